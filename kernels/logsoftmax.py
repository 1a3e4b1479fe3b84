"""Selective log-softmax: log softmax(hidden @ weight^T / temperature)[t, targets[t]] for every row,
chunked over rows so the [tokens, vocab] logits never exist whole, nor in fp32.

Two paths compute the same function (logits rounded to hidden's dtype by the matmul, as an
HF/vLLM LM head does, then fp32 softmax):
- "torch": the reference and the CPU trainer's path. Per chunk: matmul, fp32 log_softmax, gather.
  The backward recomputes each chunk's logits (memory O(chunk x vocab), compute 3 matmuls).
- "triton": per chunk a cuBLAS matmul into one reused buffer in hidden's dtype, then
  `selective_logsoftmax_kernel` (online log-sum-exp, fp32 in registers only). When hidden needs a
  gradient, the kernel also turns the buffer into d logp / d logits in place and the forward forms
  G = dlogits @ W right away (Liger-Kernel's fused linear cross entropy): the backward is then
  dh = g[:, None] * G, exact because logp_t depends on hidden row t only. 2 matmuls instead of 3,
  at the price of keeping G ([T, d] in hidden's dtype) until the backward.
A trained LM head (weight requiring a gradient: a full-parameter job's) gets d weight = sum_t dlogits_t^T
hidden_t, which needs each row's upstream gradient: the forward then keeps no G, and the backward
recomputes each chunk's logits and d logp / d logits (by the kernel, or in torch), scales them by the
upstream gradient and forms dh and d weight from them (4 matmuls), d weight summed over chunks in
weight's dtype as autograd sums a weight used in several matmuls.
"""

from __future__ import annotations

import torch
import triton

from .backend import resolve_backend
from .logsoftmax_kernels import selective_logsoftmax_kernel
from .util import ALIGN


def _temperatures(temperature: float | torch.Tensor, T: int, device: torch.device) -> torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        if temperature.shape not in ((T,), ()):
            raise ValueError(f"temperature must be a float or an fp32 [T={T}] tensor, "
                             f"got shape {tuple(temperature.shape)}")
        return temperature.to(device=device, dtype=torch.float32).expand(T).contiguous()
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.full((T,), float(temperature), dtype=torch.float32, device=device)


def _chunks(T: int, chunk_size: int):
    return [(c0, min(T, c0 + chunk_size)) for c0 in range(0, T, chunk_size)]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # float64: gradcheck only


def _ref_chunk(h: torch.Tensor, weight: torch.Tensor, tgt: torch.Tensor, temp: torch.Tensor):
    """(logp, entropy, softmax) of one chunk in fp32 (fp64 for fp64 inputs).
    h: [C, d], weight: [V, d], tgt: [C], temp: [C]."""
    acc = _acc_dtype(h.dtype)
    z = (h @ weight.t()).to(acc) / temp.to(acc)[:, None]  # [C, V]
    lsm = torch.log_softmax(z, dim=-1)
    p = lsm.exp()
    return lsm.gather(1, tgt[:, None]).squeeze(1), -(p * lsm).sum(-1), p


def _forward_torch(hidden, weight, targets, temp, chunk_size):
    logp = torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden.dtype), device=hidden.device)
    ent = torch.empty_like(logp)
    for c0, c1 in _chunks(hidden.shape[0], chunk_size):
        logp[c0:c1], ent[c0:c1], _ = _ref_chunk(hidden[c0:c1], weight, targets[c0:c1], temp[c0:c1])
    return logp, ent


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it that starts on a 16-byte boundary: Triton compiles a kernel again for
    each new pattern of its pointers' alignment, and a caller's view at an odd offset (one row of a
    packed upload: fp32 [N] at 8N bytes) would make that depend on the batch."""
    return t if t.data_ptr() % ALIGN == 0 else t.clone()


def _forward_triton(hidden, weight, targets, temp, chunk_size, want_grad: bool, want_entropy: bool):
    """(logp [T], entropy [T] or None, G [T, d] or None)."""
    T, d = hidden.shape
    targets, temp = _aligned(targets), _aligned(temp)
    V = weight.shape[0]
    logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(logp) if want_entropy else logp  # a dummy pointer when not written
    G = torch.empty_like(hidden) if want_grad else None
    buf = hidden.new_empty((min(chunk_size, T), V))  # [C, V], reused by every chunk
    block_v = min(4096, max(128, triton.next_power_of_2(V)))
    for c0, c1 in _chunks(T, chunk_size):
        lg = buf[: c1 - c0]
        torch.mm(hidden[c0:c1], weight.t(), out=lg)
        selective_logsoftmax_kernel[(c1 - c0,)](
            lg, targets[c0:c1], temp[c0:c1], logp[c0:c1], ent[c0:c1],
            V, lg.stride(0),
            BLOCK_V=block_v, HAS_GRAD=want_grad, HAS_ENTROPY=want_entropy,
            num_warps=8 if block_v >= 2048 else 4,
        )
        if want_grad:
            torch.mm(lg, weight, out=G[c0:c1])  # [C, d] = d logp / d hidden for an upstream 1
    return logp, (ent if want_entropy else None), G


def _forward(hidden, weight, targets, temp, chunk_size, use_triton: bool, want_entropy: bool):
    """(logp [T], entropy [T] or None) by either path, without the fused gradient pass."""
    if use_triton:
        return _forward_triton(hidden, weight, targets, temp, chunk_size, False, want_entropy)[:2]
    return _forward_torch(hidden, weight, targets, temp, chunk_size)


def _dlogits(hidden, weight, targets, temp, dlogp, chunk_size, use_triton):
    """Per chunk of rows (c0, c1, g): g [C, V] in hidden's dtype, d loss / d logits for the upstream
    gradient dlogp [T] (the torch path forms it in fp32, then rounds it as autograd through .float() does;
    the Triton path takes the kernel's d logp / d logits, already rounded, and scales it in place)."""
    if use_triton:
        targets, temp = _aligned(targets), _aligned(temp)
        V = weight.shape[0]
        buf = hidden.new_empty((min(chunk_size, hidden.shape[0]), V))  # [C, V], reused by every chunk
        scratch = torch.empty(buf.shape[0], dtype=torch.float32, device=hidden.device)  # logp, not kept
        block_v = min(4096, max(128, triton.next_power_of_2(V)))
    for c0, c1 in _chunks(hidden.shape[0], chunk_size):
        if not use_triton:
            _, _, p = _ref_chunk(hidden[c0:c1], weight, targets[c0:c1], temp[c0:c1])
            p.neg_()
            p.scatter_add_(1, targets[c0:c1, None], torch.ones_like(p[:, :1]))  # onehot - p
            yield c0, c1, (p * (dlogp[c0:c1].to(p.dtype) / temp[c0:c1].to(p.dtype))[:, None]).to(hidden.dtype)
            continue
        lg = buf[: c1 - c0]
        torch.mm(hidden[c0:c1], weight.t(), out=lg)
        selective_logsoftmax_kernel[(c1 - c0,)](
            lg, targets[c0:c1], temp[c0:c1], scratch, scratch, V, lg.stride(0),
            BLOCK_V=block_v, HAS_GRAD=True, HAS_ENTROPY=False, num_warps=8 if block_v >= 2048 else 4,
        )
        yield c0, c1, lg.mul_(dlogp[c0:c1, None].to(lg.dtype))


class _SelectiveLogSoftmax(torch.autograd.Function):
    """forward(hidden, weight, targets, temp, chunk_size, use_triton) -> (logp, entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temp, chunk_size: int, use_triton: bool):
        ctx.use_triton, ctx.chunk_size = use_triton, chunk_size
        ctx.fused = use_triton and not ctx.needs_input_grad[1]  # G formed now: the head is frozen
        if ctx.fused:
            logp, ent, G = _forward_triton(hidden, weight, targets, temp, chunk_size, True, True)
            ctx.save_for_backward(G)
        else:
            logp, ent = _forward(hidden, weight, targets, temp, chunk_size, use_triton, True)
            ctx.save_for_backward(hidden, weight, targets, temp)
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, dlogp, _dent):
        if dlogp is None:
            return None, None, None, None, None, None
        if ctx.fused:
            (G,) = ctx.saved_tensors
            return (G.float() * dlogp.float()[:, None]).to(G.dtype), None, None, None, None, None
        hidden, weight, targets, temp = ctx.saved_tensors
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for c0, c1, g in _dlogits(hidden, weight, targets, temp, dlogp, ctx.chunk_size, ctx.use_triton):
            if dh is not None:
                dh[c0:c1] = g @ weight  # [C, d]
            if dw is not None:
                dw.addmm_(g.t(), hidden[c0:c1])  # [V, d]
        return dh, dw, None, None, None, None


def selective_log_softmax(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          temperature: float | torch.Tensor = 1.0, chunk_size: int = 4096,
                          return_entropy: bool = False, backend: str = "auto"):
    """log softmax(hidden @ weight^T / temperature)[t, targets[t]] for every row t.

    hidden: [T, d] (bf16/fp16/fp32), weight: [V, d] (the LM head: frozen, or trained where it requires
    a gradient), targets: int64 [T] in [0, V), temperature: float or fp32 [T] (per row). Returns logp:
    fp32 [T], differentiable wrt hidden and a trained weight, and with return_entropy also the entropy
    fp32 [T] (not differentiable).
    Peak extra memory: chunk_size x V in hidden's dtype (triton) or about 3 x chunk_size x V fp32
    (torch); a trained head's backward adds d weight, [V, d] in weight's dtype. On the triton path an out-of-range target is not checked (that would sync); its logp
    is garbage, never a fault.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)} must be [T, d] / [V, d]")
    if targets.shape != (hidden.shape[0],) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 [T={hidden.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    use_triton = resolve_backend(backend, hidden.device) == "triton"
    allowed = (torch.float32, torch.float16, torch.bfloat16) + (() if use_triton else (torch.float64,))
    if hidden.dtype != weight.dtype or hidden.dtype not in allowed:
        raise ValueError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one of {allowed} "
                         "(float64: the torch reference only)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    T = hidden.shape[0]
    temp = _temperatures(temperature, T, hidden.device)
    targets = targets.contiguous()
    hidden = hidden.contiguous()  # G = empty_like(hidden) and its row slices are matmul outputs
    if T == 0:
        z = hidden.new_zeros(0, dtype=torch.float32) + hidden.sum() * 0  # keeps the graph for an empty batch
        return (z, z.detach()) if return_entropy else z
    if (hidden.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        logp, ent = _SelectiveLogSoftmax.apply(hidden, weight, targets, temp, chunk_size, use_triton)
    else:
        logp, ent = _forward(hidden, weight, targets, temp, chunk_size, use_triton, return_entropy)
    return (logp, ent) if return_entropy else logp
