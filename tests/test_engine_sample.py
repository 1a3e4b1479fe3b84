"""The sampling profile's reading of py-spy's raw stacks (colora/bench/engine_sample.py): threads named by
process and thread, busy share from the samples, self and inclusive time per function a step; and a
recording of a real process by the py-spy the `profile` extra installs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from colora.bench import engine_sample

RAW = "\n".join([
    'process 10:"VLLM::EngineCore";thread (10): MainThread;run_busy_loop (vllm/v1/engine/core.py:900);'
    'step (vllm/v1/engine/core.py:400);schedule (vllm/v1/core/sched/scheduler.py:300) 30',
    'process 10:"VLLM::EngineCore";thread (10): MainThread;run_busy_loop (vllm/v1/engine/core.py:900);'
    'step (vllm/v1/engine/core.py:410);execute_model (vllm/v1/worker/gpu_model_runner.py:50) 50',
    # a recursion: counted once in the inclusive time of f
    'process 10:"VLLM::EngineCore";thread (10): MainThread;run_busy_loop (vllm/v1/engine/core.py:900);'
    'f (x.py:1);f (x.py:2) 20',
    'process 10:"VLLM::EngineCore";process 11:"VLLM::Worker --flag";thread (11): MainThread;'
    'worker_busy_loop (vllm/v1/executor/multiproc_executor.py:9) 10',
    "not a stack line",
])


def test_threads_busy_share_self_and_inclusive_time_a_step():
    s = engine_sample.summarize(RAW, seconds=1.0, rate=200, steps=50)  # the batches: the whole recording
    assert s["ms_per_step"] == 20.0 and [t["thread"] for t in s["threads"]] == ["VLLM::EngineCore / MainThread",
                                                                                "VLLM::Worker / MainThread"]
    core, worker = s["threads"]
    assert core["samples"] == 100 and core["busy"] == pytest.approx(0.5) and worker["busy"] == pytest.approx(0.05)
    one = 1e3 / 200 / 50  # a sample, in ms a step
    assert core["busy_ms"] == pytest.approx(100 * one)
    assert dict(core["self"]) == pytest.approx({"execute_model (vllm/v1/worker/gpu_model_runner.py)": 50 * one,
                                                "schedule (vllm/v1/core/sched/scheduler.py)": 30 * one,
                                                "f (x.py)": 20 * one})
    inclusive = dict(core["inclusive"])
    assert inclusive["run_busy_loop (vllm/v1/engine/core.py)"] == pytest.approx(100 * one)
    assert inclusive["step (vllm/v1/engine/core.py)"] == pytest.approx(80 * one)  # lines of one function merged
    assert inclusive["f (x.py)"] == pytest.approx(20 * one)
    assert core["areas"] == pytest.approx({"model runner": 50 * one, "scheduler and KV cache": 30 * one,
                                           "torch and the rest": 20 * one})
    assert engine_sample.areas(core) is core["areas"]
    # a summary kept before areas were: its top functions by area, what they leave of its busy time apart
    older = {"busy_ms": 100 * one, "self": core["self"][:2]}
    assert engine_sample.areas(older) == pytest.approx({"model runner": 50 * one, "scheduler and KV cache": 30 * one,
                                                        engine_sample.UNLISTED: 20 * one})
    assert engine_sample.area("synchronize (torch/cuda/streams.py)") == "waiting on the GPU"
    assert engine_sample.area("prepare_tensors (vllm/lora/ops/triton_ops/lora_kernel_metadata.py)") == "LoRA bookkeeping"
    text = engine_sample.to_text(s, "== a case ==")
    assert text.startswith("== a case ==\n50 engine steps at 20.00 ms a step, recorded over 1.00 s")
    assert "VLLM::EngineCore / MainThread: busy 50% of the recording, 10.00 ms a step" in text


def test_a_recording_of_a_running_process_finds_its_busy_function(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "import time\ndef spin():\n    t = time.time()\n"
                             "    while time.time() - t < 30:\n        pass\nspin()"])
    try:
        time.sleep(0.5)
        rec = engine_sample.Recorder(engine_sample.find_py_spy(), busy.pid, tmp_path / "raw.txt", 100)
        time.sleep(1.5)
        s = engine_sample.summarize(rec.stop(), seconds=1.5, rate=100, steps=1)
    finally:
        busy.kill()
    top = s["threads"][0]
    assert top["self"][0][0] == "spin (<string>)" and top["busy"] > 0.5, s


def test_a_missing_py_spy_is_named():
    with pytest.raises(engine_sample.SampleError, match="--py-spy /nonexistent/py-spy: no such executable"):
        engine_sample.find_py_spy("/nonexistent/py-spy")
