"""colora's kernels: grouped LoRA over rows sorted by job (the `lora` subpackage), a fused selective
log-softmax, and the trainer's elementwise kernels (rmsnorm, swiglu, rotary). docs/kernels.md gives the design.

Each entry point takes `backend`: "triton" (CUDA, or Triton's interpreter with TRITON_INTERPRET=1),
"torch" (the plain reference, the CPU trainer's path) or "auto" (triton on CUDA, torch elsewhere).
"""

from .backend import BACKENDS, resolve_backend
from .logsoftmax import selective_log_softmax
from .lora import LoRABatchMeta, grouped_lora, grouped_lora_packed, grouped_lora_packed_ref, grouped_lora_ref
from .util import upload, upload_aligned

__all__ = [
    "BACKENDS",
    "LoRABatchMeta",
    "grouped_lora",
    "grouped_lora_packed",
    "grouped_lora_packed_ref",
    "grouped_lora_ref",
    "resolve_backend",
    "selective_log_softmax",
    "upload",
    "upload_aligned",
]
