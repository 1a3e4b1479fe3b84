"""colora's backend of the Tinker service: every tenant's adapter in one multi-job trainer, every
tenant's samples in one vLLM engine, the two at once.

The scheduler's trainer thread (colora/service/scheduler.py) calls `train_cycle`: all models' ready
forward_backward and forward calls in one pass of shared micro-batches, then every pending optim_step
in one pass (colora/training/trainer.py), each call's failure its own. The engine runs on a thread of
its own (`EngineLoop`), the only one that calls it: snapshots registered and released, samples queued
the moment they arrive and answered the moment they finish, whatever the trainer is doing. Clients at
different phases of their loops therefore overlap the way colora's phase-offset groups do: one
tenant's samples decode while another tenant's step trains. On a GPU both are MPS clients of colora's
own daemon (the trainer in this process, the engine in its client's process, `runtime.engine_process`).

A sampler (`save_for_sampler`, `load_sampler`) holds weights of the backend's own, in the engine's dtype
with the scale folded into B, registered in the engine under a LoRA name and id of its own: later
optim_steps never touch them. With the `samplers` lever at "memory" (colora/service/levers.py) the
unnamed save of a model's adapter (`save_weights_and_get_sampling_client`, every RL step) is frozen into a
shared-memory segment of its own (colora/service/frozen.py) that vLLM's worker builds the adapter from,
the native run's in-memory path; the trainer's thread only copies the adapter there, and the samplers
saved before the next sample go to the engine in one call (`_flush`, on the engine's thread). Otherwise
(the lever at "disk", a named save, `load_sampler`, /dev/shm full, `memory_samplers` held already) it is
a PEFT directory, OUT/samplers/<key>, which vLLM's LRU of adapter slots evicts and reloads as clients use
it (colora/engine/rollout.py `register_snapshots`). A named sampler save
writes the checkpoint's folder too, and `load_sampler` of a checkpoint makes the sampler's own folder
of the checkpoint's files: hard links where the file system allows (no bytes copied), else copies.
Never the checkpoint's folder itself: a tenant's delete or overwrite of the checkpoint (the store
removes the folder or puts a new one in its place, and never rewrites a file) then leaves every sampler
made from it as it was, where vLLM would fail to reload a deleted adapter inside an engine step, and
would load an overwritten one's new weights after an eviction. OUT/samplers is swept when a backend
starts (what a killed server left) and emptied when it closes; the backend holds OUT's lock meanwhile.
Segments go with their samplers and their folder when the backend closes; a killed server's folder goes at
the next colora's start (colora/run/preflight.py `remove_stale_adapter_sync`, also called here).

A full-parameter model (create_model with a `FullSpec`, `colora serve --full-models N`) has its own trainer and
engine (colora/service/full.py); every call of this backend for it, or for one of its samplers, goes there,
and a trainer cycle trains its calls with its own trainer beside the shared one's.

The engine comes back when its processes die (colora/service/engine_loop.py): the samples in flight
fail with a retryable error, every live sampler is registered in the new engine, and `health` says
how it goes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from colora.config import EngineConfig, OverlapConfig, TrainerConfig
from colora.engine.adapters import AdapterDir, ShmFull
from colora.engine.process import RemoteEngine
from colora.engine.rollout import RolloutEngine, engine_process
from colora.engine.vllm_args import vllm_lora_rank
from colora.models.base import load_base_model, load_tokenizer
from colora.run.memory import for_service
from colora.run.preflight import RunError, remove_stale_adapter_sync, start_mps_for
from colora.run.rundir import LOCK, holder, holding
from colora.run.watcher import watch_this_process
from colora.service.backend import (
    Backend,
    BackendError,
    Capabilities,
    ForwardCall,
    ForwardResult,
    FullSpec,
    LoraSpec,
    OptimCall,
    SampleCall,
    SampleResult,
    scored_span,
    scores_weighted,
)
from colora.service.engine_loop import EngineLoop
from colora.service.frozen import FrozenAdapters
from colora.service.full import MARKER as FULL_MARKER
from colora.service.full import FullModel, FullSampler
from colora.service.levers import Levers
from colora.training import adamw, losses
from colora.training.batches import Datum
from colora.training.fusion import fuse_elementwise, should_fuse
from colora.training.lora import AdapterBank, inject_lora
from colora.training.trainer import ForwardBackwardCall, MultiJobTrainer

ALPHA = 32.0  # Tinker's API sends no alpha; colora's jobs and SkyRL use 32 (scale = 32 / rank)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class CorunBackend(Backend):
    """model_dir: the base model (a Hugging Face directory, also the name clients load the tokenizer
    by); engine, trainer: their config sections (colora/config.py); max_loras: the engine's adapter
    slots; device "auto" | "cpu" | "cuda"; out: the server's folder, whose samplers/ this backend owns;
    levers: colora/service/levers.py (the scheduler reads `gather` and `save_in_step` from `self.levers`)."""

    def __init__(self, model_dir: str | Path, out: Path, *, engine: EngineConfig, trainer: TrainerConfig,
                 max_lora_rank: int = 64, max_loras: int = 8, device: str = "auto", seed: int = 0,
                 overlap: OverlapConfig | None = None, log: Callable[[str], None] = print,
                 levers: Levers | None = None):
        self.levers = levers or Levers()
        self.model_dir = Path(model_dir)
        self.out = Path(out)
        self.seed = seed
        self.log = log
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        self.max_lora_rank = vllm_lora_rank(max_lora_rank)
        self.samplers_dir = self.out / "samplers"
        self._stack = contextlib.ExitStack()
        self._closing = threading.Lock()
        self._samplers = itertools.count()
        self._pending: list[tuple[str, object]] = []  # samplers saved and not yet handed to the engine's thread
        self._pending_lock = threading.Lock()
        self.full: dict[str, FullModel] = {}  # the full-parameter models (colora/service/full.py)
        self.frozen: FrozenAdapters | None = None  # the samplers in memory, with the `samplers` lever at "memory"
        try:
            watch_this_process()  # the engine's processes and MPS go with this process however it ends
            self._own_samplers_dir()
            if self.device == "cuda":
                start_mps_for(overlap or OverlapConfig(), "overlap_mps", self.device, self._stack, log, None)
            # the engine's share and the trainer's passes that the settings leave to colora (0), planned from the
            # card once MPS runs (reading the card before would keep this process out of MPS)
            engine, trainer = for_service(engine, trainer, self.model_dir, self.device, self.dtype, max_loras,
                                          self.max_lora_rank, log)
            remote = engine_process("auto", "overlap_mps")  # the engine's client beside the trainer's thread
            Engine = RemoteEngine if remote else RolloutEngine
            memory = self.levers.samplers == "memory"
            # the samplers held in memory are pinned in vLLM's CPU cache of adapters: room for them beside
            # the 2 * max_loras that vLLM keeps for adapters loaded from disk (colora/engine/vllm_args.py)
            self.memory_samplers = (self.levers.memory_samplers or 2 * max(1, max_loras)) if memory else 0
            extra = {"max_cpu_loras": max(2, 2 * max_loras) + self.memory_samplers} if memory else None

            def start_engine():  # the first engine, and each one that replaces a dead one
                return Engine(str(self.model_dir), engine, max_loras=max_loras, max_lora_rank=self.max_lora_rank,
                              dtype=self.dtype, seed=seed, device=self.device,
                              adapter_sync="auto" if memory else "disk", engine_args=extra)

            self._stack.callback(lambda: self.frozen and self.frozen.close())  # once the engine has closed
            self.loop = EngineLoop(start_engine, log, grouped=self.levers.grouped_requests)
            self._stack.callback(self.loop.close)
            if memory and self.loop.engine.adapter_sync == "memory":
                for d in remove_stale_adapter_sync():
                    log(f"removed {d}, adapters in shared memory that a killed colora left")
                self.frozen = FrozenAdapters(str(self.model_dir), getattr(torch, self.dtype))
            elif memory:
                log(f"samplers go by disk: {self.loop.engine.adapter_sync_note}")
            self.tokenizer = load_tokenizer(self.model_dir)
            model = load_base_model(self.model_dir, getattr(torch, self.dtype), self.device)
            if should_fuse(trainer.fuse_elementwise, self.device):
                fuse_elementwise(model)
            self.bank = AdapterBank(self.device, trainer.lora_backend, trainer.pack_projections)
            inject_lora(model, self.bank)
            self.trainer = MultiJobTrainer(model, self.bank, trainer, {}, self.tokenizer.pad_token_id)
            self._full_settings = {"engine": engine, "trainer": trainer, "device": self.device, "dtype": self.dtype,
                                   "seed": seed, "pad_id": self.tokenizer.pad_token_id, "log": log}
            self._stack.callback(self._close_full)  # before the shared engine closes
        except BaseException:
            self._stack.close()
            raise
        self._caps = Capabilities(model_name=str(self.model_dir), max_context=engine.max_model_len,
                                  vocab_size=int(self.trainer.vocab), max_lora_rank=self.max_lora_rank,
                                  arch=str(getattr(model.config, "model_type", "unknown")))

    def _own_samplers_dir(self) -> None:
        """OUT held (a second server on it would sweep this one's samplers: refused), OUT/samplers swept
        now and emptied at close."""
        self.samplers_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._stack.enter_context(holding(self.out, self.log))
        except RunError:
            rec = holder(self.out) or {}
            raise RunError(f"{self.out} is served already (pid {rec.get('pid', '?')} on {rec.get('host', '?')} holds "
                           f"{self.out / LOCK}): two servers must not share one --out") from None
        self._stack.callback(self._sweep_samplers)  # runs before the lock is let go
        left = self._sweep_samplers()
        if left:
            self.log(f"removed {left} samplers' folders a previous server left in {self.samplers_dir}")

    def _sweep_samplers(self) -> int:
        gone = 0
        for d in self.samplers_dir.iterdir():
            if d.is_dir() and not d.is_symlink():
                shutil.rmtree(d)
            else:
                d.unlink()
            gone += 1
        return gone

    # -- what it serves ---------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self._caps

    def health(self) -> dict:
        gpu = None
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            gpu = int(total - free)  # the device's, every process's (the engine's and MPS's with the trainer's)
        return {**self.loop.health(), "gpu_memory_bytes": gpu}

    def full_health(self) -> dict[str, dict]:
        """Each full-parameter model's engine's health (FullModel.health), by model id."""
        return {model_id: m.health() for model_id, m in list(self.full.items())}

    # -- the training side (the scheduler's trainer thread) --------------------------------------
    def create_model(self, model_id: str, spec: LoraSpec | FullSpec) -> None:
        if isinstance(spec, FullSpec):
            if model_id in self.full or model_id in self.bank.jobs:
                raise BackendError(f"model {model_id!r} exists", "user")
            self.full[model_id] = FullModel(model_id, self.model_dir, **self._full_settings)
            self.log(f"model {model_id}: full-parameter, its own trainer and engine "
                     f"({sum(p.numel() for p in self.full[model_id].bank.jobs[model_id].masters):,} parameters)")
            return
        targets = (ATTN if spec.train_attn else ()) + (MLP if spec.train_mlp else ())
        if not targets:
            raise BackendError("lora_config: train_attn and train_mlp are both false: nothing to train", "user")
        if spec.rank > self.max_lora_rank:
            raise BackendError(f"lora_config.rank ({spec.rank}) is above this server's largest ({self.max_lora_rank})",
                               "user")
        try:
            # the init is the client's seed's alone (LoraConfig.seed): two models of one seed start equal
            self.bank.add_job(model_id, spec.rank, ALPHA, targets, spec.seed, init_name="tinker")
        except ValueError as e:
            raise BackendError(str(e), "user") from None

    def delete_model(self, model_id: str) -> None:
        if model_id in self.full:
            self.full.pop(model_id).close("the model was deleted")
            return
        self.bank.remove_job(model_id)

    def _close_full(self) -> None:
        while self.full:
            self.full.popitem()[1].close("the server is stopping")

    def train_cycle(self, forward: list[ForwardCall], optim: list[OptimCall]):
        """The LoRA models' calls in the shared trainer's passes, each full-parameter model's in its own
        trainer's; one result per call, in the order given."""
        groups: dict[str, tuple[list, list]] = {}  # "" (the shared trainer) or a full model -> (calls, steps)
        for i, c in enumerate(forward):
            groups.setdefault(c.model_id if c.model_id in self.full else "", ([], []))[0].append((i, c))
        for i, c in enumerate(optim):
            groups.setdefault(c.model_id if c.model_id in self.full else "", ([], []))[1].append((i, c))
        out_f: list = [None] * len(forward)
        out_o: list = [None] * len(optim)
        for name, (fs, os_) in groups.items():
            trainer = self.full[name].trainer if name else self.trainer
            got_f, got_o = _cycle(trainer, [c for _, c in fs], [c for _, c in os_])
            for (i, _), r in zip(fs, got_f):
                out_f[i] = r
            for (i, _), r in zip(os_, got_o):
                out_o[i] = r
        return out_f, out_o

    def save_state(self, model_id: str, directory: Path, optimizer: bool = True) -> None:
        if model_id in self.full:
            return self.full[model_id].save_state(directory, optimizer)
        state = self.bank.job_state(model_id)
        if not optimizer:
            state.pop("optimizer")
        ad = self.bank.jobs[model_id]
        torch.save(state, Path(directory) / "state.pt")
        (Path(directory) / "adapter.json").write_text(json.dumps(
            {"rank": ad.rank, "alpha": ad.alpha, "target_modules": list(ad.target_modules)}))

    def load_state(self, model_id: str, directory: Path, optimizer: bool) -> None:
        path = Path(directory) / "state.pt"
        if not path.is_file():
            raise BackendError(f"{directory} holds no saved state (state.pt)", "user")
        if model_id in self.full:
            return self.full[model_id].load_state(directory, optimizer)
        if (Path(directory) / FULL_MARKER).is_file():
            raise BackendError(f"{directory} holds a full-parameter model's state, not a LoRA adapter's: load it "
                               "into a full-parameter model", "user")
        state = torch.load(path, map_location="cpu", weights_only=True)
        ad = self.bank.jobs[model_id]
        if optimizer and "optimizer" not in state:
            raise BackendError(f"{directory} was saved without optimizer state", "user")
        if not optimizer:  # fresh AdamW state: no moments, no step count
            state["optimizer"] = {**ad.optimizer.state_dict(), "state": {}}
        try:
            self.bank.load_job_state(model_id, state)  # also drops the gradient accumulated since the last step
        except ValueError as e:
            raise BackendError(str(e), "user") from None

    def save_for_sampler(self, model_id: str, directory: Path | None):
        """The model's adapter now, frozen in memory or in the sampler's own folder (module docstring; named,
        in `directory` too: the same files, hard links where the file system allows)."""
        if model_id in self.full:
            return self.full[model_id].save_for_sampler(directory)
        key = self._new_sampler()
        if directory is None and self.frozen is not None and self.frozen.held() < self.memory_samplers:
            try:
                adapter = self.frozen.freeze(self.bank, model_id, key)
            except ShmFull as e:
                self.log(f"sampler {key} goes by disk: {e}")
            else:
                with self._pending_lock:
                    self._pending.append((key, adapter))
                return key
        own = self.samplers_dir / key
        try:
            self.bank.export_peft(model_id, own, str(self.model_dir), getattr(torch, self.dtype), fold_scale=True)
            if directory is not None:
                _link_or_copy(own, Path(directory))
            if self.frozen is not None:  # registered with the others, when a sample needs it
                with self._pending_lock:
                    self._pending.append((key, AdapterDir(key, 0, str(own))))
            else:
                self.loop.call("register", key, own)
        except BaseException:
            shutil.rmtree(own, ignore_errors=True)
            raise
        return key

    def _flush(self) -> None:
        """The samplers saved since the last flush to the engine's thread, as one registration, ahead of
        whatever is put after it (a sample of one of them)."""
        with self._pending_lock:
            if self._pending:
                self.loop.put("register_many", self._pending)
                self._pending = []

    # -- the sampling side (any thread) ----------------------------------------------------------
    def load_sampler(self, directory: Path):
        """A sampler of its own made of the checkpoint `directory`'s files (module docstring)."""
        directory = Path(directory)
        if (directory / "config.json").is_file() and not (directory / SAMPLER_FILES[0]).is_file():
            raise BackendError(f"{directory} holds a full-parameter model's weights: this server samples a full "
                               "model only from its live model's newest save (save_weights_and_get_sampling_client)",
                               "user")
        missing = [f for f in SAMPLER_FILES if not (directory / f).is_file()]
        if missing:
            raise BackendError(f"{directory} holds no sampler weights ({', '.join(missing)} missing)", "user")
        key = self._new_sampler()
        own = self.samplers_dir / key
        try:
            _link_or_copy(directory, own)
            self.loop.call("register", key, own)
        except FileNotFoundError as e:  # the checkpoint was deleted meanwhile
            shutil.rmtree(own, ignore_errors=True)
            raise BackendError(f"{directory} holds no sampler weights any more: {e}", "user") from None
        except BaseException:
            shutil.rmtree(own, ignore_errors=True)
            raise
        return key

    def _new_sampler(self) -> str:
        return f"sampler-{next(self._samplers)}"

    def release_sampler(self, ref) -> None:
        """Returns at once (it is called from samples' callbacks, on the engine's thread too); the
        engine lets the sampler go between two of its steps, then its folder is removed."""
        if ref is None or isinstance(ref, FullSampler):  # a full model's sampler holds nothing of its own
            return
        own = self.samplers_dir / ref

        def free() -> None:
            shutil.rmtree(own, ignore_errors=True)
            if self.frozen is not None:
                self.frozen.free(ref)

        with self._pending_lock:
            pending = next((i for i, (k, _) in enumerate(self._pending) if k == ref), None)
            if pending is None:  # under the lock: after the flush that took it, in the queue's order
                self.loop.put("release", ref, free)
                return
            del self._pending[pending]
        free()  # never handed to the engine

    def held(self) -> dict[str, list[str]]:
        """What this backend holds now: the models' adapters in the trainer, the samplers in the engine."""
        self._flush()
        return {"models": sorted([*self.bank.jobs, *self.full]), "samplers": self.loop.call("snapshots")}

    def sample(self, call: SampleCall, done: Callable[[SampleResult | BackendError], None]) -> None:
        if isinstance(call.sampler, FullSampler):
            full = self.full.get(call.sampler.model_id)
            if full is None:
                done(BackendError(f"model {call.sampler.model_id} was deleted: its engine, which served this "
                                  "full-parameter sampler, is gone", "user"))
            else:
                full.sample(call.sampler, call, done)
            return
        self._flush()
        self.loop.put("sample", call, done)

    def close(self) -> None:
        """Once, also when the server's shutdown and its caller both call it: the engine closed, then
        OUT/samplers emptied, then OUT's lock let go."""
        with self._closing:
            self._stack.close()


SAMPLER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # what vLLM reads of a PEFT folder


def _link_or_copy(src: Path, dst: Path) -> None:
    """`dst` (made here, or empty) with every file of the PEFT folder `src`: a hard link to each where the
    file system allows (no bytes copied: the files are never rewritten, only removed or replaced, so
    the link keeps what it was made of), else a copy."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.is_symlink():
            continue
        try:
            os.link(f, dst / f.name)
        except FileNotFoundError:
            raise
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(f, dst / f.name)


def _cycle(trainer: MultiJobTrainer, forward: list[ForwardCall], optim: list[OptimCall]):
    """`forward`'s calls in one trainer's shared passes, then `optim`'s steps: (results, results), in order."""
    out_f: list = [None] * len(forward)
    todo: list[tuple[int, list[tuple[int, int]]]] = []  # (the call's index, each datum's span [lo, hi))
    for i, c in enumerate(forward):
        try:
            weighted = scores_weighted(c.loss_fn_config)
        except BackendError as e:
            out_f[i] = e
            continue
        todo.append((i, [scored_span(c.loss_fn, d.inputs) if weighted else (0, len(d.tokens)) for d in c.datums]))
    calls = [ForwardBackwardCall(forward[i].model_id, [_scored(d, forward[i].loss_fn, lo, hi)
                                                       for d, (lo, hi) in zip(forward[i].datums, spans) if hi > lo],
                                 _loss(forward[i]), forward[i].forward_only) for i, spans in todo]
    for (i, spans), res in zip(todo, trainer.forward_backward(calls) if calls else []):
        c = forward[i]
        if res.error:
            out_f[i] = BackendError(f"model {c.model_id}: {res.error}", "user")
            continue
        got = iter(res.logprobs)
        outputs = []
        for d, (lo, hi) in zip(c.datums, spans):
            lp = np.zeros(len(d.tokens), np.float32)  # [N]: 0.0 outside the scored span
            if hi > lo:
                lp[lo:hi] = next(got)
            outputs.append({"logprobs": lp})
        out_f[i] = ForwardResult(outputs, {"loss:sum": float(res.metrics["loss:sum"])})
    steps = trainer.optim_step({c.model_id: _adam(c) for c in optim}) if optim else {}
    out_o: list = []
    for c in optim:
        r = steps[c.model_id]
        # a failure of the device (r.raised) is the server's, the model left as it was; a refused update is the client's
        out_o.append(BackendError(f"model {c.model_id}: {r.failure}", "server" if r.raised else "user")
                     if r.failure else
                     {"grad_norm": float(r.grad_norm), "clip_coef": float(r.clip_coef)})
    return out_f, out_o


def _scored(d, loss_fn: str, lo: int, hi: int) -> Datum:
    """The Tinker datum `d` as the trainer's, scored on positions [lo, hi) only: its tokens up to hi (a causal
    model's positions before hi read none after it), its targets and loss inputs from lo."""
    if (lo, hi) == (0, len(d.tokens)):
        return Datum.tinker(d.tokens, loss_fn, d.inputs)
    datum = Datum.tinker(d.tokens[:hi], loss_fn, {k: v[lo:hi] for k, v in d.inputs.items()})
    return dataclasses.replace(datum, first=lo)


def _loss(c: ForwardCall) -> losses.LossSpec:
    cfg = c.loss_fn_config or {}
    return losses.LossSpec(c.loss_fn, float(cfg.get("clip_low_threshold", 0.8)),
                           float(cfg.get("clip_high_threshold", 1.2)))


def _adam(c: OptimCall) -> adamw.AdamParams:
    p = c.params
    return adamw.AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)

