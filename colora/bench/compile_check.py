"""Compile the kernels for the H200 (sm_90a) on a machine without a GPU, and report what the
compiler did: registers, stack (spills), shared memory, and SASS instruction counts (HGMMA/HMMA
tensor-core ops, LDGSTS async copies, 128-bit LDG/STG vs 2-byte loads, local-memory LDL/STL).

    python -m colora.bench.compile_check            (all; about 1 minute)
    python -m colora.bench.compile_check shrink     (labels containing "shrink")
    python -m colora.bench.compile_check --tune     (colora/bench/tune.py's candidates, bf16, ranks 16 and 64)

The interpreter (CPU tests) enforces none of Triton's compile-time rules; this does, with the
installed Triton's own ptxas. The specialisations mirror real launches at Qwen3 shapes (unit
strides as constants, 16-divisible sizes) with the launch parameters the LoRA launch policy
(kernels/lora/policy.py and its H200 table) and logsoftmax choose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from colora.bench.tune import candidates
from colora.kernels.logsoftmax_kernels import selective_logsoftmax_kernel
from colora.kernels.lora.common import block_r
from colora.kernels.lora.meta import LoRABatchMeta
from colora.kernels.lora.policy import reduce_shape, rows_config, shrink_config, stream_entry
from colora.kernels.lora.reduce import lora_reduce_kernel
from colora.kernels.lora.sgrad import lora_sgrad_kernel
from colora.kernels.lora.shrink import lora_shrink_kernel
from colora.kernels.lora.stream import lora_stream_kernel

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OPS = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDG.E.128", "LDG.E.U16", "STG.E.128", "STG.E.U16", "LDL", "STL",
       "REDG", "ATOMG", "F32x4")  # REDG: fire-and-forget atomic adds (the dy pass's dB); F32x4: 128-bit ones; UTMALDG: TMA loads


def compile_one(label: str, fn, types: dict, consts: dict, ones=(), div16=(), warps=4, stages=3) -> str:
    """Compile fn with `types` for its runtime args, `consts` as constexprs, `ones` as the stride-1
    specialisation and `div16` marked divisible by 16 (pointers always are); one report line."""
    sig, cst, attrs = {}, dict(consts), {}
    for i, name in enumerate(fn.arg_names):
        if name in consts or name in ones:
            sig[name] = "constexpr"
            if name in ones:
                cst[name] = 1
        else:
            sig[name] = types[name]
            if types[name].startswith("*") or name in div16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cst, attrs=attrs), target=TARGET,
                       options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    try:
        run = lambda *a: subprocess.run([os.path.join(BIN, "cuobjdump"), *a, f.name],  # noqa: E731
                                        capture_output=True, text=True, check=True).stdout
        usage = next(line.split() for line in run("--dump-resource-usage").splitlines() if "REG:" in line)
        sass = run("-sass")
    finally:
        os.unlink(f.name)
    ops = {k: sass.count(k) for k in OPS if k in sass}
    return f"{label:34s} {usage[0]:8s} {usage[1]:10s} smem={c.metadata.shared:6d} {ops}"


def _meta(R: int, tokens_per_job: int) -> LoRABatchMeta:
    """8 jobs at rank R: the batch whose launches a variant compiles (24k tokens a job: the dy pass's 256-row
    tiles; 100: its 64-row ones)."""
    return LoRABatchMeta.build([tokens_per_job * j for j in range(9)], [R * j for j in range(9)], [1.0] * 8)


def variants():
    """(label, kernel, arg types, constexprs, unit strides, 16-divisible ints, warps, stages)."""
    i = "i32"
    for dt, prec in (("bf16", "tf32"), ("fp32", "ieee")):
        p = "*" + dt
        for R in (16, 64, 256):
            shrink = dict(x_ptr=p, w_ptr=p, h_ptr=p, p_ptr=p, part_ptr="*fp32", tile_job_ptr="*i32",
                          tile_row_ptr="*i32", seg_start_ptr="*i32", rank_start_ptr="*i32", scale_ptr="*fp32",
                          K=i, h_slice=i, n_part=i, stride_xm=i, stride_xk=i, stride_wr=i, stride_wk=i, stride_hm=i,
                          stride_pm=i,
                          w2_ptr=p, y_ptr=p, N2=i, stride_w2n=i, stride_w2r=i, stride_ym=i, stride_yn=i)
            div = ("K", "h_slice", "stride_xm", "stride_wr", "stride_hm", "stride_pm", "N2", "stride_w2r", "stride_ym")
            dtype = torch.float32 if dt == "fp32" else torch.bfloat16
            big, small = _meta(R, 24576), _meta(R, 100)
            cfg = shrink_config(big, dtype, 1024, 0)
            warps, stages = cfg["warps"], cfg["stages"]
            base = dict(BLOCK_M=cfg["block_m"], BLOCK_R=R, BLOCK_K=cfg["block_k"], EVEN_K=True, PRECISION=prec,
                        FUSE_SGRAD=False, FUSE_EXPAND=False, BLOCK_N2=16, EXPAND_SCALE=False, ACCUMULATE=False,
                        PART_ATOMIC=False)
            ones = ("stride_xk", "stride_wk", "stride_w2n", "stride_yn")
            yield (f"shrink {dt} R{R}", lora_shrink_kernel, shrink, dict(base, HAS_SCALE=True), ones, div, warps, stages)
            # with the expand fused (x -> h -> y; dy -> dh -> dx accumulating into dy W), BLOCK_N2 as launched
            if R <= 64:  # policy.fuse_expand_pays
                n2 = shrink_config(big, dtype, 1024, 1024)["block_n2"]
                yield (f"shrink+expand {dt} R{R}", lora_shrink_kernel, shrink,
                       dict(base, HAS_SCALE=False, FUSE_EXPAND=True, BLOCK_N2=n2, EXPAND_SCALE=True),
                       ones, div, warps, stages)
            # lora_stream_kernel (its table's "on": BLOCK_R 64; 16-bit only): the shrink_expand (B^T's [R, N2]
            # layout, or B's [N2, R]) and the dy pass, on the table's tiles
            if R <= 64 and dt == "bf16":
                def td(block):
                    return f"tensordesc<{dt}[{block[0]}, {block[1]}]>"
                for label, kind, nr in (("fwd", "stream", False), ("fwd B", "stream", True),
                                        ("dy", "stream_dy", False)):
                    sc = stream_entry(kind, big, dtype)
                    bm, bk, bn2, fused = sc["block_m"], sc["block_k"], sc["block_n2"], kind == "stream_dy"
                    stream = dict(x=td((bm, bk)), w=td((R, bk)), h_ptr=p, p_ptr=p, part_ptr="*fp32",
                                  w2=td((bn2, R) if nr else (R, bn2)), y_ptr=p, tile_job_ptr="*i32",
                                  tile_row_ptr="*i32", rank_start_ptr="*i32", scale_ptr="*fp32", n_tiles=i,
                                  programs=i, K=i, N2=i, n_part=i, stride_hm=i, stride_pm=i, stride_ym=i)
                    yield (f"stream {label} {dt} R{R} M{bm}", lora_stream_kernel, stream,
                           dict(BLOCK_M=bm, BLOCK_R=R, BLOCK_K=bk, BLOCK_N2=bn2, W2_NR=nr, EVEN_N2=True,
                                FUSE_SGRAD=fused, HAS_SCALE=fused, EXPAND_SCALE=not fused, ACCUMULATE=fused,
                                PRECISION=prec),
                           (), ("K", "N2", "n_part", "stride_hm", "stride_pm", "stride_ym"), sc["warps"], sc["stages"])
            # the fused dy pass (policy.fuse_dy_pays): per-tile or atomic dB partials at R <= 32, atomic
            # ones on 256-row tiles at R 64 (bf16 only: at fp32 it spills 2.4 KB a thread, so it does not run)
            for meta, atomic in ((small, False), (big, False), (small, True), (big, True)) if R <= 32 else \
                    ((big, True),) if R == 64 and dt == "bf16" else ():
                dc = shrink_config(meta, dtype, 1024, 1024, dy_pass=True)
                bm, w = dc["block_m"], dc["warps"]
                fused = dict(base, BLOCK_M=bm, BLOCK_K=dc["block_k"], FUSE_SGRAD=True, HAS_SCALE=True,
                             PART_ATOMIC=atomic)
                a = " atomic" if atomic else ""
                yield (f"shrink+sgrad {dt} R{R} M{bm}{a}", lora_shrink_kernel, shrink, fused, ones, div, w,
                       dc["stages"])
                yield (f"shrink+sgrad+expand {dt} R{R} M{bm}{a}", lora_shrink_kernel, shrink,
                       dict(fused, FUSE_EXPAND=True, BLOCK_N2=dc["block_n2"], ACCUMULATE=True), ones, div, w,
                       dc["stages"])
            sc = rows_config("sgrad", big, 1024, dtype)
            bn, sw = sc["block_n"], sc["warps"]
            sgrad = dict(p_ptr=p, q_ptr=p, part_ptr="*fp32", w_ptr=p, y_ptr=p, scale_ptr="*fp32", tile_job_ptr="*i32",
                         tile_row_ptr="*i32", seg_start_ptr="*i32", rank_start_ptr="*i32", N=i, p_slice=i, chunk=i,
                         stride_pm=i, stride_qm=i, stride_qn=i, stride_wn=i, stride_wr=i, stride_ym=i, stride_yn=i)
            sg = dict(BLOCK_T=sc["block_t"], BLOCK_R=R, BLOCK_N=bn, PRECISION=prec, SGRAD=True, EXPAND=False,
                      EXPAND_SCALE=False, ACCUMULATE=False)
            sdiv = ("N", "p_slice", "chunk", "stride_pm", "stride_qm", "stride_wr", "stride_ym")
            sones = ("stride_qn", "stride_wn", "stride_yn")
            yield f"sgrad {dt} R{R}", lora_sgrad_kernel, sgrad, sg, sones, sdiv, sw, sc["stages"]
            ec = rows_config("expand", big, 1024, dtype)
            for acc in (False, True):  # lora_expand (the sgrad kernel without its sgrad)
                yield (f"expand{'+acc' if acc else ''} {dt} R{R}", lora_sgrad_kernel, sgrad,
                       dict(sg, BLOCK_T=ec["block_t"], BLOCK_N=ec["block_n"], SGRAD=False, EXPAND=True,
                            EXPAND_SCALE=True, ACCUMULATE=acc), sones, sdiv, ec["warps"], ec["stages"])
            reduce = dict(part_ptr="*fp32", out_ptr=p, job_chunk_ptr="*i32", rank_start_ptr="*i32",
                          scale_ptr="*fp32", N=i, n_chunks=i, stride_or=i, stride_on=i)
            # as launched at 8 jobs x 1024 columns on the H200: the dy pass's 64-column blocks, and few
            # partials in the sgrad's blocks
            for pb, partials in ((64, 8 * 96), (bn, 8)):
                rbn, chunks, rows = reduce_shape(8, 1024, R, partials, pb)
                yield (f"reduce {dt} R{R} N{rbn} C{chunks} rows{rows}", lora_reduce_kernel, reduce,
                       dict(BLOCK_R=R, BLOCK_N=rbn, PB=pb, CHUNKS=chunks, HAS_SCALE=True, ROWS=rows),
                       ("stride_or",), ("N", "stride_on"), 8 if rows * rbn * chunks >= 16384 else 4, 3)
        lsm = dict(logits_ptr=p, targets_ptr="*i64", temp_ptr="*fp32", logp_ptr="*fp32", ent_ptr="*fp32",
                   V=i, stride_l=i)
        yield (f"logsoftmax {dt}", selective_logsoftmax_kernel, lsm,
               dict(BLOCK_V=4096, HAS_GRAD=True, HAS_ENTROPY=True), (), ("V", "stride_l"), 8, 3)


def tune_variants():
    """The candidates of colora/bench/tune.py at bf16, ranks 16 and 64, as `variants` yields them: which
    compile for sm_90a, with how much shared memory and how many registers, before device time goes
    to them."""
    base = {v[0]: v[1:] for v in variants()}
    for R in (16, 64):
        # the shrink as it runs where its expand fuses (fuse_expand_pays), the dy pass with dx fused
        for kernel, label in (("shrink", f"shrink+expand bf16 R{block_r(R)}"),
                              ("dy_pass", f"shrink+sgrad+expand bf16 R{R} M256 atomic"),
                              ("expand", f"expand+acc bf16 R{R}"), ("sgrad", f"sgrad bf16 R{R}")):
            fn, types, consts, ones, div, _, _ = base[label]
            for cfg in candidates(kernel, quick=False):
                c = dict(consts)
                for key, const in (("block_m", "BLOCK_M"), ("block_k", "BLOCK_K"), ("block_n", "BLOCK_N"),
                                   ("block_t", "BLOCK_T"), ("block_n2", "BLOCK_N2")):
                    if key in cfg:
                        c[const] = cfg[key]
                yield (f"tune {kernel} R{R} {'/'.join(str(v) for v in cfg.values())}", fn, types, c, ones, div,
                       cfg["warps"], cfg["stages"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore")
    print(f"triton {triton.__version__}, target sm_{TARGET.arch}")
    tune = "--tune" in argv
    argv = [a for a in argv if a != "--tune"]
    for label, *rest in (tune_variants() if tune else variants()):
        if not argv or any(a in label for a in argv):
            try:
                print(compile_one(label, *rest), flush=True)
            except Exception as e:  # e.g. out of shared memory: the line says so, the others still compile
                print(f"{label:34s} failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
