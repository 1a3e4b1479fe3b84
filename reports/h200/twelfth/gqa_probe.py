"""Does torch's varlen attention take grouped-query K/V as they are (fewer heads than Q), without
`enable_gqa` and without repeating them? Forward and backward against the repeated-K/V call.

    python3 reports/h200/twelfth/gqa_probe.py   (on the H200, torch 2.11)
"""
import inspect

import torch
from torch.nn.attention.varlen import varlen_attn

print("torch", torch.__version__, "varlen_attn parameters:", list(inspect.signature(varlen_attn).parameters))
torch.manual_seed(0)
T, Hq, Hkv, D = 4096, 16, 8, 128
lens = [384] * 10 + [256]
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
T = int(cu[-1])
params = inspect.signature(varlen_attn).parameters
causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
go = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
rep = lambda t: t.repeat_interleave(Hq // Hkv, dim=1)  # noqa: E731
ref = varlen_attn(q, rep(k), rep(v), cu, cu, max(lens), max(lens), **causal)
gref = torch.autograd.grad(ref, (q, k, v), go)
try:
    out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **causal)
    g = torch.autograd.grad(out, (q, k, v), go)
    print("native GQA: out max|diff|", float((out - ref).abs().max()),
          "grads max|diff|", [float((a - b).abs().max()) for a, b in zip(g, gref)],
          "grad scale", [float(b.abs().max()) for b in gref])
except Exception as e:  # noqa: BLE001
    print("native GQA refused:", type(e).__name__, str(e)[:300])
