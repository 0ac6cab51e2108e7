"""``tuner serve``, ``tuner token create|list|revoke``, ``tuner sync``, ``tuner push``,
``tuner artifacts``: the fleet service, its tokens, and a host's exchange of results and
compiled-kernel artifacts with it (``tuner.fleet``)."""

from __future__ import annotations

import contextlib
import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cache.artifacts import ArtifactStore, default_root
from tuner.cache.sqlite import unmade
from tuner.cli.errors import FAILED, fleet_service, typed_in
from tuner.cli.options import CacheOpt, cache_path, open_store, store_kept_if_used
from tuner.core.console import counted, output_console
from tuner.core.device import host_fingerprints
from tuner.core.settings import SERVER_TIMEOUT
from tuner.fleet.artifact_sync import (
    check_artifacts,
    fetch_host_artifacts,
    host_archs,
    push_artifacts,
)
from tuner.fleet.client import TIMEOUT_S, FleetClient, FleetError
from tuner.fleet.sync import PushResult, pull, push, push_misses

if TYPE_CHECKING:
    from server import Settings
    from tuner.cache.store import Store
    from tuner.core.device import Fingerprint

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
console = output_console()
app = typer.Typer()
token_app = typer.Typer(
    help="Create, list and revoke the service's bearer tokens.", no_args_is_help=True
)
app.add_typer(token_app, name="token")

DbOpt = Annotated[
    Path,
    typer.Option(
        "--db", envvar="TUNER_SERVER_DB", help="The service's SQLite file.", dir_okay=False
    ),
]
ServerOpt = Annotated[
    str | None, typer.Option("--server", envvar="TUNER_SERVER", help="Service base URL.")
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="TUNER_TOKEN", help="Bearer token.", show_default=False),
]


def _timeout_read(value: float) -> float:
    """``--timeout`` (or ``$TUNER_SERVER_TIMEOUT``) by ``SERVER_TIMEOUT``'s rule, the one the
    background sync, warmup, tune-all and ``tuner info`` read it by, naming the value given:
    ``inf`` (or ``1e400``) would wait for ever on a hung service, where they use the default."""
    if SERVER_TIMEOUT.read(str(value)) is None:
        raise typer.BadParameter(f"must be {SERVER_TIMEOUT.words()}, got {value}")
    return value


TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        envvar="TUNER_SERVER_TIMEOUT",
        help=f"Seconds to wait for each answer of the service, {SERVER_TIMEOUT.words()} (a "
        "request that times out is tried 3 more times, with backoff, before the command fails).",
        callback=_timeout_read,
    ),
]


@app.command()
def serve(
    db: DbOpt,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.", min=1, max=65535)] = 8000,
    open_reads: Annotated[
        bool, typer.Option("--open-reads", help="Let anyone read winners without a token.")
    ] = False,
    confirm_margin: Annotated[
        float,
        typer.Option(
            help="Winner changes beyond this (0.25 = 25%) need a second submitter "
            "or an admin token.",
            min=0,
        ),
    ] = 0.25,
    max_artifact_bytes: Annotated[
        int, typer.Option(help="Largest compiled-kernel artifact one upload may carry.", min=1)
    ] = 512 * 2**20,
    artifacts_dir: Annotated[
        Path | None,
        typer.Option(
            help="Folder of artifact blobs (default: <db>.artifacts beside the database).",
            file_okay=False,
        ),
    ] = None,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds a stop (SIGTERM, Ctrl-C) waits for requests in flight before it "
            "cuts them (answered 503 where nothing was stored; a write being committed gets "
            "5 s more to commit or roll back whole).",
            min=0,
        ),
    ] = 30.0,
    log_level: Annotated[
        str, typer.Option(help=f"uvicorn log level: {', '.join(LOG_LEVELS)}.")
    ] = "info",
    lock_wait: Annotated[
        float,
        typer.Option(
            help="Seconds a request waits for a lock another process holds on the database (a "
            "backup, a sqlite3 shell) before it is answered 503, nothing stored (clients send "
            "it again).",
            min=0.001,
        ),
    ] = 30.0,
) -> None:
    """Run the fleet service (FastAPI on uvicorn, one worker: SQLite has one writer anyway)."""
    import uvicorn

    from server import Settings, create_app

    if log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {list(LOG_LEVELS)}, got {log_level!r}")
    _check_address(host, port)  # before the database is opened (or made)
    settings = Settings(
        db=db, open_reads=open_reads, confirm_margin=confirm_margin,
        max_artifact_bytes=max_artifact_bytes, artifacts_dir=artifacts_dir, lock_wait_s=lock_wait,
    )  # fmt: skip
    new = unmade(db)
    uvicorn_app = create_app(settings)
    _startup_lines(settings, new, uvicorn_app.state.db.store().tokens())
    uvicorn.run(uvicorn_app, host=host, port=port, access_log=access_log, log_level=log_level,
                timeout_graceful_shutdown=shutdown_timeout)  # fmt: skip


def _check_address(host: str, port: int) -> None:
    """A ValueError naming --host or --port unless this process could listen there now (uvicorn
    finds out only after its startup, and names neither)."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address here ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(
                f"--host {host} --port {port}: cannot listen there ({e.strerror})"
            ) from None


def _startup_lines(settings: Settings, new: bool, tokens: list[dict]) -> None:
    """What the service serves, said before it listens: the database (and whether it was made
    just now: a mistyped --db makes an empty service), its tokens, who may read."""
    from server.blobs import default_dir

    valid = sum(1 for t in tokens if t["revoked_at"] is None)
    made = "created now, empty" if new else "existing"
    typer.echo(f"database {settings.db} ({made}); {valid} valid tokens; artifacts in "
               f"{settings.artifacts_dir or default_dir(settings.db)}; reads "
               f"{'open to anyone' if settings.open_reads else 'need a token'}", err=True)  # fmt: skip
    if not valid:
        typer.echo(f"warning: no valid token: hosts cannot submit until one is made "
                   f"(tuner token create --db {settings.db} --name ... --scope ...)", err=True)  # fmt: skip


@token_app.command("create")
def token_create(
    db: DbOpt,
    name: Annotated[str, typer.Option(help="Who holds it, e.g. the host or worker name.")],
    scope: Annotated[
        list[str],
        typer.Option(
            "--scope",
            help="read, submit, build or admin (each includes the previous; build publishes "
            "compiled kernels).",
        ),
    ],
) -> None:
    """Create a token and print it (the only time it is shown)."""
    from server import tokens
    from server.store import FleetStore

    tokens.check_request(name, scope)
    new = unmade(db)
    with FleetStore(db) as store:
        token, secret = tokens.create(store, name, scope)
    if new:  # a typo of --db would make a database no service reads: said
        typer.echo(f"created the fleet database {db} (new, empty before this token)", err=True)
    typer.echo(
        f"token {token.id} ({token.name}, scopes {','.join(token.scopes)}); keep it secret:",
        err=True,
    )
    print(secret)


@token_app.command("list")
def token_list(db: DbOpt) -> None:
    """List tokens (ids, names, scopes; never the secrets)."""
    from server import tokens
    from server.store import FleetStore

    with FleetStore(_existing(db)) as store:
        found = tokens.list_tokens(store)
    t = Table(title=counted(len(found), "token"))
    for col in ("id", "name", "scopes", "created", "revoked"):
        t.add_column(col)
    for tok in found:
        t.add_row(
            tok.id, tok.name, ",".join(tok.scopes), _when(tok.created_at), _when(tok.revoked_at)
        )
    console.print(t)


@token_app.command("revoke")
def token_revoke(
    db: DbOpt,
    token_id: Annotated[
        str, typer.Argument(help="Token id (as 'tuner token list' shows it), or the token itself.")
    ],
) -> None:
    """Revoke a token: it stops working at once; what it submitted stays."""
    from server import tokens
    from server.store import FleetStore

    with FleetStore(_existing(db)) as store:
        tok = tokens.revoke(store, token_id)
    console.print(f"revoked {tok.id} ({tok.name})")


def _existing(db: Path) -> Path:
    """``db``, or a ValueError if there is no database there (a read must not make one): no
    file, or an empty one, which SQLite would make a new database of."""
    if unmade(db):
        what = "an empty file, not a fleet database" if db.is_file() else "no fleet database there"
        raise ValueError(f"--db {db}: {what} ('tuner serve' or 'tuner token create' makes one)")
    return db


def _when(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds") if t else ""


def _client(server: str | None, token: str | None, timeout_s: float) -> FleetClient:
    if not server:
        raise ValueError("no service configured: pass --server URL or set TUNER_SERVER")
    return FleetClient(server, token, timeout_s=timeout_s)


@app.command()
def sync(
    server: ServerOpt = None,
    token: TokenOpt = None,
    cache: CacheOpt = None,
    timeout: TimeoutOpt = TIMEOUT_S,
    full: Annotated[bool, typer.Option(help="Pull everything, not only what changed.")] = False,
    push_first: Annotated[
        bool, typer.Option("--push/--no-push", help="Push local results and misses first.")
    ] = False,
    artifacts: Annotated[
        bool,
        typer.Option(
            help="Also fetch the compiled kernels served for this host's GPU arch "
            "($TUNER_ARTIFACTS store), each checked against its sha256."
        ),
    ] = True,
) -> None:
    """Pull the served winners of this host's device classes into the local cache
    (incremental): one class per GPU model the host holds."""
    client = _client(server, token, timeout)
    refused = None
    with client, store_kept_if_used(cache) as store, fleet_service(client.server):
        fps = host_fingerprints()
        if push_first:
            try:
                _push_host(client, store, fps)
            except FleetError as e:  # a token of scope read: the pull still comes
                if e.status != 403:
                    raise
                refused = e
                console.print(f"[yellow]push refused[/yellow]: {escape(str(e))}; pulling anyway")
        rejected = [_pull_class(client, store, fp, full=full, artifacts=artifacts) for fp in fps]
    # every class is pulled; the command still failed at what it was asked (each rejected kernel
    # was logged with its reason)
    if refused is not None or any(rejected):
        raise typer.Exit(FAILED)


def _pull_class(
    client: FleetClient, store: Store, fp: Fingerprint, *, full: bool, artifacts: bool
) -> bool:
    """One device class's pull (and its GPU arch's compiled kernels), reported in a line each;
    True where a fetched kernel was rejected."""
    r = pull(client, store, fp, full=full)
    console.print(
        f"pulled {counted(r.winners, 'winner')} for {fp.device_class} in "
        f"{counted(r.pages, 'page')}, "
        f"{r.seconds:.2f} s (cursor {r.cursor}); served for this host's versions "
        f"{fp.version_tag} only"
    )
    if not artifacts:
        return False
    a = fetch_host_artifacts(client, store, fp, full=full)
    if a is None:
        why = "no GPU on this host" if not host_archs(fp) else "the kernel store cannot be opened"
        console.print(f"fetched no compiled kernels: {why}")
        return False
    console.print(f"fetched {a.fetched} compiled kernels ({a.present} already here)")
    return bool(a.rejected)


@app.command("push")
def push_command(
    server: ServerOpt = None,
    token: TokenOpt = None,
    cache: CacheOpt = None,
    timeout: TimeoutOpt = TIMEOUT_S,
    artifacts: Annotated[
        bool,
        typer.Option(
            help="Also publish this host's compiled kernels ($TUNER_ARTIFACTS store) that the "
            "service lacks; needs a token of scope build."
        ),
    ] = False,
) -> None:
    """Send local measurements not sent yet, and the misses recorded here (for each device
    class of this host), to the service."""
    client = _client(server, token, timeout)
    has_results = cache_path(cache).exists() or not artifacts  # else a missing cache is refused
    with client, fleet_service(client.server):
        client.require_scope("build" if artifacts else "submit")  # also with nothing to send
        if has_results:
            with open_store(cache, existing=True) as store:
                _push_host(client, store, host_fingerprints())
        else:  # a builder publishing kernels needs no results cache
            console.print(f"no results pushed: no cache at {cache_path(cache)}")
        if artifacts:
            with ArtifactStore() as kernels:
                a = push_artifacts(client, kernels)
            console.print(
                f"published {a.published} compiled kernels ({a.present} already there, "
                f"{a.conflicts} differing from the build the service serves)"
            )


@app.command("artifacts")
def artifacts_command(
    ctx: typer.Context,
    server: ServerOpt = None,
    token: TokenOpt = None,
    cache: CacheOpt = None,  # the store is the one beside it (the option's callback says so)
    timeout: TimeoutOpt = TIMEOUT_S,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Report specs whose builds differ, on the service and here; exit 1 if any.",
        ),
    ] = False,
) -> None:
    """This host's compiled kernels ($TUNER_ARTIFACTS store) and, with --check, their conflicts
    (on the fleet service too: --server, --token)."""
    given = [f"--{n}" for n in ("server", "token") if typed_in(ctx, n)]
    if given and not check:  # from the environment they are the host's, and said nothing of
        console.print(
            f"note: {' and '.join(given)} are read by --check only (which compares this host's "
            "builds with the service's)"
        )
    if not (root := default_root()).exists():  # a look makes no store (a mistyped --cache)
        console.print(f"0 compiled kernels: no store at {root} yet")
        if not check:
            return
    client = FleetClient(server, token, timeout_s=timeout) if server and check else None
    with contextlib.ExitStack() as opened:
        kernels = opened.enter_context(ArtifactStore()) if root.exists() else None
        if client is not None:
            opened.enter_context(client)
        if kernels is not None:
            entries = kernels.entries()
            size = sum(e.size for e in entries)
            console.print(f"{len(entries)} compiled kernels, {size} bytes in {kernels.root}")
        if not check:
            return
        with fleet_service(server or ""):
            found = check_artifacts(client, kernels)
    for c in found.service:
        builds = ", ".join(f"{b['hash'][:12]} by {b['builder']}" for b in c["builds"])
        console.print(
            f"service: spec {c['spec_id'][:12]} {c['spec']}: serves {c['served'][:12]}; builds {builds}"
        )
    for c in found.local:
        console.print(
            f"here: {c.spec.source} spec {c.spec.id[:12]}: serves {c.hashes[0][:12]}; also {', '.join(h[:12] for h in c.hashes[1:])}"
        )
    if client is None:
        console.print("service not checked: pass --server URL or set TUNER_SERVER")
    if not found.clean:
        raise typer.Exit(FAILED)
    console.print("no conflicting builds")


def _push_host(client: FleetClient, store: Store, fps: list[Fingerprint]) -> None:
    """The cache's measurements not sent yet (of every device class it holds a fingerprint
    of), then the misses of each of this host's classes; a line each, naming the class where
    the host has several."""
    named = len(fps) > 1
    _report_push(push(client, store, fps[0]), fps[0].device_class if named else None)
    for fp in fps[1:]:
        keys, queued = push_misses(client, store, fp)
        console.print(f"{fp.device_class}: {keys} missed keys ({queued} newly queued)")


def _report_push(r: PushResult, device_class: str | None) -> None:
    console.print(
        f"pushed {r.accepted} measurements ({r.duplicates} already there"
        + (f", {r.skipped} skipped: no fingerprint of their device class" if r.skipped else "")
        + (f", {r.refused} refused by the service: see the warnings" if r.refused else "")
        + f"), {r.misses} missed keys"
        + (f" of {device_class}" if device_class else "")
        + f" ({r.queued} newly queued)"
    )
