"""The LoRA's forward (h = x A_j^T, y = s_j h B_j^T, one pass: x read, y written) on Triton's Hopper path
(TMA descriptors, a persistent loop, automatic warp specialisation) against the op's own forward
(lora_ops.lora_shrink_expand: pointer loads through cp.async), at 8 jobs x TPJ tokens (default 24,576: the
issue's bytes-bound rows), rank RANK (default 64), every Qwen3-0.6B shape. CUDA-graph microseconds, one
process; GB/s counts x read and y written. Run from the repository root on the H200 after scripts/h200.sh made
its shim:
    PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/nineteenth/ws_fwd_probe.py [--quick]
(--quick: tiny shapes on the CPU's interpreter, plumbing only.)  CONFIGS=0,2 limits the descriptor kernel's
configurations. The own launch's baseline passes B^T's transpose view as the op does (call 5's passed B row-major,
the expand's weight read across its rows: a baseline the op never runs; it stays as "B row-major").
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
from colora.kernels.lora_ops import h_width, launch_overrides, lora_shrink_expand  # noqa: E402


@triton.jit
def fwd_desc_kernel(x_ptr, a_ptr, b_ptr, h_ptr, y_ptr,
                    tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, scale_ptr,
                    T, K, N, R_total, n_tiles, stride_hm,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_SMS: tl.constexpr, WS: tl.constexpr, PRECISION: tl.constexpr):
    """Persistent over the LoRA's row tiles (one job's rows each): h = x A_j^T over K (x and A through
    descriptors), h stored, then y = s_j h B_j^T over N (B through a descriptor, y through masked pointers)."""
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R_total, K], strides=[K, 1], block_shape=[BLOCK_R, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, R_total], strides=[R_total, 1],
                                       block_shape=[BLOCK_N, BLOCK_R])
    start = tl.program_id(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    for tile in tl.range(start, n_tiles, NUM_SMS, warp_specialize=WS):
        job, row0, row_end, r0, r = _tile_of(tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, tile,
                                             BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for ki in range(k_tiles):
            xt = x_desc.load([row0, ki * BLOCK_K])
            at = a_desc.load([r0, ki * BLOCK_K])
            acc = _dot(xt, at.T, acc, PRECISION)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows = rows.to(tl.int64)
        hb = tl.where((offs_r < r)[None, :], acc, 0.0).to(h_ptr.dtype.element_ty)  # A's rows past r_j: next job's
        tl.store(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], hb, mask=row_ok[:, None])
        s = tl.load(scale_ptr + job)
        for ni in range(n_tiles_n):
            bt = b_desc.load([ni * BLOCK_N, r0])
            yt = _dot(hb, bt.T, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION) * s
            offs_n = ni * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(y_ptr + rows[:, None] * N + offs_n[None, :], yt.to(y_ptr.dtype.element_ty),
                     mask=row_ok[:, None])


dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
NUM_SMS = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
cal = calibrate(dev, QUICK)
J, TPJ, R = (2, 48, 16) if QUICK else (8, int(os.environ.get("TPJ", "24576")), int(os.environ.get("RANK", "64")))
SHAPES = {"tiny": (64, 96)} if QUICK else {
    "q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072), "down": (3072, 1024)}
CONFIGS = {  # BLOCK_M, BLOCK_K, BLOCK_N, warps, stages, programs an SM, warp specialisation
    "64x64 n64 w4 s4 x3": (64, 64, 64, 4, 4, 3, False), "128x64 n64 w4 s3 x1": (128, 64, 64, 4, 3, 1, False),
    "128x64 n128 w8 s3 x1": (128, 64, 128, 8, 3, 1, False), "ws 128x64 n64 w4 s3": (128, 64, 64, 4, 3, 1, True),
    "ws 128x64 n128 w4 s3": (128, 64, 128, 4, 3, 1, True), "ws 64x64 n64 w4 s4": (64, 64, 64, 4, 4, 1, True)}
if os.environ.get("CONFIGS"):
    CONFIGS = {k: v for i, (k, v) in enumerate(CONFIGS.items()) if str(i) in os.environ["CONFIGS"].split(",")}
if QUICK:
    CONFIGS = {"tiny": (16, 32, 32, 4, 2, 1, False), "ws tiny": (16, 32, 32, 4, 2, 1, True)}


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
      f"{cal['copy_GBps']:.0f} GB/s; {J} jobs x {TPJ} tokens, rank {R}", flush=True)
for name, (d_in, d_out) in SHAPES.items():
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(T, d_in, device=dev, generator=g).to(dtype)
    A = (torch.randn(J * R, d_in, device=dev, generator=g) / d_in**0.5).to(dtype)
    B = (torch.randn(d_out, J * R, device=dev, generator=g) / R**0.5).to(dtype)
    h = x.new_zeros((T, h_width(meta, 1)))
    y = x.new_empty((T, d_out))
    nbytes = 2 * T * (d_in + d_out)
    print(f"\n{name} {d_in}->{d_out}: x + y {nbytes / 1e9:.2f} GB, {nbytes / cal['copy_GBps'] * 1e-3:.0f} us at the "
          f"copy's rate", flush=True)
    ref = torch.empty(T, d_out, device=dev)
    for j in range(J):
        hj = (x[seg[j]:seg[j + 1]].float() @ A[j * R:(j + 1) * R].float().t()).to(dtype).float()
        ref[seg[j]:seg[j + 1]] = 2.0 * hj @ B[:, j * R:(j + 1) * R].float().t()
    Bt = B.t().contiguous()  # the op's layout: B^T made contiguous once a forward, B passed as its transpose view
    variants = {"own (lora_shrink_expand)": lambda: lora_shrink_expand(x, A, Bt.t(), meta, h, y, scale_out=True),
                "own, B row-major (call 5's)": lambda: lora_shrink_expand(x, A, B, meta, h, y, scale_out=True)}
    for oname, over in [("op persistent desc", {"on": True}), ("op persistent x desc", {"on": True, "w_desc": False})]:
        def op(over=over):
            with launch_overrides(persistent=over):
                lora_shrink_expand(x, A, Bt.t(), meta, h, y, scale_out=True)
        variants[oname] = op
    for cname, (bm, bk, bn, warps, stages, per_sm, ws) in CONFIGS.items():
        tiles = meta.tiles(bm)

        def run(bm=bm, bk=bk, bn=bn, warps=warps, stages=stages, per_sm=per_sm, ws=ws, tiles=tiles):
            fwd_desc_kernel[(min(NUM_SMS * per_sm, tiles.n),)](
                x, A, B, h, y, tiles.job, tiles.row, meta.seg_start_t, meta.rank_start_t, meta.scale_t,
                T, d_in, d_out, A.shape[0], tiles.n, h.stride(0), BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=max(16, R),
                BLOCK_N=bn, NUM_SMS=NUM_SMS * per_sm, WS=ws, PRECISION="upcast" if QUICK else "tf32",
                num_warps=warps, num_stages=stages)
        variants[f"desc {cname}"] = run
    own = None
    for vname, fn in variants.items():
        try:
            y.fill_(float("nan"))
            fn()
            bad = (~torch.isfinite(y)).any(dim=1).sum().item()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, f"max rel diff {err}, {bad} rows not finite"
            t = graph_us(fn)
        except Exception as e:  # a configuration that does not compile, fit or match: recorded
            print(f"  {vname:32s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                  flush=True)
            rows.append({"shape": name, "variant": vname, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        own = own or t
        print(f"  {vname:32s} {t:8.1f} us  {nbytes / t / 1e3:6.0f} GB/s ({nbytes / t / 1e3 / cal['copy_GBps']:4.0%} "
              f"of the copy)  x own {t / own:5.3f}  max rel diff {err:.1e}", flush=True)
        rows.append({"shape": name, "variant": vname, "graph_us": t, "GBps": nbytes / t / 1e3, "x_own": t / own,
                     "rel_diff": err})
    del x, A, B, h, y, ref

out_dir = os.environ.get("OUT")
if out_dir:
    with open(os.path.join(out_dir, "ws_fwd_probe.json"), "w") as f:
        json.dump({"calibration": cal, "triton": triton.__version__, "jobs": J, "tokens_per_job": TPJ, "rank": R,
                   "rows": rows}, f, indent=1)
