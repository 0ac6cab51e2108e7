"""Cold start: what a fresh host pays to tune Qwen2.5-7B's GEMMs and the odd shapes of the suite.

Each part runs ``tuner tune-all`` as a real command on empty caches of its own (tuner cache,
Triton cache, CUTLASS cache, artifact store), every source on, CUTLASS included:

- ``cold``: pruned (the default): wall time, per-problem compile wait vs timing, kernels compiled
  vs pruned (by rule), the winners' speedups;
- ``everything``: the same with ``--no-prune``; the result compares both runs' winners (the
  pruning must lose no measurable speedup) and their wall times.

Not here yet: the same tune-all with the artifacts fetched from a local ``tuner serve``, and the
first-call latency after ``tuner sync`` + ``tuner warmup`` (``--part fleet`` / ``first-call``
stop with a message saying so).

``--dry-run`` runs both parts on the CPU on a tiny model (Triton through its interpreter), to
check the script itself.

    python bench/cold_start.py --part cold --out bench/results/cold_start
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "configs" / "models" / "qwen2.5-7b.yaml"
TINY = """name: Tiny
hidden_size: 64
intermediate_size: 96
num_heads: 4
num_kv_heads: 2
head_dim: 16
dtypes: [f32]
m_sizes: [1, 16]
ops: [qkv, down]
"""
PARTS = ("cold", "everything", "fleet", "first-call")
NOT_YET = ("fleet", "first-call")


def problem_files(work: Path, dry_run: bool) -> list[str]:
    """tune-all's source arguments: the model and a problem list of the suite's odd shapes
    (``tuner bench gemm --part odd``), each as the key the suite tunes."""
    from tuner.suites.gemm import gemm_key, odd_problems

    keys = (
        [gemm_key(5, 7, 9, layout="nt", dtype="f32")] if dry_run else [k for _, k in odd_problems()]
    )
    entries = []
    for key in keys:
        op, _, fields = str(key).partition(":")
        pairs = (f.split("=", 1) for f in fields.split(","))
        entries.append({"op": op, **{k: int(v) if v.isdigit() else v for k, v in pairs}})
    listed = work / "odd.yaml"
    listed.write_text(json.dumps({"problems": entries}))  # JSON is YAML
    model = MODEL
    if dry_run:
        model = work / "tiny.yaml"
        model.write_text(TINY)
    return ["--model", str(model), "--config", str(listed), "--op", "gemm"]


def fresh_env(run_dir: Path, dry_run: bool) -> dict[str, str]:
    """Empty caches of this run's own: nothing compiled by an earlier run is found."""
    env = os.environ | {
        "TUNER_CACHE": str(run_dir / "tuner.db"),
        "TRITON_CACHE_DIR": str(run_dir / "triton"),
        "CUTLASS_CACHE_DIR": str(run_dir / "cutlass"),
        "TUNER_ARTIFACTS": str(run_dir / "artifacts"),
        "COLUMNS": "200",
    }
    env.pop("TUNER_SERVER", None)
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def tune_all(run_dir: Path, sources: list[str], extra: list[str], dry_run: bool) -> dict:
    """One tune-all on fresh caches; its report, wall time and console output."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tuner.cli", "tune-all", *sources, "--out", str(run_dir), *extra]
    if dry_run:
        cmd += ["--source", "torch", "--source", "triton_gemm", "--budget", "0.01"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=fresh_env(run_dir, dry_run), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (run_dir / "console.txt").write_text(proc.stdout + proc.stderr)
    report_path = run_dir / "report.json"
    if not report_path.exists():
        raise RuntimeError(
            f"tune-all wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    report = json.loads(report_path.read_text())
    return {"command": cmd[2:], "exit": proc.returncode, "wall_s": wall, "report": report}


def problems(run: dict) -> list[dict]:
    """Per problem: shape, status, tuning time split, compiled and pruned, speedup."""
    keep = ("title", "key", "status", "tune_s", "wait_s", "timing_s", "compile_s", "compiled",
            "pruned", "speedup", "candidate")  # fmt: skip
    return [{k: row.get(k) for k in keep} for row in run["report"]["rows"]]


def compare(pruned: dict, everything: dict) -> dict:
    """The winners' speedups side by side: what the pruning cost, per problem and in all."""
    a = {r["key"]: r.get("speedup") for r in pruned["report"]["rows"]}
    b = {r["key"]: r.get("speedup") for r in everything["report"]["rows"]}
    both = [k for k in a if a[k] and b.get(k)]
    rows = [{"key": k, "pruned": a[k], "everything": b[k], "ratio": a[k] / b[k]} for k in both]

    def geomean(xs: list[float]) -> float | None:
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None

    ga, gb = geomean([a[k] for k in both]), geomean([b[k] for k in both])
    return {
        "problems": len(both),
        "geomean_pruned": ga,
        "geomean_everything": gb,
        "geomean_ratio": ga / gb if ga and gb else None,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Folder for runs and cold_start.json.")
    ap.add_argument("--part", choices=(*PARTS, "all"), default="all")
    ap.add_argument("--problem-timeout", type=float, default=200.0)
    ap.add_argument("--dry-run", action="store_true", help="Tiny problems on the CPU.")
    args = ap.parse_args(argv)
    parts = ["cold", "everything"] if args.part == "all" else [args.part]
    missing = [p for p in parts if p in NOT_YET]
    if missing:
        print(f"cold_start: part(s) {', '.join(missing)} not implemented yet", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sources = problem_files(args.out, args.dry_run)
    extra = ["--problem-timeout", str(args.problem_timeout)]
    result_path = args.out / "cold_start.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    for part in parts:
        flags = extra + (["--no-prune"] if part == "everything" else [])
        run = tune_all(args.out / part, sources, flags, args.dry_run)
        s = run["report"]["summary"]
        result[part] = {
            "wall_s": run["wall_s"], "exit": run["exit"], "command": run["command"],
            "summary": s, "problems": problems(run),
        }  # fmt: skip
        print(
            f"{part}: {run['wall_s']:.1f} s wall, {s['problems']} problems ({s['tuned']} tuned, "
            f"{s['timeout']} timeout), {s['compiled']} compiled, pruned {s['pruned']}, "
            f"geomean {s['geomean_speedup']}"
        )
    if "cold" in result and "everything" in result:
        result["comparison"] = compare(
            {"report": {"rows": result["cold"]["problems"]}},
            {"report": {"rows": result["everything"]["problems"]}},
        )
        print(f"pruned vs everything: geomean ratio {result['comparison']['geomean_ratio']}")
    result_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
