"""What an operator sees: the log's lines, the health answer, unknown routes, the snapshot that the
metrics and status page read, and the wiring of other modules' routes (colora/service/app.py,
errors.py, service.py, usage.py, futures.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from test_service_http import ADMIN, A, B, MODEL, GatedFake, fb, fb_body, make, new_model, post, result

import colora.service.errors as errors_module
from colora.service.app import create_app, request_is_admin, request_tenant
from colora.service.config import ServeConfig
from colora.service.errors import Journal, scrub
from colora.service.futures import failure_answer
from colora.service.scheduler import Outcome

TENANT_KEYS = {"sessions", "models", "samplers", "requests", "errors", "forward_calls", "forward_datums",
               "trained_tokens", "optim_steps", "samples", "sampled_sequences", "sampled_tokens", "queue_depth",
               "pending_bytes", "disk_bytes", "models_detail"}
SERVER_KEYS = {"uptime_s", "cycles", "cycle_seconds_sum", "last_cycle_seconds", "cycle_models_sum",
               "multi_model_cycles", "live_sessions", "futures_pending", "health"}
ERROR_KEYS = {"time", "tenant", "route", "status", "category", "reason"}


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "colora.service"]


def test_the_operators_log_has_a_line_per_session_and_per_refused_or_failed_request(tmp_path, caplog):
    c, _ = make(tmp_path)
    with caplog.at_level(logging.INFO, logger="colora.service"), c:
        sid, mid = new_model(c)
        post(c, f"sessions/{sid}/finish", {})
        quiet = post(c, "create_session", {}, B).json()["session_id"]
        refusal = post(c, "get_info", {"model_id": "nope"}, B)
        assert refusal.status_code == 404
        _, mid2 = new_model(c, B)
        result(c, fb(c, fb_body(mid2, 1, loss="gspo"), B).json()["request_id"], B)
        c.post("/api/v1/create_session", json={}, headers={"X-API-Key": "tml-stranger-1"})
        c.app.state.service.reap(now=1e12)  # every live session's heartbeats have lapsed by then
    log = lines(caplog)
    assert any(f"session {sid} of tenant alice started" in x for x in log)
    assert any(f"session {sid} of tenant alice finished: 1 model(s) deleted" in x for x in log)
    assert any(f"session {quiet} of tenant bob lapsed" in x for x in log)
    assert any("refused get_info of tenant bob (404 user): model 'nope' not found" in x for x in log), log
    assert any("failed forward_backward of tenant bob (200 user): loss_fn 'gspo'" in x for x in log), log
    assert any("refused create_session of tenant (no key) (401 user)" in x for x in log), log


def test_a_tenant_that_repeats_a_bad_request_gets_a_few_lines_a_minute_then_a_sum(monkeypatch, caplog):
    now = [1000.0]
    monkeypatch.setattr(errors_module.time, "time", lambda: now[0])
    j = Journal(keep=5, burst=3, window_s=60)
    with caplog.at_level(logging.INFO, logger="colora.service"):
        for _ in range(10):
            j.record("bob", "asample", 400, "user", "temperature (9.0) must be in [0, 2.0]")
        j.record("alice", "asample", 400, "user", "x")
        now[0] += 61
        j.record("bob", "asample", 400, "user", "again")
    log = lines(caplog)
    assert len([x for x in log if "of tenant bob" in x]) == 4 and "alice" in log[3]
    assert "tenant bob: 7 more refused or failed requests were not logged" in log
    assert j.count("bob") == 11 and [e["reason"] for e in j.recent("bob")] == ["temperature (9.0) must be in "
                                                                               "[0, 2.0]"] * 3 + ["again"]
    assert len(j.recent()) == 5  # the last `keep`, newest last


class Ailing(GatedFake):
    """A backend whose health() the test sets."""

    state = {"status": "ok"}

    def health(self):
        return dict(self.state)


def test_healthz_tells_the_backends_health_and_the_reaper_logs_each_change(tmp_path, caplog):
    c, backend = make(tmp_path, backend=Ailing)
    with caplog.at_level(logging.INFO, logger="colora.service"), c:
        for path in ("/api/v1/healthz", "/healthz"):
            assert c.get(path).json() == {"status": "ok"}
        svc = c.app.state.service
        backend.state = {"status": "restarting", "engine_restarts": 1,
                         "last_engine_error": f"EngineDead: {tmp_path}/samplers/sampler-3 is gone"}
        r = c.get("/api/v1/healthz")
        assert r.status_code == 503 and r.json()["category"] == "server" and r.json()["status"] == "restarting"
        assert "EngineDead: sampler-3 is gone" in r.json()["error"] and str(tmp_path) not in r.text
        svc.reap()
        svc.reap()
        backend.state = {"status": "ok", "engine_restarts": 1}
        svc.reap()
        assert c.get("/healthz").status_code == 200
        assert svc.snapshot(None)["server"]["health"]["engine_restarts"] == 1
    changes = [x for x in lines(caplog) if x.startswith("backend health")]
    assert len(changes) == 2 and "restarting (was ok)" in changes[0] and "ok (was restarting)" in changes[1], changes


def test_an_unknown_route_or_method_answers_the_apis_error_body(tmp_path):
    c, _ = make(tmp_path)
    with c:
        r = c.post("/api/v1/no_such_thing", json={}, headers=A)
        assert r.status_code == 404 and r.json()["category"] == "user" and "no such route" in r.json()["error"]
        r = c.get("/api/v1/asample", headers=A)
        assert r.status_code == 405 and set(r.json()) == {"error", "category"}


def test_the_snapshot_holds_the_contracts_keys_and_counts_what_happened(tmp_path):
    c, _ = make(tmp_path)
    with c:
        sid, mid = new_model(c)
        first = result(c, fb(c, fb_body(mid, 1, n_datums=2, n=4)).json()["request_id"])
        result(c, post(c, "optim_step", {"model_id": mid, "seq_id": 2, "adam_params": {}}).json()["request_id"])
        result(c, fb(c, fb_body(mid, 3)).json()["request_id"])  # a second step's loss, not yet stepped
        snap = post(c, "save_weights_for_sampler", {"model_id": mid, "seq_id": 4, "sampling_session_seq_id": 0}).json()
        ss = result(c, snap["request_id"])["sampling_session_id"]
        out = result(c, post(c, "asample", {"sampling_session_id": ss, "seq_id": 0, "num_samples": 2,
                                            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                            "sampling_params": {"max_tokens": 3, "stop": []}}).json()["request_id"])
        assert len(out["sequences"]) == 2
        post(c, "get_info", {"model_id": "nope"})
        new_model(c, B)
        s = c.app.state.service.snapshot(None)
    assert set(s) == {"tenants", "server", "errors"} and set(s["tenants"]) == {"alice", "bob"}
    t = s["tenants"]["alice"]
    assert TENANT_KEYS <= set(t) and SERVER_KEYS <= set(s["server"])
    assert (t["sessions"], t["models"], t["samplers"], t["requests"], t["errors"]) == (1, 1, 1, 6, 1)
    assert (t["forward_calls"], t["forward_datums"], t["trained_tokens"], t["optim_steps"]) == (2, 3, 12, 1)
    assert (t["samples"], t["sampled_sequences"], t["sampled_tokens"]) == (1, 2, 6)
    assert t["queue_depth"] == 0 and t["pending_bytes"] == 0 and t["disk_bytes"] == 0
    (m,) = t["models_detail"]
    assert (m["model_id"], m["session_id"], m["rank"], m["optim_steps"]) == (mid, sid, 4, 1)
    (step,) = m["recent_losses"]
    assert step[0] == 0 and step[1] == pytest.approx(first["metrics"]["loss:sum"]) and step[2] > 1.7e9
    assert s["server"]["cycles"] >= 3 and s["server"]["live_sessions"] == 2 and s["server"]["futures_pending"] == 0
    assert s["server"]["health"]["status"] == "ok"
    (e,) = s["errors"]
    assert set(e) == ERROR_KEYS and (e["tenant"], e["route"], e["status"]) == ("alice", "get_info", 404)


def test_a_tenants_snapshot_holds_only_its_own_entry_and_errors(tmp_path):
    c, _ = make(tmp_path)
    with c:
        new_model(c)
        post(c, "get_info", {"model_id": "nope"}, B)
        post(c, "get_info", {"model_id": "nope"}, A)
        mine = c.app.state.service.snapshot("bob")
    assert list(mine["tenants"]) == ["bob"] and [e["tenant"] for e in mine["errors"]] == ["bob"]
    assert mine["tenants"]["bob"]["models"] == 0


def test_extra_installers_add_their_routes_to_the_app(tmp_path):
    seen = []

    def wire(app: FastAPI) -> None:
        @app.get("/api/v1/colora/whoami")
        async def whoami(request: Request):
            seen.append(request_is_admin(request))
            return {"tenant": request_tenant(request)}

    config = ServeConfig(out=tmp_path, api_keys={"tml-alice-0000": "alice"}, admin_keys=frozenset(ADMIN.values()))
    with TestClient(create_app(config, GatedFake(MODEL, 32, 0), extra=[wire])) as c:
        assert c.get("/api/v1/colora/whoami", headers=A).json() == {"tenant": "alice"}
        assert c.get("/api/v1/colora/whoami", headers=ADMIN).status_code == 401 and seen == [False, True]


def test_scrub_turns_server_paths_into_tinker_paths_or_names():
    out = Path("/srv/colora/out")
    ck = f"{out}/tenants/alice/s1-ab:train:0/weights"
    for message, clean in [
        (f"No such file: '{ck}/ck/adapter.pt'", "No such file: 'tinker://s1-ab:train:0/weights/ck'"),
        (f"{ck}/.tmp-ck-123456789 holds no saved state (state.pt)", "tinker://s1-ab:train:0/weights/ck holds no "
                                                                   "saved state (state.pt)"),
        (f"the sampler's weights are gone ({out}/samplers/sampler-3)", "the sampler's weights are gone (sampler-3)"),
        ("must be tinker://<model_id>/weights/<name>", "must be tinker://<model_id>/weights/<name>"),
        ("base_model '/data/models/tiny' is served", "base_model '/data/models/tiny' is served"),
        ("at /dev/shm/colora-adapters-1/j/a.safetensors.", "at a.safetensors."),
    ]:
        assert scrub(message, out, ("/data/models/tiny",)) == clean


def test_a_retryable_failure_maps_to_its_answer_in_one_place():
    assert failure_answer(Outcome(error="bad", category="user")) == (200, {"error": "bad", "category": "user"})
    status, body = failure_answer(Outcome(error="the engine restarted", category="server", retry=True))
    assert body == {"error": "the engine restarted", "category": "server"} and status == 410  # the SDK resends
