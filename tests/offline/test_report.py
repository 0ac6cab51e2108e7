"""tuner.offline.report: rows, summary, JSON, PNG and table of a real store of problems tuned on the
CPU, with a tune-all journal beside it.

The store holds torch's winners, one Triton winner forced from the engine's own measurement (on
the CPU Triton runs in its interpreter and never wins, so the report sees a speedup below 1), one
winner from other versions (stale); the journal adds a failure and the tuning times.
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from rich.console import Console

from tuner.cache import Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure.records import LABEL_WIDTH, candidate_label, candidate_name
from tuner.offline import report
from tuner.offline.journal import (
    append_journal,
    journal_path,
    journal_records,
    pending,
    read_journal,
)
from tuner.offline.plots import geomean
from tuner.offline.problem_set import ProblemSet
from tuner.offline.tune_all import Result, RunSummary
from tuner.tuning.engine import TuneOptions, tune

FP = fingerprint()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gemm(m: int) -> GemmKey:
    return GemmKey(m=m, n=24, k=40, dtype="f32", out_dtype="f32")


TORCH_WON, TRITON_WON, STALE, FAILED, PENDING = gemm(8), gemm(4), gemm(16), gemm(32), gemm(64)


@dataclass
class Tuned:
    store: Store
    journal: list[dict]


def journal_record(key: GemmKey, status: str, seconds: float, **extra: str) -> dict:
    fields = {"device_class": FP.device_class, "error": "", "run_id": "", "worker": 0, "at": 0.0}
    return {**fields, "key": str(key), "status": status, "seconds": seconds, **extra}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Tuned:
    path = tmp_path_factory.mktemp("report") / "c.db"
    store = Store(path)
    store.save_device(FP)
    journal = journal_path(path)
    for key, seconds in ((TORCH_WON, 1.5), (STALE, 3.0)):
        outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=["torch"]))
        winner = outcome.winner if key != STALE else replace(outcome.winner, versions="older")
        store.save_run(outcome.measurements, winner)
        record = journal_record(key, "tuned", seconds, run_id=outcome.winner.run_id)
        append_journal(journal, record)
    append_journal(journal, journal_record(TORCH_WON, "tuned", 9.0, run_id="another-run"))
    outcome = tune(TRITON_WON, options=TuneOptions(budget_s=0.01, sources=["triton_gemm"]))
    triton = next(m for m in outcome.measurements if m.source == "triton_gemm" and m.median_us)
    forced = replace(outcome.winner, source=triton.source, params=triton.params)
    store.save_run(outcome.measurements, replace(forced, median_us=triton.median_us))
    append_journal(journal, journal_record(TRITON_WON, "tuned", 2.0, run_id=forced.run_id))
    append_journal(journal, journal_record(FAILED, "failed", 0.5, error="worker died"))
    append_journal(journal, journal_record(PENDING, "failed", 0.5, device_class="other-gpu"))
    return Tuned(store, read_journal(journal))


def test_rows_come_from_the_store_and_the_journal(tuned: Tuned) -> None:
    rep = report.build(tuned.store, FP, journal=tuned.journal)
    rows = {r.key: r for r in rep.rows}
    # every winner and failure of this device class, by shape family and growing M
    assert [r.key for r in rep.rows] == [str(k) for k in (TRITON_WON, TORCH_WON, STALE, FAILED)]
    statuses = {key: r.status for key, r in rows.items()}
    assert statuses == {
        str(TRITON_WON): "tuned", str(TORCH_WON): "tuned", str(STALE): "stale",
        str(FAILED): "failed",
    }  # fmt: skip
    for key in (TORCH_WON, TRITON_WON, STALE):
        winner, row = tuned.store.winner(FP.device_class, str(key)), rows[str(key)]
        assert (row.baseline_us, row.winner_us) == (winner.baseline_us, winner.median_us)
        assert (row.source, row.candidate) == (winner.source, winner.candidate)
        assert row.speedup == pytest.approx(winner.baseline_us / winner.median_us)
        assert row.label == key.label
    assert rows[str(TORCH_WON)].tune_s == 1.5  # the journal entry of the stored winner's run
    assert rows[str(TORCH_WON)].speedup == 1.0 and rows[str(TRITON_WON)].source == "triton_gemm"
    failed = rows[str(FAILED)]
    assert (failed.tune_s, failed.error, failed.speedup) == (0.5, "worker died", None)


def test_a_failed_retune_is_failed_beside_the_winner_it_kept(tuned: Tuned) -> None:
    journal = [
        *tuned.journal,
        journal_record(TORCH_WON, "failed", 0.7, error="worker died (exit code -9)"),
    ]
    rep = report.build(tuned.store, FP, journal=journal)
    row = next(r for r in rep.rows if r.key == str(TORCH_WON))
    winner = tuned.store.winner(FP.device_class, str(TORCH_WON))
    assert (row.status, row.error, row.tune_s) == ("failed", "worker died (exit code -9)", 0.7)
    assert (row.winner_us, row.source) == (winner.median_us, winner.source)
    assert rep.summary()["failed"] == 2
    # and the next run tunes it again (not "0 to tune" beside a failed row, forever)
    assert pending(tuned.store, FP, [TORCH_WON], journal=journal) == [TORCH_WON]
    assert pending(tuned.store, FP, [TORCH_WON], journal=tuned.journal) == []


def test_a_problem_stopped_between_its_passes_shows_the_verdict_it_kept(tuned: Tuned) -> None:
    error = "the run stopped before its second pass; the first pass's verdict kept"
    journal = [*tuned.journal, journal_record(TORCH_WON, "partial", 0.9, error=error)]
    rep = report.build(tuned.store, FP, journal=journal)
    row = next(r for r in rep.rows if r.key == str(TORCH_WON))
    winner = tuned.store.winner(FP.device_class, str(TORCH_WON))
    assert (row.status, row.winner_us, row.source) == ("partial", winner.median_us, winner.source)
    assert rep.summary()["partial"] == 1 and row not in rep.timed()  # not this run's verdict
    text = rendered(rep)
    assert "1 partial" in text and candidate_label(winner.candidate, LABEL_WIDTH) in text
    assert pending(tuned.store, FP, [TORCH_WON], journal=journal) == [TORCH_WON]


def test_summary_counts_and_ranks_the_tuned_rows(tuned: Tuned) -> None:
    run = RunSummary(results=[], wall_s=12.5, workers=2, stopped="time limit")
    summary = report.build(tuned.store, FP, journal=tuned.journal, run=run).summary()
    rows = {r.key: r for r in report.build(tuned.store, FP, journal=tuned.journal).rows}
    speedups = {k: rows[str(k)].speedup for k in (TORCH_WON, TRITON_WON)}
    worst, best = sorted(speedups, key=speedups.get)
    assert {k: summary[k] for k in ("problems", "tuned", "stale", "failed", "timeout")} == {
        "problems": 4, "tuned": 2, "stale": 1, "failed": 1, "timeout": 0
    }  # fmt: skip
    assert summary["geomean_speedup"] == pytest.approx(geomean(list(speedups.values())))
    # the plot draws the rows the summary counts: not the stale winner, whose speedup has one
    timed = report.build(tuned.store, FP, journal=tuned.journal).timed()
    assert {r.key for r in timed} == {str(TORCH_WON), str(TRITON_WON)} and rows[str(STALE)].speedup
    assert summary["worst"] == {"label": worst.label, "speedup": speedups[worst]}
    assert summary["best"] == {"label": best.label, "speedup": speedups[best]}
    assert summary["tuning_s_total"] == 1.5 + 2.0 + 3.0 + 0.5
    assert summary["tuning_s_median"] == 2.0
    assert (summary["wall_s"], summary["workers"], summary["stopped"]) == (12.5, 2, "time limit")


def test_a_problem_set_gives_labels_and_pending_rows(tuned: Tuned) -> None:
    problems = ProblemSet()
    problems.add(PENDING, "tiny.yaml: down")
    problems.add(TORCH_WON, "tiny.yaml: qkv")
    problems.add(TORCH_WON, "tiny.yaml: o")
    rep = report.build(tuned.store, FP, problems=problems, journal=tuned.journal)
    assert [(r.label, r.status) for r in rep.rows] == [
        ("tiny.yaml: down", "pending"),  # its failure was on another device class
        ("tiny.yaml: qkv (+1)", "tuned"),
    ]
    assert rep.summary()["geomean_speedup"] == 1.0


def test_write_puts_the_json_and_a_png(tuned: Tuned, tmp_path: Path) -> None:
    rep = report.build(tuned.store, FP, journal=tuned.journal)
    json_path, png = report.write(rep, tmp_path / "out")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(rep.to_dict()))
    written = json.loads(json_path.read_text())
    assert written["device_class"] == FP.device_class and written["versions"] == FP.version_tag
    assert [r["speedup"] for r in written["rows"]] == [r.speedup for r in rep.rows]
    assert png == tmp_path / "out" / "speedup.png"
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_a_problem_another_process_tuned_meanwhile_counts_as_an_earlier_runs(tuned: Tuned):
    """This run found TORCH_WON tuned by another process as it came to it ("skipped"): its
    time is that process's, so the closing line counts it among the earlier runs' problems."""
    results = [Result(TRITON_WON, "tuned", 2.0, 0), Result(TORCH_WON, "skipped", 0.0, 0)]
    run = RunSummary(results=results, wall_s=5.0, workers=1)
    rep = report.build(tuned.store, FP, journal=tuned.journal, run=run)
    # TORCH_WON, STALE and FAILED: only TRITON_WON is this run's
    assert "(3 of them tuned by earlier runs)" in rendered(rep)


def test_write_without_timed_rows_writes_no_png(tuned: Tuned, tmp_path: Path) -> None:
    """Nor keeps an earlier run's beside the new JSON, where it would read as this run's."""
    report.write(report.build(tuned.store, FP, journal=tuned.journal), tmp_path)
    assert (tmp_path / "speedup.png").exists()
    problems = ProblemSet()
    problems.add(PENDING, "not tuned yet")
    rep = report.build(tuned.store, FP, problems=problems, journal=tuned.journal)
    json_path, png = report.write(rep, tmp_path)
    assert png is None and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert json.loads(json_path.read_text())["summary"]["pending"] == 1


def test_render_puts_failures_first_and_the_summary_below(tuned: Tuned) -> None:
    run = RunSummary(results=[], wall_s=12.5, workers=2, stopped="time limit", start_s=3.5)
    rep = report.build(tuned.store, FP, journal=tuned.journal, run=run)
    out = io.StringIO()
    report.render(rep, Console(file=out, width=200), limit=2)
    text = out.getvalue()
    lines = [line for line in text.splitlines() if "24x40" in line]  # the table's rows
    assert "failed" in lines[0] and "worker died" in lines[0]
    assert "... 2 more rows in report.json" in text
    assert "problems: 4 (2 tuned, 1 stale, 1 failed)" in text
    assert (
        "wall time 12.5 s on 2 workers, 3.5 s of it starting them; stopped early: time limit"
        in text
    )


def test_render_without_a_journal_says_tuning_times_were_not_recorded(tuned: Tuned) -> None:
    """Problems tuned by `tuner tune` leave no journal: no "0.0 s, median - s" line."""
    out = io.StringIO()
    report.render(report.build(tuned.store, FP), Console(file=out, width=200))
    text = out.getvalue()
    assert "tuning time: not recorded (the problems were not tuned by tune-all)" in text
    rows = [line for line in text.splitlines() if line.startswith("│") and "24x40" in line]
    speeds = [row.split("│")[5].strip() for row in rows]
    assert speeds and all(s.endswith("x") or s == "-" for s in speeds)  # one format for all


def test_report_refuses_an_unusable_out_before_printing_its_table(
    tuned: Tuned, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from tuner.cli import main

    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"  # under a file: cannot be made
    argv = ["tuner", "report", "--cache", str(tuned.store.path), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        main.main()
    printed = capsys.readouterr()
    assert exit_.value.code == 2 and printed.out == ""  # no table, then an error under it
    assert printed.err == f"error: {out}: cannot create the output directory: Not a directory\n"


def test_report_of_a_missing_cache_makes_no_out_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from tuner.cli import main

    out, cache = tmp_path / "report", tmp_path / "typo.db"
    monkeypatch.setattr(sys, "argv", ["tuner", "report", "--cache", str(cache), "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        main.main()
    assert exit_.value.code == 2 and "no such cache" in capsys.readouterr().err
    assert not out.exists() and not cache.exists()


def rendered(rep: report.Report, limit: int | None = None) -> str:
    out = io.StringIO()
    report.render(rep, Console(file=out, width=200), limit=limit)
    return out.getvalue()


def test_the_table_names_the_winner_by_its_label_and_the_json_by_its_name(tuned: Tuned) -> None:
    rep = report.build(tuned.store, FP, journal=tuned.journal)
    row = next(r for r in rep.rows if r.key == str(TRITON_WON))
    text = rendered(rep)
    line = next(line for line in text.splitlines() if line.startswith(f"│ {TRITON_WON.label} "))
    assert f"│ {candidate_label(row.candidate)} " in line
    assert line.count("triton_gemm") == 1 and "{" not in text  # no JSON cut in half
    written = next(r for r in rep.to_dict()["rows"] if r["key"] == str(TRITON_WON))
    stored = tuned.store.winner(FP.device_class, str(TRITON_WON))
    assert written["candidate"] == row.candidate == candidate_name(stored.source, stored.params)


def test_a_table_cut_short_leaves_out_the_rows_that_kept_their_baseline_first(
    tuned: Tuned,
) -> None:
    """Failures first, then the rows where something other than the baseline won: the Triton
    winner is shown, torch's kept baseline is the row left out."""
    text = rendered(report.build(tuned.store, FP, journal=tuned.journal), limit=3)
    shown = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert shown == [FAILED.label, STALE.label, TRITON_WON.label]
    assert "... 1 more row in report.json; the baseline won on each" in text


def summary_row(m: int, speedup: float, tune_s: float, phases: dict[str, float]) -> report.Row:
    key = gemm(m)
    return report.Row(
        key.label, str(key), "tuned", baseline_us=10.0 * speedup, winner_us=10.0, source="torch",
        candidate="torch", tune_s=tune_s, shape=key.label, phases=phases,
    )  # fmt: skip


def test_the_closing_lines() -> None:
    """Speedups several problems share are counted, not pinned on one of them; the tuning time
    says how many problems earlier runs tuned; phases in the order a problem meets them; the
    pruning on a line of its own."""
    phases = {"confirm": 0.5, "baseline": 0.25, "setup": 0.25}  # as a journal's JSON sorts them
    rows = [summary_row(8, 1.0, 1.0, phases), summary_row(16, 1.0, 1.0, phases),
            summary_row(32, 2.0, 1.0, phases)]  # fmt: skip
    rep = report.Report(
        FP.device_class, FP.version_tag, rows, wall_s=5.0, workers=1, start_s=0.5,
        ran={rows[2].key},
    )  # fmt: skip
    lines = rendered(rep).splitlines()
    assert lines[lines.index("problems: 3 (3 tuned)") :] == [
        "problems: 3 (3 tuned)",
        "speedup: geomean 1.260x, worst 1.000x on 2 problems, best 2.000x on 32x24x40 nn f32",
        "tuning time: 3.0 s over 3 problems (2 of them tuned by earlier runs), median 1.00 s per "
        "problem; wall time 5.0 s on 1 worker, 0.5 s of it starting the worker",
        "tuning time by phase: setup 0.8 s, baseline 0.8 s, confirm 1.5 s",
        "compiling: 0 candidates compiled ahead (0.0 s of per-problem compile jobs), 0.0 s "
        "waited for",
        "pruned uncompiled: none",
    ]


def test_a_failed_rows_cell_keeps_saying_the_first_pass_verdict_was_kept() -> None:
    """A long second-pass error is cut in the winner cell before its ending, which stays."""
    from tuner.offline.journal import KEPT_FIRST_PASS

    error = "second pass: RuntimeError: " + "x" * 300 + KEPT_FIRST_PASS
    row = replace(summary_row(8, 1.5, 1.0, {}), status="failed", error=error)
    cell = report._winner_cell(row)
    assert cell.endswith("x…" + KEPT_FIRST_PASS) and len(cell) < 120


def test_a_problems_title_is_printed_as_it_is_brackets_and_all() -> None:
    """A title from a file whose name holds [ ] reads the same in the table and the lines."""
    row = replace(summary_row(8, 2.0, 1.0, {}), label="shapes[v2].yaml[0]")
    text = rendered(report.Report(FP.device_class, FP.version_tag, [row]))
    assert text.count("(shapes[v2].yaml[0])") == 2, text


def test_caches_of_one_stem_keep_their_own_journals_and_read_an_earlier_releases(tmp_path):
    """``a.db`` and ``a.sqlite`` in one folder each journal under their whole name; the file an
    earlier release wrote under the stem (``a.tune-all.jsonl``) is read first by both, so a run
    after an upgrade resumes where the last one stopped. A link's journal is its target's."""
    assert journal_path(tmp_path / "a.db") == tmp_path.resolve() / "a.db.tune-all.jsonl"
    append_journal(tmp_path / "a.tune-all.jsonl", {"key": "old", "status": "tuned"})
    append_journal(journal_path(tmp_path / "a.db"), {"key": "db", "status": "tuned"})
    append_journal(journal_path(tmp_path / "a.sqlite"), {"key": "sqlite", "status": "tuned"})
    assert [r["key"] for r in journal_records(tmp_path / "a.db")] == ["old", "db"]
    assert [r["key"] for r in journal_records(tmp_path / "a.sqlite")] == ["old", "sqlite"]
    (tmp_path / "link.db").symlink_to(tmp_path / "a.db")
    assert [r["key"] for r in journal_records(tmp_path / "link.db")] == ["old", "db"]
