"""The frozen base projection with the LoRA's expand in its epilogue (lora_ops.lora_base_gemm, one Triton GEMM)
against what the op does now (lora_expand writes the LoRA's part of y, then cuBLAS adds x W^T with beta = 1) and
against cuBLAS's x W^T alone, at the trainer's shapes: each slice of its four calls a layer (q, k/v, o, gate/up,
down) over 8 jobs x TPJ tokens (default 6,144: the 49,152-token micro-batch), rank RANK (default 16). h comes from
the shrink in every variant (not timed: both paths need it). CUDA-graph microseconds (do_bench_cudagraph), every
variant of a shape in one process. Run from the repository root on the H200 after scripts/h200.sh made its shim:
    PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/eighteenth/base_gemm_probe.py [--quick]
OWN_ONLY=1: the launcher's own tiles only. Each shape first checks its first expand + cuBLAS call against fp32.
(--quick: tiny shapes on the CPU's interpreter, plumbing only.)
"""
import json
import os
import sys

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from colora.kernels.bench import calibrate  # noqa: E402
from colora.kernels.lora_meta import LoRABatchMeta  # noqa: E402
from colora.kernels.lora_ops import h_width, launch_overrides, lora_base_gemm, lora_expand, lora_shrink  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cal = calibrate(dev, QUICK)
J, TPJ, R = (2, 48, 16) if QUICK else (8, int(os.environ.get("TPJ", "6144")), int(os.environ.get("RANK", "16")))
SHAPES = {"tiny": (64, 96)} if QUICK else {
    "q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072), "down": (3072, 1024)}
CONFIGS = {"own": {}} if QUICK or os.environ.get("OWN_ONLY") else {  # BLOCK_M x N x K, warps, stages
    "own": {},
    "128x128x64 w8 s3": {"block_m": 128, "block_n": 128, "block_k": 64, "warps": 8, "stages": 3},
    "128x128x64 w8 s4": {"block_m": 128, "block_n": 128, "block_k": 64, "warps": 8, "stages": 4},
    "128x128x64 w4 s4": {"block_m": 128, "block_n": 128, "block_k": 64, "warps": 4, "stages": 4},
    "128x256x64 w8 s4": {"block_m": 128, "block_n": 256, "block_k": 64, "warps": 8, "stages": 4},
    "256x128x64 w8 s3": {"block_m": 256, "block_n": 128, "block_k": 64, "warps": 8, "stages": 3},
}


def graph_us(fn):
    if dev.type != "cuda":
        fn()
        return float("nan")
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


T = J * TPJ
seg = [j * TPJ for j in range(J + 1)]
meta = LoRABatchMeta.build(seg, [j * R for j in range(J + 1)], [2.0] * J, device=dev)
dtype = torch.bfloat16
rows = []
print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; copy {cal['copy_GBps']:.0f} GB/s, "
      f"bf16 matmul {cal['bf16_matmul_TFLOPs']:.0f} TFLOP/s; {J} jobs x {TPJ} tokens, rank {R}", flush=True)
for name, (d_in, d_out) in SHAPES.items():
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(T, d_in, device=dev, generator=g).to(dtype)
    W = (torch.randn(d_out, d_in, device=dev, generator=g) / d_in**0.5).to(dtype)
    A = (torch.randn(J * R, d_in, device=dev, generator=g) / d_in**0.5).to(dtype)
    B = (torch.randn(d_out, J * R, device=dev, generator=g) / R**0.5).to(dtype)
    h = x.new_zeros((T, h_width(meta, 1)))
    lora_shrink(x, A, meta, h)
    out = x.new_empty((T, d_out))
    flop = 2 * T * d_in * d_out
    print(f"\n{name} {d_in}->{d_out}: base GEMM {flop / 1e9:.0f} GFLOP", flush=True)

    def cublas():
        torch.mm(x, W.t(), out=out)

    def expand_then_cublas():
        lora_expand(h, B, meta, out, scale=True)
        out.addmm_(x, W.t())

    # the first expand + cuBLAS call at this shape, before any other GEMM of it (base_gemm's call saw that one's
    # output differ from every later call's at down)
    expand_then_cublas()
    first_out = out.clone()
    variants = {"cuBLAS x W^T alone": cublas, "expand, then cuBLAS (beta 1)": expand_then_cublas}
    for cname, cfg in CONFIGS.items():
        def fused(cfg=cfg):
            with launch_overrides(base_gemm=cfg):
                lora_base_gemm(x, W, h, B, meta, out, scale=True)
        variants[f"fused {cname}"] = fused
    ref = x.float() @ W.float().t()  # fp32 (cuBLAS's own products), then each job's LoRA part
    for j in range(J):
        ref[seg[j]:seg[j + 1]] += 2.0 * (h[seg[j]:seg[j + 1], :R].float() @ B[:, j * R:(j + 1) * R].float().t())
    first = ((first_out.float() - ref).abs().max() / ref.abs().max()).item()
    print(f"  first expand + cuBLAS call: max rel diff to fp32 {first:.1e}", flush=True)
    rows.append({"shape": name, "variant": "first expand, then cuBLAS", "rel_diff": first})
    base_us = None
    for vname, fn in variants.items():
        try:
            fn()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item() if "alone" not in vname else float("nan")
            assert err < 2e-2 or "alone" in vname, f"{vname}: {err}"
            t = graph_us(fn)
        except Exception as e:  # a configuration that does not compile or fit: recorded
            print(f"  {vname:32s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            rows.append({"shape": name, "variant": vname, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        base_us = base_us or t
        print(f"  {vname:32s} {t:8.1f} us  {flop / t / 1e6:6.0f} TFLOP/s  x cuBLAS alone {t / base_us:5.3f}  "
              f"max rel diff to fp32 {err:.1e}", flush=True)
        rows.append({"shape": name, "variant": vname, "graph_us": t, "tflops": flop / t / 1e6,
                     "x_cublas_alone": t / base_us, "rel_diff": err})
    del x, W, A, B, h, out, ref

out_dir = os.environ.get("OUT")
if out_dir:
    with open(os.path.join(out_dir, "base_gemm_probe.json"), "w") as f:
        json.dump({"calibration": cal, "jobs": J, "tokens_per_job": TPJ, "rank": R, "rows": rows}, f, indent=1)
