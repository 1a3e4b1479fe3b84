"""Can Triton's Hopper GEMM (tensor descriptors: TMA loads; a persistent loop; automatic warp specialisation)
come close enough to cuBLAS for the LoRA's expand in the base GEMM's epilogue to pay? At the trainer's slices
(8 jobs x TPJ tokens, default 6,144; rank RANK, default 16), CUDA-graph microseconds, one process:
  cuBLAS x W^T alone; expand then cuBLAS (beta 1: what the op does); lora_base_gemm (the eighteenth's fused
  kernel, pointer loads); `desc`: x W^T alone on descriptors (uniform row tiles); `desc fused`: the same with the
  LoRA's part in the epilogue (the LoRA's row tiles, one job's each), each with warp specialisation off and on.
Run from the repository root on the H200 after scripts/h200.sh made its shim:
    PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/nineteenth/ws_probe.py [--quick]
(--quick: tiny shapes on the CPU's interpreter, plumbing only.)  CONFIGS=a,b limits the tile configurations.
"""
import json
import os
import sys

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from colora.kernels.bench import calibrate  # noqa: E402
from colora.kernels.lora_kernels import _dot, _tile_of  # noqa: E402
from colora.kernels.lora_meta import LoRABatchMeta  # noqa: E402
from colora.kernels.lora_ops import h_width, lora_base_gemm, lora_expand, lora_shrink  # noqa: E402


@triton.jit
def desc_gemm_kernel(x_ptr, wb_ptr, h_ptr, w_ptr, y_ptr,
                     tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, scale_ptr,
                     T, N, K, R_total, n_row_tiles, stride_hm, stride_wn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                     NUM_SMS: tl.constexpr, LORA: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr,
                     PRECISION: tl.constexpr):
    """y = x wb^T (+ s_j h_j B_j^T where LORA): persistent over [BLOCK_M, BLOCK_N] tiles; x and wb through TMA
    descriptors; row tiles uniform (LORA off) or the LoRA's (one job's rows, LORA on: y stored through masked
    pointers, as a tile may end inside the tensor at its job's last row)."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(wb_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[T, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    h_desc = tl.make_tensor_descriptor(h_ptr, shape=[T, BLOCK_R], strides=[stride_hm, 1],
                                       block_shape=[BLOCK_M, BLOCK_R])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, R_total], strides=[stride_wn, 1],
                                       block_shape=[BLOCK_N, BLOCK_R])
    start = tl.program_id(0)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = n_row_tiles * n_tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_c = start - NUM_SMS
    for tile in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m = tile // n_tiles_n
        pid_n = tile % n_tiles_n
        if LORA:
            row0 = tl.load(tile_row_ptr + pid_m)
        else:
            row0 = pid_m * BLOCK_M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([row0, ki * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = _dot(a, b.T, acc, PRECISION)
        tile_c += NUM_SMS
        pid_m = tile_c // n_tiles_n
        pid_n = tile_c % n_tiles_n
        if LORA:
            job, row0, row_end, r0, r = _tile_of(tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, pid_m,
                                                 BLOCK_M)
            # h's lanes past r_j are zero (h_width's padding), so B's lanes past r_j (the next job's) add nothing:
            # both come through descriptors (pointer loads cannot go to the warp-specialised producer)
            ht = h_desc.load([row0, 0])
            wt = w_desc.load([pid_n * BLOCK_N, r0])
            s = tl.load(scale_ptr + job)
            acc = _dot(ht, wt.T, acc / s, PRECISION) * s
            rows = row0 + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=(rows < row_end)[:, None])
        else:
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))


dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
NUM_SMS = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
cal = calibrate(dev, QUICK)
J, TPJ, R = (2, 48, 16) if QUICK else (8, int(os.environ.get("TPJ", "6144")), int(os.environ.get("RANK", "16")))
SHAPES = {"tiny": (64, 96)} if QUICK else {
    "q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072), "down": (3072, 1024)}
CONFIGS = {  # BLOCK_M x N x K, warps, stages, warp specialisation (Hopper's pass wants 4 warps: 3 warp groups)
    "128x256x64 w8 s3": (128, 256, 64, 8, 3, False), "128x256x64 w8 s4": (128, 256, 64, 8, 4, False),
    "128x128x64 w8 s4": (128, 128, 64, 8, 4, False), "ws 128x256x64 w4 s3": (128, 256, 64, 4, 3, True),
    "ws 128x128x64 w4 s4": (128, 128, 64, 4, 4, True), "ws 128x128x64 w4 s5": (128, 128, 64, 4, 5, True),
    "ws 128x256x32 w4 s4": (128, 256, 32, 4, 4, True)}
if QUICK:
    CONFIGS = {"tiny": (16, 32, 32, 4, 2, False), "ws tiny": (16, 32, 32, 4, 2, True)}
if os.environ.get("CONFIGS"):
    CONFIGS = {k: v for i, (k, v) in enumerate(CONFIGS.items()) if str(i) in os.environ["CONFIGS"].split(",")}


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
print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; triton {triton.__version__}; copy "
      f"{cal['copy_GBps']:.0f} GB/s, bf16 matmul {cal['bf16_matmul_TFLOPs']:.0f} TFLOP/s; {J} jobs x {TPJ} "
      f"tokens, rank {R}", flush=True)
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
    base = x.float() @ W.float().t()
    ref = base.clone()
    for j in range(J):
        ref[seg[j]:seg[j + 1]] += 2.0 * (h[seg[j]:seg[j + 1], :R].float() @ B[:, j * R:(j + 1) * R].float().t())

    def expand_then_cublas():
        lora_expand(h, B, meta, out, scale=True)
        out.addmm_(x, W.t())

    variants = {"cuBLAS x W^T alone": (lambda: torch.mm(x, W.t(), out=out), base),
                "expand, then cuBLAS (beta 1)": (expand_then_cublas, ref),
                "lora_base_gemm (pointer loads)": (lambda: lora_base_gemm(x, W, h, B, meta, out, scale=True), ref)}
    for cname, (bm, bn, bk, warps, stages, ws) in CONFIGS.items():
        tiles = meta.tiles(bm)
        for lora in (False, True):
            def run(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, tiles=tiles, lora=lora, ws=ws):
                n_rows = tiles.n if lora else triton.cdiv(T, bm)
                grid = (min(NUM_SMS, n_rows * triton.cdiv(d_out, bn)),)
                desc_gemm_kernel[grid](x, W, h, B, out, tiles.job, tiles.row, meta.seg_start_t,
                                       meta.rank_start_t, meta.scale_t, T, d_out, d_in, B.shape[1], n_rows, h.stride(0),
                                       B.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=max(16, R),
                                       NUM_SMS=NUM_SMS, LORA=lora, WS=ws, FLATTEN=False,
                                       PRECISION="upcast" if QUICK else "tf32", num_warps=warps,
                                       num_stages=stages)
            label = f"desc{' fused' if lora else ''} {cname}"
            variants[label] = (run, ref if lora else base)
    cub = None
    for vname, (fn, want) in variants.items():
        try:
            out.fill_(float("nan"))
            fn()
            bad = (~torch.isfinite(out)).any(dim=1).sum().item()
            err = ((out.float() - want).abs().max() / want.abs().max()).item()
            assert err < 2e-2, f"max rel diff {err}, {bad} of {T} rows not finite"
            t = graph_us(fn)
        except Exception as e:  # a configuration that does not compile, fit or match: recorded
            print(f"  {vname:40s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                  flush=True)
            rows.append({"shape": name, "variant": vname, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        cub = cub or t
        print(f"  {vname:40s} {t:8.1f} us  {flop / t / 1e6:6.0f} TFLOP/s  x cuBLAS alone {t / cub:5.3f}  "
              f"max rel diff to fp32 {err:.1e}", flush=True)
        rows.append({"shape": name, "variant": vname, "graph_us": t, "tflops": flop / t / 1e6,
                     "x_cublas_alone": t / cub, "rel_diff": err})
    del x, W, A, B, h, out, ref, base

out_dir = os.environ.get("OUT")
if out_dir:
    with open(os.path.join(out_dir, "ws_probe.json"), "w") as f:
        json.dump({"calibration": cal, "triton": triton.__version__, "jobs": J, "tokens_per_job": TPJ, "rank": R,
                   "rows": rows}, f, indent=1)
