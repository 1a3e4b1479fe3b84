"""T1: the official Tinker SDK (tinker 0.38.0, in .venv-tinker) against `colora serve` with the fake backend.

The server runs in this process on a free port (so the test can read its scheduler and wrap it with a
fault); tests/fixtures/tinker_client/t1_conformance.py runs under .venv-tinker as a subprocess, asserts
what a client can see and prints its findings as JSON; this file checks those and the server's record.
`make test` builds .venv-tinker (`make tinker-client`); without it these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from colora.service.app import ServerThread, create_app
from colora.service.config import ServeConfig
from colora.service.fake import fake_from_model_dir

ROOT = Path(__file__).resolve().parents[1]
CLIENT_PY = ROOT / ".venv-tinker" / "bin" / "python"
SCRIPT = ROOT / "tests" / "fixtures" / "tinker_client" / "t1_conformance.py"
# how every test starts an SDK client: through run_module.py, which leaves without the client environment's
# shutdown (it aborts now and then after the client is done; run_module.py says more)
CLIENT_RUN = [str(CLIENT_PY), str(SCRIPT.parent / "run_module.py")]
KEYS = {"tml-alice-0123456789": "alice", "tml-bob-0123456789": "bob"}

pytestmark = pytest.mark.skipif(not CLIENT_PY.exists(), reason="no .venv-tinker: `make tinker-client` builds the "
                                "official SDK's environment these tests drive (`make test` does it first)")


class FailFirstOptimStep:
    """ASGI middleware: the first optim_step POST reaches the server, but its client gets a 503, as if the
    answer were lost; the SDK then sends the same POST again (same seq_id). Records every optim_step body."""

    def __init__(self, app):
        self.app, self.bodies, self._failed = app, [], False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/api/v1/optim_step":
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        self.bodies.append(json.loads(body))
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return {"type": "http.disconnect"}
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        if self._failed:
            return await self.app(scope, replay, send)
        self._failed = True

        async def swallow(message):  # the server's answer is lost on the way
            pass

        await self.app(scope, replay, swallow)
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"error": "injected", "category": "server"}'})


@pytest.fixture(scope="module")
def t1(tiny_model_dir, tmp_path_factory):
    """Runs the SDK client once against a fresh server; returns (findings, server app, stats rows, backend, fault)."""
    assert str(tiny_model_dir).count("/") != 2  # the SDK rewrites a name with exactly two "/" (docs/serving.md)
    out = tmp_path_factory.mktemp("serve")
    config = ServeConfig(out=out, api_keys=KEYS, fwdbwd_max_chunk_len=2)
    backend = fake_from_model_dir(tiny_model_dir)
    app = create_app(config, backend)
    fault = FailFirstOptimStep(app)
    with ServerThread(fault) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
        env.update(TINKER_BASE_URL=server.url, TINKER_API_KEY="tml-alice-0123456789", TINKER_TELEMETRY="0",
                   OTHER_TENANT_KEY="tml-bob-0123456789", MODEL=str(tiny_model_dir), HF_HUB_OFFLINE="1")
        proc = subprocess.run([*CLIENT_RUN, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=240)
        stats = app.state.service.stats()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("T1 ")]
    assert proc.returncode == 0 and lines, f"client failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(ln) for ln in (out / "stats.jsonl").read_text().splitlines()]
    return json.loads(lines[-1][3:]), stats, rows, backend, fault


def test_sdk_round_trip_trains_samples_saves_and_resumes(t1):
    found = t1[0]
    assert found["lora_rank"] == 8
    assert found["loss_after"] < found["loss_before"]
    assert len(found["sample_sequence_ids"]) == 3
    mid = found["model_id"]
    assert mid.split(":")[1:] == ["train", "0"]  # <session_id>:train:<model_seq_id>, as the SDK computes it
    assert found["checkpoints"] == sorted([f"tinker://{mid}/weights/ckpt1", f"tinker://{mid}/sampler_weights/samp1"])
    assert found["checkpoints_after_delete"] == [f"tinker://{mid}/weights/ckpt1"]


def test_chunks_sent_out_of_order_run_in_seq_order_in_one_cycle(t1):
    mid, rows = t1[0]["model_id"], t1[2]
    first = next(r for r in rows if r["forward"])
    # 5 datums, at most 2 a request: seq 1, 2, 3 with 2, 2, 1 datums, all in the first cycle, in seq order
    assert first["forward"] == [[mid, 1, 2, False], [mid, 2, 2, False], [mid, 3, 1, False]]
    steps = [r["optim"] for r in rows if r["optim"]]
    assert steps[0] == [[mid, 4]]


def test_a_retried_post_runs_once(t1):
    mid, rows, fault = t1[0]["model_id"], t1[2], t1[4]
    first = fault.bodies[0]
    assert [b["seq_id"] for b in fault.bodies if b["model_id"] == mid].count(first["seq_id"]) == 2  # the SDK retried
    ran = [s for r in rows for s in r["optim"] if s == [first["model_id"], first["seq_id"]]]
    assert len(ran) == 1


def test_an_unsupported_loss_fails_its_request_and_the_model_goes_on(t1):
    found = t1[0]
    assert found["dro"]["type"] == "RequestFailedError" and "dro" in found["dro"]["message"]
    assert "user" in found["dro"]["category"].lower()
    assert found["after_dro"] == pytest.approx(found["loss_step2"], abs=1e-5)


def test_resume_from_state_with_and_without_optimizer(t1):
    found = t1[0]
    assert found["resumed_model_id"].split(":")[1:] == ["train", "1"]
    assert found["resumed_loss"] == pytest.approx(found["loss_after"], abs=1e-4)
    assert found["resumed_with_optimizer_loss"] == pytest.approx(found["loss_step2"], abs=1e-4)


def test_keys_and_tenants(t1):
    found = t1[0]
    assert "tml-" in found["dummy_key"]["message"]  # refused by the SDK before any request
    assert found["unknown_key"]["type"] == "AuthenticationError"
    for what in ("other_load", "other_sampler", "other_list"):
        assert "not found" in found[what]["message"], (what, found[what])
    # its own session and model (seq 1: the SDK spent model seq 0 on the refused load)
    assert found["other_own_model"].split(":")[0] != found["model_id"].split(":")[0]


def test_close_frees_the_sessions_models_and_samplers(t1):
    found, stats, backend = t1[0], t1[1], t1[3]
    assert stats["live_sessions"] == 0 and stats["live_models"] == 0 and stats["live_samplers"] == 0, stats
    assert not set(found["session_models"]) & set(backend.model_ids)
    assert backend.live_samplers == 0





def test_a_well_behaved_tenant_is_unaffected_by_a_neighbour_that_sends_bad_inputs(tiny_model_dir, tmp_path):
    """Two SDK clients at once: alice trains and samples; bob sends a temperature the engine refuses, a
    malformed adam_params in his model's sequence, a seq_id far ahead and a token id past int64. Each of
    bob's is refused by name, his model goes on, and alice sees nothing of it."""
    config = ServeConfig(out=tmp_path, api_keys=KEYS, admin_keys=frozenset({"tml-ops-0123456789"}))
    app = create_app(config, fake_from_model_dir(tiny_model_dir))
    script = SCRIPT.parent / "neighbours.py"
    with ServerThread(app) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
        env.update(TINKER_BASE_URL=server.url, TINKER_TELEMETRY="0", MODEL=str(tiny_model_dir), HF_HUB_OFFLINE="1")
        procs = {role: subprocess.Popen([*CLIENT_RUN, str(script)], env={**env, "ROLE": role,
                                        "TINKER_API_KEY": key}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                 for role, key in (("good", "tml-alice-0123456789"), ("bad", "tml-bob-0123456789"))}
        found = {}
        for role, p in procs.items():
            stdout, stderr = p.communicate(timeout=300)
            lines = [ln for ln in stdout.splitlines() if ln.startswith("NEIGHBOUR ")]
            assert p.returncode == 0 and lines, f"{role} failed ({p.returncode}):\n{stdout[-3000:]}\n{stderr[-6000:]}"
            found[role] = json.loads(lines[-1][len("NEIGHBOUR "):])
        snap = app.state.service.snapshot(None)
    good, bad = found["good"], found["bad"]
    assert good["samples"] == [2, 2, 2, 2] and all(b < a for a, b in zip(good["losses"], good["losses"][1:])), good
    assert "temperature (2.5)" in bad["temperature"]["message"] and "user" in bad["temperature"]["category"].lower()
    assert bad["malformed_status"] == 200 and "adam_params" in bad["malformed"]["error"], bad
    assert bad["far_status"] == 429 and bad["far"]["limit"] == "seq_window", bad["far"]
    assert "token id 9223372036854775808" in bad["huge_token"]["message"], bad["huge_token"]
    assert bad["still_samples"] == 1 and bad["steps_after"] == "ok"
    assert snap["tenants"]["alice"]["errors"] == 0 and snap["tenants"]["bob"]["errors"] >= 4
    assert {e["tenant"] for e in snap["errors"]} == {"bob"}
