"""Grouped LoRA as a differentiable op: `grouped_lora` (one projection) and `grouped_lora_packed`
(several projections of the same input, q|k|v or gate|up, sharing one read of x).

Backward of y = s * (x A^T) B^T with h = x A^T, per job j:
  dB_j = s_j dy_j^T h_j,  dh_j = s_j dy_j B_j,  dA_j = dh_j^T x_j,  dx_j = dh_j A_j.
h (small: [T, about slices * max_rank]) is saved from the forward rather than recomputed.

Masters: with `compute=`, A and B are the fp32 masters the gradients belong to and the arithmetic
runs on the given copies in x's dtype (made once per optimizer step by the caller); the kernels
then write dA and dB in fp32 straight into the masters' gradients, where a differentiable cast
per micro-batch would launch a cast of every A and B forward and another of every gradient back.

Packing: the slices' A are gathered so that each job's rows sit side by side (q_j | k_j | v_j), a
rank-(slices * r_j) adapter for the shrink, the dx expand and dA; h then holds [h_q | h_k | h_v] per
row, and each slice's expand, dh shrink and dB reduce read or write its own third.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend import resolve_backend
from .common import h_width
from .meta import FloatsLike, IntsLike, LoRABatchMeta
from .policy import Launch, check_launch, fuse_dy_pays, fuse_expand_pays
from .reference import grouped_lora_ref
from .sgrad import lora_expand, lora_sgrad
from .shrink import lora_shrink, lora_shrink_expand, lora_shrink_sgrad


class _GroupedLoRA(torch.autograd.Function):
    """forward(x, A_packed, meta, n_slices, fuse, compute, weights, launch, *Bs, *bases) -> one output per slice.

    x: [T, d_in], A_packed: [slices * R, d_in] (rows per job: slice 0 | slice 1 | ...),
    Bs[s]: [d_out_s, R], bases[s]: [T, d_out_s] (optional, added to in place and returned).
    compute: None, or (A_packed, [B_s^T]) in x's dtype to compute with, A and Bs then being the
    masters (any float dtype) whose gradients are written in their own dtype.
    weights: None, or the frozen base projections [W_s: [d_out_s, d_in]] (no bases then): each
    output is the LoRA delta plus x W_s^T, and dx the LoRA's plus dy_s W_s, each base product added by
    cuBLAS's epilogue (beta = 1) after the kernels wrote the LoRA's part: the GEMM reads that part under
    its arithmetic, where the kernels adding into the base's output read and write it again, and autograd
    summing two dx would add a pass more. Measured on the H200 at 20758dc: the trainer's four calls a layer
    (rank 16, 8 x 6,144 tokens) 1.4-2.6% less than with x W^T first.
    fuse: (fuse_dy, fuse_expand): dh and dB in one pass over dy; with one slice, the expands in the
    launches that compute h and dh (x -> h -> y, dy -> dh -> dx), else lora_expand writes y and dx.
    launch: None, or launch parameters for every launcher (policy.TUNABLE).
    """

    @staticmethod
    def forward(ctx, x, A, meta: LoRABatchMeta, n_slices: int, fuse: tuple[bool, bool], compute, weights,
                launch: Launch | None, *rest):
        Bs, bases = rest[:n_slices], rest[n_slices:]
        packed = meta.packed(n_slices)
        T = x.shape[0]
        # the gradients' dtypes: the masters' when computing on copies, else the inputs' own
        ctx.grad_dtypes = (A.dtype, [B.dtype for B in Bs])
        if compute is not None:
            A, Bts = compute
        else:
            # B^T copies ([R, d_out], tiny): contiguous along d_out, so both the expand here and the dh
            # shrink of the backward read them with wide loads
            Bts = [B.t().contiguous() for B in Bs]
        fuse_expand = fuse[1] and n_slices == 1  # a packed call's dx needs every slice's dh first
        # [T, >= slices * max_rank], see h_width; zero-filled for the separate expand, which reads its
        # padding lanes. With the expand fused, h's only readers (the backward's dy pass and sgrad)
        # carry its lanes >= r_j into rows of their fp32 partials that the reduce never stores.
        h = (x.new_empty if fuse_expand else x.new_zeros)((T, h_width(meta, n_slices)))
        if not fuse_expand:
            lora_shrink(x, A, packed, h, launch=launch)
        ys = []
        for s, Bt in enumerate(Bts):
            out = bases[s] if bases else x.new_empty((T, Bt.shape[1]))
            if fuse_expand:
                ys.append(lora_shrink_expand(x, A, Bt.t(), meta, h, out, scale_out=True, accumulate=bool(bases),
                                             launch=launch))
            else:
                ys.append(lora_expand(h, Bt.t(), meta, out, h_slice=s, scale=True, accumulate=bool(bases),
                                      launch=launch))
            if weights is not None:
                out.addmm_(x, weights[s].t())  # the base projection after the delta (see the class docstring)
        if bases:
            ctx.mark_dirty(*bases)
        ctx.save_for_backward(x, A, h, *Bts)
        ctx.meta, ctx.n_slices, ctx.n_bases = meta, n_slices, len(bases)
        ctx.fuse_dy, ctx.fuse_expand = fuse[0], fuse_expand
        ctx.weights, ctx.launch = weights, launch
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        x, A, h, *Bts = ctx.saved_tensors
        meta, S, launch = ctx.meta, ctx.n_slices, ctx.launch
        a_dtype, b_dtypes = ctx.grad_dtypes
        packed = meta.packed(S)
        need = ctx.needs_input_grad
        need_dh = need[0] or need[1]
        dys = [None if d is None else d.to(x.dtype) for d in dys]
        dys = [None if d is None else (d if d.stride(-1) == 1 else d.contiguous()) for d in dys]
        # dx is written by the dy pass (its expand fused: one slice with a dy) or by lora_expand; then the base
        # projections' dy_s W_s are added (see the class docstring)
        fused_dx = ctx.fuse_expand and dys[0] is not None
        dx = torch.empty_like(x) if need[0] else None
        # slices without an incoming gradient keep dh = 0; lora_expand reads its padding lanes (as h's in the
        # forward). One slice whose dy pass writes every lane read: no fill.
        dh = ((torch.empty_like if fused_dx else torch.zeros_like)(h)) if need_dh else None
        fused_dx = (A.t(), dx, False) if (fused_dx and need[0]) else None
        dBs = []
        for s, (Bt, dy) in enumerate(zip(Bts, dys)):
            dBt = None
            if need[8 + s]:  # x, A, meta, n_slices, fuse, compute, weights, launch, then the Bs
                # [R, d_out_s], returned as dB = dBt^T: the kernels write every element (each job's rows,
                # zeros where it has no tokens), so it needs no zero fill; zeros without a dy
                dBt = (torch.empty if dy is not None else torch.zeros)(Bt.shape, dtype=b_dtypes[s], device=Bt.device)
            if dy is not None:
                if need_dh and dBt is not None and ctx.fuse_dy:
                    lora_shrink_sgrad(dy, Bt, h, meta, dh, dBt, h_slice=s, dx=fused_dx, launch=launch)  # one read of dy
                else:
                    if fused_dx is not None:
                        lora_shrink_expand(dy, Bt, fused_dx[0], meta, dh, fused_dx[1], scale_h=True, launch=launch)
                    elif need_dh:
                        lora_shrink(dy, Bt, meta, dh, h_slice=s, scale=True, launch=launch)
                    if dBt is not None:
                        lora_sgrad(h, dy, meta, dBt, p_slice=s, scale=True, launch=launch)
            dBs.append(None if dBt is None else dBt.t())
        dA = torch.empty(A.shape, dtype=a_dtype, device=A.device) if need[1] else None
        if dx is not None and fused_dx is None:
            lora_expand(dh, A.t(), packed, dx, launch=launch)
        if dA is not None:
            lora_sgrad(dh, x, packed, dA, launch=launch)
        if dx is not None and ctx.weights is not None:
            for W, dy in zip(ctx.weights, dys):
                if dy is not None:
                    dx.addmm_(dy, W)  # dx += dy_s W_s, the base projection's part
        return (dx, dA, None, None, None, None, None, None, *dBs, *(dys[:ctx.n_bases]))


def _meta_for(x: torch.Tensor, seg_start, rank_start, scale, meta: LoRABatchMeta | None) -> LoRABatchMeta:
    if meta is not None:
        return meta
    if seg_start is None or rank_start is None or scale is None:
        raise ValueError("pass seg_start, rank_start and scale, or meta=LoRABatchMeta.build(...)")
    return LoRABatchMeta.build(seg_start, rank_start, scale, x.device)


def _check_inputs(x: torch.Tensor, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor], meta: LoRABatchMeta,
                  backend: str, compute: tuple | None = None) -> None:
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
        if compute is None and (A.dtype != x.dtype or B.dtype != x.dtype):
            raise ValueError(f"x, A and B must share one dtype: {x.dtype}, {A.dtype}, {B.dtype}")
    if compute is not None:
        Acs, Btcs = compute
        if len(Acs) != len(As) or len(Btcs) != len(Bs):
            raise ValueError(f"compute holds {len(Acs)} A and {len(Btcs)} B^T copies for {len(As)} slices")
        for A, B, Ac, Btc in zip(As, Bs, Acs, Btcs):
            if Ac.shape != A.shape or Btc.shape != B.shape[::-1] or not Btc.is_contiguous():
                raise ValueError(f"compute copies {tuple(Ac.shape)} / {tuple(Btc.shape)} must be A's shape "
                                 f"{tuple(A.shape)} and B^T's {tuple(B.shape[::-1])}, contiguous")
            if Ac.dtype != x.dtype or Btc.dtype != x.dtype or Ac.requires_grad or Btc.requires_grad:
                raise ValueError(f"compute copies must be in x's dtype {x.dtype} ({Ac.dtype}, {Btc.dtype}) "
                                 "and outside autograd (the gradients go to A and B)")


def _check_base(x: torch.Tensor, base, Bs, add_to) -> tuple[torch.Tensor, ...] | None:
    """The base weights as a tuple (None without), checked: frozen, [d_out_s, d_in] in x's dtype and device."""
    if base is None:
        return None
    if add_to is not None:
        raise ValueError("pass add_to (the base's output) or base (its weight), not both")
    if len(base) != len(Bs):
        raise ValueError(f"base has {len(base)} weights, expected one per slice ({len(Bs)})")
    for W, B in zip(base, Bs):
        if W.shape != (B.shape[0], x.shape[1]) or W.dtype != x.dtype or W.device != x.device:
            raise ValueError(f"base weight {tuple(W.shape)} {W.dtype} on {W.device} must be [{B.shape[0]}, "
                             f"{x.shape[1]}] in x's dtype {x.dtype} on {x.device}")
        if W.requires_grad:
            raise ValueError("base weights must be frozen (requires_grad=False): the op computes no gradient for them")
    return tuple(base)


def _plus_base(x: torch.Tensor, y: torch.Tensor, W: torch.Tensor | None, add_to: torch.Tensor | None) -> torch.Tensor:
    """The torch path's output: y plus the base projection's (x W^T, or the given add_to), if any."""
    if W is not None:
        return x @ W.t() + y
    return y if add_to is None else add_to + y


def grouped_lora(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, seg_start: IntsLike | None = None,
                 rank_start: IntsLike | None = None, scale: FloatsLike | None = None, *, backend: str = "auto",
                 meta: LoRABatchMeta | None = None, add_to: torch.Tensor | None = None,
                 fuse_dy: bool | None = None, compute: tuple[torch.Tensor, torch.Tensor] | None = None,
                 base: torch.Tensor | None = None, fuse_expand: bool | None = None,
                 launch: Launch | None = None) -> torch.Tensor:
    """y = for each job j: scale[j] * (x_j @ A_j^T) @ B_j^T, differentiable wrt x, A and B.

    x: [T, d_in] rows sorted by job (job j: x[seg_start[j]:seg_start[j+1]]), A: [R, d_in] (job j owns
    A[rank_start[j]:rank_start[j+1]], r_j may be 0), B: [d_out, R], scale: fp32 [J]
    -> [T, d_out] in x.dtype (fp32 accumulation on the triton path).
    seg_start / rank_start / scale may be tensors or Python lists; tensors on the GPU cost a sync per
    call, so a layer stack should build `meta = LoRABatchMeta.build(...)` once per micro-batch and pass
    `meta=` (the three positional arguments are then ignored).
    add_to: [T, d_out], the base projection's output: returns add_to + y, written into add_to in
    place on the triton path (saves writing and re-reading y); gradients flow to it unchanged.
    fuse_dy: compute dh and dB in one pass over dy (None: when it pays, see policy.fuse_dy_pays).
    fuse_expand: write y from the launch that computes h, and dx from the one that computes dh
    (None: when it pays, see policy.fuse_expand_pays).
    compute: (A_c [R, d_in], Bt_c [R, d_out] contiguous) in x's dtype, outside autograd, to compute
    with; A and B are then masters in their own dtype (the trainer's fp32 adapters) and get their
    gradients in it (see the module docstring). The torch path casts A and B instead.
    base: the frozen base projection's weight W [d_out, d_in] in x's dtype (instead of add_to):
    returns x W^T + y, the base product computed inside the op, whose backward adds dy W to dx in
    the same matmul (see _GroupedLoRA).
    launch: parameters that replace the device table's for named launches of this call, e.g.
    {"expand": {"block_n": 256, "warps": 8}} (policy.TUNABLE; the tuner's candidates, the tests' small tiles);
    an unknown launch or parameter is a ValueError. The triton path only.
    """
    meta = _meta_for(x, seg_start, rank_start, scale, meta)
    backend = resolve_backend(backend, x.device)
    check_launch(launch)
    _check_inputs(x, [A], [B], meta, backend, None if compute is None else ([compute[0]], [compute[1]]))
    weights = _check_base(x, None if base is None else [base], [B], add_to)
    if backend == "torch":
        y = grouped_lora_ref(x, A.to(x.dtype), B.to(x.dtype), meta)
        return _plus_base(x, y, base, add_to)
    x = x if x.stride(-1) == 1 else x.contiguous()
    bases = () if add_to is None else (add_to,)
    fuse = (fuse_dy_pays(meta, x.shape[1], B.shape[0], x.dtype) if fuse_dy is None else fuse_dy,
            fuse_expand_pays(meta, 1, x.shape[1], B.shape[0]) if fuse_expand is None else fuse_expand)
    copies = None if compute is None else (compute[0], [compute[1]])
    return _GroupedLoRA.apply(x, A, meta, 1, fuse, copies, weights, launch, B, *bases)[0]


def grouped_lora_packed(x: torch.Tensor, As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor],
                        meta: LoRABatchMeta, *, backend: str = "auto",
                        add_to: Sequence[torch.Tensor] | None = None, fuse_dy: bool | None = None,
                        compute: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
                        base: Sequence[torch.Tensor] | None = None,
                        fuse_expand: bool | None = None, launch: Launch | None = None) -> list[torch.Tensor]:
    """[grouped_lora(x, As[s], Bs[s], meta=meta) for each slice s], with one read of x in the forward
    and one dx in the backward. x: [T, d_in], As[s]: [R, d_in], Bs[s]: [d_out_s, R] (same rank layout
    for every slice); add_to: optional list of [T, d_out_s] base outputs, as in `grouped_lora`;
    compute: ([A_c per slice], [Bt_c per slice]), as in `grouped_lora`; base: the slices' frozen base
    weights [d_out_s, d_in], as in `grouped_lora` (one dx for the base products and the LoRA's);
    fuse_dy, fuse_expand, launch: as in `grouped_lora` (the expands fuse with one slice only)."""
    if len(As) != len(Bs) or not As:
        raise ValueError(f"need as many A as B, at least one: got {len(As)} and {len(Bs)}")
    if add_to is not None and len(add_to) != len(Bs):
        raise ValueError(f"add_to has {len(add_to)} tensors, expected one per slice ({len(Bs)})")
    backend = resolve_backend(backend, x.device)
    check_launch(launch)
    _check_inputs(x, As, Bs, meta, backend, compute)
    weights = _check_base(x, base, Bs, add_to)
    S = len(As)
    if backend == "torch":
        ys = [grouped_lora_ref(x, A.to(x.dtype), B.to(x.dtype), meta) for A, B in zip(As, Bs)]
        return [_plus_base(x, y, None if base is None else base[s], None if add_to is None else add_to[s])
                for s, y in enumerate(ys)]
    x = x if x.stride(-1) == 1 else x.contiguous()

    def pack(ts):  # [S * R, d_in]
        return ts[0] if S == 1 else torch.cat(list(ts), 0).index_select(0, meta.pack_index(S))

    copies = None
    if compute is not None:
        with torch.no_grad():
            copies = (pack(compute[0]), list(compute[1]))
    fuse = (fuse_dy_pays(meta, x.shape[1], Bs[0].shape[0], x.dtype) if fuse_dy is None else fuse_dy,
            fuse_expand_pays(meta, S, x.shape[1], Bs[0].shape[0]) if fuse_expand is None else fuse_expand)
    return list(_GroupedLoRA.apply(x, pack(As), meta, S, fuse, copies, weights, launch, *Bs, *(add_to or ())))
