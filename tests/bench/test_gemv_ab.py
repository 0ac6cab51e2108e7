"""bench/gemv_ab.py: two versions' w4a16_gemv.py runs paired row by row, or one run's bench twins
beside the product's builds (CPU)."""

from __future__ import annotations

import json
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
