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

A sampler (`save_for_sampler`) is the model's adapter at that moment, written as a PEFT directory (the
engine's dtype, its scale folded into B) into the directory asked for or under OUT/samplers/, and
registered in the engine under a LoRA name and id of its own: later optim_steps never touch it, and
vLLM's LRU of adapter slots evicts and reloads it from its directory as clients use it
(colora/engine/rollout.py `register_snapshot`).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import shutil
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from colora.config import EngineConfig, OverlapConfig, TrainerConfig
from colora.engine.adapters import AdapterDir
from colora.engine.process import RemoteEngine
from colora.engine.rollout import RolloutEngine, engine_process
from colora.engine.vllm_args import vllm_lora_rank
from colora.engine.sampling import GenRequest, samples
from colora.models.base import load_base_model, load_tokenizer
from colora.run.preflight import start_mps_for
from colora.run.watcher import watch_this_process
from colora.service.backend import (
    Backend,
    BackendError,
    Capabilities,
    ForwardCall,
    ForwardResult,
    LoraSpec,
    OptimCall,
    SampleCall,
    SampledSequence,
    SampleResult,
)
from colora.training import adamw, losses
from colora.training.batches import Datum
from colora.training.fusion import fuse_elementwise, should_fuse
from colora.training.lora import AdapterBank, inject_lora
from colora.training.trainer import ForwardBackwardCall, MultiJobTrainer

ALPHA = 32.0  # Tinker's API sends no alpha; colora's jobs and SkyRL use 32 (scale = 32 / rank)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
IDLE_WAIT_S = 0.5  # the longest the engine thread waits for work while nothing decodes


class EngineLoop:
    """The engine's thread: the only caller of the engine. Work arrives through `put` from any thread:
    ("sample", SampleCall, done), ("register", key, path, reply), ("release", key, then), ("snapshots", reply).
    A sample's requests join the running batch at once; `done` is called when its last sequence finishes.
    A release is not waited for (it may come from a sample's `done`, on this thread); `then` runs after it.

    A sampler whose folder is gone (its checkpoint deleted by its tenant) fails its samples before they
    reach the engine: vLLM reloads an evicted adapter from its folder inside a step, and a load that fails
    there would end the engine for every tenant."""

    def __init__(self, engine, log: Callable[[str], None]):
        self.engine = engine
        self.log = log
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._paths: dict[str, Path] = {}  # registered sampler key -> its folder
        self._thread = threading.Thread(target=self._run, name="colora-serve-engine", daemon=True)
        self._thread.start()

    def put(self, *item) -> None:
        self._q.put(item)

    def call(self, *item, timeout: float = 600.0):
        """put(item) and wait for its answer (register, snapshots); never from the engine's thread."""
        assert threading.current_thread() is not self._thread, "a call from the engine's thread waits for itself"
        box: dict = {}
        done = threading.Event()
        self.put(*item, (box, done))
        if not done.wait(timeout):
            raise BackendError(f"the engine did not answer {item[0]} within {timeout:.0f} s", "server")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _run(self) -> None:
        inflight: dict[int, tuple[SampleCall, Callable]] = {}
        while not self._stop.is_set():
            items = []
            with contextlib.suppress(queue.Empty):
                items.append(self._q.get(timeout=IDLE_WAIT_S) if not self.engine.busy() else self._q.get_nowait())
                while True:
                    items.append(self._q.get_nowait())
            for item in items:
                self._take(item, inflight)
            if self.engine.busy():
                try:
                    finished = self.engine.poll()
                except Exception as e:  # noqa: BLE001  (the engine failed: every sample in flight hears it)
                    self._fail_all(inflight, BackendError(f"the engine failed: {type(e).__name__}: {e}", "server"))
                    self._forget_all()
                    continue
                for key, results in finished:
                    call, done = inflight.pop(key, (None, None))
                    if done is not None:  # None: failed already, when the engine failed
                        _answer(done, lambda: _result(call, results))

    def _take(self, item, inflight) -> None:
        op = item[0]
        if op == "stop":
            self._stop.set()
            self._fail_all(inflight, BackendError("the server is stopping", "server"))
            return
        if op == "sample":
            _, call, done = item
            path = self._paths.get(call.sampler) if call.sampler is not None else None
            if call.sampler is not None and (path is None or not (path / "adapter_config.json").is_file()):
                err = BackendError(f"the sampler's weights are gone ({path}): its checkpoint was deleted; "
                                   "create a sampling client from a checkpoint that exists", "user")
                _answer(done, lambda: err)
                return
            key = next(self._ids)
            try:
                self.engine.submit(key, samples(_request(call), call.num_samples))
            except Exception as e:  # noqa: BLE001  (this sample's failure alone: an unknown sampler, say)
                err = BackendError(f"{type(e).__name__}: {e}", "user")
                _answer(done, lambda: err)
                return
            inflight[key] = (call, done)
            return
        if op == "release":
            _, key, then = item
            self._paths.pop(key, None)
            try:
                self.engine.release_snapshot(key)
            except Exception as e:  # noqa: BLE001  (nobody waits for a release: say it, go on)
                self.log(f"releasing sampler {key} failed: {type(e).__name__}: {e}")
            if then is not None:
                then()
            return
        *args, (box, event) = item[1:]
        try:
            if op == "register":
                key, path = args
                box["value"] = self.engine.register_snapshot(key, AdapterDir(key, 0, str(path)))
                self._paths[key] = Path(path)
            elif op == "snapshots":
                box["value"] = sorted(self.engine.snapshots())
        except Exception as e:  # noqa: BLE001  (handed to the caller's thread)
            box["error"] = BackendError(f"{type(e).__name__}: {e}", "server")
        event.set()

    def _forget_all(self) -> None:
        """After the engine failed: what it still had in flight is aborted, so that it is idle again
        (the samples were answered) and the next samples run, if it lives."""
        try:
            self.engine.abort_all()
        except Exception as e:  # noqa: BLE001  (a dead engine: its next calls fail the same way)
            self.log(f"the engine failed and its requests could not be aborted: {type(e).__name__}: {e}")

    @staticmethod
    def _fail_all(inflight: dict, err: BackendError) -> None:
        for _, done in inflight.values():
            _answer(done, lambda: err)
        inflight.clear()

    def close(self) -> None:
        self.put("stop")
        self._thread.join(timeout=30)


def _answer(done: Callable, make: Callable) -> None:
    try:
        value = make()
    except Exception as e:  # noqa: BLE001  (a result that cannot be built is that sample's failure)
        value = BackendError(f"{type(e).__name__}: {e}", "server")
    try:
        done(value)
    except Exception:  # noqa: BLE001  (the protocol layer's callback: never kill the engine's thread)
        pass


def _request(call: SampleCall) -> GenRequest:
    """One sample's GenRequest; `samples` makes num_samples of them, seeds derived from call.seed."""
    return GenRequest(None, tuple(int(t) for t in call.prompt), int(call.max_tokens), float(call.temperature),
                      float(call.top_p), int(call.seed), ignore_eos=not call.stop.eos, snapshot=call.sampler,
                      top_k=int(call.top_k), stop=tuple(call.stop.strings), stop_token_ids=tuple(call.stop.token_ids),
                      prompt_logprobs=bool(call.prompt_logprobs))


def _result(call: SampleCall, results) -> SampleResult:
    results = sorted(results, key=lambda r: r.request.tag[1])
    seqs = [SampledSequence(np.asarray(r.completion_ids, np.int64), np.asarray(r.logprobs, np.float32),
                            r.stop_reason) for r in results]
    first = results[0].prompt_logprobs if results else None
    return SampleResult(seqs, None if first is None else np.asarray(first, np.float32))


class CorunBackend(Backend):
    """model_dir: the base model (a Hugging Face directory, also the name clients load the tokenizer
    by); engine, trainer: their config sections (colora/config.py); max_loras: the engine's adapter
    slots; device "auto" | "cpu" | "cuda"; out: where samplers are written."""

    def __init__(self, model_dir: str | Path, out: Path, *, engine: EngineConfig, trainer: TrainerConfig,
                 max_lora_rank: int = 64, max_loras: int = 8, device: str = "auto", seed: int = 0,
                 overlap: OverlapConfig | None = None, log: Callable[[str], None] = print):
        self.model_dir = Path(model_dir)
        self.out = Path(out)
        self.seed = seed
        self.log = log
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        self.max_lora_rank = vllm_lora_rank(max_lora_rank)
        self._stack = contextlib.ExitStack()
        self._samplers = itertools.count()
        self._own: dict[str, Path] = {}  # sampler key -> the directory this backend made for it
        try:
            watch_this_process()  # the engine's processes and MPS go with this process however it ends
            if self.device == "cuda":
                start_mps_for(overlap or OverlapConfig(), "overlap_mps", self.device, self._stack, log, None)
            remote = engine_process("auto", "overlap_mps")  # the engine's client beside the trainer's thread
            Engine = RemoteEngine if remote else RolloutEngine
            self.engine = Engine(str(self.model_dir), engine, max_loras=max_loras, max_lora_rank=self.max_lora_rank,
                                 dtype=self.dtype, seed=seed, device=self.device, adapter_sync="disk")
            self._stack.callback(self.engine.close)
            self.tokenizer = load_tokenizer(self.model_dir)
            model = load_base_model(self.model_dir, getattr(torch, self.dtype), self.device)
            if should_fuse(trainer.fuse_elementwise, self.device):
                fuse_elementwise(model)
            self.bank = AdapterBank(self.device, trainer.lora_backend, trainer.pack_projections)
            inject_lora(model, self.bank)
            self.trainer = MultiJobTrainer(model, self.bank, trainer, {}, self.tokenizer.pad_token_id)
            self.loop = EngineLoop(self.engine, log)
            self._stack.callback(self.loop.close)
        except BaseException:
            self._stack.close()
            raise
        self._caps = Capabilities(model_name=str(self.model_dir), max_context=engine.max_model_len,
                                  vocab_size=int(self.trainer.vocab), max_lora_rank=self.max_lora_rank,
                                  arch=str(getattr(model.config, "model_type", "unknown")))

    # -- what it serves ---------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self._caps

    # -- the training side (the scheduler's trainer thread) --------------------------------------
    def create_model(self, model_id: str, spec: LoraSpec) -> None:
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
        self.bank.remove_job(model_id)

    def train_cycle(self, forward: list[ForwardCall], optim: list[OptimCall]):
        calls = [ForwardBackwardCall(c.model_id, [Datum.tinker(d.tokens, c.loss_fn, d.inputs) for d in c.datums],
                                     _loss(c), c.forward_only) for c in forward]
        out_f: list = []
        for c, res in zip(forward, self.trainer.forward_backward(calls) if calls else []):
            if res.error:
                out_f.append(BackendError(f"model {c.model_id}: {res.error}", "user"))
            else:
                out_f.append(ForwardResult([{"logprobs": np.asarray(lp, np.float32)} for lp in res.logprobs],
                                           {"loss:sum": float(res.metrics["loss:sum"])}))
        steps = self.trainer.optim_step({c.model_id: _adam(c) for c in optim}) if optim else {}
        out_o: list = []
        for c in optim:
            r = steps[c.model_id]
            out_o.append(BackendError(f"model {c.model_id}: {r.failure}", "user") if r.failure else
                         {"grad_norm": float(r.grad_norm), "clip_coef": float(r.clip_coef)})
        return out_f, out_o

    def save_state(self, model_id: str, directory: Path, optimizer: bool = True) -> None:
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
        key = f"sampler-{next(self._samplers)}"
        path = Path(directory) if directory is not None else self.out / "samplers" / key
        if directory is None:
            self._own[key] = path
        self.bank.export_peft(model_id, path, str(self.model_dir), getattr(torch, self.dtype), fold_scale=True)
        self.loop.call("register", key, path)
        return key

    # -- the sampling side (any thread) ----------------------------------------------------------
    def load_sampler(self, directory: Path):
        if not (Path(directory) / "adapter_model.safetensors").is_file():
            raise BackendError(f"{directory} holds no sampler weights (adapter_model.safetensors)", "user")
        key = f"sampler-{next(self._samplers)}"
        self.loop.call("register", key, Path(directory))
        return key

    def release_sampler(self, ref) -> None:
        """Returns at once (it is called from samples' callbacks, on the engine's thread too); the
        engine lets the sampler go between two of its steps, then its own folder is removed."""
        if ref is None:
            return
        path = self._own.pop(ref, None)
        self.loop.put("release", ref, None if path is None else lambda: shutil.rmtree(path, ignore_errors=True))

    def held(self) -> dict[str, list[str]]:
        """What this backend holds now: the models' adapters in the trainer, the samplers in the engine."""
        return {"models": sorted(self.bank.jobs), "samplers": self.loop.call("snapshots")}

    def sample(self, call: SampleCall, done: Callable[[SampleResult | BackendError], None]) -> None:
        self.loop.put("sample", call, done)

    def close(self) -> None:
        self._stack.close()


def _loss(c: ForwardCall) -> losses.LossSpec:
    cfg = c.loss_fn_config or {}
    return losses.LossSpec(c.loss_fn, float(cfg.get("clip_low_threshold", 0.8)),
                           float(cfg.get("clip_high_threshold", 1.2)))


def _adam(c: OptimCall) -> adamw.AdamParams:
    p = c.params
    return adamw.AdamParams(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)

