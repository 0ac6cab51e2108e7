"""Cold start: what a fresh host pays to tune Qwen2.5-7B's GEMMs and the odd shapes of the suite.

Each part runs ``tuner tune-all`` as a real command on empty caches of its own (tuner cache,
Triton cache, CUTLASS cache, artifact store), every source on, CUTLASS included:

- ``cold``: pruned (the default): wall time, per-problem compile wait vs timing, kernels compiled
  vs pruned (by rule), the winners' speedups;
- ``everything``: the same with ``--no-prune``; the result compares both runs' winners (the
  pruning must lose no measurable speedup) and their wall times;
- ``warm``: the cold run's tune-all again on the cold run's own caches, every problem retuned
  (``--force``): nothing is left to compile, so this is what timing alone costs per problem.

- ``fleet``: a second host, simulated by empty local caches, runs the same tune-all with the cold
  run's kernels published to a local ``tuner serve`` (``TUNER_SERVER``): wall time, per-problem
  compile wait vs timing, kernels fetched vs compiled here, winners compared with the cold run's;
- ``first-call``: a fresh host (empty caches, the kernels only via the service) runs ``tuner
  sync``, then in a fresh process either ``tuner.warmup()`` and the first call of every winner's
  problem, or no warmup: the first call (served by the baseline while the winner loads), then,
  once the loader is done, that the winner serves. Per-winner latency and resolution kind.

``fleet`` and ``first-call`` start from a cold run's folder (``--cold-from``, default the
``cold`` folder under ``--out``); if it lacks the cache or the kernels, the part runs the cold
tune-all itself first and says so (``cold_run_here``).

``--dry-run`` runs every part on the CPU on a tiny model (Triton through its interpreter), to
check the script itself.

    python bench/cold_start.py --part cold --out bench/results/cold_start
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import duel_costs

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
PARTS = ("cold", "everything", "warm", "fleet", "first-call")
PROBES = ("warmup", "no-warmup")
FIRST_CALL_TARGET_MS = 50.0  # the target for a first call on a warmed host


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
    model = work / "qwen2.5-7b-bf16.yaml"  # the problem set: the model's bf16 GEMMs
    model.write_text(re.sub(r"(?m)^dtypes:.*$", "dtypes: [bf16]", MODEL.read_text()))
    if dry_run:
        model = work / "tiny.yaml"
        model.write_text(TINY)
    return ["--model", str(model), "--config", str(listed), "--op", "gemm"]


def fresh_env(
    run_dir: Path, dry_run: bool, server: tuple[str, str] | None = None
) -> dict[str, str]:
    """Empty caches of this run's own: nothing compiled by an earlier run is found. ``server``:
    (url, token) of the fleet service the run talks to; none otherwise."""
    env = os.environ | {
        "TUNER_CACHE": str(run_dir / "tuner.db"),
        "TRITON_CACHE_DIR": str(run_dir / "triton"),
        "CUTLASS_CACHE_DIR": str(run_dir / "cutlass"),
        "TUNER_ARTIFACTS": str(run_dir / "artifacts"),
        "COLUMNS": "200",
    }
    env.pop("TUNER_SERVER", None)
    env.pop("TUNER_TOKEN", None)
    if server is not None:
        env["TUNER_SERVER"], env["TUNER_TOKEN"] = server
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
    return env


def tune_all(
    run_dir: Path, sources: list[str], extra: list[str], dry_run: bool,
    server: tuple[str, str] | None = None, caches: Path | None = None, profile: bool = False,
) -> dict:  # fmt: skip
    """One tune-all on fresh caches (``caches``: those of an earlier run's folder instead); its
    report, wall time and console output. ``profile``: its processes' cProfile files in
    ``run_dir/profile`` (``TUNER_PROFILE``), summed up in ``profile.txt``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tuner", "tune-all", *sources, "--out", str(run_dir), *extra]
    if dry_run:
        cmd += ["--source", "torch", "--source", "triton_gemm", "--budget", "0.01"]
    cache = (caches or run_dir) / "tuner.db"
    before = duel_costs.last_id(cache)  # an earlier run's caches hold its measurements too
    t0 = time.perf_counter()
    env = fresh_env(caches or run_dir, dry_run, server)
    if profile:
        env["TUNER_PROFILE"] = str(run_dir / "profile")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if profile:
        summarize_profiles(run_dir / "profile", run_dir / "profile.txt")
    console = proc.stdout + proc.stderr
    (run_dir / "console.txt").write_text(console)
    report_path = run_dir / "report.json"
    if not report_path.exists():
        raise RuntimeError(
            f"tune-all wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    report = json.loads(report_path.read_text())
    return {
        "command": cmd[2:], "exit": proc.returncode, "wall_s": wall, "report": report,
        "console": console, "cache": cache, "measurements_after": before,
    }  # fmt: skip


def summarize_profiles(folder: Path, out: Path, top: int = 45) -> None:
    """Each process's heaviest calls by cumulative time, and the imports' total, as text."""
    import io
    import pstats

    with out.open("w") as f:
        f.write(f"import tuner.cli.main in a fresh interpreter: {import_seconds():.2f} s\n")
        f.write(heaviest_imports())
        for path in sorted(folder.glob("*.prof")):
            text = io.StringIO()
            stats = pstats.Stats(str(path), stream=text)
            stats.sort_stats("cumulative").print_stats(top)
            f.write(f"\n===== {path.name}\n{text.getvalue()}")


def import_seconds() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import tuner.cli.main"], check=True)
    return time.perf_counter() - t0


def heaviest_imports(top: int = 30) -> str:
    """``python -X importtime`` of the CLI: the modules with the most cumulative time."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import tuner.cli.main"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    rows = []
    for line in proc.stderr.splitlines():
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]), parts[2].rstrip()))
    rows.sort(reverse=True)
    return "".join(f"{us / 1e6:8.3f} s {name}\n" for us, name in rows[:top])


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


def recorded(run: dict) -> dict:
    """What the result file keeps of one tune-all, with the duels that confirmed its winners by
    kind (``duel_costs``: K kept, l lost; s at the power limit, - short) and the lost ones by
    each test they failed."""
    after = run["measurements_after"]
    return {
        "wall_s": run["wall_s"], "exit": run["exit"], "command": run["command"],
        "summary": run["report"]["summary"], "problems": problems(run),
        "duels": duel_costs.by_kind(duel_costs.duels(run["cache"], after)),
        "lost_duels_failed": dict(duel_costs.loss_reasons(run["cache"], after).most_common()),
    }  # fmt: skip


def console_count(console: str, pattern: str) -> int | None:
    """A count tune-all printed (``fleet: fetched N ...``), None if it printed none."""
    found = re.search(pattern, console)
    return int(found.group(1)) if found else None


def kernels_source(
    args: argparse.Namespace, sources: list[str], extra: list[str]
) -> tuple[Path, dict | None]:
    """The folder of a cold run with its cache, report and kernel store; a cold tune-all run
    here first (returned too) when the named folder lacks them (a bench call's kernels are
    not kept past the call)."""
    folder = args.cold_from or args.out / "cold"
    needed = ("tuner.db", "report.json", "artifacts/index.db")
    if all((folder / n).exists() for n in needed):
        return folder, None
    folder = args.out / "cold"
    shutil.rmtree(folder, ignore_errors=True)
    print(
        f"no cold run with kernels at {args.cold_from or folder}: running the cold tune-all first"
    )
    return folder, recorded(tune_all(folder, sources, extra, args.dry_run))


def publish(url: str, token: str, source: Path, workdir: Path, *, winners: bool) -> dict:
    """Publish ``source``'s compiled kernels to the service (push_artifacts); ``winners``: its
    measurements too, by ``tuner push`` from a copy of its cache (the push cursor stays out of
    the source's)."""
    from tuner.cache.artifacts import ArtifactStore
    from tuner.fleet.artifact_sync import push_artifacts
    from tuner.fleet.client import FleetClient

    with FleetClient(url, token) as client, ArtifactStore(source / "artifacts") as kernels:
        sent = push_artifacts(client, kernels)
    out: dict[str, Any] = {"kernels_published": sent.published, "kernels_present": sent.present,
                           "kernels_conflicting": sent.conflicts}  # fmt: skip
    if winners:
        cache = workdir / "publisher.db"
        shutil.copy(source / "tuner.db", cache)
        env = os.environ | {"TUNER_SERVER": url, "TUNER_TOKEN": token, "TUNER_CACHE": str(cache)}
        proc = run_logged([sys.executable, "-m", "tuner", "push"], env, workdir / "push.txt")
        out["push"] = proc.stdout.strip()
    return out


def run_logged(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.CompletedProcess:
    """A command that must succeed, its output kept in ``log``."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[2:])} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return proc


def winners_of(report: dict) -> dict[str, str | None]:
    return {r["key"]: r.get("candidate") for r in report["rows"]}


def fleet_part(args: argparse.Namespace, sources: list[str], extra: list[str]) -> dict:
    """The cold tune-all on a second host: empty caches, the cold run's kernels on a local
    ``tuner serve`` fetched before anything compiles."""
    from server.live import SubprocessServer

    source, cold_here = kernels_source(args, sources, extra)
    work = args.out / "fleet"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with SubprocessServer(work / "fleet.db", log=work / "serve.log") as srv:
        token = srv.token("builder", "build")
        published = publish(srv.url, token, source, work, winners=False)
        run = tune_all(work / "host", sources, extra, args.dry_run, server=(srv.url, token))
    cold = json.loads((source / "report.json").read_text())
    mine, theirs = winners_of(run["report"]), winners_of(cold)
    same = [k for k in mine if k in theirs and mine[k] == theirs[k]]
    result = recorded(run) | {
        "cold_from": str(source), "cold_run_here": cold_here is not None,
        "published": published,
        "kernels_fetched": console_count(run["console"], r"fleet: fetched (\d+) compiled kernels"),
        "kernels_compiled_here": console_count(run["console"], r"fleet: published (\d+) compiled kernels"),
        "winners_same": len(same), "winners_compared": sum(k in theirs for k in mine),
        "winners_differing": [{"key": k, "fleet": mine[k], "cold": theirs[k]}
                              for k in mine if k in theirs and mine[k] != theirs[k]],
        "comparison": compare({"report": cold}, run),
    }  # fmt: skip
    if cold_here is not None:
        result["cold"] = cold_here
    return result


def first_call_part(args: argparse.Namespace, sources: list[str], extra: list[str]) -> dict:
    """A fresh host per mode: ``tuner sync`` from a local service holding a tuned cache's
    winners and kernels, then a fresh process timing the first call of every winner."""
    from server.live import SubprocessServer

    source, cold_here = kernels_source(args, sources, extra)
    work = args.out / "first_call"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    result: dict[str, Any] = {"cold_from": str(source), "cold_run_here": cold_here is not None}
    with SubprocessServer(work / "fleet.db", log=work / "serve.log") as srv:
        # admin: the first winner of a key far from its baseline is served without a second voice
        result["published"] = publish(
            srv.url, srv.token("builder", "admin"), source, work, winners=True
        )
        for mode in PROBES:
            host = work / mode
            env = fresh_env(host, args.dry_run, (srv.url, srv.token(mode, "read")))
            host.mkdir()
            t0 = time.perf_counter()
            synced = run_logged([sys.executable, "-m", "tuner", "sync"], env, host / "sync.txt")
            sync_s = time.perf_counter() - t0
            out = host / "probe.json"
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--probe",
                mode,
                "--out",
                str(out),
            ]
            run_logged(cmd, env, host / "probe.txt")
            result[mode] = {
                "sync_s": sync_s,
                "sync": synced.stdout.strip(),
                **summarize_probe(json.loads(out.read_text())),
            }
    if cold_here is not None:
        result["cold"] = cold_here
    return result


def summarize_probe(probe: dict) -> dict:
    """The probe's rows and a summary: first-call latency and how each call was served."""
    rows = probe["rows"]
    ms = [r["first_ms"] for r in rows]
    summary: dict[str, Any] = {
        "winners": len(rows),
        "max_first_ms": max(ms, default=None),
        "median_first_ms": statistics.median(ms) if ms else None,
        "over_target": sum(m > FIRST_CALL_TARGET_MS for m in ms),
        "target_ms": FIRST_CALL_TARGET_MS,
        "first_kinds": {k: sum(r["first_kind"] == k for r in rows) for k in {r["first_kind"] for r in rows}},
    }  # fmt: skip
    builds = [r for r in rows if r["needs_build"]]
    summary["needing_a_build"] = len(builds)
    if probe["mode"] == "no-warmup":
        # never waits for a compile: each winner that needs a build was served by the baseline
        summary["served_by_baseline_while_loading"] = sum(
            r["first_kind"] == "loading" for r in builds
        )
        summary["winner_serves_after_wait"] = sum(
            r["after_wait_candidate"] == r["candidate"] for r in rows
        )
    else:
        summary["winner_serves_first"] = sum(r["first_candidate"] == r["candidate"] for r in rows)
    return {"summary": summary, **{k: v for k, v in probe.items() if k != "mode"}}


def probe(mode: str) -> dict:
    """In a fresh process on a synced host: warm up (``mode`` warmup) or not, then time the
    first call of every winner's problem through the process dispatcher (wall clock around the
    call, device synchronised before and after) and say how it was served; without warmup,
    wait for the background loader and check that each winner then serves."""
    import torch

    import tuner
    from tuner.candidates import registry
    from tuner.core.device import fingerprint
    from tuner.core.keys import parse_key
    from tuner.measure import samples
    from tuner.serving.background import may_compile
    from tuner.serving.dispatcher import get_dispatcher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    disp = get_dispatcher()
    x = torch.ones(8, 8, device=device)
    (x @ x).sum().item()  # the device context and torch's own first call: not the tuner's
    out: dict[str, Any] = {"mode": mode, "device": device}
    if mode == "warmup":
        t0 = time.perf_counter()
        rep = tuner.warmup(progress=False)
        out["warmup"] = {
            "seconds": time.perf_counter() - t0, "winners": rep.winners, "loaded": rep.loaded,
            "ready": rep.ready, "fetched": rep.fetched, "fetch_error": rep.fetch_error,
            "failures": [f.__dict__ for f in rep.failures],
        }  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(0)
    calls = []
    for w in disp.winners(fingerprint(device).device_class):
        key = parse_key(w.key)
        calls.append((w, key, samples.make_inputs(key, device, gen)))
    rows = []
    for w, key, inputs in calls:
        ms, res = first_call(disp, key, inputs, sync)
        rows.append({
            "key": w.key, "candidate": w.candidate, "needs_build": may_compile(registry.get(w.source)),
            "first_ms": ms, "first_kind": res.kind, "first_candidate": res.candidate,
            "resolved_key": res.key,
        })  # fmt: skip
    if mode == "no-warmup":
        out["loader_done"] = disp.loader.wait()
        out["loader_failures"] = dict(disp.loader.failures)
        for row, (_, key, inputs) in zip(rows, calls, strict=True):
            ms, res = first_call(disp, key, inputs, sync)
            row |= {
                "after_wait_ms": ms,
                "after_wait_kind": res.kind,
                "after_wait_candidate": res.candidate,
            }
    out["rows"] = rows
    return out


def first_call(disp: Any, key: Any, inputs: tuple, sync: Any) -> tuple[float, Any]:
    """One call of ``key``'s problem through the dispatcher's public entry point, timed in ms,
    and the resolution that served it."""
    from tuner.core.keys import DTYPES, SdpaKey

    if isinstance(key, SdpaKey):
        causal = {"none": False, "top_left": True}.get(key.causal, key.causal)
        gqa = {"enable_gqa": True}  # a key's kv heads may divide its q heads
        call = lambda: disp.sdpa(*inputs, causal=causal, scale=key.scale, **gqa)  # noqa: E731
        resolve = lambda: disp.resolve_sdpa(*inputs, causal, key.scale, **gqa)  # noqa: E731
    elif key.wdtype == "int4":
        call = lambda: disp.int4_linear(*inputs, key.group)  # noqa: E731
        resolve = lambda: disp.resolve_int4(*inputs, key.group)  # noqa: E731
    elif key.lowbit:
        kw = {"out_dtype": DTYPES[key.out_dtype], "use_fast_accum": key.accum == "fast"}
        call = lambda: disp.scaled_mm(*inputs, **kw)  # noqa: E731
        resolve = lambda: disp.resolve_scaled_mm(*inputs, **kw)  # noqa: E731
    else:
        call = lambda: disp.matmul(*inputs)  # noqa: E731
        resolve = lambda: disp.resolve_gemm(*inputs)  # noqa: E731
    sync()
    t0 = time.perf_counter()
    call()
    sync()
    ms = (time.perf_counter() - t0) * 1e3
    return ms, resolve()[1]


def warm_part(args: argparse.Namespace, sources: list[str], extra: list[str]) -> dict:
    """The cold run's problems retuned on the cold run's caches (run first if this call has
    none: a bench call's compiled kernels are not kept past the call)."""
    cold = args.out / "cold"
    result: dict[str, Any] = {}
    if not all((cold / n).exists() for n in ("tuner.db", "triton")):
        print("no cold run's caches here: running the cold tune-all first")
        result["cold"] = recorded(tune_all(cold, sources, extra, args.dry_run))
    run = tune_all(args.out / "warm", sources, [*extra, "--force"], args.dry_run, caches=cold,
                   profile=args.profile)  # fmt: skip
    result |= recorded(run)
    tuned = result["summary"]["tuned"]
    result["wall_s_per_problem"] = result["wall_s"] / tuned if tuned else None
    return result


def run_part(part: str, args: argparse.Namespace, sources: list[str], extra: list[str]) -> dict:
    """One part's result, with a line on the console."""
    if part == "warm":
        r = warm_part(args, sources, extra)
        per = r["wall_s_per_problem"]
        print(f"warm: {r['wall_s']:.1f} s wall, {per:.2f} s per problem" if per else "warm: none")
        return r
    if part == "fleet":
        r = fleet_part(args, sources, extra)
        print(
            f"fleet: {r['wall_s']:.1f} s wall, fetched {r['kernels_fetched']}, compiled here "
            f"{r['kernels_compiled_here']}, winners same {r['winners_same']}/{r['winners_compared']}"
        )
        return r
    if part == "first-call":
        r = first_call_part(args, sources, extra)
        for mode in PROBES:
            print(f"first call, {mode}: {r[mode]['summary']}")
        return r
    flags = extra + (["--no-prune"] if part == "everything" else [])
    r = recorded(tune_all(args.out / part, sources, flags, args.dry_run))
    s = r["summary"]
    print(
        f"{part}: {r['wall_s']:.1f} s wall, {s['problems']} problems ({s['tuned']} tuned, "
        f"{s['timeout']} timeout), {s['compiled']} compiled, pruned {s['pruned']}, "
        f"geomean {s['geomean_speedup']}"
    )
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="Folder for runs and cold_start.json.")
    ap.add_argument(
        "--part", nargs="+", choices=(*PARTS, "all"), default=["all"],
        help="Parts to run, in this order (all: cold, then everything).",
    )  # fmt: skip
    ap.add_argument("--problem-timeout", type=float, default=200.0)
    ap.add_argument(
        "--time-limit", type=float, help="tune-all's --time-limit: no problem starts after it."
    )
    ap.add_argument(
        "--cold-from",
        type=Path,
        help="A cold run's folder (tuner.db, report.json, artifacts/) for fleet / first-call.",
    )
    ap.add_argument("--dry-run", action="store_true", help="Tiny problems on the CPU.")
    ap.add_argument(
        "--profile", action="store_true",
        help="warm: cProfile the tune-all command and its workers (warm/profile.txt).",
    )  # fmt: skip
    ap.add_argument("--probe", choices=PROBES, help=argparse.SUPPRESS)  # the first-call child
    args = ap.parse_args(argv)
    if args.probe:
        args.out.write_text(json.dumps(probe(args.probe), indent=1))
        return 0
    parts = [
        p for part in args.part for p in (("cold", "everything") if part == "all" else (part,))
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    sources = problem_files(args.out, args.dry_run)
    extra = ["--problem-timeout", str(args.problem_timeout)]
    if args.time_limit:
        extra += ["--time-limit", str(args.time_limit)]
    result_path = args.out / "cold_start.json"
    result = json.loads(result_path.read_text()) if result_path.exists() else {}
    for part in parts:
        result[part] = run_part(part, args, sources, extra)
        if "cold" in result and "everything" in result:
            result["comparison"] = compare(
                {"report": {"rows": result["cold"]["problems"]}},
                {"report": {"rows": result["everything"]["problems"]}},
            )
            print(f"pruned vs everything: geomean ratio {result['comparison']['geomean_ratio']}")
        result_path.write_text(json.dumps(result, indent=1))  # after each part: a cut-off call
        print(f"wrote {result_path}")  # keeps what the parts before it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
