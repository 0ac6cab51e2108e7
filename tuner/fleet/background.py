"""The dispatcher's sync with the fleet service, in a daemon thread so that serving never waits
for the service: ``attach`` starts it, it pushes and pulls every ``$TUNER_SYNC_INTERVAL`` seconds
with its own SQLite connection, and calls ``Dispatcher.reload()`` when new winners or kernels
arrive.

Settings: ``TUNER_SERVER`` (base URL), ``TUNER_TOKEN``, ``TUNER_SYNC_INTERVAL`` (seconds),
``TUNER_SERVER_TIMEOUT`` (seconds each request waits for its answer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tuner.cache import Store
from tuner.cache.artifacts import ArtifactStore, shared_store
from tuner.core.device import Fingerprint
from tuner.core.settings import env_number
from tuner.fleet.artifact_sync import fetch_host_artifacts, host_archs
from tuner.fleet.client import FleetClient, FleetError
from tuner.fleet.sync import PullResult, pull, push_measurements, push_misses

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 60.0  # default seconds between background syncs


class BackgroundSync:
    """Push, then pull (winners, then the artifacts of this host's archs when given an artifact
    store), every ``interval_s`` in a daemon thread, for each GPU class of the host
    (``fingerprints``: by default every visible GPU's, each class once); never raises into the
    caller.

    After a failure the next try comes sooner (5 s, doubling up to the interval), and the error
    is logged once per distinct message, so a service outage costs a log line, not a crash.
    """

    def __init__(
        self,
        client: FleetClient,
        store_path: str | Path,
        *,
        interval_s: float = SYNC_INTERVAL_S,
        push: bool = True,
        on_change: Callable[[], None] | None = None,
        fingerprints: Callable[[], list[Fingerprint]] | None = None,
        artifacts: ArtifactStore | None = None,
    ) -> None:
        from tuner.core.device import host_fingerprints

        self.client, self.store_path, self.interval_s = client, Path(store_path), interval_s
        self.push, self.on_change, self.artifacts = push, on_change, artifacts
        self._fingerprints = fingerprints or host_fingerprints
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tuner-fleet-sync", daemon=True)
        self.syncs = 0
        self.failures = 0
        self.last_error: str | None = None
        self.synced = threading.Event()  # set after each successful round

    def start(self) -> BackgroundSync:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def trigger(self) -> None:
        """Sync now instead of at the next interval."""
        self._wake.set()

    def _run(self) -> None:
        store: Store | None = None
        failures = 0
        while not self._stop.is_set():
            try:
                store = store or Store(self.store_path)  # this thread's own connection
                self.sync_once(store)
                failures = 0
                wait = self.interval_s
            except Exception as e:  # the service or the cache failing must never kill the host
                failures += 1
                self.failures += 1
                message = f"{type(e).__name__}: {e}"
                if message != self.last_error:
                    log.warning("fleet sync with %s failed: %s", self.client.server, message)
                self.last_error = message
                wait = min(self.interval_s, 5.0 * 2 ** (failures - 1))
            self._wake.wait(wait)
            self._wake.clear()
        if store is not None:
            store.close()

    def sync_once(self, store: Store) -> list[PullResult]:
        """One round, for each GPU class of the host: what each pull brought."""
        refused: list[str] = []
        results, changed = [], False
        for fp in self._fingerprints():
            if self.push:  # a refused push (e.g. a read-only token) must not stop the pull
                for step in (push_measurements, push_misses):  # a restore found re-sends misses
                    try:
                        step(self.client, store, fp)
                    except FleetError as e:
                        if e.status is None:  # unreachable: the pull would fail the same way
                            raise
                        refused.append(f"{step.__name__}: {e}")
            result = pull(self.client, store, fp)
            kernels = (
                fetch_host_artifacts(self.client, store, fp, self.artifacts)
                if self.artifacts is not None
                else None
            )
            results.append(result)
            changed = changed or bool(result.winners or (kernels and kernels.fetched))
        if changed and self.on_change is not None:
            self.on_change()
        self.syncs += 1
        self.synced.set()
        if refused:
            raise FleetError("; ".join(refused))
        self.last_error = None
        return results


def _sync_interval() -> float:
    """``$TUNER_SYNC_INTERVAL`` in seconds. One that is not a number of seconds in its bounds
    (``SYNC_INTERVAL``) is logged and the default used: a typo in a setting must not leave the
    host without its sync, nor 0 make it loop with no wait."""
    return env_number("TUNER_SYNC_INTERVAL", SYNC_INTERVAL_S)


def attach(
    dispatcher: Any, client: FleetClient | None = None, **kwargs: Any
) -> BackgroundSync | None:
    """Keep ``dispatcher``'s cache in sync with the service in the background.

    Uses ``$TUNER_SERVER``/``$TUNER_TOKEN``, waiting ``$TUNER_SERVER_TIMEOUT`` seconds for each
    answer, unless a client is given; the interval is ``$TUNER_SYNC_INTERVAL`` seconds (default
    60, also used, and logged, for a value that is not a number of seconds, or is below 1 or
    above a week). Returns None (and logs) if no service is configured or the configuration is
    unusable: the dispatcher then works from its cache alone.
    """
    from tuner.core.device import host_fingerprints

    try:
        client = client or FleetClient.from_env(retries=2)
        if client is None:
            return None
        if "interval_s" not in kwargs:
            kwargs["interval_s"] = _sync_interval()
        if "artifacts" not in kwargs:
            fps = (kwargs.get("fingerprints") or host_fingerprints)()
            kwargs["artifacts"] = shared_store() if any(host_archs(fp) for fp in fps) else None
        return BackgroundSync(
            client, dispatcher.store_path, on_change=dispatcher.reload, **kwargs
        ).start()
    except Exception as e:
        log.error("fleet sync not started: %s", e)
        return None
