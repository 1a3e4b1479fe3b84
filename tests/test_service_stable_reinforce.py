"""stable_reinforce as `colora serve` serves it (colora/service/records.py): samples recorded with
record_stability_info, datums whose provenance names them, the loss against the engine's recorded
log-probs, and the records' bounds. The fake backend, over HTTP without the SDK (the SDK's own datums
are tests/test_service_sdk.py's and, on the real backend, the cookbook's math_rl in test_service_corun.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_service_http import A, B, fb, make, new_model, post, result
from test_service_sdk import CLIENT_PY, CLIENT_RUN, KEYS

from colora.service import tinker_public_pb2 as pb
from colora.service.app import ServerThread, create_app
from colora.service.config import Limits, ServeConfig
from colora.service.fake import fake_from_model_dir
from colora.service.records import Provenance, RecordError, Records, Span, behaviour_logprobs

SCRIPT = Path(__file__).resolve().parent / "fixtures" / "tinker_client" / "stable_reinforce.py"

PROMPT = [1, 2, 3]
T = 5  # sampled tokens a sequence


def sampler_of(c, sid: str, mid: str, seq_id: int, seq: int = 0, key=A) -> str:
    """An ephemeral sampler of the model (the SDK's save_weights_and_get_sampling_client)."""
    r = post(c, "save_weights_for_sampler", {"model_id": mid, "seq_id": seq_id, "sampling_session_seq_id": seq}, key)
    return result(c, r.json()["request_id"], key)["sampling_session_id"]


def sample(c, ss: str, seq_id: int, n: int = 4, record: bool = True, key=A, seed: int = 1) -> list[dict]:
    """n sequences of T tokens after PROMPT: [{tokens, logprobs, id}]."""
    r = post(c, "asample", {"sampling_session_id": ss, "seq_id": seq_id, "num_samples": n,
                            "record_stability_info": record,
                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                            "sampling_params": {"max_tokens": T, "seed": seed, "stop": []}}, key).json()
    seqs = result(c, r["request_id"], key)["sequences"]
    return [{**s, "id": i} for s, i in zip(seqs, r["sample_sequence_ids"])]


def rl_datum(s: dict, adv: float, sequence_id: str | None = None, **changes) -> dict:
    """The cookbook's rl_loop datum of a sampled sequence (with_sampled_provenance): input = prompt + all but
    the last sampled token, targets 0 on the prompt then the sampled tokens, advantage 0 on the prompt."""
    P, sid = len(PROMPT), sequence_id or s["id"]
    d = {"tokens": PROMPT + s["tokens"][:-1], "target_tokens": [0] * (P - 1) + s["tokens"],
         "advantages": [0.0] * (P - 1) + [adv] * T,
         "inputs": [(False, sid, 0, P), (True, sid, 0, T - 1)], "targets": [(False, sid, 1, P - 1), (True, sid, 0, T)]}
    return {**d, **changes}


def sr_body(model_id: str, seq: int, datums: list[dict], loss: str = "stable_reinforce", config=None,
            forward_only: bool = False) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss, forward_only=forward_only)
    for k, v in (config or {}).items():
        msg.loss_fn_config_v2[k].number = v
    for x in datums:
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(x["tokens"], np.int32).tobytes()
        for name in ("target_tokens", "advantages", "logprobs", "weights"):
            if name in x:
                a = np.asarray(x[name], np.int64 if name == "target_tokens" else np.float32)
                d.loss_fn_inputs[name].dense = a.tobytes()
                d.loss_fn_inputs[name].dtype = pb.DTYPE_INT64 if name == "target_tokens" else pb.DTYPE_FLOAT32
                d.loss_fn_inputs[name].shape.append(len(a))
        for field, runs in ((d.model_input_spans, x.get("inputs", ())), (d.loss_fn_input_spans, x.get("targets", ()))):
            for sampled, sid, offset, length in runs:
                arm = field.add().sampled_tokens if sampled else field.add().prompt_tokens
                arm.sequence_id, arm.offset, arm.length = sid, offset, length
    return msg.SerializeToString()


def run(c, body: bytes, key=A) -> dict:
    r = fb(c, body, key)
    assert r.status_code == 200, r.text
    return result(c, r.json()["request_id"], key)


def reference(lp: list[np.ndarray], seqs: list[dict], advs: list[float], cap: float) -> torch.Tensor:
    """-sum(sg(min(r, C)) * A * logp) over the sampled targets, r = exp(logp - q) with q the sampled log-probs, in
    float64 from the trainer's log-probs: the loss written out (records.py)."""
    total = torch.zeros((), dtype=torch.float64)
    for x, s, a in zip(lp, seqs, advs):
        logp = torch.tensor(x[len(PROMPT) - 1:], dtype=torch.float64)
        q = torch.tensor(s["logprobs"], dtype=torch.float64)
        total = total - (torch.clamp(torch.exp(logp - q), max=cap) * a * logp).sum()
    return total


@pytest.fixture
def trained(tmp_path):
    """alice's model after one strong cross_entropy step on the sequences she sampled from its first sampler
    (so the trainer's policy is off the sampler's: some ratios above 2, some below 1)."""
    c, backend = make(tmp_path)
    with c:
        sid, mid = new_model(c)
        ss = sampler_of(c, sid, mid, 1)
        seqs = sample(c, ss, 0)
        ce = [{"tokens": PROMPT + s["tokens"][:-1], "target_tokens": PROMPT[1:] + s["tokens"],
               "weights": [0.0] * 2 + [1.0, 1.0] + [0.0] * (T - 2)} for s in seqs[:2]]
        run(c, sr_body(mid, 2, ce, loss="cross_entropy"))
        assert "error" not in result(c, post(c, "optim_step", {"model_id": mid, "seq_id": 3,
                                                              "adam_params": {"learning_rate": 0.5}}).json()["request_id"])
        yield c, backend, sid, mid, seqs


def test_the_loss_is_reinforce_weighted_by_the_recorded_ratio_truncated_at_the_cap(trained):
    c, backend, _, mid, seqs = trained
    advs = [1.0, -0.5, 2.0, -1.5]
    datums = [rl_datum(s, a, logprobs=[-9.0] * (len(PROMPT) + T - 1)) for s, a in zip(seqs, advs)]  # ignored
    seq = iter(range(4, 100))
    for cap in (2.0, 5.0):
        out = run(c, sr_body(mid, next(seq), datums, config={"clip_high_threshold": cap}, forward_only=True))
        lp = [np.asarray(o["logprobs"]["data"], np.float64) for o in out["loss_fn_outputs"]]
        want = reference(lp, seqs, advs, cap)
        assert out["metrics"]["loss:sum"] == pytest.approx(float(want), rel=1e-5)
    ratios = np.concatenate([np.exp(x[len(PROMPT) - 1:] - s["logprobs"]) for x, s in zip(lp, seqs)])
    assert (ratios > 2).any() and (ratios < 1).any(), "the cap must bind somewhere for this test to mean anything"
    # the gradient: -sg(min(r, 2)) A dlogp, that of cross_entropy with weights min(r, 2) * A on the sampled targets
    adapter = backend._models[mid]
    run(c, sr_body(mid, next(seq), datums))
    got = [adapter.A.grad.clone(), adapter.B.grad.clone()]
    adapter.A.grad = adapter.B.grad = None
    weighted = []
    for d, x, s, a in zip(datums, lp, seqs, advs):
        w = np.minimum(np.exp(x[len(PROMPT) - 1:] - np.asarray(s["logprobs"], np.float64)), 2.0) * a
        weighted.append({"tokens": d["tokens"], "target_tokens": d["target_tokens"],
                         "weights": [0.0] * (len(PROMPT) - 1) + w.tolist()})
    run(c, sr_body(mid, next(seq), weighted, loss="cross_entropy"))
    # fp32 rounding apart: the weights here come from float64 log-probs, the loss's from the server's fp32 ones
    # (one element of 128 differed by 9e-5 relative on a loaded CI machine); an uncapped or unweighted ratio
    # moves the gradient by its own size
    for g, want in zip(got, (adapter.A.grad, adapter.B.grad)):
        torch.testing.assert_close(g, want, rtol=5e-4, atol=1e-6)
    assert float(got[1].abs().max()) > 0


def test_a_datum_naming_another_tenants_sequence_fails_that_request_alone(trained):
    c, _, _, mid, seqs = trained
    _, bob_model = new_model(c, B)
    body = sr_body(bob_model, 1, [rl_datum(seqs[0], 1.0)])
    err = run(c, body, B)
    assert err["category"] == "user" and "not found among this tenant's recorded sequences" in err["error"], err
    assert seqs[0]["id"] in err["error"] and "alice" not in err["error"]
    # bob's model goes on: his next request runs, and alice's sequence still trains alice's model
    assert "loss:sum" in run(c, sr_body(bob_model, 2, [{"tokens": [1, 2], "target_tokens": [2, 3],
                                                         "weights": [1.0, 1.0]}], loss="cross_entropy"), B)["metrics"]
    assert "loss:sum" in run(c, sr_body(mid, 4, [rl_datum(seqs[0], 1.0)]))["metrics"]


def test_unrecorded_unknown_and_other_sessions_sequences_are_refused_by_name(trained):
    c, _, sid, mid, seqs = trained
    ss = sampler_of(c, sid, mid, 4, seq=1)
    plain = sample(c, ss, 0, record=False)[0]  # sampled without record_stability_info: nothing recorded
    other_sid, other_mid = new_model(c)  # alice's second session
    cases = [(mid, rl_datum(plain, 1.0), ["not found", "record_stability_info=True"]),
             (mid, rl_datum(seqs[0], 1.0, sequence_id="req-0-00000000:0"), ["'req-0-00000000:0'", "not found"]),
             (mid, rl_datum(seqs[0], 1.0, sequence_id=seqs[0]["id"].split(":")[0] + ":9"), ["not found"]),
             (other_mid, rl_datum(seqs[0], 1.0), [f"sampled by session {sid}", "belong to the session"])]
    seq = {mid: 5, other_mid: 1}
    for model, datum, words in cases:
        err = run(c, sr_body(model, seq[model], [datum]))
        seq[model] += 1
        assert err["category"] == "user" and all(w in err["error"] for w in words), (words, err)
        assert "data[0].model_input_spans[0]" in err["error"], err


N = len(PROMPT) + T - 1  # a datum's positions
BAD = [  # (the datum's changes, given the datum and its sequence id; config; the words of its error)
    (lambda d, x: {"targets": [(False, x, 1, 2), (True, x, 0, T - 1)]}, {},
     [f"loss_fn_input_spans cover {N - 1} positions; the datum has {N}"]),
    (lambda d, x: {"target_tokens": d["target_tokens"][:3] + [(d["target_tokens"][3] + 1) % 32] + d["target_tokens"][4:]},
     {}, ["loss_fn_input_spans[1]", "target_tokens[3] is token"]),
    (lambda d, x: {"advantages": [0.5] + d["advantages"][1:]}, {}, ["advantages[0] is 0.5 on a prompt run",
                                                                   "sampled tokens only"]),
    (lambda d, x: {"inputs": [(False, x, 1, 3), (True, x, 0, T - 1)]}, {}, ["names positions [1, 4)",
                                                                           "prompt, which has 3 tokens"]),
    (lambda d, x: {"inputs": [], "targets": []}, {}, ["data[0] has no provenance", "with_provenance"]),
    (lambda d, x: {}, {"kl_coeff": 0.01}, ["kl_coeff", "no KL term"]),
    (lambda d, x: {}, {"clip_high_threshold": 0.5}, ["clip_high_threshold", "at least 1"]),
    (lambda d, x: {}, {"clip_low_threshold": 0.5}, ["accepted: ['clip_high_threshold', 'kl_coeff', 'score_weighted']"]),
    (lambda d, x: {"weights": [1.0] * N}, {}, ["has ['weights'], which stable_reinforce does not use"]),
]


@pytest.mark.parametrize("changes, config, words", BAD, ids=[b[2][0][:32] for b in BAD])
def test_provenance_or_config_that_does_not_fit_fails_by_name_and_the_model_goes_on(trained, changes, config, words):
    c, _, _, mid, seqs = trained
    datum = rl_datum(seqs[1], 1.0)
    err = run(c, sr_body(mid, 4, [{**datum, **changes(datum, seqs[1]["id"])}], config=config))
    assert err["category"] == "user" and all(w in err["error"] for w in words), (words, err)
    assert "loss:sum" in run(c, sr_body(mid, 5, [datum]))["metrics"]


def test_a_session_that_ends_drops_its_records_and_the_snapshot_counts_them(trained):
    c, _, sid, mid, seqs = trained
    svc = c.app.state.service
    assert svc.snapshot("alice")["tenants"]["alice"]["recorded_sequences"] == len(seqs)
    assert svc.snapshot("alice")["tenants"]["alice"]["recorded_bytes"] > 0
    svc.finish("alice", sid)
    assert svc.records.usage("alice") == (0, 0)
    with pytest.raises(RecordError, match="no longer recorded: its session finished"):
        svc.records.get("alice", sid, seqs[0]["id"], "here")


def test_a_sample_over_the_tenants_record_limit_fails_saying_so(tmp_path):
    c, _ = make(tmp_path, tenant_limits={"alice": Limits(recorded_sequences=2)})  # the key file's [limits.alice]
    with c:
        sid, mid = new_model(c)
        ss = sampler_of(c, sid, mid, 1)
        r = post(c, "asample", {"sampling_session_id": ss, "seq_id": 0, "num_samples": 3, "record_stability_info": True,
                                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                                "sampling_params": {"max_tokens": 2, "seed": 1}}).json()
        err = result(c, r["request_id"])
        assert err["category"] == "user" and "over a tenant's limit of recorded sequences (2 sequences" in err["error"]
        assert "limits.recorded_sequences" in err["error"]
        assert len(sample(c, ss, 1, n=2)) == 2  # within the limit it records and answers
        bob_sid, bob_mid = new_model(c, B)  # bob keeps the default limits
        assert len(sample(c, sampler_of(c, bob_sid, bob_mid, 1, key=B), 0, n=3, key=B)) == 3


# -- the records alone --------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def seqs_of(n: int, length: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.arange(length) + i, -np.ones(length) * (i + 1)) for i in range(n)]


def test_a_record_lives_a_day_after_its_last_use():
    clock = Clock()
    rec = Records(keep_s=100.0, clock=clock)
    rec.record("alice", "s1", "r1", np.array([1, 2]), seqs_of(2))
    rec.record("alice", "s1", "r2", np.array([1, 2]), seqs_of(1))
    clock.t += 90
    rec.get("alice", "s1", "r1:1", "here")  # a use restarts r1's day
    clock.t += 20  # r2 unused for 110 s, r1 for 20 s
    assert rec.expire() == 1 and rec.usage("alice")[0] == 2
    with pytest.raises(RecordError, match="'r2:0' is no longer recorded: no training request used it for 100 s"):
        rec.get("alice", "s1", "r2:0", "here")
    clock.t += 100
    assert rec.expire() == 1 and rec.usage("alice") == (0, 0)


def test_records_are_bounded_per_tenant_least_recently_used_first():
    rec = Records(lambda tenant: Limits(recorded_sequences=4))
    rec.record("alice", "s1", "r1", np.array([1]), seqs_of(2))
    rec.record("alice", "s1", "r2", np.array([1]), seqs_of(2))
    rec.record("bob", "s2", "b1", np.array([1]), seqs_of(4))  # another tenant's count is its own
    rec.get("alice", "s1", "r1:0", "here")  # r1 used last: r2 goes first
    rec.record("alice", "s1", "r3", np.array([1]), seqs_of(1))
    assert rec.usage("alice")[0] == 3 and rec.usage("bob")[0] == 4
    with pytest.raises(RecordError, match="more than 4 recorded sequences"):
        rec.get("alice", "s1", "r2:0", "here")
    with pytest.raises(RecordError, match="not found"):  # bob's drop reasons are not alice's to read
        rec.get("alice", "s1", "b1:0", "here")
    rec.record("alice", "s1", "r4", np.array([1]), seqs_of(1))
    assert rec.usage("alice")[0] == 4
    nbytes = Records(lambda tenant: Limits(recorded_bytes=100))
    with pytest.raises(RecordError, match="over a tenant's limit"):
        nbytes.record("alice", "s1", "big", np.arange(30), seqs_of(1))


def test_behaviour_log_probs_follow_the_runs_over_two_turns():
    """A two-turn datum (the cookbook's trajectory_to_data): turn 1's prompt and sampled tokens, turn 2's new
    prompt tokens (positions of its request's prompt) and sampled tokens; each sampled target gets its own
    sequence's recorded log-prob, prompt targets 0."""
    rec = Records()
    rec.record("t", "s", "a", np.array([5, 6]), [(np.array([7, 8]), np.array([-0.1, -0.2]))])
    rec.record("t", "s", "b", np.array([5, 6, 7, 8, 9]), [(np.array([10, 11]), np.array([-0.3, -0.4]))])
    full = [5, 6, 7, 8, 9, 10, 11]
    runs = [Span(False, "a:0", 0, 2), Span(True, "a:0", 0, 2), Span(False, "b:0", 4, 1), Span(True, "b:0", 0, 2)]
    inputs = runs[:-1] + [Span(True, "b:0", 0, 1)]
    targets = [Span(False, "a:0", 1, 1)] + runs[1:]
    q = behaviour_logprobs(np.array(full[:-1]), np.array(full[1:]), np.array([0, 1, 1, 0, 1, 1.0]),
                           Provenance(tuple(inputs), tuple(targets)),
                           lambda sid, where: rec.get("t", "s", sid, where), "data[0]")
    np.testing.assert_allclose(q, [0, -0.1, -0.2, 0, -0.3, -0.4], rtol=1e-6)


# -- the official SDK, on the cookbook's rl_loop datums ---------------------------------------------------------
@pytest.mark.skipif(not CLIENT_PY.exists(), reason="no .venv-tinker: `make tinker-client` builds the official SDK's "
                    "environment this test drives (`make test` does it first)")
def test_the_sdk_trains_the_cookbooks_rl_loop_datums_and_another_tenant_cannot(tiny_model_dir, tmp_path):
    app = create_app(ServeConfig(out=tmp_path, api_keys=KEYS), fake_from_model_dir(tiny_model_dir))
    with ServerThread(app) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
        env.update(TINKER_BASE_URL=server.url, TINKER_API_KEY="tml-alice-0123456789", TINKER_TELEMETRY="0",
                   OTHER_TENANT_KEY="tml-bob-0123456789", MODEL=str(tiny_model_dir), HF_HUB_OFFLINE="1")
        p = subprocess.run([*CLIENT_RUN, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
    lines = [x for x in p.stdout.splitlines() if x.startswith("SR ")]
    assert p.returncode == 0 and lines, f"client failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    found = json.loads(lines[-1][3:])
    assert found["loss_after_step"] != pytest.approx(found["loss"])  # trained, and still trainable off-policy
    for what, words in (("unrecorded", ["not found", "record_stability_info=True"]),
                        ("other_tenant", ["not found", found["sequence_ids"][0]])):
        e = found[what]
        assert e["type"] == "RequestFailedError" and "user" in e["category"].lower(), e
        assert all(w in e["message"] for w in words), (what, e)
    assert found["after_unrecorded"] == pytest.approx(found["loss_after_step"], abs=1e-5)
    assert np.isfinite(found["other_goes_on"])
