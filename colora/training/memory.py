"""What one training pass holds in memory, and the micro-batch that fits a budget.

The trainer's memory beyond its base weights is the adapters' state (per job) and, per pass, the
activations its backward keeps, the log-softmax's chunk over the vocabulary and the backward's own
tensors. `pass_fit` sizes `trainer.micro_batch_tokens` (and whether to recompute activations, and the
log-softmax's rows per chunk) for a byte budget: the memory planner (colora/run/memory.py) gives it what
the GPU has beside the engine; a trainer built without a plan (the service's, a test's) gives it
`default_budget` of its device.

Measured and estimated, per token of a pass (B: the model's dtype bytes):
- Activations kept for the backward: B x layers x (4 x intermediate + 4 x hidden + 2 x q width + 2 x KV
  width + the adapted projections' ranks), counted with torch's saved-tensor hooks on the CPU trainer
  (SmolLM2-135M's shape in fp32: 1.23 MB a token). On the GPU, reports/trainer_step's peak of 62.6 GiB
  at 49,152 tokens (Qwen3-0.6B's shape, bf16, 8 jobs of rank 16) less its fixed parts (weights 1.1 GiB,
  the adapters' state 2.9, the log-softmax buffer 1.2) is 1.25 MB a token against the count's 1.27
  (measured); with the items below the estimate of that step is 70.5 GiB. On an 80 GB H100 the same
  49,152-token passes ran out of memory beside an engine of 0.35 (the trainer's process at 49 GiB,
  CUDA's message at e30f8d7).
- With gradient checkpointing (each decoder layer recomputed in the backward): each layer's input
  (B x hidden a layer) plus one layer's activations while it is recomputed. CPU, SmolLM2's shape in
  1,024-token passes: 0.82 GB of peak growth against 1.93 GB without (measured); on the GPU an estimate.
- The backward's own tensors (activation gradients): one layer's activations more (an estimate).
- The allocator's slack: x1.08 on the GPU (an estimate: the measured peaks above are torch's allocated
  bytes, the card also holds what its caching allocator keeps); x1.5 on the CPU, the largest ratio of
  peak RSS growth to the count seen on the CPU trainer (1.2-1.5, tiny and SmolLM2 shapes, measured with
  large blocks given back to the system: `return_freed_host_memory`).
- The log-softmax (colora.kernels.selective_log_softmax), per chunk of rows: the Triton path's logits
  buffer (rows x vocab x B) and, per target token, G and its fp32 gradient (hidden x (2B + 4)); the
  torch path (the CPU's) about 3 x rows x vocab fp32.
- Adapters' state, per parameter of a job's adapter: 38 bytes (fp32 weight, its gradient, the step's
  stacked leaf and its gradient, AdamW's two moments, the copies of weight and moments kept to undo a
  diverged step, the compute copy in bf16): counted from colora/training/lora.py and adamw.py.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

from colora.models.shape import ModelShape

LORA_STATE_BYTES = 38  # bytes per adapter parameter of a job (the docstring's last item)
GPU_SLACK, CPU_SLACK = 1.08, 1.5
# The largest micro-batch planned: on a GPU 49,152 tokens, the throughput workload's setting (a group of 4
# jobs in one packed pass, measured fastest at 0e15773); on the CPU 16,384 (nothing measured there).
MAX_TOKENS = {"cuda": 49152, "cpu": 16384}
# Below this many tokens a pass recomputes activations rather than run that small: on a GPU each pass
# costs ~0.2 s of host work whatever its size (colora/training/packing.py), a recompute a third more
# compute (an estimate, not measured against each other); on the CPU small passes cost little.
MIN_FAST_TOKENS = {"cuda": 8192, "cpu": 512}
CPU_BUDGET = 2 << 30  # a trainer without a plan on the CPU: at most this for a pass (and a quarter of free RAM)
GPU_SHARE = 0.5  # ... on a GPU: this share of what is free when it is built (its tenants' adapters come later)
LOGITS_SHARE = 8  # the log-softmax's chunk gets at most 1/8 of the pass's budget


@dataclass(frozen=True)
class PassFit:
    """What a pass of `micro_batch_tokens` holds (`bytes`, slack included) with these settings."""

    micro_batch_tokens: int
    gradient_checkpointing: bool
    logprob_chunk: int
    bytes: int


def layer_values(shape: ModelShape, rank: int, modules: tuple[str, ...]) -> int:
    """Values one decoder layer keeps a token for its backward (the docstring's first item)."""
    return 4 * shape.intermediate + 4 * shape.hidden + 2 * shape.q_dim + 2 * shape.kv_dim + rank * len(modules)


def token_bytes(shape: ModelShape, dtype_bytes: int, checkpointing: bool, rank: int, modules: tuple[str, ...],
                triton: bool) -> float:
    """A pass's bytes per token, before the allocator's slack: activations (all layers', or each layer's
    input and one layer's with checkpointing), one layer's more for the backward, and the log-softmax's
    per-target tensors (G and its gradient; a target per token at most)."""
    layer = dtype_bytes * layer_values(shape, rank, modules)
    kept = shape.layers * dtype_bytes * shape.hidden + layer if checkpointing else shape.layers * layer
    per_target = shape.hidden * (2 * dtype_bytes + 4) if triton else 0
    return kept + layer + per_target


def chunk_bytes(shape: ModelShape, rows: int, dtype_bytes: int, triton: bool) -> int:
    """The log-softmax's chunk of `rows` rows over the whole vocabulary."""
    return rows * shape.vocab * (dtype_bytes if triton else 3 * 4)


def lora_state_bytes(shape: ModelShape, rank: int, modules: tuple[str, ...]) -> int:
    """One job's adapter state on the trainer's device."""
    return LORA_STATE_BYTES * shape.lora_parameters(rank, modules)


def _round(tokens: float) -> int:
    step = 1024 if tokens >= 8192 else 16
    return int(tokens // step * step)


def _kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def _rows(budget: float, shape: ModelShape, dtype_bytes: int, logprob_chunk: int, triton: bool) -> int:
    """The log-softmax's rows per chunk: `logprob_chunk`, fewer where that chunk would take more than
    1/LOGITS_SHARE of `budget`."""
    if math.isinf(budget):
        return logprob_chunk
    return max(16, min(logprob_chunk, int(budget / LOGITS_SHARE // chunk_bytes(shape, 1, dtype_bytes, triton))))


def pass_at(tokens: int, shape: ModelShape, dtype_bytes: int, device: str, *, rank: int, modules: tuple[str, ...],
            logprob_chunk: int, triton: bool, checkpointing: bool) -> PassFit:
    """What a pass of `tokens` tokens holds with these settings, the allocator's slack included."""
    slack = GPU_SLACK if _kind(device) == "cuda" else CPU_SLACK
    per = token_bytes(shape, dtype_bytes, checkpointing, rank, modules, triton)
    fixed = chunk_bytes(shape, logprob_chunk, dtype_bytes, triton)
    return PassFit(tokens, checkpointing, logprob_chunk, math.ceil(slack * (fixed + per * tokens)))


def pass_fit(budget: float, shape: ModelShape, dtype_bytes: int, device: str, *, rank: int,
             modules: tuple[str, ...], logprob_chunk: int, triton: bool, checkpointing: bool | None = None,
             cap: int | None = None) -> PassFit:
    """The largest micro-batch (in tokens, at most `cap`, by default MAX_TOKENS of the device) whose pass
    fits `budget` bytes; with checkpointing where `checkpointing` says so, or (None) where without it the
    micro-batch would be below MIN_FAST_TOKENS and with it larger. The log-softmax's rows per chunk are
    `logprob_chunk`, fewer where its chunk would take more than 1/LOGITS_SHARE of the budget.
    micro_batch_tokens is 0 where not even 16 tokens fit."""
    kind = _kind(device)
    slack = GPU_SLACK if kind == "cuda" else CPU_SLACK
    cap = cap or MAX_TOKENS[kind]
    rows = _rows(budget, shape, dtype_bytes, logprob_chunk, triton)
    kw = dict(rank=rank, modules=modules, logprob_chunk=rows, triton=triton)

    def fit(ckpt: bool) -> PassFit:
        per = token_bytes(shape, dtype_bytes, ckpt, rank, modules, triton)
        room = max(0.0, budget / slack - chunk_bytes(shape, rows, dtype_bytes, triton))
        tokens = min(cap, _round(room / per))
        return pass_at(tokens if tokens >= 16 else 0, shape, dtype_bytes, device, checkpointing=ckpt, **kw)

    if checkpointing is not None:
        return fit(checkpointing)
    plain = fit(False)
    if plain.micro_batch_tokens >= min(cap, MIN_FAST_TOKENS[kind]):
        return plain
    recompute = fit(True)
    return recompute if recompute.micro_batch_tokens > plain.micro_batch_tokens else plain


def default_budget(device: str) -> int:
    """A pass's budget for a trainer built without a plan: on a GPU GPU_SHARE of what is free now, on the
    CPU CPU_BUDGET or a quarter of the memory available, whichever is less."""
    if str(device).startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(GPU_SHARE * free)
    import psutil

    return int(min(CPU_BUDGET, psutil.virtual_memory().available / 4))


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_host_memory(threshold: int = 1 << 20) -> bool:
    """Have glibc serve allocations of `threshold` bytes or more with their own pages, given back to the
    system when freed. By default glibc raises that threshold to 32 MiB after the first large free, and
    the CPU trainer's activations (a few MB each) then come from its heap, which keeps what they freed:
    the process stayed 2.1 GB above its start after a 1,024-token pass of SmolLM2's shape and peaked
    0.8 GB higher (measured; 0.01 GB and 1.9 GB peak with this). Process-wide; False where the C
    library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
