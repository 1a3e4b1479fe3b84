"""The summary of a broker's record, on a hand-made log whose figures are computed by hand."""

from __future__ import annotations

import json

from pytest import approx

from colora.timeslice import read_log, summarize
from colora.timeslice.record import quantiles


def _grant(tenant, requested, granted, released, parked=(), park_s=0.0, restore_s=0.0, failed=False):
    return {"kind": "grant", "tenant": tenant, "phase": "train", "requested": requested, "granted": granted,
            "released": released, "waited_s": granted - requested, "parked": list(parked), "park_s": park_s,
            "restore_s": restore_s, "restored": restore_s > 0, "failed": failed}


def _switch(kind, tenant, wall_s, ok=True):
    return {"kind": kind, "tenant": tenant, "start": 0.0, "end": wall_s, "wall_s": wall_s, "seconds": wall_s,
            "bytes": 1, "waiting": 1, "ok": ok}


LOG = [
    {"kind": "start", "policy": "lazy", "origin": 100.0, "pid": 1, "at": 0.0},
    _grant("a", 0.0, 0.0, 2.0),                                      # waits 0, holds 2, no switch
    _switch("park", "a", 0.5),
    _grant("b", 1.0, 3.0, 4.0, parked=["a"], park_s=0.5),            # waits 2, holds 1, switch 0.5
    _switch("park", "b", 0.25), _switch("restore", "a", 0.75),
    _grant("a", 2.5, 5.0, 6.0, parked=["b"], park_s=0.25, restore_s=0.75),  # waits 2.5, holds 1, switch 1.0
    _switch("park", "a", 0.5), _switch("park", "b", 9.0, ok=False),
    _grant("c", 3.0, 6.5, 8.0, parked=["a"], park_s=0.5, failed=True),  # waits 3.5, holds 1.5, switch 0.5
    {"kind": "failed", "tenant": "c", "at": 8.0, "reason": "connection closed without BYE"},
    {"kind": "stop", "at": 9.0, "failed": ["c"]},
]


def test_summary_of_a_hand_made_log(tmp_path):
    path = tmp_path / "timeslice.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in LOG) + '{"kind": "gra')  # a torn last line
    s = summarize(read_log(path))
    assert s["policy"] == "lazy" and s["grants"] == 4
    assert s["grants_per_tenant"] == {"a": 2, "b": 1, "c": 1}
    # queue waits 0, 2, 2.5, 3.5: median 2.25; p90 at rank 2.7 = 2.5 + 0.7 * 1.0
    assert s["queue_wait_s"] == {"n": 4, "median": approx(2.25), "p90": approx(3.2)}
    assert s["queue_wait_s_per_tenant"]["a"] == {"n": 2, "median": approx(1.25), "p90": approx(2.25)}
    # switches 0.5, 1.0, 0.5: median 0.5; p90 at rank 1.8 = 0.5 + 0.8 * 0.5
    assert s["switch_s"] == {"n": 3, "median": approx(0.5), "p90": approx(0.9)}
    # the failed park is no park
    assert s["park_s"] == {"n": 3, "median": approx(0.5), "p90": approx(0.5)}
    assert s["restore_s"] == {"n": 1, "median": approx(0.75), "p90": approx(0.75)}
    assert s["parks_per_tenant"] == {"a": 2, "b": 1}
    # held 2 + 1 + 1 + 1.5 over the window from the first request (0) to the last release (8)
    assert s["held_s"] == approx(5.5) and s["window_s"] == approx(8.0) and s["duty"] == approx(5.5 / 8)
    assert s["failed"] == ["c"]


def test_summary_of_an_empty_log():
    s = summarize([])
    assert s["grants"] == 0 and s["duty"] is None and s["switch_s"] == quantiles([]) == {
        "n": 0, "median": None, "p90": None}
