"""What the service keeps, and for how long: ephemeral samplers, unnamed and expiring checkpoints, the
folders of models that are gone, and what a killed server leaves on disk (colora/service/samplers.py,
checkpoints.py, store.py)."""

from __future__ import annotations

import json
import time
import types

import pytest
from test_service_http import A, MODEL, GatedSampling, eventually, fb, fb_body, make, new_model, post, result

import colora.service.store as store_module
from colora.service.backend import LoraSpec
from colora.service.store import CheckpointError, CheckpointPath, Store, check_name, parse_path


def snapshot_sampler(c, mid: str, seq: int, n: int) -> str:
    r = post(c, "save_weights_for_sampler", {"model_id": mid, "seq_id": seq, "sampling_session_seq_id": n}).json()
    return result(c, r["request_id"])["sampling_session_id"]


def sample(c, ss: str, seq: int):
    return post(c, "asample", {"sampling_session_id": ss, "seq_id": seq, "num_samples": 1,
                               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                               "sampling_params": {"max_tokens": 2}})


def test_a_models_ephemeral_samplers_beyond_the_newest_few_are_released(tmp_path):
    c, backend = make(tmp_path, keep_samplers=2)
    with c:
        _, mid = new_model(c)
        ids = [snapshot_sampler(c, mid, i + 1, i) for i in range(4)]
        assert backend.live_samplers == 2 and set(c.app.state.service.samplers) == set(ids[2:])
        r = sample(c, ids[0], 0)
        assert r.status_code == 404 and "was released: a newer sampler of model" in r.json()["error"]
        assert "sequences" in result(c, sample(c, ids[3], 0).json()["request_id"])


def test_a_superseded_sampler_is_released_only_after_its_sample_in_flight(tmp_path):
    c, backend = make(tmp_path, keep_samplers=1, backend=GatedSampling)
    with c:
        _, mid = new_model(c)
        old = snapshot_sampler(c, mid, 1, 0)
        backend.sampling.clear()
        rid = sample(c, old, 0).json()["request_id"]
        new = snapshot_sampler(c, mid, 2, 1)
        assert backend.live_samplers == 2  # the old one still serves its sample
        assert sample(c, old, 1).status_code == 404  # but takes no new one
        backend.sampling.set()
        assert "sequences" in result(c, rid)
        assert eventually(lambda: backend.live_samplers == 1) and list(c.app.state.service.samplers) == [new]


def test_unnamed_checkpoints_keep_the_newest_few_and_named_ones_stay(tmp_path):
    c, _ = make(tmp_path, keep_checkpoints=2)
    with c:
        _, mid = new_model(c)
        result(c, post(c, "save_weights", {"model_id": mid, "seq_id": 1, "path": "mine"}).json()["request_id"])
        for seq in range(2, 6):
            result(c, post(c, "save_weights", {"model_id": mid, "seq_id": seq}).json()["request_id"])
        listed = c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=A).json()["checkpoints"]
        assert [x["checkpoint_id"] for x in listed] == ["weights/mine", "weights/seq-4", "weights/seq-5"]
        assert [x["automatic"] for x in listed] == [False, True, True]
        assert c.app.state.service.store.usage("alice")[0] == 3


def test_checkpoints_saved_with_a_ttl_expire_unless_a_live_sampler_reads_them(tmp_path, monkeypatch):
    c, _ = make(tmp_path)
    with c:
        sid, mid = new_model(c)
        for seq, (kind, name) in enumerate((("save_weights", "short"), ("save_weights", "kept"),
                                            ("save_weights_for_sampler", "read")), 1):
            ttl = {"ttl_seconds": 60} if name != "kept" else {}
            result(c, post(c, kind, {"model_id": mid, "seq_id": seq, "path": name, **ttl}).json()["request_id"])
        read = f"tinker://{mid}/sampler_weights/read"
        post(c, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0, "model_path": read})
        svc = c.app.state.service
        svc.reap()
        assert len(c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=A).json()["checkpoints"]) == 3
        later = time.time() + 61
        monkeypatch.setattr(store_module, "time", types.SimpleNamespace(time=lambda: later,
                                                                         monotonic_ns=time.monotonic_ns))
        svc.reap()
        listed = c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=A).json()["checkpoints"]
        assert [x["checkpoint_id"] for x in listed] == ["weights/kept", "sampler_weights/read"]
        post(c, f"sessions/{sid}/finish", {})  # the sampler goes with its session: the checkpoint can go
        assert eventually(lambda: not svc.samplers)
        svc.reap()
        listed = c.get(f"/api/v1/training_runs/{mid}/checkpoints", headers=A).json()["checkpoints"]
        assert [x["checkpoint_id"] for x in listed] == ["weights/kept"]


def test_a_deleted_models_folder_goes_with_its_last_checkpoint(tmp_path):
    c, _ = make(tmp_path)
    with c:
        sid, mid = new_model(c)
        result(c, post(c, "save_weights", {"model_id": mid, "seq_id": 1, "path": "a"}).json()["request_id"])
        post(c, f"sessions/{sid}/finish", {})
        folder = tmp_path / "tenants" / "alice" / mid
        assert eventually(lambda: mid not in c.app.state.service.models)
        assert folder.is_dir()  # it holds a checkpoint: the run and its record stay
        assert c.get(f"/api/v1/training_runs/{mid}", headers=A).json()["training_run_id"] == mid
        assert c.delete(f"/api/v1/training_runs/{mid}/checkpoints/weights/a", headers=A).status_code == 204
        assert not folder.exists() and c.get(f"/api/v1/training_runs/{mid}", headers=A).status_code == 404


SPEC = LoraSpec(rank=2, seed=0)


def write(store: Store, name: str, content: str, **kw) -> CheckpointPath:
    cp = CheckpointPath("m1", "weights", name)
    store.write("alice", cp, MODEL, SPEC, lambda d: (d / "adapter.pt").write_text(content), **kw)
    return cp


def test_a_kill_during_an_overwrite_leaves_the_old_checkpoint_and_the_start_sweep_restores_it(tmp_path):
    store = Store(tmp_path)
    store.write_run("alice", "m1", MODEL, SPEC)
    cp = write(store, "final", "old")
    write(store, "final", "new", overwrite=True)
    assert (store.dir_of("alice", cp) / "adapter.pt").read_text() == "new"
    # what a kill between "rename the old aside" and "swap" leaves: the old folder aside, the new one unfinished
    weights = tmp_path / "tenants" / "alice" / "m1" / "weights"
    (weights / "final").rename(weights / ".old-final-123")
    (weights / ".tmp-final-456").mkdir()
    (weights / ".tmp-final-456" / "tinker.json").write_text(json.dumps({"checkpoint_id": "weights/final"}))
    assert [c["checkpoint_id"] for c in store.list("alice", "m1")] == []  # half-written folders are never listed
    fresh = Store(tmp_path)
    swept = fresh.sweep()
    assert len(swept) == 2 and sorted(x.name for x in weights.iterdir()) == ["final"], swept
    _, d, _ = fresh.find("alice", str(cp))
    assert (d / "adapter.pt").read_text() == "new" and fresh.usage("alice")[0] == 1


def test_the_start_sweep_removes_the_folders_of_models_without_checkpoints(tmp_path):
    store = Store(tmp_path)
    store.write_run("alice", "m1", MODEL, SPEC)
    store.write_run("alice", "m2", MODEL, SPEC)
    write(store, "a", "x")
    Store(tmp_path).sweep()
    assert sorted(p.name for p in (tmp_path / "tenants" / "alice").iterdir()) == ["m1"]


def test_names_with_a_trailing_newline_are_refused(tmp_path):
    for bad in ("ok\n", "ok\nmore", ".hidden", "-x", "a/b", ""):
        with pytest.raises(CheckpointError):
            check_name(bad)
    with pytest.raises(CheckpointError):
        parse_path("tinker://m1/weights/ok\n")
    assert check_name("step-0001.final") == "step-0001.final"


def test_a_forward_after_a_sampler_release_is_unaffected(tmp_path):
    c, _ = make(tmp_path, keep_samplers=1)
    with c:
        _, mid = new_model(c)
        for i in range(3):
            snapshot_sampler(c, mid, 2 * i + 1, i)
            assert "loss:sum" in result(c, fb(c, fb_body(mid, 2 * i + 2)).json()["request_id"])["metrics"]


def test_a_ttl_set_after_the_save_expires_and_a_kind_the_store_does_not_know_keeps_its_models_folder(tmp_path):
    store = Store(tmp_path)
    store.write_run("alice", "m1", MODEL, SPEC)
    cp = write(store, "a", "x")
    assert store.expired(time.time() + 10**9) == []
    store.set_ttl("alice", str(cp), 3600)
    assert store.expired(time.time() + 3599) == [] and store.expired(time.time() + 3601) == [("alice", cp)]
    store.set_ttl("alice", str(cp), None)
    assert store.expired(time.time() + 10**9) == []
    other = tmp_path / "tenants" / "alice" / "m1" / "published_weights" / "e"  # a kind not in store.KINDS
    other.mkdir(parents=True)
    (other / "tinker.json").write_text("{}")
    store.delete("alice", "m1", "weights/a")
    assert not store.forget_model("alice", "m1") and other.is_dir()  # a checkpoint still lives there
    Store(tmp_path).sweep()
    assert other.is_dir()
