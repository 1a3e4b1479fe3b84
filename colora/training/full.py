"""A full-parameter job's trainer: all of its own model's weights, its own AdamW, the LoRA jobs' contract.

A job with `finetune = "full"` owns a model of its own (no adapter: every weight is trained, the tied LM
head and embedding among them) and a vLLM engine of its own (colora/engine/weights.py). Its trainer is
`MultiJobTrainer` with one job whose "adapter" is the whole model (`FullBank`, `FullWeights`), so the
job's step is a LoRA job's step on other parameters:

- the same datums, micro-batches and losses (colora/training/batches.py, losses.py; GRPO's normalisation
  from grpo.py, SFT's cross_entropy), through `forward_backward` and `optim_step` as every job;
- its own gradient clipping on its own norm and torch.optim.AdamW's update with the job's lr, betas, eps
  and weight decay (`optim_step`, checked against plain torch AdamW in tests/test_full_finetune.py);
- strictly on-policy: a rollout whose version is not the weights' current one is refused.

What differs: the LM head is trained, so the kernels' selective log-softmax gives its weight a gradient
too (on either `trainer.logprob_backend`; kernels/logsoftmax.py says what that costs); colora's fused
elementwise kernels are not used (they take frozen norms); a KL term to the base model is refused by the config (the model is
the policy: there is no frozen base to compare with). And a failed update cannot be undone: a LoRA job
keeps a copy of its weights and AdamW state on the device through each step, which for a whole model is
12 bytes a parameter. A non-finite loss or gradient norm still refuses the update before it; weights that
are not finite or beyond `trainer.max_adapter_weight` after it, or an exception inside it, stop the job,
whose last checkpoint holds its last good state.

Precision: in fp32 (the CPU) the model's parameters are AdamW's. In bf16/fp16 the model runs in that
dtype and AdamW steps fp32 master copies: each backward's gradient is added into the master's fp32
gradient as it is made (the model's own is freed at once), and after each step the masters are copied
into the model. Bytes a parameter: 4 + 4 + 4 + 4 (weights, gradient, two moments) in fp32; 2 + 4 + 4 + 4
+ 4 (weights, masters, their gradient, two moments) in bf16 (`state_bytes`).
"""

from __future__ import annotations

import contextlib
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colora.config import Config, JobConfig, TrainerConfig
from colora.engine.weights import WeightsSegment, WeightsUpdate
from colora.models.base import load_base_model
from colora.training.adamw import AdamParams, OptimStepResult, group_norms
from colora.training.lora import _cpu_copy
from colora.training.trainer import MultiJobTrainer


def state_bytes(parameters: int, dtype_bytes: int) -> int:
    """A full-parameter trainer's fixed device memory: weights, AdamW's masters where the model is not
    fp32, their gradient and two fp32 moments (the module's docstring)."""
    masters = 0 if dtype_bytes == 4 else 4
    return parameters * (dtype_bytes + masters + 4 + 4 + 4)


@dataclass
class FullWeights:
    """The role a LoRA job's `JobAdapter` plays, for a whole model: the parameters AdamW steps (the
    model's own in fp32, else fp32 masters), the optimizer, the version and why the gradient accumulated
    since the last step must not be applied."""

    name: str
    model: torch.nn.Module
    masters: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    version: int = 0
    bad_gradient: str = ""
    rank: int = 0  # no adapter: the trainer's pass plan reads a rank
    kept: list = field(default_factory=list)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.masters

    @property
    def mixed(self) -> bool:
        """AdamW steps fp32 masters apart from the model's weights."""
        return self.masters[0] is not next(self.model.parameters())

    def sync(self) -> None:
        """The masters' values into the model's weights (cast)."""
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(list(self.model.parameters()), self.masters)


class FullBank:
    """The AdapterBank's role for one full-parameter job: `jobs`, the step scope and activation (nothing
    to stack or route: every row runs through the one model), the job's state for checkpoints and its
    final export."""

    full = True

    def __init__(self, weights: FullWeights):
        self.jobs = {weights.name: weights}
        self.device = next(weights.model.parameters()).device

    @contextlib.contextmanager
    def step_scope(self, jobs: tuple[str, ...]):
        yield

    @contextlib.contextmanager
    def activate(self, jobs: tuple[str, ...], tokens_per_job: list[int]):
        assert set(jobs) <= set(self.jobs), jobs
        yield

    def named_weights(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """The model's weights under its checkpoint's names, each once (a tied LM head is the embedding's)."""
        return [(n, p.detach()) for n, p in self.jobs[name].model.named_parameters()]

    def job_state(self, name: str) -> dict:
        """Everything needed to resume the job exactly, on the CPU: AdamW's parameters, its state, the version."""
        w = self.jobs[name]
        return {"full": [p.detach().to("cpu", copy=True) for p in w.masters], "version": w.version,
                "optimizer": _cpu_copy(w.optimizer.state_dict())}

    def load_job_state(self, name: str, state: dict) -> None:
        w = self.jobs[name]
        if "full" not in state or len(state["full"]) != len(w.masters):
            raise ValueError(f"job {name!r}: the checkpoint holds no full-parameter state of this model")
        with torch.no_grad():
            for p, saved in zip(w.masters, state["full"]):
                if p.shape != saved.shape:
                    raise ValueError(f"job {name!r}: the checkpoint's weight of shape {tuple(saved.shape)} is not "
                                     f"the model's {tuple(p.shape)}")
                p.copy_(saved)
        w.sync()
        w.optimizer.load_state_dict(state["optimizer"])
        w.optimizer.zero_grad(set_to_none=True)
        w.bad_gradient = ""
        w.version = int(state["version"])

    def export_peft(self, name: str, out_dir: str | Path, base_model: str, dtype: torch.dtype = torch.float32,
                    fold_scale: bool = False) -> Path:
        """The job's model as a Hugging Face directory (its config, weights and the base's tokenizer files),
        replaced whole: what a LoRA job's adapter directory is to it."""
        out, tmp = Path(out_dir), Path(out_dir).with_name(f".{Path(out_dir).name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.jobs[name].model.save_pretrained(tmp, safe_serialization=True)
        for f in Path(base_model).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and f.is_file():
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out


class FullTrainer(MultiJobTrainer):
    """`MultiJobTrainer` over one full-parameter job (the module's docstring): its `step` and
    `forward_backward` (the trained head's gradient from the kernels' log-softmax), its own `optim_step`,
    no KL term."""

    MISSING = "has no weights in this trainer"

    def __init__(self, bank: FullBank, cfg: TrainerConfig, jobs: dict[str, JobConfig], pad_id: int,
                 packed_rows: bool | None = None, memory_budget: int | None = None):
        (w,) = bank.jobs.values()
        super().__init__(w.model, bank, cfg, jobs, pad_id, packed_rows, memory_budget)

    def optim_step(self, steps: dict[str, AdamParams]) -> dict[str, OptimStepResult]:
        """The job's AdamW step (torch.optim.AdamW's, its own clip) on its gradient since the last step,
        which is then cleared; module docstring for what a failure leaves."""
        out = {}
        for name, p in steps.items():
            out[name] = self._refused_step(name, p)
            if out[name] is None:
                out[name] = _adamw_step(self.bank.jobs[name], p, self.cfg.max_adapter_weight)
        return out

    def _problem(self, c) -> str:
        problem = super()._problem(c)
        if not problem and c.loss.kl_coef > 0:
            return (f"loss.kl_coef ({c.loss.kl_coef}): a full-parameter model is the policy itself, there is no "
                    "frozen base for the KL term (not built)")
        return problem


def _adamw_step(w: FullWeights, p: AdamParams, max_weight: float) -> OptimStepResult:
    """One AdamW step of the whole model: refused on a bad gradient (it is cleared), clipped on its own
    norm as clip_grad_norm_ (max / (norm + 1e-6)), torch.optim.AdamW's update, the masters into the model."""
    params = w.parameters()
    refused, w.bad_gradient = w.bad_gradient, ""
    for q in params:
        if q.grad is None:  # no forward_backward since the last step: AdamW still steps (momentum, decay)
            q.grad = torch.zeros_like(q)
    try:
        norm = group_norms([[q.grad for q in params]], 2.0)[0]
    except Exception as e:  # nothing changed: the gradient stays for the same step again
        w.bad_gradient = refused
        return OptimStepResult(math.nan, 1.0, w.version, _raised(e), raised=True)
    clip = min(1.0, p.grad_clip_norm / (norm + 1e-6)) if p.grad_clip_norm > 0 and math.isfinite(norm) else 1.0
    failure = refused or ("" if math.isfinite(norm) else
                          f"gradient norm is not finite ({norm}) at weights version {w.version}")
    if not failure:
        try:
            for g in w.optimizer.param_groups:
                g.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
            if clip < 1.0:
                torch._foreach_mul_([q.grad for q in params], clip)
            w.optimizer.step()
            peak = group_norms([[q.detach() for q in params]], math.inf)[0]
        except Exception as e:  # noqa: BLE001  (the weights may be part-updated: the job stops)
            failure, peak = (f"the optimizer step failed ({type(e).__name__}: {e}) part-way; a full-parameter job "
                             "keeps no copy to put back: it stops, its last checkpoint holds its last good state"), 0.0
        if not failure and not math.isfinite(peak):
            failure = f"weights are not finite after the update to version {w.version + 1}"
        elif not failure and max_weight and peak > max_weight:
            failure = (f"weights diverged: max |weight| {peak:.3g} > trainer.max_adapter_weight ({max_weight:g}) "
                       f"after the update to version {w.version + 1}")
        if not failure:
            w.version += 1
            w.sync()
    w.optimizer.zero_grad(set_to_none=True)
    return OptimStepResult(norm, clip, w.version, failure)


def _raised(e: BaseException) -> str:
    return (f"the optimizer step failed ({type(e).__name__}: {e}) before any change; the weights, their AdamW "
            "state and their gradient are as before it: the same step again applies the gradient once")


def _into_master(param: torch.Tensor, master: torch.Tensor):
    """A hook that adds each new gradient of `param` into `master`'s fp32 gradient and frees it."""
    def hook(p: torch.Tensor) -> None:
        g = p.grad.to(torch.float32)
        master.grad = g if master.grad is None else master.grad.add_(g)
        p.grad = None

    return param.register_post_accumulate_grad_hook(hook)


def full_weights(name: str, model: torch.nn.Module, job: JobConfig) -> FullWeights:
    """`model`'s weights as one job's: all trainable, AdamW with the job's settings (fused on CUDA) over
    the model's own parameters in fp32, over fp32 masters otherwise (their gradient fed by hooks)."""
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    if params[0].dtype == torch.float32:
        masters = params
    else:
        masters = [torch.nn.Parameter(p.detach().to(torch.float32)) for p in params]
        for p, m in zip(params, masters):
            _into_master(p, m)
    opt = torch.optim.AdamW(masters, lr=job.learning_rate, betas=tuple(job.adam_betas), eps=job.adam_eps,
                            weight_decay=job.weight_decay, **({"fused": True} if params[0].is_cuda else {}))
    return FullWeights(name, model, masters, opt)


def build_full_trainer(cfg: Config, model_dir: Path, device: str, dtype: torch.dtype,
                       pad_id: int) -> tuple[FullBank, FullTrainer]:
    """The run's one full-parameter job (the config's only job): its model on `device` in `dtype`, all of
    it trained, and its trainer: (bank, trainer)."""
    (job,) = cfg.jobs
    model = load_base_model(model_dir, dtype, device)
    bank = FullBank(full_weights(job.name, model, job))
    return bank, FullTrainer(bank, cfg.trainer, {job.name: job}, pad_id)


class FullExport:
    """The trainer's side of the weight hand-off (colora/engine/weights.py): each version of the job's
    weights, in the engine's dtype, into the job's segment; what the runner's adapter export is to LoRA jobs."""

    def __init__(self, dtype: str):
        self.dtype = getattr(torch, dtype)
        self._segment: WeightsSegment | None = None

    def export(self, bank: FullBank, job: str) -> WeightsUpdate:
        if self._segment is None:
            self._segment = WeightsSegment(job)
        return self._segment.write(bank.jobs[job].version, bank.named_weights(job), self.dtype)

    def release(self, job: str) -> None:
        self.close()

    def close(self) -> None:
        seg, self._segment = self._segment, None
        if seg is not None:
            seg.close()
