"""A sample that fails for a passing reason (it was decoding when the engine died) is answered so that the
official SDK sends it again: retrieve_future answers 410 for a retryable failure, and tinker 0.38.0's sampling
client resubmits the sample; any other failure reaches the caller as RequestFailedError."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from colora.service.app import ServerThread, create_app
from colora.service.backend import BackendError
from colora.service.config import ServeConfig
from colora.service.fake import fake_from_model_dir
from test_service_sdk import CLIENT_RUN

ROOT = Path(__file__).resolve().parents[1]
CLIENT_PY = ROOT / ".venv-tinker" / "bin" / "python"
KEY = "tml-alice-0123456789"
CLIENT = """
import json, os, tinker
from tinker import types
with tinker.ServiceClient() as service:
    tc = service.create_lora_training_client(base_model=os.environ["MODEL"], rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = {}
    try:
        r = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=3, seed=1)).result(timeout=120)
        out["sequences"] = len(r.sequences)
    except Exception as e:
        out["error"] = type(e).__name__ + ": " + str(e)[:300]
    print("RETRY " + json.dumps(out), flush=True)
"""

pytestmark = pytest.mark.skipif(not CLIENT_PY.exists(), reason="no .venv-tinker: `make tinker-client` builds it")


def _run(tiny_model_dir, tmp_path, failures: list[BackendError]) -> tuple[dict, int]:
    backend = fake_from_model_dir(tiny_model_dir)
    calls = []
    sample = backend.sample

    def failing(call, done):
        calls.append(call)
        if len(calls) <= len(failures):
            done(failures[len(calls) - 1])
        else:
            sample(call, done)

    backend.sample = failing
    app = create_app(ServeConfig(out=tmp_path / "out", api_keys={KEY: "alice"}), backend)
    with ServerThread(app) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
        env.update(TINKER_BASE_URL=server.url, TINKER_API_KEY=KEY, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
                   MODEL=str(tiny_model_dir))
        p = subprocess.run([*CLIENT_RUN, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=240)
    line = [x for x in p.stdout.splitlines() if x.startswith("RETRY ")]
    assert p.returncode == 0 and line, f"{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(line[-1][6:]), len(calls)


def test_a_sample_the_engines_death_failed_is_sent_again_by_the_sdk(tiny_model_dir, tmp_path):
    died = BackendError("the engine died while this sample decoded; it restarts", "server", retryable=True)
    found, calls = _run(tiny_model_dir, tmp_path, [died, died])
    assert found == {"sequences": 2} and calls == 3


def test_a_failure_that_is_not_retryable_reaches_the_caller(tiny_model_dir, tmp_path):
    found, calls = _run(tiny_model_dir, tmp_path, [BackendError("the engine is degraded", "server")])
    assert found["error"].startswith("RequestFailedError") and "degraded" in found["error"] and calls == 1
