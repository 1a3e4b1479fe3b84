"""The rollout engine's client in a process of its own: the default for the arms whose groups
overlap (the run option `runtime.engine_process`, "auto"; "on" / "off" force it; see
`engine.engine_process`).

overlap_mps on the H200 made 5399 and 5677 steps/h through this process against 5168 and 5304 in
the trainer's (seed 1, two runs each, measured at f954d65). The dedicated arm run through it had
training steps of 1.9-3.2 s against a 0.44 s median, not explained: the sequential arms keep the
client in-process, so the baseline of every ratio is the in-process one.

On the H200 under MPS (measured at 39baa4c), a group's adapter export on the trainer's thread took
2-4x longer while the other group generated, and an adapter load on the engine thread 5x longer while
the other group trained. Both threads share the trainer's Python interpreter, and vLLM's client turns
every engine step into Python work (its output processing for every running sequence) on the engine
thread. `RemoteEngine` keeps `RolloutEngine` and that work in a child process; the engine thread of
the trainer's process only sends a group's adapters and requests and receives its finished batch.

Adapters are exported in the trainer's process (colora/training/export.py): into shared memory that
vLLM's worker maps without the bytes passing through the child, or as a PEFT directory; the child is
sent the `AdapterTensors` or `AdapterDir` naming it (colora/engine/adapters.py).

Same interface as `RolloutEngine` (the co-runner, evaluation and the runner use either): one thread
makes every call. Results are the child's `GenResult`s, unchanged (per-request seeds make them the
same as in-process ones; tested).

Stopping: the child leads a process group of its own, with vLLM's engine processes in it, so a
Ctrl-C in the terminal (SIGINT to the foreground group) reaches the trainer's process only, which
then closes the engine in order (colora/stopping.py). SIGTERM or SIGHUP to the child close its engine
and end it; so does the end of its pipe (the trainer's process is gone). Every wait for the child
has a timeout after which it looks whether the child still lives, and `close` wakes them.

Failures: what the engine refuses of a submitted batch (a sampling setting vLLM does not take) is that
batch's alone, `BatchRefused` from `poll`, and the engine goes on. An engine one of whose processes
died (its core killed, say) is noticed by every wait and by `poll`, which raise EngineProcessError,
and `close` kills what is left of it at once and removes the shared memory a killed core leaves.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from typing import Any

from colora.config import EngineConfig
from colora.engine import adapters as sync
from colora.engine.adapters import Adapter
from colora.engine.liveness import dead_process, shm_segments, unlink_segments
from colora.engine.rollout import GenRequest, GenResult, RolloutEngine
from colora.models.base import load_tokenizer

RECV_SLICE_S = 0.5  # the longest a wait for the child goes without looking whether it still lives
CLOSE_WAIT_S = 20.0  # the longest `close` waits for the child to stop its engine, then to exit


def _serve(conn, kwargs: dict) -> None:
    """The child: one RolloutEngine; commands from `conn` between engine steps, finished batches back.

    A command is (op, call number, *args). Every op but submit is answered ("reply", number, value) or
    ("error", number, message, traceback). A submit has no answer of its own: its batch comes back
    ("done", key, results), or ("failed", key, message, traceback) when the engine refuses it (a
    sampling setting vLLM does not take, say), so that the refusal is that batch's alone. A submit that
    fails because the engine died ends the child, as a step that fails does: the parent finds it dead."""
    os.setpgrp()  # a group of its own (see the module docstring)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # end like Ctrl-C: the engine is closed on the way out
        signal.signal(sig, signal.default_int_handler)
    try:
        eng = RolloutEngine(**kwargs)
    except BaseException as e:  # noqa: BLE001  (everything goes back to the parent, which raises it)
        conn.send(("error", None, f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready", eng.start_seconds, eng._largest_graph(), [p.pid for p in eng._procs]))
    try:
        while True:
            while not eng.busy() or conn.poll(0):  # block for a command only when nothing decodes
                op, n, *args = conn.recv()
                if op == "stop":
                    conn.send(("reply", n, None))
                    return
                try:
                    out = eng.steps.take() if op == "take_steps" else getattr(eng, op)(*args)
                except Exception as e:
                    if op != "submit":  # a refused adapter, say: the parent's call raises it
                        conn.send(("error", n, f"{type(e).__name__}: {e}", traceback.format_exc()))
                    elif eng.dead():
                        raise
                    else:
                        conn.send(("failed", args[0], f"{type(e).__name__}: {e}", traceback.format_exc()))
                    continue
                if op != "submit":
                    conn.send(("reply", n, out))
            for key, results in eng.poll():
                conn.send(("done", key, results))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):  # the parent is gone
        pass
    finally:
        eng.close()


def _kill(proc) -> None:
    """SIGKILL to the child's process group (vLLM's processes are in it) and to the child itself (in
    case it has not made its group yet); then reap it."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        proc.kill()
    proc.join(timeout=CLOSE_WAIT_S)


class EngineProcessError(RuntimeError):
    """The engine's process refused a command or failed; the message is its error."""


class BatchRefused(EngineProcessError):
    """The engine refused one submitted batch (`key`); the engine and every other batch go on."""

    def __init__(self, key: Any, message: str):
        super().__init__(f"the engine refused batch {key!r}: {message}")
        self.key = key
        self.reason = message


class _RemoteSteps:
    """`RolloutEngine.steps` of the child: its buckets of engine steps, on time.perf_counter's clock,
    which on Linux is CLOCK_MONOTONIC, one clock for every process of the machine."""

    def __init__(self, engine: RemoteEngine):
        self._engine = engine

    def take(self) -> list[dict]:
        return self._engine._call("take_steps")


class RemoteEngine:
    own_process = True
    generate = RolloutEngine.generate  # submit + poll, the same code as in-process
    decode = RolloutEngine.decode  # texts are decoded here, by the caller's tokenizer
    set_adapter = RolloutEngine.set_adapter

    def __init__(self, model_dir: str, cfg: EngineConfig, *, max_loras: int, max_lora_rank: int,
                 dtype: str, seed: int, device: str, adapter_sync: str = "auto",
                 engine_args: dict | None = None):
        import psutil

        self._proc = None  # close() works from here on
        self.adapter_sync, self.adapter_sync_note = sync.resolve(adapter_sync)  # the child's is the same
        ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
        self._closing = threading.Event()  # set by close(): a wait in another thread gives up
        self._procs = []
        self._segments: set[str] = set()  # vLLM's shared-memory segments, removed by close() if left
        self._calls = itertools.count()  # numbers each command, so that a late reply is not taken for another's
        self._conn, child = ctx.Pipe()
        kwargs = dict(model_dir=model_dir, cfg=cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype,
                      seed=seed, device=device, adapter_sync=self.adapter_sync, engine_args=engine_args)
        self._proc = ctx.Process(target=_serve, args=(child, kwargs), name="colora-engine")
        t0 = time.perf_counter()
        self._proc.start()
        child.close()
        self._procs = [psutil.Process(self._proc.pid)]  # watched while the engine starts
        try:
            msg = self._recv()
        except BaseException:  # interrupted (a signal) or the child died: nothing of it may stay
            _kill(self._proc)
            raise
        if msg[0] == "error":
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                _kill(self._proc)
            raise EngineProcessError(f"the engine's process failed to start: {msg[2]}\n{msg[3]}")
        _, self.start_seconds, self._graph, pids = msg
        self.start_seconds = time.perf_counter() - t0
        self._procs = [psutil.Process(p) for p in pids] + [psutil.Process(self._proc.pid)]
        self._segments = shm_segments(self._procs)
        self.tokenizer = load_tokenizer(model_dir)
        self.model_dir = str(model_dir)
        self.max_model_len = cfg.max_model_len
        self.dtype = dtype
        self.warmed = False
        self._adapters: dict[str, int] = {}  # job -> version loaded in the child
        self._snapshots: dict[str, int] = {}  # snapshot key -> its version, registered in the child
        self._inflight: set = set()  # batch keys submitted and not yet back
        self._next_request = 0  # makes generate()'s batch keys unique
        self._done: list[tuple[Any, list[GenResult]]] = []
        self._refused: list[tuple[Any, str]] = []  # (key, why) of batches the engine refused, for poll()
        self._next_look = 0.0  # when poll() next looks whether the engine's processes live
        self.steps = _RemoteSteps(self)  # the child's engine-step record, as RolloutEngine.steps

    # -- messages ---------------------------------------------------------------------------------
    def _recv(self):
        """The child's next message. Waits in slices of RECV_SLICE_S, between which a child that died
        (or a close from another thread) ends the wait."""
        try:
            while not self._conn.poll(RECV_SLICE_S):
                why = self.dead() or ("closed" if self._closing.is_set() else "")
                if why:
                    raise EngineProcessError(f"the engine's process ended ({why})")
            return self._conn.recv()
        except (EOFError, OSError):
            why = self.dead() or f"exit code {self._proc.exitcode if self._proc else None}"
            raise EngineProcessError(f"the engine's process ended ({why})") from None

    def _send(self, op: str, n: int | None, *args) -> None:
        try:
            self._conn.send((op, n, *args))
        except OSError:  # a broken pipe: the child is gone
            why = self.dead() or f"exit code {self._proc.exitcode if self._proc else None}"
            raise EngineProcessError(f"the engine's process ended ({why})") from None

    def _call(self, op: str, *args):
        """Send a command and wait for its reply; batches that finish meanwhile are kept for poll(). A
        reply to an earlier command (one whose wait was given up) is dropped."""
        n = next(self._calls)
        self._send(op, n, *args)
        while True:
            msg = self._recv()
            if msg[0] in ("reply", "error"):
                if msg[1] != n:
                    continue
                if msg[0] == "error":
                    raise EngineProcessError(f"engine process, {op}: {msg[2]}")
                return msg[2]
            self._take(msg)

    def _take(self, msg) -> None:
        """A batch back from the child: its results, or the engine's refusal of it."""
        kind, key, *rest = msg
        self._inflight.discard(key)
        if kind == "failed":
            self._refused.append((key, rest[0]))
        else:
            self._done.append((key, rest[0]))

    # -- RolloutEngine's interface ----------------------------------------------------------------
    def set_adapters(self, adapters: list[Adapter]) -> float:
        """RolloutEngine.set_adapters in the child; the seconds are this call's, the trip included."""
        t0 = time.perf_counter()
        self._call("set_adapters", adapters)
        for adapter in adapters:
            self._adapters[adapter.job] = adapter.version
        return time.perf_counter() - t0

    def loaded_adapters(self) -> set[int]:
        return self._call("loaded_adapters")

    def version(self, job: str) -> int:
        return self._adapters[job]

    def drop(self, job: str) -> None:
        """RolloutEngine.drop in the child: the job's requests in flight come back as "abort" results."""
        if self._adapters.pop(job, None) is not None:
            self._call("drop", job)

    def register_snapshot(self, key: str, adapter: Adapter) -> int:
        """RolloutEngine.register_snapshot in the child."""
        lora_id = self._call("register_snapshot", key, adapter)
        self._snapshots[key] = adapter.version
        return lora_id

    def register_snapshots(self, items: list[tuple[str, Adapter]]) -> dict[str, str]:
        """RolloutEngine.register_snapshots in the child: one trip, one call into its engine core for
        the adapters in memory."""
        refused = self._call("register_snapshots", items)
        for key, adapter in items:
            if key not in refused:
                self._snapshots[key] = adapter.version
        return refused

    def release_snapshot(self, key: str) -> None:
        """RolloutEngine.release_snapshot in the child."""
        if self._snapshots.pop(key, None) is not None:
            self._call("release_snapshot", key)

    def snapshots(self) -> dict[str, int]:
        return dict(self._snapshots)

    def abort_all(self) -> list:
        """RolloutEngine.abort_all in the child; the batches it forgot are forgotten here too, those that
        came back (or were refused) and were not yet polled among them, also when the child is gone."""
        keys = [k for k, _ in self._done] + [k for k, _ in self._refused]
        try:
            keys = self._call("abort_all") + [k for k in keys if k not in self._inflight]
        finally:
            self._forget()
        return keys

    def drop_all(self) -> None:
        """RolloutEngine.drop_all in the child (a dead child holds nothing)."""
        try:
            if not self.dead():
                self._call("drop_all")
        finally:
            self._adapters.clear()
            self._snapshots.clear()
            self._forget()

    def reset(self) -> bool:
        """RolloutEngine.reset in the child."""
        try:
            return self._call("reset")
        finally:
            self._adapters.clear()
            self._snapshots.clear()
            self._forget()

    def _forget(self) -> None:
        self._inflight.clear()
        self._done.clear()
        self._refused.clear()

    def warm_up(self, seed: int = 0) -> float:
        return self._call("warm_up", seed)

    def _largest_graph(self) -> int:
        return self._graph

    def submit(self, key: Any, requests: list[GenRequest]) -> None:
        """RolloutEngine.submit in the child. What the engine refuses there (a sampling setting vLLM does
        not take) comes back as that batch's BatchRefused from `poll`."""
        if key in self._inflight:
            raise KeyError(f"batch {key!r} is already in flight")
        for r in requests:
            if r.job is not None and r.job not in self._adapters:
                raise KeyError(f"job {r.job!r} has no adapter loaded in the engine")
            if r.snapshot is not None and r.snapshot not in self._snapshots:
                raise KeyError(f"snapshot {r.snapshot!r} is not registered in the engine (released, or never registered)")
        if not requests:
            self._done.append((key, []))
            return
        self._send("submit", None, key, requests)
        self._inflight.add(key)
        self._next_request += len(requests)

    POLL_WAIT_S = 0.002  # the longest poll() waits for a batch: the caller then looks for new work

    def poll(self) -> list[tuple[Any, list[GenResult]]]:
        """The batches back since the last call, waiting at most POLL_WAIT_S for one while any is in
        flight, so that a group handed to the engine thread meanwhile does not wait for another
        group's generation (waiting for the next batch, the hand-off took 0.29-0.63 s on the H200,
        measured at 4fe85a8).

        A batch the engine refused raises BatchRefused naming it (the batches back beside it are
        returned by the next call). While nothing comes back it looks, every RECV_SLICE_S, whether
        the engine's processes live, and raises EngineProcessError once one has died: the child's
        client waits for a killed engine core for ever, so no batch would come."""
        if self._inflight and not self._done and not self._refused and self._conn.poll(self.POLL_WAIT_S):
            self._take(self._recv())
        while self._inflight and self._conn.poll(0):
            self._take(self._recv())
        if self._refused:
            raise BatchRefused(*self._refused.pop(0))
        if self._inflight and not self._done and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + RECV_SLICE_S
            why = self.dead()
            if why:
                raise EngineProcessError(f"the engine's process ended ({why})")
        done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        return bool(self._inflight) or bool(self._done) or bool(self._refused)

    def dead(self) -> str:
        return dead_process(self._procs)

    def close(self) -> None:
        """Ask the child to close its engine and wait for it (CLOSE_WAIT_S for its reply, then as long
        for its exit), else kill its process group; an engine one of whose processes died is killed
        at once (its client may wait for its core for ever). Then the shared memory a killed engine
        core left, or a closed one did not unlink in time (liveness.shm_segments), is removed."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        self._closing.set()
        died = self.dead()
        if not died and proc.is_alive():
            try:
                self._conn.send(("stop", None))
                t_end = time.monotonic() + CLOSE_WAIT_S
                while proc.is_alive() and self._conn.poll(max(0.0, t_end - time.monotonic())):
                    if self._conn.recv()[0] == "reply":
                        break
            except (EOFError, BrokenPipeError, OSError):
                pass
            proc.join(timeout=CLOSE_WAIT_S)
        import psutil

        if died or proc.is_alive() or proc.exitcode != 0:
            _kill(proc)  # the child's group: also the engine's processes of a child that was killed
        # gone before a new engine starts: on a GPU a dying core still holds its memory
        psutil.wait_procs(self._procs, timeout=CLOSE_WAIT_S)
        self._conn.close()
        # an engine closed in order unlinks its own, but not always before its processes end (a segment
        # outlived a clean close on a loaded machine): what is left of them goes now
        unlink_segments(self._segments)
