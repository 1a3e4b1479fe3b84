"""The Markdown of a report: `render` for a statistical report over runs (colora report, sweeps),
`arms_tables` for the arms benchmark's throughput and phase tables.
"""

from __future__ import annotations

import math

from colora.config import ARMS
from colora.record.compilewatch import describe
from colora.record.phases import PHASES
from colora.record.throughput import SHORT_WINDOW_S, SHORT_WINDOW_STEPS, failed_note
from colora.studies import stats
from colora.studies.report_data import METRICS, RunData, display_path


def _f(v, fmt=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def _ci(iv: dict) -> str:
    return f"[{_f(iv['low'], '+.4f')}, {_f(iv['high'], '+.4f')}]"


def _code(summary: dict) -> str:
    """The source hash of the code that made a run (colora.record.provenance), '-' for runs that predate it."""
    return (summary.get("code_version") or {}).get("source_hash") or "-"


def _throughput(res: dict) -> list[str]:
    """The steps-per-hour table (ratios to dedicated beside), the A/A line, and which runs' windows
    are too short to mean much."""
    seeds = res["seeds"]
    L = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ratio |", "|---" * (len(seeds) + 2) + "|"]
    for a in res["arms"]:
        cells = []
        for s in seeds:
            v, r = res["steps_per_hour"][a].get(str(s)), res["ratio"].get(a, {}).get(str(s))
            cells.append(_f(v, ".1f") + (f" ({r:.3f}x)" if r is not None else ""))
        mean = _f(res["ratio_mean"].get(a), ".3f") + "x" if a != "dedicated" else "1x (baseline)"
        L.append(f"| {a} | " + " | ".join(cells) + f" | {mean} |")
    L += ["", "Ratio: the arm's steps per hour over dedicated's on the same seed, each averaged over repeats first.",
          ""]
    if res["aa"]["throughput"]:
        L.append("A/A (dedicated repeat 1 vs repeat 0, relative): " + ", ".join(
            f"seed {s}: {v:+.1%}" for s, v in res["aa"]["throughput"].items()) + ".")
    else:
        L.append("A/A: no seed has two dedicated repeats.")
    if res["short_windows"]:
        L += ["", f"> **Short measured windows:** the steps per hour of {len(res['short_windows'])} run(s) come from "
              "a window too short to mean much: "
              + "; ".join(f"{w['arm']} seed {w['seed']} r{w['repeat']}, {w['note'].split(':')[0]}"
                          for w in res["short_windows"])
              + f" (under {SHORT_WINDOW_S:.0f} s or {SHORT_WINDOW_STEPS} measured steps per job)."]
    return L


def _learning(res: dict, analysis: dict) -> list[str]:
    """The paired differences, arm - dedicated, with both intervals (and the A/A's)."""
    conf = res["conf"]
    L = [f"Repeats are averaged per (job, seed) first. t: Student-t interval; bootstrap: "
         f"{analysis.get('bootstrap_method', 'percentile')} method, {analysis.get('bootstrap_resamples', 10000)} "
         f"resamples, numpy Generator seed {analysis.get('bootstrap_seed', 0)}. Pairs sharing a seed share a run; "
         "the intervals treat them as independent.", "",
         f"| arm | metric | pairs | mean diff | {conf:.0%} CI (t) | {conf:.0%} CI (bootstrap) |",
         "|---|---|---|---|---|---|"]
    rows = [(a, res["learning"][a]) for a in res["learning"]] + [("dedicated A/A (r1 - r0)", res["aa"])]
    for a, learn in rows:
        for m, title in METRICS:
            c = learn.get(m)
            if c:
                L.append(f"| {a} | {title} | {len(c['pairs'])} | {_f(c['t']['mean'], '+.4f')} | {_ci(c['t'])} | "
                         f"{_ci(c['bootstrap'])} |")
                if c["dropped"]:
                    L.append(f"| | unpaired, left out | {', '.join(f'{j} seed {s}' for j, s in c['dropped'])} | | | |")
    return L


def _gates(res: dict, gates: stats.Gates, prereg: dict) -> list[str]:
    L = [f"## Gates (pre-registered in `{prereg['path']}`)", "",
         f"throughput >= {gates.min_ratio:g}x dedicated on every seed; mean gain (ratio - 1) > {gates.aa_multiple:g} x "
         f"the largest |A/A|; paired {gates.conf:.0%} {gates.interval} lower bounds of eval accuracy and training "
         f"reward differences >= {gates.min_lower_bound:+g}.", ""]
    if not prereg["matches"]:
        L += ["> **Not a pre-registered test:** these runs' configs differ from the locked one: "
              + ", ".join(prereg["mismatched_runs"]), ""]
    if not res["gates"]:
        L += ["No arm besides dedicated (or no dedicated baseline): no gate can be evaluated.", ""]
    L += ["| arm | gate | result | value | threshold | numbers |", "|---|---|---|---|---|---|"]
    for a, g in res["gates"].items():
        for r in g["results"]:
            L.append(f"| {a} | {r['name']} | **{r['status']}** | {_f(r['value'], '.4f')} | "
                     f"{_f(r['threshold'], '.4f')} | {r['detail']} |")
        L.append(f"| {a} | **all gates** | **{g['overall']}** | | | |")
    L += ["", "Hypotheses:", ""] + [f"- {h['id']} ({h.get('arm') or 'all arms'}): {h['statement']}"
                                    for h in prereg["hypotheses"]]
    return L


def render(res: dict, runs: list[RunData], command: str, gates: stats.Gates | None, prereg: dict | None,
           warnings: list[str], figures: list[str], analysis: dict) -> str:
    """The report: with a pre-registration (`prereg`, `gates`) its result and gates come first and a
    replication on other seeds has its own section; without, no gate is described or applied."""
    seeds = res["seeds"]
    L = [f"# colora report: {', '.join(res['arms'])} over seeds {', '.join(map(str, seeds))}", "",
         "Generated by:", "", f"    {command}", ""]
    for w in warnings + res["notes"]:
        L.append(f"> **Warning:** {w}")
    if warnings or res["notes"]:
        L.append("")
    if prereg is None:
        L += ["No pre-registration given: the report describes and applies no gates (`--prereg FILE` applies "
              "one's).", ""]
    if res["gates"]:
        L += ["## Result", ""]
        for a, g in res["gates"].items():
            ratio = res["ratio_mean"].get(a)
            failed = [r["name"] for r in g["results"] if r["status"] != stats.PASS]
            L.append(f"- **{a}: {g['overall']}**" + (f" ({_f(ratio)}x dedicated, mean over seeds)" if ratio else "")
                     + (f"; not passed: {', '.join(failed)}" if failed else "; every gate passed")
                     + (" (primary arm)" if prereg and a == prereg["primary_arm"] else ""))
        L.append("")
    L += ["## Throughput: optimizer steps per device-hour, all jobs", ""] + _throughput(res)
    L += ["", "## Learning: paired differences, arm - dedicated, per (job, seed)", ""] + _learning(res, analysis)
    ebj = res.get("eval_by_job") or {}
    if ebj:
        arms_e = [a for a in res["arms"] if a in ebj]
        jobs = sorted({j for a in arms_e for j in ebj[a]})
        L += ["", "## Eval accuracy before and after training, per job", "",
              "Held-out eval split, greedy; each cell: before -> after (change), the mean over seeds (and "
              "repeats). The last row counts the jobs whose accuracy rose.", "",
              "| job | " + " | ".join(arms_e) + " |", "|---" * (len(arms_e) + 1) + "|"]
        for j in jobs:
            cells = [(f"{ebj[a][j]['before']:.3f} -> {ebj[a][j]['after']:.3f} ({ebj[a][j]['change']:+.3f})"
                      if j in ebj[a] else "-") for a in arms_e]
            L.append(f"| {j} | " + " | ".join(cells) + " |")
        L.append("| rose on | " + " | ".join(
            f"{sum(v['change'] > 0 for v in ebj[a].values())} of {len(ebj[a])}" for a in arms_e) + " |")
    rep = res.get("replication")
    if rep:
        L += ["", "## Replication on fresh seeds, not pooled into the gates", "",
              f"Seeds {', '.join(map(str, rep['seeds']))}, which the pre-registration does not list: the same "
              "numbers computed over these runs alone. No gate is applied to them.", ""]
        L += [f"> **Note:** {n}" for n in rep["notes"]] + ([""] if rep["notes"] else [])
        L += ["Throughput, steps per device-hour (ratio to dedicated on the same seed):", ""] + _throughput(rep)
        if rep["learning"] or rep["aa"].get("eval_accuracy"):
            L += ["", "Learning, arm - dedicated per (job, seed):", ""] + _learning(rep, analysis)
    if prereg is not None and gates is not None:
        L += [""] + _gates(res, gates, prereg)
    L += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    short = {w["dir"] for w in res["short_windows"] + ((rep or {}).get("short_windows") or [])}
    L += ["", "## Runs used", "",
          "config hash: the hash a pre-registration locks (every setting but experiment.arm and experiment.seed); "
          "code: the hash of the source tree that ran (colora.record.provenance); seconds: the measured window "
          "(short: too short for its steps per hour to mean much).",
          "", "| arm | seed | repeat | steps | seconds | steps/h | device | MPS | engine | config hash | code | directory |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.summary
        L.append(f"| {r.arm} | {r.seed} | {r.repeat} | {s.get('steps_measured')} | "
                 f"{_f(s.get('seconds_measured'), '.1f')}{' (short)' if display_path(r.path) in short else ''} | "
                 f"{_f(r.steps_per_hour, '.1f')} | {s.get('device')} | {s.get('mps')} | "
                 f"{'reused' if s.get('engine_reused') else 'started'} | {r.lock_hash} | {_code(s)} | {display_path(r.path)} |")
    return "\n".join(L) + "\n"


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def arms_tables(rows: list[dict], command: str, cfg, steady_from: int = 0) -> str:
    """The arms benchmark's report (colora/bench/arms.py): steps per device-hour and the ratio to the
    seed's dedicated run per arm, the job-count and tuning runs, and per run its engine, phase times,
    group chains and the engine's decoding while a group trains and while none does
    (colora/record/phases.py); with `steady_from`, the main runs' figures from that step of each job on too."""
    seeds = sorted({r["seed"] for r in rows})
    arms = [a for a in ARMS if any(r["arm"] == a and r["label"] == "main" for r in rows)]
    lines = [f"# Arms benchmark: {cfg.experiment.name}", "", "```", command, "```", "",
             f"Config hash `{cfg.hash()}`; model `{cfg.experiment.model}`; {len(cfg.jobs)} jobs; "
             f"{cfg.experiment.steps} steps of which {cfg.experiment.warmup_steps} warm-up (not measured), in every arm.",
             "", "Steps per device-hour (ratio to the same seed's dedicated baseline):", ""]
    lines += _arm_table(rows, arms, seeds, "steps_per_hour", "ratio")
    if steady_from and any(r.get("steady_steps_per_hour") is not None for r in rows):
        lines += ["", f"The same runs measured from step {steady_from} of each job on (each job's first "
                  f"{steady_from - 1} steps out, where a job's first steps at new shapes can stall; measured again "
                  "from the same runs' step times):", ""]
        lines += _arm_table(rows, arms, seeds, "steady_steps_per_hour", "steady_ratio")
    extra = [r for r in rows if r["label"] != "main"]
    if extra:
        steady = steady_from and any(r.get("steady_steps_per_hour") is not None for r in extra)
        lines += ["", "Job-count scaling and tuning (ratio: to the seed's dedicated run of the base workload; "
                  "x main: to the same arm's main run of the seed, the baseline of a tuning run"
                  + (f"; from step {steady_from}: as above" if steady else "") + "):", "",
                  "| run | arm | jobs | seed | steps/h | ratio | x main |"
                  + (f" from step {steady_from} | x main |" if steady else "") + " busy | GPU util |",
                  "|---|---|---|---|---|---|---|" + ("---|---|" if steady else "") + "---|---|"]
        for r in extra:
            s = r["summary"] or {}
            main = next((m for m in rows if m["label"] == "main" and m["arm"] == r["arm"] and m["seed"] == r["seed"]),
                        {})
            cells = [_fmt(r["steps_per_hour"], 0) + _failed(r), _fmt(r["ratio"], 3),
                     _fmt(_over(r.get("steps_per_hour"), main.get("steps_per_hour")), 3)]
            if steady:
                cells += [_fmt(r.get("steady_steps_per_hour"), 0),
                          _fmt(_over(r.get("steady_steps_per_hour"), main.get("steady_steps_per_hour")), 3)]
            lines.append(f"| {r['label']} | {r['arm']} | {r['jobs']} | {r['seed']} | " + " | ".join(cells)
                         + f" | {_fmt(s.get('busy_fraction'))} | {_fmt(s.get('gpu_util'))} |")
    lines += _timeslice_table(rows)
    lines += ["", "Per run: phase times and engine start (reported apart from throughput; trainer peak: its process's "
              "caching allocator, allocated / reserved, GiB):", "",
              "| arm | seed | label | engine start s | engine and trainer | measured steps | steps a job | measured s "
              "| busy | GPU util | trainer peak GiB | MPS |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"] or {}
        lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | {_fmt(s.get('engine_start_s'), 0)}"
                     f"{' (reused)' if s.get('engine_reused') else ''} | "
                     f"{'client in its own process' if s.get('engine_process') else 'client in-process'}"
                     f"{', packed rows' if s.get('packed_rows') else ''} | "
                     f"{s.get('steps_measured', '-')} | {_per_job(r.get('steps_per_job') or {})} | "
                     f"{_fmt(s.get('seconds_measured'), 1)} | {_fmt(s.get('busy_fraction'))} | "
                     f"{_fmt(s.get('gpu_util'))} | {_peak(s.get('trainer_peak_gib'))} | {s.get('mps', '-')} |")
    timed = [r for r in rows if r.get("phases")]
    if timed:
        lines += ["", "Phase durations in the measured window, seconds: median / largest (handoff: from the trainer "
                  "handing a group over to the engine thread taking it up; generate includes loading the group's "
                  "adapters, which reload also shows):", "",
                  "| arm | seed | label | " + " | ".join(PHASES) + " |", "|---|---|---|" + "---|" * len(PHASES)]
        for r in timed:
            ph = r["phases"]
            cells = [f"{ph[k]['median']:.2f} / {ph[k]['max']:.2f}" if k in ph else "-" for k in PHASES]
            lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | " + " | ".join(cells) + " |")
        synced = [r for r in timed if r["phases"].get("adapter_sync")]
        if synced:
            lines += ["", "Adapter sync per adapter version, from the trainer's weights to the engine serving them "
                      "(its export plus its load, `adapter_sync` in the run's summary), milliseconds:", "",
                      "| arm | seed | label | adapters by | versions | median | largest |", "|---|---|---|---|---|---|---|"]
            for r in synced:
                a = r["phases"]["adapter_sync"]
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | {(r['summary'] or {}).get('adapter_sync', '-')} "
                             f"| {a['n']} | {1e3 * a['median']:.1f} | {1e3 * a['max']:.1f} |")
        chained = [r for r in timed if r["phases"].get("chain")]
        if chained:
            lines += ["", "Each group's chain (means, seconds): the cycle between a group's successive training steps, "
                      "beside the phases it runs in series; a cycle near their sum says the chain bounds the "
                      "throughput. Engine idle: the share of the measured window in which no group generated "
                      "(each was training or waiting for the trainer); trainer busy: the share in which it trained:",
                      "",
                      "| arm | seed | label | groups | cycle | generate | wait for the trainer | train | export "
                      "| their sum | engine idle | trainer busy |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in chained:
                c = r["phases"]["chain"]
                wait = c.get("wait", 0.0)  # reports rebuilt from older summaries have none
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | {c['groups']} | {c['cycle']:.2f} | "
                             f"{c['generate']:.2f} | {wait:.2f} | {c['train']:.2f} | {c['export']:.2f} | "
                             f"{c['generate'] + wait + c['train'] + c['export']:.2f} | {_share(c.get('engine_idle'))} | "
                             f"{_share(c.get('trainer_busy'))} |")
        rated = [r for r in timed if r["phases"].get("engine")]
        if rated:
            lines += ["", "The engine's decoding while a group trains and while none does (engine steps per second "
                      "of stepping, medians over half-second buckets with requests in flight; requests in flight "
                      "per engine step, mean; waiting: the median share of a step the engine's client spent waiting "
                      "for the engine core's output, high where the GPU bounds the decoding, low where the client's "
                      "Python in the trainer's process does):", "",
                      "| arm | seed | label | steps/s, training | steps/s, not training | in flight, training "
                      "| in flight, not training | waiting, training | waiting, not training |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in rated:
                e = r["phases"]["engine"]
                cells = [f"{e[k]['steps_per_s']:.0f} (n={e[k]['n']})" if k in e else "-" for k in ("training", "not_training")]
                cells += [f"{e[k]['inflight']:.0f}" if k in e else "-" for k in ("training", "not_training")]
                cells += [f"{e[k]['waiting']:.2f}" if "waiting" in e.get(k, {}) else "-" for k in ("training", "not_training")]
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | " + " | ".join(cells) + " |")
            lines += ["", "The engine's step time against the requests in flight (least squares over the same buckets: "
                      "ms per step = fixed + per request x in flight; a per-request cost the decode's memory traffic "
                      "cannot explain points at the engine's host work):", "",
                      "| arm | seed | label | training: fixed ms | training: per request us | not training: fixed ms "
                      "| not training: per request us |", "|---|---|---|---|---|---|---|"]
            for r in rated:
                e = r["phases"]["engine"]
                cells = [f"{e[k][f]:{fmt}}" if f in e.get(k, {}) else "-" for k in ("training", "not_training")
                         for f, fmt in (("fixed_ms", ".2f"), ("per_request_us", ".1f"))]
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | " + " | ".join(cells) + " |")
        for r in timed:
            if r["phases"].get("train_outliers"):
                slow = r["phases"]["train_outliers"]
                why = [describe(c) for c in r["phases"].get("train_outlier_compiles", [{}] * len(slow))]
                lines.append(f"\nWarning: {r['arm']} seed {r['seed']} ({r['label']}): training steps of "
                             + ", ".join(f"{d:.2f} s" + (f" ({w})" if w else "") for d, w in zip(slow, why))
                             + f" in the measured window against a median of {r['phases']['train']['median']:.2f} s "
                             "(a compile or a stall); its steps per hour include them.")
    return "\n".join(lines) + "\n"


def _arm_table(rows: list[dict], arms: list[str], seeds: list[int], key: str, ratio: str) -> list[str]:
    """One row per arm of the main runs: `key` per seed with its `ratio` beside, and the mean ratio."""
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ratio |", "|---|" + "---|" * (len(seeds) + 1)]
    for a in arms:
        cells, ratios = [], []
        for s in seeds:
            r = next((r for r in rows if r["arm"] == a and r["seed"] == s and r["label"] == "main"), None)
            if r is None or r.get(key) is None:
                cells.append("-" if r is None else "-" + _failed(r))  # a run that failed whole still says so
                continue
            cells.append((f"{r[key]:.0f} ({r[ratio]:.3f}x)" if r.get(ratio) else f"{r[key]:.0f}") + _failed(r))
            if r.get(ratio):
                ratios.append(r[ratio])
        mean = f"{sum(ratios) / len(ratios):.3f}x" if ratios else "-"
        lines.append(f"| {a} | " + " | ".join(cells) + f" | {mean} |")
    return lines


def _failed(row: dict) -> str:
    """" (N of M jobs failed)" after a run's figure where some of its jobs failed, else ""."""
    note = failed_note(row["summary"] or {})
    return f" ({note})" if note else ""


def _per_job(counts: dict[str, int]) -> str:
    """A window's steps a job: one number where every job has it, else the range."""
    if not counts:
        return "-"
    lo, hi = min(counts.values()), max(counts.values())
    return str(lo) if lo == hi else f"{lo}-{hi}"


# the seeds' own figures (seed 001, the llm-d time-slicing study): the report puts colora's beside them
SEED_SWITCH_S = "0.5-1.6"
SEED_QUEUE_WAIT_S = "1-15"


def _q(d: dict | None) -> str:
    """A quantiles dict (colora/timeslice/record.py) as 'median / p90 (n)'."""
    if not d or not d.get("n"):
        return "-"
    return f"{d['median']:.2f} / {d['p90']:.2f} (n={d['n']})"


def _timeslice_table(rows: list[dict]) -> list[str]:
    """The time-slicing runs' broker figures (summary["timeslice"]), beside the seeds' medians."""
    ts = [r for r in rows if (r["summary"] or {}).get("timeslice")]
    if not ts:
        return []
    lines = ["", "The time-slicing runs (colora/timeslice/): each switch (the park before a grant plus the "
             f"restore, seconds), each queue wait (request to grant), median / p90 (count); the seeds report "
             f"switches of {SEED_SWITCH_S} s and queue waits of {SEED_QUEUE_WAIT_S} s (medians, seed 001). Duty: the "
             "share of the window some tenant held the grant. Makespan: first span to last of all tenants; "
             "s/step: each tenant's measured seconds per step; failed: the tenants that died or ended without their "
             "summary (their jobs' steps are not in the run's figure):", "",
             "| label | park | parking | tenants | switch s | park s | restore s | queue wait s | duty | makespan s "
             "| s/step per tenant | pinned host GiB | failed |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ts:
        t = r["summary"]["timeslice"]
        b = t.get("broker") or {}
        tenants = t.get("tenants", [])
        per = ", ".join(_fmt(x.get("seconds_per_step")) for x in tenants)
        pinned = sum(x.get("pinned_host_bytes") or 0 for x in tenants) / 2**30
        # the broker's (a grant freed by a death) and every tenant that ended without its summary
        failed = list(dict.fromkeys([*(b.get("failed") or []),
                                     *(f"tenant-{x['tenant']}" for x in tenants if not x.get("complete", True))]))
        lines.append(f"| {r['label']} | {t['policy']} | {t['parking']} | {len(tenants)} | {_q(b.get('switch_s'))} | "
                     f"{_q(b.get('park_s'))} | {_q(b.get('restore_s'))} | {_q(b.get('queue_wait_s'))} | "
                     f"{_share(b.get('duty'))} | {_fmt(t.get('makespan_s'), 0)} | {per} | {pinned:.2f} | "
                     f"{', '.join(failed) or '-'} |")
    return lines


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _fmt(v, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _peak(p: dict | None) -> str:
    """A trainer's allocator peaks as `allocated / reserved` GiB; "-" off a GPU or from a run before they were kept."""
    return "-" if not p else f"{p['allocated']:.1f} / {p['reserved']:.1f}"
