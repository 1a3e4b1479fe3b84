"""loss_fn_config `score_weighted` (colora/service/backend.py `scored_span`): a datum computed over the positions
its loss weighs only gives the same loss, gradient and scored log-probs as the whole datum, 0.0 elsewhere; a
datum that weighs nothing reaches no trainer; any value but 0 or 1 is refused naming the key; colora's own
client asks for it. The fake backend and the real trainer on the tiny model (fp32, no engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_service_http import fb, make, new_model, result

from colora.config import TrainerConfig
from colora.models.base import load_base_model
from colora.service import client as tinker_client
from colora.service import corun
from colora.service import tinker_public_pb2 as pb
from colora.service.backend import AdamParams, BackendError, Datum, ForwardCall, LoraSpec, OptimCall
from colora.service.fake import FakeBackend
from colora.training.lora import AdapterBank, inject_lora
from colora.training.trainer import MultiJobTrainer

ON = {"score_weighted": 1.0}
ADAM = AdamParams(learning_rate=1e-2)


def sft_datum(vocab: int, seed: int) -> Datum:
    """A prompt (weight 0), an answer (weights nonzero, one 0 inside) and padding (weight 0): 14 positions."""
    g = np.random.default_rng(seed)
    tokens = g.integers(1, vocab, 14).astype(np.int64)
    targets = np.concatenate([tokens[1:], [1]]).astype(np.int64)
    w = np.zeros(14, np.float32)
    w[5:10] = [1.0, 0.5, 0.0, 2.0, 1.0]
    return Datum(tokens, {"target_tokens": targets, "weights": w})


def rl_datum(vocab: int, seed: int, advantage: float) -> Datum:
    """A prompt (advantage 0), a completion (advantage `advantage`) and padding (advantage 0): 12 positions."""
    g = np.random.default_rng(seed)
    tokens = g.integers(1, vocab, 12).astype(np.int64)
    targets = np.concatenate([tokens[1:], [1]]).astype(np.int64)
    adv, q = np.zeros(12, np.float32), np.zeros(12, np.float32)
    adv[3:9] = advantage
    q[3:9] = -g.uniform(0.5, 4.0, 6)
    return Datum(tokens, {"target_tokens": targets, "advantages": adv, "logprobs": q})


def weighed(d: Datum) -> np.ndarray:
    """bool [N]: the positions inside the datum's scored span."""
    key = "weights" if "weights" in d.inputs else "advantages"
    nz = np.flatnonzero(d.inputs[key])
    out = np.zeros(len(d.tokens), bool)
    if len(nz):
        out[nz[0]: nz[-1] + 1] = True
    return out


def assert_same_outputs(on, off, datums, atol):
    """on's log-probs equal off's inside each datum's span and are 0.0 outside; the loss sums equal."""
    assert on.metrics["loss:sum"] == pytest.approx(off.metrics["loss:sum"], abs=atol)
    for o_on, o_off, d in zip(on.outputs, off.outputs, datums, strict=True):
        lp_on, lp_off, span = o_on["logprobs"], o_off["logprobs"], weighed(d)
        assert lp_on.dtype == np.float32 and lp_on.shape == lp_off.shape == (len(d.tokens),)
        np.testing.assert_allclose(lp_on[span], lp_off[span], atol=atol, rtol=0)
        assert (lp_on[~span] == 0.0).all() and (lp_off[~span] != 0.0).all()


# -- the fake backend ----------------------------------------------------------------------------
def fake(*models: str) -> FakeBackend:
    b = FakeBackend("fake", vocab_size=16, eos_token_id=0)
    for m in models:
        b.create_model(m, LoraSpec(rank=4, seed=3))
    return b


def fake_params(b: FakeBackend, m: str) -> list[torch.Tensor]:
    return [b._models[m].A.detach().clone(), b._models[m].B.detach().clone()]


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "ppo", "cispo"])
def test_fake_scores_the_weighted_span_with_the_same_loss_gradient_and_logprobs(loss):
    b = fake("on", "off")
    datums = ((sft_datum(16, 1), sft_datum(16, 2)) if loss == "cross_entropy" else
              (rl_datum(16, 1, 0.7), rl_datum(16, 2, -1.3), rl_datum(16, 3, 0.0)))
    cfg = {} if loss in ("cross_entropy", "importance_sampling") else {"clip_low_threshold": 0.8,
                                                                       "clip_high_threshold": 1.2}
    for step in range(2):  # the second step's adapter has B != 0: both A's and B's gradients count
        (on, off), _ = b.train_cycle([ForwardCall("on", step, datums, loss, {**cfg, **ON}),
                                      ForwardCall("off", step, datums, loss, cfg)], [])
        assert_same_outputs(on, off, datums, 1e-5)
        for g_on, g_off in zip((b._models["on"].A.grad, b._models["on"].B.grad),
                               (b._models["off"].A.grad, b._models["off"].B.grad)):
            torch.testing.assert_close(g_on, g_off, atol=1e-5, rtol=1e-5)
        b.train_cycle([], [OptimCall("on", step, ADAM), OptimCall("off", step, ADAM)])
        for p_on, p_off in zip(fake_params(b, "on"), fake_params(b, "off")):
            torch.testing.assert_close(p_on, p_off, atol=1e-5, rtol=1e-5)


def test_fake_a_datum_without_advantage_changes_nothing_and_still_gets_its_outputs():
    b = fake("m")
    before = fake_params(b, "m")
    d = rl_datum(16, 4, 0.0)
    (res,), _ = b.train_cycle([ForwardCall("m", 1, (d,), "importance_sampling", ON)], [])
    assert res.metrics["loss:sum"] == 0.0
    assert res.outputs[0]["logprobs"].shape == (12,) and (res.outputs[0]["logprobs"] == 0.0).all()
    b.train_cycle([], [OptimCall("m", 2, ADAM)])
    for p, q in zip(before, fake_params(b, "m")):
        assert torch.equal(p, q)


@pytest.mark.parametrize("value", [2.0, 0.5, -1.0, float("nan"), "yes", True])
def test_a_value_other_than_0_or_1_is_refused_naming_the_key(value):
    b = fake("m")
    (res,), _ = b.train_cycle([ForwardCall("m", 1, (sft_datum(16, 1),), "cross_entropy",
                                           {"score_weighted": value})], [])
    assert isinstance(res, BackendError) and res.category == "user"
    assert "score_weighted" in res.message and "1.0" in res.message and "0.0" in res.message


def body(model_id: str, seq: int, loss: str, value, **inputs) -> bytes:
    """A forward_backward of one 4-token datum with `inputs` and loss_fn_config score_weighted = value (a
    string goes as loss_fn_config_v2's text, as the SDK sends one)."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss)
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, 5, dtype=np.int32).tobytes()
    for name, a in {"target_tokens": np.arange(2, 6, dtype=np.int64), **inputs}.items():
        d.loss_fn_inputs[name].dense = a.tobytes()
        d.loss_fn_inputs[name].dtype = pb.DTYPE_INT64 if a.dtype == np.int64 else pb.DTYPE_FLOAT32
        d.loss_fn_inputs[name].shape.append(len(a))
    if isinstance(value, str):
        msg.loss_fn_config_v2["score_weighted"].text = value
    else:
        msg.loss_fn_config["score_weighted"] = value
    return msg.SerializeToString()


def test_the_service_accepts_the_key_for_every_loss_and_refuses_a_bad_value_in_its_slot(tmp_path):
    c, _ = make(tmp_path)
    with c:
        _, mid = new_model(c)

        def send(seq, loss, value, **inputs):
            return result(c, fb(c, body(mid, seq, loss, value, **inputs)).json()["request_id"])

        w, adv, q = (np.array([0, 1, 1, 0], np.float32), np.array([0, 1, -2, 0], np.float32),
                     np.full(4, -1.0, np.float32))
        for seq, loss in enumerate(("cross_entropy", "importance_sampling", "ppo", "cispo"), start=1):
            out = send(seq, loss, 1.0, **({"weights": w} if loss == "cross_entropy" else
                                           {"advantages": adv, "logprobs": q}))
            assert "error" not in out, out
            lp = np.asarray(out["loss_fn_outputs"][0]["logprobs"]["data"], np.float32)
            assert lp.shape == (4,) and lp[0] == lp[3] == 0.0 and (lp[1:3] < 0).all(), lp
        for seq, value in ((5, 2.0), (6, "yes")):  # seq_ids go on one by one
            err = send(seq, "cross_entropy", value, weights=w)
            assert err["category"] == "user" and "score_weighted" in err["error"], err


# -- the real trainer (the tiny model, fp32) through CorunBackend's cycle ------------------------
@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    cfg = TrainerConfig(micro_batch_tokens=64, lora_backend="torch", logprob_backend="torch", logprob_chunk=5)
    return MultiJobTrainer(model, bank, cfg, {}, pad_id=0)


class Recording:
    """The trainer's forward_backward, recording the datums each call brought."""

    def __init__(self, trainer):
        self.trainer, self.calls = trainer, []

    def __getattr__(self, name):
        return getattr(self.trainer, name)

    def forward_backward(self, calls):
        self.calls.append(calls)
        return self.trainer.forward_backward(calls)


def adapters(trainer, *names):
    for n in names:
        if n in trainer.bank.jobs:
            trainer.bank.remove_job(n)
        # one init for both (a Tinker model's init is its seed's alone)
        trainer.bank.add_job(n, 4, corun.ALPHA, corun.ATTN + corun.MLP, 11, init_name="tinker")


def weights_of(trainer, name) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.bank.jobs[name].parameters()]


def grads_of(trainer, name) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in trainer.bank.jobs[name].parameters()]


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling"])
def test_trainer_scores_the_weighted_span_only_with_the_same_gradient_and_logprobs(trainer, loss):
    adapters(trainer, "on", "off")
    V = int(trainer.vocab)
    datums = ((sft_datum(V, 1), sft_datum(V, 2)) if loss == "cross_entropy" else
              (rl_datum(V, 1, 0.7), rl_datum(V, 2, -1.3), rl_datum(V, 3, 0.0)))
    rec = Recording(trainer)
    for step in range(2):  # the second step's B != 0: both A's and B's gradients count
        (on, off), _ = corun._cycle(rec, [ForwardCall("on", step, datums, loss, dict(ON)),
                                          ForwardCall("off", step, datums, loss, {})], [])
        assert_same_outputs(on, off, datums, 1e-5)
        for g_on, g_off in zip(grads_of(trainer, "on"), grads_of(trainer, "off")):
            torch.testing.assert_close(g_on, g_off, atol=1e-5, rtol=1e-5)
        _, steps = corun._cycle(rec, [], [OptimCall("on", step, ADAM), OptimCall("off", step, ADAM)])
        assert not any(isinstance(s, BackendError) for s in steps), steps
        for p_on, p_off in zip(weights_of(trainer, "on"), weights_of(trainer, "off")):
            torch.testing.assert_close(p_on, p_off, atol=1e-5, rtol=1e-5)
    # what the trainer read: the span's targets from its first position, no token after its last, and
    # no datum that weighs nothing
    sent_on, sent_off = rec.calls[0][0].datums, rec.calls[0][1].datums
    assert [len(d.tokens) for d in sent_off] == [len(d.tokens) for d in datums]
    scored = [d for d in datums if weighed(d).any()]
    assert len(sent_on) == len(scored)
    for d, s in zip(scored, sent_on):
        span = np.flatnonzero(weighed(d))
        assert s.first == span[0] and len(s.targets) == len(span) and len(s.tokens) == span[-1] + 1
        np.testing.assert_array_equal(s.tokens, d.tokens[: span[-1] + 1])


def test_trainer_a_call_that_weighs_nothing_changes_nothing_and_still_gets_its_outputs(trainer):
    adapters(trainer, "z")
    V = int(trainer.vocab)
    before = weights_of(trainer, "z")
    datums = (rl_datum(V, 5, 0.0), rl_datum(V, 6, 0.0))
    rec = Recording(trainer)
    for forward_only in (True, False):
        (res,), _ = corun._cycle(rec, [ForwardCall("z", 1, datums, "importance_sampling", dict(ON), forward_only)], [])
        assert res.metrics["loss:sum"] == 0.0
        assert [o["logprobs"].tolist() for o in res.outputs] == [[0.0] * 12] * 2
    assert all(len(c.datums) == 0 for calls in rec.calls for c in calls)
    _, (step,) = corun._cycle(trainer, [], [OptimCall("z", 2, ADAM)])
    assert not isinstance(step, BackendError)
    for p, q in zip(before, weights_of(trainer, "z")):
        assert torch.equal(p, q)


def test_trainer_refuses_a_bad_value_in_its_call_alone(trainer):
    adapters(trainer, "bad", "good")
    V = int(trainer.vocab)
    d = (sft_datum(V, 1),)
    (bad, good), _ = corun._cycle(trainer, [ForwardCall("bad", 1, d, "cross_entropy", {"score_weighted": 2.0}),
                                            ForwardCall("good", 1, d, "cross_entropy", dict(ON))], [])
    assert isinstance(bad, BackendError) and bad.category == "user" and "score_weighted" in bad.message
    assert not isinstance(good, BackendError) and good.metrics["loss:sum"] > 0


# -- colora's own client ---------------------------------------------------------------------------
class TrainingClientRecorder:
    """What JobClient sends: forward_backward / forward calls, with their arguments."""

    def __init__(self):
        self.sent = []

    def _record(self, route, data, loss_fn, loss_fn_config=None):
        self.sent.append((route, loss_fn, loss_fn_config, data))
        return Done(None)

    def forward_backward(self, data, loss_fn, loss_fn_config=None):
        return self._record("forward_backward", data, loss_fn, loss_fn_config)

    def forward(self, data, loss_fn, loss_fn_config=None):
        return self._record("forward", data, loss_fn, loss_fn_config)


class Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def test_colora_client_asks_for_score_weighted_with_every_loss_call():
    rec = TrainingClientRecorder()
    tinker_client.forward_backward(rec, ["d"], "importance_sampling")
    tinker_client.forward_backward(rec, ["d"], "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    tinker_client.forward_backward(rec, ["d"], "cross_entropy", forward_only=True)
    assert [(r, f, c) for r, f, c, _ in rec.sent] == [
        ("forward_backward", "importance_sampling", {"score_weighted": 1.0}),
        ("forward_backward", "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "score_weighted": 1.0}),
        ("forward", "cross_entropy", {"score_weighted": 1.0})]


def test_colora_client_sft_step_sends_score_weighted(monkeypatch):
    from colora.training.batches import Datum as NativeDatum

    native = [NativeDatum(np.arange(1, 9), np.arange(2, 9), 0, np.array([0, 0, 0, 1, 1, 1, 0], np.float32))]
    monkeypatch.setattr(tinker_client, "sft_datums", lambda convs: native)
    jc = tinker_client.JobClient.__new__(tinker_client.JobClient)
    jc.step, jc.training = 0, TrainingClientRecorder()
    jc.job = type("Job", (), {"prompts_per_step": 1, "learning_rate": 1e-3, "adam_betas": (0.9, 0.999),
                              "adam_eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0})()
    jc.task = type("Task", (), {"batch": lambda self, step, n: ["conv"]})()
    jc.training.optim_step = lambda params: Done(type("Out", (), {"metrics": {}})())
    jc.training.forward_backward = lambda data, loss_fn, loss_fn_config=None: (
        jc.training.sent.append(("forward_backward", loss_fn, loss_fn_config, data))
        or Done(type("Out", (), {"metrics": {"loss:sum": 1.0}})()))
    jc._sft_step()
    ((route, loss, config, data),) = jc.training.sent
    assert (route, loss, config) == ("forward_backward", "cross_entropy", {"score_weighted": 1.0})
    assert data[0].loss_fn_inputs["weights"].to_numpy().tolist() == [0, 0, 0, 1, 1, 1, 0]


def test_stable_reinforce_takes_the_key_and_a_bad_value_is_refused_while_the_request_is_parsed():
    """The cookbook's default loss accepts score_weighted as the others do (the service passes it to the cispo
    form it trains); a value other than 0 or 1 is refused before the request reaches a cycle."""
    from colora.service import wire
    from colora.service.backend import Capabilities

    caps = Capabilities("m", 64, 16, 8)
    for value, ok in ((1.0, True), (0.0, True), (2.0, False)):
        msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="stable_reinforce")
        msg.loss_fn_config["score_weighted"] = value
        if ok:
            assert wire._loss(msg, caps) == ("stable_reinforce", {"clip_high_threshold": 2.0, "kl_coeff": 0.0,
                                                                  "score_weighted": value})
        else:
            with pytest.raises(wire.InputError, match="score_weighted"):
                wire._loss(msg, caps)
