"""Grouped LoRA over rows sorted by job: many jobs' adapters in one forward and backward.

    meta.py       LoRABatchMeta: a micro-batch's segments, rank layout and row tiles, uploaded once
    reference.py  the plain torch per-job loop (the CPU trainer's path, the tests' ground truth)
    op.py         grouped_lora / grouped_lora_packed: the differentiable op over the launchers below
    shrink.py     lora_shrink_kernel: x -> h (-> y), dy -> dh (-> dx) with the dy pass's dB partials
    stream.py     lora_stream_kernel: the same on persistent programs over full tiles, through TMA
    sgrad.py      lora_sgrad_kernel: weight-gradient partials over row chunks, or the separate expand
    reduce.py     lora_reduce_kernel: each job's partials summed in order into dA / dB^T
    policy.py     which passes fuse, and each launch's tiles from configs/<GPU>.json
    common.py     what the kernels and launchers share (the dot, a tile's job, BLOCK_R, checks)

docs/kernels.md gives the design: the bytes bound, the tiles, the routes, and the measurements behind the
defaults.
"""

from .meta import LoRABatchMeta, Tiles
from .op import grouped_lora, grouped_lora_packed
from .reference import grouped_lora_packed_ref, grouped_lora_ref

__all__ = ["LoRABatchMeta", "Tiles", "grouped_lora", "grouped_lora_packed", "grouped_lora_packed_ref",
           "grouped_lora_ref"]
