"""Triton's cache manager hook: each compiled Triton kernel is one artifact of the artifact store.

Selected with ``TRITON_CACHE_MANAGER=tuner.candidates.triton_cache:ArtifactCacheManager``
(``share_compiled_kernels`` sets it). Triton writes a kernel's files (IRs, cubin, metadata json)
one by one, then a group file that lists them; this manager then also stores the whole group as one bundle in ``tuner.cache.artifacts``. A lookup
that misses Triton's own directory fetches the bundle and writes its files back into that
directory, so a host that never compiled the kernel loads it without compiling. Everything else
(the launcher modules Triton builds with the host's C compiler, autotuner timings, dump and
override directories) keeps Triton's plain file cache behaviour.

The spec is Triton's cache key, which already hashes Triton's version, the source, the target,
the options and the environment, plus the kernel's name and target for the index. A kernel is
found by the target of the active device; one compiled for another target is shared under that
target.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import triton
from triton.runtime.cache import FileCacheManager

from tuner.cache.artifacts import (
    ArtifactError,
    ArtifactSpec,
    ArtifactStore,
    pack,
    shared_store,
    unpack,
)
from tuner.cache.sqlite import StoreError

log = logging.getLogger(__name__)


def kernel_spec(cache_key: str, group_name: str, target: str) -> ArtifactSpec:
    """The spec of the kernel Triton caches under ``cache_key`` as group ``group_name``."""
    return ArtifactSpec(
        "triton",
        {"cache_key": cache_key, "kernel": group_name.removesuffix(".json")},
        target,
        {"triton": triton.__version__},
    )


def target_name(backend: str, arch: object) -> str:
    return f"{backend}:{arch}"


def _active_target() -> str | None:
    from triton.runtime import driver

    try:
        target = driver.active.get_current_target()
    except RuntimeError:  # no GPU driver: nothing here runs compiled kernels
        return None
    return target_name(target.backend, target.arch)


MANAGER = f"{__name__}:ArtifactCacheManager"


def share_compiled_kernels() -> None:
    """Route Triton's cache through this manager from now on (and in child processes started
    after), unless the environment already names a cache manager. Called where the tuner first
    compiles (tuning, background builds, warmup), not at import."""
    os.environ.setdefault("TRITON_CACHE_MANAGER", MANAGER)


class ArtifactCacheManager(FileCacheManager):
    """Triton's file cache, with each kernel's group of files also kept as one artifact."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        super().__init__(key, override=override, dump=dump)
        self.shares = not (override or dump)

    def get_group(self, filename: str) -> dict[str, str] | None:
        group = super().get_group(filename)
        if group is not None or not self.shares:
            return group
        store, target = shared_store(), _active_target()
        if store is None or target is None:
            return None
        return fetch_group(self, store, filename, target)

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        path = super().put_group(filename, group)
        store = shared_store() if self.shares else None
        if store is not None:
            publish_group(self, store, filename, group)
        return path


def publish_group(
    manager: FileCacheManager, store: ArtifactStore, filename: str, group: dict[str, str]
) -> None:
    """Store the files of ``group`` (name -> path, as Triton's compile passes it) as one bundle;
    a failure is logged, never raised: the kernel is compiled and cached here either way."""
    try:
        files = {name: Path(path).read_bytes() for name, path in group.items()}
        target = json.loads(files[filename])["target"]
        spec = kernel_spec(manager.key, filename, target_name(target["backend"], target["arch"]))
        store.put(spec, pack(files))
    except (OSError, KeyError, TypeError, ValueError, StoreError) as e:
        log.warning("Triton kernel %s/%s not stored as an artifact: %s", manager.key, filename, e)


def fetch_group(
    manager: FileCacheManager, store: ArtifactStore, filename: str, target: str
) -> dict[str, str] | None:
    """Write the stored bundle of ``filename``'s kernel into ``manager``'s directory; its group
    (name -> path), or None when the store has no usable bundle."""
    try:
        bundle = store.get(kernel_spec(manager.key, filename, target))
        if bundle is None:
            return None
        files = unpack(bundle)
        if filename not in files:
            raise ArtifactError(f"the bundle has no {filename}: {sorted(files)}")
        group = {name: manager.put(data, name) for name, data in files.items()}
    except (OSError, ArtifactError, StoreError) as e:
        log.warning(
            "Triton kernel %s/%s not loaded from the artifact store: %s", manager.key, filename, e
        )
        return None
    FileCacheManager.put_group(manager, filename, group)  # last: the group lists complete files
    return group
