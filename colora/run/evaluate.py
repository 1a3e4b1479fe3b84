"""Held-out evaluation: greedy answers to each job's eval split, scored by the job's task."""

from __future__ import annotations

from colora.engine.rollout import GenRequest
from colora.seeding import derive_seed


def evaluate(corunner, names: list[str], n: int, run_seed: int, max_new_tokens: int = 0) -> dict:
    """{job: {"accuracy": mean correctness, "n": n, "items": [[item id, reward], ...]}}.

    The eval items of a job depend only on the run seed and the job's name, so every arm and every
    repeat of a seed is scored on the same items (paired comparisons). All jobs' requests go to the
    engine in one call, each with the job's current adapter. A reward function that raises scores
    that item 0 and is recorded; evaluation never stops a run.
    """
    if n <= 0:
        return {}
    reqs, items = [], {}
    for name in names:
        js = corunner.jobs[name]
        its = js.task.sample(n, derive_seed(run_seed, name, "eval"), "eval")
        items[name] = its
        budget = max_new_tokens or js.cfg.max_new_tokens
        for i, it in enumerate(its):
            reqs.append(GenRequest(name, tuple(corunner.prompts.ids(it.messages)), budget, 0.0, tag=i))
    results = corunner.engine.generate(reqs)
    out: dict[str, dict] = {name: {"n": n, "items": [], "errors": 0} for name in names}
    for r in results:
        name, i = r.request.job, r.request.tag
        it = items[name][i]
        try:
            score = float(corunner.jobs[name].task.reward(r.text, it))
        except Exception:
            score = 0.0
            out[name]["errors"] += 1
        out[name]["items"].append([it.id, score])
    for name in names:
        scores = [s for _, s in out[name]["items"]]
        out[name]["accuracy"] = sum(scores) / len(scores)
        out[name]["version"] = corunner.engine.version(name)
    return out
