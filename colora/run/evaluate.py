"""Held-out evaluation: greedy answers to each grpo job's eval split, scored by the job's task; each
sft job's mean loss on its held-out conversations."""

from __future__ import annotations

from colora.corun.rollouts import call_task, check_reward
from colora.engine.rollout import GenRequest
from colora.seeding import derive_seed
from colora.training.losses import LossSpec
from colora.training.sft_data import datums as sft_datums
from colora.training.trainer import ForwardBackwardCall, JobFailure


def evaluate(corunner, names: list[str], n: int, run_seed: int, max_new_tokens: int = 0) -> dict:
    """{job: {"accuracy": mean correctness, "n": n, "items": [[item id, reward], ...]}}, or for a job
    whose task failed here {job: {"accuracy": None, "n": n, "items": [], "error": why}}.

    The eval items of a job depend only on the run seed and the job's name, so every arm and every
    repeat of a seed is scored on the same items (paired comparisons). All jobs' requests go to the
    engine in one call, each with the job's current adapter. The job's task code runs as in training
    (colora/corun/rollouts.py): under runtime.task_timeout_s per call, its rewards held to the contract
    (finite, in [0, 1]); a job whose sampling, prompts or rewards fail gets its error instead of an
    accuracy, and the other jobs are scored as ever.
    """
    if n <= 0:
        return {}
    sft = [name for name in names if corunner.jobs[name].cfg.kind == "sft"]
    out_sft = sft_loss(corunner, sft)
    names = [name for name in names if name not in out_sft]
    limit = corunner.schedule.task_timeout_s
    max_len = getattr(corunner.engine, "max_model_len", 0)
    reqs, items = [], {}
    out: dict[str, dict] = {name: {"n": n, "items": []} for name in names}
    for name in names:
        js = corunner.jobs[name]
        budget = max_new_tokens or js.cfg.max_new_tokens
        try:
            def prompts(js=js):
                its = js.task.sample(n, derive_seed(run_seed, js.name, "eval"), "eval")
                return its, [tuple(corunner.prompts.ids(it.messages)) for it in its]

            its, ids = call_task(name, "sample of its eval items (or their chat template)", prompts, limit_s=limit)
            for it, p in zip(its, ids):
                if not p or (max_len and len(p) + budget > max_len):
                    raise JobFailure(name, f"the prompt of eval item {it.id} is {len(p)} tokens: empty, or with "
                                           f"{budget} new tokens over engine.max_model_len ({max_len})")
        except JobFailure as f:
            out[name].update(accuracy=None, error=f.reason)
            continue
        items[name] = its
        reqs += [GenRequest(name, p, budget, 0.0, tag=i) for i, p in enumerate(ids)]
    results = corunner.engine.generate(reqs)
    by_job: dict[str, list] = {name: [] for name in items}
    for r in results:
        by_job[r.request.job].append(r)
    for name, rs in by_job.items():
        task, its = corunner.jobs[name].task, items[name]
        try:
            scored = call_task(name, "reward on its eval items",
                               lambda rs=rs, task=task, its=its, name=name: [
                                   [its[r.request.tag].id, check_reward(name, task.reward(r.text, its[r.request.tag]),
                                                                        its[r.request.tag].id)] for r in rs],
                               limit_s=limit)
        except JobFailure as f:
            out[name].update(accuracy=None, error=f.reason)
            continue
        out[name]["items"] = scored
        out[name]["accuracy"] = sum(s for _, s in scored) / len(scored)
        out[name]["version"] = corunner.engine.version(name)
    return {**out, **out_sft}


def sft_loss(corunner, names: list[str]) -> dict:
    """{job: {"loss": the mean NLL per assistant token of its held-out conversations, "n": how many}}
    for sft jobs, from the trainer (forward only: no gradient), all jobs in one pass."""
    if not names:
        return {}
    calls = [ForwardBackwardCall(name, sft_datums(corunner.jobs[name].task.eval), LossSpec("cross_entropy"),
                                 forward_only=True) for name in names]
    out = {}
    for name, res in zip(names, corunner.trainer_side.trainer.forward_backward(calls)):
        n = len(corunner.jobs[name].task.eval)
        out[name] = ({"n": n, "loss": None, "accuracy": None, "error": res.error} if res.error else
                     {"n": n, "loss": res.metrics["loss:sum"], "accuracy": None})
    return out
