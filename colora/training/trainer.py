"""The multi-job trainer: every job's rows in shared micro-batches over one frozen base model.

Two primitives, the Tinker API's (colora/service/backend.py), batched across jobs:

- `forward_backward(calls)`: all calls' datums (colora/training/batches.py) in shared micro-batches, each row
  under its call's loss (colora/training/losses.py), forward-only calls in micro-batches of their own without
  gradient. A row's gradient reaches its own job's adapter only, and accumulates there over calls until
  the job's next optimizer step. Each call gets its datums' log-probs and its summed metrics, or an error of
  its own that fails no other call.
- `optim_step(steps)`: every job's AdamW step in one pass, with the settings of its call, its own
  gradient clipping and its last good state kept when an update fails (colora/training/adamw.py).

colora's GRPO step, `step(rollouts)`, is one client of these: per job, its rollouts as datums under
ppo with the trainer's own log-probs as q (the ratio is 1 in value) and its normalisation weights
(grpo.sequence_token_weight, fixed over the whole step, so micro-batching changes only the order of
floating-point sums), then its AdamW settings and gradient clip from its JobConfig. Sharing a batch
mixes no gradients, learning rates or clip factors (tests/test_trainer.py and tests/test_primitives.py hold
shared steps to solo ones). The step is strictly on-policy: a rollout whose adapter version is not the
job's current version is refused (`StaleRolloutError`) before any work. The primitives check no
versions: a Tinker client may train on samples of an older snapshot by its choice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from colora.config import Config, JobConfig, TrainerConfig
from colora.kernels import resolve_backend, selective_log_softmax, upload, upload_aligned
from colora.models.base import load_base_model
from colora.models.shape import ModelShape
from colora.training import grpo, losses
from colora.training.adamw import AdamParams, OptimStepResult, adamw_steps
from colora.training.batches import Datum, Row, datums_problem, micro_batches, pack_micro_batch, pack_micro_batch_rows
from colora.training.fusion import fuse_elementwise, should_fuse
from colora.training.lora import AdapterBank, inject_lora
from colora.training.memory import PassFit, default_budget, pass_fit, return_freed_host_memory
from colora.training.packing import packed_by_default, use_packed_attention


@dataclass
class Rollout:
    job: str
    version: int  # adapter version the completion was sampled from
    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]  # the engine's log-prob of each sampled token (diagnostic)
    prompt_index: int  # which prompt of the step (the advantage group)
    reward: float = 0.0
    advantage: float = 0.0
    finish_reason: str = ""
    text: str = ""


class StaleRolloutError(RuntimeError):
    """A rollout sampled from an adapter version that is not the job's current one."""


class JobFailure(RuntimeError):
    """A job cannot go on (non-finite loss or gradient, bad reward): the job stops, the others go on."""

    def __init__(self, job: str, reason: str):
        super().__init__(f"job {job!r}: {reason}")
        self.job = job
        self.reason = reason


@dataclass
class JobStepStats:
    loss: float
    grad_norm: float
    clip_coef: float  # min(1, grad_clip / grad_norm): < 1 when clipping was active
    kl: float
    clip_frac: float  # share of tokens whose ratio to the engine's log-prob leaves [0.8, 1.2]
    logprob_gap: float  # mean |trainer log-prob - engine log-prob| over completion tokens
    entropy: float
    tokens: int
    sequences: int
    version: int  # the adapter version after the step
    failure: str = ""


# the columns of a pass's sums, one row per call; a call's metrics are their `name:sum`s
METRICS = ("loss", "kl", "clipped", "logprob_gap", "entropy", "tokens")


@dataclass(frozen=True)
class ForwardBackwardCall:
    """One forward_backward (or, with forward_only, forward) of one job: its datums under one loss."""

    job: str
    datums: list[Datum]
    loss: losses.LossSpec = field(default_factory=losses.LossSpec)
    forward_only: bool = False


@dataclass
class ForwardBackwardResult:
    """logprobs: per datum, float32 [n], the trainer's log-prob of each target (at the loss's
    temperature); metrics: sums over the call's targets, `name:sum` for each of METRICS (loss:sum the
    call's loss; kl the k3 KL to the base where the loss has a KL term; clipped and logprob_gap the
    targets whose ratio to `engine_logprobs` leaves [0.8, 1.2] and |logp - engine logp|, where a datum
    has them; tokens the targets). error: why the call failed ("" when it did not): a malformed call
    (no logprobs or metrics), or a loss that is not finite (both present; the job's next optimizer
    step is refused: its gradient holds that loss's)."""

    logprobs: list[np.ndarray] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""


# a target's loss inputs, fp32 [N] each (colora/training/batches.py `pack_micro_batch`)
PER_TOKEN = ("w", "adv", "q", "kind", "lo", "hi", "temp", "kl", "elp")


@dataclass
class DeviceBatch:
    """One micro-batch on the trainer's device (N targets)."""

    inputs: dict  # the decoder body's keyword arguments: ids [B, L] and mask, or one packed row [1, T]
    pos: torch.Tensor  # int64 [N]: each target's row among the body's hidden states, flattened
    call: torch.Tensor  # int64 [N]: each target's call, its row of the pass's sums
    targets: torch.Tensor  # int64 [N]
    tokens: list[int]  # each job's tokens in the activation, in the pass's job order
    loss_inputs: dict[str, torch.Tensor]  # PER_TOKEN's, fp32 [N] each


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    body = getattr(model, "model", None) or getattr(model, "base_model", None)
    if body is None:
        raise TypeError(f"{type(model).__name__} exposes no decoder body (.model)")
    return body


class MultiJobTrainer:
    """jobs: the JobConfig of each job `step` trains (a job driven only through the primitives needs
    none: its adapter's shape comes from the bank, its optimizer settings from each optim_step).
    packed_rows: each micro-batch's sequences back to back in one row without padding
    (colora/training/packing.py); None: `packing.packed_by_default` (on CUDA). memory_budget: the bytes
    a pass may hold where `cfg.micro_batch_tokens` is 0 (planned here, colora/training/memory.py: the
    micro-batch, checkpointing and the log-softmax's rows per chunk; `fit` says what was chosen); None:
    `memory.default_budget` of the device. A run plans its trainer beside its engine
    (colora/run/memory.py) and gives it explicit settings."""

    MISSING = "has no adapter"  # what a call or step for a job not in this trainer is told

    def __init__(self, model: torch.nn.Module, bank: AdapterBank, cfg: TrainerConfig,
                 jobs: dict[str, JobConfig], pad_id: int, packed_rows: bool | None = None,
                 memory_budget: int | None = None):
        self.model = model
        self.body = _decoder(model)
        self.lm_head = model.get_output_embeddings()
        # token ids a datum may hold: rows of the input embedding and of the LM head
        self.vocab = min(self.lm_head.weight.shape[0], model.get_input_embeddings().weight.shape[0])
        self.bank = bank
        self.cfg = cfg
        self.jobs = jobs
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.packed = packed_by_default(self.device) if packed_rows is None else packed_rows
        if self.packed:
            use_packed_attention(model)
        if self.device.type == "cpu":
            return_freed_host_memory()  # a pass's freed activations leave the process (training/memory.py)
        self.fit: PassFit | None = None
        self.micro_batch_tokens, self.logprob_chunk = cfg.micro_batch_tokens, cfg.logprob_chunk
        checkpointing = cfg.gradient_checkpointing
        if not cfg.micro_batch_tokens:
            self.fit = self._plan(memory_budget)
            self.micro_batch_tokens, self.logprob_chunk = self.fit.micro_batch_tokens, self.fit.logprob_chunk
            checkpointing = self.fit.gradient_checkpointing
        if checkpointing:
            _recompute_layers(model)

    def _plan(self, budget: int | None) -> PassFit:
        """The pass's settings for `budget` bytes (colora/training/memory.py), for adapters up to rank 64 or
        the largest of the bank's, on every projection."""
        shape = ModelShape.from_config(self.model.config.to_dict())
        ranks = [ad.rank for ad in self.bank.jobs.values()]
        fit = pass_fit(default_budget(str(self.device)) if budget is None else budget, shape,
                       next(self.model.parameters()).element_size(), str(self.device), rank=max([64, *ranks]),
                       modules=tuple(shape.projections()), logprob_chunk=self.cfg.logprob_chunk,
                       triton=resolve_backend(self.cfg.logprob_backend, self.device) == "triton",
                       checkpointing=True if self.cfg.gradient_checkpointing else None)
        if not fit.micro_batch_tokens:
            raise ValueError(f"trainer.micro_batch_tokens = 0 (planned): a budget of {budget} bytes holds no pass "
                             "of this model; set trainer.micro_batch_tokens, or give the trainer more memory")
        return fit

    # -- the primitives ---------------------------------------------------------------------------
    def forward_backward(self, calls: list[ForwardBackwardCall]) -> list[ForwardBackwardResult]:
        """Run every call in one pass of shared micro-batches; one result per call, in order. A call's
        gradient is added to its job's, which its next `optim_step` applies; forward-only calls add none."""
        return self._pass(calls, keep_logprobs=True)

    def optim_step(self, steps: dict[str, AdamParams]) -> dict[str, OptimStepResult]:
        """Apply each job's gradient accumulated since its last optimizer step, all jobs in one pass
        (colora/training/adamw.py); the gradient is then cleared. A non-finite loss since the last step or
        gradient norm refuses the update, a non-finite or diverged adapter undoes it: the job keeps its
        last good weights and AdamW state, its version stays and `failure` says why. An unknown job or
        invalid settings change nothing (the gradient stays) and `failure` names the field, as does an
        exception inside one job's update (it fails that job alone; colora/training/adamw.py)."""
        out, jobs, params, refused = {}, [], [], []
        for name, p in steps.items():
            out[name] = self._refused_step(name, p)
            if out[name] is not None:
                continue
            ad = self.bank.jobs[name]
            jobs.append(ad)
            params.append(p)
            refused.append(ad.bad_gradient)
            ad.bad_gradient = ""
        try:
            results = adamw_steps(jobs, params, refused, self.cfg.max_adapter_weight)
        except BaseException:
            for ad, why in zip(jobs, refused):  # still refused: their gradients were not cleared
                ad.bad_gradient = ad.bad_gradient or why
            raise
        for ad, res in zip(jobs, results):
            out[ad.name] = res
        return {name: out[name] for name in steps}

    def _refused_step(self, name: str, p: AdamParams) -> OptimStepResult | None:
        """The result of an optimizer step refused before any work (a job not in this trainer, settings that
        are not valid AdamParams: nothing changes, the gradient stays), or None."""
        job = self.bank.jobs.get(name)
        problem = (f"job {name!r} {self.MISSING}" if job is None else
                   p.problem() if isinstance(p, AdamParams) else f"adam_params is a {type(p).__name__}")
        return OptimStepResult(math.nan, 1.0, -1 if job is None else job.version, problem) if problem else None

    # -- colora's GRPO step: one forward_backward and one optim_step -------------------------------
    def step(self, rollouts: dict[str, list[Rollout]],
             sft: dict[str, list[Datum]] | None = None) -> dict[str, JobStepStats]:
        """Train each job present on its rollouts, and each sft job on its datums (cross_entropy, their
        weights the job's normalisation: colora/training/sft_data.py), all in one pass; returns stats per
        job. A job whose loss or gradient is not finite, or whose adapter diverges, is not stepped: its
        stats carry `failure`, its adapter and AdamW state are as before the step, and the caller stops it."""
        self._check_versions(rollouts)
        sft = sft or {}
        calls = self._native_calls(rollouts) + [ForwardBackwardCall(job, datums, losses.LossSpec("cross_entropy"))
                                                for job, datums in sft.items()]
        results = self._pass(calls, keep_logprobs=False)
        for c, res in zip(calls, results):
            if res.error and not self.bank.jobs[c.job].bad_gradient:  # a malformed rollout: no update from it
                self.bank.jobs[c.job].bad_gradient = res.error
        opt = self.optim_step({c.job: self._adam_params(c.job) for c in calls})
        stats = {}
        for c, res in zip(calls, results):
            m, o = {k: res.metrics.get(f"{k}:sum", math.nan) for k in METRICS}, opt[c.job]
            n = max(m["tokens"], 1.0) if math.isfinite(m["tokens"]) else math.nan
            stats[c.job] = JobStepStats(
                loss=m["loss"], grad_norm=o.grad_norm, clip_coef=o.clip_coef, kl=m["kl"] / n,
                clip_frac=m["clipped"] / n, logprob_gap=m["logprob_gap"] / n, entropy=m["entropy"] / n,
                tokens=int(m["tokens"]) if math.isfinite(m["tokens"]) else 0,
                sequences=len(rollouts[c.job] if c.job in rollouts else sft[c.job]),
                version=o.version, failure=o.failure)
        return stats

    def _check_versions(self, rollouts: dict[str, list[Rollout]]) -> None:
        for job, rs in rollouts.items():
            if job not in self.bank.jobs:
                raise KeyError(f"rollouts for unknown job {job!r}")
            if not rs:
                raise ValueError(f"job {job!r}: no rollouts for this step")
            current = self.bank.jobs[job].version
            for r in rs:
                if r.job != job:
                    raise ValueError(f"rollout of job {r.job!r} filed under job {job!r}")
                if r.version != current:
                    raise StaleRolloutError(
                        f"job {job!r}: rollout sampled from adapter version {r.version}, but the job's "
                        f"current version is {current}; colora trains strictly on-policy and refuses it")

    def _native_calls(self, rollouts: dict[str, list[Rollout]]) -> list[ForwardBackwardCall]:
        """Each job's rollouts as one call: datums of prompt + completion scored on the completion,
        weighted by the job's normalisation, ppo on the trainer's own log-probs (ratio 1)."""
        calls = []
        for job, rs in rollouts.items():
            jc = self.jobs[job]
            weights = grpo.sequence_token_weight([len(r.completion_ids) for r in rs], jc.loss, jc.max_new_tokens)
            datums = []
            for r, w in zip(rs, weights):
                if not r.completion_ids:
                    continue  # an empty completion has no tokens to train on
                ids = np.array(list(r.prompt_ids) + list(r.completion_ids), np.int64)
                P = len(r.prompt_ids)
                datums.append(Datum(ids, ids[P:], P - 1, w, r.advantage, math.nan, r.engine_logprobs))
            calls.append(ForwardBackwardCall(job, datums, losses.LossSpec("ppo", 0.8, 1.2, jc.temperature, jc.kl_coef)))
        return calls

    def _adam_params(self, job: str) -> AdamParams:
        jc = self.jobs[job]
        return AdamParams(jc.learning_rate, jc.adam_betas[0], jc.adam_betas[1], jc.adam_eps, jc.weight_decay,
                          jc.grad_clip)

    def _sequences(self, rollouts: dict[str, list[Rollout]]) -> list[Row]:
        """The rows `step` trains on (its micro-batches are `_micro_batches` of these)."""
        calls = self._native_calls(rollouts)
        return self._rows(calls, [""] * len(calls))

    # -- one pass ---------------------------------------------------------------------------------
    def _problem(self, c: ForwardBackwardCall) -> str:
        if not isinstance(c, ForwardBackwardCall):
            return f"a call must be a ForwardBackwardCall, got {type(c).__name__}"
        if c.job not in self.bank.jobs:
            return f"job {c.job!r} {self.MISSING}"
        if not isinstance(c.loss, losses.LossSpec):
            return f"loss is a {type(c.loss).__name__}, not a LossSpec"
        return c.loss.problem() or datums_problem(c.datums, self.vocab)

    @staticmethod
    def _rows(calls: list[ForwardBackwardCall], errors: list[str]) -> list[Row]:
        return [Row(c.job, i, d, c.loss, k) for i, (c, e) in enumerate(zip(calls, errors)) if not e
                for k, d in enumerate(c.datums)]

    def _micro_batches(self, rows: list[Row], order: tuple[str, ...]) -> list[list[Row]]:
        return micro_batches(rows, order, self.micro_batch_tokens, self.packed)

    def _pass(self, calls: list[ForwardBackwardCall], keep_logprobs: bool) -> list[ForwardBackwardResult]:
        """Every valid call's rows in shared micro-batches (forward-only ones apart, without gradient),
        all jobs activated in one order; the host waits for the device once, at the end."""
        errors = [self._problem(c) for c in calls]
        results = [ForwardBackwardResult(error=e) for e in errors]
        rows = self._rows(calls, errors)
        # each call's sums, on the device: one copy to the host per pass, so the host queues the next
        # micro-batch while the GPU still runs this one
        sums = torch.zeros(len(calls), len(METRICS), dtype=torch.float64, device=self.device)
        done = []  # (micro-batch, its log-probs on the device)
        order = tuple(dict.fromkeys(r.job for r in rows))  # jobs' segment order in every micro-batch
        with self.bank.step_scope(order):
            for grad in (True, False):
                part = [r for r in rows if calls[r.call].forward_only != grad]
                for mb in self._micro_batches(part, order):
                    lp = self._forward_backward(mb, order, sums, grad=grad)
                    done.append((mb, lp if keep_logprobs else None))  # only what the caller asked for
        sums = sums.cpu().tolist()
        if keep_logprobs and done:
            for res, c in zip(results, calls):
                res.logprobs = [] if res.error else [None] * len(c.datums)
            flat = torch.cat([lp for _, lp in done]).cpu().numpy()
            mb_rows = [r for mb, _ in done for r in mb]
            ends = np.cumsum([len(r.datum.targets) for r in mb_rows])
            for r, lp in zip(mb_rows, np.split(flat, ends[:-1])):
                results[r.call].logprobs[r.index] = lp
        for i, (c, res) in enumerate(zip(calls, results)):
            if res.error:
                continue
            res.metrics = {f"{k}:sum": v for k, v in zip(METRICS, sums[i])}
            loss = sums[i][0]
            if not math.isfinite(loss) and not c.forward_only:
                ad = self.bank.jobs[c.job]
                res.error = f"loss is not finite ({loss}) at adapter version {ad.version}"
                ad.bad_gradient = ad.bad_gradient or res.error
        return results

    def _device_batch(self, mb: list[Row], order: tuple[str, ...]) -> DeviceBatch:
        """The micro-batch's rows on the device: the body's inputs, each target's place and loss inputs."""
        dev = self.device
        B, L = len(mb), max(len(r.datum.tokens) for r in mb)
        if self.packed:
            longs_host, per_tok, targets_host = pack_micro_batch_rows(mb)
        else:
            longs_host, per_tok, targets_host = pack_micro_batch(mb, self.pad_id)
        # Two uploads from pinned memory, not blocking: a plain .to(cuda) waits for the GPU to finish
        # the previous micro-batch's backward, and the host would stop queueing work meanwhile.
        N, K = len(targets_host), len(longs_host)
        longs = upload(torch.from_numpy(np.concatenate([longs_host, targets_host])), dev)
        tokens = dict.fromkeys(order, 0)  # each job's rows' tokens: its segment of the activation
        if self.packed:  # one row of T tokens: [ids | position ids | pos | call | cu]
            T = int(longs_host[-1])
            for r in mb:
                tokens[r.job] += len(r.datum.tokens)
            inputs = {"input_ids": longs[:T].view(1, T), "position_ids": longs[T: 2 * T].view(1, T),
                      "cu_seq_lens_q": longs[2 * T + 2 * N: K].to(torch.int32), "max_length_q": L}
            pos, call = longs[2 * T: 2 * T + N], longs[2 * T + N: 2 * T + 2 * N]
        else:
            for r in mb:
                tokens[r.job] += L
            inputs = {"input_ids": longs[: B * L].view(B, L), "attention_mask": longs[B * L: 2 * B * L].view(B, L)}
            pos, call = longs[2 * B * L: 2 * B * L + N], longs[2 * B * L + N: K]  # [N] each
        # no KV cache: transformers builds one by default, also in training, and its update per layer
        # is a concatenation of K and V that leaves them strided for the attention (a copy each):
        # ~100 ms of the 8-job step on the H200 (measured at b1c6366) and K/V of every layer held
        inputs["use_cache"] = False
        # each row on a 16-byte boundary: temp goes to a Triton kernel, compiled per pointer alignment
        loss_inputs = dict(zip(PER_TOKEN, upload_aligned([per_tok[k] for k in PER_TOKEN], torch.float32, dev)))
        return DeviceBatch(inputs, pos, call, longs[K:], [tokens[j] for j in order], loss_inputs)

    def _forward_backward(self, mb: list[Row], order: tuple[str, ...], sums: torch.Tensor,
                          grad: bool = True) -> torch.Tensor:
        """One micro-batch: its rows' losses, their gradient into the step scope's leaves where
        `grad`, and their metrics added to `sums` [calls, METRICS] (index_add_ by call). Returns the
        targets' log-probs [N] (detached, in the micro-batch's row order)."""
        b = self._device_batch(mb, order)
        w, adv, q, kind, lo, hi, temp, klc, elp = (b.loss_inputs[k] for k in PER_TOKEN)  # fp32 [N] each
        present = tuple(k for k in losses.KINDS if any(r.loss.kind == k for r in mb))
        W = self.lm_head.weight

        ref_logp = None
        if any(r.loss.kl_coef > 0 for r in mb):
            with torch.no_grad():  # the frozen base model: no adapter active
                h_ref = self.body(**b.inputs).last_hidden_state
                ref_logp = selective_log_softmax(h_ref.reshape(-1, h_ref.shape[-1])[b.pos], W, b.targets,
                                                 temperature=temp, chunk_size=self.logprob_chunk,
                                                 backend=self.cfg.logprob_backend)

        with torch.set_grad_enabled(grad), self.bank.activate(order, b.tokens):
            hidden = self.body(**b.inputs).last_hidden_state  # [B, L, d], or [1, T, d] packed
            h = hidden.reshape(-1, hidden.shape[-1])[b.pos]  # [N, d]
            # a full-parameter job's head is trained: the log-softmax gives its weight a gradient too
            logp, ent = selective_log_softmax(h, W, b.targets, temperature=temp, chunk_size=self.logprob_chunk,
                                              return_entropy=True, backend=self.cfg.logprob_backend)
            tok_loss, kl = losses.token_losses(logp, kind, w, adv, q, lo, hi, ref_logp, klc, present)
            if grad:
                tok_loss.sum().backward()

        with torch.no_grad():
            lp = logp.detach()
            have = ~torch.isnan(elp)
            ratio = torch.exp(lp - elp)
            clipped = ((ratio < 0.8) | (ratio > 1.2)) & have
            gap = torch.where(have, (lp - elp).abs(), torch.zeros_like(elp))
            cols = torch.stack([tok_loss.detach(), kl, clipped.float(), gap, ent.detach(),
                                torch.ones_like(w)], 1).double()  # [N, METRICS]
            sums.index_add_(0, b.call, cols)
        return lp


def _recompute_layers(model: torch.nn.Module) -> None:
    """Gradient checkpointing: each decoder layer keeps only its input for the backward and runs again
    there. transformers checkpoints a layer only while the layer is in training mode, and the base model
    is in eval mode (no dropout): the layers alone are put in training mode, their submodules (attention's
    dropout among them) stay in eval mode."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise TypeError(f"{type(model).__name__} has no layers transformers can checkpoint")
    for m in layers:
        m.training = True


def build_trainer(cfg: Config, model_dir: Path, device: str, dtype: torch.dtype,
                  pad_id: int) -> tuple[AdapterBank, MultiJobTrainer]:
    """The frozen base model on `device` in `dtype`, its elementwise parts fused where
    `trainer.fuse_elementwise` says (colora/training/fusion.py), every job's adapter injected, and the trainer over
    it: (bank, trainer). Used by a run and by `colora replay-step`."""
    model = load_base_model(model_dir, dtype, device)
    if should_fuse(cfg.trainer.fuse_elementwise, device):
        fuse_elementwise(model)
    bank = AdapterBank(device, cfg.trainer.lora_backend, cfg.trainer.pack_projections)
    inject_lora(model, bank)
    for j in cfg.jobs:
        bank.add_job(j.name, j.lora_rank, j.lora_alpha, j.target_modules, cfg.experiment.seed, j.learning_rate,
                     j.weight_decay, j.adam_betas, j.adam_eps)
    return bank, MultiJobTrainer(model, bank, cfg.trainer, {j.name: j for j in cfg.jobs}, pad_id)

