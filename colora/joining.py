"""When a job that joins a run later (`start_after`) can join.

A job with `start_after = K` joins the running co-runner once some job of the run has done K steps
(colora/corun/corunner.py). The jobs that start at once run their steps (their own `steps`, else
experiment.steps), and a job that has joined runs its own from 0: so a job can join only where K is
below the most steps of the jobs that start at once and of those that join before it. Where the
jobs run in parts of their own (the time-slicing arm's tenants), each part counts alone.
"""

from __future__ import annotations


def join_bounds(jobs, steps: int, part: int) -> dict[int, int]:
    """{index of a job with start_after: the most steps that the jobs able to join before it reach},
    over `jobs` (JobConfigs) cut into parts of `part` jobs in order; `steps`: experiment.steps, each
    job's where its own is 0. A job joins iff its start_after is below its bound."""
    out = {}
    for first in range(0, len(jobs), part):
        unit = list(enumerate(jobs))[first:first + part]
        reach = max((j.steps or steps for _, j in unit if not j.start_after), default=0)
        for i, j in sorted(((i, j) for i, j in unit if j.start_after), key=lambda x: x[1].start_after):
            out[i] = reach
            if j.start_after < reach:  # it joins, and its own steps count from then on
                reach = max(reach, j.steps or steps)
    return out
