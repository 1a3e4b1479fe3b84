"""Fused elementwise parts of the base model's layers for the trainer (`trainer.fuse_elementwise`).

The H200 profile of a trainer step (reports/h200/fused/trainer_profile_eager.txt) showed the GPU spending more
time in Hugging Face's eager elementwise code than in matrix products: RMSNorm upcasts every hidden
state to fp32 and makes five passes over it, rotary embeddings four muls and a cat on q and k, the MLP
a SiLU and a mul, each again in the backward. torch.compile (Inductor) fuses each of those into one
kernel forward and one backward, with the same arithmetic; the projections and the LoRA kernels stay
as they are (the compiled pieces are pure functions between them, so no graph ever holds a LoRA call).

We compile three small functions rather than the layer: the LoRA projections are custom autograd
functions whose metadata changes per micro-batch, and compiling around them would break the graph at
every projection anyway. Shapes are dynamic (the token count changes every micro-batch), so each
function compiles once per process and dtype.
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Qwen3RMSNorm / LlamaRMSNorm, operation for operation
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary_thd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Llama's / Qwen3's apply_rotary_pos_emb (unsqueeze_dim=1), computed in the [B, T, H, D] layout
    of the projections: q, k are [B, H, T, D] transposed views of it, and so are the results. Compiled
    from the model's own function, the results came out [B, H, T, D]-contiguous on the H200, and the
    layout changes cost strided copies both ways: FlashAttention's inputs made contiguous, and
    AOTAutograd coercing the gradients to the traced layout (reports/h200/twelfth)."""
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # [B, T, H, D]
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]
    return ((qt * c) + (_rotate_half(qt) * s)).transpose(1, 2), ((kt * c) + (_rotate_half(kt) * s)).transpose(1, 2)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_compiled: dict[str, object] = {}
_rotary_originals: dict[str, object] = {}  # modeling module name -> its own apply_rotary_pos_emb


def _compile(name: str, fn):
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return _compile("rms_norm", _rms_norm)(hidden_states, self.weight, self.variance_epsilon)


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter: the CPU tests


def _norm_kernel_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if self.weight.requires_grad or not _on_triton(hidden_states):  # the kernel has no weight gradient
        return _norm_forward(self, hidden_states)
    from colora.kernels.rmsnorm import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def elementwise_kernels_from_env() -> bool:
    """COLORA_ELEMENTWISE_KERNELS: "1" or unset (the default) routes the fused model's RMSNorms,
    SiLU-gated products and rotary embedding through colora's Triton kernels (kernels/rmsnorm.py,
    kernels/swiglu.py, kernels/rotary.py: one autograd.Function and one launch a tensor each way)
    instead of torch.compile's functions; "0" keeps the compiled ones. On the H200 the 8-job trainer
    step took 1.721 s with the kernels against 1.986 s without, in one run (reports/h200/twelfth/
    kernels_ab). Anything else is a ValueError (checked before a run: runner.prepare)."""
    from .environment import env_switch

    return env_switch("COLORA_ELEMENTWISE_KERNELS", ("0", "1"), "1") == "1"


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_compile("silu_mul", _silu_mul)(self.gate_proj(x), self.up_proj(x)))


def _mlp_kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _on_triton(x):
        return _mlp_forward(self, x)
    from colora.kernels.swiglu import swiglu

    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def fuse_elementwise(model: torch.nn.Module, kernels: bool = False) -> dict[str, int]:
    """Route the model's RMSNorms, SiLU-gated MLPs and rotary embedding through compiled functions
    (with `kernels`, the RMSNorms whose weight is frozen, the MLPs' SiLU-gated products and the
    rotary embedding through colora's Triton kernels instead). Only modules that match the
    Llama/Qwen3 pattern exactly are touched (an RMSNorm with `weight` and `variance_epsilon`, an MLP
    with gate/up/down projections and a SiLU); anything else keeps its own forward. Returns how many
    of each were fused."""
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0}
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") and isinstance(getattr(mod, "weight", None), torch.Tensor) \
                and isinstance(getattr(mod, "variance_epsilon", None), float):
            mod.forward = types.MethodType(_norm_kernel_forward if kernels else _norm_forward, mod)
            counts["rms_norm"] += 1
        elif all(hasattr(mod, a) for a in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(mod, "act_fn", None)):
            mod.forward = types.MethodType(_mlp_kernel_forward if kernels else _mlp_forward, mod)
            counts["mlp"] += 1
    # The attention layers call their modeling module's apply_rotary_pos_emb by global name; the
    # compiled `_rotary_thd` computes the same thing (tests/test_fusion.py holds it to the original)
    # in the projections' layout; other calls (another unsqueeze_dim) go to the original.
    modeling = sys.modules.get(type(model).__module__)
    orig = getattr(modeling, "apply_rotary_pos_emb", None)
    if orig is not None and not getattr(orig, "_colora_fused", False):
        fused = _compile("rotary_thd", _rotary_thd)

        def wrapper(q, k, cos, sin, unsqueeze_dim=1):
            if unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3:
                return orig(q, k, cos, sin, unsqueeze_dim)
            if wrapper._colora_kernels and _on_triton(q):
                from colora.kernels.rotary import rotary, supported

                if supported(q, k, cos, sin):
                    return rotary(q, k, cos, sin)
            return fused(q, k, cos, sin)

        wrapper._colora_fused = True
        _rotary_originals[modeling.__name__] = orig
        modeling.apply_rotary_pos_emb = wrapper
    if orig is not None:
        # the modeling module's function is shared by its models: the last call's `kernels` decides
        modeling.apply_rotary_pos_emb._colora_kernels = kernels
        counts["rotary"] = 1
    return counts


def restore_rotary() -> None:
    """Give every patched modeling module its own apply_rotary_pos_emb back (the norms and MLPs are
    patched per instance and go with their model)."""
    for name, orig in _rotary_originals.items():
        sys.modules[name].apply_rotary_pos_emb = orig
    _rotary_originals.clear()


def should_fuse(setting: str, device: torch.device | str) -> bool:
    """`trainer.fuse_elementwise`: "on", "off", or "auto" (on for CUDA, where it was measured)."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "on"
