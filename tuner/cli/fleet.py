"""``tuner serve``, ``tuner token create|list|revoke``, ``tuner sync``, ``tuner push``: the fleet
service, its tokens, and a host's exchange of results with it (``tuner.fleet.client``)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tuner.cli.errors import fleet_service
from tuner.cli.options import CacheOpt, open_store
from tuner.core.device import fingerprint
from tuner.fleet.client import FleetClient, PushResult, pull, push

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
console = Console()
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
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    log_level: Annotated[
        str, typer.Option(help=f"uvicorn log level: {', '.join(LOG_LEVELS)}.")
    ] = "info",
) -> None:
    """Run the fleet service (FastAPI on uvicorn, one worker: SQLite has one writer anyway)."""
    import uvicorn

    from server import Settings, create_app

    if log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {list(LOG_LEVELS)}, got {log_level!r}")
    app = create_app(Settings(db=db, open_reads=open_reads, confirm_margin=confirm_margin))
    uvicorn.run(app, host=host, port=port, access_log=access_log, log_level=log_level)


@token_app.command("create")
def token_create(
    db: DbOpt,
    name: Annotated[str, typer.Option(help="Who holds it, e.g. the host or worker name.")],
    scope: Annotated[
        list[str],
        typer.Option("--scope", help="read, submit or admin (each includes the previous)."),
    ],
) -> None:
    """Create a token and print it (the only time it is shown)."""
    from server import tokens
    from server.store import FleetStore

    with FleetStore(db) as store:
        token, secret = tokens.create(store, name, scope)
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

    with FleetStore(db) as store:
        found = tokens.list_tokens(store)
    t = Table(title=f"{len(found)} tokens")
    for col in ("id", "name", "scopes", "created", "revoked"):
        t.add_column(col)
    for tok in found:
        t.add_row(
            tok.id, tok.name, ",".join(tok.scopes), _when(tok.created_at), _when(tok.revoked_at)
        )
    console.print(t)


@token_app.command("revoke")
def token_revoke(db: DbOpt, token_id: Annotated[str, typer.Argument(help="Token id.")]) -> None:
    """Revoke a token: it stops working at once; what it submitted stays."""
    from server import tokens
    from server.store import FleetStore

    with FleetStore(db) as store:
        tok = tokens.revoke(store, token_id)
    console.print(f"revoked {tok.id} ({tok.name})")


def _when(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds") if t else ""


def _client(server: str | None, token: str | None) -> FleetClient:
    if not server:
        raise ValueError("no service configured: pass --server URL or set TUNER_SERVER")
    return FleetClient(server, token)


@app.command()
def sync(
    server: ServerOpt = None,
    token: TokenOpt = None,
    cache: CacheOpt = None,
    full: Annotated[bool, typer.Option(help="Pull everything, not only what changed.")] = False,
    push_first: Annotated[
        bool, typer.Option("--push/--no-push", help="Push local results and misses first.")
    ] = False,
) -> None:
    """Pull the served winners of this device class into the local cache (incremental)."""
    fp = fingerprint()
    client = _client(server, token)
    with client, open_store(cache) as store, fleet_service(client.server):
        if push_first:
            _report_push(push(client, store, fp))
        r = pull(client, store, fp, full=full)
    console.print(
        f"pulled {r.winners} winners for {fp.device_class} in {r.pages} pages, "
        f"{r.seconds:.2f} s (cursor {r.cursor})"
    )


@app.command("push")
def push_command(server: ServerOpt = None, token: TokenOpt = None, cache: CacheOpt = None) -> None:
    """Send local measurements not sent yet, and the misses recorded here, to the service."""
    client = _client(server, token)
    with client, open_store(cache) as store, fleet_service(client.server):
        _report_push(push(client, store, fingerprint()))


def _report_push(r: PushResult) -> None:
    console.print(
        f"pushed {r.accepted} measurements ({r.duplicates} already there"
        + (f", {r.skipped} skipped: no fingerprint of their device class" if r.skipped else "")
        + f"), {r.misses} missed keys ({r.queued} newly queued)"
    )
