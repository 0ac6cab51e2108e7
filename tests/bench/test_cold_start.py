"""bench/cold_start.py in its --dry-run mode on the CPU: both tune-all runs (pruned,
compile-everything) on fresh caches of their own, the result file and the comparison of their
winners; the fleet part (a real ``tuner serve`` on loopback, a second host's tune-all against it)
and the first-call part (``tuner sync`` on fresh hosts, a fresh process per mode)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.bench_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cold_start.py"
costs = load_script("duel_costs")


def test_dry_run_writes_both_runs_and_their_comparison(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / "cold_start.json").read_text())
    for part in ("cold", "everything"):
        run = result[part]
        assert run["exit"] == 0 and run["summary"]["tuned"] == 5  # 4 model GEMMs + 1 odd shape
        assert (tmp_path / part / "tuner.db").exists()  # each run on its own caches
        titles = [p["title"] for p in run["problems"]]
        assert "5x7x9 nt f32 align 4 (odd.yaml[0])" in titles
        assert all(p["timing_s"] is not None and p["compiled"] is not None for p in run["problems"])
        assert set(run["duels"]) <= {"K-", "l-"}  # by kind; none at a GPU's power limit here
        # what the lost ones failed: on the CPU no graph, so never the GPU's tests
        assert set(run["lost_duels_failed"]) <= {
            "disturbed", "no faster beyond the margin", "its launch not repaid",
            "not ahead in the second take", "second take disturbed",
        }  # fmt: skip
    assert "--no-prune" in result["everything"]["command"]
    assert result["comparison"]["problems"] == 5
    assert result["comparison"]["geomean_ratio"] > 0


def run_part(out: Path, part: str) -> dict:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--part", part, "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "cold_start.json").read_text())[part]


def test_fleet_then_first_call_from_a_real_service(tmp_path):
    fleet = run_part(tmp_path, "fleet")
    assert fleet["cold_run_here"] and fleet["cold"]["summary"]["tuned"] == 5  # no cold run yet
    assert fleet["exit"] == 0 and fleet["summary"]["tuned"] == 5
    assert (tmp_path / "fleet" / "fleet.db").exists()  # the service's own database
    assert (tmp_path / "fleet" / "host" / "tuner.db").exists()  # the second host's empty cache
    assert set(fleet["published"]) >= {"kernels_published", "kernels_present"}
    assert fleet["winners_compared"] == 5
    assert fleet["winners_same"] + len(fleet["winners_differing"]) == 5
    assert all(p["timing_s"] is not None for p in fleet["problems"])

    first = run_part(tmp_path, "first-call")
    assert not first["cold_run_here"]  # the fleet part's cold run is reused
    pushed = re.match(r"pushed (\d+) measurements", first["published"]["push"])
    # 5 winners and their baselines; on a GPU, the other candidates' measurements too
    assert pushed and (int(pushed[1]) > 10 if torch.cuda.is_available() else int(pushed[1]) == 10)
    for mode in ("warmup", "no-warmup"):
        run = first[mode]
        assert "pulled 5 winners" in run["sync"]
        assert run["summary"]["winners"] == 5 and len(run["rows"]) == 5
        assert run["summary"]["max_first_ms"] >= run["summary"]["median_first_ms"] > 0
        assert sum(run["summary"]["first_kinds"].values()) == 5
        assert all(r["resolved_key"] == r["key"] for r in run["rows"])
    warm = first["warmup"]
    assert warm["warmup"]["winners"] == 5 and warm["warmup"]["failures"] == []
    assert warm["summary"]["winner_serves_first"] == 5
    cold = first["no-warmup"]
    assert cold["loader_done"] and cold["loader_failures"] == {}
    assert cold["summary"]["winner_serves_after_wait"] == 5


def test_warm_retunes_every_problem_on_the_cold_runs_caches(tmp_path):
    warm = run_part(tmp_path, "warm")
    assert warm["cold"]["summary"]["tuned"] == 5  # no cold run yet: made first
    assert warm["exit"] == 0 and warm["summary"]["tuned"] == 5  # --force: none skipped
    assert "--force" in warm["command"]
    assert warm["wall_s_per_problem"] == warm["wall_s"] / 5
    assert not (tmp_path / "warm" / "tuner.db").exists()  # the cold run's cache was used
    # each run counts its own duels in the cache they share (on a GPU host the dry run's
    # challengers duel; on a CPU, interpreted Triton never contends and both are empty)
    every = costs.by_kind(costs.duels(tmp_path / "cold" / "tuner.db"))
    runs = [warm["cold"]["duels"], warm["duels"]]
    assert {k: sum(r.get(k, {}).get("duels", 0) for r in runs) for k in every} == {
        k: v["duels"] for k, v in every.items()
    }
