"""The table a run ends with: per job its status, steps, first and last step's mean reward and eval
accuracy before and after, then the run's steps per device-hour and what the columns hold.

    colora run CONFIG        (printed when the run ends; `colora run --resume DIR` too)
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table
from rich.text import Text

from colora import output
from colora.record.runlog import read_jsonl
from colora.record.throughput import short_window


def closing_rows(summary: dict, rows: list[dict]) -> list[dict]:
    """Per job: status, steps, first and last step's mean reward (metrics.jsonl's ok rows), eval
    accuracy before and after (summary.json)."""
    out = []
    for name, j in summary["jobs"].items():
        sft = j.get("kind") == "sft"  # its loss (NLL per assistant token) where a grpo job has its reward
        key = "loss" if sft else "reward"
        rs = sorted((r["step"], r[key]) for r in rows
                    if r.get("job") == name and r.get("status") == "ok" and key in r and "event" not in r)
        out.append({"job": name, "status": j["status"], "reason": j.get("reason") or "", "steps": j["steps"],
                    **({"sft": True} if sft else {}),  # reward_* and eval_* then hold its losses
                    "reward_first": rs[0][1] if rs else None, "reward_last": rs[-1][1] if rs else None,
                    "eval_before": j.get("eval_loss_before" if sft else "eval_before"),
                    "eval_after": j.get("eval_loss_after" if sft else "eval_after")})
    return out


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None and b is None else f"{_num(a)} -> {_num(b)}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def closing_table(summary: dict, rows: list[dict]) -> tuple[Table, list[str]]:
    """The table a run ends with (see `closing_rows`), its last row the run's steps per device-hour,
    and the lines under it: what the columns hold, why a job stopped, whether the window was too
    short for the steps per hour to mean much."""
    from rich import box


    t = Table(title=f"{summary['experiment']}: {summary['arm']}, seed {summary['seed']}", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("job", "status", "steps", "reward", "eval", "steps/h"):
        t.add_column(col, justify="left" if col in ("job", "status") else "right", no_wrap=True)
    cr = closing_rows(summary, rows)
    for r in cr:
        sft = r.get("sft", False)

        def cell(a, b, sft=sft):
            pair = _pair(a, b)
            return f"loss {pair}" if sft and pair != "-" else pair

        t.add_row(r["job"], r["status"], str(r["steps"]), cell(r["reward_first"], r["reward_last"]),
                  cell(r["eval_before"], r["eval_after"]), "")
    sph = summary.get("steps_per_hour")
    t.add_row("all jobs", "", str(sum(r["steps"] for r in cr)), "", "",
              f"{sph:.0f}" if isinstance(sph, (int, float)) and math.isfinite(sph) else "-", end_section=True)
    lines = ["reward: the mean reward of the first -> last step; eval: held-out accuracy before -> after training; "
             f"steps/h: optimizer steps per device-hour summed over jobs, over the {summary.get('steps_measured')} "
             f"job-steps measured in {summary.get('seconds_measured') or 0:.1f} s after the warm-up"]
    if any(r.get("sft") for r in cr):
        lines.append("loss: an sft job's mean NLL per assistant token, of its first -> last step and held out "
                     "before -> after training")
    lines += [f"{r['job']} stopped: {r['reason']}" for r in cr if r["reason"]]
    note = short_window(summary.get("seconds_measured") or 0.0, summary.get("steps_measured") or 0, len(cr))
    if note:
        lines.append(f"steps/h {note}")
    return t, lines


def print_closing(summary: dict, run_dir: Path) -> None:
    """The closing table of a finished run, from its summary and metrics, on the console."""
    table, lines = closing_table(summary, read_jsonl(Path(run_dir) / "metrics.jsonl"))
    c = output.console()
    c.print(table)
    for line in lines:
        c.print(Text(line))
