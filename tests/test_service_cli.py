"""`python -m colora.service` (what `colora serve` runs): starts on the fake backend, refuses what it cannot serve."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from colora.service.cli import build_backend, main, parser, serve_config, served_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serves_the_fake_backend_until_stopped(tiny_model_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "colora.service", "--fake", "--model", str(tiny_model_dir),
                             "--any-key", "--out", str(tmp_path / "serve"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1) as r:
                    assert json.load(r) == {"status": "ok"}
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        else:
            raise AssertionError("the server did not answer healthz in 30 s")
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/get_server_capabilities",
                                     headers={"X-API-Key": "tml-someone-1234"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.load(r)["supported_models"][0]["model_name"] == str(tiny_model_dir)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_refuses_without_keys_and_a_folder_that_holds_no_model(tiny_model_dir, tmp_path, capsys):
    assert main(["--model", str(tiny_model_dir), "--out", str(tmp_path), "--fake"]) == 2
    assert "--api-keys FILE" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--model", str(empty), "--out", str(tmp_path / "out"), "--any-key"]) == 2  # the co-runner's check
    err = capsys.readouterr().err
    assert err.startswith("colora serve: --model:") and str(empty) in err, err
    assert main(["--model", str(tmp_path), "--out", str(tmp_path), "--any-key", "--fake"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_sigterm_stops_the_server_with_status_0_after_a_closing_line_and_the_log_shows_without_verbose(
        tiny_model_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "colora.service", "--fake", "--model", str(tiny_model_dir),
                             "--any-key", "--out", str(tmp_path / "serve"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/create_session", data=b"{}", method="POST",
                                     headers={"X-API-Key": "tml-someone-1234", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as r:
            sid = json.load(r)["session_id"]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert f"session {sid} of tenant key-" in out  # the operator's log, without --verbose
    assert out.rstrip().splitlines()[-1].startswith("colora serve: stopped (SIGTERM); 1 live session(s) dropped"), out


def test_model_takes_the_builtin_names_colora_run_takes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLORA_HOME", str(tmp_path / "home"))
    args = parser().parse_args(["--fake", "--model", "builtin:tiny", "--out", str(tmp_path / "out"), "--any-key"])
    backend = build_backend(args)
    served = Path(backend.capabilities().model_name)
    assert served.is_relative_to(tmp_path / "home") and (served / "tokenizer.json").is_file()
    assert served_model("builtin:tiny") == str(served)  # built once, then found
    assert main(["--fake", "--model", "builtin:nope", "--out", str(tmp_path / "o"), "--any-key"]) == 2
    err = capsys.readouterr().err
    assert "builtin:nope" in err and "builtin:tiny" in err and "does not exist" not in err, err


def test_the_keys_file_and_admin_flag_make_the_config(tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text('[keys]\n"tml-alice-1234" = "alice"\n[admin]\nkeys = ["tml-ops-00001"]\n'
                    '[limits]\nmodels = 3\n[limits.alice]\nsamplers = 9\n')
    config = serve_config(parser().parse_args(["--model", "m", "--out", str(tmp_path), "--api-keys", str(keys),
                                               "--admin-key", "tml-ops-00002"]))
    assert config.admin_keys == {"tml-ops-00001", "tml-ops-00002"}
    assert config.limits_of("alice").models == 3 and config.limits_of("alice").samplers == 9
    assert config.limits_of("bob").samplers == 64


def test_a_lever_that_is_not_one_is_refused_by_name(tmp_path, tiny_model_dir, capsys):
    """--lever items are checked before any model is loaded; the fake backend has none to take."""
    out = str(tmp_path / "out")
    assert main(["--model", str(tiny_model_dir), "--out", out, "--any-key", "--lever", "samplers=tape"]) == 2
    assert "lever samplers = 'tape'" in capsys.readouterr().err
    assert main(["--model", str(tiny_model_dir), "--out", out, "--any-key", "--lever", "gathr=1"]) == 2
    assert "gathr" in capsys.readouterr().err
    assert main(["--fake", "--model", str(tiny_model_dir), "--out", out, "--any-key", "--lever", "off"]) == 2
    assert "--fake has none" in capsys.readouterr().err
