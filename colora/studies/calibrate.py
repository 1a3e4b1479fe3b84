"""Where a base model starts on a task: greedy accuracy and sampled reward on the eval split.

    colora tasks calibrate MODEL --task addition,digits=1,terms=3 [--task NAME,k=v ...] [--n 64] [--samples 8]

A learning experiment needs every task inside the model's reach: a task the model never solves gives
GRPO no signal (every group's rewards equal), one it always solves leaves nothing to learn. This
prints, per (task, options), the greedy accuracy on n eval items and, at the given temperature, the
mean reward over `samples` samples per item and the share of items whose samples are mixed (some
right, some wrong: the groups that carry signal). One engine serves every setting asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from colora.config import EngineConfig
from colora.tables import parse_override
from colora.engine.rollout import GenRequest, RolloutEngine
from colora.models.base import load_tokenizer
from colora.run.preflight import resolve_model
from colora.seeding import derive_seed
from colora.tasks import TaskError, get_task


def calibrate(engine: RolloutEngine, tok, task, n: int, samples: int, temperature: float, max_tokens: int,
              seed: int = 0) -> dict:
    """Greedy accuracy, sampled mean reward and mixed-group share of the base model on `task`."""
    items = task.sample(n, derive_seed(seed, "calibrate", "eval"), "eval")
    prompts = []
    for it in items:
        text = tok.apply_chat_template(list(it.messages), tokenize=False, add_generation_prompt=True)
        prompts.append(tuple(tok(text, add_special_tokens=False).input_ids))
    greedy = engine.generate([GenRequest(None, p, max_tokens, 0.0, tag=i) for i, p in enumerate(prompts)])
    sampled = engine.generate([GenRequest(None, p, max_tokens, temperature, seed=derive_seed(seed, i, s), tag=i)
                               for i, p in enumerate(prompts) for s in range(samples)])
    acc = sum(task.reward(r.text, items[r.request.tag]) for r in greedy) / n
    per_item: dict[int, list[float]] = {}
    for r in sampled:
        per_item.setdefault(r.request.tag, []).append(task.reward(r.text, items[r.request.tag]))
    mean = sum(sum(v) for v in per_item.values()) / (n * samples)
    mixed = sum(1 for v in per_item.values() if 0 < sum(v) < len(v)) / n
    return {"greedy_accuracy": acc, "sampled_reward": mean, "mixed_share": mixed, "n": n, "samples": samples,
            "temperature": temperature, "example": greedy[0].text[:200]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colora tasks calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a model directory or builtin:NAME")
    p.add_argument("--task", action="append", required=True, metavar="NAME[,k=v,...]",
                   help="a task and its options, e.g. addition,digits=1,terms=3 (repeatable)")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--out", help="also write the results as JSON here")
    args = p.parse_args(argv)





    specs = []
    for spec in args.task:  # every task and its eval items are checked before the engine starts
        name, *opts = spec.split(",")
        try:
            task = get_task(name, **dict(parse_override(o) for o in opts))
            task.sample(args.n, derive_seed(0, "calibrate", "eval"), "eval")
        except TaskError as e:
            print(f"{spec:<48} skipped: {e}", flush=True)
            continue
        specs.append((spec, task))
    model_dir = resolve_model(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    engine = RolloutEngine(str(model_dir), EngineConfig(gpu_memory_utilization=0.3 if device == "cpu" else 0.5,
                                                        max_model_len=1024, enforce_eager=device == "cpu"),
                           max_loras=1, max_lora_rank=8, dtype=dtype, seed=0, device=device)
    tok = load_tokenizer(model_dir)
    results = {}
    try:
        for spec, task in specs:
            r = calibrate(engine, tok, task, args.n, args.samples, args.temperature, args.max_tokens)
            results[spec] = r
            print(f"{spec:<48} greedy {r['greedy_accuracy']:.3f}  sampled {r['sampled_reward']:.3f}  "
                  f"mixed groups {r['mixed_share']:.2f}", flush=True)
    finally:
        engine.close()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
