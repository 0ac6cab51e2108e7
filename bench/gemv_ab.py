"""Two versions of the W4A16 decode kernels side by side, from whole runs of each.

``bench/w4a16_decode_grid.py`` runs of a baseline tree and of this tree, in turns on one machine
(``gpu_check.sh gemv-ab``).

    python bench/gemv_ab.py --base base1.json --base base2.json --new new1.json --new new2.json

``w4a16_decode_grid.py --baseline`` builds another kernel source beside this one in one process,
on one set of operands; a change that moves the weight's layout needs each version's own packing, so
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

    python bench/gemv_ab.py --variants run.json --against gemm_lowbit.json.xz

also puts each row's fastest product config beside the line the low-bit suite's INT4 decode
target draws for the same (N, K, M) in that suite run: its bf16 cuBLAS time over the goal, in
the timing the suite judges (CUDA-graph), and the time the suite served there.
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tuner.candidates import cuda_w4a16
from tuner.suites import lowbit

Row = dict[str, Any]
PRODUCT = "cuda_gemv"  # the product's builds; their twins are "cuda_gemv_NAME"
Pair = tuple[str, int, str, str]  # projection, M, implementation, config


def pair_key(row: Row) -> Pair:
    """A row's pair, its config without the fields at their defaults, so that a run from before
    a field existed (which lacks it) pairs with one that states its default."""
    config = row.get("config")
    if config and row["impl"].startswith(PRODUCT):
        config = {k: v for k, v in config.items() if not _default(k, v)}
    return row["proj"], row["m"], row["impl"], json.dumps(config, sort_keys=True) if config else ""


def _default(key: str, value: Any) -> bool:
    default = cuda_w4a16.DEFAULTS.get(key, ...)
    return type(value) is type(default) and value == default


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


DECODE_TARGET = lowbit.INT4_DECODE.name


def against(run: dict[str, Any], suite: dict[str, Any]) -> list[Row]:
    """Per (projection, M) of ``run``, its fastest product config beside the suite row of the
    same (N, K, M) that the INT4 decode target judges: the time that target asks for (the row's
    bf16 time, as the suite judges it, over the goal) and the time the suite served (None where
    its runner was not captured). A suite row without a bf16 time draws no line."""
    lines = {}
    for r in suite["rows"]:
        verdict = r.get("targets", {}).get(DECODE_TARGET)
        bf16 = lowbit.target_field(r, "bf16_us") if verdict else None
        if bf16:
            lines[r["n"], r["k"], r["m"]] = (
                bf16 / verdict["goal"],
                lowbit.target_field(r, "winner_us"),
            )
    best: dict[tuple[str, int], Row] = {}
    for r in run["rows"]:
        if r["impl"] != PRODUCT or "error" in r or r.get("excess", 0) > 1:
            continue
        key = r["proj"], r["m"]
        if (r["n"], r["k"], r["m"]) in lines and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    out = []
    for (proj, m), r in sorted(best.items()):
        need, served = lines[r["n"], r["k"], m]
        out.append({"proj": proj, "m": m, "config": r["config"], "us": r["us"],
                    "need_us": round(need, 3), "served_us": served and round(served, 3),
                    "over_need": round(r["us"] / need, 4)})  # fmt: skip
    return out


def against_table(rows: list[Row]) -> str:
    lines = [f"{'projection':14s} {'M':>3s} {'fastest config':18s} {'us':>7s} {'needed':>7s} "
             f"{'us/needed':>9s} {'suite served':>12s}"]  # fmt: skip
    for r in rows:
        served = "-" if r["served_us"] is None else f"{r['served_us']:.2f}"
        lines.append(f"{r['proj']:14s} {r['m']:3d} {config_text(r['config']):18s} {r['us']:7.2f} "
                     f"{r['need_us']:7.2f} {r['over_need']:9.3f} {served:>12s}")  # fmt: skip
    met = sum(r["over_need"] <= 1 for r in rows)
    lines.append(f"at or under the suite's line: {met} of {len(rows)} rows")
    return "\n".join(lines)


def config_text(cfg: dict[str, Any] | None) -> str:
    """A W4A16 decode config as ``--config`` takes it (``k,4,2,8,2``; a stagger, teams or
    carveout only up to the last one not at its default, a carveout of None as -1); anything
    else as the head of its JSON."""
    cfg = cfg or {}
    keys = cuda_w4a16.CONFIG_KEYS
    if not all(k in cfg for k in keys[:5]):
        return json.dumps(cfg, sort_keys=True)[:34]
    values = [{**cuda_w4a16.DEFAULTS, **cfg}[k] for k in keys]
    while len(values) > 5 and _default(keys[len(values) - 1], values[-1]):
        values.pop()
    return ",".join("-1" if v is None else str(int(v)) if isinstance(v, bool) else str(v)
                    for v in values)  # fmt: skip


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
                    help="a w4a16_decode_grid.py JSON of the baseline tree "
                         "(repeatable)")  # fmt: skip
    ap.add_argument("--new", action="append", type=Path, default=[],
                    help="a w4a16_decode_grid.py JSON of this tree (repeatable)")  # fmt: skip
    ap.add_argument("--variants", type=Path,
                    help="instead: one w4a16_decode_grid.py --variant run, each twin "
                         "beside its product build")  # fmt: skip
    ap.add_argument("--against", type=Path,
                    help="with --variants: a low-bit suite run (JSON, or .json.xz) whose INT4 "
                         "decode lines the product's fastest configs are read against")  # fmt: skip
    ap.add_argument("--out", type=Path, help="also write the comparison as JSON here")
    args = ap.parse_args()
    if bool(args.variants) == bool(args.base or args.new):
        ap.error("give --variants RUN, or --base and --new runs (not both)")
    if not args.variants and not (args.base and args.new):
        ap.error("--base and --new: each side needs at least one run")
    if args.against and not args.variants:
        ap.error("--against SUITE: only with --variants RUN")

    def load(flag: str, path: Path, what: str = "bench/w4a16_decode_grid.py run") -> dict[str, Any]:
        try:
            raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
            run = json.loads(raw)
        except (OSError, lzma.LZMAError, json.JSONDecodeError) as e:
            ap.error(f"--{flag} {path}: not a readable JSON run ({e})")
        if not isinstance(run, dict) or not isinstance(run.get("rows"), list):
            ap.error(f"--{flag} {path}: no 'rows' list (not a {what})")
        return run

    if args.variants:
        run = load("variants", args.variants)
        result = variants(run)
        print(variants_table(result))
        if args.against:
            suite = load("against", args.against, "low-bit suite run")
            result["against"] = against(run, suite)
            if not result["against"]:
                ap.error(f"--against {args.against}: no INT4 decode row of it matches the run's "
                         "(N, K, M)")  # fmt: skip
            print(against_table(result["against"]))
    else:
        result = compare([load("base", p) for p in args.base], [load("new", p) for p in args.new])
        print(table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
