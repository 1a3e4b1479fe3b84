"""The broker's record, `timeslice.jsonl`, and its summary.

Rows, by `kind` (times in seconds on the shared clock, zero at the broker's origin):

| kind | fields |
| --- | --- |
| start | policy, origin, pid, at |
| register | tenant, pids, resident_bytes, peak_bytes, at |
| peak | tenant, peak_bytes (policy memory: the peak it measured), at |
| grant | tenant, phase, requested, granted, released, waited_s, parked (tenants), park_s, restore_s, restored, failed; stopped if the broker stopped while it was held; resident_peak_bytes (policy memory: the resident tenants' peaks at the grant) |
| park, restore | tenant, start, end, wall_s (the broker's, command to DONE), seconds and bytes (the tenant's DONE), waiting (queue length), ok |
| failed | tenant, at, reason |
| leave | tenant, at |
| stop | at, failed |

A grant's `park_s` and `restore_s` are the switch before it; the switch's cost is their sum.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from colora.record.runlog import read_jsonl


def read_log(path: str | os.PathLike) -> list[dict]:
    """The rows of a `timeslice.jsonl` (a torn last line is skipped)."""
    return read_jsonl(path)


def quantiles(xs: list[float]) -> dict:
    """n, median and p90 (linear interpolation between order statistics); None for an empty list."""
    if not xs:
        return {"n": 0, "median": None, "p90": None}
    a = np.asarray(xs, dtype=float)
    return {"n": len(xs), "median": float(np.median(a)), "p90": float(np.percentile(a, 90))}


def summarize(rows: list[dict]) -> dict:
    """The figures of one run's record.

    - switch_s: park_s + restore_s of each grant that had a switch (a park or its grantee restored);
    - queue_wait_s: granted - requested of each grant, also per tenant;
    - park_s, restore_s: the broker's wall seconds of each park and restore that succeeded;
    - duty: the time some grant was held over the window, first request to last release; an upper
      bound on the GPU's duty cycle (a holder need not keep the GPU busy), NVML's util being the other;
      held_s sums every grant's seconds, above the window where grants overlap (policy memory);
    - failed: the tenants marked failed.
    """
    grants = [r for r in rows if r.get("kind") == "grant"]
    switches = [r["park_s"] + r["restore_s"] for r in grants if r["parked"] or r["restored"]]
    tenants = sorted({r["tenant"] for r in grants})
    ok = [r for r in rows if r.get("kind") in ("park", "restore") and r.get("ok")]
    held = sum(r["released"] - r["granted"] for r in grants)
    window = (max(r["released"] for r in grants) - min(r["requested"] for r in grants)) if grants else 0.0
    start = next((r for r in rows if r.get("kind") == "start"), {})
    return {
        "policy": start.get("policy"),
        "grants": len(grants),
        "grants_per_tenant": dict(sorted(Counter(r["tenant"] for r in grants).items())),
        "switch_s": quantiles(switches),
        "queue_wait_s": quantiles([r["granted"] - r["requested"] for r in grants]),
        "queue_wait_s_per_tenant": {t: quantiles([r["granted"] - r["requested"] for r in grants if r["tenant"] == t])
                                    for t in tenants},
        "park_s": quantiles([r["wall_s"] for r in ok if r["kind"] == "park"]),
        "restore_s": quantiles([r["wall_s"] for r in ok if r["kind"] == "restore"]),
        "parks_per_tenant": dict(sorted(Counter(r["tenant"] for r in ok if r["kind"] == "park").items())),
        "held_s": held,
        "window_s": window,
        "duty": _covered([(r["granted"], r["released"]) for r in grants]) / window if window > 0 else None,
        "failed": sorted({r["tenant"] for r in rows if r.get("kind") == "failed"}),
    }


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the spans (their union's length)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
