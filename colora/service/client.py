"""One job of a colora config as a loop over the official `tinker` SDK (0.38), against `colora serve` or any
server that speaks the Tinker API: what `colora run CONFIG --server URL` runs for each job, each in a process
of its own (colora/service/client_run.py).

    colora run experiments/reference8_throughput.toml --server http://127.0.0.1:8000 --api-key tml-mine

A grpo job's step k, strictly on-policy:
1. the step's items and requests as a native run makes them (colora/corun/rollouts.py `step_requests`: the
   same prompts and, where the workload draws lengths, each request's length), sampled from the sampler saved
   after the job's last optim_step (step 0: the fresh adapter's): `stop=[]` (EOS ignored) and max_tokens =
   the drawn length where lengths are drawn, else EOS and max_new_tokens. A prompt's requests that share
   their length go as one `sample` of as many samples (`groups`: all of them for natural or fixed lengths;
   with lengths drawn per request, lognormal, those that drew the same length), seeded with the first one's
   seed: the server draws sample i with that seed + i (colora/engine/sampling.py), one engine request;
2. rewards and group-relative advantages by the job's task (`score`), the job's normalisation weight w_i of
   each sequence (grpo.sequence_token_weight);
3. forward_backward with `importance_sampling`: a datum per sequence, advantages w_i*A_i on the completion's
   targets and 0 on the prompt's, logprobs the sampler's; optim_step with the job's AdamW settings and
   grad_clip; save_weights_and_get_sampling_client: the sampler of step k+1.
An sft job's step sends its step's conversations (colora/training/sft_data.py) as cross_entropy datums with the
weights a native step uses (1 / the step's assistant targets), then optim_step.

The same as a native step: the prompts, the rewards, the advantages, the loss's normalisation, the AdamW
settings and clip, sampling from the current adapter only. What differs (the API's):
- the ratio: importance_sampling weighs each token by r = exp(logp - q), q the sampler's log-prob, where a
  native step uses the trainer's own (r = 1): r departs from 1 by the engine-trainer gap each row records
  (`logprob_gap`, as a native row does);
- seeds: a group's sample i is drawn with the first request's seed + i where the native run draws it with its
  own request's seed: samples differ from a native run's, rewards compare in distribution;
- the adapter's initial draw: the server's, from the seed the client sends (the native run's derivation) and
  the model's id, so it differs from a native run's;
- the engine-trainer gap (`logprob_gap`, `clip_frac`) is measured over the sequences of nonzero advantage: the
  client asks the server to score only the positions a loss weighs (loss_fn_config score_weighted), as a native
  step scores the completion's only, so a sequence of advantage 0 comes back unscored.
What the API cannot express is refused before the run starts, all of it in one message (`refusal`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from typing import Any, Callable

import numpy as np

from colora.config import JobConfig
from colora.corun.rollouts import Prompts, call_task, check_reward, score, step_requests
from colora.corun.trainer_side import TrainerSide
from colora.engine.sampling import GenRequest, GenResult
from colora.seeding import derive_seed
from colora.training import grpo
from colora.training.sft_data import datums as sft_datums
from colora.training.trainer import JobFailure

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
SERVER_ALPHA = 32.0  # the API sends no LoRA alpha; colora serve's adapters use 32 (colora/service/corun.py)
WAIT_S = 0.5  # the longest a job waits on the run's events before it looks whether it should stop


def unsupported(i: int, job: JobConfig) -> list[tuple[str, str]]:
    """What of job `i` cannot run as a Tinker client with the update it gets natively, each as (why, the
    `--set` that makes it expressible); empty when it can. The API has no LoRA alpha (the server's is 32),
    adapts all attention and/or all MLP projections, has no KL term, and its losses read log-probs at
    temperature 1 over the whole vocabulary."""
    p, targets, out = f"jobs.{i}", set(job.target_modules), []
    if job.lora_alpha != SERVER_ALPHA:
        out.append((f"{p}.lora_alpha ({job.lora_alpha:g}) must be {SERVER_ALPHA:g} with --server: the Tinker API "
                    "sends no alpha and colora serve's adapters use 32", f"jobs.{job.name}.lora_alpha={SERVER_ALPHA:g}"))
    if targets not in (set(ATTN), set(MLP), set(ATTN) | set(MLP)):
        whole = (ATTN if targets & set(ATTN) else ()) + (MLP if targets & set(MLP) else ())
        out.append((f"{p}.target_modules ({sorted(targets)}) must be all of {list(ATTN)}, all of {list(MLP)} or both "
                    "with --server: the Tinker API adapts attention and MLP projections as wholes",
                    f"jobs.{job.name}.target_modules={json.dumps(list(whole))}"))
    if job.kind == "sft":
        return out
    if job.kl_coef:
        out.append((f"{p}.kl_coef ({job.kl_coef:g}) must be 0 with --server: the Tinker API's losses have no KL term",
                    f"jobs.{job.name}.kl_coef=0"))
    for key, v in (("temperature", job.temperature), ("top_p", job.top_p)):
        if v != 1.0:
            out.append((f"{p}.{key} ({v:g}) must be 1 with --server: Tinker's importance_sampling takes the trainer's "
                        "log-probs at temperature 1 over the whole vocabulary, so the update would not be the native "
                        "one", f"jobs.{job.name}.{key}=1"))
    return out


def refusal(cfg_jobs, chosen) -> str:
    """Every problem of every chosen job in one message, with the `--set` flags that make the config run
    ("" when there is none)."""
    found = [x for i, j in enumerate(cfg_jobs) if j in chosen for x in unsupported(i, j)]
    if not found:
        return ""
    sets = " ".join(f"--set '{s}'" for _, s in found)
    return ("the Tinker API cannot express these settings: " + "; ".join(why for why, _ in found)
            + f". The same jobs run as clients with {sets}")


# -- what crosses the API ------------------------------------------------------------------------
def rl_datum(prompt_ids, completion_ids, logprobs, advantage: float):
    """A sequence as an importance_sampling datum: model input prompt + completion but its last token,
    position i predicting token i + 1; `advantage` (w_i * A_i) and the sampler's `logprobs` on the
    completion's P-1.. positions, 0 on the prompt's (no loss there)."""
    from tinker import types

    ids = np.asarray([*prompt_ids, *completion_ids], np.int64)
    P, N = len(prompt_ids), len(ids) - 1
    assert P >= 1 and len(logprobs) == len(completion_ids) == N - P + 1, (P, N, len(logprobs))
    adv, q = np.zeros(N, np.float32), np.zeros(N, np.float32)  # [N] each
    adv[P - 1:] = advantage
    q[P - 1:] = logprobs
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": ids[1:], "advantages": adv, "logprobs": q})


def sft_datum(d):
    """A native sft datum (tokens [L], targets tokens[1:], weights [L-1]) as a cross_entropy datum: the model
    input without the last token, which predicts nothing."""
    from tinker import types

    assert d.first == 0 and len(d.targets) == len(d.tokens) - 1, (d.first, len(d.targets), len(d.tokens))
    return types.Datum(model_input=types.ModelInput.from_ints(np.asarray(d.tokens[:-1]).tolist()),
                       loss_fn_inputs={"target_tokens": np.asarray(d.targets, np.int64),
                                       "weights": np.asarray(d.weights, np.float32)})


SCORE_WEIGHTED = {"score_weighted": 1.0}


def forward_backward(training, datums: list, loss_fn: str, config: dict[str, float] | None = None,
                     forward_only: bool = False):
    """The training client's forward_backward (or, `forward_only`, forward) of `datums` under `loss_fn` and
    `config`, with loss_fn_config score_weighted (colora serve computes only the positions the loss weighs and
    returns 0.0 log-probs at the others): this client reads no log-prob at a position of weight or advantage 0."""
    send = training.forward if forward_only else training.forward_backward
    return send(datums, loss_fn, loss_fn_config={**(config or {}), **SCORE_WEIGHTED})


def sampling_params(r: GenRequest):
    """One native request's sampling: its seed, length, temperature and top_p; `stop=[]` where it ignores EOS."""
    from tinker import types

    return types.SamplingParams(max_tokens=r.max_tokens, seed=r.seed, temperature=r.temperature, top_p=r.top_p,
                                stop=[] if r.ignore_eos else None)


def groups(reqs: list[GenRequest]) -> list[list[GenRequest]]:
    """The requests that go as one `sample` each: those of one prompt (their tag's first part) that share
    their sampling (length, EOS, temperature, top_p), in their order; a group's first request's seed seeds it."""
    out: dict[tuple, list[GenRequest]] = {}
    for r in reqs:
        key = (r.tag[0], r.prompt_ids, r.max_tokens, r.min_tokens, r.ignore_eos, r.temperature, r.top_p)
        out.setdefault(key, []).append(r)
    return list(out.values())


def adam_params(job: JobConfig):
    from tinker import types

    return types.AdamParams(learning_rate=job.learning_rate, beta1=job.adam_betas[0], beta2=job.adam_betas[1],
                            eps=job.adam_eps, weight_decay=job.weight_decay, grad_clip_norm=job.grad_clip)


def ratio_stats(trainer_lp: list[np.ndarray], sampler_lp: list[np.ndarray]) -> tuple[float, float, int]:
    """(mean |logp - q|, share of tokens whose ratio exp(logp - q) leaves [0.8, 1.2], tokens) over the
    completions: the engine-trainer gap a native step records as logprob_gap and clip_frac."""
    lp, q = np.concatenate(trainer_lp), np.concatenate(sampler_lp)
    assert lp.shape == q.shape, (lp.shape, q.shape)
    ratio = np.exp(lp - q)
    return float(np.abs(lp - q).mean()), float(((ratio < 0.8) | (ratio > 1.2)).mean()), len(lp)


# -- one job's loop ------------------------------------------------------------------------------
class JobClient:
    """One job's training client and current sampler on the server, and its steps. task: the job's Task
    (grpo) or SftData (sft); base_model: the name the server serves; max_context: its context."""

    def __init__(self, cfg, job: JobConfig, task, tokenizer, service, base_model: str, max_context: int):
        self.cfg, self.job, self.task, self.tok = cfg, job, task, tokenizer
        self.service, self.base_model, self.max_context = service, base_model, max_context
        self.seed = cfg.experiment.seed
        self.limit_s = cfg.runtime.task_timeout_s
        self.prompts = Prompts(tokenizer)
        self.step = 0  # optimizer steps done: the version of the adapter the sampler holds
        self.training = None
        self.sampler = None

    def open(self) -> None:
        """The job's adapter on the server (its rank, its projections, a seed derived as a native run's) and,
        for a grpo job, the sampler of its fresh adapter."""
        targets = set(self.job.target_modules)
        self.training = self.service.create_lora_training_client(
            self.base_model, rank=self.job.lora_rank, seed=derive_seed(self.seed, self.job.name, "lora_init"),
            train_mlp=bool(targets & set(MLP)), train_attn=bool(targets & set(ATTN)), train_unembed=False).result()
        if self.job.kind == "grpo":
            self.sampler = self.training.save_weights_and_get_sampling_client().result()

    def train_step(self) -> dict:
        """One optimizer step; its metrics row (what a native run's row holds, plus `end`: the time.time() at
        which the step's next sampler was ready). A task that fails is a JobFailure."""
        row = self._grpo_step() if self.job.kind == "grpo" else self._sft_step()
        self.step += 1
        return {"job": self.job.name, "kind": self.job.kind, "version": self.step, "status": "ok", **row,
                "end": time.time()}

    def _sample(self, reqs: list[GenRequest]) -> list[GenResult]:
        """Every request of the step at once, a `sample` of the current sampler per group (`groups`); each result
        under its native request (its tag scores it); texts decoded as the engine's."""
        from tinker import types

        batches = groups(reqs)
        futures = [self.sampler.sample(types.ModelInput.from_ints(list(g[0].prompt_ids)), len(g), sampling_params(g[0]))
                   for g in batches]
        out = []
        for g, f in zip(batches, futures):
            seqs = f.result().sequences
            if len(seqs) != len(g):
                raise JobFailure(self.job.name, f"the server answered {len(seqs)} samples for {len(g)}")
            for r, seq in zip(g, seqs):
                lps = seq.logprobs
                if lps is None or len(lps) != len(seq.tokens):
                    raise JobFailure(self.job.name, "the server's samples carry no log-probs, which "
                                                    "importance_sampling needs (colora serve: --engine logprobs=true)")
                out.append(GenResult(r, self.step, list(seq.tokens), list(lps), "", seq.stop_reason))
        texts = self.tok.batch_decode([g.completion_ids for g in out], skip_special_tokens=True)
        for g, t in zip(out, texts):
            g.text = t
        return out

    def _grpo_step(self) -> dict:
        job, t0 = self.job, time.perf_counter()
        items, reqs = step_requests(self.task, job, self.seed, self.step, self.prompts, self.max_context, self.limit_s)
        results = self._sample(reqs)
        t_gen = time.perf_counter() - t0
        rollouts = score(self.task, job, items, results, self.limit_s)
        weights = grpo.sequence_token_weight([len(r.completion_ids) for r in rollouts], job.loss, job.max_new_tokens)
        kept = [(r, w) for r, w in zip(rollouts, weights) if r.completion_ids]  # as a native step: no empty ones
        if not kept:
            raise JobFailure(job.name, f"no completion of step {self.step} holds a token to train on")
        t1 = time.perf_counter()
        advantages = [np.float32(w * r.advantage) for r, w in kept]  # as rl_datum sends them
        fb = forward_backward(self.training, [rl_datum(r.prompt_ids, r.completion_ids, r.engine_logprobs, a)
                                              for (r, _), a in zip(kept, advantages)], "importance_sampling")
        opt = self.training.optim_step(adam_params(job))
        nxt = self.training.save_weights_and_get_sampling_client()  # sent at once: the SDK keeps the order
        out, stepped = fb.result(), opt.result()
        t_train = time.perf_counter() - t1
        self.sampler = nxt.result()
        # the sequences of advantage 0 are not scored (score_weighted: their log-probs come back 0.0)
        scored = [(o, r) for o, (r, _), a in zip(out.loss_fn_outputs, kept, advantages) if a != 0]
        lp = [o["logprobs"].to_numpy()[len(r.prompt_ids) - 1:] for o, r in scored]
        gap, clipped, _ = (ratio_stats(lp, [np.asarray(r.engine_logprobs, np.float32) for _, r in scored])
                           if scored else (math.nan, math.nan, 0))
        tokens = sum(len(r.completion_ids) for r, _ in kept)
        m = stepped.metrics or {}
        # rollout_versions: the optimizer steps behind the sampler every rollout came from (on-policy: = step)
        return {"step": self.step, **TrainerSide._rl_row(rollouts, float(np.mean([r.reward for r in rollouts]))),
                "loss": out.metrics.get("loss:sum", math.nan), "grad_norm": m.get("grad_norm", math.nan),
                "clip_coef": m.get("clip_coef", math.nan), "clip_frac": clipped, "logprob_gap": gap, "tokens": tokens,
                "sequences": len(kept), "t_generate": t_gen, "t_train": t_train,
                "t_save": time.perf_counter() - t1 - t_train}

    def _sft_step(self) -> dict:
        convs = self.task.batch(self.step, self.job.prompts_per_step)
        datums = sft_datums(convs)
        t1 = time.perf_counter()
        fb = forward_backward(self.training, [sft_datum(d) for d in datums], "cross_entropy")
        opt = self.training.optim_step(adam_params(self.job))
        out, stepped = fb.result(), opt.result()
        m = stepped.metrics or {}
        return {"step": self.step, "loss": out.metrics.get("loss:sum", math.nan), "grad_norm": m.get("grad_norm", math.nan),
                "clip_coef": m.get("clip_coef", math.nan), "tokens": int(sum(len(d.targets) for d in datums)),
                "sequences": len(datums), "t_generate": 0.0, "t_train": time.perf_counter() - t1}

    def evaluate(self) -> dict:
        """The held-out evaluation a native run makes (colora/run/evaluate.py): a grpo job's greedy answers
        to its eval items from its current sampler, scored by its task; an sft job's mean loss per assistant
        token on its held-out conversations (a forward: no gradient). {} without eval (eval_size 0)."""
        n, job = self.cfg.experiment.eval_size, self.job
        if n <= 0:
            return {}
        if job.kind == "sft":
            out = forward_backward(self.training, [sft_datum(d) for d in sft_datums(self.task.eval)], "cross_entropy",
                                   forward_only=True).result()
            return {"n": len(self.task.eval), "loss": out.metrics["loss:sum"], "accuracy": None}
        from tinker import types

        budget = self.cfg.experiment.eval_max_new_tokens or job.max_new_tokens
        try:
            items = call_task(job.name, "sample of its eval items", self.task.sample, n,
                              derive_seed(self.seed, job.name, "eval"), "eval", limit_s=self.limit_s)
            greedy = types.SamplingParams(max_tokens=budget, temperature=0.0)
            futures = [self.sampler.sample(types.ModelInput.from_ints(list(self.prompts.ids(it.messages))), 1, greedy)
                       for it in items]
            texts = self.tok.batch_decode([f.result().sequences[0].tokens for f in futures], skip_special_tokens=True)
            scored = call_task(job.name, "reward on its eval items", lambda: [
                [it.id, check_reward(job.name, self.task.reward(t, it), it.id)] for it, t in zip(items, texts)],
                limit_s=self.limit_s)
        except JobFailure as f:
            return {"n": n, "items": [], "accuracy": None, "error": f.reason}
        return {"n": n, "items": scored, "accuracy": sum(s for _, s in scored) / len(scored), "version": self.step}


def job_process(spec: dict, to_parent, go, finish, stop) -> None:
    """One job's process (colora/service/client_run.py starts it): open the job on the server, evaluate, wait
    for `go`, train its steps unless `stop` is set, report, wait for `finish` (every job trained: the
    evaluation after training runs on a quiet server, as a native run's), evaluate, save its final state
    (`tinker://<model>/weights/final`), close its session (the server frees its adapter and samplers). Every
    message to the parent is (job, kind, payload): "line", "row", "eval" ((when, result)), "trained" ({status,
    reason, steps, ends}) and, last, "end" ({weights: the final state's path or None})."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the run's parent, which sets `stop`
    os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's telemetry posts go to the server otherwise
    name = spec["job"]

    def send(kind: str, payload: Any = None) -> None:
        to_parent.put((name, kind, payload))

    state = {"status": "running", "reason": "", "steps": 0, "ends": [], "reported": False}

    def trained() -> None:
        state["reported"] = True
        send("trained", {k: v for k, v in state.items() if k != "reported"})

    try:
        _run_job(spec, send, go, finish, stop, state, trained)
    except BaseException as e:  # noqa: BLE001  (whatever ends this job, the parent hears why; the others go on)
        if not state["reported"]:
            state.update(status="stopped", reason=_why(e))
            send("row", {"job": name, "step": state["steps"], "event": "stopped", "status": "stopped",
                         "reason": state["reason"]})
            trained()
        else:  # after its training: the evaluation or the session's close failed
            send("line", f"warning: job {name}: after training: {_why(e)}")
    finally:
        send("end", {"weights": state.get("weights")})


def _run_job(spec: dict, send: Callable, go, finish, stop, state: dict, trained: Callable[[], None]) -> None:
    import tinker

    from colora.config import from_dict
    from colora.models.base import load_tokenizer
    from colora.tasks import add_task_dirs, get_task
    from colora.training.sft_data import SftData

    add_task_dirs(*spec["task_dirs"])
    cfg = from_dict(spec["config"])
    job = cfg.job(spec["job"])
    tok = load_tokenizer(spec["model_dir"])
    task = (SftData(spec["sft_path"], tok, job=job.name, run_seed=cfg.experiment.seed, eval_size=cfg.experiment.eval_size,
                    max_len=cfg.engine.max_model_len) if job.kind == "sft" else get_task(job.task, **job.task_options))
    with tinker.ServiceClient(base_url=spec["url"], api_key=spec["api_key"]) as service:
        jc = JobClient(cfg, job, task, tok, service, spec["base_model"], spec["max_context"])
        jc.open()
        send("eval", ("before", jc.evaluate()))
        state["status"] = "waiting"
        while not go.wait(WAIT_S):
            if stop.is_set() or finish.is_set():  # the run ended before this job was to join
                state["reason"] = "the run ended before it was to join" if not stop.is_set() else "interrupted"
                trained()
                return
        state["status"] = "running"
        steps = job.steps or cfg.experiment.steps
        while jc.step < steps and not stop.is_set():
            row = jc.train_step()
            state["steps"], state["ends"] = jc.step, state["ends"] + [row["end"]]
            send("row", row)
            send("line", f"step {jc.step}/{steps} | {job.name} "
                         + (f"r={row['reward']:.2f}" if "reward" in row else f"loss={row['loss']:.3f}")
                         + f" | gen {row['t_generate']:.1f}s train {row['t_train']:.1f}s")
        state["status"] = "done" if jc.step >= steps else "running"
        trained()
        while not finish.wait(WAIT_S):
            if stop.is_set():
                return
        if not stop.is_set():
            send("eval", ("after", jc.evaluate()))
            # the adapter and its AdamW state outlive the session: a client can load them and go on
            state["weights"] = jc.training.save_state("final").result().path


def _why(e: BaseException) -> str:
    """A job's end as its summary says it: a task's failure by its reason, the server's refusal by its answer."""
    if isinstance(e, JobFailure):
        return e.reason
    return f"{type(e).__name__}: {e}"[:2000]
