"""One job's step on the job's side: its prompts, the engine requests they make, and the scoring of the
engine's answers into rollouts for the trainer.

Everything here is a function of the run seed, the job's name and the step (`derive_seed`), so two
arms of one seed sample the same prompts with the same per-request seeds.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import numpy as np
import torch

from colora.config import JobConfig
from colora.engine.rollout import GenRequest, GenResult
from colora.seeding import derive_seed
from colora.training import grpo
from colora.training.trainer import JobFailure, Rollout


class Prompts:
    """A job's chat messages as the engine's prompt token ids: the chat template rendered to text
    and tokenized without special tokens, each distinct prompt once."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[tuple, list[int]] = {}

    def ids(self, messages: tuple[dict, ...]) -> list[int]:
        key = tuple((m["role"], m["content"]) for m in messages)
        ids = self._cache.get(key)
        if ids is None:
            text = self.tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            ids = self.tok(text, add_special_tokens=False).input_ids
            self._cache[key] = ids
        return ids


def response_length(job: JobConfig, seed: int) -> int | None:
    """The fixed length of one response for workloads that set lengths (None: stop at EOS)."""
    spec = job.response_length
    if spec.dist == "natural":
        return None
    if spec.dist == "fixed":
        return job.max_new_tokens
    rng = np.random.default_rng(seed)
    n = int(round(math.exp(rng.normal(math.log(spec.median), spec.sigma))))
    return max(spec.min, min(job.max_new_tokens, n))


def call_task(job: str, what: str, fn: Callable, *args, limit_s: float):
    """fn(*args) (a job's task code) on a thread of its own, its result within `limit_s` seconds, else
    a JobFailure of that job alone; so is anything it raises, SystemExit included. A call that never
    returns is left behind on its daemon thread: Python cannot stop it, but the run goes on and a signal
    still reaches the main thread, which is only waiting."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (a customer's code: whatever it raises is its failure)
            box["error"] = e

    t = threading.Thread(target=run, name=f"colora-task-{job}", daemon=True)
    t.start()
    t.join(None if math.isinf(limit_s) else limit_s)  # join(inf) overflows the platform's time_t
    if t.is_alive():
        raise JobFailure(job, f"its task's {what} did not return within runtime.task_timeout_s ({limit_s:g} s)")
    if "error" in box:
        e = box["error"]
        if isinstance(e, JobFailure):
            raise e
        raise JobFailure(job, f"its task's {what} raised {type(e).__name__}: {e}") from e
    return box["value"]


def check_reward(job: str, value, item_id) -> float:
    """A task's reward as the contract says it is (colora.tasks.Task.reward): a finite number in [0, 1]."""
    try:
        r = float(value)
    except (TypeError, ValueError):
        raise JobFailure(job, f"reward {value!r} for item {item_id} is not a number") from None
    if not (math.isfinite(r) and 0.0 <= r <= 1.0):
        raise JobFailure(job, f"reward {r} for item {item_id} is not a number in [0, 1] (the task contract)")
    return r


def step_items(task, job: JobConfig, seed: int, step: int) -> list:
    """The training prompts of one step of one job."""
    return task.sample(job.prompts_per_step, derive_seed(seed, job.name, step, "prompts"), "train")


def step_requests(task, job: JobConfig, seed: int, step: int, prompts: Prompts, max_model_len: int = 0,
                  limit_s: float = math.inf) -> tuple[list, list[GenRequest]]:
    """(the step's items, the engine requests: samples_per_prompt for each item, each with its own
    sampling seed and, where the workload fixes lengths, its response length). The task's sampling
    and its prompts' chat template run under `limit_s`; a prompt that is empty, or that with the job's
    max_new_tokens does not fit `max_model_len`, is a JobFailure of the job before the engine sees it."""
    def build() -> tuple[list, list[tuple[int, ...]]]:
        items = step_items(task, job, seed, step)
        return items, [tuple(prompts.ids(item.messages)) for item in items]

    items, all_ids = call_task(job.name, "sample (or its prompts' chat template)", build, limit_s=limit_s)
    reqs = []
    for p, (item, ids) in enumerate(zip(items, all_ids)):
        if not ids:
            raise JobFailure(job.name, f"the prompt of item {item.id} is empty")
        if max_model_len and len(ids) + job.max_new_tokens > max_model_len:
            raise JobFailure(job.name, f"the prompt of item {item.id} is {len(ids)} tokens: with max_new_tokens "
                                       f"({job.max_new_tokens}) it does not fit engine.max_model_len ({max_model_len})")
        for s in range(job.samples_per_prompt):
            sseed = derive_seed(seed, job.name, step, "sample", p, s)
            n = response_length(job, sseed)
            reqs.append(GenRequest(job.name, ids, n or job.max_new_tokens, job.temperature, job.top_p, sseed,
                                   min_tokens=n or 0, ignore_eos=n is not None, tag=(p, s)))
    return items, reqs


def score(task: Any, job: JobConfig, items: list, results: list[GenResult], limit_s: float = math.inf) -> list[Rollout]:
    """Rewards and group-relative advantages (std-normalised except for dr_grpo). The job's reward code
    runs under `limit_s` for the whole step; whatever it raises, a reward outside [0, 1] or not finite,
    or a call past the limit is a JobFailure of that job alone."""
    rewards = np.zeros((job.prompts_per_step, job.samples_per_prompt))

    def rewards_of_step() -> None:
        for r in results:
            p, s = r.request.tag
            rew = check_reward(job.name, task.reward(r.text, items[p]), items[p].id)
            if job.format_reward_weight:
                fmt = check_reward(job.name, task.format_reward(r.text, items[p]), items[p].id)
                rew += job.format_reward_weight * fmt
            rewards[p, s] = rew

    call_task(job.name, "reward", rewards_of_step, limit_s=limit_s)
    adv = grpo.group_advantages(torch.tensor(rewards, dtype=torch.float64), std_normalize=job.loss != "dr_grpo")
    return [Rollout(job.name, r.version, list(r.request.prompt_ids), r.completion_ids, r.logprobs,
                    r.request.tag[0], float(rewards[r.request.tag]), float(adv[r.request.tag]),
                    r.finish_reason, r.text)
            for r in results]
