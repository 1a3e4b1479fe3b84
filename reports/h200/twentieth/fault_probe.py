"""Where the illegal memory access of calls 2 and 4 comes from: stream_probe.py's full runs (fwd, dy and step
sections, then the cuBLAS step) faulted between two shapes, after a device synchronisation that followed every
variant; the step section alone did not (call 5). This runs SET's launches at each shape for ROUNDS rounds, each
eagerly, replayed as a CUDA graph (triton.testing.do_bench_cudagraph) and under torch.profiler, then the cuBLAS
products, frees everything, empties the cache and synchronises at the next shape's start: the first transition that
raises names the set. SET: defaults (the op's launches as they run by default at rank 64), suspects (the dy
pass's variants new in call 2: 4 and 2 stages, 128 expand columns, BLOCK_K 128, 16 warps; the forward at 4 stages),
tiles (the stream launches off).
    SET=defaults ROUNDS=2 PYTHONPATH=/tmp/colora-shim python3 -P reports/h200/twentieth/fault_probe.py
"""
import os
import sys

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from colora import kernels as K  # noqa: E402
from colora.kernels.bench import _kernel_breakdown, _lora_problem, dense_lora_products  # noqa: E402
from colora.kernels.lora_ops import h_width, launch_overrides, lora_shrink_expand, lora_shrink_sgrad  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
J, TPJ, R = (2, 48, 16) if QUICK else (8, 24576, 64)
SHAPES = [(32, 48)] if QUICK else [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 3072), (3072, 1024)]
ROUNDS = int(os.environ.get("ROUNDS", "2"))
SET = os.environ.get("SET", "defaults")


def cfg(m, w, s, x, n=64, k=64):
    return {"on": True, "block_m": m, "block_k": k, "block_n2": n, "warps": w, "stages": s, "per_sm": x}


OFF = {"on": False}
SETS = {  # name: [(section, launch_overrides)]
    "defaults": [("fwd", {}), ("dy", {}), ("step", {})],
    "suspects": [("fwd", {"stream": cfg(128, 4, 4, 2)}), ("dy", {"stream_dy": cfg(256, 8, 4, 1)}),
                 ("dy", {"stream_dy": cfg(256, 8, 2, 1)}), ("dy", {"stream_dy": cfg(256, 8, 3, 1, 128)}),
                 ("dy", {"stream_dy": cfg(256, 8, 2, 1, 64, 128)}), ("dy", {"stream_dy": cfg(256, 16, 3, 1)})],
    "tiles": [("fwd", {"stream": OFF}), ("dy", {"stream_dy": OFF}), ("step", {"stream": OFF, "stream_dy": OFF})],
}[SET]


def run3(fn):
    fn()
    if dev.type == "cuda":
        import triton.testing
        triton.testing.do_bench_cudagraph(fn, rep=20)  # no synchronisation first: as calls 2-8 did
        _kernel_breakdown(fn, dev, calls=2)
        torch.cuda.synchronize()


print(f"SET={SET} ROUNDS={ROUNDS}", flush=True)
for rnd in range(ROUNDS):
    for d_in, d_out in SHAPES:
        where = f"round {rnd} shape {d_in}->{d_out}"
        try:
            if dev.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # the fault of the transition before this shape
            print(f"FAULT before {where}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
            sys.exit(1)
        meta, x, A, B, dy = _lora_problem(K, J, TPJ, R, d_in, d_out, dev, seed=J * 7 + R)
        T = J * TPJ
        xd, Ad, Bd = x.detach(), A.detach(), B.detach()
        Bt = Bd.t().contiguous()
        h = xd.new_zeros((T, h_width(meta, 1)))
        y = xd.new_empty((T, d_out))
        dh = xd.new_zeros((T, h_width(meta, 1)))
        dx = xd.new_empty((T, d_in))
        dBt = torch.empty_like(Bt)
        lora_shrink_expand(xd, Ad, Bt.t(), meta, h, y, scale_out=True)
        for section, over in SETS:
            def fn(section=section, over=over):
                with launch_overrides(**over):
                    if section == "fwd":
                        lora_shrink_expand(xd, Ad, Bt.t(), meta, h, y, scale_out=True)
                    elif section == "dy":
                        lora_shrink_sgrad(dy, Bt, h, meta, dh, dBt, dx=(Ad.t(), dx, False))
                    else:
                        out = K.grouped_lora(x, A, B, meta=meta, backend="triton")
                        torch.autograd.grad(out, (x, A, B), dy)
            run3(fn)
        run3(lambda: dense_lora_products(xd, Ad[:R], Bd[:, :R], dy))
        print(f"{where}: done", flush=True)
        del x, A, B, dy, xd, Ad, Bd, Bt, h, y, dh, dx, dBt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
if dev.type == "cuda":
    torch.cuda.synchronize()
print("no fault", flush=True)
