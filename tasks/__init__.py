"""colora.tasks: verifiable-reward tasks, one file per task, and their registry.

    from colora.tasks import get_task
    task = get_task("countdown", numbers=3, max_target=100)
    items = task.sample(8, seed=1, split="train")
    task.reward("<answer>(3 + 5) * 3</answer>", items[0])   # 1.0 or 0.0, never raises

Built-in tasks (`list_tasks()`): addition, countdown, counting, gsm8k (a GSM8K JSONL file),
gsm_synth, linear_algebra, modular, reverse, sorting. Each file's docstring lists its difficulty
options and how its answers are read.
"""

from __future__ import annotations

from .base import SPLITS, AnswerTask, Draft, Item, ProceduralTask, Task, TaskError, split_of
from .registry import (add_task_dirs, describe_task, format_items, get_task, list_tasks, parse_options, register_task,
                       task_class, task_dirs)

__all__ = [
    "SPLITS", "AnswerTask", "Draft", "Item", "ProceduralTask", "Task", "TaskError", "add_task_dirs", "describe_task",
    "format_items", "get_task", "list_tasks", "parse_options", "register_task", "split_of", "task_class", "task_dirs",
]
