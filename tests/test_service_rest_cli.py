"""The official `tinker` command line (SDK 0.38.0, in .venv-tinker) against `colora serve` on the fake
backend: runs, checkpoints, their download and deletion, and tenancy (colora/service/rest.py).

The server runs in this process on a free port; each `tinker -f json ...` is a subprocess whose JSON
output the tests read. Two tenants' models and checkpoints are made over plain HTTP first. Without
.venv-tinker (`make tinker-client`) the CLI tests skip, saying so; the route tests below them run.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import types
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import colora.service.store as store_module
from colora.service import rest
from colora.service.app import ServerThread, create_app
from colora.service.config import Limits, ServeConfig
from colora.service.errors import ApiError
from colora.service.fake import FakeBackend
from test_service_sdk import CLIENT_RUN

ROOT = Path(__file__).resolve().parents[1]
TINKER = ROOT / ".venv-tinker" / "bin" / "tinker"
ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789"
KEYS = {ALICE: "alice", BOB: "bob"}
MODEL = "fake/base/model"
needs_cli = pytest.mark.skipif(not TINKER.exists(), reason="no .venv-tinker: `make tinker-client` builds the "
                               "official SDK's environment whose `tinker` command these tests run")


def call(c: httpx.Client, key: str, path: str, body: dict) -> dict:
    r = c.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": key})
    assert r.status_code == 200, r.text
    return r.json()


def result(c: httpx.Client, key: str, answer: dict) -> dict:
    r = call(c, key, "retrieve_future", {"request_id": answer["request_id"]})
    assert "error" not in r, r
    return r


def fake() -> FakeBackend:
    return FakeBackend(MODEL, vocab_size=32, eos_token_id=0, max_context=64, max_lora_rank=8)


def model_with_checkpoints(c: httpx.Client, key: str, saves: list[tuple[str, str]]) -> tuple[str, str]:
    """(session_id, model_id) of a new model that saved `saves` [(route, name)] in turn."""
    sid = call(c, key, "create_session", {"tags": [], "sdk_version": "test"})["session_id"]
    mid = result(c, key, call(c, key, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": MODEL,
                                                       "lora_config": {"rank": 4}}))["model_id"]
    for seq, (route, name) in enumerate(saves, start=1):
        result(c, key, call(c, key, route, {"model_id": mid, "seq_id": seq, "path": name}))
    return sid, mid


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server with alice's model (weights/ckpt1, sampler_weights/samp1) and bob's (weights/mine):
    yields (url, out, {name: model_id}, {name: session_id})."""
    out = tmp_path_factory.mktemp("serve")
    config = ServeConfig(out=out, api_keys=KEYS, poll_hold_s=5.0)
    app = create_app(config, fake(), extra=[rest.install])
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        a_sid, a = model_with_checkpoints(c, ALICE, [("save_weights", "ckpt1"), ("save_weights_for_sampler", "samp1")])
        b_sid, b = model_with_checkpoints(c, BOB, [("save_weights", "mine")])
        yield server.url, out, {"alice": a, "bob": b}, {"alice": a_sid, "bob": b_sid}


def tinker(url: str, key: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
    env.update(TINKER_BASE_URL=url, TINKER_API_KEY=key, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    return subprocess.run([*CLIENT_RUN, "tinker.cli.__main__", "-f", "json", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=180)


def ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"tinker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


@needs_cli
def test_run_list_and_info_show_the_tenants_own_runs(served):
    url, _, models, _ = served
    runs = {r["training_run_id"]: r for r in ok(tinker(url, ALICE, "run", "list"))["runs"]}
    assert models["alice"] in runs and models["bob"] not in runs  # (a download adds a run of alice's)
    assert {r["model_owner"] for r in runs.values()} == {"alice"}
    assert runs[models["alice"]]["lora_rank"] == 4 and runs[models["alice"]]["base_model"] == MODEL
    info = ok(tinker(url, ALICE, "run", "info", models["alice"]))
    assert info["last_checkpoint"]["tinker_path"] == f"tinker://{models['alice']}/weights/ckpt1"
    assert info["last_sampler_checkpoint"]["tinker_path"] == f"tinker://{models['alice']}/sampler_weights/samp1"
    assert models["alice"] not in {r["training_run_id"] for r in ok(tinker(url, BOB, "run", "list"))["runs"]}
    other = tinker(url, BOB, "run", "info", models["alice"])
    assert other.returncode != 0 and "not found" in other.stderr.lower()


@needs_cli
def test_checkpoint_list_and_info(served):
    url, _, models, _ = served
    a = models["alice"]
    mine = {c["tinker_path"] for c in ok(tinker(url, ALICE, "checkpoint", "list"))["checkpoints"]}
    assert {f"tinker://{a}/weights/ckpt1", f"tinker://{a}/sampler_weights/samp1"} <= mine
    assert not any(models["bob"] in p for p in mine)
    info = ok(tinker(url, ALICE, "checkpoint", "info", f"tinker://{a}/weights/ckpt1"))
    assert info["checkpoint_type"] == "training" and info["tinker_path"] == f"tinker://{a}/weights/ckpt1"


@needs_cli
def test_checkpoint_download_brings_the_adapter_and_another_tenant_finds_nothing(served, tmp_path):
    url, out, models, _ = served
    a = models["alice"]
    path = f"tinker://{a}/weights/ckpt1"
    proc = tinker(url, ALICE, "checkpoint", "download", path, "-o", str(tmp_path / "dl"))
    got = ok(proc)
    assert "Warning" not in proc.stderr, proc.stderr  # its temporary export was deleted, as the CLI asked
    assert not list(out.glob("tenants/alice/*/external_weights/download"))
    folder = Path(got["destination"])
    assert folder == tmp_path / "dl" / path.replace("tinker://", "").replace("/", "_")
    assert sorted(f.name for f in folder.iterdir()) == ["sampler.pt"]  # the fake backend's sampler format
    exported = torch.load(folder / "sampler.pt")
    saved = torch.load(out / "tenants" / "alice" / a / "weights" / "ckpt1" / "adapter.pt")
    assert torch.equal(exported["A"], saved["A"]) and torch.equal(exported["B"], saved["B"])

    refused = tinker(url, BOB, "checkpoint", "download", path, "-o", str(tmp_path / "bob"))
    assert refused.returncode != 0 and "not found" in refused.stderr.lower()
    assert not any((tmp_path / "bob").rglob("*.pt"))
    info = tinker(url, BOB, "checkpoint", "info", path)
    assert info.returncode != 0 and "not found" in (info.stdout + info.stderr).lower()


@needs_cli
def test_checkpoint_delete_removes_only_what_it_names(served):
    url, _, models, _ = served
    b = models["bob"]
    refused = ok(tinker(url, ALICE, "checkpoint", "delete", "-y", f"tinker://{b}/weights/mine"))
    assert refused["deleted_count"] == 0 and len(refused["failed"]) == 1
    deleted = ok(tinker(url, BOB, "checkpoint", "delete", "-y", f"tinker://{b}/weights/mine"))
    assert deleted == {"deleted_count": 1, "failed": []}
    assert ok(tinker(url, BOB, "checkpoint", "list", "--run-id", b))["checkpoints"] == []


# -- the routes themselves, over HTTP --------------------------------------------------------------

def later(monkeypatch, seconds: float) -> None:
    """The store's clock (what its expiry reads) `seconds` ahead."""
    now = time.time() + seconds
    monkeypatch.setattr(store_module, "time", types.SimpleNamespace(time=lambda: now, monotonic_ns=time.monotonic_ns))


def listed(c, mid: str) -> dict[str, dict]:
    cps = c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers={"X-API-Key": ALICE}).json()["checkpoints"]
    return {x["checkpoint_id"]: x for x in cps}


def test_an_export_is_a_checkpoint_listed_counted_under_the_quota_expired_and_deleted(tmp_path, monkeypatch):
    config = ServeConfig(out=tmp_path, api_keys=KEYS, poll_hold_s=5.0, tenant_limits={"alice": Limits(checkpoints=3)})
    with TestClient(create_app(config, fake(), extra=[rest.install])) as c:
        _, mid = model_with_checkpoints(c, ALICE, [("save_weights", "a")])
        export = result(c, ALICE, call(c, ALICE, "save_weights_external",
                                       {"model_id": mid, "seq_id": 2, "path": "e", "ttl_seconds": 3600}))
        e = listed(c, mid)["external_weights/e"]
        assert e["checkpoint_type"] == "external" and e["tinker_path"] == export["path"] == f"tinker://{mid}/external_weights/e"
        assert e["size_bytes"] == export["size_bytes"] > 0 and e["expires_at"] is not None
        assert f"tinker://{mid}/external_weights/e" in {x["tinker_path"] for x in c.get(
            "/api/v1/checkpoints", headers={"X-API-Key": ALICE}).json()["checkpoints"]}
        mine = c.get("/api/v1/colora/stats", headers={"X-API-Key": ALICE}).json()["tenants"]["alice"]
        assert mine["checkpoints"] == 2 and mine["disk_bytes"] == sum(x["size_bytes"] for x in listed(c, mid).values())
        result(c, ALICE, call(c, ALICE, "save_weights", {"model_id": mid, "seq_id": 3, "path": "b"}))
        refused = c.post("/api/v1/save_weights", json={"model_id": mid, "seq_id": 4, "path": "c"},
                         headers={"X-API-Key": ALICE})
        assert refused.status_code == 403 and refused.json()["limit"] == "checkpoints" and refused.json()["count"] == 3

        later(monkeypatch, 3601)  # the export's ttl_seconds pass: the reaper deletes it, the others stay
        c.app.state.service.reap()
        assert sorted(listed(c, mid)) == ["weights/a", "weights/b"]
        result(c, ALICE, call(c, ALICE, "save_weights_external", {"model_id": mid, "seq_id": 5, "path": "e2"}))
        gone = f"/api/v1/training_runs/{mid}/checkpoints/external_weights/e2"
        assert c.delete(gone, headers={"X-API-Key": BOB}).status_code == 404
        assert c.delete(gone, headers={"X-API-Key": ALICE}).status_code == 204
        assert sorted(listed(c, mid)) == ["weights/a", "weights/b"]
        assert c.app.state.service.store.usage("alice")[0] == 2


def test_a_ttl_set_on_a_training_or_sampler_checkpoint_expires_it(tmp_path, monkeypatch):
    with TestClient(create_app(ServeConfig(out=tmp_path, api_keys=KEYS, poll_hold_s=5.0), fake(),
                               extra=[rest.install])) as c:
        _, mid = model_with_checkpoints(c, ALICE, [("save_weights", "a"), ("save_weights_for_sampler", "s"),
                                                   ("save_weights", "keep")])
        runs = f"/api/v1/training_runs/{mid}/checkpoints"
        for cid, ttl in (("weights/a", 3600), ("sampler_weights/s", 7200), ("weights/keep", 3600),
                         ("weights/keep", None)):
            assert c.put(f"{runs}/{cid}/ttl", json={"ttl_seconds": ttl}, headers={"X-API-Key": ALICE}).status_code == 204
        assert c.put(f"{runs}/weights/a/ttl", json={"ttl_seconds": 3600}, headers={"X-API-Key": BOB}).status_code == 404
        missing = c.put(f"{runs}/weights/nothing/ttl", json={"ttl_seconds": 3600}, headers={"X-API-Key": ALICE})
        assert missing.status_code == 404 and "not found" in missing.json()["error"]
        assert {k: v["expires_at"] is not None for k, v in listed(c, mid).items()} == {
            "weights/a": True, "sampler_weights/s": True, "weights/keep": False}
        later(monkeypatch, 3601)
        c.app.state.service.reap()
        assert sorted(listed(c, mid)) == ["sampler_weights/s", "weights/keep"]
        later(monkeypatch, 7201)
        c.app.state.service.reap()
        assert sorted(listed(c, mid)) == ["weights/keep"]


def test_a_session_answers_the_metadata_and_name_it_was_created_with(served):
    url = served[0]
    with httpx.Client(base_url=url, timeout=30, headers={"X-API-Key": ALICE}) as c:
        sid = c.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test", "display_name": "sweep 3",
                                                     "user_metadata": {"team": "rl", "lr": "1e-4"}}).json()["session_id"]
        assert c.get(f"/api/v1/sessions/{sid}").json() == {"training_run_ids": [], "sampler_ids": [],
                                                           "user_metadata": {"team": "rl", "lr": "1e-4"},
                                                           "display_name": "sweep 3"}
        assert c.get(f"/api/v1/sessions/{sid}", headers={"X-API-Key": BOB}).status_code == 404


def test_external_weights_urls_are_signed_for_their_tenant_and_checkpoint(served):
    url, _, models, _ = served
    a = models["alice"]
    with httpx.Client(base_url=url, timeout=30) as c:
        sid = call(c, ALICE, "create_session", {"tags": [], "sdk_version": "test"})["session_id"]
        mid = result(c, ALICE, call(c, ALICE, "load_weights", {"session_id": sid, "model_seq_id": 0,
                                                                "path": f"tinker://{a}/weights/ckpt1"}))["model_id"]
        export = result(c, ALICE, call(c, ALICE, "save_weights_external",
                                       {"model_id": mid, "seq_id": 1, "path": "hf"}))
        assert export["path"] == f"tinker://{mid}/external_weights/hf"
        where = f"/api/v1/training_runs/{mid}/checkpoints/external_weights/hf/external_weights_urls"
        signed = c.get(where, headers={"X-API-Key": ALICE}).json()
        assert list(signed["urls"]) == ["sampler.pt"]
        link = signed["urls"]["sampler.pt"]
        assert c.get(link).status_code == 200  # no key: the signature is the credential
        assert c.get(where, headers={"X-API-Key": BOB}).status_code == 404
        token = link.split("/download/")[1].split("/")[0]
        forged = link.replace(token, token[:-1] + ("0" if token[-1] != "0" else "1"))
        assert c.get(forged).status_code == 403
        assert c.get(link.replace("sampler.pt", "tinker.json")).status_code == 404  # the server's record stays
        assert c.get(link.replace("sampler.pt", "../../weights/ckpt1/adapter.pt")).status_code == 404
        runs = f"/api/v1/training_runs/{mid}/checkpoints"
        ttl = c.put(f"{runs}/external_weights/hf/ttl", json={"ttl_seconds": 60}, headers={"X-API-Key": ALICE})
        assert ttl.status_code == 400 and "ttl_seconds (60)" in ttl.json()["error"]
        assert c.put(f"{runs}/external_weights/hf/ttl", json={"ttl_seconds": 7200},
                     headers={"X-API-Key": ALICE}).status_code == 204

        # a body that does not validate still takes its seq_id slot, so the model's next request runs
        bad = call(c, ALICE, "save_weights_external", {"model_id": mid, "seq_id": 2, "path": {"not": "a name"}})
        failed = call(c, ALICE, "retrieve_future", {"request_id": bad["request_id"]})
        assert failed["category"] == "user" and "path" in failed["error"]
        again = result(c, ALICE, call(c, ALICE, "save_weights_external", {"model_id": mid, "seq_id": 3, "path": "hf2"}))
        assert again["path"] == f"tinker://{mid}/external_weights/hf2"


def test_a_signed_url_expires_and_names_what_to_do():
    s = rest.Signer(b"k" * 32)
    token = s.token("alice", "s1:train:0", "external_weights/hf", expires=1000)
    assert s.check(token, now=999.0) == ("alice", "s1:train:0", "external_weights/hf")
    with pytest.raises(ApiError, match="expired"):
        s.check(token, now=1000.0)
    with pytest.raises(ApiError, match="not this server's"):
        rest.Signer(b"j" * 32).check(token, now=0.0)


def test_weights_info_sessions_and_paging(served):
    url, _, models, sessions = served
    a = models["alice"]
    with httpx.Client(base_url=url, timeout=30, headers={"X-API-Key": ALICE}) as c:
        info = c.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{a}/weights/ckpt1"}).json()
        assert info == {"base_model": MODEL, "is_lora": True, "lora_rank": 4, "train_unembed": False,
                        "train_mlp": True, "train_attn": True}
        bad = c.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{a}/other/ckpt1"})
        assert bad.status_code == 400 and "tinker://<run_id>/" in bad.json()["error"]
        assert c.post("/api/v1/weights_info", json={"tinker_path": f"tinker://{models['bob']}/weights/mine"}) \
            .status_code == 404
        assert sessions["alice"] in c.get("/api/v1/sessions").json()["sessions"]
        assert sessions["bob"] not in c.get("/api/v1/sessions").json()["sessions"]
        assert c.get(f"/api/v1/sessions/{sessions['alice']}").json()["training_run_ids"] == [a]
        assert c.get(f"/api/v1/sessions/{sessions['bob']}").status_code == 404
        page = c.get("/api/v1/checkpoints", params={"limit": 1, "offset": 0}).json()
        assert len(page["checkpoints"]) == 1 and page["cursor"]["total_count"] >= 2
        assert page["checkpoints"][0]["time"] >= c.get("/api/v1/checkpoints").json()["checkpoints"][-1]["time"]
        r = c.get("/api/v1/training_runs", params={"limit": "many"})
        assert r.status_code == 400 and r.json() == {"error": "query parameter limit='many' must be an integer "
                                                     "from 1 to 10000", "category": "user"}
        assert c.get("/api/v1/training_runs", headers={"X-API-Key": "tml-nobody-000"}).status_code == 401
