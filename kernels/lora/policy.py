"""How the grouped-LoRA op launches its kernels: which passes fuse, how the dy pass sums dB, and each launch's
tiles, warps and stages.

The tuned launch parameters live in one JSON file per GPU (configs/<device name>.json, spaces as _), read by
`launch_table`; a device without a file of its own (any GPU but the H200, and Triton's CPU interpreter) takes
the H200's, the only one tuned. Each launcher's entries are keyed by BLOCK_R, the entry of the largest key not
above the batch's BLOCK_R applying, and each launcher's "_source" names the measurement its figures came from.
What the tables leave out follows from the register and shared-memory budgets, here in code: fp32's IEEE dots
hold their operands in registers (narrower tiles), a shrink tile of more than 64 rows takes 8 warps, and the
fused expand's column tile is sized to its fp32 accumulator (`expand_block_n2`).

`launch=` (every launcher, and the op's grouped_lora) replaces named parameters of one launch for that call
(keys and parameters as in TUNABLE): the tuner's candidates (colora/bench/tune.py) and the tests' small tiles.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from ..util import cdiv, pow2
from .common import block_r, num_sms
from .meta import LoRABatchMeta

CONFIGS = Path(__file__).with_name("configs")
TUNED_ON = "NVIDIA_H200"  # the table of every device without its own

# The parameters `launch=` may give each launch.
TUNABLE = {
    "shrink": ("block_m", "block_k", "warps", "stages", "block_n2"),  # x -> h (-> y), dy -> dh (-> dx) unfused dy
    "dy_pass": ("block_m", "block_k", "warps", "stages", "block_n2"),  # the fused dh + dB partials (-> dx)
    "expand": ("block_t", "block_n", "warps", "stages", "chunk"),  # h -> y, dh -> dx
    "sgrad": ("block_t", "block_n", "warps", "stages", "chunk"),  # dA (and dB unfused)
    # lora_stream_kernel: shrink_expand (stream) and the fused dy pass (stream_dy) over full tiles, descriptors
    "stream": ("on", "block_m", "block_k", "block_n2", "warps", "stages", "per_sm"),
    "stream_dy": ("on", "block_m", "block_k", "block_n2", "warps", "stages", "per_sm"),
}
Launch = Mapping[str, Mapping[str, object]]

SHRINK_BLOCK_M = 64  # rows per tile of the shrink (and of the fused dy pass below one 256-row tile an SM)
# The fused dy pass takes 256-row tiles from this many tiles per SM on (T >= 256 x SMs), 64-row ones below:
# its fp32 partials cost 4 BLOCK_R / tile of a dy read each way, as much as the read it saves at 64 rows and
# rank 16. Measured on the H200 at 857c862: the 8-job trainer step (1.45 tiles of 256 per SM) 1.442 s against
# 1.524-1.579 s with 64-row tiles and 1.499 s unfused.
FUSED_TILE_WAVES = 1


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The name of `device`'s table: the GPU's name with spaces and dashes as _, or "interpreter"."""
    if device.type != "cuda":
        return "interpreter"
    return torch.cuda.get_device_name(device).replace(" ", "_").replace("-", "_")


@functools.lru_cache(maxsize=None)
def launch_table(name: str) -> dict:
    """The tuned launches of the device called `name`: configs/<name>.json, or the H200's where there is none."""
    path = CONFIGS / f"{name}.json"
    if not path.exists():
        path = CONFIGS / f"{TUNED_ON}.json"
    return json.loads(path.read_text())


def check_launch(launch: Launch | None) -> None:
    """A ValueError naming any launch or parameter of `launch` that is not in TUNABLE."""
    for kernel, cfg in (launch or {}).items():
        if kernel not in TUNABLE or not set(cfg) <= set(TUNABLE[kernel]):
            raise ValueError(f"launch: {kernel}={dict(cfg)} (tunable: {TUNABLE})")


def table_entry(kind: str, br: int, dtype: torch.dtype, device: torch.device) -> dict:
    """`kind`'s entry for BLOCK_R `br` in `device`'s table (a copy to change), with fp32's register budget
    applied: IEEE fp32 dots hold their operands in registers, so the shrinks read 64 (the 256-row dy pass 32)
    columns of K a step, at 3 stages, the fused expand sizes its own columns (`expand_block_n2`), and the
    expand takes 64 columns a program (32 above BLOCK_R 64) over 8 warps (compile_check: no spills so,
    Triton 3.9)."""
    return dict(_entry(kind, br, dtype == torch.float32, device_name(device)))


@functools.lru_cache(maxsize=None)
def _entry(kind: str, br: int, fp32: bool, name: str) -> tuple:
    # cached: the launchers ask for an entry per launch, host time a layer stack pays per micro-batch
    entries = launch_table(name)[kind]
    keys = sorted(int(k) for k in entries if not k.startswith("_"))
    cfg = dict(entries[str(max([k for k in keys if k <= br], default=keys[0]))])
    if fp32:
        if kind in ("shrink", "dy_pass"):
            cfg.update(block_k=32 if cfg["block_m"] > SHRINK_BLOCK_M else 64, stages=3)
            cfg.pop("block_n2", None)
        elif kind == "expand":
            cfg.update(block_n=64 if br <= 64 else 32, warps=8)
    return tuple(cfg.items())


def shrink_config(meta: LoRABatchMeta, dtype: torch.dtype, K: int, N2: int, *, dy_pass: bool = False,
                  launch: Launch | None = None, rows: int | None = None, block_k: int | None = None) -> dict:
    """lora_shrink_kernel's launch over K columns of x (or dy) with a fused expand of N2 columns (0: none):
    {block_m, block_k, warps, stages, block_n2}. dy_pass: the fused dy pass (dB's partials), on 256-row tiles
    from one such tile an SM on (`dy_pass_block_m`), else on the shrink's 64-row tiles at 3 stages (the
    partial's tile takes the shared memory of one). rows, block_k: the short tiles of a stream launch, at its
    tile rows and K block. `launch`'s "shrink" (or "dy_pass") parameters replace the table's, block_m first
    (warps and block_n2 follow it unless given)."""
    br = block_r(meta.max_rank)
    big = (rows if rows is not None else dy_pass_block_m(meta)) > SHRINK_BLOCK_M
    cfg = table_entry("dy_pass" if dy_pass and big else "shrink", br, dtype, meta.device)
    if dy_pass:
        cfg["stages"] = 3
    cfg["block_k"] = min(cfg["block_k"], max(16, pow2(K)))
    over = dict((launch or {}).get("dy_pass" if dy_pass else "shrink", {}))
    if rows is not None:  # the stream launch's tiles and its partials' column block
        over.update(block_m=rows, block_k=block_k)
    cfg["block_m"] = over.get("block_m", cfg["block_m"])
    cfg["warps"] = 8 if (cfg["block_m"] > SHRINK_BLOCK_M or br >= 128) else 4
    n2 = cfg.get("block_n2") or expand_block_n2(cfg["block_m"], cfg["warps"], br, dtype == torch.float32)
    cfg["block_n2"] = max(16, min(pow2(N2), n2))
    cfg.update(over)
    return cfg


def rows_config(kind: str, meta: LoRABatchMeta, N: int, dtype: torch.dtype, launch: Launch | None = None,
                chunk: int | None = None) -> dict:
    """lora_sgrad_kernel's launch for `kind` ("expand" or "sgrad") over N columns: {block_t, block_n, warps,
    stages, chunk}, BLOCK_N capped at N's power of 2, the rows a program `chunk` (else `sgrad_chunk`'s), then
    `launch`'s parameters."""
    br = block_r(meta.max_rank)
    cfg = table_entry(kind, br, dtype, meta.device)
    cfg["block_n"] = min(cfg["block_n"], max(16, pow2(N)))
    cfg["chunk"] = chunk or sgrad_chunk(meta, cdiv(N, cfg["block_n"]), br)
    cfg.update((launch or {}).get(kind, {}))
    return cfg


def stream_entry(kind: str, meta: LoRABatchMeta, dtype: torch.dtype, launch: Launch | None = None) -> dict:
    """The table's launch of lora_stream_kernel for `kind` ("stream": the forward and the dh -> dx pass,
    "stream_dy": the fused dy pass), with `launch`'s parameters; "on" says whether it runs at this BLOCK_R."""
    cfg = table_entry(kind, block_r(meta.max_rank), dtype, meta.device)
    cfg.update((launch or {}).get(kind, {}))
    return cfg


def expand_block_n2(block_m: int, warps: int, br: int, fp32: bool) -> int:
    """Columns of the fused expand's [BLOCK_M, BLOCK_N2] fp32 tile (before capping at N): at most 64 registers a
    thread (32 at fp32, whose IEEE dots hold their operands in registers; half that again at BLOCK_R 64).
    compile_check: no spills at bf16; at fp32 and BLOCK_R 64 (a test dtype, not the trainer's) 24 bytes of stack
    with Triton 3.9."""
    return (32 if fp32 else 64) * 32 * warps // block_m // (2 if br >= 64 else 1)


def dy_pass_block_m(meta: LoRABatchMeta) -> int:
    """Rows per tile of the fused dy pass: 256 from one such tile per SM on, else 64."""
    return 256 if meta.num_tokens >= FUSED_TILE_WAVES * 256 * num_sms(meta.device) else SHRINK_BLOCK_M


def atomic_db() -> bool:
    """Whether the fused dy pass adds its tiles' dB partials atomically into one fp32 partial a job
    (the order of the additions varies from run to run, so dB may differ in its last bits) rather
    than writing one a tile for the reduce to sum in a fixed order: unless PyTorch is asked for
    deterministic algorithms (torch.use_deterministic_algorithms), as its own scatter-adds do.
    A tile's per-tile partial is written and read back, 8 BLOCK_R bytes a column against the tile's
    2 x BLOCK_M bytes of dy, where the atomic ones are additions in L2 (a job's partial, BLOCK_R x N
    fp32, is at most a few MB), 128 bits each (RED.E.ADD.F32x4). Measured on the H200 at 6a8bfbb: 1-6%
    less per rank-16 step than per-tile partials (8 jobs x 24k tokens)."""
    return not torch.are_deterministic_algorithms_enabled()


def fuse_dy_pays(meta: LoRABatchMeta, d_in: int, d_out: int, dtype: torch.dtype) -> bool:
    """dh and dB from one read of dy (lora_shrink_sgrad) rather than two passes. Per-tile fp32 dB
    partials, written and read back, cost 4 BLOCK_R / BLOCK_M of the dy read the fusion saves: at
    BLOCK_R <= 32 on 256-row tiles at most 1/2 (1/4 at rank 16), as much or more on the 64-row tiles of
    small batches (below one 256-row tile an SM, where launches dominate), and less again with the
    atomic partials (`atomic_db`). At BLOCK_R 64 only with atomic partials on 256-row tiles, whichever of
    dx and dy is wider; not at fp32, whose IEEE dots hold their operands in registers: that pass spills
    2.4 KB a thread (compile_check, Triton 3.9) where the two passes do not. Measured on the H200 at
    6c75111: rank 64, fused against two passes, o 1181 -> 1128 us, down 1545 -> 1480 (8 jobs x 24k)."""
    br = block_r(meta.max_rank)
    if br <= 32:
        return True
    return br == 64 and dtype != torch.float32 and atomic_db() and dy_pass_block_m(meta) > SHRINK_BLOCK_M


def fuse_expand_pays(meta: LoRABatchMeta, n_slices: int, d_in: int, d_out: int) -> bool:
    """The expand of the y / dx rows fuses into the pass that computes their h / dh when there is
    one slice (a packed call's dx needs every slice's dh first, and its outputs are several tensors)
    and BLOCK_R <= 64 (at 128 the shrink's and the expand's tiles do not fit one program's shared
    memory: compile_check); at BLOCK_R <= 32 only where d_in <= d_out, where the dy pass's programs would
    write a dx wider than the dy they read. Measured on the H200 at 086fdec (rank 16: fused 4-6% faster at q,
    k/v, gate/up, 0.7-2.3% slower at o and down) and 17829b5 (rank 64: fused 10-11% faster at o and down too)."""
    br = block_r(meta.max_rank)
    return n_slices == 1 and br <= 64 and (br == 64 or d_in <= d_out)


def sgrad_chunk(meta: LoRABatchMeta, n_tiles_n: int, br: int) -> int:
    """Rows per program of the segment reduction: enough programs to fill the GPU (about 4 per SM),
    but chunks of at least 8 * BLOCK_R rows so the fp32 partials stay small beside the inputs."""
    want = max(1, 4 * num_sms(meta.device) // max(n_tiles_n, 1))
    chunk = pow2(max(1, cdiv(meta.num_tokens, want)))
    return int(min(max(chunk, 256, 8 * br), 8192))


def reduce_shape(num_jobs: int, N: int, br: int, partials: int, pb: int) -> tuple[int, int, int]:
    """(columns per program, partials summed per step, rank rows per program) of the reduce over
    partials in column blocks of pb (reduce.py's blocked layout).

    Many partials (the fused dy pass's dB: 96 a job at 8 x 24k tokens): a program reads whole block
    rows (pb columns) of 4 rank rows, 16 partials a step (4 x 64 x 16 fp32: 32 registers a thread at
    4 warps), at the rate of torch's own sum over the same partials (measured on the H200 at 086fdec).
    Few partials (below 8 a job: dA): one partial a step, all rank rows, measured faster there (at 0f6c006)."""
    block_n = min(pb, max(16, pow2(N)))
    if partials < 8 * num_jobs:
        return block_n, 1, br
    rows = min(4, br)
    return block_n, max(2, min(16, 8192 // (rows * block_n))), rows
