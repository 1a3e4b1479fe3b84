"""Paired statistics and the pre-registered gate, as small pure functions over numbers.

The design is the reference study's: every arm runs the same jobs on the same seeds as the dedicated
baseline, so learning is compared *paired*, one difference per (job, seed): the unit is one job's
outcome on one seed, arm minus dedicated. With 8 jobs and 3 seeds that is 24 pairs. Pairs that share
a seed share a run, so they are not fully independent; the intervals below treat them as
independent, as the reference does, and say so in the report.

Repeats: when an (arm, seed) ran several times, `average_repeats` first averages each (job, seed)
over its repeats, so a seed that ran twice does not count twice. Throughput is averaged the same way
per (arm, seed) before the ratio to dedicated is taken.

Intervals: `t_interval` is the classical Student-t interval of the mean (scipy.stats.t);
`bootstrap_interval` resamples the pairs with an explicit `np.random.Generator` through
scipy.stats.bootstrap, by default with the *percentile* method. Percentile rather than BCa because
BCa's jackknife acceleration is undefined (NaN, with a warning) when every difference is equal,
which is common for accuracy differences of small evaluations; BCa is available by name.

Nothing here reads files or touches a global RNG.
"""

from __future__ import annotations

import inspect
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Hashable, Mapping, Sequence

import numpy as np
from scipy import stats as sps

PASS, FAIL, NOT_EVALUATED = "PASS", "FAIL", "NOT EVALUATED"


@dataclass(frozen=True)
class Interval:
    """A confidence interval for the mean of a sample of paired differences."""

    mean: float
    low: float
    high: float
    n: int
    conf: float
    method: str  # "t", "bootstrap-percentile", "bootstrap-BCa"

    def defined(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    def to_dict(self) -> dict:
        return asdict(self)


def average_repeats(values: Mapping[tuple, float]) -> dict[tuple, float]:
    """{(*key, repeat): value} -> {key: mean over repeats}.

    The last element of each key is the repeat index; e.g. (job, seed, repeat) -> (job, seed).
    """
    groups: dict[tuple, list[float]] = defaultdict(list)
    for k, v in values.items():
        if not isinstance(k, tuple) or len(k) < 2:
            raise ValueError(f"key {k!r} must be a tuple ending in the repeat index, e.g. (job, seed, repeat)")
        groups[k[:-1]].append(float(v))
    return {k: float(np.mean(v)) for k, v in sorted(groups.items())}


def paired_keys(arm: Mapping[Hashable, float], base: Mapping[Hashable, float]) -> list:
    """The sorted keys both sides have; raises naming every key that only one side has."""
    only_arm = sorted(set(arm) - set(base), key=repr)
    only_base = sorted(set(base) - set(arm), key=repr)
    if only_arm or only_base:
        parts = []
        if only_arm:
            parts.append(f"in the arm but not the baseline: {', '.join(map(repr, only_arm))}")
        if only_base:
            parts.append(f"in the baseline but not the arm: {', '.join(map(repr, only_base))}")
        raise ValueError("unpaired keys (every (job, seed) needs both sides): " + "; ".join(parts))
    return sorted(arm, key=repr)


def paired_differences(arm: Mapping[Hashable, float], base: Mapping[Hashable, float]) -> np.ndarray:
    """arm[k] - base[k] for every key k, in `paired_keys` order. Keys are usually (job, seed)."""
    keys = paired_keys(arm, base)
    # d: [pairs]
    return np.array([float(arm[k]) - float(base[k]) for k in keys], dtype=np.float64)


def _sample(x: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"expected a 1-D sample of differences, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"sample holds non-finite values: {x.tolist()}")
    return x


def _check_conf(conf: float) -> None:
    if not 0.0 < conf < 1.0:
        raise ValueError(f"conf ({conf}) must be in (0, 1), e.g. 0.95")


def t_interval(x: Sequence[float] | np.ndarray, conf: float = 0.95) -> Interval:
    """Student-t interval of the mean: mean +- t_{(1+conf)/2, n-1} * sd / sqrt(n).

    Undefined (NaN bounds) for fewer than 2 values; a zero-spread sample gives [mean, mean].
    """
    _check_conf(conf)
    x = _sample(x)
    n = len(x)
    mean = float(x.mean()) if n else math.nan
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, conf, "t")
    sem = float(x.std(ddof=1)) / math.sqrt(n)
    if sem == 0.0:  # scipy returns NaN for scale 0
        return Interval(mean, mean, mean, n, conf, "t")
    lo, hi = sps.t.interval(conf, n - 1, loc=mean, scale=sem)
    return Interval(mean, float(lo), float(hi), n, conf, "t")


# scipy renamed bootstrap's `random_state` to `rng` in 1.15; the GPU host may have either.
_BOOTSTRAP_RNG_KW = "rng" if "rng" in inspect.signature(sps.bootstrap).parameters else "random_state"


def bootstrap_interval(x: Sequence[float] | np.ndarray, rng: np.random.Generator, n_resamples: int = 10000,
                       conf: float = 0.95, method: str = "percentile") -> Interval:
    """Bootstrap interval of the mean, resampling the values with `rng` (scipy.stats.bootstrap).

    `method` is "percentile" (default, see the module docstring) or "BCa". Undefined (NaN bounds)
    for fewer than 2 values. The same generator state gives the same interval.
    """
    _check_conf(conf)
    if method not in ("percentile", "BCa"):
        raise ValueError(f"method {method!r} is not accepted: use 'percentile' or 'BCa'")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator (np.random.default_rng(seed)), got {type(rng).__name__}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples ({n_resamples}) must be at least 1")
    x = _sample(x)
    n = len(x)
    label = f"bootstrap-{method}"
    mean = float(x.mean()) if n else math.nan
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, conf, label)
    if np.all(x == x[0]):  # every resample has the same mean
        return Interval(mean, mean, mean, n, conf, label)
    res = sps.bootstrap((x,), np.mean, n_resamples=n_resamples, confidence_level=conf, method=method,
                        vectorized=True, **{_BOOTSTRAP_RNG_KW: rng})
    ci = res.confidence_interval
    return Interval(mean, float(ci.low), float(ci.high), n, conf, label)


def relative_difference(a: float, b: float) -> float:
    """(b - a) / a: how much `b` differs from `a`, as a fraction of `a`."""
    a, b = float(a), float(b)
    if not (math.isfinite(a) and math.isfinite(b)) or a <= 0:
        raise ValueError(f"relative difference needs a positive finite reference and a finite value, got a={a}, b={b}")
    return (b - a) / a


def aa_spread(a: float, b: float) -> float:
    """The A/A difference of two dedicated runs of the same seed: (b - a) / a for the steps per hour
    of repeat 0 (`a`) and repeat 1 (`b`). 0.019 reads "the repeat was 1.9% faster"."""
    return relative_difference(a, b)


def throughput_ratios(arm: Mapping[int, float], base: Mapping[int, float]) -> dict[int, float]:
    """Per seed: the arm's steps per hour over the dedicated baseline's (each averaged over repeats
    first). Seeds missing from either side raise, naming them."""
    keys = paired_keys(arm, base)
    out = {}
    for s in keys:
        a, b = float(arm[s]), float(base[s])
        if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
            raise ValueError(f"seed {s}: steps per hour must be finite and the baseline positive "
                             f"(arm {a}, dedicated {b})")
        out[s] = a / b
    return out


@dataclass(frozen=True)
class Gates:
    """The pre-registered thresholds (the reference study's by default)."""

    min_ratio: float = 2.0  # steps per GPU-hour over dedicated, on every seed
    aa_multiple: float = 5.0  # mean gain (ratio - 1) must exceed this times the A/A spread
    min_lower_bound: float = -0.05  # paired CI lower bound of eval accuracy / train reward differences
    conf: float = 0.95
    interval: str = "t"  # which interval the learning gates use: "t" or "bootstrap"

    def __post_init__(self):
        if self.interval not in ("t", "bootstrap"):
            raise ValueError(f"gates.interval = {self.interval!r} is not accepted: use 't' or 'bootstrap'")
        _check_conf(self.conf)


@dataclass(frozen=True)
class GateResult:
    name: str
    status: str  # PASS | FAIL | NOT EVALUATED
    value: float | None  # the number compared
    threshold: float
    detail: str  # the numbers behind it, in words

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt_seeds(d: Mapping[int, float], fmt: str) -> str:
    return ", ".join(f"seed {s}: {format(v, fmt)}" for s, v in sorted(d.items()))


def evaluate_gates(ratios: Mapping[int, float], aa: Mapping[int, float], acc: Interval | None,
                   reward: Interval | None, gates: Gates = Gates(),
                   expected_seeds: Sequence[int] | None = None) -> list[GateResult]:
    """The four gates of one arm against the dedicated baseline.

    - throughput: min over seeds of the ratio >= gates.min_ratio ("on every seed"); if
      `expected_seeds` is given, every one of them must have a ratio.
    - gain_vs_aa: mean over seeds of (ratio - 1) > gates.aa_multiple x the A/A spread, where the
      spread is the largest |aa_spread| over the seeds that have a dedicated repeat.
    - eval_accuracy / train_reward: the interval's lower bound >= gates.min_lower_bound.
    A gate without the data it needs is NOT EVALUATED, never passed.
    """
    out = []
    missing = sorted(set(expected_seeds or ()) - set(ratios))
    if not ratios:
        out.append(GateResult("throughput", NOT_EVALUATED, None, gates.min_ratio,
                              "no seed has both this arm and dedicated"))
    elif missing:
        out.append(GateResult("throughput", NOT_EVALUATED, min(ratios.values()), gates.min_ratio,
                              f"pre-registered seed(s) {missing} missing; have {_fmt_seeds(ratios, '.3f')}"))
    else:
        lo = min(ratios.values())
        out.append(GateResult("throughput", PASS if lo >= gates.min_ratio else FAIL, lo, gates.min_ratio,
                              f"min ratio {lo:.3f} vs {gates.min_ratio}; {_fmt_seeds(ratios, '.3f')}"))

    if not ratios or not aa:
        why = "no dedicated A/A repeat" if not aa else "no throughput ratio"
        out.append(GateResult("gain_vs_aa", NOT_EVALUATED, None, gates.aa_multiple, why))
    else:
        gain = float(np.mean(list(ratios.values()))) - 1.0
        spread = max(abs(v) for v in aa.values())
        need = gates.aa_multiple * spread
        out.append(GateResult("gain_vs_aa", PASS if gain > need else FAIL, gain, need,
                              f"mean gain {gain:+.3f} vs {gates.aa_multiple:g} x A/A spread {spread:.3f} = {need:.3f}; "
                              f"A/A {_fmt_seeds(aa, '+.3f')}"))

    for name, iv in (("eval_accuracy", acc), ("train_reward", reward)):
        if iv is None or not iv.defined():
            why = "no paired data" if iv is None else f"interval undefined ({iv.n} pair(s); at least 2 needed)"
            out.append(GateResult(name, NOT_EVALUATED, None, gates.min_lower_bound, why))
            continue
        ok = iv.low >= gates.min_lower_bound
        out.append(GateResult(name, PASS if ok else FAIL, iv.low, gates.min_lower_bound,
                              f"mean diff {iv.mean:+.4f}, {iv.conf:.0%} {iv.method} CI [{iv.low:+.4f}, {iv.high:+.4f}] "
                              f"over {iv.n} pairs; lower bound vs {gates.min_lower_bound:+.3f}"))
    return out


def overall(results: Sequence[GateResult]) -> str:
    """FAIL if any gate failed, PASS if all passed, else NOT EVALUATED."""
    states = {r.status for r in results}
    if FAIL in states:
        return FAIL
    if states == {PASS}:
        return PASS
    return NOT_EVALUATED
