"""Host-side helpers of the kernels' launchers: integer arithmetic, and uploads that neither wait for the
device nor move a pointer's 16-byte alignment."""

from __future__ import annotations

import numpy as np
import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of 2 that is at least n (1 for n <= 1), as triton.next_power_of_2.

    Host code uses these plain versions: Triton's own are constexpr functions in Triton 3.9 (the CPU
    machines'; not checked for the H200's 3.6), and a call from Python goes through Triton's wrapper,
    2-3 us a call and tens of calls per LoRA op. With these and LoRABatchMeta's cached max_rank, a
    layer's four grouped-LoRA calls made 2.2x fewer Python calls and took 1.33x less of colora's host
    time on the CPU (measured at 5395e86; the figures in 65eb13e)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without waiting for the work already queued there: from pinned memory,
    non-blocking (a pageable copy to the GPU would wait for the queued layers)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


ALIGN = 16  # bytes: Triton specialises a pointer argument on its 16-byte alignment


def upload_aligned(parts: list, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Each of `parts` (1-D sequences) on `device` in one upload: views of one buffer, every view
    starting at a 16-byte boundary.

    Triton compiles a kernel once per combination of its pointer arguments' 16-byte alignment, so
    views at data-dependent offsets (the tile arrays of n tiles, back to back: `row` at 4n bytes) made
    new micro-batch sizes compile the grouped-LoRA kernels again mid-run, a stall of seconds."""
    step = ALIGN // torch.empty((), dtype=dtype).element_size()
    starts, total = [], 0
    for p in parts:
        starts.append(total)
        total += -(-len(p) // step) * step
    host = np.zeros(max(total, 1), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    for p, s0 in zip(parts, starts):
        host[s0: s0 + len(p)] = p
    dev = upload(torch.from_numpy(host), device)
    return [dev[s0: s0 + len(p)] for p, s0 in zip(parts, starts)]
