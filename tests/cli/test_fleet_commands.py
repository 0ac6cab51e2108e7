"""The fleet commands (tuner.cli.fleet): ``tuner token``, ``tuner push`` and ``tuner sync`` against a
real ``tuner serve`` on loopback, moving results between two local caches; and what the commands
that need the service say when it is not there.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from server.live import SubprocessServer, free_port
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


@pytest.fixture
def served(tmp_path: Path) -> Iterator[SubprocessServer]:
    """A service of its own per test: what a sync pulls is exactly what that test pushed."""
    with SubprocessServer(tmp_path / "fleet.db", log=tmp_path / "serve.log") as srv:
        yield srv


def cli(*args: str, cache: Path | None = None, **env: str) -> Result:
    """``tuner ARGS`` in this process, with TUNER_CACHE set to ``cache`` where given."""
    extra = {"TUNER_CACHE": str(cache)} if cache else {}
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **extra, **env})


def tuner_process(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m tuner ARGS`` as its own process: its real exit status and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "tuner", *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "200", **env},
    )  # fmt: skip


def test_an_option_value_refused_names_the_variable_only_where_it_came_from_there() -> None:
    """A refused ``--timeout inf`` names the option alone when no variable is set: the error
    names ``TUNER_SERVER_TIMEOUT`` only where its value is the one refused."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    typed = tuner_process("sync", "--server", nowhere, "--timeout", "inf")
    assert typed.returncode == 2 and typed.stderr.startswith(
        "error: Invalid value for '--timeout': must be a finite number of at least 0.1, got inf"
    ), typed.stderr
    from_env = tuner_process("sync", "--server", nowhere, TUNER_SERVER_TIMEOUT="inf")
    assert from_env.returncode == 2
    assert "Invalid value for '--timeout' (env var: 'TUNER_SERVER_TIMEOUT')" in from_env.stderr


def tuned_cache(path: Path, *ms: int) -> dict[str, str]:
    """A local cache holding torch's tuned result for an (M, 24, 40) f32 GEMM per ``ms``;
    returns each key's winning run id."""
    runs = {}
    with Store(path) as store:
        store.save_device(FP)
        for m in ms:
            key = GemmKey(m=m, n=24, k=40, dtype="f32", out_dtype="f32")
            outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=["torch"]))
            store.save_run(outcome.measurements, outcome.winner)
            runs[str(key)] = outcome.winner.run_id
    return runs


def new_token(served: SubprocessServer, name: str, *scopes: str) -> str:
    args = ["token", "create", "--db", str(served.db), "--name", name]
    for scope in scopes:
        args += ["--scope", scope]
    made = cli(*args)
    assert made.exit_code == 0, made.output
    return made.stdout.strip().splitlines()[-1]


def test_token_scopes_are_enforced_and_revocation_is_listed(
    served: SubprocessServer, tmp_path: Path
) -> None:
    reader = new_token(served, "reader-host", "read")
    writer = new_token(served, "writer-host", "submit")
    tuned_cache(tmp_path / "a.db", 12)
    refused = cli("push", "--server", served.url, "--token", reader, cache=tmp_path / "a.db")
    assert refused.exit_code == 1  # read cannot submit
    assert "token " in refused.output and "has scopes ['read']; this needs 'submit'" in (
        refused.output
    )
    with Store(tmp_path / "empty.db"):  # nothing to send: the scope is checked all the same
        pass
    for args, needs in ((), "'submit'"), (("--artifacts",), "'build'"):
        refused = cli("push", *args, "--server", served.url, "--token", reader,
                      cache=tmp_path / "empty.db")  # fmt: skip
        assert refused.exit_code == 1 and f"this needs {needs}" in refused.output, refused.output
    anonymous = cli("push", "--server", served.url, cache=tmp_path / "empty.db", TUNER_TOKEN="")
    assert anonymous.exit_code == 1 and "pass --token or set TUNER_TOKEN" in anonymous.output
    pushed = cli("push", "--server", served.url, "--token", writer, cache=tmp_path / "a.db")
    assert pushed.exit_code == 0, pushed.output
    # sync --push with a read token: the push is refused, the pull still comes, the exit is 1
    tuned_cache(tmp_path / "b.db", 20)
    synced = cli("sync", "--push", "--server", served.url, "--token", reader,
                 "--no-artifacts", cache=tmp_path / "b.db")  # fmt: skip
    assert synced.exit_code == 1 and "push refused" in synced.stdout and "HTTP 403" in synced.stdout
    assert "pulled 1 winner" in synced.stdout, synced.output
    reader_id = reader.split("_")[1]
    assert cli("token", "revoke", "--db", str(served.db), reader_id).exit_code == 0
    listed = cli("token", "list", "--db", str(served.db)).stdout
    rows = {line.split("│")[2].strip(): line for line in listed.splitlines() if "-host" in line}
    assert "read " in rows["reader-host"] and "submit" in rows["writer-host"]
    assert rows["reader-host"].count(":") > rows["writer-host"].count(":")  # a revoked time
    twice = cli("token", "revoke", "--db", str(served.db), reader_id)
    assert isinstance(twice.exception, ValueError) and "already revoked" in str(twice.exception)


def test_push_sends_results_and_misses_once_and_sync_brings_them_to_another_cache(
    served: SubprocessServer, tmp_path: Path
) -> None:
    token = new_token(served, "pusher", "submit")
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    runs = tuned_cache(a, 3, 5)
    missed = str(GemmKey(m=7, n=24, k=40, dtype="f32", out_dtype="f32"))
    with Store(a) as store:
        store.record_misses(DC, [missed], count=4)
        sent = len(store.measurements(DC))
    server = {"TUNER_SERVER": served.url, "TUNER_TOKEN": token}

    first = cli("push", cache=a, **server)
    assert first.exit_code == 0, first.output
    assert f"pushed {sent} measurements (0 already there), 1 missed keys (1 newly queued)" in (
        first.stdout
    )
    again = cli("push", cache=a, **server)
    assert "pushed 0 measurements (0 already there), 0 missed keys (0 newly queued)" in again.stdout
    with FleetClient(served.url, token) as client:
        assert missed in {row["key"] for row in client.queue(device_class=DC)}

    pulled = cli("sync", cache=b, **server)
    assert pulled.exit_code == 0 and "pulled 2 winners" in pulled.stdout, pulled.output
    gpu = not DC.startswith("cpu")  # a CPU host says why it fetched no kernels
    assert ("compiled kernels" if gpu else "fetched no compiled kernels: no GPU on this host") in (
        pulled.stdout
    )
    with Store(a) as store_a, Store(b) as store_b:
        for key, run_id in runs.items():
            there, here = store_a.winner(DC, key), store_b.winner(DC, key)
            assert here.run_id == run_id
            assert (here.source, here.params, here.median_us) == (
                there.source, there.params, there.median_us
            )  # fmt: skip
    assert "pulled 0 winners" in cli("sync", cache=b, **server).stdout  # incremental
    assert "pulled 2 winners" in cli("sync", "--full", cache=b, **server).stdout


def test_sync_push_sends_this_cache_before_pulling(
    served: SubprocessServer, tmp_path: Path
) -> None:
    token = new_token(served, "both-ways", "submit")
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    runs = tuned_cache(b, 9)
    server = {"TUNER_SERVER": served.url, "TUNER_TOKEN": token}
    both = cli("sync", "--push", cache=b, **server)
    assert both.exit_code == 0, both.output
    assert both.stdout.index("pushed") < both.stdout.index("pulled")
    assert cli("sync", cache=a, **server).exit_code == 0
    with Store(a) as store:
        assert {k: store.winner(DC, k).run_id for k in runs} == runs


def test_push_and_sync_serve_every_gpu_class_of_the_host(
    served: SubprocessServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host of two GPU models (``host_fingerprints``: one per class, here FP and a second
    class beside it): ``push`` reports each class's misses and ``sync`` pulls each class's
    winners, a line each."""
    other = dataclasses.replace(FP, name="Other GPU", sm_count=FP.sm_count + 1)
    monkeypatch.setattr("tuner.cli.fleet.host_fingerprints", lambda: [FP, other])
    token = new_token(served, "two-classes", "submit")
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    tuned_cache(a, 3)
    missed = str(GemmKey(m=7, n=24, k=40, dtype="f32", out_dtype="f32"))
    tuned_there = str(GemmKey(m=5, n=24, k=40, dtype="f32", out_dtype="f32"))
    with Store(a) as store:
        store.save_device(other)
        store.save_run([
            Measurement(other.device_class, tuned_there, "torch", {}, "ok", is_baseline=True,
                        median_us=7.0, versions=other.version_tag)
        ])  # fmt: skip
        store.record_misses(DC, [missed], count=2)
        store.record_misses(other.device_class, [missed], count=5)
    server = {"TUNER_SERVER": served.url, "TUNER_TOKEN": token}

    pushed = cli("push", cache=a, **server)
    assert pushed.exit_code == 0, pushed.output
    assert pushed.stdout.splitlines() == [
        f"pushed 2 measurements (0 already there), 1 missed keys of {DC} (1 newly queued)",
        f"{other.device_class}: 1 missed keys (1 newly queued)",
    ]
    with FleetClient(served.url, token) as client:
        for dc in (DC, other.device_class):
            assert missed in {row["key"] for row in client.queue(device_class=dc)}

    pulled = cli("sync", cache=b, **server)
    assert pulled.exit_code == 0, pulled.output
    assert f"pulled 1 winner for {DC} " in pulled.stdout
    assert f"pulled 1 winner for {other.device_class} " in pulled.stdout
    with Store(b) as store:
        assert store.winner(other.device_class, tuned_there).median_us == 7.0


def test_sync_without_a_service_says_how_to_name_one(tmp_path: Path) -> None:
    env = {"TUNER_CACHE": str(tmp_path / "c.db"), "TUNER_SERVER": "", "TUNER_TOKEN": ""}
    done = tuner_process("sync", **env)
    assert done.returncode == 2
    assert "no service configured: pass --server URL or set TUNER_SERVER" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_malformed_server_url_is_one_error_line(tmp_path: Path) -> None:
    done = tuner_process("push", "--server", "http://[::1", TUNER_CACHE=str(tmp_path / "c.db"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: --server/TUNER_SERVER 'http://[::1': not a valid URL: Invalid port: ':1'"
    )


def test_push_to_a_closed_port_fails_in_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    tuned_cache(tmp_path / "c.db", 4)
    done = tuner_process("push", "--server", url, "--token", "tnr_0123456789ab_x",
                         TUNER_CACHE=str(tmp_path / "c.db"))  # fmt: skip
    assert done.returncode == 1
    assert f"error: fleet service {url}: unreachable: " in done.stderr  # the URL said once
    assert "Traceback" not in done.stderr


def test_tune_all_queue_with_the_service_down_names_it(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    env = {"TUNER_CACHE": str(tmp_path / "c.db"), "TUNER_SERVER": url, "TUNER_TOKEN": ""}
    done = tuner_process("tune-all", "--queue", "5", **env)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if "fleet service" in line]
    assert any(url in line for line in lines), done.stderr
    assert "Traceback" not in done.stderr


def test_tune_all_queue_with_the_service_down_leaves_no_cache_behind(tmp_path: Path) -> None:
    """A claim that fails leaves neither a new cache nor --out's folder behind: both are unmade,
    with their folders (the device is saved after the claim, so the new cache holds nothing of
    its own); an empty file given stays empty, and a cache that was there keeps what it held."""
    url = f"http://127.0.0.1:{free_port()}"
    made, empty, kept = tmp_path / "new" / "c.db", tmp_path / "empty.db", tmp_path / "kept.db"
    empty.touch()
    runs = tuned_cache(kept, 4)
    for i, cache in enumerate((made, empty, kept)):
        out = tmp_path / f"out{i}" / "report"
        done = cli("tune-all", "--queue", "5", "--out", str(out), cache=cache,
                   TUNER_SERVER=url, TUNER_TOKEN="")  # fmt: skip
        assert done.exit_code == 1, done.output
        (line,) = done.stderr.strip().splitlines()  # one line, no traceback
        assert line.startswith(f"error: fleet service {url}: unreachable: "), line
        assert not out.parent.exists()
    assert not made.parent.exists()
    assert empty.read_bytes() == b""
    with Store(kept) as store:
        assert {w.key: w.run_id for w in store.winners(DC)} == runs


def test_a_failed_claim_keeps_a_new_cache_another_command_stored_in(tmp_path: Path) -> None:
    """A command that made a cache and failed (no service reached) keeps it where another
    command stored in it: a device row may be another command's that shares the new cache (a
    host's first `tuner sync &` beside a `tuner tune`), whose work would go on into a deleted
    file."""
    from tuner.cli.options import NewPaths

    cache = tmp_path / "new" / "c.db"
    new = NewPaths(cache)
    store = Store(cache)
    with pytest.raises(ConnectionError), new.kept_if_used(store):
        with Store(cache) as other:
            other.save_device(fingerprint())
        raise ConnectionError("no service reached")
    with Store(cache) as kept:
        assert kept.db["devices"].count == 1


def test_a_failed_claim_through_a_link_unmakes_the_target_not_the_link(tmp_path: Path) -> None:
    """A --cache that is a link to a file not there yet: a failed claim unmakes the cache made
    at its target and keeps the link."""
    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "real").mkdir()
    link = tmp_path / "link.db"
    link.symlink_to(tmp_path / "real" / "target.db")
    done = cli("tune-all", "--queue", "5", cache=link, TUNER_SERVER=url, TUNER_TOKEN="")
    assert done.exit_code == 1, done.output
    assert link.is_symlink() and not (tmp_path / "real" / "target.db").exists()


def test_tune_all_queue_out_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    """An --out whose name the system refuses (too long) is named, exit 2, with no traceback
    (the claim's clean-up looks at it before the run checks it); --dry-run makes no --out."""
    out = tmp_path / ("a" * 300) / "report"
    env = {"TUNER_CACHE": str(tmp_path / "c.db"), "TUNER_SERVER": "http://127.0.0.1:9"}
    done = tuner_process("tune-all", "--queue", "5", "--out", str(out), TUNER_TOKEN="", **env)
    assert done.returncode == 2, done.stderr
    assert "cannot create the output directory: File name too long" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    dry = tuner_process("tune-all", "--queue", "5", "--out", str(out), "--dry-run", **env)
    assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stderr


def test_tune_all_queue_help_names_the_service_it_claims_from() -> None:
    """tune-all has no --server or --token, so its --queue help names the variables that say
    which service it claims from and with which token."""
    shown = cli("tune-all", "--help", COLUMNS="2000")
    (line,) = [line for line in shown.stdout.splitlines() if "--queue" in line]
    assert "$TUNER_SERVER" in line and "$TUNER_TOKEN of scope submit" in line, line


def test_serve_takes_its_artifact_limit_and_folder_from_flags(tmp_path: Path) -> None:
    from tuner.cache.artifacts import ArtifactSpec
    from tuner.fleet.client import FleetError

    spec = ArtifactSpec("cutlass", {"tile": [128, 128, 64]}, "sm90", {"cutlass": "4.2.0"})
    blobs = tmp_path / "blobs"
    flags = ("--max-artifact-bytes", "1000", "--artifacts-dir", str(blobs))
    with SubprocessServer(tmp_path / "fleet.db", *flags, log=tmp_path / "serve.log") as srv:
        token = cli("token", "create", "--db", str(srv.db), "--name", "b", "--scope", "build")
        assert token.exit_code == 0, token.output
        with FleetClient(srv.url, token.output.strip().splitlines()[-1]) as client:
            with pytest.raises(FleetError) as too_big:
                client.publish_artifact(spec, b"x" * 2000)
            assert too_big.value.status == 413 and "at most 1000 bytes" in str(too_big.value)
            client.publish_artifact(spec, b"a compiled kernel")
    assert len(list(blobs.iterdir())) == 1  # the one that fit, in the folder the flag named


def test_serve_says_what_it_serves_before_it_listens(tmp_path: Path) -> None:
    """A mistyped --db makes a new, empty service: the first lines say so, and that no host can
    submit until a token is made."""
    log = tmp_path / "serve.log"
    with SubprocessServer(tmp_path / "typo" / "fleet.db", log=log):
        pass
    said = log.read_text()
    assert f"database {tmp_path / 'typo' / 'fleet.db'} (created now, empty); 0 valid tokens" in said
    assert "warning: no valid token" in said and "tuner token create --db" in said
    with SubprocessServer(tmp_path / "typo" / "fleet.db", log=log):
        pass
    assert "(existing)" in log.read_text()


def test_token_list_and_revoke_need_the_database_to_exist(tmp_path: Path) -> None:
    missing = tmp_path / "fleet.db"
    for args in (["token", "list"], ["token", "revoke", "abc"]):
        done = tuner_process(*args, "--db", str(missing))
        assert done.returncode == 2, done.stderr
        assert f"--db {missing}: no fleet database there" in done.stderr
        assert "Traceback" not in done.stderr
    assert not missing.exists()
    made = tuner_process("token", "create", "--db", str(missing), "--name", "h", "--scope", "read")
    assert made.returncode == 0 and f"created the fleet database {missing}" in made.stderr
    again = tuner_process("token", "create", "--db", str(missing), "--name", "i", "--scope", "read")
    assert again.returncode == 0 and "created the fleet database" not in again.stderr


def test_a_misspelt_scope_is_refused_with_a_guess_and_no_database_made(tmp_path: Path) -> None:
    db = tmp_path / "fleet.db"
    done = tuner_process("token", "create", "--db", str(db), "--name", "h", "--scope", "reader")
    assert done.returncode == 2 and done.stderr == (
        "error: scope must be one or more of ['read', 'submit', 'build', 'admin'], got "
        "['reader'] (did you mean 'read'?)\n"
    )
    assert not db.exists()


def test_an_empty_file_as_the_database_is_no_database(tmp_path: Path) -> None:
    """An empty file (touch, a copy that failed) is no fleet database: token list and revoke
    refuse it and leave it empty rather than make a database of it and list 0 tokens; token
    create and serve make one and say so, not that the database was there already."""
    empty = tmp_path / "fleet.db"
    empty.touch()
    for args in (["token", "list"], ["token", "revoke", "abc"]):
        done = tuner_process(*args, "--db", str(empty))
        assert done.returncode == 2, done.stderr
        assert f"--db {empty}: an empty file, not a fleet database" in done.stderr
    assert empty.read_bytes() == b""
    made = cli("token", "create", "--db", str(empty), "--name", "h", "--scope", "read")
    assert made.exit_code == 0 and f"created the fleet database {empty}" in made.stderr
    other = tmp_path / "other.db"
    other.touch()
    log = tmp_path / "serve.log"
    with SubprocessServer(other, log=log):
        pass
    assert f"database {other} (created now, empty); 0 valid tokens" in log.read_text()


def test_push_needs_the_cache_to_exist(served: SubprocessServer, tmp_path: Path) -> None:
    """A push from a mistyped cache path would report "pushed 0" and make an empty cache."""
    missing = tmp_path / "typo" / "c.db"
    done = tuner_process("push", "--server", served.url, "--token", new_token(served, "h", "submit"),
                         TUNER_CACHE=str(missing))  # fmt: skip
    assert done.returncode == 2 and f"{missing}: no such cache" in done.stderr, done.stderr
    assert not missing.parent.exists()


def test_a_fleet_database_given_as_a_cache_is_named(tmp_path: Path) -> None:
    from server.store import FleetStore

    with FleetStore(tmp_path / "fleet.db"):
        pass
    done = tuner_process("show", TUNER_CACHE=str(tmp_path / "fleet.db"))
    assert done.returncode == 2, done.stderr
    assert "is a tuner fleet database, not a tuner cache" in done.stderr


def test_a_first_sync_that_fails_leaves_no_cache_behind(
    served: SubprocessServer, tmp_path: Path
) -> None:
    """A bad token, or no service reached: a failed first sync unmakes the cache it made (and
    its folder), which a later command would take for a cache that was synced; an empty file
    given stays empty, and a cache that was there stays."""
    made = tmp_path / "new" / "c.db"
    done = cli("sync", "--server", served.url, "--token", "tnr_0123456789ab_wrong", cache=made)
    assert done.exit_code == 1 and "invalid token '0123456789ab'" in done.stderr, done.output
    assert not made.parent.exists()
    empty, kept = tmp_path / "empty.db", tmp_path / "kept.db"
    empty.touch()
    Store(kept).close()
    nowhere = f"http://127.0.0.1:{free_port()}"
    for cache in (made, empty, kept):
        done = cli("sync", "--server", nowhere, "--timeout", "0.3", cache=cache)
        assert done.exit_code == 1 and "unreachable" in done.stderr, done.output
    assert not made.parent.exists()
    assert empty.read_bytes() == b""
    assert kept.read_bytes().startswith(b"SQLite format 3")


@pytest.fixture
def hung_url() -> Iterator[str]:
    """The URL of a service that accepts connections and never answers."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"


def test_sync_against_a_hung_service_gives_up_after_its_timeout(
    tmp_path: Path, hung_url: str
) -> None:
    import time

    started = time.monotonic()
    done = tuner_process("sync", "--server", hung_url, "--timeout", "0.3",
                         TUNER_CACHE=str(tmp_path / "c.db"))  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert f"error: fleet service {hung_url}: unreachable: ReadTimeout" in done.stderr
    assert took < 30  # four tries of 0.3 s and their backoff, plus the interpreter's start


@pytest.mark.parametrize("how", ["--timeout", "TUNER_SERVER_TIMEOUT"])
def test_artifacts_check_against_a_hung_service_gives_up_after_its_timeout(
    tmp_path: Path, hung_url: str, how: str
) -> None:
    """``artifacts --check`` takes --timeout and $TUNER_SERVER_TIMEOUT, as sync and push do, and
    gives up after four tries of that timeout rather than the default's."""
    import time

    given = {"TUNER_SERVER_TIMEOUT": "0.3"} if how != "--timeout" else {}
    args = ["--timeout", "0.3"] if how == "--timeout" else []
    started = time.monotonic()
    done = cli("artifacts", "--check", "--server", hung_url, "--token", "tnr_0123456789ab_x",
               *args, cache=tmp_path / "c.db", **given)  # fmt: skip
    took = time.monotonic() - started
    assert done.exit_code == 1, done.output
    assert f"error: fleet service {hung_url}: unreachable: ReadTimeout" in done.stderr
    assert took < 10  # four tries of 0.3 s and their backoff (the default waits 10 s a try)


def test_serve_names_an_address_it_cannot_listen_on(tmp_path: Path, monkeypatch) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        done = tuner_process("serve", "--db", str(tmp_path / "a.db"), "--port", port)
    assert done.returncode == 2, done.stderr
    assert f"--host 127.0.0.1 --port {port}: cannot listen there (Address already in use)" in (
        done.stderr
    )
    assert not (tmp_path / "a.db").exists()  # nothing made for a service that cannot start

    def unknown(*args, **kwargs):  # a name no resolver knows (no DNS asked in the test)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    out = cli("serve", "--db", str(tmp_path / "a.db"), "--host", "tuner.nowhere")
    assert isinstance(out.exception, ValueError)
    assert (
        str(out.exception)
        == "--host 'tuner.nowhere': not an address here (Name or service not known)"
    )


def test_a_token_revoked_by_its_whole_string_is_named_by_its_id_alone(tmp_path: Path) -> None:
    """An operator pastes the token itself: its id is taken, and the secret never echoed."""
    from server import tokens
    from server.store import FleetStore

    with FleetStore(tmp_path / "fleet.db") as store:
        tok, whole = tokens.create(store, "gpu-node-1", ["submit"])
    done = tuner_process("token", "revoke", whole, "--db", str(tmp_path / "fleet.db"))
    assert done.returncode == 0 and f"revoked {tok.id} (gpu-node-1)" in done.stdout
    again = tuner_process("token", "revoke", whole, "--db", str(tmp_path / "fleet.db"))
    assert again.returncode != 0 and f"token '{tok.id}' was already revoked" in again.stderr
    assert whole.rpartition("_")[2] not in again.stderr + again.stdout


def test_serve_names_an_artifacts_folder_it_cannot_make(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    folder = tmp_path / "a-file" / "blobs"
    done = tuner_process(
        "serve", "--db", str(tmp_path / "a.db"), "--artifacts-dir", str(folder),
        "--port", str(free_port()),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"error: artifacts folder {folder}: cannot make it: Not a directory\n"
    assert not (tmp_path / "a.db").exists()  # nothing made for a service that cannot start


def test_artifacts_check_against_another_web_server_says_it_is_no_tuner_service(
    tmp_path: Path,
) -> None:
    """As sync and push say it: the command named only the page's status and type
    (``HTTP 404 (text/html)``)."""
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{other.server_address[1]}"
    try:
        done = cli("artifacts", "--check", "--server", url, "--token", "tnr_0123456789ab_x",
                   cache=tmp_path / "c.db")  # fmt: skip
    finally:
        other.shutdown()
        other.server_close()
    assert done.exit_code == 1, done.output
    assert f"error: fleet service {url}: no tuner service at this URL" in done.stderr


@pytest.mark.parametrize("how", ["--timeout", "TUNER_SERVER_TIMEOUT"])
@pytest.mark.parametrize(("value", "read"), [("inf", "inf"), ("1e400", "inf"), ("0.05", "0.05")])
def test_a_timeout_of_no_finite_seconds_is_refused_as_the_background_sync_refuses_it(
    tmp_path: Path, how: str, value: str, read: str
) -> None:
    """``tuner info`` says sync, push and artifacts refuse such a ``TUNER_SERVER_TIMEOUT``,
    and the background sync, warmup and tune-all use the default for it. The commands refuse
    it, naming the option and the rule, rather than wait for ever on a hung service."""
    given = {"TUNER_SERVER_TIMEOUT": value} if how != "--timeout" else {}
    args = ["--timeout", value] if how == "--timeout" else []
    nowhere = f"http://127.0.0.1:{free_port()}"  # never reached: the refusal comes first
    for command in ("sync", "push"):
        done = cli(command, "--server", nowhere, *args, cache=tmp_path / "c.db", **given)
        assert done.exit_code == 2, done.output
        assert f"must be a finite number of at least 0.1, got {read}" in done.stderr, done.stderr
        assert "TUNER_SERVER_TIMEOUT" in done.stderr and "--timeout" in done.stderr
    assert not (tmp_path / "c.db").exists()
