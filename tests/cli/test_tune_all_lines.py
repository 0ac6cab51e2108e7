"""The line tune-all prints as each problem ends, read as a user reads it."""

from __future__ import annotations

import io

from rich.console import Console

from tuner.cli.tune_all import _describe
from tuner.core.keys import GemmKey
from tuner.measure.records import ELLIPSIS
from tuner.offline.journal import KEPT_BASELINE, KEPT_FIRST_PASS, PARTIAL
from tuner.offline.problem_set import ProblemSet
from tuner.offline.tune_all import Result

KEY = GemmKey(m=512, n=512, k=512, dtype="f32", out_dtype="f32")
BASELINE = {"candidate": "torch", "baseline_us": 10.0, "median_us": 10.0}


def problems() -> ProblemSet:
    found = ProblemSet()
    found.add(KEY, "list.yaml[0]")
    return found


def test_a_timed_out_problem_says_it_kept_its_baseline():
    error = "ran past the limit of 5 s" + KEPT_BASELINE
    result = Result(KEY, "timeout", 5.0, 0, winner=BASELINE, error=error)
    line = _describe(result, problems())
    assert line.endswith("ran past the limit of 5 s; its baseline kept")


def test_a_second_pass_cut_short_names_its_first_pass_verdict_once():
    error = "second pass: RuntimeError: boom; the first pass's verdict kept"
    result = Result(KEY, "failed", 5.0, 0, winner=BASELINE, error=error, first_pass_s=2.0)
    line = _describe(result, problems())
    assert line.endswith(error) and "baseline" not in line


def test_a_long_second_pass_error_is_cut_before_it_says_the_first_pass_verdict_was_kept():
    error = "second pass: RuntimeError: " + "x" * 400 + KEPT_FIRST_PASS
    result = Result(KEY, "failed", 5.0, 0, winner=BASELINE, error=error, first_pass_s=2.0)
    line = _describe(result, problems())
    assert line.endswith(f"x{ELLIPSIS}{KEPT_FIRST_PASS}")


def test_a_problem_the_run_stopped_between_its_passes_is_not_called_a_failure():
    error = "the run stopped before its second pass" + KEPT_FIRST_PASS
    result = Result(KEY, PARTIAL, 2.0, 0, winner=BASELINE, error=error, first_pass_s=2.0)
    line = _describe(result, problems())
    assert line.startswith("[yellow]partial[/yellow]") and line.endswith(error)


def test_a_problems_label_is_printed_as_it_is_brackets_and_all():
    """A problem list's file name may hold [ ]: the line shows it, not rich markup made of it."""
    found = ProblemSet()
    found.add(KEY, "shapes[v2].yaml[0]")
    console = Console(file=io.StringIO(), width=200)
    for status in ("tuned", "failed"):
        console.print(_describe(Result(KEY, status, 1.0, 0, winner=BASELINE), found))
    lines = console.file.getvalue().splitlines()
    assert all("(shapes[v2].yaml[0])" in line for line in lines), lines
