"""bench/gemv_ab.py: two versions' w4a16_decode_grid.py runs paired row by row, or one run's
bench twins beside the product's builds (CPU)."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path

from tests.bench_scripts import BENCH, load_script

ab = load_script("gemv_ab")
CFG = {"split": "k", "slices": 4, "stages": 2, "warps": 8, "cluster": 1}


def run(*rows: dict) -> dict:
    return {"device": {"name": "NVIDIA H200"}, "rows": list(rows)}


def row(proj: str, m: int, impl: str, us: float, **extra) -> dict:
    return {"proj": proj, "m": m, "impl": impl, "us": us, **extra}


def test_each_side_reads_its_fastest_run_and_the_ratio_is_new_over_base() -> None:
    base = [
        run(row("gate_up", 1, "cuda_gemv", 21.6, config=CFG), row("gate_up", 1, "bf16", 56.0)),
        run(row("gate_up", 1, "cuda_gemv", 21.4, config=CFG), row("gate_up", 1, "bf16", 57.0)),
    ]
    new = [
        run(row("gate_up", 1, "cuda_gemv", 20.9, config=CFG), row("gate_up", 1, "bf16", 56.5)),
        run(row("gate_up", 1, "cuda_gemv", 21.0, config=CFG), row("gate_up", 1, "bf16", 56.2)),
    ]
    result = ab.compare(base, new)
    by_impl = {r["impl"]: r for r in result["rows"]}
    assert (by_impl["cuda_gemv"]["base_us"], by_impl["cuda_gemv"]["new_us"]) == (21.4, 20.9)
    assert by_impl["cuda_gemv"]["ratio"] == round(20.9 / 21.4, 4)
    assert by_impl["cuda_gemv"]["config"] == CFG and by_impl["bf16"]["config"] is None
    assert result["runs"] == {"base": 2, "new": 2}


def test_failed_and_out_of_bound_rows_are_left_out_and_counted() -> None:
    other = {**CFG, "cluster": 2}
    base = [
        run(
            row("down", 8, "cuda_gemv", 13.4, config=CFG, excess=0.2),
            row("down", 8, "cuda_gemv", 9.0, config=other, excess=3.0),
        )
    ]
    new = [
        run(
            row("down", 8, "cuda_gemv", 13.1, config=CFG, excess=0.3),
            {"proj": "down", "m": 8, "impl": "cuda_gemv", "config": other, "error": "boom"},
        )
    ]
    result = ab.compare(base, new)
    assert [(r["config"], r["ratio"]) for r in result["rows"]] == [(CFG, round(13.1 / 13.4, 4))]
    assert result["left_out"] == {"base": 1, "new": 1}
    assert result["only_base"] == result["only_new"] == []
    text = ab.table(result)
    assert (
        "k,4,2,8,1" in text
        and "left out (failed or past the numerics bound): base 1, new 1" in text
    )


def test_pairs_timed_on_one_side_only_are_listed() -> None:
    base = [run(row("down", 1, "cuda_gemv", 11.5, config=CFG))]
    new = [run(row("down", 1, "cuda_gemv", 11.3, config=CFG), row("down", 4, "w4a16", 15.0))]
    result = ab.compare(base, new)
    assert result["only_new"] == [["down", 4, "w4a16", ""]] and result["only_base"] == []


def test_a_run_from_before_a_config_field_pairs_with_one_that_states_its_default() -> None:
    base = [run(row("down", 16, "cuda_gemv", 14.9, config=CFG))]  # no stagger, teams, carveout
    new = [
        run(
            row("down", 16, "cuda_gemv", 14.8,
                config={**CFG, "stagger": False, "teams": 1, "carveout": None}),
            row("down", 16, "cuda_gemv", 14.1, config={**CFG, "carveout": 72}),
        )
    ]  # fmt: skip
    result = ab.compare(base, new)
    assert [(r["config"], r["ratio"]) for r in result["rows"]] == [(CFG, round(14.8 / 14.9, 4))]
    assert result["only_new"] == [["down", 16, "cuda_gemv", json.dumps({**CFG, "carveout": 72},
                                                                      sort_keys=True)]]  # fmt: skip
    # read as --config takes it: the fields before a carveout at their defaults
    assert ab.config_text({**CFG, "carveout": 72}) == "k,4,2,8,1,0,1,72"
    assert ab.config_text({**CFG, "stagger": True, "teams": 1, "carveout": None}) == "k,4,2,8,1,1"
    assert ab.config_text({"bm": 16, "warps": 4}) == '{"bm": 16, "warps": 4}'


def test_the_command_line_names_a_file_that_is_not_a_run(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(run(row("down", 1, "bf16", 32.0))))
    bad.write_text(json.dumps({"results": []}))
    cmd = [sys.executable, str(BENCH / "gemv_ab.py"), "--base", str(good), "--new", str(bad)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 2 and f"--new {bad}: no 'rows' list" in done.stderr
    out = tmp_path / "ab.json"
    done = subprocess.run([*cmd[:-1], str(good), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and "down" in done.stdout
    assert json.loads(out.read_text())["rows"][0]["ratio"] == 1.0


def test_a_variant_run_puts_each_twin_beside_its_product_build() -> None:
    """Twins whose output is wrong on purpose (x copied once) are kept; a product build past
    the bound is left out, and its twins with it (nothing to be beside)."""
    other = {**CFG, "cluster": 2}
    result = ab.variants(run(
        row("down", 4, "cuda_gemv", 11.6, config=CFG, excess=0.2),
        row("down", 4, "cuda_gemv", 11.5, config=CFG, excess=0.2),  # a second round: the fastest
        row("down", 4, "cuda_gemv_xonce", 10.35, config=CFG, excess=40.0),
        row("down", 4, "cuda_gemv_xca", 11.73, config=CFG, excess=0.2),
        row("down", 4, "cuda_gemv", 9.0, config=other, excess=3.0),
        row("down", 4, "cuda_gemv_xonce", 8.0, config=other, excess=40.0),
        row("down", 4, "bf16", 32.5),
    ))  # fmt: skip
    assert [(r["variant"], r["config"], r["product_us"], r["variant_us"]) for r in result["rows"]] == [
        ("xca", CFG, 11.5, 11.73), ("xonce", CFG, 11.5, 10.35)]  # fmt: skip
    assert result["variants"]["xonce"] == {"rows": 1, "faster": 1, "median": 0.9, "min": 0.9,
                                           "max": 0.9}  # fmt: skip
    assert result["variants"]["xca"]["faster"] == 0 and result["left_out"] == 1
    text = ab.variants_table(result)
    assert (
        "k,4,2,8,1" in text and "xonce: faster on 1 of 1 rows, variant/product median 0.900" in text
    )


def test_the_command_line_takes_one_variant_run_or_two_sides(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps(run(row("down", 1, "cuda_gemv", 11.0, config=CFG),
                                  row("down", 1, "cuda_gemv_copies", 9.9, config=CFG))))  # fmt: skip
    script = [sys.executable, str(BENCH / "gemv_ab.py")]
    done = subprocess.run([*script, "--variants", str(one)], capture_output=True, text=True)
    assert done.returncode == 0 and "copies: faster on 1 of 1 rows" in done.stdout
    for args in (["--variants", str(one), "--base", str(one)], ["--base", str(one)], []):
        done = subprocess.run([*script, *args], capture_output=True, text=True)
        assert done.returncode == 2 and "--base" in done.stderr, args


def suite_row(n: int, k: int, m: int, bf16_us: float, served_us: float) -> dict:
    """A low-bit suite row as `tuner.suites.lowbit.judge` leaves it (graph timing)."""
    return {"n": n, "k": k, "m": m, "timing": "graph", "graph_bf16_us": bf16_us,
            "graph_winner_us": served_us,
            "targets": {ab.DECODE_TARGET: {"goal": 3.0, "value": bf16_us / served_us}}}  # fmt: skip


def test_the_fastest_product_config_is_read_against_the_suites_decode_line(tmp_path: Path) -> None:
    """The line is the suite row's bf16 time over the goal for the same (N, K, M), in the timing
    the suite judges it in; a product build past the numerics bound, a twin (its output right
    or not), and a row the suite does not judge are not read; a winner the suite could not
    capture leaves its served time out, not the row."""
    down = {"proj": "down", "n": 4096, "k": 14336}
    other = {**CFG, "cluster": 2}
    bench_run = run(
        row(m=4, impl="cuda_gemv", us=10.9, config=CFG, excess=0.2, **down),
        row(m=4, impl="cuda_gemv", us=10.6, config=other, excess=0.2, **down),
        row(m=4, impl="cuda_gemv", us=9.0, config={**CFG, "warps": 4}, excess=3.0, **down),
        row(m=4, impl="cuda_gemv_xca", us=8.5, config=CFG, excess=0.2, **down),
        row(m=16, impl="cuda_gemv", us=14.0, config=CFG, excess=0.2, **down),
        row(m=8, impl="cuda_gemv", us=11.0, config=CFG, excess=0.2, **down),
        row(m=2, impl="cuda_gemv", us=10.5, config=CFG, excess=0.2, **down),
    )  # fmt: skip
    uncaptured = suite_row(4096, 14336, 8, 32.1, 11.1)
    del uncaptured["graph_winner_us"]
    eager = {"n": 4096, "k": 14336, "m": 2, "timing": "eager", "bf16_us": 31.5, "winner_us": 10.4,
             "targets": {ab.DECODE_TARGET: {"goal": 3.0, "value": 31.5 / 10.4}}}  # fmt: skip
    suite = {"rows": [suite_row(4096, 14336, 4, 31.8, 10.66), {"n": 1, "k": 1, "m": 4},
                      uncaptured, eager]}  # fmt: skip
    lines = {line["m"]: line for line in ab.against(bench_run, suite)}
    assert sorted(lines) == [2, 4, 8]
    line = lines[4]
    assert (line["proj"], line["config"], line["us"]) == ("down", other, 10.6)
    assert line["need_us"] == 10.6 and line["served_us"] == 10.66
    assert line["over_need"] == 1.0
    assert lines[8]["served_us"] is None and lines[8]["need_us"] == 10.7
    assert lines[2]["need_us"] == 10.5 and lines[2]["served_us"] == 10.4
    text = ab.against_table([line, lines[8]])
    assert "at or under the suite's line: 1 of 2 rows" in text

    bench_file, suite_file = tmp_path / "run.json", tmp_path / "suite.json.xz"
    bench_file.write_text(json.dumps(bench_run))
    suite_file.write_bytes(lzma.compress(json.dumps(suite).encode()))
    script = [sys.executable, str(BENCH / "gemv_ab.py"), "--variants", str(bench_file)]
    done = subprocess.run([*script, "--against", str(suite_file)], capture_output=True, text=True)
    assert done.returncode == 0 and "k,4,2,8,2" in done.stdout and "10.60" in done.stdout
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"rows": [suite_row(3584, 18944, 4, 39.0, 12.4)]}))
    done = subprocess.run([*script, "--against", str(elsewhere)], capture_output=True, text=True)
    assert done.returncode == 2 and "no INT4 decode row of it matches" in done.stderr
    done = subprocess.run([sys.executable, str(BENCH / "gemv_ab.py"), "--base", str(bench_file),
                           "--new", str(bench_file), "--against", str(elsewhere)],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "only with --variants" in done.stderr
