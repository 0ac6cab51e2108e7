"""Two versions of the W4A16 decode kernels side by side, from whole ``bench/w4a16_gemv.py`` runs
of each: a baseline tree's and this tree's, in turns on one machine (``gpu_check.sh gemv-ab``).

    python bench/gemv_ab.py --base base1.json --base base2.json --new new1.json --new new2.json

``w4a16_gemv.py --baseline`` builds another kernel source beside this one in one process, on one
set of operands; a change that moves the weight's layout needs each version's own packing, so
this pairs rows of separate runs instead. Rows pair on (projection, M, implementation, config);
a side reads its fastest time over its runs (turns on one machine: the fastest is the least
disturbed), and the ratio is new / base. Rows with an error, or whose output missed the numerics
bound (``excess`` > 1), are left out and counted.

    python bench/gemv_ab.py --variants run.json

reads one run made with ``--variant NAME=FLAGS`` instead: each config's twins (implementation
``cuda_gemv_NAME``) beside the product's build of the same config (``cuda_gemv``), variant /
product, with a line per variant (rows faster, median and range of the ratio). A bench variant
may leave the output wrong on purpose (copies only, x copied once), so the twins' rows are kept
whatever their ``excess``; the product's are held to the bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Pair = tuple[str, int, str, str]  # projection, M, implementation, config


def pair_key(row: Row) -> Pair:
    config = json.dumps(row.get("config"), sort_keys=True) if row.get("config") else ""
    return row["proj"], row["m"], row["impl"], config


def fastest(
    runs: Iterable[dict[str, Any]], bound: Callable[[Row], bool] = lambda row: True
) -> tuple[dict[Pair, float], int]:
    """Each pair's fastest time over ``runs``, and how many rows were left out (failed, or
    outside the numerics bound where ``bound(row)`` holds it to it)."""
    best: dict[Pair, float] = {}
    dropped = 0
    for run in runs:
        for row in run["rows"]:
            if "error" in row or (bound(row) and row.get("excess", 0) > 1):
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


PRODUCT = "cuda_gemv"


def variants(run: dict[str, Any]) -> dict[str, Any]:
    """Each config's bench twins beside its product build in one ``--variant`` run: per pair
    (projection, M, config) the product's fastest time and each twin's with twin / product; per
    variant, how many of its rows were faster and the median and range of the ratio."""
    best, dropped = fastest([run], bound=lambda row: row["impl"] == PRODUCT)
    rows, ratios = [], {}
    for (proj, m, impl, config), us in sorted(best.items()):
        name = impl.removeprefix(PRODUCT + "_")
        product = best.get((proj, m, PRODUCT, config))
        if impl == PRODUCT or not impl.startswith(PRODUCT + "_") or product is None:
            continue
        ratio = us / product
        ratios.setdefault(name, []).append(ratio)
        rows.append({"proj": proj, "m": m, "variant": name,
                     "config": json.loads(config) if config else None,
                     "product_us": product, "variant_us": us, "ratio": round(ratio, 4)})  # fmt: skip
    summary = {name: {"rows": len(r), "faster": sum(x < 1 for x in r),
                      "median": round(statistics.median(r), 4), "min": round(min(r), 4),
                      "max": round(max(r), 4)} for name, r in sorted(ratios.items())}  # fmt: skip
    return {"device": run.get("device"), "left_out": dropped, "rows": rows, "variants": summary}


def config_text(cfg: dict[str, Any] | None) -> str:
    cfg = cfg or {}
    keys = ("split", "slices", "stages", "warps", "cluster", "stagger", "teams")
    return ",".join(str(int(cfg[k]) if isinstance(cfg[k], bool) else cfg[k])
                    for k in keys if k in cfg) or json.dumps(cfg, sort_keys=True)[:34]  # fmt: skip


def variants_table(result: dict[str, Any]) -> str:
    lines = [f"{'projection':14s} {'M':>3s} {'config':18s} {'variant':12s} {'product us':>10s} "
             f"{'variant us':>10s} {'variant/product':>15s}"]  # fmt: skip
    for r in result["rows"]:
        lines.append(f"{r['proj']:14s} {r['m']:3d} {config_text(r['config']):18s} "
                     f"{r['variant']:12s} {r['product_us']:10.2f} {r['variant_us']:10.2f} "
                     f"{r['ratio']:15.3f}")  # fmt: skip
    for name, v in result["variants"].items():
        lines.append(f"{name}: faster on {v['faster']} of {v['rows']} rows, variant/product "
                     f"median {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})")  # fmt: skip
    lines.append(f"left out (failed, or the product past the numerics bound): {result['left_out']}")
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    lines = [f"{'projection':14s} {'M':>3s} {'impl':18s} {'config':34s} {'base us':>9s} "
             f"{'new us':>9s} {'new/base':>8s}"]  # fmt: skip
    for r in result["rows"]:
        text = config_text(r["config"])
        lines.append(f"{r['proj']:14s} {r['m']:3d} {r['impl']:18s} {text:34s} "
                     f"{r['base_us']:9.2f} {r['new_us']:9.2f} {r['ratio']:8.3f}")  # fmt: skip
    left = result["left_out"]
    lines.append(f"left out (failed or past the numerics bound): base {left['base']}, "
                 f"new {left['new']}; pairs on one side only: base {len(result['only_base'])}, "
                 f"new {len(result['only_new'])}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", action="append", type=Path, default=[],
                    help="a w4a16_gemv.py JSON of the baseline tree (repeatable)")  # fmt: skip
    ap.add_argument("--new", action="append", type=Path, default=[],
                    help="a w4a16_gemv.py JSON of this tree (repeatable)")  # fmt: skip
    ap.add_argument("--variants", type=Path,
                    help="instead: one w4a16_gemv.py --variant run, each twin beside its product build")  # fmt: skip
    ap.add_argument("--out", type=Path, help="also write the comparison as JSON here")
    args = ap.parse_args()
    if bool(args.variants) == bool(args.base or args.new):
        ap.error("give --variants RUN, or --base and --new runs (not both)")
    if not args.variants and not (args.base and args.new):
        ap.error("--base and --new: each side needs at least one run")

    def load(flag: str, path: Path) -> dict[str, Any]:
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"--{flag} {path}: not a readable JSON run ({e})")
        if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
            ap.error(f"--{flag} {path}: no 'rows' list (not a bench/w4a16_gemv.py run)")
        return run

    if args.variants:
        result = variants(load("variants", args.variants))
        print(variants_table(result))
    else:
        result = compare([load("base", p) for p in args.base], [load("new", p) for p in args.new])
        print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
