"""colora/bench/engine_profile.py and engine_report.py on hand-made traces and results: the decode
window, GPU busy time and idle share, kernels by family and name, the step thread's host time by
family adding up to the step, self times with nesting per thread; lines per family, the report's
tables and its figure."""

from __future__ import annotations

import gzip
import json

import pytest

from colora.bench.engine_profile import (
    HOST_FAMILIES,
    kernel_family,
    load_trace,
    self_times,
    summarize,
    to_text,
    union_length,
)
from colora.bench.engine_report import family_fits, line_fit, to_markdown, write_figure

DECODE = "execute_context_0(0)_generation_2(2)"


def ev(name, cat, ts, dur, pid=1, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def trace() -> list[dict]:
    return [
        ev("execute_context_2(16)_generation_0(0)", "user_annotation", 0, 90),  # prefill: outside the window
        ev("aten::embedding", "cpu_op", 10, 30),
        ev("prefill_kernel", "kernel", 50, 40, pid=0, tid=7),
        ev(DECODE, "user_annotation", 100, 40),  # the window: 100 to 200 us (the third range's start), two steps
        ev("aten::mm", "cpu_op", 105, 20),
        ev("cudaLaunchKernel", "cuda_runtime", 110, 5),
        ev("cudaStreamSynchronize", "cuda_runtime", 140, 8),  # between execute_model ranges, on the step thread
        ev("schedule: allocate_slots", "user_annotation", 148, 2),
        ev(DECODE, "user_annotation", 150, 40),
        ev("aten::mm", "cpu_op", 160, 10),
        ev(DECODE, "user_annotation", 200, 30),  # starts at the window's end: outside, and so is its child
        ev("aten::mm", "cpu_op", 205, 10),
        ev("sampler_op", "cpu_op", 120, 30, tid=2),  # another thread: in host_top, not in the step thread's time
        ev("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "kernel", 112, 20, pid=0, tid=7),
        ev("_lora_shrink_kernel", "kernel", 125, 10, pid=0, tid=8),  # overlaps the GEMM on another stream
        ev("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "kernel", 170, 10, pid=0, tid=7),
        ev("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 195, 10, pid=0, tid=7),  # runs past the window's end
        {"ph": "i", "name": "marker", "ts": 120},  # not a complete event
    ]


def complete() -> list[dict]:
    return [e for e in trace() if e.get("ph") == "X"]


def test_union_length_merges_overlaps_and_gaps():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 30), (22, 25)]) == 25
    assert union_length([(10, 20), (0, 5)]) == 15


def test_self_times_subtract_direct_children_per_thread():
    evs = [e for e in complete() if e["cat"] in ("cpu_op", "cuda_runtime") or e["name"] == DECODE]
    own = {}
    for e, us in self_times(evs):
        own.setdefault(e["name"], []).append(us)
    assert sorted(own[DECODE]) == [20.0, 20.0, 30.0]  # 40 - 20 (aten::mm), 30 - 10, 40 - 10
    assert sorted(own["aten::mm"]) == [10.0, 10.0, 15.0]  # 20 - 5 (the launch inside it), 10, 10
    assert own["cudaLaunchKernel"] == [5.0] and own["sampler_op"] == [30.0]  # tid 2: nothing nested under tid 1


@pytest.mark.parametrize("name, family", [
    ("_lora_shrink_kernel", "LoRA"), ("_lora_expand_kernel", "LoRA"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>", "attention"),
    ("kernel_unified_attention_2d", "attention"), ("void vllm::reshape_and_cache_flash_kernel<...>", "attention"),
    ("_prepare_decode_inputs_kernel", "step inputs"), ("_compute_slot_mappings_kernel", "step inputs"),
    ("_gumbel_sample_kernel", "sampling"), ("_topk_log_softmax_kernel", "sampling"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT", "GEMM"), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "GEMM"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "compiled fusions"),
    ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", "norm"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>", "activation"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "rotary"),
    ("Memcpy HtoD (Pinned -> Device)", "copies"), ("Memset (Device)", "copies"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("ncclDevKernel_SendRecv", "other"),
])
def test_kernel_families_of_real_kernel_names(name, family):
    assert kernel_family(name) == family


def test_summarize_gives_per_step_figures_over_the_decode_window():
    s = summarize(complete())
    assert s["steps"] == 2 and s["step_ms"] == pytest.approx(0.05)
    # GPU busy in [100, 200): [112, 135) + [170, 180) + [195, 200) = 38 us of 100
    assert s["gpu_busy_ms"] == pytest.approx(0.019) and s["gpu_idle_share"] == pytest.approx(0.62)
    assert s["gpu_kernel_ms"] == pytest.approx(0.025)
    assert s["kernel_families"] == {"GEMM": pytest.approx(0.015), "LoRA": pytest.approx(0.005),
                                    "copies": pytest.approx(0.005)}
    assert [(k["name"], k["calls_per_step"]) for k in s["kernels"]] == [
        ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", 1.0), ("_lora_shrink_kernel", 0.5),
        ("Memcpy DtoH (Device -> Pinned)", 0.5)]
    # the step thread: ranges' own Python 20 + 30 + 2, operators 15 + 10, a launch 5, a sync 8; untraced 10 of 100
    assert s["host_families"] == {"waiting on the GPU": pytest.approx(0.004), "CUDA launches and runtime":
                                  pytest.approx(0.0025), "operators": pytest.approx(0.0125),
                                  "Python in ranges": pytest.approx(0.026), "untraced": pytest.approx(0.005)}
    assert sum(s["host_families"].values()) == pytest.approx(s["step_ms"])
    assert s["execute_ms"] == pytest.approx(0.04)
    assert s["ranges"] == [{"name": "schedule: allocate_slots", "ms_per_step": pytest.approx(0.001),
                            "calls_per_step": 0.5}]
    assert [h["name"] for h in s["host_top"]] == [DECODE, "sampler_op", "aten::mm", "cudaStreamSynchronize",
                                                  "cudaLaunchKernel", "schedule: allocate_slots"]
    text = to_text(s, "adapters 2, batch 2")
    assert "idle 62.0% of the step" in text and "LoRA 0.0050" in text and "sampler_op" in text
    assert "untraced 0.0050" in text and "schedule: allocate_slots" in text


def test_summarize_takes_at_most_the_steps_asked_for():
    s = summarize(complete(), steps=1)  # the first two ranges: [100, 150)
    assert s["steps"] == 1 and s["step_ms"] == pytest.approx(0.05) and s["execute_ms"] == pytest.approx(0.04)
    assert s["gpu_busy_ms"] == pytest.approx(0.023)  # [112, 135)
    assert summarize(complete(), steps=5)["steps"] == 2  # only three ranges: two steps


def test_summarize_without_gpu_events_or_two_decode_steps():
    cpu = summarize([e for e in complete() if e["cat"] not in ("kernel", "gpu_memcpy")])
    assert cpu["steps"] == 2 and cpu["gpu_idle_share"] is None and cpu["kernels"] == []
    assert cpu["kernel_families"] == {} and sum(cpu["host_families"].values()) == pytest.approx(0.05)
    assert "events: none" in to_text(cpu, "t")
    assert summarize([ev("aten::mm", "cpu_op", 0, 5)]) == {"steps": 0}
    assert summarize([ev(DECODE, "user_annotation", 0, 5)]) == {"steps": 0}  # one range: no whole step
    assert "fewer than two decode steps" in to_text({"steps": 0}, "t")


def test_load_trace_reads_gzipped_and_plain_chrome_traces(tmp_path):
    doc = {"traceEvents": trace()}
    (tmp_path / "a.json").write_text(json.dumps(doc))
    with gzip.open(tmp_path / "b.pt.trace.json.gz", "wt") as f:
        json.dump(doc, f)
    for name in ("a.json", "b.pt.trace.json.gz"):
        assert len(load_trace(tmp_path / name)) == len(trace()) - 1  # the instant event dropped


def test_line_fit_recovers_a_line_and_refuses_a_slope_from_one_batch():
    f = line_fit([64, 128, 256], [2.0 + 0.01 * x for x in (64, 128, 256)])
    assert f["fixed_ms"] == pytest.approx(2.0) and f["per_request_us"] == pytest.approx(10.0)
    assert line_fit([64, 64], [1.0, 3.0]) == {"fixed_ms": 2.0, "per_request_us": None}


def _summary(k: int, batch: int) -> dict:
    """A profiled case whose LoRA kernels cost 0.1 ms per active adapter plus 2 us a request, GEMMs
    1 ms + 1 us a request, the step thread's untraced Python 0.5 ms per adapter."""
    lora, gemm, untraced = 0.1 * k + 0.002 * batch, 1.0 + 0.001 * batch, 0.5 * k
    host = dict.fromkeys(HOST_FAMILIES, 0.0) | {"operators": 1.0, "untraced": untraced}
    return {"steps": 4, "step_ms": 1.0 + untraced, "execute_ms": 1.0, "gpu_busy_ms": lora + gemm,
            "gpu_idle_share": 0.1, "gpu_kernel_ms": lora + gemm,
            "kernel_families": {"GEMM": gemm, "LoRA": lora} if k else {"GEMM": gemm},
            "host_families": host, "kernels": [], "ranges": [], "host_top": []}


def result() -> dict:
    cases = [(k, b) for k in (0, 1, 4) for b in (64, 256)]
    rows = [{"batch": b, "adapters": k, "seeded": s, "steps": 130, "ms_per_step": 2.0 + k + 0.01 * b, "wall_s": 1.0,
             "tokens_per_s": 100.0, "waiting": 0.9} for k, b in cases for s in (True, False)]
    return {"command": "colora bench engine x.toml --adapters 0 1 4 --profile",
            "environment": {"device": "NVIDIA H200", "vllm": "0.26.0", "torch": "2.11.0", "date": "today"},
            "model": "builtin:tiny", "dtype": "bfloat16", "engine_start_s": 90.0, "arm": "overlap_mps", "mps": "on",
            "max_loras": 4, "jobs": ["a", "b", "c", "d"], "ranks": [16] * 4, "tokens": 128, "prompt": 64,
            "rows": rows, "fits": [{"adapters": k, "seeded": s, "fixed_ms": 2.0 + k, "per_request_us": 10.0}
                                   for k in (0, 1, 4) for s in (True, False)],
            "profiles": [{"adapters": k, "batch": b, "summary": _summary(k, b), "file": "out/report.profile.txt"}
                         for k, b in cases] + [{"adapters": 4, "batch": 512, "summary": {"steps": 0},
                                                "file": "out/report.profile.txt"}],
            "profile_steps": 4, "profile_delay": 32}


def test_family_fits_separate_the_fixed_cost_per_adapter_from_the_cost_per_request():
    fits = {(f["family"], f["adapters"]): f for f in family_fits(result()["profiles"])}
    for k in (1, 4):
        assert fits["LoRA", k]["fixed_ms"] == pytest.approx(0.1 * k)
        assert fits["LoRA", k]["per_request_us"] == pytest.approx(2.0)
        assert fits["untraced", k]["fixed_ms"] == pytest.approx(0.5 * k)
        assert fits["untraced", k]["per_request_us"] == pytest.approx(0.0, abs=1e-9)
    assert fits["GEMM", 4]["fixed_ms"] == pytest.approx(1.0) and fits["GEMM", 0]["per_request_us"] == pytest.approx(1.0)
    assert fits["LoRA", 0]["fixed_ms"] == 0.0  # no LoRA kernels without adapters
    assert fits["profiled step", 4]["fixed_ms"] == pytest.approx(3.0)


def test_the_report_has_every_table_and_its_figure(tmp_path):
    md = to_markdown(result(), "report.png")
    assert md.startswith("# Engine decoding") and "colora bench engine x.toml --adapters 0 1 4 --profile" in md
    assert "![step time, kernel and host families](report.png)" in md
    assert "| 4 | yes | 256 | 130 | 8.56 |" in md  # a timed row: 2 + 4 + 0.01 x 256
    assert "### GPU kernel time by family, ms a step" in md and "| 1 | 256 | 0.612 | 1.256 |" in md  # LoRA, GEMM
    assert "| 4 | 64 | 0.000 | 0.000 | 1.000 | 0.000 | 2.000 |" in md  # the host families, untraced last
    assert "| 4 | 512 | 0 | - |" in md  # a case without two decode steps keeps its row
    assert "| kernels | LoRA | 0.000 + 0.00 | 0.100 + 2.00 | 0.400 + 2.00 |" in md
    assert "`report.profile.txt`" in md and "4 decode steps recorded after 32 steps" in md
    write_figure(result(), tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cpu = result() | {"profiles": []}
    assert "## Profile" not in to_markdown(cpu, None)
    write_figure(cpu, tmp_path / "cpu.png")  # no profile: the timed panel alone has data
    assert (tmp_path / "cpu.png").stat().st_size > 0
