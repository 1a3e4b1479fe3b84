"""The task registry: names -> Task classes, plus user tasks given as import paths.

    get_task("countdown", numbers=3, max_target=100)
    get_task("mypkg.mytask:MyTask", level=2)      # a user's own Task subclass, from config

Options are checked against the class's keyword-only __init__ parameters before it is built, so an
unknown or missing option is a TaskError naming it and listing what is accepted; values are checked
by each task's constructor.

An import path's module is looked up, in order, where Python finds installed packages (sys.path),
in the task folders (`add_task_dirs`: the folder of each config file loaded, colora/config.py), and
in the current directory. A module found in a task folder or the current directory has that folder
appended to sys.path, so that it can import the modules beside it. A module found nowhere is a
TaskError that lists every place looked in.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import json
import os
import sys
from pathlib import Path

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
_TASK_DIRS: list[str] = []  # absolute folders to look in for a task's module after sys.path


def add_task_dirs(*dirs: str | os.PathLike) -> None:
    """Look for the modules of import-path tasks in these folders too (after sys.path, before the
    current directory)."""
    for d in dirs:
        d = str(Path(d).resolve())
        if d not in _TASK_DIRS:
            _TASK_DIRS.append(d)


def task_dirs() -> list[str]:
    """Where a task's module is looked for after sys.path: the task folders, then the current
    directory."""
    return list(dict.fromkeys([*_TASK_DIRS, str(Path.cwd())]))


def _import(name: str, module_name: str):
    """The module of import-path task `name` (see the module docstring)."""
    top = module_name.split(".")[0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name not in {module_name.rsplit(".", k)[0] for k in range(module_name.count(".") + 1)}:
            raise TaskError(f"task {name!r}: importing module {module_name!r} failed ({e})") from e
    except Exception as e:  # the module itself raised while it was imported
        raise TaskError(f"task {name!r}: importing module {module_name!r} failed ({type(e).__name__}: {e})") from e
    where = task_dirs()
    for d in where:
        if importlib.machinery.PathFinder.find_spec(top, [d]) is not None:
            if d not in sys.path:
                sys.path.append(d)
            importlib.invalidate_caches()
            try:
                return importlib.import_module(module_name)
            except Exception as e:
                raise TaskError(f"task {name!r}: importing module {module_name!r} from {d} failed "
                                f"({type(e).__name__}: {e})") from e
    raise TaskError(f"task {name!r}: no module {module_name!r}; looked in the installed packages (sys.path) and in "
                    + ", ".join(where) + " (the config file's folder and the current directory)")


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
    if not module_name or not attr:
        raise TaskError(f"task {name!r}: an import path is 'module:Class' (e.g. 'mytasks:MyTask')")
    module = _import(name, module_name)
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
