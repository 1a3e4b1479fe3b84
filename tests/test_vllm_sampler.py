"""Seeded sampling in one launch (colora/kernels/noise.py, colora/vllm_sampler.py).

    pytest tests/test_vllm_sampler.py -q           (CPU: the kernel through Triton's interpreter)
    pytest tests/test_vllm_sampler.py -m gpu -q    (the H200: the compiled kernel, CUDA generators)

What must hold: the kernel equals the torch reference; a request's draws depend on its seed and how
many tokens it has drawn, never on its row or its batch; a draw vLLM discards and rewinds comes back
the same; the tokens drawn follow the probabilities; a generator without an offset takes vLLM's loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from colora.kernels.testing import interpreted_kernels

K = interpreted_kernels()  # the noise kernel interpreted on the CPU
from colora.kernels import noise  # noqa: E402  (after the interpreter is in place)
from colora import vllm_sampler  # noqa: E402

CUDA = torch.cuda.is_available()


class OffsetGenerator:
    """A generator as vLLM's GPU worker holds one: a seed and a Philox offset (the CPU's torch
    generator has no offset)."""

    def __init__(self, seed: int, offset: int = 0):
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        assert offset % 4 == 0, "CUDA generators take offsets in multiples of 4"
        self.offset = offset


def _generator(seed: int, device: torch.device):
    if device.type == "cuda":
        return torch.Generator(device).manual_seed(seed)
    return OffsetGenerator(seed)


@pytest.mark.parametrize("V", [1, 7, 2048, 3001])
def test_kernel_equals_reference(V):
    dev = torch.device("cuda" if CUDA else "cpu")
    rows = np.array([5, 0, 3])
    keys = noise.mix_keys([11, 11, 2**40 + 3], [0, 1, 999])
    got = noise.seeded_exponential_(torch.full((6, V), -1.0, device=dev), rows, keys, "triton")
    ref = noise.seeded_exponential_(torch.full((6, V), -1.0, device=dev), rows, keys, "torch")
    # the same integer hash; only log may differ in its last bit between libm and the kernel
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-7)
    untouched = [1, 2, 4]
    assert (got[untouched] == -1).all(), "rows without a key must be left as they were"
    assert (got[rows] > 0).all() and torch.isfinite(got).all()


def test_noise_is_exponential_and_keys_differ():
    q = noise.seeded_exponential_(torch.empty(3, 50_000), np.arange(3), noise.mix_keys([7, 7, 8], [0, 1, 0]), "torch")
    for row in q:
        assert stats.kstest(row.numpy(), "expon").pvalue > 1e-3
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    assert abs(np.corrcoef(q[0].numpy(), q[1].numpy())[0, 1]) < 0.02  # neighbouring counters unrelated


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="fp32"):
        noise.seeded_exponential_(torch.empty(2, 4, dtype=torch.float16), np.array([0]), noise.mix_keys([1], [0]))
    with pytest.raises(ValueError, match="rows must lie"):
        noise.seeded_exponential_(torch.empty(2, 4), np.array([2]), noise.mix_keys([1], [0]))
    with pytest.raises(ValueError, match="2 rows but 1 keys"):
        noise.seeded_exponential_(torch.empty(2, 4), np.array([0, 1]), noise.mix_keys([1], [0]))


def _draws(device: torch.device, batches: list[dict[int, int]], V: int, steps: int) -> dict[int, list[int]]:
    """Sample `steps` tokens for every seeded request; batches: one {row: seed} per batch, each
    batch its own (uniform) probabilities. Returns seed -> tokens."""
    out: dict[int, list[int]] = {}
    for rows in batches:
        n = max(rows) + 1
        gens = {r: _generator(s, device) for r, s in rows.items()}
        for _ in range(steps):
            probs = torch.full((n, V), 1.0 / V, device=device)
            tok = vllm_sampler.random_sample(probs, gens)
            for r, s in rows.items():
                out.setdefault(s, []).append(int(tok[r]))
    return out


def _devices():
    return [torch.device("cpu")] + ([pytest.param(torch.device("cuda"), marks=pytest.mark.gpu)] if CUDA else [])


@pytest.mark.parametrize("device", _devices())
def test_a_requests_draws_do_not_depend_on_its_batch(device):
    V = 4096  # uniform probabilities: the token is the row's noise argmax, 12 bits per draw
    alone = _draws(device, [{0: 101}, {0: 202}], V, steps=6)
    together = _draws(device, [{7: 202, 2: 101, 0: 303, 4: 404}], V, steps=6)  # other rows, other company
    assert together[101] == alone[101] and together[202] == alone[202]
    assert together[101] != together[202]


@pytest.mark.parametrize("device", _devices())
def test_a_rewound_draw_comes_back_the_same(device):
    g = _generator(5, device)
    probs = lambda: torch.full((1, 4096), 1 / 4096, device=device)  # noqa: E731
    first = int(vllm_sampler.random_sample(probs(), {0: g})[0])
    assert g.get_offset() == vllm_sampler.DRAW_OFFSET
    g.set_offset(g.get_offset() - 4)  # what vLLM does to a partial prefill's discarded token
    assert int(vllm_sampler.random_sample(probs(), {0: g})[0]) == first
    assert int(vllm_sampler.random_sample(probs(), {0: g})[0]) != first  # the next draw moves on


@pytest.mark.parametrize("device", _devices())
def test_tokens_follow_the_probabilities(device):
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0], device=device)
    n = 4000
    gens = {i: _generator(1000 + i, device) for i in range(n)}
    tok = vllm_sampler.random_sample(p.expand(n, -1).contiguous(), gens).cpu().numpy()
    counts = np.bincount(tok, minlength=6)
    assert counts[5] == 0, "a zero-probability token was drawn"
    assert stats.chisquare(counts[:5], (p[:5] * n).cpu().numpy()).pvalue > 1e-3


def test_unseeded_rows_are_sampled_too():
    gens = {1: OffsetGenerator(9)}
    probs = torch.zeros(3, 5)
    probs[:, 2] = 1.0  # every row certain of token 2, seeded or not
    assert vllm_sampler.random_sample(probs, gens).tolist() == [2, 2, 2]


def test_a_cpu_generator_takes_vllms_loop():
    probs = torch.softmax(torch.randn(3, 64, generator=torch.Generator().manual_seed(0)), -1)
    ours = vllm_sampler.random_sample(probs.clone(), {0: torch.Generator().manual_seed(3), 2: torch.Generator().manual_seed(4)})
    vllms = vllm_sampler._vllm_random_sample(probs.clone(), {0: torch.Generator().manual_seed(3), 2: torch.Generator().manual_seed(4)})
    assert ours[[0, 2]].tolist() == vllms[[0, 2]].tolist()


def test_importing_the_extension_installs_the_sampler():
    from vllm.v1.sample.ops import topk_topp_sampler

    assert topk_topp_sampler.random_sample is vllm_sampler.random_sample
    assert vllm_sampler.SeededSampling().colora_seeded_sampling()
