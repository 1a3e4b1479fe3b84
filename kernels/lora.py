"""Grouped LoRA as a differentiable op: `grouped_lora` (one projection) and `grouped_lora_packed`
(several projections of the same input, q|k|v or gate|up, sharing one read of x).

Backward of y = s * (x A^T) B^T with h = x A^T, per job j:
  dB_j = s_j dy_j^T h_j,  dh_j = s_j dy_j B_j,  dA_j = dh_j^T x_j,  dx_j = dh_j A_j.
h (small: [T, about slices * max_rank]) is saved from the forward rather than recomputed.

Packing: the slices' A are gathered so that each job's rows sit side by side (q_j | k_j | v_j), a
rank-(slices * r_j) adapter for the shrink, the dx expand and dA; h then holds [h_q | h_k | h_v] per
row, and each slice's expand, dh shrink and dB reduce read or write its own third.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backend import resolve_backend
from .lora_meta import FloatsLike, IntsLike, LoRABatchMeta
from .lora_ops import fuse_dy_pays, h_width, lora_expand, lora_sgrad, lora_shrink, lora_shrink_sgrad
from .lora_ref import grouped_lora_ref


class _GroupedLoRA(torch.autograd.Function):
    """forward(x, A_packed, meta, n_slices, fuse_dy, *Bs, *bases) -> one output per slice.

    x: [T, d_in], A_packed: [slices * R, d_in] (rows per job: slice 0 | slice 1 | ...),
    Bs[s]: [d_out_s, R], bases[s]: [T, d_out_s] (optional, added to in place and returned).
    """

    @staticmethod
    def forward(ctx, x, A, meta: LoRABatchMeta, n_slices: int, fuse_dy: bool, *rest):
        Bs, bases = rest[:n_slices], rest[n_slices:]
        packed = meta.packed(n_slices)
        T = x.shape[0]
        h = x.new_zeros((T, h_width(meta, n_slices)))  # [T, >= slices * max_rank], see h_width
        lora_shrink(x, A, packed, h)
        # B^T copies ([R, d_out], tiny): contiguous along d_out, so both the expand here and the dh
        # shrink of the backward read them with wide loads
        Bts = [B.t().contiguous() for B in Bs]
        ys = []
        for s, Bt in enumerate(Bts):
            out = bases[s] if bases else x.new_empty((T, Bt.shape[1]))
            ys.append(lora_expand(h, Bt.t(), meta, out, h_slice=s, scale=True, accumulate=bool(bases)))
        if bases:
            ctx.mark_dirty(*bases)
        ctx.save_for_backward(x, A, h, *Bts)
        ctx.meta, ctx.n_slices, ctx.n_bases, ctx.fuse_dy = meta, n_slices, len(bases), fuse_dy
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, A, h, *Bts = ctx.saved_tensors
        meta, S = ctx.meta, ctx.n_slices
        packed = meta.packed(S)
        need = ctx.needs_input_grad
        need_dh = need[0] or need[1]
        dys = [None if d is None else d.to(x.dtype) for d in dys]
        dys = [None if d is None else (d if d.stride(-1) == 1 else d.contiguous()) for d in dys]
        dh = torch.zeros_like(h) if need_dh else None  # slices without an incoming gradient keep dh = 0
        dBs = []
        for s, (Bt, dy) in enumerate(zip(Bts, dys)):
            need_dB = need[5 + s]
            # [d_out_s, R]; the kernels write every element of dB^T (each job's rows, zeros where it
            # has no tokens), so it needs no zero fill, one launch less a slice; zeros without a dy
            dB = (Bt.new_empty if dy is not None else Bt.new_zeros)(Bt.shape[::-1]) if need_dB else None
            if dy is not None:
                if need_dh and need_dB and ctx.fuse_dy:
                    lora_shrink_sgrad(dy, Bt, h, meta, dh, dB.t(), h_slice=s)  # one read of dy
                else:
                    if need_dh:
                        lora_shrink(dy, Bt, meta, dh, h_slice=s, scale=True)
                    if need_dB:
                        lora_sgrad(h, dy, meta, dB.t(), p_slice=s, scale=True)
            dBs.append(dB)
        dx = lora_expand(dh, A.t(), packed, torch.empty_like(x)) if need[0] else None
        dA = lora_sgrad(dh, x, packed, torch.empty_like(A)) if need[1] else None
        return (dx, dA, None, None, None, *dBs, *(dys[:ctx.n_bases]))


def _meta_for(x: torch.Tensor, seg_start, rank_start, scale, meta: LoRABatchMeta | None) -> LoRABatchMeta:
    if meta is not None:
        return meta
    if seg_start is None or rank_start is None or scale is None:
        raise ValueError("pass seg_start, rank_start and scale, or meta=LoRABatchMeta.build(...)")
    return LoRABatchMeta.build(seg_start, rank_start, scale, x.device)


def _check_inputs(x: torch.Tensor, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], meta: LoRABatchMeta,
                  backend: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, d_in], got shape {tuple(x.shape)}")
    if x.shape[0] != meta.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows, seg_start[-1] is {meta.num_tokens}")
    allowed = (torch.float32, torch.float16, torch.bfloat16) + ((torch.float64,) if backend == "torch" else ())
    if x.dtype not in allowed:
        raise ValueError(f"x dtype {x.dtype} is not one of {allowed} (float64: the torch reference only)")
    for A, B in zip(As, Bs):
        if A.shape != (meta.total_rank, x.shape[1]) or B.dim() != 2 or B.shape[1] != meta.total_rank:
            raise ValueError(f"A {tuple(A.shape)} / B {tuple(B.shape)} must be [R, d_in] / [d_out, R] with "
                             f"R = rank_start[-1] = {meta.total_rank}, d_in = {x.shape[1]}")
        if A.dtype != x.dtype or B.dtype != x.dtype:
            raise ValueError(f"x, A and B must share one dtype: {x.dtype}, {A.dtype}, {B.dtype}")


def grouped_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, seg_start: IntsLike | None = None,
                 rank_start: IntsLike | None = None, scale: FloatsLike | None = None, *, backend: str = "auto",
                 meta: LoRABatchMeta | None = None, add_to: torch.Tensor | None = None,
                 fuse_dy: bool | None = None) -> torch.Tensor:
    """y = for each job j: scale[j] * (x_j @ A_j^T) @ B_j^T, differentiable wrt x, A and B.

    x: [T, d_in] rows sorted by job (job j: x[seg_start[j]:seg_start[j+1]]), A: [R, d_in] (job j owns
    A[rank_start[j]:rank_start[j+1]], r_j may be 0), B: [d_out, R], scale: fp32 [J]
    -> [T, d_out] in x.dtype (fp32 accumulation on the triton path).
    seg_start / rank_start / scale may be tensors or Python lists; tensors on the GPU cost a sync per
    call, so a layer stack should build `meta = LoRABatchMeta.build(...)` once per micro-batch and pass
    `meta=` (the three positional arguments are then ignored).
    add_to: [T, d_out], the base projection's output: returns add_to + y, written into add_to in
    place on the triton path (saves writing and re-reading y); gradients flow to it unchanged.
    fuse_dy: compute dh and dB in one pass over dy (None: when it pays, see lora_ops.fuse_dy_pays).
    """
    meta = _meta_for(x, seg_start, rank_start, scale, meta)
    backend = resolve_backend(backend, x.device)
    _check_inputs(x, [A], [B], meta, backend)
    if backend == "torch":
        y = grouped_lora_ref(x, A, B, meta)
        return y if add_to is None else add_to + y
    x = x if x.stride(-1) == 1 else x.contiguous()
    bases = () if add_to is None else (add_to,)
    fuse = fuse_dy_pays(meta) if fuse_dy is None else fuse_dy
    return _GroupedLoRA.apply(x, A, meta, 1, fuse, B, *bases)[0]


def grouped_lora_packed(x: torch.Tensor, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor],
                        meta: LoRABatchMeta, *, backend: str = "auto",
                        add_to: Sequence[torch.Tensor] | None = None, fuse_dy: bool | None = None
                        ) -> list[torch.Tensor]:
    """[grouped_lora(x, As[s], Bs[s], meta=meta) for each slice s], with one read of x in the forward
    and one dx in the backward. x: [T, d_in], As[s]: [R, d_in], Bs[s]: [d_out_s, R] (same rank layout
    for every slice); add_to: optional list of [T, d_out_s] base outputs, as in `grouped_lora`."""
    if len(As) != len(Bs) or not As:
        raise ValueError(f"need as many A as B, at least one: got {len(As)} and {len(Bs)}")
    if add_to is not None and len(add_to) != len(Bs):
        raise ValueError(f"add_to has {len(add_to)} tensors, expected one per slice ({len(Bs)})")
    backend = resolve_backend(backend, x.device)
    _check_inputs(x, As, Bs, meta, backend)
    S = len(As)
    if backend == "torch":
        ys = [grouped_lora_ref(x, A, B, meta) for A, B in zip(As, Bs)]
        return ys if add_to is None else [b + y for b, y in zip(add_to, ys)]
    x = x if x.stride(-1) == 1 else x.contiguous()
    A = As[0] if S == 1 else torch.cat(list(As), 0).index_select(0, meta.pack_index(S))  # [S * R, d_in]
    fuse = fuse_dy_pays(meta) if fuse_dy is None else fuse_dy
    return list(_GroupedLoRA.apply(x, A, meta, S, fuse, *Bs, *(add_to or ())))
