"""One job's step on the job's side: its prompts, the engine requests they make, and the scoring of the
engine's answers into rollouts for the trainer.

Everything here is a function of the run seed, the job's name and the step (`derive_seed`), so two
arms of one seed sample the same prompts with the same per-request seeds.
"""

from __future__ import annotations

import math
from typing import Any

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


def step_items(task, job: JobConfig, seed: int, step: int) -> list:
    """The training prompts of one step of one job."""
    return task.sample(job.prompts_per_step, derive_seed(seed, job.name, step, "prompts"), "train")


def step_requests(task, job: JobConfig, seed: int, step: int, prompts: Prompts) -> tuple[list, list[GenRequest]]:
    """(the step's items, the engine requests: samples_per_prompt for each item, each with its own
    sampling seed and, where the workload fixes lengths, its response length)."""
    items = step_items(task, job, seed, step)
    reqs = []
    for p, item in enumerate(items):
        ids = tuple(prompts.ids(item.messages))
        for s in range(job.samples_per_prompt):
            sseed = derive_seed(seed, job.name, step, "sample", p, s)
            n = response_length(job, sseed)
            reqs.append(GenRequest(job.name, ids, n or job.max_new_tokens, job.temperature, job.top_p, sseed,
                                   min_tokens=n or 0, ignore_eos=n is not None, tag=(p, s)))
    return items, reqs


def score(task: Any, job: JobConfig, items: list, results: list[GenResult]) -> list[Rollout]:
    """Rewards and group-relative advantages (std-normalised except for dr_grpo); any failure of the
    job's reward code is a JobFailure of that job alone."""
    rewards = np.zeros((job.prompts_per_step, job.samples_per_prompt))
    for r in results:
        p, s = r.request.tag
        try:
            rew = float(task.reward(r.text, items[p]))
            if job.format_reward_weight:
                rew += job.format_reward_weight * float(task.format_reward(r.text, items[p]))
        except Exception as e:  # a customer's reward code: isolate, never crash the others
            raise JobFailure(job.name, f"reward function raised {type(e).__name__}: {e}") from e
        if not math.isfinite(rew):
            raise JobFailure(job.name, f"reward is not finite ({rew}) for item {items[p].id}")
        rewards[p, s] = rew
    adv = grpo.group_advantages(torch.tensor(rewards, dtype=torch.float64), std_normalize=job.loss != "dr_grpo")
    return [Rollout(job.name, r.version, list(r.request.prompt_ids), r.completion_ids, r.logprobs,
                    r.request.tag[0], float(rewards[r.request.tag]), float(adv[r.request.tag]),
                    r.finish_reason, r.text)
            for r in results]
