"""An asample body -> the backend's SampleCall, with every check of its content (errors name the field).

Tinker's `stop`: None stops at EOS only; [] stops at nothing, not even EOS; a string or a list of
strings stops once the completion contains one (EOS still stops); a list of ints stops at any of those
tokens (EOS still stops). The stopping tokens are returned with the completion. max_tokens defaults to
what the context leaves after the prompt. Top-k / target / alternative-token prompt log-probs and
`prompt_logprobs_last_n` are not served yet: a request asking for them fails, naming the field.
`record_stability_info` is the sampler's business (colora/service/samplers.py records the sample).

Every setting is checked against what the engine accepts before it goes there (a setting vLLM refuses
inside the engine fails more than its own request): temperature in [0, MAX_TEMPERATURE], top_p in
(0, 1], top_k -1 or at least 1 (one above the vocabulary means no limit), at most MAX_STOP stop
entries, each string non-empty and at most MAX_STOP_CHARS characters, each token id in the vocabulary.
Any int is a seed: it is reduced to the engine's 63 bits. Token ids are checked as Python ints, before
numpy, so an id of 2**63 or more is refused by name instead of overflowing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colora.config import MAX_TEMPERATURE
from colora.service import schemas
from colora.service.backend import Capabilities, SampleCall, Stop
from colora.service.wire import InputError, check_tokens

MAX_STOP = 64  # stop strings or stop token ids of one request
MAX_STOP_CHARS = 1024  # characters of one stop string
SEED_RANGE = 1 << 63  # seeds are reduced modulo this (vLLM takes a 64-bit signed seed)


def build_sample_call(body: schemas.Sample, sampler: Any, caps: Capabilities, max_num_samples: int,
                      seed: int) -> SampleCall:
    """`seed` is used when the request sends none (derived from the sampling session and seq_id)."""
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name):
            raise InputError(f"{name} ({getattr(body, name)}) is not supported by this server; send 0")
    for name in ("target_prompt_logprobs", "prompt_logprobs_last_n"):
        if getattr(body, name) is not None:
            raise InputError(f"{name} is not supported by this server; leave it unset")
    if not 1 <= body.num_samples <= max_num_samples:
        raise InputError(f"num_samples ({body.num_samples}) must be from 1 to this server's max_num_samples "
                         f"({max_num_samples})")
    parts = []
    for j, c in enumerate(body.prompt.chunks):
        if c.type != "encoded_text":
            raise InputError(f"prompt.chunks[{j}] is a {c.type!r} chunk; this server takes encoded_text only")
        if len(parts) + len(c.tokens) > caps.max_context:
            raise InputError(f"prompt has more than the model's max context ({caps.max_context}) tokens")
        _check_ids(c.tokens, f"prompt.chunks[{j}].tokens", caps.vocab_size)
        parts.extend(c.tokens)
    prompt = np.asarray(parts, np.int64)
    check_tokens(prompt, "prompt", caps)
    p = body.sampling_params
    room = caps.max_context - len(prompt)
    max_tokens = room if p.max_tokens is None else p.max_tokens
    if max_tokens < 1 or max_tokens > room:
        raise InputError(f"sampling_params.max_tokens ({max_tokens}) must be from 1 to {room}: the prompt's "
                         f"{len(prompt)} tokens leave that much of the model's context ({caps.max_context})")
    if not 0 <= p.temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise InputError(f"sampling_params.temperature ({p.temperature}) must be in [0, {MAX_TEMPERATURE}] "
                         "(the engine's range)")
    if not 0 < p.top_p <= 1:
        raise InputError(f"sampling_params.top_p ({p.top_p}) must be in (0, 1]")
    if p.top_k == 0 or p.top_k < -1:
        raise InputError(f"sampling_params.top_k ({p.top_k}) must be -1 (no limit) or at least 1")
    return SampleCall(sampler=sampler, prompt=prompt, num_samples=body.num_samples, max_tokens=max_tokens,
                      temperature=float(p.temperature), top_k=-1 if p.top_k >= caps.vocab_size else p.top_k,
                      top_p=float(p.top_p), seed=(p.seed % SEED_RANGE) if p.seed is not None else seed,
                      stop=_stop(p.stop, caps), prompt_logprobs=bool(body.prompt_logprobs))


def _check_ids(ids: list[int], where: str, vocab: int) -> None:
    """Token ids as Python ints (any size) in [0, vocab)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InputError(f"{where} has token id {bad}, outside the vocabulary [0, {vocab})")


def _stop(stop, caps: Capabilities) -> Stop:
    if stop is None:
        return Stop(eos=True)
    if isinstance(stop, str):
        stop = [stop]
    if not stop:
        return Stop(eos=False)
    if len(stop) > MAX_STOP:
        raise InputError(f"sampling_params.stop has {len(stop)} entries; this server takes at most {MAX_STOP}")
    if all(isinstance(s, str) for s in stop):
        if any(not s for s in stop):
            raise InputError("sampling_params.stop has an empty string")
        long = next((s for s in stop if len(s) > MAX_STOP_CHARS), None)
        if long is not None:
            raise InputError(f"sampling_params.stop has a string of {len(long)} characters; at most {MAX_STOP_CHARS}")
        return Stop(eos=True, strings=tuple(stop))
    ids = [int(s) for s in stop]
    _check_ids(ids, "sampling_params.stop", caps.vocab_size)
    return Stop(eos=True, token_ids=tuple(ids))
