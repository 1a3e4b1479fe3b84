"""The base model's elementwise parts through colora's Triton kernels, for the trainer (`trainer.fuse_elementwise`).

The H200 profile of a trainer step (measured at e034c1e) showed the GPU spending more time in Hugging Face's
eager elementwise code than in matrix products: RMSNorm upcasts every hidden state to fp32 and makes five
passes over it, rotary embeddings four muls and a cat on q and k, the MLP a SiLU and a mul, each again in
the backward. `fuse_elementwise` routes the frozen RMSNorms, the SiLU-gated products and the rotary
embedding through kernels/rmsnorm.py, kernels/swiglu.py and kernels/rotary.py: one autograd.Function and one
launch a tensor each way, in the model's arithmetic (its roundings included), the rotary's results in the
projections' [B, T, H, D] layout. On the H200 the 8-job trainer step took 1.721 s with them against 1.986 s
with torch.compile's fused functions of the same pieces (measured at fd87e62).

Where a kernel cannot run (no CUDA and no Triton interpreter, a trainable norm weight, a rotary call of
another shape) the module keeps the model's own code.
"""

from __future__ import annotations

import sys
import types

import torch

from colora.kernels.backend import triton_runs_on
from colora.kernels.rmsnorm import rms_norm
from colora.kernels.rotary import rotary, supported
from colora.kernels.swiglu import swiglu

_rotary_originals: dict[str, object] = {}  # modeling module name -> its own apply_rotary_pos_emb


def _on_triton(t: torch.Tensor) -> bool:
    return triton_runs_on(t.device)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if self.weight.requires_grad or not _on_triton(hidden_states):  # the kernel has no weight gradient
        return type(self).forward(self, hidden_states)

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if not _on_triton(x):
        return type(self).forward(self, x)

    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def fuse_elementwise(model: torch.nn.Module) -> dict[str, int]:
    """Route the model's RMSNorms, SiLU-gated MLPs and rotary embedding through colora's Triton kernels.
    Only modules that match the Llama/Qwen3 pattern exactly are touched (an RMSNorm with `weight` and
    `variance_epsilon`, an MLP with gate/up/down projections and a SiLU); anything else keeps its own
    forward. Returns how many of each were routed."""
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0}
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RMSNorm") and isinstance(getattr(mod, "weight", None), torch.Tensor) \
                and isinstance(getattr(mod, "variance_epsilon", None), float):
            mod.forward = types.MethodType(_norm_forward, mod)
            counts["rms_norm"] += 1
        elif all(hasattr(mod, a) for a in ("gate_proj", "up_proj", "down_proj")) and _is_silu(getattr(mod, "act_fn", None)):
            mod.forward = types.MethodType(_mlp_forward, mod)
            counts["mlp"] += 1
    # The attention layers call their modeling module's apply_rotary_pos_emb by global name; the kernel
    # computes the same thing (tests/test_fusion.py and tests/test_kernel_elementwise.py hold it to the original) in
    # the projections' layout; other calls (another unsqueeze_dim, shapes it does not take) go to the original.
    modeling = sys.modules.get(type(model).__module__)
    orig = getattr(modeling, "apply_rotary_pos_emb", None)
    if orig is not None and not getattr(orig, "_colora_fused", False):
        def wrapper(q, k, cos, sin, unsqueeze_dim=1):
            if unsqueeze_dim == 1 and q.dim() == 4 and cos.dim() == 3 and _on_triton(q):
                if supported(q, k, cos, sin):
                    return rotary(q, k, cos, sin)
            return orig(q, k, cos, sin, unsqueeze_dim)

        wrapper._colora_fused = True
        _rotary_originals[modeling.__name__] = orig
        modeling.apply_rotary_pos_emb = wrapper
    if orig is not None:
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
