"""Rank 64 at 8 jobs x 24k tokens (the fifteenth's probe with the sixteenth's and seventeenth's variant sets).
Each shape, one process, one call: variants of the grouped LoRA's forward + backward beside the launchers'
own choices, timed as a CUDA graph (triton.testing.do_bench_cudagraph) and kernel by kernel (torch.profiler).
bound: compulsory bytes 2 T (3 d_in + 2 d_out) over a measured 1 GiB copy. Run from the repository root on
the H200 after scripts/h200.sh has made its shim:
    PROBE=15 PYTHONPATH=/tmp/colora-shim python3 reports/h200/seventeenth/r64_probe.py [--quick]
(without PROBE: 3, the final tree against its expands in their own launches)
Sets 12-15 ran at the commits calls.sh names, where route's separate expands were "tiles" (one [64, 128] tile a
program: lora_expand then) and "rows" (lora_expand_rows, an "expand_rows" override); since 15, "rows" is lora_expand
and the route is called "expand", so those sets no longer run as written.
PROBE=18 (nineteenth session): lora_shrink_expand (the forward's x -> h -> y, and the dy -> dh -> dx of the shapes
whose dB is not fused) on persistent programs with x and the weights loaded by TMA descriptors, against the own
one program a tile. PROBE=19: the same after the expand's weight tile skips its zeroing where every rank is BLOCK_R
(EVEN_R: every rank here). (Sets 16-17: the eighteenth session's, named in their entries.)
PROBE=15: after the backward's base products moved after the LoRA's dx as well: the separate expands (y, dx)
by lora_expand_rows against lora_expand (rank 16: the trainer's calls, and o and down alone).
PROBE=14: with PACKED=1 BASE=1, the op's base projection added after the LoRA delta by cuBLAS's epilogue (the
default since) against before it (the delta's expand accumulating into x W^T).
PROBE=13: the expand routes at rank 16, each named in full; with PACKED=1 BASE=1 TPJ=6144 as the trainer calls
the kernels (q|k|v and gate|up packed, the base projections inside the op, 49,152-token micro-batches).
PROBE=12: where dx and y are expanded (launch_overrides' "route"): dx in dA's pass (lora_sgrad's
expand: each x tile read and the dx tile of the same rows written in turn) against the dy pass (rank 64's
own choice, and rank 16's where d_in <= d_out) or its own expand; y by lora_expand_rows (long programs)
against the shrink's launch; with the dy pass fused or not.
PROBE=11: the rank-64 dy pass with dB fused on 16 warps, and on BLOCK_K 32 x 4 stages.
PROBE=10 (default): the fused dy pass's dx expand on 128 columns (the launch search's choice, the default
at rank 64 since) against 32 (before) and 64; and the forward shrink 3 stages deep against 4.
PROBE=9 (at a1263ea, reverted): x loaded and y stored by the tensor-memory accelerator (shrink "tma").
PROBE=8: the same as 7 after the atomic partials were vectorised and became the default, against
the dy read twice (rank 64's default before) and the per-tile partials (rank 16's default before).
PROBE=7: the fused dy pass (dh and dB from one read of dy) with its dB partials added atomically into one
fp32 partial a job (dy_pass "atomic") on 64- to 512-row tiles, against its per-tile partials and the own
choice (at rank 64: dy read twice). RANK=16 and SHAPES=k/v,gate/up pick the rank and the shapes.
NCU=1: instead, one step of each shape (own choices) under `ncu` (the caller's command line) between
cudaProfilerStart / Stop.
(--quick: tiny shapes on the CPU's interpreter, plumbing only.)
"""
import json
import os
import sys

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from colora import kernels as K  # noqa: E402
from colora.kernels.bench import _kernel_breakdown, _lora_problem, calibrate  # noqa: E402
from colora.kernels.lora_ops import launch_overrides  # noqa: E402

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cal = calibrate(dev, QUICK)
J, TPJ, R = (2, 64, 64) if QUICK else (8, int(os.environ.get("TPJ", "24576")), int(os.environ.get("RANK", "64")))
SHAPES = {"tiny": (64, 128)} if QUICK else {
    "q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072), "down": (3072, 1024)}
# PACKED=1: the trainer's calls instead, q|k|v and gate|up packed (grouped_lora_packed) and o and down alone;
# BASE=1: with the frozen base projections inside the op (base=W: y = x W^T + LoRA, dx = dy W + dh A), as the
# trainer calls them. The bound stays the LoRA's own bytes (the base GEMMs' are not in it).
PACKED = {"q|k|v": (1024, (2048, 1024, 1024)), "o": (2048, (1024,)), "gate|up": (1024, (3072, 3072)),
          "down": (3072, (1024,))}
if QUICK:
    PACKED = {"tiny|tiny": (64, (64, 64))}
if os.environ.get("PACKED") == "1":
    SHAPES = {k: (d_in, sum(outs)) for k, (d_in, outs) in PACKED.items()}
BASE = os.environ.get("BASE") == "1"


def graph_us(fn):
    if dev.type != "cuda":
        fn()
        return float("nan")
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


VARIANTS = {  # name: (grouped_lora kwargs, launch_overrides); set with PROBE=1-4 (the calls)
    "1": {
        "own": ({}, {}),
        "shrink M128": ({}, {"shrink": {"block_m": 128, "warps": 8, "stages": 3}}),
        "shrink M256": ({}, {"shrink": {"block_m": 256, "block_k": 64, "warps": 8, "stages": 3}}),
        "dy fused M256": ({"fuse_dy": True}, {}),
        "dy fused M512 w8": ({"fuse_dy": True}, {"dy_pass": {"block_m": 512, "block_k": 32, "warps": 8, "stages": 3}}),
        "dy fused M512 w16": ({"fuse_dy": True}, {"dy_pass": {"block_m": 512, "block_k": 32, "warps": 16, "stages": 3}}),
        "shrink M128 + dy fused M512 w8": ({"fuse_dy": True}, {"shrink": {"block_m": 128, "warps": 8, "stages": 3},
                                                              "dy_pass": {"block_m": 512, "block_k": 32, "warps": 8,
                                                                          "stages": 3}}),
    },
    "2": {  # after the launchers took the search's rank-64 choices (shrink BLOCK_K 64 x 4 stages, sgrad 256 x 8)
        "own": ({}, {}),
        "before (0c409b1's launch)": ({}, {"shrink": {"block_k": 128, "stages": 3},
                                           "sgrad": {"block_n": 64, "warps": 4}}),
        "shrink n2 128": ({}, {"shrink": {"block_n2": 128}}),
        "shrink M128 w8 s3": ({}, {"shrink": {"block_m": 128, "warps": 8, "stages": 3}}),
        "shrink M128 w4 s4": ({}, {"shrink": {"block_m": 128, "warps": 4, "stages": 4}}),
        "shrink M128 w8 s4 n2 128": ({}, {"shrink": {"block_m": 128, "warps": 8, "stages": 4, "block_n2": 128}}),
    },
    "3": {  # the final tree: every rank-64 choice its own, against the expands in their own launches
        "own": ({}, {}),
        "expands separate": ({"fuse_expand": False}, {}),
    },
    "4": {  # shared memory per program (occupancy): the shrink at 64 KB (3 a SM), the sgrad at 120 KB (1 a SM)
        "own": ({}, {}),
        "shrink k64 s3": ({}, {"shrink": {"block_k": 64, "stages": 3}}),
        "shrink k32 s4": ({}, {"shrink": {"block_k": 32, "stages": 4}}),
        "shrink k32 s6": ({}, {"shrink": {"block_k": 32, "stages": 6}}),
        "sgrad t32 n256 w8 s3": ({}, {"sgrad": {"block_t": 32, "block_n": 256, "warps": 8, "stages": 3}}),
        "sgrad t64 n256 w8 s2": ({}, {"sgrad": {"block_t": 64, "block_n": 256, "warps": 8, "stages": 2}}),
        "sgrad t32 n256 w4 s4": ({}, {"sgrad": {"block_t": 32, "block_n": 256, "warps": 4, "stages": 4}}),
        "sgrad t64 n128 w4 s3": ({}, {"sgrad": {"block_t": 64, "block_n": 128, "warps": 4, "stages": 3}}),
        "shrink k32 s4 + sgrad t32 n256 w8 s3": ({}, {"shrink": {"block_k": 32, "stages": 4},
                                                      "sgrad": {"block_t": 32, "block_n": 256, "warps": 8, "stages": 3}}),
    },
    "5": {  # the dy pass keeping one dB partial per chunk of tiles (dy_pass "chunk"), fused dy forced on
        "own": ({}, {}),
        "dy fused per tile M256": ({"fuse_dy": True}, {}),
        "dy chunk 1536 M256": ({"fuse_dy": True}, {"dy_pass": {"block_m": 256, "chunk": 1536}}),
        "dy chunk 1536 M128": ({"fuse_dy": True}, {"dy_pass": {"block_m": 128, "block_k": 64, "warps": 8, "chunk": 1536}}),
        "dy chunk 1536 M64": ({"fuse_dy": True}, {"dy_pass": {"block_m": 64, "block_k": 64, "warps": 4, "chunk": 1536}}),
        "dy chunk 3072 M128": ({"fuse_dy": True}, {"dy_pass": {"block_m": 128, "block_k": 64, "warps": 8, "chunk": 3072}}),
    },
    "6": {  # x read and y written with L2's evict-first policy in the shrink (and the dy pass), weights kept
        "own": ({}, {}),
        "stream": ({}, {"shrink": {"stream": "evict_first"}, "dy_pass": {"stream": "evict_first"}}),
        "own again": ({}, {}),
        "stream again": ({}, {"shrink": {"stream": "evict_first"}, "dy_pass": {"stream": "evict_first"}}),
    },
    "7": {  # the fused dy pass's dB partials added atomically, one fp32 partial a job
        "own": ({}, {}),
        "dy fused M256": ({"fuse_dy": True}, {}),
        "dy fused M256 atomic": ({"fuse_dy": True}, {"dy_pass": {"atomic": True}}),
        "dy fused M128 atomic": ({"fuse_dy": True}, {"dy_pass": {"block_m": 128, "warps": 8, "atomic": True}}),
        "dy fused M64 atomic": ({"fuse_dy": True}, {"dy_pass": {"block_m": 64, "block_k": 64, "warps": 4,
                                                                 "atomic": True}}),
        "dy fused M512 w16 atomic": ({"fuse_dy": True}, {"dy_pass": {"block_m": 512, "block_k": 32, "warps": 16,
                                                                      "stages": 3, "atomic": True}}),
        "own again": ({}, {}),
    },
    "8": {  # after the atomic partials' pointers were made 16-byte aligned (vectorised: RED.E.ADD.F32x4) and
            # became the default (fuse_dy_pays at rank 64 where d_out >= d_in; atomic_db)
        "own": ({}, {}),
        "dy read twice": ({"fuse_dy": False}, {}),
        "dy fused M256 per tile": ({"fuse_dy": True}, {"dy_pass": {"atomic": False}}),
        "dy fused M256 atomic": ({"fuse_dy": True}, {"dy_pass": {"atomic": True}}),
        "dy fused M128 atomic": ({"fuse_dy": True}, {"dy_pass": {"block_m": 128, "warps": 8, "atomic": True}}),
        "own again": ({}, {}),
    },
    "10": {  # the dy pass's fused dx expand on 128 columns (the search's choice) against 32 (before) and 64;
             # at rank 16 (RANK=16): the forward shrink 3 stages deep (the search's choice at k/v) against 4
        "own": ({}, {}),
        "dy pass n2 32": ({}, {"dy_pass": {"block_n2": 32}}),
        "dy pass n2 64": ({}, {"dy_pass": {"block_n2": 64}}),
        "shrink s3": ({}, {"shrink": {"stages": 3}}),
        "own again": ({}, {}),
    },
    "12": {  # where dx and y are expanded (seventeenth session)
        "own": ({}, {}),
        "dx sgrad": ({}, {"route": {"dx": "sgrad"}}),
        "dx sgrad, fuse_dy": ({"fuse_dy": True}, {"route": {"dx": "sgrad"}}),
        "dx sgrad, fuse_dy, y rows": ({"fuse_dy": True, "fuse_expand": False}, {"route": {"dx": "sgrad", "y": "rows"}}),
        "y rows": ({"fuse_expand": False}, {"route": {"dx": "dy", "y": "rows"}}),
        "dx sgrad n64 w4, fuse_dy": ({"fuse_dy": True}, {"route": {"dx": "sgrad"},
                                                          "dx_pass": {"block_n": 64, "warps": 4}}),
        "dx sgrad n256 w8, fuse_dy": ({"fuse_dy": True}, {"route": {"dx": "sgrad"},
                                                           "dx_pass": {"block_n": 256, "warps": 8}}),
        "own again": ({}, {}),
    },
    "13": {  # the expand routes at rank 16 (RANK=16), every one named, with the trainer's calls (PACKED=1 BASE=1)
        "own": ({}, {}),
        "y tiles, dx tiles": ({"fuse_expand": False}, {"route": {"y": "tiles", "dx": "tiles"}}),
        "y rows, dx tiles": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "tiles"}}),
        "y tiles, dx rows": ({"fuse_expand": False}, {"route": {"y": "tiles", "dx": "rows"}}),
        "y rows, dx rows": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "rows"}}),
        "y rows, dx sgrad": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "sgrad"}}),
        "y rows, dx dy": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "dy"}}),
        "y rows, dx rows, n256 w8": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "rows"},
                                                              "expand_rows": {"block_n": 256, "warps": 8}}),
        "own again": ({}, {}),
    },
    "14": {  # the base projection's order in the forward (PACKED=1 BASE=1): after the delta (own) or before
        "own": ({}, {}),
        "base before": ({}, {"route": {"base": "before"}}),
        "y rows": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "tiles"}}),
        "y rows, base before": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "tiles", "base": "before"}}),
        "own again": ({}, {}),
        "base before again": ({}, {"route": {"base": "before"}}),
    },
    "15": {  # after the backward's base dy W moved after the LoRA's dx too: the separate expands as lora_expand_rows
        "own": ({}, {}),
        "y rows, dx rows": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "rows"}}),
        "y rows, dx tiles": ({"fuse_expand": False}, {"route": {"y": "rows", "dx": "tiles"}}),
        "y tiles, dx rows": ({"fuse_expand": False}, {"route": {"y": "tiles", "dx": "rows"}}),
        "own again": ({}, {}),
    },
    "16": {  # (eighteenth session) the rank-64 dy pass reading dy alone (dh, dB); dx by lora_expand (long programs)
        "own": ({}, {}),
        "dx expand": ({}, {"route": {"dx": "expand"}}),
        "dx expand, fuse_dy": ({"fuse_dy": True}, {"route": {"dx": "expand"}}),
        "dx expand, fuse_dy M128 w4": ({"fuse_dy": True}, {"route": {"dx": "expand"},
                                                            "dy_pass": {"block_m": 128, "warps": 4}}),
        "dx expand, fuse_dy M128 w8": ({"fuse_dy": True}, {"route": {"dx": "expand"},
                                                            "dy_pass": {"block_m": 128, "warps": 8}}),
        "dx expand n128 w4, fuse_dy": ({"fuse_dy": True}, {"route": {"dx": "expand"},
                                                            "expand": {"block_n": 128, "warps": 4}}),
        "y expand, dx expand, fuse_dy": ({"fuse_dy": True, "fuse_expand": False}, {"route": {"dx": "expand"}}),
        "own again": ({}, {}),
    },
    "17": {  # (eighteenth session) the base GEMM with the expand in its epilogue (lora_base_gemm); PACKED=1 BASE=1
        "own": ({}, {}),
        "base fused": ({}, {"route": {"base": "fused"}}),
        "own again": ({}, {}),
        "base fused again": ({}, {"route": {"base": "fused"}}),
    },
    "18": {  # (nineteenth session) lora_shrink_expand on persistent programs, x and the weights by TMA descriptors
        "own": ({}, {}),
        "persistent desc": ({}, {"persistent": {"on": True}}),
        "persistent x desc": ({}, {"persistent": {"on": True, "w_desc": False}}),
        "persistent pointers": ({}, {"persistent": {"on": True, "x_desc": False, "w_desc": False}}),
        "persistent desc n2 128": ({}, {"persistent": {"on": True, "block_n2": 128}}),
        "persistent desc x2": ({}, {"persistent": {"on": True, "per_sm": 2}}),
        "own again": ({}, {}),
        "persistent desc again": ({}, {"persistent": {"on": True}}),
    },
    "19": {  # (nineteenth session) set 18's persistent launch with every rank at BLOCK_R: no zeroing of weight tiles
        "own": ({}, {}),
        "persistent desc": ({}, {"persistent": {"on": True}}),
        "own again": ({}, {}),
        "persistent desc again": ({}, {"persistent": {"on": True}}),
    },
    "11": {  # the rank-64 dy pass (dB fused; one program of 8 warps an SM at 48-50% of DRAM peak) on 16 warps
        "own": ({}, {}),
        "dy pass w16": ({}, {"dy_pass": {"warps": 16}}),
        "dy pass w16 k32 s4": ({}, {"dy_pass": {"warps": 16, "block_k": 32, "stages": 4}}),
        "dy pass w8 k32 s4 n2 64": ({}, {"dy_pass": {"block_k": 32, "stages": 4, "block_n2": 64}}),
        "own again": ({}, {}),
    },
}[os.environ.get("PROBE", "3")]
# the cuBLAS and forward-only rows: with the sets 1-3 and 9 only
CEILING = os.environ.get("PROBE", "3") not in ("4", "5", "6", "7", "8", "10", "11", "12", "13", "14", "15", "16", "17")
if os.environ.get("SHAPES"):  # e.g. SHAPES=k/v,gate/up
    SHAPES = {k: v for k, v in SHAPES.items() if k in os.environ["SHAPES"].split(",")}
if QUICK:  # the interpreter: small tiles only
    VARIANTS = {"own": ({}, {}), "shrink M128": ({}, {"shrink": {"block_m": 128, "block_k": 32, "warps": 4, "stages": 2}}),
                "dy fused M128": ({"fuse_dy": True}, {"dy_pass": {"block_m": 128, "block_k": 32, "warps": 4, "stages": 2}}),
                "dy fused M64 atomic": ({"fuse_dy": True}, {"dy_pass": {"block_m": 64, "block_k": 32, "atomic": True}}),
                "dx sgrad, fuse_dy, y expand": ({"fuse_dy": True, "fuse_expand": False},
                                                {"route": {"dx": "sgrad", "y": "expand"}}),
                "y expand, dx expand": ({"fuse_expand": False}, {"route": {"y": "expand", "dx": "expand"}})}
NCU = os.environ.get("NCU") == "1"

rows = []
print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; copy {cal['copy_GBps']:.0f} GB/s, "
      f"bf16 matmul {cal['bf16_matmul_TFLOPs']:.0f} TFLOP/s; {J} jobs x {TPJ} tokens, rank {R}", flush=True)
for name, (d_in, d_out) in SHAPES.items():
    meta, x, A, B, dy = _lora_problem(K, J, TPJ, R, d_in, d_out, dev, seed=J * 7 + R)
    outs = PACKED[name][1] if os.environ.get("PACKED") == "1" else (d_out,)
    g = torch.Generator(device=dev).manual_seed(5)
    As = [A] + [(torch.randn_like(A, dtype=torch.float32) / d_in**0.5).to(A.dtype).requires_grad_() for _ in outs[1:]]
    Bs = list(B.detach().split(outs, 0)) if len(outs) > 1 else [B]
    Bs = [b.contiguous().requires_grad_() for b in Bs] if len(outs) > 1 else Bs
    dys = list(dy.split(outs, 1)) if len(outs) > 1 else [dy]
    Ws = [(torch.randn(n, d_in, device=dev, generator=g) / d_in**0.5).to(x.dtype) for n in outs] if BASE else None
    T = J * TPJ
    bound_us = 2 * T * (3 * d_in + 2 * d_out) / (cal["copy_GBps"] * 1e9) * 1e6
    ref = None
    print(f"\n{name} {d_in}->{d_out}: bound {bound_us:.0f} us", flush=True)
    if NCU:  # one warm step, then one step between the profiler's start and stop
        def own():
            y = K.grouped_lora(x, A, B, meta=meta, backend="triton")
            return torch.autograd.grad(y, (x, A, B), dy)
        own()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        own()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        del x, A, B, dy
        continue
    for vname, (kw, over) in VARIANTS.items():
        def step(kw=kw):
            if len(outs) > 1:
                ys = K.grouped_lora_packed(x, As, Bs, meta, backend="triton", base=Ws, **kw)
                return torch.autograd.grad(ys, (x, *As, *Bs), dys)
            y = K.grouped_lora(x, A, B, meta=meta, backend="triton", base=Ws and Ws[0], **kw)
            return torch.autograd.grad(y, (x, A, B), dy)
        try:
            with launch_overrides(**over):
                got = step()
                if ref is None:
                    ref = got
                err = max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-6)).item()
                          for g, r in zip(got, ref))
                t = graph_us(step)
                ks = _kernel_breakdown(step, dev) or {}
        except Exception as e:  # a configuration that does not compile or fit: recorded
            print(f"  {vname:32s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            rows.append({"shape": name, "variant": vname, "error": f"{type(e).__name__}: {e}"[:400]})
            continue
        top = ", ".join(f"{k.split('(')[0][:40]} {v:.0f}" for k, v in list(ks.items())[:5])
        print(f"  {vname:32s} graph {t:7.0f} us  x bound {t / bound_us:5.2f}  max rel diff to own {err:.1e}  [{top}]",
              flush=True)
        rows.append({"shape": name, "variant": vname, "graph_us": t, "x_bound": t / bound_us, "kernels_us": ks,
                     "rel_diff_to_own": err})
    # cuBLAS on the same rows as one adapter (scale 1; the same products, no grouping)
    xd, Ad, Bd = x.detach(), A.detach()[:R], B.detach()[:, :R]

    def dense(fwd_only=False):
        h = xd @ Ad.t()
        y = h @ Bd.t()
        if fwd_only:
            return y
        dh = dy @ Bd
        return y, dh @ Ad, dh.t() @ xd, dy.t() @ h

    def own_fwd():
        with torch.no_grad():
            return K.grouped_lora(x, A, B, meta=meta, backend="triton")

    for vname, fn in (("dense cuBLAS", dense), ("dense cuBLAS fwd", lambda: dense(True)),
                      ("own fwd", own_fwd))[:3 * (CEILING and len(outs) == 1 and not BASE)]:
        t = graph_us(fn)
        ks = _kernel_breakdown(fn, dev) or {}
        fwd_bound = 2 * T * (d_in + d_out) / (cal["copy_GBps"] * 1e9) * 1e6
        b = fwd_bound if "fwd" in vname else bound_us
        top = ", ".join(f"{k.split('(')[0][:40]} {v:.0f}" for k, v in list(ks.items())[:6])
        print(f"  {vname:32s} graph {t:7.0f} us  x bound {t / b:5.2f}{' (fwd bytes)' if 'fwd' in vname else ''}  [{top}]",
              flush=True)
        rows.append({"shape": name, "variant": vname, "graph_us": t, "x_bound": t / b, "kernels_us": ks})
    del x, A, B, dy, ref, As, Bs, dys, Ws
    if dev.type == "cuda":
        torch.cuda.empty_cache()

out = os.environ.get("OUT")
if out:
    with open(os.path.join(out, "r64_probe.json"), "w") as f:
        json.dump({"calibration": cal, "jobs": J, "tokens_per_job": TPJ, "rank": R, "rows": rows}, f, indent=1)
