"""Padding-free micro-batches: every sequence of a micro-batch back to back in one row, attention kept
inside each sequence. The trainer's default on CUDA (`packed_by_default`; `MultiJobTrainer(packed_rows=)`).

Why: the trainer pads each micro-batch's rows to its longest (rows x longest <= trainer.
micro_batch_tokens). A group of the reference workload's overlap arm (4 jobs x 64 sequences, 40 + 8-256
tokens) is ~39k real tokens padded to ~56k in two micro-batches; one micro-batch of the same rows
would need ~80k padded tokens, more memory than the trainer has beside the engine. On the H200 each
micro-batch costs ~0.2 s of host work (measured at c41a630: 0.662 s for such a group in two
micro-batches against 0.458 s in one). Packed, the group is one micro-batch of its real tokens, and no
padded token is computed. Measured on the H200 at a9f4f4f: with micro-batches of 49,152 tokens
the overlap_mps arm's training step fell from 1.07 to 0.53 s (medians) and the arm made 6386 steps/h
against 5098 padded, in one process on one engine.

How: the micro-batch is one row of T tokens; position ids restart at 0 for every sequence (the
rotary embedding sees each sequence as alone); the attention is `varlen_attention`, registered with
transformers' AttentionInterface as ATTN, which receives the sequences' cumulative starts
(`cu_seq_lens_q`, as flash-attention's varlen API) from the model's forward: on CUDA in fp16/bf16
torch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen kernels, torch >= 2.10;
FlashAttention has no fp32), otherwise one causal SDPA call per sequence. transformers builds no mask
for an attention it has no mask function for, so nothing of size T x T exists.

On the CPU the default stays padded: the per-sequence SDPA loop is a reference there, not a speed-up
(nothing was measured on the CPU), and the CPU tests hold the packed step to the padded one (they ask
the trainer for packed rows with `packed_rows=True`).
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import torch

ATTN = "colora_varlen"


def packed_by_default(device: torch.device | str) -> bool:
    """Whether the trainer on `device` packs its micro-batches' rows unless told: on CUDA, where it was
    measured (the A/B above), and not elsewhere."""
    return torch.device(device).type == "cuda"


def use_packed_attention(model: torch.nn.Module) -> None:
    """Register `varlen_attention` with transformers and make `model` use it. Every forward must then
    pass `cu_seq_lens_q` and `max_length_q` (one row of back-to-back sequences)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN, varlen_attention)
    model.config._attn_implementation = ATTN


@functools.lru_cache(maxsize=1)
def _torch_varlen():
    """torch's varlen attention and how to ask it for causal attention (torch 2.10: is_causal=True;
    later: window_size=(-1, 0)), or None where torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, sliding_window=None, **kwargs):
    """Causal attention within each sequence of one packed row, in transformers' attention interface:
    query [1, Hq, T, D], key/value [1, Hkv, T, D] -> ([1, T, Hq, D], None). `cu_seq_lens_q`: int32
    [S+1], the sequences' starts and T; `max_length_q`: the longest sequence.

    The inputs are transposed views of the projections' [1, T, H, D] outputs (the fused rotary keeps
    that layout: colora/training/fusion.py), so FlashAttention gets them without a copy. `squeeze(0)`, not
    `[0]`: the backward of indexing builds a zero tensor and copies the gradient into it (a strided
    copy of q's, k's and v's gradients per layer on the H200, measured at 4139214)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(f"attention {ATTN!r} needs cu_seq_lens_q and max_length_q (colora's packed rows)")
    if sliding_window is not None or dropout:
        raise ValueError(f"attention {ATTN!r}: no sliding window or dropout (got {sliding_window}, {dropout})")
    if query.shape[0] != 1:
        raise ValueError(f"attention {ATTN!r} takes one packed row, got a batch of {query.shape[0]}")
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)  # FlashAttention has no fp32
    varlen = _torch_varlen() if flash else None
    if varlen is not None:
        fn, causal, gqa = varlen
        cu = cu_seq_lens_q.to(torch.int32)
        n = int(max_length_q)
        out = _flash_varlen(fn, q.contiguous(), k.contiguous(), v.contiguous(), cu, n, scaling, causal, gqa)
        return out.unsqueeze(0), None
    # the reference: one causal SDPA call per sequence
    bounds = cu_seq_lens_q.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qa, ka, va = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qa, ka, va, is_causal=True, scale=scaling, enable_gqa=ka.shape[0] != qa.shape[0]).transpose(0, 1))
    return torch.cat(outs, 0).unsqueeze(0), None


_repeat_kv: list[bool] = []  # [True] once torch's varlen attention refused K/V with fewer heads than Q


def _flash_varlen(fn, q, k, v, cu, max_len, scaling, causal, gqa):
    """FlashAttention's varlen call with grouped-query K/V as they are: its kernels take fewer K/V
    heads than Q heads (torch 2.11 passes them through without an `enable_gqa` parameter: same
    output and K/V gradients as with K/V repeated, measured at 4139214). Repeating
    them costs a copy of K and V forward and a reduction of their gradients backward per layer
    (~100 ms of a 2 s trainer step on the H200). A torch that refuses them gets them repeated."""
    extra = {"enable_gqa": True} if gqa else {}
    if k.shape[1] != q.shape[1] and not gqa and _repeat_kv:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    try:
        return fn(q, k, v, cu, cu, max_len, max_len, scale=scaling, **causal, **extra)
    except RuntimeError as e:
        if k.shape[1] == q.shape[1] or gqa or isinstance(e, torch.OutOfMemoryError):
            raise
        _repeat_kv.append(True)
        return _flash_varlen(fn, q, k, v, cu, max_len, scaling, causal, gqa)


def cumulative_starts(lengths: np.ndarray) -> np.ndarray:
    """int64 [S+1]: 0, then the running sum of the sequences' lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
