"""A dedicated run whose jobs ran on several GPUs at once, merged into the run directory a one-GPU
dedicated run makes (`colora sweep --gpus N`, `colora bench arms --gpus N`; colora/sweeps/on_cluster.py).

    DIR/parts/<k>/       part k: a dedicated run of some of the jobs (colora.run.runner) on a GPU of its own
    DIR/parts/<k>.log    its log

When every part is complete, DIR gets what a one-GPU dedicated run leaves there: config.json (the
whole config and its hash), metrics.jsonl, eval_before.json and eval.json (the parts' together, in
part order), adapters/<job>/ (moved up), run.log (the parts' one after another), timeline.jsonl and
summary.json, then status.json. The parts' logs become DIR's log beside it (`DIR.log`, as a sweep's
run has). The timeline lays the parts end to end: each part is shifted so that its first span (its
engine's start) begins where the part before it ended, so that its jobs' spans and windows follow
one another as in a one-GPU dedicated run, where each job runs alone, and every reader of a
dedicated run (the busy share, the phase times, the timeline figure) reads both alike. When and
where each part really ran is in the summary's `parts` (wall-clock `started` and `ended`, its GPU,
its `shift`). The throughput keeps the one-GPU definition: steps summed over the jobs' windows
over their seconds summed (throughput.combine_windows), so both report the same quantity.

A part's checkpoints stay in parts/<k>/checkpoints (a checkpoint holds the states of the jobs that
ran together), with its config.json and status.json; its summary.json is folded into DIR's, so DIR
is the only run a report finds there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from colora.cluster.placement import Outcome, merge_eval
from colora.config import Config
from colora.record.runlog import read_jsonl, write_json_atomic
from colora.record.summary import RunSummary
from colora.record.throughput import busy, combine_windows, throughput

TIMES = ("start", "end", "queued")  # a timeline span's fields that are timeline seconds


def part_dir(out: Path, k: int) -> Path:
    return out / "parts" / str(k)


def part_log(out: Path, k: int) -> Path:
    return out / "parts" / f"{k}.log"


def _shift_window(w: dict, by: float) -> dict:
    return {**w, "start": w["start"] + by, "end": w["end"] + by, "t0": w["t0"] + by,
            "ends": {n: [t + by for t in e] for n, e in w["ends"].items()}}


def _append(dst: Path, parts: list[tuple[str, Path]]) -> None:
    """Each file of `parts` (header, path) onto `dst`, under its header line; the parts removed."""
    with open(dst, "ab") as f:
        for header, src in parts:
            if src.exists():
                f.write(f"== {header} ==\n".encode())
                f.write(src.read_bytes())
                src.unlink()


def gather_logs(out: Path, jobs: list[list[str]]) -> Path:
    """The logs of the parts (each part's jobs in `jobs`), one after another, as the run's log beside
    it, whether the parts completed or not; returns its path."""
    log = out.with_name(out.name + ".log")
    _append(log, [(f"part {k}: {', '.join(names)}", part_log(out, k)) for k, names in enumerate(jobs)])
    return log


def _largest(peaks: list[dict | None]) -> dict | None:
    """The parts' trainer peaks, each the largest of any part's (None where no part ran on a GPU)."""
    seen = [p for p in peaks if p]
    return {k: max(p[k] for p in seen) for k in ("allocated", "reserved")} if seen else None


def merge_parts(cfg: Config, out: Path, parts: list[Outcome]) -> dict:
    """Merge complete parts (their Outcomes, in part order, each run in `part_dir(out, k)`) into `out`
    as the module docstring says; returns the summary it wrote."""
    assert all(o.summary is not None for o in parts), "merge_parts takes complete parts only"
    spans, windows, rows, before, evals, shifts = [], [], [], {}, [], []
    end = None
    for k, o in enumerate(parts):
        d = part_dir(out, k)
        tl = read_jsonl(d / "timeline.jsonl")
        by = 0.0 if end is None or not tl else end - min(s["start"] for s in tl)
        tl = [{**s, **{f: s[f] + by for f in TIMES if f in s}} for s in tl]
        end = max((s["end"] for s in tl), default=end)
        spans += tl
        shifts.append(by)
        windows += [_shift_window(w, by) for w in o.summary["window"]["windows"]]
        rows += read_jsonl(d / "metrics.jsonl")
        if (d / "eval_before.json").exists():
            before.update(json.loads((d / "eval_before.json").read_text()))
        if (d / "eval.json").exists():
            evals.append(json.loads((d / "eval.json").read_text()))
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    for name, data in (("metrics.jsonl", rows), ("timeline.jsonl", spans)):
        (out / name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in data))
    write_json_atomic(out / "eval_before.json", before)
    write_json_atomic(out / "eval.json", merge_eval(evals))
    (out / "adapters").mkdir(exist_ok=True)
    for k, o in enumerate(parts):
        for job in o.jobs:
            shutil.move(str(part_dir(out, k) / "adapters" / job), str(out / "adapters" / job))
    _append(out / "run.log", [(f"part {k}: {', '.join(o.jobs)} on {o.info.get('host', '?')} GPU "
                               f"{(o.info.get('gpu_ids') or ['?'])[0]}", part_dir(out, k) / "run.log")
                              for k, o in enumerate(parts)])
    window = combine_windows(windows)
    first = parts[0].summary
    utils = [(o.summary["gpu_util"], o.summary["seconds_measured"]) for o in parts if o.summary["gpu_util"] is not None]
    order = [j.name for j in cfg.jobs]
    jobs = {n: j for o in parts for n, j in o.summary["jobs"].items()}
    summary = RunSummary(
        experiment=cfg.experiment.name, arm=cfg.experiment.arm, seed=cfg.experiment.seed, config_hash=cfg.hash(),
        code_version=first["code_version"], runtime=first["runtime"], model=first["model"], device=first["device"],
        dtype=first["dtype"], mps=first["mps"],
        engine_start_s=max(o.summary["engine_start_s"] for o in parts),  # they started at once
        engine_reused=all(o.summary["engine_reused"] for o in parts),
        engine_process=first["engine_process"], adapter_sync=first["adapter_sync"], packed_rows=first["packed_rows"],
        trainer_setup_s=max(o.summary["trainer_setup_s"] for o in parts), trainer_sm_count=first["trainer_sm_count"],
        steps_measured=window["steps"], seconds_measured=window["seconds"], steps_per_hour=throughput(window),
        groups=None, busy_fraction=busy(spans, window),
        gpu_util=sum(u * s for u, s in utils) / sum(s for _, s in utils) if utils and sum(s for _, s in utils) else None,
        wall_s=max(o.ended for o in parts) - min(o.started for o in parts), jobs={n: jobs[n] for n in order},
        window=window, trainer_peak_gib=_largest([o.summary.get("trainer_peak_gib") for o in parts])).to_dict()
    summary["parts"] = [{"dir": str(part_dir(out, k).relative_to(out)), "jobs": o.jobs, "shift": shifts[k],
                         "started": o.started, "ended": o.ended, **o.info,
                         **{key: o.summary[key] for key in ("steps_measured", "seconds_measured", "steps_per_hour",
                                                            "engine_start_s", "wall_s")}}
                        for k, o in enumerate(parts)]
    write_json_atomic(out / "summary.json", summary)
    for k in range(len(parts)):
        for name in ("summary.json", "metrics.jsonl", "timeline.jsonl", "eval.json", "eval_before.json"):
            (part_dir(out, k) / name).unlink(missing_ok=True)
        shutil.rmtree(part_dir(out, k) / "adapters", ignore_errors=True)
    write_json_atomic(out / "status.json", {"state": "complete"})
    return summary
