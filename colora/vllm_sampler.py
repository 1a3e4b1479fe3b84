"""A vLLM worker extension that samples every seeded request of a step in one kernel launch.

colora gives every rollout request a seed of its own (`derive_seed(run, job, step, "sample", ...)`),
so a job's samples do not depend on which other jobs share the engine. vLLM draws a seeded request's
noise with that request's torch.Generator, one launch per request per decoding step; with the 180-250
requests an 8-job engine has in flight that loop is a large part of each step's host time, and under
MPS each of those launches queues behind the trainer's kernels. This module replaces vLLM's
`random_sample` with `colora.kernels.noise`: one launch for all seeded rows, each row's noise a hash of
(its generator's seed, how many tokens it has drawn).

The count is kept where vLLM keeps it, in the CUDA generator's Philox offset: each draw advances it by
4, as one of vLLM's own draws does, so vLLM's rewind of a discarded draw (a partial prefill's token:
`gen.set_offset(gen.get_offset() - 4)`) rewinds ours too. A generator without an offset (the CPU's)
takes vLLM's own loop.

vLLM imports this module in its worker process when the engine is built with
`worker_extension_cls="colora.vllm_sampler.SeededSampling"` (colora/engine.py does with
COLORA_VLLM_SAMPLER=colora; not the default: on the H200 with vLLM 0.26 the engine's decode step was
no faster with it, 9.60 against 9.33 ms at 256 requests, and vLLM's profile there shows its own
seeded sampling as one `_gumbel_sample_kernel` launch a step: reports/h200/ninth/engine); the import
installs the sampler. The draws are a different random stream from vLLM's, equally exact in distribution (the
exponential race, on 23-bit uniforms), and reproducible from the seed.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.ops import topk_topp_sampler as _vllm_sampler

from .kernels.noise import mix_keys, seeded_exponential_

DRAW_OFFSET = 4  # Philox offset one seeded draw takes; vLLM rewinds a discarded draw by the same
_vllm_random_sample = getattr(_vllm_sampler.random_sample, "vllm_random_sample", _vllm_sampler.random_sample)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator],
                  use_fp64_gumbel: bool = False) -> torch.Tensor:
    """vLLM's `random_sample` with the seeded rows' noise in one launch. probs: fp32 [N, V];
    generators: row -> that request's generator. Returns the sampled token ids, int64 [N]."""
    if not generators or use_fp64_gumbel or probs.dtype != torch.float32:
        return _vllm_random_sample(probs, generators, use_fp64_gumbel)
    gens = list(generators.values())
    try:
        offsets = np.array([g.get_offset() for g in gens], dtype=np.int64)
    except RuntimeError:  # "CPU Generator does not use offset"
        return _vllm_random_sample(probs, generators, use_fp64_gumbel)
    seeds = np.array([g.initial_seed() for g in gens], dtype=np.uint64)
    for g, off in zip(gens, offsets.tolist()):
        g.set_offset(off + DRAW_OFFSET)
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()  # the unseeded rows, from the device's default generator as vLLM does
    rows = np.fromiter(generators.keys(), dtype=np.int64, count=len(gens))
    seeded_exponential_(q, rows, mix_keys(seeds, offsets // DRAW_OFFSET))
    return _vllm_sampler.sample_with_exponential_noise(probs, q)


random_sample.vllm_random_sample = _vllm_random_sample  # type: ignore[attr-defined]


def install() -> None:
    """Make vLLM's sampler (in this process) call `random_sample`. Idempotent."""
    _vllm_sampler.random_sample = random_sample


def installed() -> bool:
    return _vllm_sampler.random_sample is random_sample


class SeededSampling:
    """The worker extension vLLM mixes into its worker class; its import installs the sampler."""

    def colora_seeded_sampling(self) -> bool:
        """Whether this worker samples seeded requests through colora (LLM.collective_rpc)."""
        return installed()


install()
