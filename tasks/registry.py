"""The task registry: names -> Task classes, plus user tasks given as import paths.

    get_task("countdown", numbers=3, max_target=100)
    get_task("mypkg.mytask:MyTask", level=2)      # a user's own Task subclass, from config

Options are checked against the class's keyword-only __init__ parameters before it is built, so an
unknown or missing option is a TaskError naming it and listing what is accepted; values are checked
by each task's constructor.
"""

from __future__ import annotations

import importlib
import inspect
import json

from .addition import Addition
from .base import Item, Task, TaskError
from .countdown import Countdown
from .counting import Counting
from .gsm8k import GSM8K
from .gsm_synth import GsmSynth
from .linear_algebra import LinearAlgebra
from .modular import Modular
from .reverse import Reverse
from .sorting import Sorting

_REGISTRY: dict[str, type[Task]] = {}


def register_task(name: str, cls: type[Task]) -> None:
    """Register `cls` under `name`; registering the same class again is a no-op."""
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise TaskError(f"task name {name!r} must be a non-empty string without ':' or surrounding spaces")
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise TaskError(f"task {name!r}: {cls!r} is not a subclass of colora.tasks.Task")
    if _REGISTRY.get(name, cls) is not cls:
        raise TaskError(f"task name {name!r} is already registered to {_REGISTRY[name].__qualname__}")
    _REGISTRY[name] = cls


def list_tasks() -> list[str]:
    return sorted(_REGISTRY)


def task_class(name: str) -> type[Task]:
    """The class for a registered name or an import path "pkg.module:Class"."""
    if not isinstance(name, str):
        raise TaskError(f"task name {name!r} must be a string")
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}; registered: {', '.join(list_tasks())}, "
                        f"or give an import path 'pkg.module:Class'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"task {name!r}: cannot import module {module_name!r} ({e})") from e
    cls = getattr(module, attr, None)
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise TaskError(f"task {name!r}: {module_name}.{attr} is not a subclass of colora.tasks.Task")
    return cls


def get_task(name: str, **options: object) -> Task:
    """A task built with `options`; unknown name, unknown or missing option, bad value: TaskError."""
    cls = task_class(name)
    if inspect.isabstract(cls):
        raise TaskError(f"task {name!r}: {cls.__qualname__} does not implement "
                        f"{', '.join(sorted(cls.__abstractmethods__))}")
    params = {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        accepted = [k for k, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise TaskError(f"task {name!r} has no option {', '.join(map(repr, unknown))}; "
                            f"accepted: {', '.join(accepted) or 'none'}")
        missing = [k for k in accepted if params[k].default is inspect.Parameter.empty and k not in options]
        if missing:
            raise TaskError(f"task {name!r} needs option {', '.join(map(repr, missing))}")
    return cls(**options)


def describe_task(name: str) -> str:
    """One line for `colora tasks list` without building the task (gsm8k needs a file to be built):
    name, summary, options with their defaults ("<required>" for those without one)."""
    cls = task_class(name)
    doc = (inspect.getdoc(cls) or "").strip().splitlines()
    params = [p for k, p in inspect.signature(cls.__init__).parameters.items()
              if k != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    opts = ", ".join(f"{p.name}={'<required>' if p.default is p.empty else repr(p.default)}" for p in params)
    return f"{name}: {doc[0].rstrip('.') if doc else ''} ({opts})"


def parse_options(pairs: list[str]) -> dict[str, object]:
    """CLI "key=value" pairs as task options: a value that parses as JSON is taken as such (3, 0.5,
    true, null, "text"), anything else is kept as text (a path). The same defaults apply as in
    `get_task`, since only the given keys are passed on."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise TaskError(f"task option {pair!r} must be written key=value")
        if key in options:
            raise TaskError(f"task option {key!r} is given twice")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text
    return options


def format_items(items: list[Item]) -> str:
    """Items as text for `colora tasks show`: id, each message, the answer and the metadata."""
    blocks = []
    for i, item in enumerate(items, start=1):
        lines = [f"[{i}] {item.id}"]
        lines += [f"  {m.get('role', '?')}: " + m.get("content", "").replace("\n", "\n    ") for m in item.messages]
        lines.append(f"  answer: {item.answer}")
        lines.append(f"  meta: {json.dumps(dict(item.meta), sort_keys=True)}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


for _cls in (Addition, Countdown, Counting, GSM8K, GsmSynth, LinearAlgebra, Modular, Reverse, Sorting):
    register_task(_cls.name, _cls)
