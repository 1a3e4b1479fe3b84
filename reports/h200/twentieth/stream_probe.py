"""lora_stream_kernel (persistent programs over full row tiles, x / dy and the weights by TMA descriptors, nothing
masked: every rank BLOCK_R) against the op's launches of one program a tile (lora_shrink_kernel: "own", "tiles"),
at 8 jobs x TPJ tokens (default 24,576: the issue's bytes-bound rows), rank RANK (default 64), every Qwen3-0.6B
shape, one process, CUDA-graph microseconds:
  fwd    lora_shrink_expand (x -> h -> y): x read, y written
  dy     lora_shrink_sgrad with its dx (dy -> dh -> dx, dB's atomic partials, the reduce): dy read, dx written
  step   the op's forward + backward (grouped_lora), against the bytes bound of the issue (x twice, y, dy, dx)
Run from the repository root on the H200 after scripts/h200.sh made its shim:
    PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/twentieth/stream_probe.py [--quick]
(--quick: tiny shapes on the CPU's interpreter, plumbing only.) PARTS=fwd,dy,step picks the sections.
graph_us synchronises before do_bench_cudagraph since call 11 (calls.sh): without it the timer's own stream could
read a tile table the eager call had not yet uploaded.
"""
import json
import os
import sys

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from colora import kernels as K  # noqa: E402
from colora.kernels.bench import _kernel_breakdown, _lora_problem, calibrate, dense_lora_products  # noqa: E402
from colora.kernels.lora_ops import h_width, launch_overrides, lora_shrink_expand, lora_shrink_sgrad  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cal = calibrate(dev, QUICK)
J, TPJ, R = (2, 48, 16) if QUICK else (8, int(os.environ.get("TPJ", "24576")), int(os.environ.get("RANK", "64")))
SHAPES = {"tiny": (32, 48)} if QUICK else {
    "q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072), "down": (3072, 1024)}
if os.environ.get("SHAPES"):
    SHAPES = {k: v for k, v in SHAPES.items() if k in os.environ["SHAPES"].split(",")}
PARTS = os.environ.get("PARTS", "fwd,dy,step").split(",")
# diagnostics of the fault between shapes (calls 2 and 4): STREAM_OFF=1 runs everything with the stream launches
# off unless a variant turns them on; NO_DENSE=1 leaves out the cuBLAS step; FRESH=1 skips torch.cuda.empty_cache
STREAM_OFF = os.environ.get("STREAM_OFF") == "1"
NO_DENSE = os.environ.get("NO_DENSE") == "1"


def cfg(m, w, s, x, n=64, k=64):
    return {"on": True, "block_m": m, "block_k": k, "block_n2": n, "warps": w, "stages": s, "per_sm": x}


OFF = {"on": False}
# call 1 (s1/): the own launches were the default then; from call 2 on the stream launches are (at BLOCK_R 64)
FWD = {"stream (default)": {}, "stream m64 w4 s4 x3": cfg(64, 4, 4, 3), "stream m128 w4 s4 x2": cfg(128, 4, 4, 2)}
DY = {"stream (default)": {}, "stream m256 w8 s4 x1": cfg(256, 8, 4, 1), "stream m256 w8 s2 x1": cfg(256, 8, 2, 1),
      "stream m256 w8 s3 x1 n128": cfg(256, 8, 3, 1, 128), "stream m256 w8 s2 x1 k128": cfg(256, 8, 2, 1, 64, 128),
      "stream m256 w16 s3 x1": cfg(256, 16, 3, 1), "stream m512 w16 s2 x1": cfg(512, 16, 2, 1)}
if os.environ.get("TILES_ONLY") == "1":  # with STREAM_OFF=1: the same run without any stream launch (a control)
    FWD, DY = {"tiles again": {"on": False}}, {"tiles again": {"on": False}}
if QUICK:
    FWD = {"stream (default)": {}, "stream m16": cfg(16, 4, 2, 1, 16, 16)}
    DY = {"stream (default)": {}, "stream m16": cfg(16, 4, 2, 1, 16, 16)}


def graph_us(fn):
    if dev.type != "cuda":
        fn()
        return float("nan")
    import triton.testing
    torch.cuda.synchronize()  # fn's tile tables, uploaded on this stream, ready for do_bench_cudagraph's stream
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


rows = []


def timed(section, shape, vname, fn, outs, ref, nbytes, base):
    """Time fn (graph), check its outputs against ref's (the own launch's), print and record one row."""
    try:
        got = [o.clone() for o in fn() or outs]
        err = max(rel(g, r) for g, r in zip(got, ref)) if ref else 0.0
        assert err < 3e-2, f"max rel diff to own {err:.1e}"
        t = graph_us(fn)
        ks = _kernel_breakdown(fn, dev) or {}
        if dev.type == "cuda":
            torch.cuda.synchronize()  # an asynchronous fault is this variant's
    except Exception as e:  # a configuration that does not compile, fit or match: recorded
        print(f"  {section:4s} {vname:28s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
              flush=True)
        rows.append({"section": section, "shape": shape, "variant": vname, "error": f"{type(e).__name__}: {e}"[:400]})
        return None, None
    base = base or t
    top = ", ".join(f"{k.split('(')[0][:36]} {v:.0f}" for k, v in list(ks.items())[:4])
    gbps = nbytes / t / 1e3
    print(f"  {section:4s} {vname:28s} {t:8.1f} us  {gbps:6.0f} GB/s ({gbps / cal['copy_GBps']:4.0%} of the copy)"
          f"  x own {t / base:5.3f}  diff {err:.1e}  [{top}]", flush=True)
    rows.append({"section": section, "shape": shape, "variant": vname, "graph_us": t, "GBps": nbytes / t / 1e3,
                 "x_own": t / base, "rel_diff_to_own": err, "kernels_us": ks})
    return t, got


print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; copy {cal['copy_GBps']:.0f} GB/s; "
      f"{J} jobs x {TPJ} tokens, rank {R}", flush=True)
if STREAM_OFF:
    _off = launch_overrides(stream={"on": False}, stream_dy={"on": False})
    _off.__enter__()
for name, (d_in, d_out) in SHAPES.items():
    meta, x, A, B, dy = _lora_problem(K, J, TPJ, R, d_in, d_out, dev, seed=J * 7 + R)
    T = J * TPJ
    xd, Ad, Bd = x.detach(), A.detach(), B.detach()
    Bt = Bd.t().contiguous()
    bound = 2 * T * (3 * d_in + 2 * d_out) / (cal["copy_GBps"] * 1e9) * 1e6
    print(f"\n{name} {d_in}->{d_out}: step bound {bound:.0f} us", flush=True)
    h = xd.new_zeros((T, h_width(meta, 1)))
    y = xd.new_empty((T, d_out))
    if "fwd" in PARTS:
        def fwd(w2=Bt.t()):
            lora_shrink_expand(xd, Ad, w2, meta, h, y, scale_out=True)

        nb = 2 * T * (d_in + d_out)
        def own_fwd():
            with launch_overrides(stream=OFF):
                fwd()

        base, ref = timed("fwd", name, "own (tiles)", own_fwd, (h, y), None, nb, None)
        fwd_variants = {**FWD, "stream (default) B[N,R]": {}} if "stream (default)" in FWD else FWD
        for vname, over in fwd_variants.items():
            def run(over=over, w2=Bd if "B[N,R]" in vname else Bt.t()):
                with launch_overrides(stream=over):
                    fwd(w2)
            timed("fwd", name, vname, run, (h, y), ref, nb, base)
    if "dy" in PARTS:
        lora_shrink_expand(xd, Ad, Bt.t(), meta, h, y, scale_out=True)  # h of the forward
        dh = xd.new_zeros((T, h_width(meta, 1)))
        dx = xd.new_empty((T, d_in))
        dBt = torch.empty_like(Bt)

        def dyp():
            lora_shrink_sgrad(dy, Bt, h, meta, dh, dBt, dx=(Ad.t(), dx, False))

        nb = 2 * T * (d_out + d_in + R)
        def own_dy():
            with launch_overrides(stream_dy=OFF):
                dyp()

        base, ref = timed("dy", name, "own (tiles)", own_dy, (dh, dx, dBt), None, nb, None)
        for vname, over in DY.items():
            def run(over=over):
                with launch_overrides(stream_dy=over):
                    dyp()
            timed("dy", name, vname, run, (dh, dx, dBt), ref, nb, base)
        del dh, dx, dBt
    if "step" in PARTS:
        nb = 2 * T * (3 * d_in + 2 * d_out)
        off = {"stream": OFF, "stream_dy": OFF}
        variants = {"tiles": ({}, off), "before (tiles, dB apart at o, down)": ({"fuse_dy": d_out >= d_in}, off),
                    "stream (default)": ({}, {})}
        base = ref = None
        for vname, (kw, over) in variants.items():
            def step(kw=kw, over=over):
                with launch_overrides(**over):
                    out = K.grouped_lora(x, A, B, meta=meta, backend="triton", **kw)
                    return list(torch.autograd.grad(out, (x, A, B), dy))
            t, got = timed("step", name, vname, step, None, ref, nb, base)
            if vname == "tiles":
                base, ref = t, got
            if t:
                print(f"       x bound {t / bound:5.2f}", flush=True)
                rows[-1]["x_bound"] = t / bound
        def dense():
            return list(dense_lora_products(xd, Ad[:R], Bd[:, :R], dy))

        t, _ = (None, None) if NO_DENSE else timed("step", name, "dense cuBLAS (one adapter)", dense, None, None, nb,
                                                    base)
        if t:
            print(f"       x bound {t / bound:5.2f}", flush=True)
            rows[-1]["x_bound"] = t / bound
    del x, A, B, dy, xd, Ad, Bd, Bt, h, y
    if dev.type == "cuda" and os.environ.get("FRESH") != "1":
        torch.cuda.empty_cache()

out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "stream_probe.json"), "w") as f:
        json.dump({"calibration": cal, "jobs": J, "tokens_per_job": TPJ, "rank": R, "rows": rows}, f, indent=1)
