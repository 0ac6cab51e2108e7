"""``tuner serve`` as a separate process: the CLI round trip, and 8 hosts submitting at once.

The soak runs ``TUNER_FLEET_SOAK_S`` seconds (default 10) in the normal suite; the full minute
is marked ``slow`` and runs with ``TUNER_SLOW=1``.
"""

from __future__ import annotations

import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from server.live import SubprocessServer
from tuner.cache import Store
from tuner.cli.main import app
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.fleet.client import FleetClient
from tuner.measure.records import Measurement
from tuner.tuning.engine import TuneOptions, tune

pytestmark = pytest.mark.timeout(300)
FP = fingerprint()
DC = FP.device_class
SOAK_S = float(os.environ.get("TUNER_FLEET_SOAK_S", "10"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    root = tmp_path_factory.mktemp("fleet")
    with SubprocessServer(root / "fleet.db", log=root / "serve.log") as srv:
        yield srv


def cli(*args: str, cache: Path | None = None, **env: str):
    extra = {"TUNER_CACHE": str(cache)} if cache else {}
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **extra, **env})


def test_cli_token_push_sync_round_trip(served: SubprocessServer, tmp_path: Path) -> None:
    made = cli("token", "create", "--db", str(served.db), "--name", "cli-host", "--scope", "submit")
    assert made.exit_code == 0, made.output
    token = made.stdout.strip().splitlines()[-1]
    assert token.startswith("tnr_")
    listed = cli("token", "list", "--db", str(served.db))
    assert "cli-host" in listed.stdout and token.split("_", 2)[2] not in listed.stdout  # no secrets
    key = GemmKey(m=20, n=36, k=44, dtype="f32", out_dtype="f32")
    outcome = tune(key, options=TuneOptions(budget_s=0.03, sources=["torch"]))
    with Store(tmp_path / "a.db") as a:
        a.save_device(FP)
        a.save_run(outcome.measurements, outcome.winner)
    pushed = cli("push", "--server", served.url, "--token", token, cache=tmp_path / "a.db")
    assert pushed.exit_code == 0, pushed.output
    assert f"pushed {len(outcome.measurements)} measurements" in pushed.stdout
    synced = cli("sync", cache=tmp_path / "b.db", TUNER_SERVER=served.url, TUNER_TOKEN=token)
    assert synced.exit_code == 0 and "pulled 1 winner for" in synced.stdout, synced.output
    with Store(tmp_path / "b.db") as b:
        assert b.winner(DC, str(key)).run_id == outcome.winner.run_id
    refused = cli("sync", "--server", served.url, "--token", "tnr_0123456789ab_nope",
                  cache=tmp_path / "b.db")  # fmt: skip
    assert refused.exit_code == 1 and "HTTP 401: invalid token '0123456789ab'" in refused.output
    token_id = token.split("_")[1]
    assert cli("token", "revoke", "--db", str(served.db), token_id).exit_code == 0
    again = cli("sync", "--server", served.url, "--token", token, cache=tmp_path / "b.db")
    assert again.exit_code == 1 and "HTTP 401" in again.output  # revoked: refused at once


def test_another_process_closing_does_not_delete_the_wal_under_us(tmp_path: Path) -> None:
    """A second Store in one process (a new server thread) skips the file header's check while
    others are open: a plain open()/close() would drop this process's SQLite locks, and another
    process closing its connection would then delete the WAL under the open connections."""
    path = tmp_path / "shared.db"
    first, second = Store(path), Store(path)
    Store(path).close()  # same process: the check is skipped while others are open
    subprocess.run(
        [sys.executable, "-c", f"from tuner.cache import Store; Store({str(path)!r}).close()"],
        check=True,
    )
    assert (tmp_path / "shared.db-wal").exists()
    with second.transaction() as c:
        c.execute("insert into sync_state(name, value, updated_at) values ('x', 1, 0)")
    assert first.db.execute("pragma integrity_check").fetchone() == ("ok",)
    first.close()
    second.close()


def submitter(url: str, token: str, seconds: float, keys: list[str], sent: list, errors: list):
    """One host: batches of 25 measurements over a shared key pool, as fast as it can."""
    client = FleetClient(url, token, timeout_s=30)
    rng = random.Random(token)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = []
        for _ in range(25):
            us = rng.uniform(5, 50)
            source = rng.choice(["torch", "triton_gemm"])
            batch.append(Measurement(
                DC, rng.choice(keys), source, {} if source == "torch" else {"bm": 32},
                rng.choice(["ok", "ok", "ok", "cut"]), is_baseline=source == "torch",
                median_us=us, p10_us=us * 0.98, p90_us=us * 1.02, reps=50, versions=FP.version_tag,
            ))  # fmt: skip
        try:
            out = client.submit(FP, batch)
        except Exception as e:  # a failed submit is a lost batch: the test reports it
            errors.append(repr(e))
            continue
        sent.append((batch, out["accepted"]))


@pytest.mark.parametrize(
    "seconds",
    [
        pytest.param(SOAK_S, id="soak"),
        pytest.param(60.0, id="minute", marks=[
            pytest.mark.slow,
            pytest.mark.skipif(os.environ.get("TUNER_SLOW") != "1", reason="set TUNER_SLOW=1"),
        ]),
    ],
)  # fmt: skip
def test_eight_hosts_submitting_at_once_lose_nothing(
    served: SubprocessServer, seconds: float
) -> None:
    keys = [str(GemmKey(m=8 * i, n=64, k=64, dtype="f32", out_dtype="f32")) for i in range(1, 41)]
    tokens = [served.token(f"soak-{i}", "submit") for i in range(8)]
    sent: list[tuple[list[Measurement], int]] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=submitter, args=(served.url, t, seconds, keys, sent, errors))
        for t in tokens
    ]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    assert errors == []
    uids = {m.uid for batch, _ in sent for m in batch}
    assert sum(accepted for _, accepted in sent) == len(uids)  # each one accepted exactly once
    con = sqlite3.connect(served.db)
    mine = "submitter in (" + ",".join("?" * 8) + ")"
    ids = [t.split("_")[1] for t in tokens]
    stored = {u for (u,) in con.execute(f"select uid from srv_measurements where {mine}", ids)}
    assert stored == uids  # nothing lost, nothing invented
    # every concurrent re-merge saw every ok measurement: aggregates match the raw rows
    ok = Counter((m.key, m.candidate) for batch, _ in sent for m in batch if m.status == "ok")
    agg = dict(
        ((k, c), n) for k, c, n in con.execute(
            "select key, candidate, count from srv_results where key in (" + ",".join("?" * len(keys)) + ")", keys,
        )
    )  # fmt: skip
    assert agg == dict(ok)
    print(
        f"\n{len(uids)} measurements from 8 hosts in {elapsed:.1f} s ({len(uids) / elapsed:.0f}/s)"
    )
