"""scripts/ray-kit.sh: the Ray wheel for the GPU host, split into parts and put together again there
(a small wheel made here stands in for Ray's; the download itself is not tested)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fake_wheel(path: Path) -> Path:
    import base64
    import hashlib

    files = {"fakemod/__init__.py": "X = 42\n" * 200,
             "fakemod-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakemod\nVersion: 1.0\n",
             "fakemod-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    rec = [f"{k},sha256={base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b'=').decode()},{len(v)}"
           for k, v in files.items()]
    files["fakemod-1.0.dist-info/RECORD"] = "\n".join(rec + ["fakemod-1.0.dist-info/RECORD,,"]) + "\n"
    whl = path / "fakemod-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_STORED) as z:
        for k, v in files.items():
            z.writestr(k, v)
    return whl


@pytest.mark.parametrize("damaged", [False, True])
def test_ray_kit_splits_and_reassembles(tmp_path, damaged):
    whl = _fake_wheel(tmp_path)
    kit, target = tmp_path / "kit", tmp_path / "target"
    subprocess.run(["bash", str(ROOT / "scripts" / "ray-kit.sh"), str(kit), "--wheel", str(whl), "--part-size", "700"],
                   check=True, capture_output=True)
    parts = sorted(kit.glob("r*"), key=lambda p: int(p.name[1:]))
    assert len(parts) == math.ceil(whl.stat().st_size / 700) >= 3
    assert all(f.stat().st_size <= 700 for p in parts for f in p.glob("part.*"))
    if damaged:
        f = next(parts[1].glob("part.*"))
        f.write_bytes(b"x" + f.read_bytes()[1:])
    shim = tmp_path / "bin"  # install.sh runs python3: this interpreter's, which has pip
    shim.mkdir()
    (shim / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    for i, p in enumerate(parts, 1):
        r = subprocess.run(["bash", str(p / "install.sh"), str(target)], capture_output=True, text=True, env=env)
        if i < len(parts):
            assert r.returncode == 0 and f"{i} of {len(parts)} parts here" in r.stdout
    if damaged:
        assert r.returncode == 1 and "checksum mismatch" in r.stderr and not (target / "fakemod").exists()
        return
    assert r.returncode == 0, r.stderr
    assert f"export PYTHONPATH={target}:$PYTHONPATH" in r.stdout
    got = subprocess.run([sys.executable, "-c", "import fakemod; print(fakemod.X)"], env={**env, "PYTHONPATH": str(target)},
                         capture_output=True, text=True)
    assert got.stdout.strip() == "42"
