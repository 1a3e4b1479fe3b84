"""Every refusal belongs to its request: a setting the engine or trainer would refuse fails that request
alone, naming the field, and every request that was recorded (a seq_id slot, a deduplicated asample, a
future) is answered whatever fails after (colora/service/sampling.py, service.py, samplers.py, app.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_service_http import A, B, MODEL, fb, fb_body, make, new_model, post, result

import colora.service.samplers
from colora.config import MAX_TEMPERATURE


def sampler(c, key=A) -> tuple[str, str]:
    sid = post(c, "create_session", {}, key).json()["session_id"]
    ss = post(c, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0, "base_model": MODEL},
              key).json()["sampling_session_id"]
    return sid, ss


def sample_body(ss: str, seq_id, tokens=(1, 2, 3), **params) -> dict:
    return {"sampling_session_id": ss, "seq_id": seq_id, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
            "sampling_params": {"max_tokens": 3, "seed": 1, **params}}


def test_sampling_settings_the_engine_refuses_fail_their_own_request_by_name(tmp_path):
    c, _ = make(tmp_path)
    with c:
        _, ss = sampler(c)
        _, other = sampler(c, B)
        cases = [({"temperature": 2.5}, ["temperature (2.5)", f"[0, {MAX_TEMPERATURE}]"]),
                 ({"temperature": float("nan")}, ["temperature (nan)"]),
                 ({"stop": ["x"] * 65}, ["65 entries", "at most 64"]),
                 ({"stop": ["y" * 2000]}, ["2000 characters"]),
                 ({"stop": ["ok", ""]}, ["empty string"]),
                 ({"stop": [2**64]}, ["token id 18446744073709551616", "[0, 32)"]),
                 ({"stop": [-1]}, ["token id -1"]),
                 ({"top_p": 1.5}, ["top_p (1.5)"]),
                 ({"top_k": -2}, ["top_k (-2)"])]
        for i, (params, words) in enumerate(cases):
            raw = json.dumps(sample_body(ss, i, **params))  # NaN as JSON's clients write it, which httpx refuses
            rid = c.post("/api/v1/asample", content=raw, headers={**A, "Content-Type": "application/json"}).json()[
                "request_id"]
            err = result(c, rid)
            assert err["category"] == "user" and all(w in err["error"] for w in words), (params, err)
        # another tenant's sample beside them, and settings the engine takes, run
        ok = post(c, "asample", sample_body(other, 0), B).json()["request_id"]
        assert len(result(c, ok, B)["sequences"]) == 1
        for i, params in enumerate(({"top_k": 2**40}, {"seed": 2**80}, {"seed": -1}, {"temperature": 0})):
            rid = post(c, "asample", sample_body(ss, 100 + i, **params)).json()["request_id"]
            assert "error" not in result(c, rid), params


def test_a_token_id_beyond_int64_fails_its_sample_and_its_retry_gets_that_answer(tmp_path):
    c, _ = make(tmp_path, poll_hold_s=1.0)
    with c:
        _, ss = sampler(c)
        first = post(c, "asample", sample_body(ss, 7, tokens=(1, 2**63)))
        assert first.status_code == 200, first.text  # not a 500 that the SDK would retry into a lost future
        again = post(c, "asample", sample_body(ss, 7, tokens=(1, 2**63)))
        assert again.json() == first.json()
        for rid in (first.json()["request_id"], again.json()["request_id"]):
            err = result(c, rid)  # answered, not held until 408 for ever
            assert "token id 9223372036854775808" in err["error"] and err["category"] == "user", err


def test_any_exception_after_an_asample_is_recorded_answers_its_future(tmp_path, monkeypatch):
    c, _ = make(tmp_path, poll_hold_s=1.0)
    with c:
        _, ss = sampler(c)

        def broken(*a, **k):
            raise RuntimeError("a bug while building the call")

        monkeypatch.setattr(colora.service.samplers, "build_sample_call", broken)
        r = post(c, "asample", sample_body(ss, 3))
        assert r.status_code == 200
        err = result(c, r.json()["request_id"])
        assert err["category"] == "server" and "a bug while building the call" in err["error"]
        assert post(c, "asample", sample_body(ss, 3)).json() == r.json()  # the retry: the same, answered, future
        svc = c.app.state.service
        assert svc.samplers[ss].inflight == 0 and svc.snapshot("alice")["tenants"]["alice"]["samples_in_flight"] == 0


@pytest.mark.parametrize("route, body, words", [
    ("optim_step", {"adam_params": "fast"}, "adam_params"),
    ("save_weights", {"path": "s", "user_metadata": {"step": 3}}, "user_metadata.step"),
    ("save_weights", {"path": "s", "ttl_seconds": -5}, "ttl_seconds"),
    ("save_weights_for_sampler", {"sampling_session_seq_id": "one"}, "sampling_session_seq_id"),
])
def test_a_body_that_fails_validation_still_takes_its_seq_id_slot(tmp_path, route, body, words):
    c, _ = make(tmp_path)
    with c:
        _, mid = new_model(c)
        bad = post(c, route, {"model_id": mid, "seq_id": 1, **body})
        assert bad.status_code == 200, bad.text
        err = result(c, bad.json()["request_id"])
        assert err["category"] == "user" and words in err["error"], err
        nxt = fb(c, fb_body(mid, 2)).json()["request_id"]
        assert "loss:sum" in result(c, nxt)["metrics"]  # the model went on past the failed slot
        r = post(c, route, {"seq_id": 3, **body})  # no model_id: nothing to slot it in
        assert r.status_code == 400 and "model_id" in r.json()["error"]


def test_a_sampler_checkpoint_of_another_base_model_is_refused_before_anything_is_loaded(tmp_path):
    c, backend = make(tmp_path)
    with c:
        sid, mid = new_model(c)
        r = post(c, "save_weights_for_sampler", {"model_id": mid, "seq_id": 1, "path": "w"}).json()
        path = result(c, r["request_id"])["path"]
        meta = tmp_path / "tenants" / "alice" / mid / "sampler_weights" / "w" / "tinker.json"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "base_model": "Qwen/Qwen3-8B"}))
        loads = []
        backend.load_sampler = lambda d: loads.append(d)
        r = post(c, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0, "model_path": path})
        assert r.status_code == 400 and "Qwen/Qwen3-8B" in r.json()["error"]
        assert loads == [] and backend.live_samplers == 0


def test_create_model_takes_a_lora_seed_of_any_size_and_refuses_oversized_metadata(tmp_path):
    c, backend = make(tmp_path)
    with c:
        sid = post(c, "create_session", {}).json()["session_id"]
        r = post(c, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                     "lora_config": {"rank": 4, "seed": 2**80}}).json()
        assert "error" not in result(c, r["request_id"])
        r = post(c, "create_model", {"session_id": sid, "model_seq_id": 1, "base_model": MODEL,
                                     "user_metadata": {"notes": "x" * 20000}})
        assert r.status_code == 400 and "user_metadata" in r.json()["error"] and "16384" in r.json()["error"]


def test_an_error_answer_names_no_server_path(tmp_path):
    c, _ = make(tmp_path)
    with c:
        _, mid = new_model(c)
        r = post(c, "save_weights", {"model_id": mid, "seq_id": 1, "path": "ck"}).json()
        path = result(c, r["request_id"])["path"]
        (tmp_path / "tenants" / "alice" / mid / "weights" / "ck" / "adapter.pt").unlink()  # a damaged checkpoint
        r = post(c, "load_weights", {"model_id": mid, "seq_id": 2, "path": path, "optimizer": False}).json()
        err = result(c, r["request_id"])["error"]
        assert str(tmp_path) not in err and "/tenants/" not in err and f"tinker://{mid}/weights/ck" in err, err
        assert str(tmp_path) not in json.dumps(c.app.state.service.snapshot(None)["errors"])


def test_datum_counts_and_sizes_are_refused_in_their_slot(tmp_path):
    c, _ = make(tmp_path, max_datums=2)
    with c:
        _, mid = new_model(c)
        ids = [fb(c, fb_body(mid, 1, n_datums=3)).json()["request_id"],
               fb(c, fb_body(mid, 2, n=65)).json()["request_id"],
               fb(c, fb_body(mid, 3, target_tokens=np.array([1, 2, 3, 2**62]))).json()["request_id"]]
        for rid, words in zip(ids, ("max_datums (2)", "max context (64)", "token id 4611686018427387904")):
            assert words in result(c, rid)["error"]
        assert "loss:sum" in result(c, fb(c, fb_body(mid, 4)).json()["request_id"])["metrics"]
