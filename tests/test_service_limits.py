"""Per-tenant limits from the keys file, auth before any body, and who sees which statistics
(colora/service/config.py, service.py, checkpoints.py, samplers.py, app.py)."""

from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from test_service_http import ADMIN, A, B, MODEL, GatedSampling, fb, fb_body, make, new_model, post, result

from colora.service.config import Limits, ServeConfig, ServeConfigError, load_api_keys, load_key_file


def refused(r, status: int, limit: str, value: int, count: int) -> None:
    """A refusal by a limit: its status and a body naming the limit, its value and the tenant's count."""
    body = r.json()
    assert r.status_code == status and body["category"] == "user", r.text
    assert (body["limit"], body["value"], body["count"]) == (limit, value, count), body
    assert f"limits.{limit} = {value}" in body["error"], body


def test_the_key_file_sets_limits_per_tenant_and_admin_keys_and_old_files_stay_valid(tmp_path):
    f = tmp_path / "keys.toml"
    f.write_text('[keys]\n"tml-alice-1234" = "alice"\n')
    old = load_key_file(f)
    assert old.keys == {"tml-alice-1234": "alice"} and old.limits == Limits() and not old.admin_keys
    f.write_text('[keys]\n"tml-alice-1234" = "alice"\n"tml-bob-12345" = "bob"\n\n[admin]\nkeys = ["tml-ops-1234"]\n\n'
                 '[limits]\nmodels = 2\ndisk_bytes = 1_000\n\n[limits.bob]\nmodels = 5\n')
    kf = load_key_file(f)
    assert kf.admin_keys == {"tml-ops-1234"} and load_api_keys(f) == kf.keys
    config = ServeConfig(out=tmp_path, api_keys=kf.keys, admin_keys=kf.admin_keys, limits=kf.limits,
                         tenant_limits=kf.tenant_limits)
    assert config.limits_of("alice").models == 2 and config.limits_of("bob").models == 5
    assert config.limits_of("bob").disk_bytes == 1_000  # a tenant's table starts from [limits]
    assert config.is_admin("tml-ops-1234") and config.tenant_of("tml-ops-1234") is None
    for text, words in (('[limits]\nmodel = 2\n', "unknown limit(s) ['model']"),
                        ('[limits]\nmodels = 0\n', "limits.models (0)"),
                        ('[limits.bob]\nsamplers = "many"\n', "limits.samplers ('many')"),
                        ('[admin]\nkeys = ["secret"]\n', "tml-")):
        f.write_text('[keys]\n"tml-alice-1234" = "alice"\n' + text)
        with pytest.raises(ServeConfigError) as e:
            load_key_file(f)
        assert words in str(e.value) and str(f) in str(e.value), str(e.value)


def test_quotas_of_sessions_models_and_samplers_answer_403_naming_the_limit(tmp_path):
    c, _ = make(tmp_path, limits=Limits(sessions=2, models=1, samplers=1), tenant_limits={"bob": Limits(models=3)})
    with c:
        s1 = post(c, "create_session", {}).json()["session_id"]
        post(c, "create_session", {})
        refused(post(c, "create_session", {}), 403, "sessions", 2, 2)
        model = {"session_id": s1, "model_seq_id": 0, "base_model": MODEL, "lora_config": {"rank": 4}}
        first = post(c, "create_model", model).json()
        refused(post(c, "create_model", {**model, "model_seq_id": 1}), 403, "models", 1, 1)
        assert post(c, "create_model", model).json()["request_id"] == first["request_id"]  # a retry: no new model
        sb = [new_model(c, B)[0] for _ in range(3)]  # bob's own table allows him 3
        refused(post(c, "create_model", {**model, "session_id": sb[0], "model_seq_id": 1}, B), 403, "models", 3, 3)
        assert "model_id" in result(c, first["request_id"])
        post(c, "create_sampling_session", {"session_id": s1, "sampling_session_seq_id": 0, "base_model": MODEL})
        refused(post(c, "create_sampling_session", {"session_id": s1, "sampling_session_seq_id": 1,
                                                    "base_model": MODEL}), 403, "samplers", 1, 1)
        post(c, f"sessions/{s1}/finish", {})  # its model and sampler go: the quota has room again
        s3 = post(c, "create_session", {}).json()["session_id"]
        r = post(c, "create_model", {**model, "session_id": s3})
        assert r.status_code == 200 and "model_id" in result(c, r.json()["request_id"])


def test_checkpoint_quotas_refuse_a_save_with_403_and_the_model_goes_on(tmp_path):
    c, _ = make(tmp_path, limits=Limits(checkpoints=1))
    with c:
        _, mid = new_model(c)
        assert "path" in result(c, post(c, "save_weights", {"model_id": mid, "seq_id": 1, "path": "a"}).json()
                                ["request_id"])
        refused(post(c, "save_weights", {"model_id": mid, "seq_id": 2, "path": "b"}), 403, "checkpoints", 1, 1)
        assert "loss:sum" in result(c, fb(c, fb_body(mid, 3)).json()["request_id"])["metrics"]  # seq 2 took its slot
        again = post(c, "save_weights", {"model_id": mid, "seq_id": 4, "path": "a", "overwrite": True}).json()
        assert "path" in result(c, again["request_id"])  # replacing one it holds adds nothing
    c, _ = make(tmp_path / "disk", limits=Limits(disk_bytes=1000))
    with c:
        _, mid = new_model(c)
        result(c, post(c, "save_weights", {"model_id": mid, "seq_id": 1, "path": "a"}).json()["request_id"])
        held = c.app.state.service.store.usage("alice")[1]
        assert held > 1000
        refused(post(c, "save_weights_for_sampler", {"model_id": mid, "seq_id": 2, "path": "s"}), 403, "disk_bytes",
                1000, held)


def test_backlogs_answer_429_take_no_slot_and_pass_once_drained(tmp_path):
    c, backend = make(tmp_path, limits=Limits(seq_window=4, pending_requests=2, pending_bytes=10**6))
    with c:
        _, mid = new_model(c)
        refused(fb(c, fb_body(mid, 6)), 429, "seq_window", 4, 5)  # next is 1: 1 + 4 is the farthest
        backend.gate.clear()
        busy = fb(c, fb_body(mid, 1)).json()["request_id"]
        assert backend.waiting.wait(10)
        queued = [fb(c, fb_body(mid, seq)).json()["request_id"] for seq in (2, 3)]
        refused(fb(c, fb_body(mid, 4)), 429, "pending_requests", 2, 2)
        backend.gate.set()
        for rid in [busy, *queued]:
            result(c, rid)
        r = fb(c, fb_body(mid, 4))  # the same request again, as the SDK retries a 429: it runs
        assert "loss:sum" in result(c, r.json()["request_id"])["metrics"]


def test_a_tenants_pending_bytes_are_bounded_across_its_models(tmp_path):
    c, backend = make(tmp_path, limits=Limits(pending_bytes=3000))
    with c:
        _, m1 = new_model(c)
        _, m2 = new_model(c)
        body = fb_body(m1, 2, n_datums=8, n=8)  # about 1.6 kB, waiting for seq 1
        assert 1000 < len(body) < 3000
        fb(c, body)
        r = fb(c, fb_body(m2, 2, n_datums=8, n=8))
        refused(r, 429, "pending_bytes", 3000, len(body))
        assert fb(c, fb_body(m2, 2, n_datums=8, n=8), B).status_code == 404  # bob's limits are bob's (and m2 alice's)


def test_samples_in_flight_are_bounded_per_tenant(tmp_path):
    c, backend = make(tmp_path, backend=GatedSampling, limits=Limits(pending_samples=2))
    with c:
        ss = {}
        for key in (A, B):
            sid = post(c, "create_session", {}, key).json()["session_id"]
            ss[key["X-API-Key"]] = post(c, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                                       "base_model": MODEL}, key).json()[
                "sampling_session_id"]

        def body(key, seq):
            return {"sampling_session_id": ss[key["X-API-Key"]], "seq_id": seq, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "sampling_params": {"max_tokens": 2}}

        backend.sampling.clear()
        ids = [post(c, "asample", body(A, i)).json()["request_id"] for i in range(2)]
        refused(post(c, "asample", body(A, 2)), 429, "pending_samples", 2, 2)
        r = post(c, "asample", body(B, 0), B)
        assert r.status_code == 200, r.text
        other = r.json()["request_id"]  # bob has his own count
        backend.sampling.set()
        for rid, key in ((ids[0], A), (ids[1], A), (other, B)):
            assert "sequences" in result(c, rid, key)
        assert "sequences" in result(c, post(c, "asample", body(A, 2)).json()["request_id"])


def test_every_route_checks_the_key_before_it_reads_the_body(tmp_path):
    c, _ = make(tmp_path)
    with c:
        routes = [(m, r.path) for r in c.app.routes if isinstance(r, APIRoute) for m in r.methods
                  if r.path not in ("/api/v1/healthz", "/healthz")]
        assert len(routes) >= 20
        for method, path in routes:
            url = path.replace("{session_id}", "s1").replace("{model_id}", "m").replace("{checkpoint_id:path}", "w/x") \
                .replace("{sampler_id}", "x")
            r = c.request(method, url, content=b"{not json at all", headers={"Content-Type": "application/json"})
            assert r.status_code == 401 and "X-API-Key" in r.json()["error"], (method, path, r.text)


def test_a_tenant_sees_only_its_own_statistics_and_the_admin_the_whole_server(tmp_path):
    c, _ = make(tmp_path)
    with c:
        new_model(c)
        new_model(c, B)
        mine = c.get("/api/v1/colora/stats", headers=B).json()
        assert list(mine["tenants"]) == ["bob"] and mine["tenants"]["bob"]["models"] == 1
        assert set(mine["server"]) == {"uptime_s", "health"}  # nothing of other tenants, not even sums
        everyone = c.get("/api/v1/colora/stats", headers=ADMIN).json()
        assert set(everyone["tenants"]) == {"alice", "bob"} and everyone["server"]["live_sessions"] == 2
        assert post(c, "create_session", {}, ADMIN).status_code == 401  # the admin key is no tenant
