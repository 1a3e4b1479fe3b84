"""`colora report` never writes into a run or above runs: a report's --out that is a run, lies inside
one or holds the runs it reads is refused before anything is written; a folder beside the runs is
fine, also inside the folder the report reads, and never reads as a run afterwards."""

from __future__ import annotations

from test_report import FAKE, make_fake_sweep

from colora.studies import report


def _files(d) -> dict:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_report_into_its_own_run_is_refused_and_leaves_the_run_as_it_was(tmp_path, capsys):
    sweep = make_fake_sweep(tmp_path / "sweep")
    run = sweep / "dedicated" / "seed1-r0"
    before = _files(sweep)
    assert report.main([str(run), "--out", str(run)]) == 2
    assert "a report never writes into a run" in capsys.readouterr().err
    assert report.main([str(run), "--out", str(run / "report")]) == 2
    assert "lies inside the run directory" in capsys.readouterr().err
    assert _files(sweep) == before


def test_a_report_into_the_sweep_it_reads_is_refused_and_the_sweep_still_reports(tmp_path, capsys):
    sweep = make_fake_sweep(tmp_path / "sweep")
    before = _files(sweep)
    assert report.main([str(sweep), "--out", str(sweep)]) == 2
    assert "holds the run" in capsys.readouterr().err
    assert _files(sweep) == before
    s = report.make_report([str(sweep)], tmp_path / "rep", figures=False)
    assert len(s["runs"]) == len(FAKE)


def test_a_report_beside_the_runs_never_reads_as_a_run(tmp_path):
    sweep = make_fake_sweep(tmp_path / "sweep")
    first = report.make_report([str(sweep)], sweep / "reports" / "a", figures=False)
    again = report.make_report([str(sweep)], tmp_path / "rep", figures=False)
    assert [r["dir"] for r in again["runs"]] == [r["dir"] for r in first["runs"]]
