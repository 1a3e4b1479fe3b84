"""The segment reduction of the fused dy pass's dB partials at 8 jobs x 24k tokens (768 tiles of 256
rows, BLOCK_R 16), timed alone as a CUDA graph, in launch shapes of two layouts:
  rows   [chunks, BLOCK_R, N]            (the layout up to ce8abe6; its kernel imported from .ab/base)
  blocks [N / 64, chunks, BLOCK_R, 64]   (this session's, kernels/lora_kernels.py)
beside a copy of the same bytes and torch's sum over equal segments. Run on the H200 from the
repository root with the base tree in .ab/base (git archive ce8abe6):
    PYTHONPATH=/tmp/colora-shim python3 reports/h200/fourteenth/reduce_probe.py
"""
import importlib.util
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from colora.kernels import lora_kernels as new
from colora.kernels.lora_meta import LoRABatchMeta

spec = importlib.util.spec_from_file_location("old_lora_kernels", ".ab/base/kernels/lora_kernels.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

dev = torch.device("cuda")
J, tpj, BR, PB = 8, 24576, 16, 64
meta = LoRABatchMeta.build([tpj * j for j in range(J + 1)], [16 * j for j in range(J + 1)], [2.0] * J, dev)
chunks = meta.tiles(256)
C = chunks.n


def t_us(fn):
    return do_bench_cudagraph(fn, rep=200) * 1e3


for N in (1024, 2048, 3072):
    mb = C * BR * N * 4 / 1e6
    rows = torch.randn(C, BR, N, device=dev)
    blocks = rows.view(C, BR, N // PB, PB).permute(2, 0, 1, 3).contiguous()
    out = torch.empty(J * 16, N, device=dev, dtype=torch.bfloat16)
    ref = (rows.view(J, C // J, BR, N).sum(1) * 2.0).reshape(J * BR, N)
    dst = torch.empty_like(rows)
    res = [f"N {N}: partials {mb:.1f} MB; copy {t_us(lambda: dst.copy_(rows)):.1f} us (read + write); "
           f"torch sum {t_us(lambda: rows.view(J, C // J, BR, N).sum(1)):.1f} us"]

    def run_old(bn, ch, warps):
        old.lora_reduce_kernel[(J, triton.cdiv(N, bn))](
            rows, out, chunks.job_start, meta.rank_start_t, meta.scale_t, N, out.stride(0), out.stride(1),
            BLOCK_R=BR, BLOCK_N=bn, CHUNKS=ch, HAS_SCALE=True, num_warps=warps)

    def run_new(bn, ch, r, warps):
        new.lora_reduce_kernel[(J, triton.cdiv(N, bn), BR // r)](
            blocks, out, chunks.job_start, meta.rank_start_t, meta.scale_t, N, C, out.stride(0), out.stride(1),
            BLOCK_R=BR, BLOCK_N=bn, PB=PB, CHUNKS=ch, HAS_SCALE=True, ROWS=r, num_warps=warps)

    for bn, ch, warps in ((32, 8, 4), (64, 8, 4), (128, 8, 8), (32, 16, 4), (64, 16, 8), (128, 4, 4)):
        run_old(bn, ch, warps)
        ok = torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2)
        res.append(f"  rows   BN {bn:3d} C {ch:2d} w {warps}: {t_us(lambda: run_old(bn, ch, warps)):7.1f} us{'' if ok else ' WRONG'}")
    for bn, ch, r, warps in ((32, 8, 16, 4), (64, 8, 16, 4), (64, 16, 8, 4), (64, 16, 4, 4), (64, 32, 4, 4),
                             (64, 8, 8, 4), (64, 4, 16, 4), (64, 16, 16, 8), (64, 32, 8, 8), (64, 8, 4, 4)):
        run_new(bn, ch, r, warps)
        ok = torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2)
        res.append(f"  blocks BN {bn:3d} C {ch:2d} rows {r:2d} w {warps}: "
                   f"{t_us(lambda: run_new(bn, ch, r, warps)):7.1f} us{'' if ok else ' WRONG'}")
    print("\n".join(res), flush=True)
    del rows, blocks, dst
sys.exit(0)
