"""tuner.suites.runner: a suite of small CPU problems tuned for real, each timed side by side with its
baseline, written to JSON and a PNG, and kept in a real store."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from tuner.cache import Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, Key
from tuner.measure import timing
from tuner.suites import runner
from tuner.tuning.engine import TuneOptions, TuneOutcome, tune

OPTIONS = TuneOptions(budget_s=0.01, sources=["torch"])
PROBLEMS = [
    ("decode", GemmKey(m=2, n=48, k=32, layout="nt", dtype="f32", out_dtype="f32")),
    ("prefill", GemmKey(m=24, n=48, k=32, layout="nt", dtype="f32", out_dtype="f32")),
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def flops(key: Key, us: float) -> dict[str, float]:
    return {"gflops": 2 * key.m * key.n * key.k / us / 1e3}


def test_suite_rows_json_png_and_store(tmp_path: Path) -> None:
    with Store(tmp_path / "c.db") as store:
        result = runner.run_suite(
            "tiny", PROBLEMS, out_dir=tmp_path / "out", title="tiny GEMMs", options=OPTIONS,
            metrics=flops, store=store,
        )  # fmt: skip
        stored = {w.key: w for w in store.winners(fingerprint().device_class)}
    assert json.loads((tmp_path / "out" / "tiny.json").read_text()) == result
    assert (tmp_path / "out" / "tiny.png").read_bytes().startswith(PNG_MAGIC)
    assert (result["suite"], result["title"]) == ("tiny", "tiny GEMMs")
    assert result["device"] == fingerprint().to_dict() and result["copy_gbs"] > 0
    assert result["options"] == asdict(OPTIONS)
    assert [(r["label"], r["key"]) for r in result["rows"]] == [(n, str(k)) for n, k in PROBLEMS]
    for row in result["rows"]:
        # torch alone: the winner is the baseline, the same kernel, so the ratio is 1 exactly
        assert row["source"] == "torch" and row["winner_us"] == row["baseline_us"] > 0
        assert row["speedup"] == 1.0 and row["tune_s"] > 0
        assert row["extra"]["gflops"] == row["extra"]["baseline_gflops"] > 0
        assert stored[row["key"]].candidate == row["candidate"]
    summary = result["summary"]
    assert (summary["n"], summary["geomean"], summary["min"], summary["max"]) == (2, 1.0, 1.0, 1.0)
    assert summary["slower_than_0.98"] == 0
    assert summary["total_tune_s"] == pytest.approx(sum(r["tune_s"] for r in result["rows"]))


def test_without_a_terminal_each_problem_is_announced_before_it_is_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No progress bar shows in a log: a line says which problem a slow run is on."""
    runner.run_suite("tiny", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS, plot=False)
    out = capsys.readouterr().out
    assert out.index("[1/2] measuring decode") < out.index("[2/2] measuring prefill")


def test_a_problem_whose_tuning_raises_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its error is said as it reads (brackets are no console markup), and the suite goes on."""
    broken = PROBLEMS[0][1]

    def tuner(key: Key, options: TuneOptions) -> TuneOutcome:
        if key == broken:
            raise RuntimeError("worker lost: weight must be [n, k//2] in [int8] [/red]")
        return tune(key, options=options)

    result = runner.run_suite(
        "partly", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS, tuner=tuner
    )
    assert [r["label"] for r in result["rows"]] == ["prefill"]
    assert result["summary"]["n"] == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "decode: tuning failed: worker lost: weight must be [n, k//2] in [int8] [/red]" in out


def test_an_empty_suite_writes_its_json_and_no_png(tmp_path: Path) -> None:
    result = runner.run_suite("empty", [], out_dir=tmp_path, title="t", options=OPTIONS)
    assert json.loads((tmp_path / "empty.json").read_text())["summary"] == {"n": 0}
    assert result["rows"] == [] and not (tmp_path / "empty.png").exists()


def test_summary_counts_rows_slower_than_the_floor() -> None:
    rows = [
        runner.Row(str(i), "k", baseline_us=100.0, winner_us=w, source="s", candidate="c",
                   tune_s=t)
        for i, (w, t) in enumerate([(50.0, 1.0), (100.0, 2.0), (104.0, 4.0)])
    ]  # fmt: skip
    summary = runner.summarize(rows)
    assert summary["n"] == 3 and summary["max"] == 2.0
    assert summary["min"] == pytest.approx(100 / 104)
    assert summary["geomean"] == pytest.approx((2.0 * 1.0 * 100 / 104) ** (1 / 3))
    assert summary["slower_than_0.98"] == 1
    assert (summary["median_tune_s"], summary["total_tune_s"]) == (2.0, 7.0)


def test_rates_keep_three_significant_digits_below_100_and_whole_numbers_above() -> None:
    """A CPU's rates (hundredths of a TFLOP/s, a few GB/s) keep their digits; a GPU's read as
    whole numbers."""
    cpu = {0.01234: "0.0123", 0.4: "0.400", 5.234: "5.23", 28.37: "28.4", 0.0: "0"}
    gpu = {312.6: "313", 4812.4: "4812", 100.0: "100"}
    assert {value: runner.rate(value) for value in cpu | gpu} == cpu | gpu


def test_in_turn_reverses_the_order_every_other_round() -> None:
    """No runner is always timed first: a GPU heating over a round would favour it."""
    seen: list[str] = []

    def call(name: str):
        return lambda: seen.append(name)

    timed = {name: (call(name), [()]) for name in ("a", "b", "c")}
    times = runner.in_turn(timed, "cpu", graph=False, rounds=2, budget_s=0.001)
    assert set(times) == {"a", "b", "c"}
    turns = [name for i, name in enumerate(seen) if i == 0 or seen[i - 1] != name]
    assert turns == ["a", "b", "c", "b", "a"]  # c, last of round one, opens round two


def test_in_turn_rounds_keeps_each_round_and_times_none_of_the_warmup_rounds() -> None:
    """A warm-up round runs every runner in turn before the timed rounds and is not kept: a
    runner slow for its first calls (a library's first uses) is timed once it is warm."""
    calls: list[str] = []
    slow_calls = 11  # a's whole first round: 3 warm-up calls, a probe of 3, 5 timed

    def call(name: str):
        def run() -> None:
            calls.append(name)
            time.sleep(0.02 if len(calls) <= slow_calls else 0.0)

        return run

    timed = {name: (call(name), [()]) for name in ("a", "b")}
    options = {"graph": False, "rounds": 3, "budget_s": 0.001}
    cold = runner.in_turn_rounds(timed, "cpu", **options)
    assert cold["a"][0].median_us > 10_000  # without a warm-up round, a's first round is slow
    calls.clear()
    warm = runner.in_turn_rounds(timed, "cpu", warmup_rounds=1, **options)
    assert {name: len(ts) for name, ts in warm.items()} == {"a": 3, "b": 3}
    assert max(t.median_us for ts in warm.values() for t in ts) < 10_000
    times = runner.in_turn(timed, "cpu", **options)
    assert times == pytest.approx({"a": 0.0, "b": 0.0}, abs=10_000)


def test_in_turn_rounds_times_sustained_stretches_when_asked():
    """GPU-bound rows are retimed over stretches of calls back to back (the power limit's
    clock), not over a short budget: many more calls a round."""
    timed = {"a": (lambda: time.sleep(0.001), [()])}
    short = runner.in_turn_rounds(timed, "cpu", graph=False, rounds=1, budget_s=0.001)
    held = runner.in_turn_rounds(timed, "cpu", graph=False, rounds=1, sustained_s=0.05)
    assert short["a"][0].reps < timing.SUSTAINED_BATCH <= held["a"][0].reps


def rounds_of(**us: list[float]) -> runner.Rounds:
    """Rounds as ``in_turn_rounds`` returns them, one timing of each median a round."""
    return {name: [timing.Timing(t, t, t, 10, t) for t in ts] for name, ts in us.items()}


def test_rounds_spread_is_the_widest_of_any_runner():
    """(max - min) / median of each runner's round times; the widest decides."""
    rounds = rounds_of(steady=[10.0, 10.2, 9.9, 10.1], shaken=[50.8, 143.5, 112.6, 79.9])
    assert runner.rounds_spread(rounds) == pytest.approx((143.5 - 50.8) / 96.25)
    assert runner.rounds_spread(rounds_of(one=[12.0])) == 0.0
    assert runner.rounds_spread({}) == 0.0


def test_disturbed_rounds_are_taken_again_and_the_steadier_take_judged():
    """A take whose rounds spread past the limit (something ran beside some of them) is taken
    again; the steadier of the two is returned, with the first for the record. A steady first
    take is not taken again."""
    takes = iter([rounds_of(a=[53.2, 87.7, 61.0, 49.6], b=[50.8, 143.5, 112.6, 79.9]),
                  rounds_of(a=[49.9, 50.1, 49.8, 50.0], b=[48.6, 48.9, 48.5, 48.7])])  # fmt: skip
    judged, first = runner.steadier_rounds(lambda: next(takes), limit=0.5)
    assert [t.median_us for t in judged["b"]] == [48.6, 48.9, 48.5, 48.7]
    assert first is not None and [t.median_us for t in first["b"]][1] == 143.5

    worse = iter([rounds_of(a=[10.0, 20.0]), rounds_of(a=[10.0, 30.0])])
    judged, first = runner.steadier_rounds(lambda: next(worse), limit=0.5)
    assert [t.median_us for t in judged["a"]] == [10.0, 20.0] and first is not None

    steady = iter([rounds_of(a=[10.0, 10.5])])  # a second take would raise StopIteration
    judged, first = runner.steadier_rounds(lambda: next(steady), limit=0.5)
    assert first is None and len(judged["a"]) == 2


def test_ctrl_c_writes_the_rows_done_then_goes_on(tmp_path: Path) -> None:
    """Ctrl-C during the second problem: the first row is written under the suite's partial
    name, marked interrupted, and the interrupt reaches the caller (the command exits as
    interrupted)."""

    def tuner(key: Key, options: TuneOptions) -> TuneOutcome:
        if key == PROBLEMS[1][1]:
            raise KeyboardInterrupt
        return tune(key, options=options)

    with pytest.raises(KeyboardInterrupt):
        runner.run_suite("cut", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS, tuner=tuner)
    written = json.loads((tmp_path / "cut.interrupted.json").read_text())
    assert written["interrupted"] is True
    assert [r["label"] for r in written["rows"]] == ["decode"]
    assert (tmp_path / "cut.interrupted.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "cut.json").exists() and not (tmp_path / "cut.png").exists()


def test_ctrl_c_keeps_an_earlier_complete_result_and_says_where_the_rows_went(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run cut short into a folder holding a complete result of the same suite leaves that
    JSON and PNG as they were; its rows go beside them, and the console names both. A complete
    run after it replaces the result and removes the partial files it supersedes."""
    complete = runner.run_suite("s", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS)
    before = {ext: (tmp_path / f"s.{ext}").read_bytes() for ext in ("json", "png")}

    def tuner(key: Key, options: TuneOptions) -> TuneOutcome:
        if key == PROBLEMS[1][1]:
            raise KeyboardInterrupt
        return tune(key, options=options)

    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        runner.run_suite("s", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS, tuner=tuner)
    assert {ext: (tmp_path / f"s.{ext}").read_bytes() for ext in ("json", "png")} == before
    assert json.loads(before["json"]) == complete and "interrupted" not in complete
    partial = json.loads((tmp_path / "s.interrupted.json").read_text())
    assert partial["interrupted"] is True and len(partial["rows"]) == 1
    said = " ".join(capsys.readouterr().out.split())
    assert str(tmp_path / "s.interrupted.json") in said
    assert (
        "without 1 of its 2 rows" in said
        and "the complete s.json of an earlier run is kept" in said
    )
    runner.run_suite("s", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS)
    assert not list(tmp_path.glob("s.interrupted.*"))


def test_ctrl_c_after_the_rows_saves_this_runs_result_as_interrupted_and_goes_on(
    tmp_path: Path,
) -> None:
    """A suite's later steps (bf16 twins, retimes, Inductor) cut short: the rows in hand are
    saved under the partial name, marked interrupted, beside an earlier complete result that
    stays; the interrupt reaches the caller. Without an interrupt nothing is written, nor where
    nothing was in hand or run_suite saved the rows already."""
    (tmp_path / "s.json").write_text('{"rows": [], "complete": true}')
    result = {"rows": [{"label": "a"}]}
    with (
        pytest.raises(KeyboardInterrupt),
        runner.marked_if_interrupted(tmp_path, "s", result, "its bf16 columns"),
    ):
        raise KeyboardInterrupt
    saved = json.loads((tmp_path / "s.interrupted.json").read_text())
    assert saved == {"rows": [{"label": "a"}], "interrupted": True}
    assert (tmp_path / "s.json").read_text() == '{"rows": [], "complete": true}'
    with runner.marked_if_interrupted(tmp_path, "t", {"rows": []}, "nothing"):
        pass
    # cut short before run_suite returned (nothing in hand), or in its rows (saved there already)
    for result in ({}, {"rows": [], "interrupted": True}):
        with (
            pytest.raises(KeyboardInterrupt),
            runner.marked_if_interrupted(tmp_path, "t", result, "all"),
        ):
            raise KeyboardInterrupt
    assert not (tmp_path / "t.interrupted.json").exists()


def test_a_plot_cut_short_leaves_the_png_before_it_and_writes_no_json(tmp_path: Path) -> None:
    """Ctrl-C while a complete result's PNG is drawn: the earlier PNG and JSON stay as they
    were (the JSON is written after the plot), with no half-drawn file left."""
    for ext in ("json", "png"):
        (tmp_path / f"s.{ext}").write_text(f"earlier {ext}")

    def draw(result: dict, png: Path) -> None:
        png.write_bytes(b"half a plot")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.save_result(tmp_path, "s", {"rows": [{"label": "a"}]}, draw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json", "s.png"]
    assert [(tmp_path / f"s.{ext}").read_text() for ext in ("json", "png")] == [
        "earlier json",
        "earlier png",
    ]


def test_a_result_without_a_plot_leaves_no_earlier_png_beside_it(tmp_path: Path) -> None:
    """An interrupted run with no row yet draws nothing: the partial PNG of an earlier cut
    run must not stand beside this run's JSON as if it were its plot."""

    def draw(result: dict, png: Path) -> None:
        png.write_text(f"a plot of {len(result['rows'])} rows")

    runner.save_result(tmp_path, "s", {"rows": [{"label": "a"}], "interrupted": True}, draw)
    runner.save_result(tmp_path, "s", {"rows": [], "interrupted": True}, draw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.interrupted.json"]


def test_ctrl_c_while_the_table_prints_saves_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row measured, then Ctrl-C while the table prints: the rows are saved as an
    interrupted result, not lost."""

    def print_table(rows: list) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "print_table", print_table)
    with pytest.raises(KeyboardInterrupt):
        runner.run_suite("s", PROBLEMS, out_dir=tmp_path, title="t", options=OPTIONS, plot=False)
    saved = json.loads((tmp_path / "s.interrupted.json").read_text())
    assert len(saved["rows"]) == len(PROBLEMS) and saved["interrupted"] is True
