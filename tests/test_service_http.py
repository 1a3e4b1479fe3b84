"""The service's HTTP layer without the SDK: tenancy, limits, error bodies, long polls, session expiry,
deduplication of retried POSTs and the sharing of a cycle by two tenants' models (colora/service/app.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zstandard
from fastapi.testclient import TestClient

from colora.service import tinker_public_pb2 as pb
from colora.service.app import create_app
from colora.service.config import ServeConfig, ServeConfigError, load_api_keys
from colora.service.fake import FakeBackend

A, B = {"X-API-Key": "tml-alice-0000"}, {"X-API-Key": "tml-bob-00000"}
ADMIN = {"X-API-Key": "tml-admin-0000"}  # reads the whole server's statistics; not a tenant
KEYS = {"tml-alice-0000": "alice", "tml-bob-00000": "bob"}
MODEL = "fake/base/model"


class GatedFake(FakeBackend):
    """A fake whose train_cycle waits while `gate` is clear, so a test can queue work behind a busy trainer."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()

    def train_cycle(self, forward, optim):
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(30)
        return super().train_cycle(forward, optim)


class GatedSampling(GatedFake):
    """Also samples wait while `sampling` is clear."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.sampling = threading.Event()
        self.sampling.set()

    def _sample(self, call):
        self.sampling.wait(30)
        return super()._sample(call)


def eventually(check, timeout: float = 10.0) -> bool:
    """Whether check() becomes true within timeout seconds (the trainer and the reaper are threads)."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def make(tmp_path, backend=GatedFake, **cfg) -> tuple[TestClient, GatedFake]:
    backend = backend(MODEL, vocab_size=32, eos_token_id=0, max_context=64, max_lora_rank=16)
    config = ServeConfig(out=tmp_path, api_keys=KEYS, **{"poll_hold_s": 5.0, "admin_keys": frozenset(ADMIN.values()),
                                                         **cfg})
    return TestClient(create_app(config, backend)), backend


def post(c, path, body, key=A, **kw):
    return c.post(f"/api/v1/{path}", json=body, headers=key, **kw)


def result(c, rid, key=A) -> dict:
    """The future's answer, polled again after a 408 as the SDK does (a loaded machine can take longer than a hold)."""
    end = time.monotonic() + 120
    while (r := post(c, "retrieve_future", {"request_id": rid}, key)).status_code == 408 and time.monotonic() < end:
        pass
    assert r.status_code == 200, r.text
    return r.json()


def new_model(c, key=A, rank=4) -> tuple[str, str]:
    sid = post(c, "create_session", {"tags": [], "sdk_version": "test"}, key).json()["session_id"]
    r = post(c, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                 "lora_config": {"rank": rank}}, key).json()
    return sid, result(c, r["request_id"], key)["model_id"]


def fb_body(model_id: str, seq: int, n_datums: int = 1, loss: str = "cross_entropy", n: int = 4, **inputs) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss)
    for _ in range(n_datums):
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype=np.int32).tobytes()
        arrays = {"target_tokens": np.arange(2, n + 2, dtype=np.int64), "weights": np.ones(n, np.float32), **inputs}
        for name, a in arrays.items():
            d.loss_fn_inputs[name].dense = a.tobytes()
            d.loss_fn_inputs[name].dtype = pb.DTYPE_INT64 if a.dtype == np.int64 else pb.DTYPE_FLOAT32
            d.loss_fn_inputs[name].shape.append(len(a))
    return msg.SerializeToString()


def fb(c, body: bytes, key=A, headers=None):
    return c.post("/api/v1/forward_backward", content=body,
                  headers={**key, "Content-Type": "application/x-protobuf", **(headers or {})})


def test_keys_unknown_missing_and_any_key(tmp_path):
    c, _ = make(tmp_path)
    with c:
        for headers in ({}, {"X-API-Key": "tml-nobody-000"}):
            r = c.post("/api/v1/create_session", json={}, headers=headers)
            assert r.status_code == 401 and r.json()["category"] == "user" and "X-API-Key" in r.json()["error"]
        assert c.get("/api/v1/healthz").json() == {"status": "ok"}  # no key needed
    c, _ = make(tmp_path / "any", allow_any_key=True)
    with c:
        assert post(c, "create_session", {}, {"X-API-Key": "tml-anyone-at-all"}).status_code == 200
        assert post(c, "create_session", {}, {"X-API-Key": "not-tml"}).status_code == 401


def test_a_tenant_cannot_see_or_touch_anothers_model_future_or_checkpoint(tmp_path):
    c, _ = make(tmp_path)
    with c:
        sid, mid = new_model(c)
        rid = fb(c, fb_body(mid, 1)).json()["request_id"]
        assert "loss:sum" in result(c, rid)["metrics"]
        save = post(c, "save_weights", {"model_id": mid, "seq_id": 2, "path": "s1"}).json()
        path = result(c, save["request_id"])["path"]
        for r in (post(c, "get_info", {"model_id": mid}, B), fb(c, fb_body(mid, 3), B),
                  post(c, "optim_step", {"model_id": mid, "seq_id": 3, "adam_params": {}}, B),
                  post(c, "retrieve_future", {"request_id": rid}, B),
                  post(c, "session_heartbeat", {"session_id": sid}, B),
                  c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=B),
                  c.delete(f"/api/v1/training_runs/{mid}/checkpoints/weights/s1", headers=B)):
            assert r.status_code == 404 and "not found" in r.json()["error"], r.text
        sid_b = post(c, "create_session", {}, B).json()["session_id"]
        load = post(c, "load_weights", {"session_id": sid_b, "model_seq_id": 0, "path": path, "optimizer": False}, B)
        assert "not found" in result(c, load.json()["request_id"], B)["error"]
        r = post(c, "create_sampling_session", {"session_id": sid_b, "sampling_session_seq_id": 0,
                                                "model_path": path.replace("/weights/", "/sampler_weights/")}, B)
        assert r.status_code == 404
        assert [x["tinker_path"] for x in c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=A).json()
                ["checkpoints"]] == [path]  # the owner still has it


def test_content_errors_fail_their_request_in_its_slot_naming_the_field(tmp_path):
    c, _ = make(tmp_path, max_datums=3)
    with c:
        _, mid = new_model(c)
        bad = [fb_body(mid, 1, loss="gspo"), fb_body(mid, 2, n_datums=4),
               fb_body(mid, 3, weights=np.ones(3, np.float32)), fb_body(mid, 4, mask=np.ones(4, np.float32)),
               fb_body(mid, 5, target_tokens=np.array([1, 2, 3, 99]))]
        ids = [fb(c, b).json()["request_id"] for b in bad]
        ok = fb(c, fb_body(mid, 6)).json()["request_id"]
        errors = [result(c, r) for r in ids]
        assert all(e["category"] == "user" for e in errors)
        for e, words in zip(errors, (["gspo", "supported: cross_entropy"], ["4 datums", "max_datums (3)"],
                                     ["weights", "3 values for 4"], ["mask"], ["token id 99", "[0, 32)"])):
            assert all(w in e["error"] for w in words), e
        assert "loss:sum" in result(c, ok)["metrics"]  # the model went on after five failed slots
        opt = post(c, "optim_step", {"model_id": mid, "seq_id": 7, "adam_params": {"learning_rate": -1}}).json()
        assert "adam_params.learning_rate (-1" in result(c, opt["request_id"])["error"]
        opt = post(c, "optim_step", {"model_id": mid, "seq_id": 8, "adam_params": {"lr": 0.1}}).json()
        assert "adam_params.lr" in result(c, opt["request_id"])["error"]
        r = fb(c, b"\xff\xff not a protobuf")
        assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]


def test_create_model_refuses_a_rank_over_the_maximum_and_another_base_model(tmp_path):
    c, _ = make(tmp_path)
    with c:
        sid = post(c, "create_session", {}).json()["session_id"]
        r = post(c, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                     "lora_config": {"rank": 64}}).json()
        assert "rank (64)" in result(c, r["request_id"])["error"] and "16" in result(c, r["request_id"])["error"]
        r = post(c, "create_model", {"session_id": sid, "model_seq_id": 1, "base_model": "Qwen/Qwen3-8B"}).json()
        assert "Qwen/Qwen3-8B" in result(c, r["request_id"])["error"]


def test_request_size_limit_and_zstd_bodies(tmp_path):
    c, _ = make(tmp_path, max_request_bytes=4000)
    with c:
        _, mid = new_model(c)
        r = fb(c, fb_body(mid, 1, n_datums=2, n=200))
        assert r.status_code == 413 and "max_request_bytes (4000)" in r.json()["error"]
        small = fb_body(mid, 1, n=8)
        r = fb(c, zstandard.ZstdCompressor().compress(small), headers={"Content-Encoding": "zstd"})
        assert "loss:sum" in result(c, r.json()["request_id"])["metrics"]
        bomb = zstandard.ZstdCompressor().compress(b"\0" * 100_000)
        r = fb(c, bomb, headers={"Content-Encoding": "zstd"})
        assert r.status_code == 413 and "decompressed" in r.json()["error"]


def test_a_poll_is_held_then_answered_408_and_a_retried_post_gets_the_same_future(tmp_path):
    c, _ = make(tmp_path, poll_hold_s=0.2)
    with c:
        _, mid = new_model(c)
        first = fb(c, fb_body(mid, 2)).json()["request_id"]  # waits for seq 1
        assert fb(c, fb_body(mid, 2)).json()["request_id"] == first
        t0 = time.monotonic()
        r = post(c, "retrieve_future", {"request_id": first})
        assert r.status_code == 408 and r.json()["type"] == "try_again" and time.monotonic() - t0 >= 0.2
        fb(c, fb_body(mid, 1))
        assert "loss:sum" in result(c, first)["metrics"]
        r = c.post("/api/v1/retrieve_future", json={"request_id": first},
                   headers={**A, "Accept": "application/x-protobuf"})
        out = pb.ForwardBackwardOutput.FromString(r.content)
        assert r.headers["content-type"] == "application/x-protobuf" and out.loss_fn_outputs[0].num_datums == 1
        assert len(out.loss_fn_outputs[0].fields["logprobs"].data) == 4 * 4  # 4 float32 log-probs


def test_a_retried_create_model_gets_the_first_future_and_makes_one_model(tmp_path):
    c, backend = make(tmp_path)
    with c:
        sid = post(c, "create_session", {}).json()["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
        first, again = post(c, "create_model", body).json(), post(c, "create_model", body).json()
        assert again["request_id"] == first["request_id"]
        assert result(c, first["request_id"])["model_id"] == f"{sid}:train:0"
        assert backend.model_ids == [f"{sid}:train:0"]
        other = post(c, "create_model", {**body, "model_seq_id": 1}).json()
        assert other["request_id"] != first["request_id"] and "error" not in result(c, other["request_id"])
        assert len(backend.model_ids) == 2


def test_two_tenants_models_share_a_cycle_behind_a_busy_trainer(tmp_path):
    c, backend = make(tmp_path)
    with c:
        _, busy = new_model(c)
        _, ma = new_model(c)
        _, mb = new_model(c, key=B)
        backend.gate.clear()
        first = fb(c, fb_body(busy, 1)).json()["request_id"]
        assert backend.waiting.wait(10)  # the trainer is inside this cycle: what follows queues behind it
        ra = fb(c, fb_body(ma, 1)).json()["request_id"]
        rb = fb(c, fb_body(mb, 1), B).json()["request_id"]
        oa = post(c, "optim_step", {"model_id": ma, "seq_id": 2, "adam_params": {}}).json()["request_id"]
        ob = post(c, "optim_step", {"model_id": mb, "seq_id": 2, "adam_params": {}}, B).json()["request_id"]
        backend.gate.set()
        for rid, key in ((first, A), (ra, A), (rb, B), (oa, A), (ob, B)):
            assert "error" not in result(c, rid, key)
        stats = c.get("/api/v1/colora/stats", headers=ADMIN).json()["server"]
        assert stats["multi_model_cycles"] >= 1 and stats["max_optim_steps_per_pass"] == 2, stats
        rows = [r for r in (tmp_path / "stats.jsonl").read_text().splitlines() if ma in r and mb in r]
        assert rows, "no cycle held both tenants' rows"


def test_lapsed_heartbeats_end_the_session_free_its_model_and_release_its_samplers(tmp_path):
    c, backend = make(tmp_path, heartbeat_timeout_s=0.4)
    with c:
        sid, mid = new_model(c)
        snap = post(c, "save_weights_for_sampler", {"model_id": mid, "seq_id": 1, "sampling_session_seq_id": 0}).json()
        assert result(c, snap["request_id"])["sampling_session_id"] == f"{sid}:sample:0"
        assert mid in backend.model_ids and backend.live_samplers == 1
        assert eventually(lambda: mid not in backend.model_ids and backend.live_samplers == 0)
        assert post(c, "session_heartbeat", {"session_id": sid}).status_code == 410
        assert post(c, "get_info", {"model_id": mid}).status_code == 404
        # a model that saved no checkpoint leaves nothing behind: its folder (and record) goes with it
        assert eventually(lambda: not (tmp_path / "tenants" / "alice" / mid).exists())
        assert c.get(f"/api/v1/training_runs/{mid}", headers=A).status_code == 404


def test_sampling_dedupes_by_seq_id_and_checks_its_parameters(tmp_path):
    c, _ = make(tmp_path)
    with c:
        sid = post(c, "create_session", {}).json()["session_id"]
        ss = post(c, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                 "base_model": MODEL}).json()["sampling_session_id"]
        assert c.get(f"/api/v1/samplers/{ss}", headers=A).json()["base_model"] == MODEL
        body = {"sampling_session_id": ss, "seq_id": 0, "num_samples": 2,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                "sampling_params": {"max_tokens": 5, "seed": 1, "stop": [7]}, "prompt_logprobs": True}
        first = post(c, "asample", body).json()
        assert post(c, "asample", body).json() == first and len(first["sample_sequence_ids"]) == 2
        r = c.post("/api/v1/retrieve_future", json={"request_id": first["request_id"]},
                   headers={**A, "Accept": "application/x-protobuf"})
        out = pb.SampleResponse.FromString(r.content)
        assert len(out.sequences) == 2 and np.isnan(np.frombuffer(out.prompt_logprobs, np.float32)[0])
        for s in out.sequences:
            toks = np.frombuffer(s.tokens, np.int32)
            assert len(np.frombuffer(s.logprobs, np.float32)) == len(toks) <= 5
            assert (toks[-1] == 7) == (s.stop_reason == pb.STOP_REASON_STOP) or toks[-1] == 0
        for params, words in (({"max_tokens": 100}, "max_tokens (100)"), ({"max_tokens": 4, "top_p": 0}, "top_p"),
                              ({"max_tokens": 4, "stop": [99]}, "token id 99")):
            r = post(c, "asample", {**body, "seq_id": None, "sampling_params": params}).json()
            assert words in result(c, r["request_id"])["error"]
        r = post(c, "asample", {**body, "seq_id": None, "topk_prompt_logprobs": 2}).json()
        assert "topk_prompt_logprobs" in result(c, r["request_id"])["error"]
        r = post(c, "asample", {**body, "seq_id": 1, "num_samples": 10**9})
        assert r.status_code == 400 and "max_num_samples (128)" in r.json()["error"]


def test_config_and_key_file_errors_name_the_field(tmp_path):
    with pytest.raises(ServeConfigError, match="--api-keys FILE"):
        ServeConfig(out=tmp_path)
    with pytest.raises(ServeConfigError, match="poll_hold_s"):
        ServeConfig(out=tmp_path, allow_any_key=True, poll_hold_s=0)
    f = tmp_path / "keys.toml"
    f.write_text('[keys]\n"tml-alice-1234" = "alice"\n"tml-bob-12345" = "bob"\n')
    assert load_api_keys(f) == {"tml-alice-1234": "alice", "tml-bob-12345": "bob"}
    f.write_text('[keys]\n"secret" = "alice"\n')
    with pytest.raises(ServeConfigError, match="tml-"):
        load_api_keys(f)
    f.write_text('[users]\n')
    with pytest.raises(ServeConfigError, match="unknown table"):
        load_api_keys(f)
