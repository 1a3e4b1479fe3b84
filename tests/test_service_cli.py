"""`python -m colora.service` (what `colora serve` runs): starts on the fake backend, refuses what it cannot serve."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

from colora.service.cli import main


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
