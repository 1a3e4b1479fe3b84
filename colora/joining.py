"""When a job that joins a run later (`start_after`) can join.

A job with `start_after = K` joins the running co-runner once some job of the run has done K steps
(colora/corun/corunner.py). The jobs that start at once run their steps (their own `steps`, else
experiment.steps), and a job that has joined runs its own from 0: so a job can join only where K is
below the most steps of the jobs that start at once and of those that join before it. The time-slicing
arm's tenants each run their own jobs (colora/tenancy.py `tenant_units`: the LoRA jobs
`timeslice.tenant_jobs` at a time, every full-parameter job alone), so each counts alone; in the
dedicated arm every job runs alone in its turn and start_after means nothing.
"""

from __future__ import annotations

from colora.tenancy import tenant_units


def join_bounds(cfg) -> dict[int, tuple[int, str]]:
    """{index of a job with start_after: (the most steps the jobs able to join before it reach, the rule as
    a config error states it)} of a Config; a job joins iff its start_after is below its bound."""
    e, out = cfg.experiment, {}
    if e.arm == "dedicated":
        return out
    units = tenant_units(cfg) if e.arm == "timeslice" else [[j.name for j in cfg.jobs]]
    where = " in its tenant (timeslice.tenant_jobs)" if e.arm == "timeslice" else ""
    index = {j.name: i for i, j in enumerate(cfg.jobs)}
    for names in units:
        unit = [(index[n], cfg.jobs[index[n]]) for n in names]
        reach = max((j.steps or e.steps for _, j in unit if not j.start_after), default=0)
        for i, j in sorted(((i, j) for i, j in unit if j.start_after), key=lambda x: x[1].start_after):
            out[i] = (reach, f"must be below {reach}, the most steps of the jobs that start at once{where} and of "
                             "those that join before it")
            if j.start_after < reach:  # it joins, and its own steps count from then on
                reach = max(reach, j.steps or e.steps)
    return out
