"""Publish this host's compiled-kernel artifacts to the fleet service and fetch the builds it
serves, so that a host runs kernels built once elsewhere; every download is checked against the
hash the service announced for it before it is stored.

    push_artifacts(client, artifacts)         # this host's builds (needs a ``build`` token)
    fetch_artifacts(client, artifacts, specs) # served builds, each checked against its hash
    sync_artifacts(client, artifacts, store, host_archs(fp))  # all new builds of these archs
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tuner.cache import Store
from tuner.cache.artifacts import (
    ArtifactError,
    ArtifactSpec,
    ArtifactStore,
    Conflict,
    shared_store,
)
from tuner.core.device import Fingerprint
from tuner.fleet.client import BATCH_SPECS, FleetClient, FleetError
from tuner.fleet.sync import service_restarted

log = logging.getLogger(__name__)


@dataclass
class ArtifactsPushed:
    published: int  # new on the service
    conflicts: int  # the service serves another build of the spec: ours is recorded beside it
    present: int  # the service already serves these very bytes


@dataclass
class ArtifactsFetched:
    fetched: int
    present: int  # already here with the served hash
    missing: int  # the service has no build of the spec
    rejected: list[str]  # one message per download refused (hash mismatch, spec mismatch, size)


def push_artifacts(
    client: FleetClient, artifacts: ArtifactStore, specs: list[ArtifactSpec] | None = None
) -> ArtifactsPushed:
    """Publish this host's artifacts (all, or those of ``specs``) that the service does not
    serve with the same bytes. Needs a ``build`` token."""
    local = artifacts.specs()
    if specs is not None:
        wanted = {s.id for s in specs}
        local = [(spec, digest) for spec, digest in local if spec.id in wanted]
    out = ArtifactsPushed(0, 0, 0)
    for i in range(0, len(local), BATCH_SPECS):
        chunk = local[i : i + BATCH_SPECS]
        served = _served(client, [spec.id for spec, _ in chunk])
        for spec, digest in chunk:
            if served.get(spec.id, {}).get("hash") == digest:
                out.present += 1
                continue
            data = artifacts.get(spec)
            if data is None:  # evicted or found corrupt meanwhile: nothing to publish
                continue
            outcome = client.publish_artifact(spec, data)["outcome"]
            if outcome == "new":
                out.published += 1
            elif outcome == "same":
                out.present += 1
            else:
                out.conflicts += 1
    return out


def _served(client: FleetClient, spec_ids: list[str]) -> dict[str, dict[str, Any]]:
    return {a["spec_id"]: a for a in client.artifact_lookup(spec_ids)["artifacts"]}


def _fetch_one(
    client: FleetClient, artifacts: ArtifactStore, spec: ArtifactSpec, row: dict[str, Any]
) -> str | None:
    """Download and store the served build ``row`` of ``spec``; None, or why it was refused."""
    if spec.id != row["spec_id"]:
        return f"the service listed spec {row['spec_id'][:12]} for spec {spec.id[:12]}; rejected"
    try:
        data = client.download_artifact(row["hash"], row["size"])
        artifacts.add_verified(spec, row["hash"], data)
    except (FleetError, ArtifactError) as e:
        if isinstance(e, FleetError) and e.status is None:
            raise  # unreachable: the next one would fail the same way
        return str(e)
    return None


def fetch_artifacts(
    client: FleetClient, artifacts: ArtifactStore, specs: list[ArtifactSpec]
) -> ArtifactsFetched:
    """Bring the served builds of ``specs`` into ``artifacts`` (e.g. before compiling them).

    Every download is checked against the hash the service announced for it
    (``ArtifactStore.add_verified``): a corrupt or substituted one is logged, listed in
    ``rejected`` and never stored."""
    have = artifacts.hashes()
    out = ArtifactsFetched(0, 0, 0, [])
    unique = list({s.id: s for s in specs}.values())
    for i in range(0, len(unique), BATCH_SPECS):
        chunk = unique[i : i + BATCH_SPECS]
        served = _served(client, [s.id for s in chunk])
        for spec in chunk:
            row = served.get(spec.id)
            if row is None:
                out.missing += 1
            elif have.get(spec.id) == row["hash"]:
                out.present += 1
            else:
                _count_fetch(out, _fetch_one(client, artifacts, spec, row))
    return out


def _count_fetch(out: ArtifactsFetched, refused: str | None) -> None:
    if refused is None:
        out.fetched += 1
    else:
        log.error("artifact download rejected: %s", refused)
        out.rejected.append(refused)


def host_archs(fp: Fingerprint) -> list[str]:
    """The artifact archs a host runs: Triton's target (``cuda:90``), CUTLASS's (``sm90``) and,
    from compute capability 9.0 on, its arch-specific target (``sm_90a``: code for that
    compute capability alone, what our CUDA decode kernels are built for); none for a host
    without a GPU."""
    if fp.kind != "cuda" or not fp.compute_capability:
        return []
    cc = fp.compute_capability.replace(".", "")
    return [f"cuda:{cc}", f"sm{cc}", *([f"sm_{cc}a"] if int(cc) >= 90 else [])]


def sync_artifacts(
    client: FleetClient, artifacts: ArtifactStore, store: Store, archs: list[str],
    *, full: bool = False,
) -> ArtifactsFetched:  # fmt: skip
    """Fetch every served build of ``archs`` published since the last sync (``full``: all).

    The position is kept in ``store`` after each page. A rejected download is reported and
    not retried by later syncs: ``fetch_artifacts`` of its spec, or a ``full`` sync, tries it
    again."""
    if not archs:
        raise ValueError("sync_artifacts needs at least one arch (see host_archs)")
    scope = client.sync_scope(store)
    name = f"artifacts:{scope}:{','.join(sorted(archs))}"
    cursor = 0 if full else store.position(name)
    out = ArtifactsFetched(0, 0, 0, [])
    have = artifacts.hashes()
    while True:
        body = client.artifact_listing(archs, cursor)
        if service_restarted(client, store, scope, cursor, body.get("last")):
            cursor = 0
            continue
        for row in body["artifacts"]:
            if have.get(row["spec_id"]) == row["hash"]:
                out.present += 1
                continue
            try:
                spec = ArtifactSpec.from_json(row["spec"])
            except (ValueError, KeyError, TypeError) as e:
                _count_fetch(out, f"the service listed an unreadable spec {row['spec_id']}: {e}")
                continue
            _count_fetch(out, _fetch_one(client, artifacts, spec, row))
        cursor = body["cursor"]
        store.set_position(name, cursor)
        if not body["more"]:
            return out


@dataclass
class ArtifactCheck:
    service: list[dict[str, Any]]  # the service's ConflictOut entries
    local: list[Conflict]  # this host's store: specs that arrived with more than one build

    @property
    def clean(self) -> bool:
        return not self.service and not self.local


def fetch_host_artifacts(
    client: FleetClient, store: Store, fp: Fingerprint, artifacts: ArtifactStore | None = None,
    *, full: bool = False,
) -> ArtifactsFetched | None:  # fmt: skip
    """``sync_artifacts`` of this host's archs into ``artifacts``, by default the process's
    shared store (the one the compile hooks read); None, fetching nothing, on a host without a
    GPU or when that store cannot be opened."""
    archs = host_archs(fp)
    if not archs:
        return None
    kernels = artifacts if artifacts is not None else shared_store()
    if kernels is None:
        return None
    return sync_artifacts(client, kernels, store, archs, full=full)


def check_artifacts(client: FleetClient | None, artifacts: ArtifactStore | None) -> ArtifactCheck:
    """Specs built differently by different builders, on the service and in this host's store
    (``tuner artifacts --check``); the service's side is skipped without a client, this host's
    without a store."""
    service = client.artifact_conflicts() if client is not None else []
    return ArtifactCheck(service, artifacts.conflicts() if artifacts is not None else [])
