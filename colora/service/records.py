"""stable_reinforce: its loss as colora serves it, its records of what a recording sampler sampled, and the
datums that name them.

Tinker describes stable_reinforce (a REINFORCE that stays stable when the sampling policy differs from
the trained one, trained on sequences a sampler recorded) but publishes no formula; this is colora's.
Per target token with logp the trainer's log-prob, q the log-prob the sampler had for the token as the
server recorded it, r = exp(logp - q), A the client's advantage and sg() no gradient:

    loss = -sum( sg(min(r, C)) * A * logp )          C = loss_fn_config clip_high_threshold (default 2)

Its gradient is REINFORCE's, -A * dlogp, weighted by the importance ratio of the trained policy to the one
that sampled, truncated at C: on-policy r = 1 and it is plain REINFORCE; off the sampler's policy (async
RL, a stale sampler, the engine's numerics against the trainer's) the ratio corrects the gradient's bias,
and the cap bounds the variance a token the trainer now favours far more than the sampler did would add.
This is truncated importance sampling (Ionides 2008) as LLM RL frameworks apply it against the inference
engine's log-probs: Yao et al.'s TIS (2025), verl's `rollout_is_threshold` (token level, truncate mode)
and ms-swift's `rollout_importance_sampling_threshold`, whose default cap of 2 is this one's. Truncation
rather than masking (IcePop drops tokens whose ratio leaves [0.5, 5]) keeps every sampled token's signal.
q is the server's own record, never the client's `logprobs` (ignored, if sent): a client cannot set the
weights, and the recorded numbers are exactly what the engine sampled with. Prompt runs train nothing
(their advantages must be 0). This is the backend's cispo with the ratio clipped to [0, C], the same loss
term for term, and is served as that (colora/service/service.py). Tinker's `kl_coeff` is accepted at 0
only: this definition has no KL term.

Records: a sample asked with `record_stability_info` (the SDK's sampling clients made with
`record_stability_info=True`) is recorded when it finishes, before it is answered: the asample request's
prompt and, per sampled sequence, its tokens and the log-probs the engine computed for them (the server's
own numbers, never a client's). A sequence is named by its `sequence_id`, "<request_id>:<index>" (the
asample answer's `sample_sequence_ids`, which the SDK puts on each `SampledSequence`).

Records are bounded. They belong to the tenant and the session that sampled them: another tenant's are
"not found", another session's are refused, and a session's end drops its records. A record (one asample
request) is dropped a day (`KEEP_S`) after its last use, each training request that names one of its
sequences restarting the day (Tinker's rule); and, oldest use first, while its tenant holds more than
its `limits.recorded_sequences` sequences or `limits.recorded_bytes` bytes of them (colora/service/config.py).

`behaviour_logprobs` reads a stable_reinforce datum's provenance (Tinker's `Datum.with_provenance`):
two lists of runs, one tiling the datum's input tokens and one its targets, each run naming positions
[offset, offset + length) of a recorded sequence's prompt or of its sampled tokens. Each run is checked
against the record (the input tokens are the recorded ones, a sampled run's targets are the sampled
tokens, a prompt run's advantages are 0: stable_reinforce trains sampled tokens only); the result is,
per target, the log-prob the sampler had for it, and 0 on prompt runs (where the advantage is 0).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from colora.service.config import Limits

KEEP_S = 86400.0  # a record lives a day after its last use
GONE_KEPT = 4096  # dropped records whose error still says why


class RecordError(ValueError):
    """A datum's provenance cannot be used; the message names the field, the sequence and why."""


@dataclass(frozen=True)
class Span:
    """One run of a datum's provenance: `length` positions that are positions [offset, offset + length)
    of sequence `sequence_id`'s sampled tokens (`sampled`) or of its request's prompt."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Provenance:
    """A datum's runs: `inputs` tile its input tokens, `targets` its targets (Tinker's model_input_spans
    and loss_fn_input_spans)."""

    inputs: tuple[Span, ...]
    targets: tuple[Span, ...]


@dataclass
class Recorded:
    """One recorded asample request."""

    tenant: str
    session_id: str
    prompt: np.ndarray  # [P] int32
    tokens: tuple[np.ndarray, ...]  # per sequence: [T_i] int32, the sampled tokens
    logprobs: tuple[np.ndarray, ...]  # per sequence: [T_i] float32, the engine's log-probs of them
    nbytes: int
    used: float  # the clock's time of its last use (its sampling, or a training request naming it)


class Records:
    """Every tenant's records (module docstring), bounded by `limits_of(tenant)` (the server's
    `ServeConfig.limits_of`); safe to call from any thread."""

    def __init__(self, limits_of: Callable[[str], Limits] = lambda tenant: Limits(), keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.monotonic):
        self.limits_of, self.keep_s, self.clock = limits_of, keep_s, clock
        self._lock = threading.Lock()
        self._held: dict[str, collections.OrderedDict[str, Recorded]] = {}  # tenant -> request id -> record, LRU
        self._gone: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()  # id -> (tenant, why)

    def record(self, tenant: str, session_id: str, request_id: str, prompt: np.ndarray,
               sequences: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Records one asample request: its prompt [P] and each sequence's (tokens [T], log-probs [T]).
        Raises RecordError when the record alone is over the limits, ValueError when the log-probs do not
        fit the tokens (the engine returned none)."""
        for i, (tok, lp) in enumerate(sequences):
            if len(lp) != len(tok) or not np.isfinite(np.asarray(lp, np.float32)).all():
                raise ValueError(f"record_stability_info: sequence {i} has {len(tok)} tokens and {len(lp)} "
                                  "log-probs (finite ones needed): the engine must return sampled log-probs")
        rec = Recorded(tenant, session_id, np.asarray(prompt, np.int32),
                       tuple(np.asarray(t, np.int32) for t, _ in sequences),
                       tuple(np.asarray(lp, np.float32) for _, lp in sequences), 0, self.clock())
        rec.nbytes = rec.prompt.nbytes + sum(a.nbytes for a in rec.tokens + rec.logprobs)
        lim = self.limits_of(tenant)
        most, most_bytes = lim.recorded_sequences, lim.recorded_bytes
        if len(rec.tokens) > most or rec.nbytes > most_bytes:
            raise RecordError(f"record_stability_info: this sample's record ({len(rec.tokens)} sequences, "
                              f"{rec.nbytes} bytes) is over a tenant's limit of recorded sequences ({most} "
                              f"sequences, {most_bytes} bytes: limits.recorded_sequences and limits.recorded_bytes); "
                              "sample fewer or shorter")
        with self._lock:
            held = self._held.setdefault(tenant, collections.OrderedDict())
            held[request_id] = rec
            n, nbytes = self._usage(held)
            while n > most or nbytes > most_bytes:
                rid, old = held.popitem(last=False)
                n, nbytes = n - len(old.tokens), nbytes - old.nbytes
                self._forget(rid, tenant, f"tenant {tenant!r} had more than {most} recorded sequences or "
                                          f"{most_bytes} bytes of them (limits.recorded_sequences, "
                                          "limits.recorded_bytes); the least recently used went")

    def get(self, tenant: str, session_id: str, sequence_id: str, where: str) -> tuple[Recorded, int]:
        """The record of `sequence_id` and the sequence's index in it, its day restarted; RecordError
        (naming `where`) when the tenant has no such sequence or another session sampled it."""
        rid, sep, index = sequence_id.rpartition(":")
        with self._lock:
            held = self._held.get(tenant, {})
            rec = held.get(rid) if sep and index.isascii() and index.isdigit() else None
            if rec is None or int(index) >= len(rec.tokens):
                owner, why = self._gone.get(rid, (None, ""))
                if owner == tenant and rec is None:
                    raise RecordError(f"{where}: sequence_id {sequence_id!r} is no longer recorded: {why}")
                raise RecordError(f"{where}: sequence_id {sequence_id!r} is not found among this tenant's recorded "
                                  "sequences: stable_reinforce trains on sequences sampled with "
                                  "record_stability_info=True, by this session, used within the last day")
            if rec.session_id != session_id:
                raise RecordError(f"{where}: sequence_id {sequence_id!r} was sampled by session {rec.session_id}, "
                                  f"not by this model's session {session_id}: recorded sequences belong to the "
                                  "session that sampled them")
            rec.used = self.clock()
            held.move_to_end(rid)
        return rec, int(index)

    def drop_session(self, tenant: str, session_id: str, why: str) -> int:
        """Drops the session's records; returns how many requests' records went."""
        with self._lock:
            held = self._held.get(tenant, {})
            gone = [rid for rid, rec in held.items() if rec.session_id == session_id]
            for rid in gone:
                del held[rid]
                self._forget(rid, tenant, f"its session {why}")
        return len(gone)

    def expire(self, now: float | None = None) -> int:
        """Drops the records unused for keep_s; returns how many went."""
        now = self.clock() if now is None else now
        count = 0
        with self._lock:
            for tenant, held in self._held.items():
                while held and next(iter(held.values())).used + self.keep_s <= now:
                    rid, _ = held.popitem(last=False)
                    self._forget(rid, tenant, f"no training request used it for {self.keep_s:.0f} s")
                    count += 1
        return count

    def usage(self, tenant: str) -> tuple[int, int]:
        """(sequences, bytes) the tenant's records hold."""
        with self._lock:
            return self._usage(self._held.get(tenant, {}))

    @staticmethod
    def _usage(held) -> tuple[int, int]:
        return sum(len(r.tokens) for r in held.values()), sum(r.nbytes for r in held.values())

    def _forget(self, request_id: str, tenant: str, why: str) -> None:
        self._gone[request_id] = (tenant, why)
        while len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)


def behaviour_logprobs(tokens: np.ndarray, targets: np.ndarray, advantages: np.ndarray, prov: Provenance | None,
                       get: Callable[[str, str], tuple[Recorded, int]], where: str) -> np.ndarray:
    """float32 [N]: per target, the recorded sampler log-prob its provenance names (0 on prompt runs).
    tokens, targets, advantages: [N], the datum's; get(sequence_id, where) -> (record, index) (`Records.get`).
    RecordError names the datum's field and position when the provenance does not fit the datum."""
    n = len(tokens)
    if prov is None:
        raise RecordError(f"{where} has no provenance: stable_reinforce needs model_input_spans and "
                          "loss_fn_input_spans naming the recorded sequence behind every position "
                          "(Datum.with_provenance)")
    q = np.zeros(n, np.float32)
    for field, spans, values, name in (("model_input_spans", prov.inputs, tokens, "model_input"),
                                       ("loss_fn_input_spans", prov.targets, targets, "target_tokens")):
        covered = sum(s.length for s in spans)
        if covered != n:
            raise RecordError(f"{where}.{field} cover {covered} positions; the datum has {n}: the runs must tile "
                              f"its {name} exactly")
        pos = 0
        for j, s in enumerate(spans):
            at = f"{where}.{field}[{j}]"
            rec, k = get(s.sequence_id, at)
            src = rec.tokens[k] if s.sampled else rec.prompt
            what = f"sequence {s.sequence_id!r}'s {'sampled tokens' if s.sampled else 'prompt'}"
            end = s.offset + s.length
            if end > len(src):
                raise RecordError(f"{at} names positions [{s.offset}, {end}) of {what}, which has {len(src)} tokens")
            seg = slice(pos, pos + s.length)
            if field == "model_input_spans" or s.sampled:  # a prompt run's targets are the client's (0 in rl_loop)
                bad = np.flatnonzero(values[seg] != src[s.offset: end])
                if len(bad):
                    b = int(bad[0])
                    raise RecordError(f"{at}: {name}[{pos + b}] is token {int(values[pos + b])}, but position "
                                      f"{s.offset + b} of {what} is {int(src[s.offset + b])}")
            if field == "loss_fn_input_spans":
                if s.sampled:
                    q[seg] = rec.logprobs[k][s.offset: end]
                elif (nz := np.flatnonzero(advantages[seg])).size:
                    p = pos + int(nz[0])
                    raise RecordError(f"{at}: advantages[{p}] is {float(advantages[p])} on a prompt run of "
                                      f"{what}: stable_reinforce trains sampled tokens only (advantage 0 elsewhere)")
            pos += s.length
    return q
