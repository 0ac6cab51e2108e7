"""Fleet service load benchmark (loopback, CPU only): lookups under wrk, and a 100k-winner sync.

    python bench/fleet_load.py                      # writes bench/results/fleet_load.json

1. ``tuner serve`` (one uvicorn worker, a real SQLite file) is started as a subprocess.
2. ``--winners`` winners are submitted through the API (timed: the ingest rate).
3. wrk hits ``GET /v1/winners/{device_class}?key=...`` with a bearer token (reads need one by
   default: each request also checks the token), random keys from the set, one wrk thread
   (one core for wrk, one for the service), at several connection counts.
4. An empty host cache pulls every winner with ``tuner.fleet.sync.pull`` (what ``tuner sync`` and
   the background sync run); repeated on fresh caches, median reported.

Targets (2-core machine): >= 2000 lookups/s with p99 <= 20 ms; 100k-winner sync <= 5 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from server.live import SubprocessServer
from tuner.cache import Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.fleet.client import FleetClient
from tuner.fleet.sync import pull
from tuner.measure.records import Measurement

RESULTS = Path(__file__).parent / "results"
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def machine() -> dict:
    cpu = ""
    if Path("/proc/cpuinfo").exists():
        m = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = m.group(1).strip() if m else ""
    versions = {
        p: importlib.metadata.version(p)
        for p in ("fastapi", "starlette", "uvicorn", "pydantic", "httpx", "sqlite-utils", "torch")
    }
    versions["sqlite"] = sqlite3.sqlite_version
    versions["python"] = platform.python_version()
    versions["wrk"] = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0]  # fmt: skip
    for extra in ("uvloop", "httptools"):
        try:
            versions[extra] = importlib.metadata.version(extra)
        except importlib.metadata.PackageNotFoundError:
            versions[extra] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "versions": versions}  # fmt: skip


def seed(client: FleetClient, n: int) -> tuple[list[str], float]:
    """Submit one baseline measurement for each of ``n`` keys: ``n`` served winners."""
    fp = fingerprint()
    keys = [
        str(GemmKey(m=i, n=4096, k=4096, dtype="f32", out_dtype="f32")) for i in range(1, n + 1)
    ]
    started = time.perf_counter()
    for i in range(0, n, 5000):
        batch = [
            Measurement(fp.device_class, k, "torch", {}, "ok", is_baseline=True, median_us=10.0 + j % 7,
                        p10_us=9.9, p90_us=10.1, reps=100, versions=fp.version_tag)
            for j, k in enumerate(keys[i : i + 5000])
        ]  # fmt: skip
        out = client.submit(fp, batch)
        assert out["accepted"] == len(batch), out
    return keys, time.perf_counter() - started


def parse_wrk(text: str) -> dict:
    def ms(value: str) -> float:
        num, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", value).groups()
        return float(num) * UNITS[unit]

    pct = dict(re.findall(r"^\s+(\d+)%\s+([\d.]+(?:us|ms|s))$", text, re.M))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: (.+)", text)
    return {
        "requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
        "requests": int(re.search(r"(\d+) requests in", text).group(1)),
        "latency_ms": {f"p{p}": ms(v) for p, v in pct.items()},
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1) if errors else "",
    }


def run_wrk(
    url: str, token: str, paths: list[str], connections: int, seconds: int, work: Path
) -> dict:
    script = work / "lookups.lua"
    table = ",\n".join(json.dumps(p) for p in paths)
    script.write_text(
        f"local paths = {{\n{table}\n}}\n"
        f'wrk.headers["Authorization"] = "Bearer {token}"\n'
        "math.randomseed(1)\n"
        'request = function() return wrk.format("GET", paths[math.random(#paths)]) end\n'
    )
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {"connections": connections, "threads": 1, "duration_s": seconds, **parse_wrk(out),
            "load_average_after": os.getloadavg()}  # fmt: skip


def time_sync(url: str, token: str, work: Path, repeats: int) -> dict:
    fp = fingerprint()
    runs, pulled = [], 0
    for i in range(repeats):
        path = work / f"host-{i}.db"
        with FleetClient(url, token, timeout_s=60) as client, Store(path) as store:
            started = time.perf_counter()
            result = pull(client, store, fp)
            runs.append(time.perf_counter() - started)
            pulled = result.winners
            assert len(store.winners(fp.device_class)) == pulled
            started = time.perf_counter()
            again = pull(client, store, fp)
            incremental = time.perf_counter() - started
            assert again.winners == 0
    return {"winners": pulled, "runs_s": runs, "median_s": statistics.median(runs),
            "incremental_noop_s": incremental, "page_size": 10000}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--winners", type=int, default=100_000)
    ap.add_argument("--duration", type=int, default=15, help="seconds per wrk run")
    ap.add_argument("--connections", default="1,4,16,64")
    ap.add_argument("--sync-repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "fleet_load.json")
    args = ap.parse_args()
    fp = fingerprint()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with SubprocessServer(work / "fleet.db", log=work / "serve.log") as srv:
            writer = srv.client("bench-writer", "submit")
            reader = srv.token("bench-reader", "read")
            keys, ingest_s = seed(writer, args.winners)
            print(f"seeded {len(keys)} winners in {ingest_s:.1f} s", flush=True)
            paths = [f"/v1/winners/{fp.device_class}?key={quote(k, safe='')}" for k in keys[::max(1, len(keys) // 2000)]]  # fmt: skip
            check = FleetClient(srv.url, reader).request("GET", paths[0])
            assert check["key"] in keys
            lookups = []
            for c in (int(x) for x in args.connections.split(",")):
                r = run_wrk(srv.url, reader, paths, c, args.duration, work)
                print(f"c={c}: {r['requests_per_s']:.0f} lookups/s, p99 {r['latency_ms']['p99']:.2f} ms", flush=True)  # fmt: skip
                lookups.append(r)
            sync = time_sync(srv.url, reader, work, args.sync_repeats)
            print(f"sync {sync['winners']} winners: median {sync['median_s']:.2f} s", flush=True)
    good = [r for r in lookups if r["requests_per_s"] >= 2000 and r["latency_ms"]["p99"] <= 20 and r["non_2xx"] == 0]  # fmt: skip
    result = {
        "benchmark": "fleet_load",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_at_end": os.getloadavg(),
        "setup": {"service": "tuner serve, 1 uvicorn worker (asyncio + h11), SQLite WAL file",
                  "auth": "bearer token on every lookup (reads need a token: default config)",
                  "winners": len(keys), "device_class": fp.device_class,
                  "distinct_lookup_keys": len(paths), "wrk_threads": 1},
        "ingest": {"measurements": len(keys), "seconds": ingest_s,
                   "per_s": len(keys) / ingest_s, "batch": 5000},
        "lookups": lookups,
        "sync": sync,
        "targets": {"lookups_per_s": 2000, "p99_ms": 20, "sync_100k_s": 5},
        "met": {"lookups": [r["connections"] for r in good],
                "sync": sync["median_s"] <= 5 and sync["winners"] >= 100_000},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
