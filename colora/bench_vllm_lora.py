"""Tune vLLM's multi-LoRA kernels (shrink, expand) for one workload's engine on this GPU.

    colora bench vllm-lora experiments/reference8_throughput.toml --out reports/vllm_lora
    VLLM_TUNED_CONFIG_FOLDER=reports/vllm_lora.configs colora bench arms ...   (the engine uses them)

Why: vLLM's LoRA kernels run with built-in block sizes unless VLLM_TUNED_CONFIG_FOLDER names a folder
of tuned ones (vllm/lora/ops/triton_ops/README_TUNING.md), and on the H200 the engine's decode step at
512 requests spent 3.2 of its 12.0 ms in them (reports/h200/ninth/engine); generation is three
quarters of a group's cycle in the overlap arms (reports/h200/tenth).

What: for every LoRA'd projection of the workload's model as vLLM runs it (q|k|v in one call of three
slices, o, gate|up of two, down) and every batch size in --batches (decode tokens: requests in
flight), vLLM's own `_lora_shrink` / `_lora_expand` are timed with each configuration of a search
space (and vLLM's default), on the engine's layout (max_loras slots, the jobs' adapters active,
tokens spread over them as decode batches are). A configuration's time is the GPU's: the calls are
captured in a CUDA graph and replayed, as the engine replays its decode step. A configuration whose
output differs from the default's beyond fp32 rounding is discarded. Writes the winners where vLLM
looks for them (OUT.configs/{GPU}_SHRINK.json, {GPU}_EXPAND_TRUE.json: vLLM's engine adds the LoRA
output to the base projection's, add_inputs=True) and OUT.json / OUT.md with each shape's default
and tuned time, measured in the same process on the same inputs.

vLLM picks a configuration by max_loras, slices, batch, K and N, each the nearest tuned value where
it has no exact one (slices exactly); so batches between the tuned ones get their nearest's.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SHRINK_SPACE = {"block_m": (16, 32, 64), "block_k": (32, 64, 128, 256), "split_k": (1, 2, 4, 8, 16),
                "num_warps": (4,), "num_stages": (2, 3)}
EXPAND_SPACE = {"block_m": (16, 32, 64, 128), "block_n": (32, 64, 128, 256), "num_warps": (4, 8), "num_stages": (2, 3)}


@dataclass(frozen=True)
class LoRAShape:
    """One vLLM LoRA kernel call: `op` shrink (x [M, k] -> [slices, M, rank]) or expand
    ([slices, M, rank] -> y [M, sum(outs)]); `k` / `n` as vLLM's config lookup keys them (shrink:
    k = the input width, n = rank; expand: k = rank, n = the widest slice)."""

    op: str
    module: str
    slices: int
    k: int
    n: int
    outs: tuple[int, ...] = ()  # expand: each slice's output width


def lora_shapes(model_config, rank: int, target_modules) -> list[LoRAShape]:
    """The shrink and expand calls vLLM makes for a model (a transformers config: hidden_size,
    intermediate_size, num_attention_heads, num_key_value_heads, head_dim) whose `target_modules`
    carry rank-`rank` adapters. vLLM merges q/k/v into one call of three slices and gate/up into one
    of two; a merged call runs when any of its projections is adapted. Calls of one shape (vLLM's
    config lookup cannot tell them apart) are one entry, named by all their modules."""
    c = model_config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    q, kv = heads * head_dim, getattr(c, "num_key_value_heads", heads) * head_dim
    d, f = c.hidden_size, c.intermediate_size
    targets = set(target_modules)
    calls = []  # (module, in width, slice output widths)
    if targets & {"q_proj", "k_proj", "v_proj"}:
        calls.append(("qkv_proj", d, (q, kv, kv)))
    if "o_proj" in targets:
        calls.append(("o_proj", q, (d,)))
    if targets & {"gate_proj", "up_proj"}:
        calls.append(("gate_up_proj", d, (f, f)))
    if "down_proj" in targets:
        calls.append(("down_proj", f, (d,)))
    out: dict[tuple, LoRAShape] = {}  # one entry per distinct call (o_proj's expand is down_proj's)
    for module, width, outs in calls:
        for shape in (LoRAShape("shrink", module, len(outs), width, rank),
                      LoRAShape("expand", module, len(outs), rank, max(outs), outs)):
            key = (shape.op, shape.slices, shape.k, shape.n, shape.outs)
            if key in out:
                shape = replace(out[key], module=f"{out[key].module}, {module}")
            out[key] = shape
    return list(out.values())


def default_config(op: str, batch: int, slices: int) -> dict:
    """vLLM 0.26's built-in configuration (vllm/lora/ops/triton_ops/utils.py, get_lora_op_configs),
    written out so that the report compares against it and a tuned file can fall back to it."""
    if op == "shrink":
        return {"block_m": 32, "block_n": 16, "block_k": 256 if batch < 128 else 32,
                "split_k": 64 if batch < 128 else 8, "num_warps": 4, "num_ctas": 1, "group_size_m": 8,
                "num_stages": 2, "max_nreg": None}
    return {"block_m": 64, "block_n": 64 if slices > 1 else 128, "block_k": 32, "num_warps": 4, "num_ctas": 1,
            "num_stages": 2, "max_nreg": None}


def candidates(shape: LoRAShape, batch: int) -> list[dict]:
    """The search space for one call, vLLM's default first. Triton's tl.dot needs every block
    dimension >= 16; the rank is one block (shrink's N, expand's K), its next power of two."""
    rank_block = max(16, 1 << (max(shape.n if shape.op == "shrink" else shape.k, 1) - 1).bit_length())
    out = [default_config(shape.op, batch, shape.slices)]
    if shape.op == "shrink":
        space = SHRINK_SPACE
        for bm, bk, sk, w, s in itertools.product(*space.values()):
            if bk * sk <= max(shape.k, bk):  # a split beyond K only adds empty programs
                out.append({"block_m": bm, "block_n": rank_block, "block_k": bk, "split_k": sk, "num_warps": w,
                            "num_ctas": 1, "group_size_m": 8, "num_stages": s, "max_nreg": None})
    else:
        space = EXPAND_SPACE
        for bm, bn, w, s in itertools.product(*space.values()):
            out.append({"block_m": bm, "block_n": bn, "block_k": rank_block, "num_warps": w, "num_ctas": 1,
                        "num_stages": s, "max_nreg": None})
    seen, unique = set(), []
    for c in out:
        key = json.dumps(c, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


def config_tree(best: list[dict], max_loras: int) -> dict[str, dict]:
    """vLLM's tuned-config files from the winners ({"op", "shape": LoRAShape fields, "batch",
    "config"} each): {file name without the GPU prefix: config_data[max_loras][slices][m][k][n]}.
    `max_loras` is the lookup's (vLLM's lora_ids: the engine's max_loras + 1)."""
    files: dict[str, dict] = {}
    for b in best:
        s = b["shape"]
        name = "SHRINK" if s["op"] == "shrink" else "EXPAND_TRUE"
        node = files.setdefault(name, {}).setdefault(str(max_loras), {}).setdefault(str(s["slices"]), {})
        node.setdefault(str(b["batch"]), {}).setdefault(str(s["k"]), {})[str(s["n"])] = b["config"]
    return files


def gpu_file_prefix(device_name: str) -> str:
    """vLLM's file-name prefix for a GPU (load_lora_op_config): spaces and dashes to underscores."""
    return device_name.replace(" ", "_").replace("-", "_")


def write_configs(folder: Path, device_name: str, files: dict[str, dict]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, tree in files.items():
        p = folder / f"{gpu_file_prefix(device_name)}_{name}.json"
        p.write_text(json.dumps(tree, indent=1, sort_keys=True))
        paths.append(p)
    return paths


class _Case:
    """One call's inputs on the GPU, in vLLM's layout, and a runner for a given configuration."""

    def __init__(self, shape: LoRAShape, batch: int, max_loras: int, active: int, dtype, seed: int):
        import torch
        from vllm.lora.ops.triton_ops import lora_expand_op, lora_shrink_op, utils
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

        self.torch, self.shape = torch, shape
        self.ops = {"shrink": lora_shrink_op, "expand": lora_expand_op}
        utils._LORA_A_PTR_DICT.clear()  # keyed by data pointers: stale once earlier weights are freed
        utils._LORA_B_PTR_DICT.clear()
        g = torch.Generator(device="cuda").manual_seed(seed)
        dev = "cuda"
        r = shape.n if shape.op == "shrink" else shape.k
        meta = LoRAKernelMeta.make(max_loras, batch, dev)
        mapping = (torch.arange(batch, device=dev) % active)[torch.randperm(batch, device=dev, generator=g)]
        meta.prepare_tensors(mapping.to(torch.int32))
        params = inspect.signature(meta.meta_args).parameters
        self.meta = meta.meta_args(batch, False) if len(params) > 1 else meta.meta_args(batch)
        if shape.op == "shrink":
            self.x = torch.randn(batch, shape.k, device=dev, dtype=dtype, generator=g)
            self.w = [torch.randn(max_loras, 1, r, shape.k, device=dev, dtype=dtype, generator=g) * 0.02
                      for _ in range(shape.slices)]
            self.out = torch.empty(shape.slices, batch, r, device=dev, dtype=torch.float32)
        else:
            self.x = torch.randn(shape.slices, batch, r, device=dev, dtype=torch.float32, generator=g)
            self.w = [torch.randn(max_loras, 1, o, r, device=dev, dtype=dtype, generator=g) * 0.02
                      for o in shape.outs]
            self.out = torch.zeros(batch, sum(shape.outs), device=dev, dtype=dtype)

    def call(self, config: dict) -> None:
        """vLLM's own launcher with `config`: the op asks its module's `get_lora_op_configs` for its
        block sizes, so that lookup answers `config` for this call (and is put back after). Why not
        launch the kernel here: a copy of vLLM's launcher would time another launch than vLLM's."""
        mod = self.ops[self.shape.op]
        saved = mod.get_lora_op_configs
        mod.get_lora_op_configs = lambda *a, **k: config  # noqa: E731
        try:
            if self.shape.op == "shrink":
                mod._lora_shrink(self.x, self.w, self.out, *self.meta, 1.0)
            else:
                mod._lora_expand(self.x, self.w, self.out, *self.meta, offset_start=0, add_inputs=True)
        finally:
            mod.get_lora_op_configs = saved

    def result(self, config: dict):
        if self.shape.op == "expand":
            self.out.zero_()
        self.call(config)
        self.torch.cuda.synchronize()
        return self.out.float().clone()

    def time_us(self, config: dict, calls: int = 20, replays: int = 5) -> float:
        """GPU microseconds per call: `calls` calls in one CUDA graph, the median of `replays` replays."""
        torch = self.torch
        self.call(config)  # compile, and fill vLLM's pointer tables outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                self.call(config)
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0 / calls)
        del graph
        return sorted(times)[len(times) // 2]


def tune(shapes: list[LoRAShape], batches: list[int], max_loras: int, active: int, dtype, deadline: float,
         log=print) -> list[dict]:
    """For every (shape, batch): the default's time and the fastest correct configuration found before
    `deadline` (time.monotonic()); the default wins where nothing beats it."""
    rows = []
    for shape, batch in itertools.product(shapes, batches):
        case = _Case(shape, batch, max_loras, active, dtype, seed=batch)
        cands = candidates(shape, batch)
        want = case.result(cands[0])
        tol = 2e-2 * float(want.abs().max()) + 1e-6  # fp32 accumulation in another order (split-K atomics)
        t_default = case.time_us(cands[0])
        best, t_best, tried, wrong, failed = cands[0], t_default, 1, 0, 0
        for c in cands[1:]:
            if time.monotonic() > deadline:
                break
            try:
                if float((case.result(c) - want).abs().max()) > tol:
                    wrong += 1
                    continue
                t = case.time_us(c)
            except Exception as e:  # a configuration the compiler refuses (shared memory, registers)
                failed += 1
                log(f"  {shape.op} {shape.module} batch {batch}: {json.dumps(c)} failed: {type(e).__name__}: {e}")
                continue
            tried += 1
            if t < t_best:
                best, t_best = c, t
        row = {"shape": asdict(shape), "batch": batch, "default_us": round(t_default, 3), "tuned_us": round(t_best, 3),
               "speedup": round(t_default / t_best, 3), "config": best, "tried": tried, "wrong": wrong,
               "failed": failed, "space": len(cands)}
        log(json.dumps({k: v for k, v in row.items() if k != "config"}))
        rows.append(row)
        del case
    return rows


def to_markdown(result: dict) -> str:
    lines = [f"# vLLM LoRA kernel tuning: {result['device']}", "", "```", result["command"], "```", "",
             f"vLLM {result['vllm']}, torch {result['torch']}, Triton {result['triton']}; {result['dtype']}; "
             f"max_loras {result['max_loras']} (lookup key {result['max_loras'] + 1}), {result['active']} adapters "
             f"active, rank {result['rank']}; GPU time per call (CUDA graph of 20 calls, median of 5 replays). "
             f"Files: {', '.join(result['files'])}.", "",
             "| op | module | slices | k | n | batch | default us | tuned us | speedup | tried / space (wrong, failed) | tuned config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, c = r["shape"], r["config"]
        cfg = ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("num_ctas", "max_nreg", "group_size_m"))
        lines.append(f"| {s['op']} | {s['module']} | {s['slices']} | {s['k']} | {s['n']} | {r['batch']} | "
                     f"{r['default_us']:.2f} | {r['tuned_us']:.2f} | {r['speedup']:.2f}x | {r['tried']} / {r['space']} "
                     f"({r['wrong']}, {r['failed']}) | {cfg} |")
    by_batch = {}
    for r in result["rows"]:
        d, t = by_batch.get(r["batch"], (0.0, 0.0))
        n = len(r["shape"]["module"].split(", "))  # a shape shared by n modules runs n times a layer
        by_batch[r["batch"]] = (d + n * r["default_us"], t + n * r["tuned_us"])
    lines += ["", f"Per decode step (every module's call once per layer, {result['layers']} layers; the calls "
              "of a layer summed, not a measured step):", "",
              "| batch | default ms | tuned ms |", "|---|---|---|"]
    for b, (d, t) in sorted(by_batch.items()):
        lines.append(f"| {b} | {d * result['layers'] / 1000:.2f} | {t * result['layers'] / 1000:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench vllm-lora", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256, 384, 512])
    p.add_argument("--budget", type=float, default=420.0, help="seconds for the search; the rest keeps the default")
    p.add_argument("--out", default="reports/vllm_lora", help="report path without suffix; configs in OUT.configs/")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.budget <= 0:
        p.error("--batches must be at least 1 and --budget positive")
    import torch

    if not torch.cuda.is_available():
        print("colora bench vllm-lora: needs a CUDA GPU (it times vLLM's Triton kernels)", file=sys.stderr)
        return 2
    import triton
    import vllm
    from transformers import AutoConfig

    from .config import load_config
    from .runner import resolve_device, resolve_model
    from .runlog import write_report

    cfg = load_config(args.config, args.set)
    model_dir = resolve_model(cfg.experiment.model)
    _, dtype = resolve_device(cfg)
    ranks = {j.lora_rank for j in cfg.jobs}
    mc = AutoConfig.from_pretrained(str(model_dir))
    targets = sorted({m for j in cfg.jobs for m in j.target_modules})
    shapes = lora_shapes(mc, max(ranks), targets)  # vLLM pads every slot to max_lora_rank
    max_loras = cfg.engine.max_loras or len(cfg.jobs)
    active = min(len(cfg.jobs), max_loras)
    t0 = time.monotonic()
    rows = tune(shapes, sorted(set(args.batches)), max_loras, active, getattr(torch, dtype), t0 + args.budget)
    name = torch.cuda.get_device_name()
    folder = Path(args.out + ".configs")
    files = write_configs(folder, name, config_tree(rows, max_loras + 1))
    result = {"command": "colora bench vllm-lora " + " ".join(argv), "device": name, "vllm": vllm.__version__,
              "torch": torch.__version__, "triton": triton.__version__, "dtype": dtype, "max_loras": max_loras,
              "active": active, "rank": max(ranks), "layers": mc.num_hidden_layers, "targets": targets,
              "seconds": round(time.monotonic() - t0, 1), "files": [str(f) for f in files], "rows": rows}
    write_report(args.out, result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
