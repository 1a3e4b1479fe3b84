"""Pre-registrations: lock and check round trip; a changed locked setting is named; the shipped ones parse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colora.config import load_config, replace
from colora.studies import prereg

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"


@pytest.fixture
def locked(tmp_path):
    cfg_path = tmp_path / "exp.toml"
    shutil.copy(SMOKE, cfg_path)
    pr, side, h = prereg.lock(cfg_path, tmp_path / "prereg" / "exp.md", title="Smoke test", today="2026-11-29")
    return cfg_path, pr, side, h


def test_lock_writes_hash_sidecar_and_skeleton(locked):
    cfg_path, pr, side, h = locked
    p = prereg.load_prereg(pr)
    assert p.config_hash == h == prereg.lock_hash(load_config(cfg_path))
    assert p.date == "2026-11-29" and p.title == "Smoke test" and p.sidecar == side
    assert json.loads(side.read_text())["config"] == load_config(cfg_path).to_dict()
    assert "TODO" in pr.read_text() and p.arms == ("dedicated", "shared_sync")


def test_lock_hash_ignores_only_arm_and_seed():
    cfg = load_config(SMOKE)
    assert prereg.lock_hash(cfg) == replace(cfg, ["experiment.arm=dedicated", "experiment.seed=0"]).hash()
    assert prereg.lock_hash(replace(cfg, ["experiment.arm=overlap", "experiment.seed=3"])) == prereg.lock_hash(cfg)
    assert prereg.lock_hash(replace(cfg, ["experiment.steps=4"])) != prereg.lock_hash(cfg)


def test_check_matches_and_allows_per_run_keys(locked, capsys):
    cfg_path, pr, _, _ = locked
    assert prereg.main(["check", str(pr), str(cfg_path)]) == 0
    assert "matches" in capsys.readouterr().out
    per_run = ["--set", "experiment.seed=2", "--set", "experiment.arm=mps"]
    assert prereg.main(["check", str(pr), str(cfg_path), *per_run]) == 0


def test_editing_a_locked_setting_fails_and_names_it(locked, capsys):
    cfg_path, pr, _, _ = locked
    cfg_path.write_text(cfg_path.read_text().replace("grad_clip = 0.5", "grad_clip = 0.4"))
    assert prereg.main(["check", str(pr), str(cfg_path)]) == 1
    err = capsys.readouterr().err
    assert "jobs.mod.grad_clip: locked 0.5, here 0.4" in err and "1 setting(s)" in err

    assert prereg.main(["check", str(pr), str(SMOKE), "--set", "engine.max_model_len=256",
                        "--set", "jobs.count.lora_rank=4"]) == 1
    err = capsys.readouterr().err
    assert "engine.max_model_len: locked 512, here 256" in err and "jobs.count.lora_rank: locked 8, here 4" in err


def test_added_job_and_default_change_are_named(locked):
    cfg_path, pr, _, _ = locked
    p = prereg.load_prereg(pr)
    text = cfg_path.read_text() + '\n[[jobs]]\nname = "extra"\ntask = "addition"\n'
    cfg_path.write_text(text)
    diffs = prereg.compare(p, load_config(cfg_path))
    assert any(k.startswith("jobs.extra.") and a is None for k, a, _ in diffs)


def test_relock_is_refused_unless_forced_and_keeps_the_prose(locked, tmp_path):
    cfg_path, pr, _, h = locked
    pr.write_text(pr.read_text().replace("TODO: motivation", "Our motivation"))
    with pytest.raises(prereg.PreregError, match="already locks config .* --force"):
        prereg.lock(cfg_path, pr)
    _, _, h2 = prereg.lock(cfg_path, pr, overrides=["experiment.steps=5"], force=True, today="2026-12-01")
    p = prereg.load_prereg(pr)
    assert h2 != h and p.config_hash == h2 and p.date == "2026-12-01"
    assert "Our motivation" in pr.read_text()


def test_lock_fills_an_unlocked_prose_file(tmp_path):
    doc = tmp_path / "x.md"
    src = (ROOT / "prereg" / "reference8.md").read_text()
    header, body = prereg.split_front_matter(src)
    import re

    header = re.sub(r'^config_hash = ".*"$', 'config_hash = ""', header, flags=re.M)
    doc.write_text(f"+++\n{header}+++\n{body}")
    with pytest.raises(prereg.PreregError, match="not locked yet"):
        prereg.locked_dict(prereg.load_prereg(doc))
    prereg.lock(SMOKE, doc)
    p = prereg.load_prereg(doc)
    assert p.config_hash == prereg.lock_hash(load_config(SMOKE)) and p.primary_arm == "overlap_mps"
    assert body.strip() in doc.read_text()


def test_tampered_sidecar_is_refused(locked):
    _, pr, side, _ = locked
    d = json.loads(side.read_text())
    d["config"]["experiment"]["steps"] = 99
    side.write_text(json.dumps(d))
    with pytest.raises(prereg.PreregError, match="sidecar was edited"):
        prereg.compare(prereg.load_prereg(pr), load_config(SMOKE))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.replace("+++\n", "", 1), "must open with"),
    (lambda t: t.replace('arms = ["dedicated", "shared_sync"]', 'arms = ["shared_sync"]'), "include 'dedicated'"),
    (lambda t: t.replace('arms = ["dedicated", "shared_sync"]', 'arms = ["dedicated", "fast"]'), "accepted arms"),
    (lambda t: t.replace("min_ratio = 2.0", "min_ratio = 2.0\nmin_speed = 1"), "gates.min_speed"),
    (lambda t: t.replace("repeats = 1", "repeats = 0"), "repeats"),
    (lambda t: t.replace('title = "Smoke test"', 'titel = "x"'), "titel"),
])
def test_malformed_headers_name_the_key(locked, edit, match):
    _, pr, _, _ = locked
    pr.write_text(edit(pr.read_text()))
    with pytest.raises(prereg.PreregError, match=match):
        prereg.load_prereg(pr)


def test_cli_errors_exit_2(tmp_path, capsys):
    assert prereg.main(["check", str(tmp_path / "none.md"), str(SMOKE)]) == 2
    assert "colora: error: pre-registration" in capsys.readouterr().err
    assert prereg.main(["lock", str(SMOKE), "--out", str(tmp_path / "x.txt")]) == 2
    assert prereg.main(["lock", str(tmp_path / "none.toml"), "--out", str(tmp_path / "x.md")]) == 2


def test_shipped_preregistrations_parse():
    for md in sorted((ROOT / "prereg").glob("*.md")):
        p = prereg.load_prereg(md)
        assert p.hypotheses and p.seeds and "dedicated" in p.arms
        if p.config_hash:  # locked: the sidecar verifies, and the config it names still matches
            prereg.locked_dict(p)
            if (ROOT / p.config).is_file():
                assert prereg.compare(p, load_config(ROOT / p.config)) == []
