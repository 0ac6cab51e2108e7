"""Two versions of the W4A16 decode kernels side by side, from whole ``bench/w4a16_gemv.py`` runs
of each: a baseline tree's and this tree's, in turns on one machine (``gpu_check.sh gemv-ab``).

    python bench/gemv_ab.py --base base1.json --base base2.json --new new1.json --new new2.json

``w4a16_gemv.py --baseline`` builds another kernel source beside this one in one process, on one
set of operands; a change that moves the weight's layout needs each version's own packing, so
this pairs rows of separate runs instead. Rows pair on (projection, M, implementation, config);
a side reads its fastest time over its runs (turns on one machine: the fastest is the least
disturbed), and the ratio is new / base. Rows with an error, or whose output missed the numerics
bound (``excess`` > 1), are left out and counted.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Pair = tuple[str, int, str, str]  # projection, M, implementation, config


def pair_key(row: Row) -> Pair:
    config = json.dumps(row.get("config"), sort_keys=True) if row.get("config") else ""
    return row["proj"], row["m"], row["impl"], config


def fastest(runs: Iterable[dict[str, Any]]) -> tuple[dict[Pair, float], int]:
    """Each pair's fastest time over ``runs``, and how many rows were left out (failed, or
    outside the numerics bound)."""
    best: dict[Pair, float] = {}
    dropped = 0
    for run in runs:
        for row in run["rows"]:
            if "error" in row or row.get("excess", 0) > 1:
                dropped += 1
                continue
            key = pair_key(row)
            best[key] = min(best.get(key, float("inf")), row["us"])
    return best, dropped


def compare(base: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, Any]:
    """The pairs both sides timed, with each side's fastest time and new / base; the pairs only
    one side has; each side's device and left-out rows."""
    base_us, base_dropped = fastest(base)
    new_us, new_dropped = fastest(new)
    rows = []
    for key in sorted(base_us.keys() & new_us.keys()):
        proj, m, impl, config = key
        rows.append({"proj": proj, "m": m, "impl": impl,
                     "config": json.loads(config) if config else None,
                     "base_us": base_us[key], "new_us": new_us[key],
                     "ratio": round(new_us[key] / base_us[key], 4)})  # fmt: skip
    return {
        "devices": {"base": [r.get("device") for r in base], "new": [r.get("device") for r in new]},
        "runs": {"base": len(base), "new": len(new)},
        "left_out": {"base": base_dropped, "new": new_dropped},
        "only_base": [list(k) for k in sorted(base_us.keys() - new_us.keys())],
        "only_new": [list(k) for k in sorted(new_us.keys() - base_us.keys())],
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{'projection':14s} {'M':>3s} {'impl':18s} {'config':34s} {'base us':>9s} "
             f"{'new us':>9s} {'new/base':>8s}"]  # fmt: skip
    for r in result["rows"]:
        cfg = r["config"] or {}
        text = ",".join(str(cfg[k]) for k in ("split", "slices", "stages", "warps", "cluster")
                        if k in cfg) or json.dumps(cfg, sort_keys=True)[:34]  # fmt: skip
        lines.append(f"{r['proj']:14s} {r['m']:3d} {r['impl']:18s} {text:34s} "
                     f"{r['base_us']:9.2f} {r['new_us']:9.2f} {r['ratio']:8.3f}")  # fmt: skip
    left = result["left_out"]
    lines.append(f"left out (failed or past the numerics bound): base {left['base']}, "
                 f"new {left['new']}; pairs on one side only: base {len(result['only_base'])}, "
                 f"new {len(result['only_new'])}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", action="append", type=Path, required=True,
                    help="a w4a16_gemv.py JSON of the baseline tree (repeatable)")  # fmt: skip
    ap.add_argument("--new", action="append", type=Path, required=True,
                    help="a w4a16_gemv.py JSON of this tree (repeatable)")  # fmt: skip
    ap.add_argument("--out", type=Path, help="also write the comparison as JSON here")
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "new": []}
    for side, paths in (("base", args.base), ("new", args.new)):
        for path in paths:
            try:
                run = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                ap.error(f"--{side} {path}: not a readable JSON run ({e})")
            if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
                ap.error(f"--{side} {path}: no 'rows' list (not a bench/w4a16_gemv.py run)")
            runs[side].append(run)
    result = compare(runs["base"], runs["new"])
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
