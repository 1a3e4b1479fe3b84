"""What `colora serve`'s co-runner backend does to come near the native run's speed, each switchable on its
own (`colora serve --lever KEY=VALUE`, as `--engine` takes an [engine] setting), so that a benchmark can
measure one at a time against the rest (`colora bench serve --vary`).

| lever | off | on |
| --- | --- | --- |
| `samplers` | "disk": a sampler is a PEFT folder written on the trainer's thread and loaded by vLLM from it, the trainer's thread waiting for the engine | "memory": the adapter frozen into a shared-memory segment of its own (colora/service/frozen.py), built by vLLM's worker from it as the native run's versions are; the samplers of one trainer cycle register in one engine call, which the trainer's thread does not wait for |
| `grouped_requests` | an asample of n sequences is n engine requests | one engine request of n (vLLM's `n`); the same samples (colora/engine/sampling.py) |
| `save_in_step` | a model's save after its optim_step waits for the next trainer cycle | it runs in its optim_step's cycle, right after the step |
| `gather` | a cycle takes what is ready | a group of tenants shares each step's cycles as a native step's jobs do: a forward_backward waits, up to `gather` times the last training cycle's seconds, for the tenants about to train (samples decoding, a step's tail), until the ready ones are 1/`gather_groups` of the active tenants; then an optim_step waits, up to the same bound, for those of the tenants whose forward_backward shared its cycle (not for one deleted, failed or training again), and they run in one optimizer pass; other work runs meanwhile (colora/service/scheduler.py) |

`memory_samplers` bounds the samplers held in memory at once (each pinned in vLLM's cache, where it cannot be
evicted); beyond it a sampler goes by disk. 0: twice the engine's adapter slots (`--max-loras`), every
tenant's two newest samplers at as many tenants as slots. The defaults are what the CPU's measurements
support (reports/serve_levers); the GPU's measurement of each is the lead's (`colora bench serve --vary`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SAMPLERS = ("memory", "disk")


class LeverError(ValueError):
    """A --lever that is not one; the message names it, its value and what is accepted."""


@dataclass(frozen=True)
class Levers:
    samplers: str = "memory"
    memory_samplers: int = 0
    grouped_requests: bool = True
    save_in_step: bool = True
    gather: float = 0.0
    gather_groups: int = 2

    def __post_init__(self):
        if self.samplers not in SAMPLERS:
            raise LeverError(f"lever samplers = {self.samplers!r}: expected one of {', '.join(map(repr, SAMPLERS))}")
        if self.memory_samplers < 0:
            raise LeverError(f"lever memory_samplers = {self.memory_samplers}: 0 (twice the engine's slots) or more")
        if not 0.0 <= self.gather <= 100.0:
            raise LeverError(f"lever gather = {self.gather}: a multiple of the last training cycle's seconds, 0 "
                             "(off) to 100")
        if self.gather_groups < 1:
            raise LeverError(f"lever gather_groups = {self.gather_groups}: at least 1")

    @classmethod
    def off(cls) -> Levers:
        """Every lever off: samplers by disk, one engine request a sample, saves and forward_backward calls as
        they come."""
        return cls(samplers="disk", grouped_requests=False, save_in_step=False, gather=0.0)


def parse(items: list[str], base: Levers | None = None) -> Levers:
    """`--lever KEY=VALUE` items over `base` (default: the defaults); `off` alone turns every lever off
    before the items after it. Each key and value checked as a config file's are."""
    from colora.tables import ConfigError, build, parse_override

    raw: dict = {}
    start = base or Levers()
    for text in items:
        if text.strip() == "off":
            start, raw = Levers.off(), {}
            continue
        try:
            key, value = parse_override(text)
        except ConfigError as e:
            raise LeverError(f"--lever: {e}") from None
        raw[key] = value
    merged = {f.name: getattr(start, f.name) for f in fields(Levers)}
    try:
        return build(Levers, {**merged, **raw}, "lever")  # unknown keys and values of the wrong type, by name
    except ConfigError as e:
        raise LeverError(f"--lever: {e}") from None

def add_argument(parser) -> None:
    """`--lever KEY=VALUE` on `colora serve`'s parser."""
    parser.add_argument("--lever", action="append", default=[], metavar="KEY=VALUE",
                        help="a lever of the co-runner backend (colora/service/levers.py): samplers=memory|disk, "
                             "memory_samplers=N, grouped_requests=true|false, save_in_step=true|false, gather=S, "
                             "gather_groups=G; `off` turns them all off")
