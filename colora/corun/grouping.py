"""How the co-runner splits jobs into phase-offset groups, and when it moves them.

Groups start balanced by the tokens of each job's first requests (`request_tokens`: exact where the
workload sets response lengths, max_new_tokens where responses end at EOS). Once every job has
finished its warm-up steps the split is weighed again on the tokens the jobs actually used and,
where that lowers the largest group's load by REGROUP_GAIN or more, jobs move (`plan_regroup`; the
co-runner moves each right after its own step, so it stays on-policy).
"""

from __future__ import annotations

from colora.engine.rollout import GenRequest

REGROUP_GAIN = 0.10  # move jobs only if the largest group's measured load falls by this share or more


def split_groups(jobs: list[str], n_groups: int, cost: dict[str, float] | None = None) -> list[list[str]]:
    """Balanced groups: longest-processing-time-first over each job's phase cost (`CoRunner.run`
    gives the tokens of its next step's requests, `request_tokens`; default: all equal), ties by name."""
    n = max(1, min(n_groups, len(jobs)))
    cost = cost or {j: 1.0 for j in jobs}
    groups: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for j in sorted(jobs, key=lambda j: (-cost[j], j)):
        i = min(range(n), key=lambda i: (load[i], i))
        groups[i].append(j)
        load[i] += cost[j]
    return [g for g in groups if g]


def plan_regroup(groups: list[list[str]], cost: dict[str, float], min_gain: float = REGROUP_GAIN) -> dict[str, int] | None:
    """Where each job of `groups` should go ({job: group index}) for the split `split_groups` makes
    from `cost`, with the new groups matched to the current indices so that fewest jobs move; None
    when the largest group's load would not fall by `min_gain` (a share) or more."""
    jobs = [j for g in groups for j in g]
    new = split_groups(jobs, len(groups), cost)
    if len(new) != len(groups):
        return None
    load = lambda gs: max(sum(cost[j] for j in g) for g in gs)  # noqa: E731
    if load(new) > load(groups) * (1.0 - min_gain):
        return None
    # match new groups to current indices, most jobs staying first (greedy over the overlap counts)
    pairs = sorted(((len(set(n) & set(g)), i, k) for i, g in enumerate(groups) for k, n in enumerate(new)),
                   key=lambda t: (-t[0], t[1], t[2]))
    slot: dict[int, int] = {}
    used: set[int] = set()
    for _, i, k in pairs:
        if k not in slot and i not in used:
            slot[k] = i
            used.add(i)
    return {j: slot[k] for k, n in enumerate(new) for j in n}


def request_tokens(reqs: list[GenRequest]) -> float:
    """The tokens of one step's requests, prompts included: what both phases scale with (the
    engine prefills and decodes them, the trainer runs every one forward and back). Exact for
    workloads that set response lengths (each request's length is drawn when it is made); with
    natural EOS the responses count at max_new_tokens, an upper bound."""
    return float(sum(len(r.prompt_ids) + r.max_tokens for r in reqs))
