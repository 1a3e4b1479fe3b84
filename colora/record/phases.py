"""What a run's timeline says about its phases: how long each took inside the measured window, how a
group's cycle chains them, how fast the engine decoded while a group trained and while none did.

Pure functions over the spans of timeline.jsonl (colora/record/runlog.py) and a summary's window; the arms
benchmark's report tables are made from them.
"""

from __future__ import annotations

import statistics

PHASES = ("generate", "handoff", "train", "export", "reload")


def phase_stats(spans: list[dict], window: dict) -> dict:
    """Median and largest duration of each phase whose span starts inside the measured window(s).
    `handoff`: from the trainer handing a group to the engine thread to that thread taking it up;
    `adapter_sync`: per adapter version, its export plus its load (`adapter_sync_times`)."""
    ws = window.get("windows") or [window]
    inside = [s for s in spans if any(w["start"] <= s["start"] < w["end"] for w in ws if w.get("seconds"))]
    out: dict = {}
    for ph in PHASES:
        if ph == "handoff":
            d = [s["start"] - s["queued"] for s in inside if s["phase"] == "generate" and "queued" in s]
        else:
            d = [s["end"] - s["start"] for s in inside if s["phase"] == ph]
        if d:
            out[ph] = {"n": len(d), "median": statistics.median(d), "max": max(d)}
    sync = adapter_sync_times(inside)
    if sync:
        out["adapter_sync"] = {"n": len(sync), "median": statistics.median(sync), "max": max(sync)}
    rate = engine_rate(inside)
    if rate:
        out["engine"] = rate
    chain = group_chain(inside)
    if chain:
        out["chain"] = chain
    if "train" in out:
        # a training step far beyond the others (a compile, a stall): it counts in the throughput
        med = out["train"]["median"]
        slow = [s for s in inside if s["phase"] == "train" and s["end"] - s["start"] > max(3 * med, med + 1.0)]
        out["train_outliers"] = [round(s["end"] - s["start"], 3) for s in slow]
        if any(s.get("compiles") for s in slow):  # what compiled in each (timelines since compilewatch)
            out["train_outlier_compiles"] = [s.get("compiles", {}) for s in slow]
    return out


def adapter_sync_times(spans: list[dict]) -> list[float]:
    """Seconds from the trainer's weights to the engine serving them, per adapter version: its export
    plus its load, from the `adapter_seconds` ({"<job>@v<version>": seconds}) of the export and
    reload spans; a version with only one of the two among `spans` is left out."""
    parts: dict[str, dict[str, float]] = {}
    for s in spans:
        if s["phase"] in ("export", "reload"):
            for name, secs in (s.get("adapter_seconds") or {}).items():
                parts.setdefault(name, {})[s["phase"]] = secs
    return [p["export"] + p["reload"] for p in parts.values() if len(p) == 2]


def _trained_groups(span: dict) -> list[int]:
    """The groups a train span trained: one step may train several ready groups at once, and its
    span then has group -1 and lists them."""
    return span.get("groups") or ([span["group"]] if span.get("group", -1) >= 0 else [])


def group_chain(spans: list[dict]) -> dict:
    """A group's cycle, the mean time between its successive training steps, beside the means of the
    phases it chains in series (generate, then train, then export of the new adapters; the group's
    next generation waits for that export) and of its wait between generating and training (while the
    trainer trains another group). Where the cycle is about their sum, the chain is what
    bounds the throughput and the phase that grew against the dedicated arm is the one to cut. Over
    the groups that trained at least twice in `spans`; {} for fewer than two groups (one group has no
    offset phases to compare)."""
    trains = sorted((s for s in spans if s["phase"] == "train"), key=lambda s: s["end"])
    ends: dict[int, list[float]] = {}
    for s in trains:
        for g in _trained_groups(s):
            ends.setdefault(g, []).append(s["end"])
    cycles = [b - a for e in ends.values() for a, b in zip(e, e[1:])]
    if len(ends) < 2 or not cycles:
        return {}
    out = {"groups": len(ends), "cycle": statistics.fmean(cycles)}
    for ph in ("generate", "train", "export"):
        d = [s["end"] - s["start"] for s in spans if s["phase"] == ph]
        out[ph] = statistics.fmean(d) if d else 0.0
    # wait: from a group's generation ending to its training starting (the trainer busy with another
    # group's step); one value per group a training step trains
    gen_ends: dict[int, list[float]] = {}
    for s in spans:
        if s["phase"] == "generate" and s.get("group", -1) >= 0:
            gen_ends.setdefault(s["group"], []).append(s["end"])
    waits = []
    for s in trains:
        for g in _trained_groups(s):
            before = [e for e in gen_ends.get(g, []) if e <= s["start"] + 1e-9]
            if before:
                waits.append(s["start"] - max(before))
    out["wait"] = statistics.fmean(waits) if waits else 0.0
    # how the two sides were kept busy over the spans' extent: the share of it in which no group
    # generated (the engine had no work: every group was training or waiting for the trainer) and
    # the share in which the trainer trained
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    if t1 > t0:
        gen = _covered([(s["start"], s["end"]) for s in spans if s["phase"] == "generate"], t0, t1)
        out["engine_idle"] = 1.0 - gen / (t1 - t0)
        out["trainer_busy"] = _covered([(s["start"], s["end"]) for s in trains], t0, t1) / (t1 - t0)
    return out


def _covered(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] inside at least one of the intervals."""
    total, end = 0.0, t0
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, t1)
        if b > a:
            total += b - a
            end = b
    return total


def engine_rate(spans: list[dict]) -> dict:
    """The engine's steps per second of stepping while some group trains and while none does:
    medians over the timeline's half-second `engine_steps` buckets that had requests in flight (a
    bucket counts as training when a train span covers half of it or more), with the mean requests in
    flight per step. Per second of the bucket's busy time, not of its length: a bucket in which a
    group's generation ended is mostly idle, and per second of its length would read as slow
    decoding (the H200's dedicated arm read 76 against 257 steps/s so, with nothing else on the GPU).
    Under MPS the trainer's kernels share the GPU with the engine's; this says what that costs the
    decoding. With `waiting` (timelines that record each step's wait for the engine core): the
    median share of step time spent waiting for the core, high where the GPU bounds the decoding,
    low where the client's Python in this process does (see steprate.StepRate). {} when the timeline
    has no engine steps."""
    trains = [(s["start"], s["end"]) for s in spans if s["phase"] == "train"]
    split: dict[str, list[tuple[float, float, float | None, int]]] = {"training": [], "not_training": []}
    for b in spans:
        if b["phase"] != "engine_steps" or not b["steps"]:
            continue
        length = b["end"] - b["start"]
        covered = sum(max(0.0, min(e, b["end"]) - max(s, b["start"])) for s, e in trains)
        key = "training" if covered >= length / 2 else "not_training"
        busy = b.get("busy") or length
        wait = b["wait"] / busy if "wait" in b and busy > 0 else None
        split[key].append((b["steps"] / busy, b["inflight"] / b["steps"], wait, b["steps"]))
    out = {}
    for k, v in split.items():
        if not v:
            continue
        out[k] = {"n": len(v), "steps_per_s": statistics.median(x for x, _, _, _ in v),
                  "inflight": statistics.fmean(y for _, y, _, _ in v)}
        # ms per step = fixed + per request x requests in flight, least squares over the buckets of
        # three steps or more (a bucket of one or two steps is mostly a step that straddles it or
        # loads an adapter: in the H200's runs they moved the fixed part from 5.9 to 13.5 ms)
        fit = [(y, 1e3 / x) for x, y, _, n in v if n >= 3]
        if len(fit) >= 3 and len({round(y, 6) for y, _ in fit}) >= 2:
            slope, icept = statistics.linear_regression(*zip(*fit))
            out[k]["fixed_ms"], out[k]["per_request_us"] = icept, 1e3 * slope
        waits = [w for _, _, w, _ in v if w is not None]
        if waits:
            out[k]["waiting"] = statistics.median(waits)
    return out
