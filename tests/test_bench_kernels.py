"""`colora bench kernels` on the CPU: its tables, its timing sums, its tuning search and the compile
check of every tuning candidate.

    pytest tests/test_bench_kernels.py -q            (CPU: conftest.py sets TRITON_INTERPRET=1 without a GPU)
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV, K, LORA_TOL, lora_case, lora_grads, rel_err


def test_bench_kernels_reduce_writes_its_table(tmp_path):
    """`colora bench kernels --quick --only reduce` on the CPU: one row per reduce case with both
    launches timed, the JSON and the Markdown table written."""
    import json

    from colora.bench.kernels import main

    assert main(["--quick", "--only", "reduce", "--out", str(tmp_path / "k")]) == 0
    rows = json.loads((tmp_path / "k.json").read_text())["reduce"]
    assert [r["case"] for r in rows] == ["dB tiny", "dA tiny packed"]
    assert all(r["before_us"] > 0 and r["now_us"] > 0 and r["shape_before"][1] == 1 for r in rows)
    md = (tmp_path / "k.md").read_text()
    assert "## Segment reduction" in md and "| dB tiny | 48 | 16 | 4 x 40 |" in md


def test_bench_kernels_lora_table_on_the_cpu(tmp_path):
    """`colora bench kernels --quick --only lora` on the CPU: every row timed, no CUDA-graph timing
    there ('-' in the table)."""
    import json

    from colora.bench.kernels import main

    assert main(["--quick", "--only", "lora", "--out", str(tmp_path / "k")]) == 0
    rows = json.loads((tmp_path / "k.json").read_text())["lora"]
    # (run on the GPU host too, where the rows have their CUDA-graph timing)
    graphs = torch.cuda.is_available()
    assert rows and all(r["triton_ms"] > 0 and r["loop_ms"] > 0 and (r["graph_ms"] is not None) == graphs for r in rows)
    md = (tmp_path / "k.md").read_text()
    assert "| x bound (graph) |" in md and md.count(" | - | - | - |") == (0 if graphs else len(rows))


def test_bench_kernels_targets_read_the_graph_timing_where_every_row_has_one():
    from colora.bench.kernels import _targets

    rows = [{"shape": "q", "rank": 16, "jobs": 8, "tokens_per_job": 24576, "x_bound": 1.65, "x_bound_graph": 1.21},
            {"shape": "o", "rank": 16, "jobs": 8, "tokens_per_job": 24576, "x_bound": 1.25, "x_bound_graph": 1.12},
            {"shape": "q", "rank": 16, "jobs": 8, "tokens_per_job": 2048, "speedup": 3.7}]
    text = "\n".join(_targets(rows))
    assert "24576 tokens/job (x_bound_graph): q r16: 1.21x bound, o r16: 1.12x bound" in text
    assert "2048 tokens/job (speedup): q r16: 3.7x faster" in text
    rows[1]["x_bound_graph"] = None  # one row without a graph: the event timing for all
    assert "24576 tokens/job (x_bound): q r16: 1.65x bound, o r16: 1.25x bound" in "\n".join(_targets(rows))


def test_bench_kernels_base_plus_lora_table_on_the_cpu(tmp_path):
    """`colora bench kernels --quick --only add_to`: the base projection alone and the three ways of
    adding the LoRA to it (separate, add_to, the base inside the op), each timed, in the table."""
    import json

    from colora.bench.kernels import main

    assert main(["--quick", "--only", "add_to", "--out", str(tmp_path / "k")]) == 0
    (row,) = json.loads((tmp_path / "k.json").read_text())["add_to"]
    assert all(row[k] > 0 for k in ("base_ms", "separate_ms", "add_to_ms", "base_in_op_ms"))
    assert row["lora_overhead_base_in_op"] == pytest.approx(row["base_in_op_ms"] / row["base_ms"] - 1)
    md = (tmp_path / "k.md").read_text()
    assert "| base in op ms |" in md and "| tiny | 4 x 48 |" in md


def test_kernel_times_sum_each_kernel_per_call_largest_first():
    from types import SimpleNamespace as E

    from colora.bench.measure import kernel_times

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [E(name="lora_shrink_kernel", device_type=cuda, device_time_total=30.0),
              E(name="lora_expand_kernel", device_type=cuda, device_time_total=50.0),
              E(name="lora_shrink_kernel", device_type=cuda, device_time_total=40.0),
              E(name="aten::mm", device_type=cpu, device_time_total=999.0),  # a host op: its kernels count apart
              E(name="Optimizer.step", device_type=cuda, device_time_total=500.0, is_user_annotation=True)]
    assert list(kernel_times(events, calls=2).items()) == [("lora_shrink_kernel", 35.0), ("lora_expand_kernel", 25.0)]


def test_kernel_breakdown_table_in_the_markdown():
    from colora.bench.kernels import to_markdown

    row = {"shape": "k/v", "d_in": 1024, "d_out": 1024, "rank": 16, "jobs": 8, "tokens_per_job": 24576,
           "tokens": 196608, "triton_ms": 1.1, "fused_dy": True, "other_fuse_ms": 1.0, "loop_ms": 4.8,
           "speedup": 4.4, "TFLOPs": 34.0, "peak_share": 0.05, "bound_GBps": 1800.0, "x_bound": 2.3,
           "graph_ms": 0.638, "graph_GBps": 3150.0, "x_bound_graph": 1.33,
           "kernels_us": {"lora_shrink_kernel": 300.0, "lora_expand_kernel": 250.0}, "x_bound_kernels": 1.15,
           "fused_expand": True, "graph_ms_expand_other": 0.7004, "kernels_us_expand_other": 612.4,
           "cublas_graph_ms": 0.709, "x_bound_cublas": 1.49}
    result = {"command": "colora bench kernels", "calibration": {"copy_GBps": 4200.0, "bf16_matmul_TFLOPs": 800.0},
              "environment": {"device": "H200", "torch": "2.11", "triton": "3.6", "date": "today"},
              "lora": [row, dict(row, rank=64, fused_expand=False, graph_ms_expand_other=None,
                                 kernels_us_expand_other=None, cublas_graph_ms=None, x_bound_cublas=None)],
              "add_to": [], "logsoftmax": []}
    md = to_markdown(result)
    assert "### Kernel by kernel at 8 jobs x 24k tokens" in md
    assert ("| k/v | 16 | 550 | 1.15 | 638 | fused | 612 | 700 | 709 | 1.49 | lora_shrink_kernel 300, "
            "lora_expand_kernel 250 |") in md
    assert "| k/v | 64 | 550 | 1.15 | 638 | separate | - | - | - | - | lora_shrink_kernel 300, lora_expand_kernel 250 |" in md
    assert "24576 tokens/job (x_bound_graph): k/v r16: 1.33x bound" in md


def test_dense_lora_products_are_one_adapters_forward_and_backward():
    """The benchmark's cuBLAS ceiling computes what it stands for: y = x A^T B^T and autograd's dx, dA,
    dB of it for an incoming dy (float64, so the two orders of summation agree to rounding)."""
    from colora.bench.kernels import dense_lora_products

    g = torch.Generator().manual_seed(5)
    x, A, B, dy = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((37, 24), (8, 24), (40, 8), (37, 40)))
    leaves = [t.clone().requires_grad_() for t in (x, A, B)]
    y_ref = leaves[0] @ leaves[1].t() @ leaves[2].t()
    want = (y_ref.detach(), *torch.autograd.grad(y_ref, leaves, dy))
    got = dense_lora_products(x, A, B, dy)
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, want):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12), name


def test_launch_parameters_reach_the_launches_and_keep_the_results():
    """The tuner's launch parameters (colora/bench/tune.py, grouped_lora's launch=): other tile sizes, warps,
    stages and chunks for every launcher give the same gradients within the table's tolerance; the expand's
    128-row chunks and the sgrad's 512-row chunks are the ones built; unknown kernels or parameters are refused."""
    launch = {"shrink": {"block_m": 128, "block_k": 32, "warps": 8, "stages": 2},
              "dy_pass": {"block_m": 128, "block_k": 16, "warps": 4, "stages": 2},
              "expand": {"block_t": 32, "block_n": 16, "warps": 8, "stages": 3, "chunk": 128},
              "sgrad": {"block_t": 32, "block_n": 16, "warps": 8, "stages": 2, "chunk": 512}}
    for fuse in (True, False):
        case = lora_case([300, 0, 170, 9], [16, 8, 0, 4], 40, 24, torch.bfloat16, DEV, seed=31)
        want = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse)
        got = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse, launch=launch)
        assert {128, 512} <= set(case.meta._tiles)
        for key in ("y", "dx", "dA", "dB"):
            assert rel_err(got[key], want[key]) <= LORA_TOL[torch.bfloat16], (fuse, key)
    for bad in ({"expand": {"block_k": 64}}, {"reduce": {"block_n": 64}}):
        with pytest.raises(ValueError, match="tunable"):
            lora_grads(K.grouped_lora, case, backend="triton", launch=bad)


def test_bench_kernels_tune_searches_every_launcher_on_the_cpu(tmp_path):
    """`colora bench kernels --quick --only tune` through the interpreter: every launcher's candidates
    tried on the tiny problem (plumbing only: the CPU's times mean nothing), the best of each and all
    of them together recorded, and the tables written."""
    import json

    from colora.kernels.lora.policy import TUNABLE

    from colora.bench.kernels import main
    from colora.bench.tune import SEARCHED, candidates

    assert main(["--quick", "--only", "tune", "--out", str(tmp_path / "k")]) == 0
    (row,) = json.loads((tmp_path / "k.json").read_text())["tune"]
    assert row["problem"] == "tiny r16" and row["default_us"] > 0 and row["combined_us"] > 0
    assert [t["kernel"] for t in row["trials"]] == [k for k in SEARCHED for _ in candidates(k, quick=True)]
    assert all(t["error"] is None and t["us"] > 0 for t in row["trials"])
    assert set(row["best"]) <= set(TUNABLE)
    md = (tmp_path / "k.md").read_text()
    assert "## Launch parameters searched" in md and "| tiny r16 |" in md


def test_compile_check_covers_every_tuning_candidate():
    """`python -m colora.bench.compile_check --tune` compiles each of colora/bench/tune.py's candidates
    (ranks 16 and 64; the fused dy pass with its atomic dB partials, the default) with its block sizes,
    warps and stages."""
    from colora.bench.compile_check import tune_variants
    from colora.bench.tune import candidates

    got = list(tune_variants())
    for R in (16, 64):
        for kernel in ("shrink", "dy_pass", "expand", "sgrad"):
            mine = [v for v in got if v[0].startswith(f"tune {kernel} R{R} ")]
            assert len(mine) == len(candidates(kernel, quick=False))
            for (_, _, _, consts, _, _, warps, stages), cfg in zip(mine, candidates(kernel, quick=False)):
                assert (warps, stages) == (cfg["warps"], cfg["stages"])
                assert all(consts[c] == cfg[k] for k, c in (("block_m", "BLOCK_M"), ("block_k", "BLOCK_K"),
                                                            ("block_n", "BLOCK_N"), ("block_t", "BLOCK_T"),
                                                            ("block_n2", "BLOCK_N2")) if k in cfg)
                assert consts.get("FUSE_EXPAND", kernel not in ("shrink", "dy_pass"))  # as launched
