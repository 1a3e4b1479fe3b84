"""Checking launchers of the grouped-LoRA kernels: shapes, dtypes and devices are checked here, block
sizes are chosen here, and each launcher says which LoRA product it computes.

The weights are passed as strided views, so the same kernel serves forward and backward
(Bt = B^T made contiguous once per forward):
  forward   h  = shrink(x, A)             y  = expand(h, Bt^T, scale)
  backward  dh = shrink(dy, Bt, scale)    dx = expand(dh, A^T)
            dA = sgrad(dh, x)             dB^T = sgrad(h, dy, scale)
  or, fused (shrink_sgrad): dh and dB^T in one pass over dy; and with one slice each expand in the
  launch that computes its h or dh (shrink_expand; shrink_sgrad's dx).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .lora_kernels import lora_reduce_kernel, lora_sgrad_kernel, lora_shrink_kernel, lora_stream_kernel
from .lora_meta import LoRABatchMeta

SHRINK_BLOCK_M = 64  # rows per tile of the shrink (and of the fused dy pass below one 256-row tile an SM)
# The fused dy pass takes 256-row tiles from one tile per SM on (T >= 256 x SMs), 64-row ones below:
# its fp32 partials cost 4 BLOCK_R / tile of a dy read each way, as much as the read it saves at 64
# rows and rank 16. On the H200's 8-job trainer step (49,152-token micro-batches: 1.45 tiles of 256
# per SM) the step took 1.442 s against 1.524-1.579 s with 64-row tiles there and 1.499 s unfused,
# in one call (reports/h200/thirteenth/tiles_ab); the threshold was 2 tiles per SM before.
FUSED_TILE_WAVES = 1

# Launch parameters each launcher may take from `launch_overrides` instead of its own choice.
TUNABLE = {
    "shrink": ("block_m", "block_k", "warps", "stages", "block_n2"),  # x -> h (-> y), dy -> dh (-> dx) unfused dy
    "dy_pass": ("block_m", "block_k", "warps", "stages", "block_n2", "atomic"),  # the fused dh + dB partials (-> dx)
    "expand": ("block_t", "block_n", "warps", "stages", "chunk"),  # h -> y, dh -> dx
    "sgrad": ("block_t", "block_n", "warps", "stages", "chunk"),  # dA (and dB unfused)
    # lora_stream_kernel: shrink_expand (stream) and the fused dy pass (stream_dy) over full tiles, descriptors
    "stream": ("on", "block_m", "block_k", "block_n2", "warps", "stages", "per_sm"),
    "stream_dy": ("on", "block_m", "block_k", "block_n2", "warps", "stages", "per_sm"),
}
_overrides: dict[str, dict] = {}


@contextlib.contextmanager
def launch_overrides(**kernels: dict):
    """Launch parameters that replace the launchers' own choices while the block runs, for the
    benchmark's tuner (kernels/tune.py), e.g. `launch_overrides(expand={"block_n": 256, "warps": 8})`.
    Keys and parameters as in TUNABLE; anything else is a ValueError. Not thread-safe: one tuner."""
    for kernel, cfg in kernels.items():
        if kernel not in TUNABLE or not set(cfg) <= set(TUNABLE[kernel]):
            raise ValueError(f"launch_overrides: {kernel}={cfg} (tunable: {TUNABLE})")
    saved = dict(_overrides)
    _overrides.update(kernels)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def _tuned(kernel: str, **chosen) -> dict:
    over = _overrides.get(kernel)
    return {**chosen, **over} if over else chosen


def _precision(dtype: torch.dtype, device: torch.device) -> str:
    if device.type != "cuda":
        return "upcast"  # Triton's interpreter: see lora_kernels._dot
    # fp32 callers (tests, the CPU trainer's dtype) expect fp32 results, not tf32's 10-bit mantissa
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of 2 that is at least n (1 for n <= 1), as triton.next_power_of_2.

    Host code uses these plain versions: Triton's own are constexpr functions in Triton 3.9 (the CPU
    machines'; not checked for the H200's 3.6), and a call from Python goes through Triton's wrapper,
    2-3 us a call and tens of calls per LoRA op. With these and LoRABatchMeta's cached max_rank, a
    layer's four grouped-LoRA calls made 2.2x fewer Python calls and took 1.33x less of colora's host
    time on the CPU (reports/cpu/lora_host.txt)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _block_r(rank: int) -> int:
    return max(16, pow2(rank))  # tl.dot needs every dim >= 16


def h_width(meta: LoRABatchMeta, slices: int) -> int:
    """Columns of the h / dh buffer of a `slices`-way packed call: the packed shrink writes
    [0, slices * r_j) per row, and every slice's expand or sgrad reads BLOCK_R columns from
    slice * r_j on (see lora_kernels: the reads carry no rank mask). Allocate it zero-filled."""
    R = meta.max_rank
    return max(_block_r(slices * R), (slices - 1) * R + _block_r(R))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few chunks, so the tests exercise the cross-chunk reduction
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(meta: LoRABatchMeta, t: torch.Tensor, name: str, rows: int | None = None) -> None:
    if t.device != meta.device:
        raise ValueError(f"{name} is on {t.device}, the batch metadata on {meta.device}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, the batch has {rows} tokens")


def lora_shrink(x: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, *,
                h_slice: int = 0, scale: bool = False) -> torch.Tensor:
    """out[t, h_slice*r_j + k] = (scale_j *) sum_i x[t, i] * w[rank_start[j] + k, i] for t in job j.

    x: [T, K], w: [R, K] (any strides: A, or B^T for dh; fastest when K has stride 1), out: [T, H]
    with H >= (h_slice+1) * max_rank. Columns of out outside each job's slice are left as they were.
    """
    _launch_shrink(x, w, meta, out, h_slice, scale, None, None, _tuned("shrink", block_m=SHRINK_BLOCK_M)["block_m"])
    return out


def lora_shrink_expand(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, meta: LoRABatchMeta, h: torch.Tensor,
                       out: torch.Tensor, *, scale_h: bool = False, scale_out: bool = False,
                       accumulate: bool = False) -> torch.Tensor:
    """h = lora_shrink(x, w, scale=scale_h) and out (+)= lora_expand(h, w2, scale=scale_out) in one
    launch (one slice: h_slice 0): each program reads its row tile of x and writes the same rows of
    out, so the op's reads and writes interleave as in a copy (the separate expand is a write-only
    pass). Forward: x, A, B -> h, y; backward: dy, B^T (scale_h), A^T -> dh, dx. w2: [N, R], out: [T, N]."""
    _check_expand(h, w2, meta, out, 0)
    stream = stream_config("stream", x, w, w2, out, meta)
    if stream is not None:
        _launch_stream(x, w, w2, meta, h, out, stream, scale_h, scale_out, accumulate)
        return out
    _launch_shrink(x, w, meta, h, 0, scale_h, None, None, _tuned("shrink", block_m=SHRINK_BLOCK_M)["block_m"],
                   (w2, out, scale_out, accumulate))
    return out


def stream_config(kernel: str, x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, out: torch.Tensor,
                  meta: LoRABatchMeta) -> dict | None:
    """The launch of lora_stream_kernel for lora_shrink_expand (kernel "stream": x -> h -> y, dy -> dh -> dx) or
    lora_shrink_sgrad's pass with its dx (kernel "stream_dy"), or None for lora_shrink_kernel's one program a tile.
    It needs a batch whose every rank is BLOCK_R, 16-bit dtypes, Hopper or later (or the CPU's interpreter), x, w
    and out with unit column strides, w2 with a unit stride along either dim, 16-byte aligned bases and row steps
    (TMA descriptors); the dy pass also 256-row tiles (dy_pass_block_m: one such tile an SM or more).

    The default at BLOCK_R 64: on the H200 at 8 jobs x 24k tokens, rank 64, one process, graph timing
    (reports/h200/twentieth/s1), the forward on [128, 64] tiles two programs an SM took 0.87-0.93x the own launch's
    time at every Qwen3-0.6B shape (k/v 246 against 283 us: 77% of the copy against 67%), the dy pass on [256, 64]
    tiles one program an SM 0.89-0.95x (k/v 333 against 374 us); on [128, 64] or [64, 64] tiles, whose dB partials
    add as many bytes into L2 as half or all the dy they read, 1.0-2.0x. The op's forward + backward with both
    (reports/h200/twentieth/d5/dA): 0.88-0.95x the time of the tile launches (1.34-1.55x the bytes bound; cuBLAS
    on the same products as one adapter 1.25-1.53x). At rank 16 (BLOCK_R 16) the forward took 1.0-1.09x the own
    launch's, which already moves 84-88% of the copy: off there."""
    block_r = _block_r(meta.max_rank)
    fwd = kernel == "stream"
    if not _overrides.get(kernel, {}).get("on", block_r == 64):
        return None
    cfg = _tuned(kernel, on=True, block_m=128 if fwd else 256, block_k=64, block_n2=64, warps=4 if fwd else 8,
                 stages=3, per_sm=2 if fwd else 1)
    if meta.min_rank != block_r or x.dtype not in (torch.bfloat16, torch.float16) or out.stride(1) != 1:
        return None
    if not fwd and cfg["block_m"] > dy_pass_block_m(meta):  # under one 256-row tile an SM
        return None
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return None
    w2_nr = w2.stride(1) == 1  # w2 [N2, R] row-major (B itself), else its transpose is ([R, N2]: B^T, A)

    def aligned(t: torch.Tensor) -> bool:
        return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0

    if not (aligned(x) and aligned(w) and aligned(w2 if w2_nr else w2.t())):
        return None
    return {**cfg, "w2_nr": w2_nr}


def _launch_stream(x, w, w2, meta, h, out, cfg, scale_h, scale_out, accumulate, p=None, part=None):
    """lora_stream_kernel over the full tiles of cfg's block_m rows, lora_shrink_kernel over the rest (a job's
    last tile, when block_m does not divide its rows). p, part: the dy pass's h and atomic dB partials."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check_shrink(x, w, meta, h, 0)
    K, N2 = x.shape[1], w2.shape[0]
    block_m, block_r = cfg["block_m"], _block_r(meta.max_rank)
    block_k = min(cfg["block_k"], max(16, pow2(K)))
    block_n2 = min(cfg["block_n2"], max(16, pow2(N2)))
    fused = part is not None
    if fused and part.shape[3] != block_k:
        raise ValueError(f"partials in column blocks of {part.shape[3]}, the pass's BLOCK_K is {block_k}")
    full, short = meta.full_tiles(block_m)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    if full.n > 0:
        w2d = desc(w2, [block_n2, block_r]) if cfg["w2_nr"] else desc(w2.t(), [block_r, block_n2])
        programs = max(1, min(full.n, cfg["per_sm"] * _num_sms(x.device)))
        lora_stream_kernel[(programs,)](
            desc(x, [block_m, block_k]), desc(w, [block_r, block_k]), h, p if fused else h, part if fused else h,
            w2d, out, full.job, full.row, meta.rank_start_t, meta.scale_t,
            full.n, programs, K, N2, part.shape[1] if fused else 0,
            h.stride(0), p.stride(0) if fused else 0, out.stride(0),
            BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N2=block_n2,
            W2_NR=cfg["w2_nr"], EVEN_N2=N2 % block_n2 == 0, FUSE_SGRAD=fused,
            HAS_SCALE=scale_h, EXPAND_SCALE=scale_out, ACCUMULATE=accumulate,
            PRECISION=_precision(x.dtype, x.device), num_warps=cfg["warps"], num_stages=cfg["stages"],
        )
    if short.n > 0:
        _launch_shrink(x, w, meta, h, 0, scale_h, p, part, block_m, (w2, out, scale_out, accumulate),
                       atomic=fused, tiles=short, block_k=block_k)


def lora_shrink_sgrad(dy: torch.Tensor, Bt: torch.Tensor, h: torch.Tensor, meta: LoRABatchMeta, dh: torch.Tensor,
                      dBt: torch.Tensor, *, h_slice: int = 0, dx: tuple | None = None) -> None:
    """dh = lora_shrink(dy, Bt, scale=True) and dBt = lora_sgrad(h, dy, scale=True) in one pass over dy.

    dy: [T, N], Bt: [R, N] (B^T), h: [T, H] as for lora_expand, dh: [T, H'] (written in its slice),
    dBt: [R, N] (any strides: pass dB.t()). Each program forms its row tile's part of dB in fp32
    (BLOCK_R x N) and, where `atomic_db`, adds it atomically to one fp32 partial a job, which stays in
    L2; else it writes it (the blocked layout of lora_kernels) for the reduce to sum in tile order.
    Tiles of 256 rows once there are enough of them (`dy_pass_block_m`); see `fuse_dy_pays`.
    dx: (A^T [d_in, R], dx [T, d_in], accumulate) to also write dx (+)= dh A from each tile (one
    slice only, h_slice 0), as `lora_shrink_expand` does.
    """
    if dx is not None:
        if h_slice != 0:
            raise ValueError("the dx expand fuses into the dy pass of one slice only (h_slice 0)")
        _check_expand(dh, dx[0], meta, dx[1], 0)
    _check(meta, h, "h", meta.num_tokens)
    block_r = _block_r(meta.max_rank)
    if h.shape[1] < h_slice * meta.max_rank + block_r or h.stride(1) != 1 or h.dtype != dy.dtype:
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} must be row-major with at least "
                         f"{h_slice * meta.max_rank + block_r} columns (h_width) and dy's dtype {dy.dtype}")
    if dBt.shape != Bt.shape:
        raise ValueError(f"dBt has shape {tuple(dBt.shape)}, expected {tuple(Bt.shape)}")
    N = dy.shape[1]
    atomic = _tuned("dy_pass", atomic=atomic_db())["atomic"]
    stream = stream_config("stream_dy", dy, Bt, dx[0], dx[1], meta) if (dx is not None and atomic) else None
    if stream is not None:
        block_m, pb = stream["block_m"], min(stream["block_k"], max(16, pow2(N)))
    else:
        block_m = _tuned("dy_pass", block_m=dy_pass_block_m(meta))["block_m"]
        pb = _shrink_block_k(block_m, block_r, N, dy.dtype)  # the partials' column block: the pass's BLOCK_K
    # one partial a job, every tile adding to it (fp32 atomics: the sum's order varies), or one a tile,
    # summed per job in tile order by the reduce
    table, alloc = (meta.per_job(), torch.zeros) if atomic else (meta.tiles(block_m), torch.empty)
    part = alloc((cdiv(N, pb), max(table.n, 1), block_r, pb), dtype=torch.float32, device=dy.device)
    if stream is not None:
        _launch_stream(dy, Bt, dx[0], meta, dh, dx[1], stream, True, False, dx[2], p=h, part=part)
    else:
        _launch_shrink(dy, Bt, meta, dh, h_slice, True, h, part, block_m,
                       None if dx is None else (*dx[:2], False, dx[2]), atomic=atomic)
    _launch_reduce(part, dBt, meta, table, block_r, scale=True)


def dy_pass_block_m(meta: LoRABatchMeta) -> int:
    """Rows per tile of the fused dy pass: 256 from one such tile per SM on, else 64."""
    return 256 if meta.num_tokens >= FUSED_TILE_WAVES * 256 * _num_sms(meta.device) else SHRINK_BLOCK_M


def atomic_db() -> bool:
    """Whether the fused dy pass adds its tiles' dB partials atomically into one fp32 partial a job
    (the order of the additions varies from run to run, so dB may differ in its last bits) rather
    than writing one a tile for the reduce to sum in a fixed order: unless PyTorch is asked for
    deterministic algorithms (torch.use_deterministic_algorithms), as its own scatter-adds do.
    A tile's per-tile partial is written and read back, 8 BLOCK_R bytes a column against the tile's
    2 x BLOCK_M bytes of dy, where the atomic ones are additions in L2 (a job's partial, BLOCK_R x N
    fp32, is at most a few MB), 128 bits each (RED.E.ADD.F32x4). On the H200 at 8 jobs x 24k tokens,
    256-row tiles, one process a shape, graph us (reports/h200/sixteenth/probe8*): rank 16, per tile ->
    atomic: q 836 -> 801, k/v 612 -> 593, o 941 -> 929, gate/up 1075 -> 1017, down 1266 -> 1250; rank
    64, dy read twice -> fused with atomic partials: q 1172 -> 1102, k/v 838 -> 819, gate/up 1544 ->
    1408, but o 1172 -> 1206 and down 1536 -> 1630 (see fuse_dy_pays)."""
    return not torch.are_deterministic_algorithms_enabled()


def fuse_dy_pays(meta: LoRABatchMeta, d_in: int, d_out: int, dtype: torch.dtype) -> bool:
    """dh and dB from one read of dy (lora_shrink_sgrad) rather than two passes. Per-tile fp32 dB
    partials, written and read back, cost 4 BLOCK_R / BLOCK_M of the dy read the fusion saves: at
    BLOCK_R <= 32 on 256-row tiles at most 1/2 (1/4 at rank 16), as much or more on the 64-row tiles of
    small batches (below one 256-row tile an SM, where launches dominate), and less again with the
    atomic partials (`atomic_db`). At BLOCK_R 64 only with atomic partials on 256-row tiles; not at fp32,
    whose IEEE dots hold their operands in registers: that pass spills 2.4 KB a thread
    (kernels/compile_check.py, Triton 3.9) where the two passes of the rule before it do not. Until the
    twentieth session also only where d_out >= d_in (atomic_db's figures at o and down); on the H200 at
    8 jobs x 24k tokens, rank 64 (reports/h200/twentieth/s1) the fused pass now pays there too: o 1181 ->
    1128 us, down 1545 -> 1480 with lora_shrink_kernel, 1104 -> 1085 and 1469 -> 1444 with lora_stream_kernel
    on 128-row tiles."""
    block_r = _block_r(meta.max_rank)
    if block_r <= 32:
        return True
    return (block_r == 64 and dtype != torch.float32 and atomic_db()
            and dy_pass_block_m(meta) > SHRINK_BLOCK_M)


def _shrink_block_k(block_m: int, block_r: int, K: int, dtype: torch.dtype, fused: bool = True) -> int:
    """The shrink's BLOCK_K: 64 / 32 (fp32) on the fused dy pass's 256-row tiles, else 128 / 64 (fp32
    or BLOCK_R >= 64); never above K's power of 2. For the dy pass (fused=True) also its partials'
    column block (the launch overrides' choice included)."""
    fp32 = dtype == torch.float32
    if block_m > SHRINK_BLOCK_M:  # [256, BLOCK_K] tiles, 3 stages in shared memory
        block_k = 32 if fp32 else 64
    else:  # BLOCK_R 64: see _shrink_stages
        block_k = 64 if (fp32 or block_r >= 64) else 128
    block_k = min(block_k, max(16, pow2(K)))
    return _tuned("dy_pass", block_k=block_k)["block_k"] if fused else block_k


def _shrink_stages(block_r: int, fp32: bool, fused: bool) -> int:
    """Pipeline stages of the shrink: 4 on the bf16 / fp16 plain shrink at BLOCK_R <= 64, else 3. At
    BLOCK_R 64 that is [64, 64] x and weight tiles 4 deep rather than [64, 128] ones 3 deep: on the
    H200 at 8 jobs x 24k tokens the LoRA step's kernels took 3-10% less at q, k/v, o and gate/up (k/v
    837 -> 801 us, gate/up 1710 -> 1546), 0.7% at down (reports/h200/fifteenth/tune, one call)."""
    return 3 if (fp32 or block_r > 64 or fused) else 4


def expand_block_n2(block_m: int, warps: int, block_r: int, fp32: bool, dy_pass: bool = False) -> int:
    """Columns of the fused expand's [BLOCK_M, BLOCK_N2] fp32 tile (before capping at N): at most 64
    registers a thread (32 at fp32, whose IEEE dots hold their operands in registers; half that again
    at BLOCK_R 64). kernels/compile_check.py: no spills at bf16; at fp32 and BLOCK_R 64 (a test dtype,
    not the trainer's) 24 bytes of stack with Triton 3.9.
    Except the dy pass with dB fused at BLOCK_R 64 on 256-row tiles (dy_pass): 128 columns (at bf16),
    though that spills 96 bytes a thread with Triton 3.9 (255 registers): the launch search on the H200
    put it first at each of q, k/v and gate/up, 1.5-3.0% less for the whole step than the 32 of the rule
    above (reports/h200/sixteenth/kernels_tune)."""
    if dy_pass and block_r == 64 and block_m == 256 and not fp32:
        return 128
    return (32 if fp32 else 64) * 32 * warps // block_m // (2 if block_r >= 64 else 1)


def fuse_expand_pays(meta: LoRABatchMeta, n_slices: int, d_in: int, d_out: int) -> bool:
    """The expand of the y / dx rows fuses into the pass that computes their h / dh when there is
    one slice (a packed call's dx needs every slice's dh first, and its outputs are several tensors)
    and BLOCK_R <= 64 (at 128 the shrink's and the expand's tiles do not fit one program's shared
    memory: kernels/compile_check.py); at BLOCK_R <= 32 only where d_in <= d_out. On the H200 at 8
    jobs x 24k tokens, graph timing, fused against separate expands in one process:
    rank 16 (reports/h200/fourteenth/final_ab): 0.840 / 0.885 ms at q (1024 -> 2048), 0.611 / 0.635
    at k/v (1024 -> 1024), 1.078 / 1.143 at gate/up (1024 -> 3072); but 0.944 / 0.937 at o
    (2048 -> 1024) and 1.281 / 1.252 at down (3072 -> 1024), where the dy pass's programs write the
    wide dx. Rank 64 (reports/h200/fifteenth/launch_ab, before this rule): fused 1.183 / 1.322 ms at o and
    1.545 / 1.730 at down as well: the separate expand of a [64, 64] h tile is the slower launch."""
    block_r = _block_r(meta.max_rank)
    return n_slices == 1 and block_r <= 64 and (block_r == 64 or d_in <= d_out)


def _launch_shrink(x, w, meta, out, h_slice, scale, p, part, block_m, exp=None, atomic=False, tiles=None,
                   block_k=None):
    """exp: None, or (w2, y, scale, accumulate) of a fused expand (see lora_shrink_expand). tiles: a table of
    tiles of at most block_m rows instead of meta.tiles(block_m); block_k: the pass's BLOCK_K (the partials')."""
    _check_shrink(x, w, meta, out, h_slice)
    K = x.shape[1]
    tiles = tiles or meta.tiles(block_m)
    if tiles.n == 0 or (meta.max_rank == 0 and exp is None):
        return
    block_r = _block_r(meta.max_rank)
    fp32 = x.dtype == torch.float32
    fused = part is not None
    w2, y, scale2, accumulate = exp or (x, x, False, False)
    N2 = w2.shape[0] if exp else 0
    warps = 8 if (block_m > SHRINK_BLOCK_M or block_r >= 128) else 4
    block_n2 = max(16, min(pow2(N2), expand_block_n2(block_m, warps, block_r, fp32, dy_pass=fused)))
    block_k = block_k or _shrink_block_k(block_m, block_r, K, x.dtype, fused)
    cfg = _tuned("dy_pass" if fused else "shrink", block_k=block_k,
                 warps=warps, stages=_shrink_stages(block_r, fp32, fused), block_n2=block_n2)
    block_k = cfg["block_k"]
    if fused and part.shape[3] != block_k:
        raise ValueError(f"partials in column blocks of {part.shape[3]}, the pass's BLOCK_K is {block_k}")
    lora_shrink_kernel[(tiles.n,)](
        x, w, out, p if fused else x, part if fused else x, w2, y,
        tiles.job, tiles.row, meta.seg_start_t, meta.rank_start_t, meta.scale_t,
        K, h_slice, N2, part.shape[1] if fused else 0,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), p.stride(0) if fused else 0,
        w2.stride(0) if exp else 0, w2.stride(1) if exp else 0, y.stride(0) if exp else 0, y.stride(1) if exp else 0,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        EVEN_K=K % block_k == 0, HAS_SCALE=scale, FUSE_SGRAD=fused, PRECISION=_precision(x.dtype, x.device),
        FUSE_EXPAND=exp is not None, BLOCK_N2=cfg["block_n2"], EXPAND_SCALE=scale2, ACCUMULATE=accumulate,
        PART_ATOMIC=atomic, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )


def _check_shrink(x: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, h_slice: int) -> None:
    T, K = x.shape
    _check(meta, x, "x", meta.num_tokens)
    _check(meta, out, "out", T)
    if w.shape != (meta.total_rank, K):
        raise ValueError(f"weight has shape {tuple(w.shape)}, expected [total rank {meta.total_rank}, {K}]")
    if out.shape[1] < (h_slice + 1) * meta.max_rank or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} (strides {out.stride()}) must be row-major with at least "
                         f"{(h_slice + 1) * meta.max_rank} columns")
    if not (x.dtype == w.dtype == out.dtype):
        raise ValueError(f"dtypes differ: x {x.dtype}, weight {w.dtype}, out {out.dtype}")


def _check_expand(h: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, h_slice: int) -> None:
    N = w.shape[0]
    _check(meta, h, "h", meta.num_tokens)
    _check(meta, out, "out", h.shape[0])
    if w.dim() != 2 or w.shape != (N, meta.total_rank) or out.shape[1] != N:
        raise ValueError(f"weight {tuple(w.shape)} / out {tuple(out.shape)}: expected [N, total rank "
                         f"{meta.total_rank}] and [T, N]")
    block_r = _block_r(meta.max_rank)
    if h.shape[1] < h_slice * meta.max_rank + block_r or h.stride(1) != 1:
        raise ValueError(f"h {tuple(h.shape)} must be row-major with at least {h_slice * meta.max_rank + block_r} "
                         "columns (h_width), zero-filled where the shrink did not write")
    if not (h.dtype == w.dtype == out.dtype):
        raise ValueError(f"dtypes differ: h {h.dtype}, weight {w.dtype}, out {out.dtype}")


def sgrad_chunk(meta: LoRABatchMeta, n_tiles_n: int, block_r: int) -> int:
    """Rows per program of the segment reduction: enough programs to fill the GPU (about 4 per SM),
    but chunks of at least 8 * BLOCK_R rows so the fp32 partials stay small beside the inputs."""
    want = max(1, 4 * _num_sms(meta.device) // max(n_tiles_n, 1))
    chunk = pow2(max(1, cdiv(meta.num_tokens, want)))
    return int(min(max(chunk, 256, 8 * block_r), 8192))


def sgrad_shape(block_r: int) -> tuple[int, int]:
    """(columns per program, warps) of the sgrad. BLOCK_R 64: [64, 256] tiles over 8 warps, 1-4% less
    for the whole rank-64 step than [64, 64] over 4 at every shape of reports/h200/fifteenth/tune
    (fewer, longer programs, each reading its p rows once for 256 columns of q)."""
    return (128, 4) if block_r <= 32 else (256, 8) if block_r == 64 else (64, 8)


def lora_sgrad(p: torch.Tensor, q: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, *,
               p_slice: int = 0, scale: bool = False, chunk: int | None = None) -> torch.Tensor:
    """out[rank_start[j] + k, n] = (scale_j *) sum_{t in job j} p[t, p_slice*r_j + k] * q[t, n].

    p: [T, H] (h or dh; as h in lora_expand), q: [T, N] (dy or x), out: [R, N] (any strides: dA,
    or dB^T). Every row of out is written (zeros for a job without rows). Two launches: per-chunk
    fp32 partials, then a per-job sum in chunk order, so the result does not depend on scheduling.
    """
    T, N = q.shape
    _check(meta, p, "p", meta.num_tokens)
    _check(meta, q, "q", meta.num_tokens)
    if out.shape != (meta.total_rank, N):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected [total rank {meta.total_rank}, {N}]")
    block_r = _block_r(meta.max_rank)
    if p.shape[1] < p_slice * meta.max_rank + block_r or p.stride(1) != 1:
        raise ValueError(f"p {tuple(p.shape)} must be row-major with at least {p_slice * meta.max_rank + block_r} "
                         "columns (h_width), finite everywhere")
    if not (p.dtype == q.dtype):
        raise ValueError(f"dtypes differ: p {p.dtype}, q {q.dtype}")
    if meta.total_rank == 0:
        return out
    cfg = _rows_config("sgrad", meta, N, *sgrad_shape(block_r), chunk)
    part, chunks = _launch_rows(p, meta, p_slice, cfg, q=q)
    _launch_reduce(part, out, meta, chunks, block_r, scale)
    return out


def lora_expand(h: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, *,
                h_slice: int = 0, scale: bool = False, accumulate: bool = False) -> torch.Tensor:
    """out[t, n] (+)= (scale_j *) sum_k h[t, h_slice*r_j + k] * w[n, rank_start[j] + k] for t in job j.

    h: [T, H >= h_slice * max_rank + BLOCK_R], finite in every column (zero-filled before the
    shrink); w: [N, R] (any strides: B, or A^T for dx; fastest when the N dim has stride 1);
    out: [T, N] (any strides). Every row of out is written, rows of rank-0 jobs with 0 (or left
    unchanged when accumulating).
    Each program takes a chunk of one job's rows and BLOCK_N columns, loads its weight tile once and
    writes the chunk's tiles one after another (lora_sgrad_kernel without its sgrad). On the H200 at
    8 jobs x 24k tokens, rank 16, against one [64, 128] tile a program (the kernel before): o 923 ->
    873 us and down 1253 -> 1213 for the whole forward + backward, y and dx both expanded so; within
    1% either way on the trainer's calls (reports/h200/seventeenth/probe15*).
    """
    N = w.shape[0]
    _check_expand(h, w, meta, out, h_slice)
    block_r = _block_r(meta.max_rank)
    # IEEE fp32 dots hold their operands in registers: narrower tiles
    shape = ((64 if block_r <= 64 else 32), 8) if h.dtype == torch.float32 else sgrad_shape(block_r)
    _launch_rows(h, meta, h_slice, _rows_config("expand", meta, N, *shape), expand=(w, out, scale, accumulate))
    return out


def _rows_config(kernel: str, meta: LoRABatchMeta, N: int, block_n: int, warps: int, chunk: int | None = None) -> dict:
    """The launch of lora_sgrad_kernel for `kernel` ("sgrad", "expand"): BLOCK_N capped at
    N's power of 2, rows a step, stages and the rows a program (sgrad_chunk unless given)."""
    block_r = _block_r(meta.max_rank)
    block_n = min(block_n, max(16, pow2(N)))
    return _tuned(kernel, block_t=64 if block_r <= 64 else 32, block_n=block_n, warps=warps,
                  stages=3, chunk=chunk or sgrad_chunk(meta, cdiv(N, block_n), block_r))


def _launch_rows(p, meta, p_slice, cfg, *, q=None, expand=None):
    """lora_sgrad_kernel over chunks of cfg["chunk"] rows and cfg["block_n"] columns: the sgrad's
    partials of p^T q where q is given, or else the expand (w, y, scale, accumulate). Returns (the
    partials or None, the chunks' table)."""
    block_r = _block_r(meta.max_rank)
    block_n, chunk = cfg["block_n"], cfg["chunk"]
    w, y, scale2, accumulate = expand or (p, p, False, False)
    N = q.shape[1] if q is not None else w.shape[0]
    n_tiles_n = cdiv(N, block_n)
    chunks = meta.tiles(chunk)
    part = None
    if q is not None:
        part = torch.empty((n_tiles_n, max(chunks.n, 1), block_r, block_n), dtype=torch.float32, device=p.device)
    if chunks.n > 0:
        lora_sgrad_kernel[(chunks.n, n_tiles_n)](
            p, q if q is not None else p, part if q is not None else p, w, y, meta.scale_t,
            chunks.job, chunks.row, meta.seg_start_t, meta.rank_start_t,
            N, p_slice, chunk,
            p.stride(0), q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            w.stride(0) if expand else 0, w.stride(1) if expand else 0,
            y.stride(0) if expand else 0, y.stride(1) if expand else 0,
            BLOCK_T=cfg["block_t"], BLOCK_R=block_r, BLOCK_N=block_n, PRECISION=_precision(p.dtype, p.device),
            SGRAD=q is not None, EXPAND=expand is not None, EXPAND_SCALE=scale2, ACCUMULATE=accumulate,
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )
    return part, chunks


def reduce_shape(num_jobs: int, N: int, block_r: int, partials: int, pb: int) -> tuple[int, int, int]:
    """(columns per program, partials summed per step, rank rows per program) of the reduce over
    partials in column blocks of pb (lora_kernels' blocked layout).

    Many partials (the fused dy pass's dB: 96 a job at 8 x 24k tokens): a program reads whole block
    rows (pb columns) of 4 rank rows, 16 partials a step (4 x 64 x 16 fp32: 32 registers a thread at
    4 warps). Measured alone on the H200 at 8 jobs x 24k tokens, BLOCK_R 16 (reports/h200/fourteenth/
    reduce_probe.txt): 11.9 / 27.8 / 40.5 us at N 1024 / 2048 / 3072, torch's sum over the same
    partials 11.2 / 26.8 / 38.4 us; the launch up to ce8abe6 (rows layout, 32-64 columns, 8 a step)
    20.6 / 42.8 / 105.6 us; programs of half a block or of all 16 rank rows 2-6x slower than this.
    Few partials (below 8 a job: dA): one partial a step, all rank rows, as measured faster there
    (reports/h200/ninth/kernels.md)."""
    block_n = min(pb, max(16, pow2(N)))
    if partials < 8 * num_jobs:
        return block_n, 1, block_r
    rows = min(4, block_r)
    return block_n, max(2, min(16, 8192 // (rows * block_n))), rows


def _launch_reduce(part, out, meta, chunks, block_r, scale, *, shape=None):
    """out[rank rows of job j] = (scale_j *) sum of job j's partials (part: fp32 [cdiv(N, PB), chunks,
    BLOCK_R, PB], the blocked layout of lora_kernels). shape: (BLOCK_N, CHUNKS) instead of
    `reduce_shape`'s (the benchmark's baseline; tests); BLOCK_N is capped at PB (powers of 2: it
    divides PB, so each program's columns lie in one block)."""
    N, pb = out.shape[1], part.shape[3]
    if part.shape[0] != cdiv(N, pb) or part.shape[2] != block_r:
        raise ValueError(f"partials {tuple(part.shape)}: expected [{cdiv(N, pb)}, chunks, {block_r}, {pb}]")
    block_n, per_step, rows = shape or reduce_shape(meta.num_jobs, N, block_r, chunks.n, pb)
    block_n = min(block_n, pb)
    lora_reduce_kernel[(meta.num_jobs, cdiv(N, block_n), block_r // rows)](
        part, out,
        chunks.job_start, meta.rank_start_t, meta.scale_t,
        N, part.shape[1],
        out.stride(0), out.stride(1),
        BLOCK_R=block_r, BLOCK_N=block_n, PB=pb, CHUNKS=per_step, HAS_SCALE=scale, ROWS=rows,
        num_warps=8 if rows * block_n * per_step >= 16384 else 4,
    )
