"""A compiled kernel as an artifact, so that a host without nvcc can load and run it: a CUTLASS
kernel, or a shared library that ``nvcc_build`` built (CUTLASS wrappers, our own CUDA kernels).

cutlass_cppgen keeps each compiled kernel as one row of ``compiled_cache.db`` (in
``nvcc_build.cache_dir()``): the device cubin, the host module (a shared object with the
argument packing functions), the kernel's name and attributes, keyed by the emitted C++ source.
When ``plan.compile`` finds that row it loads both without compiling. So the artifact of a
``KernelSpec`` is that row as a bundle (``kernel.cubin``, ``host.so``, ``operation.json``);
``publish`` stores it after a build, and ``install`` writes it back into an empty
``compiled_cache.db`` and marks the spec compiled, after which ``cutlass_env.load`` finds it.
``install_missing`` and ``publish_once`` are the builder's calls around ``compile_all``: a
failing store costs a log line, never a build.
The host module links against the CUDA runtime library, which the loading host needs.
A kernel built as a shared library of its own (``cutlass_env.BUILDERS``, or another source's
``nvcc_build.LibrarySpec``; its "op" is the library's path) is the bundle of that one file,
``kernel.so``, installed at ``nvcc_build.library_path``. ``compile_run`` is a tuning run's
install-or-compile of all of them.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tuner.cache.artifacts import (
    ArtifactError,
    ArtifactSpec,
    ArtifactStore,
    pack,
    shared_store,
    unpack,
)
from tuner.cache.sqlite import StoreError
from tuner.candidates import cutlass_env as env
from tuner.candidates import nvcc_build
from tuner.core.atomic import write_atomic

log = logging.getLogger(__name__)

# cutlass_cppgen's table, created by its ArtifactManager on import; ``install`` may run first.
_TABLE = (
    "create table if not exists compiled_operations(op_key text not null unique, "
    "cubin blob not null, hostbin blob not null, op_name text not null, op_attrs text not null)"
)


LIBRARY = "kernel.so"


def artifact_spec(spec: env.Spec) -> ArtifactSpec:
    """What stores ``spec``'s kernel: its fields, the arch, the CUTLASS version and, for kernels
    built as libraries of their own, the wrapper that built them (``env.builder_fields``); another
    source's library (``nvcc_build.LibrarySpec``) names its own."""
    if not isinstance(spec, env.KernelSpec):
        return spec.artifact_spec()
    toolchain = {"cutlass": env.version(), **env.builder_fields(spec)}
    return ArtifactSpec("cutlass", json.loads(spec.to_json()), f"sm{env.SM}", toolchain)


def _op_key(op: Any) -> str:
    """cutlass_cppgen's cache key of a compiled operation (its ``ArtifactManager.add_module``)."""
    manager = env.cutlass().backend.compiler
    return op.rt_module.emit() + op.procedural_name() + manager.backend


def bundle(op: Any) -> bytes:
    """The cached row of ``op`` (a compiled GemmOperationUniversal) as an artifact bundle, or
    ``op``'s file where it is a kernel's own shared library (a path)."""
    if isinstance(op, Path):
        return pack({LIBRARY: op.read_bytes()})
    key = _op_key(op)
    with sqlite3.connect(nvcc_build.cache_dir() / env.CACHE_NAME) as conn:
        row = conn.execute(
            "select cubin, hostbin, op_name, op_attrs from compiled_operations where op_key = ?",
            (key,),
        ).fetchone()
    if row is None:
        raise LookupError(f"{op.procedural_name()} is not in cutlass_cppgen's compiled cache")
    cubin, hostbin, op_name, op_attrs = row
    meta = {"op_key": key, "op_name": op_name, "op_attrs": op_attrs, "name": op.procedural_name()}
    return pack(
        {"kernel.cubin": cubin, "host.so": hostbin, "operation.json": json.dumps(meta).encode()}
    )


def publish(store: ArtifactStore, spec: env.Spec, op: Any) -> str:
    """Store the compiled ``op`` of ``spec``; the artifact's hash."""
    return store.put(artifact_spec(spec), bundle(op))


def install(store: ArtifactStore, spec: env.Spec) -> bool:
    """Put ``spec``'s stored kernel where ``cutlass_env.load`` finds it; False if not stored."""
    data = store.get(artifact_spec(spec))
    if data is None:
        return False
    files = unpack(data)
    if LIBRARY in files:
        path = nvcc_build.library_path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, files[LIBRARY])
        nvcc_build.record(spec, "compiled", {"artifact": artifact_spec(spec).id})
        return True
    try:
        meta = json.loads(files["operation.json"])
        row = (meta["op_key"], files["kernel.cubin"], files["host.so"], meta["op_name"])
        row += (meta["op_attrs"],)
    except (KeyError, ValueError) as e:
        raise ArtifactError(f"not a CUTLASS kernel bundle: missing {e}") from None
    path = nvcc_build.cache_dir() / env.CACHE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as conn:
        conn.execute(_TABLE)
        conn.execute("insert or ignore into compiled_operations values (?, ?, ?, ?, ?)", row)
    nvcc_build.record(spec, "compiled", {"name": meta["name"], "artifact": artifact_spec(spec).id})
    return True


def install_missing(specs: Iterable[env.Spec], store: ArtifactStore | None = None) -> None:
    """Install the stored kernel of every spec not yet compiled (nor failed) here, so that
    ``compile_all`` compiles only what no host has built. ``store``: the shared one by default,
    opened only when a spec needs it."""
    for spec in specs:
        if nvcc_build.compiled_info(spec) is not None or nvcc_build.failure(spec) is not None:
            continue
        store = store or shared_store()
        if store is None:
            return
        try:
            install(store, spec)
        except (ArtifactError, StoreError, OSError, sqlite3.Error) as e:
            log.warning("stored kernel %s not installed, compiling it: %s", spec.digest, e)


def publish_once(spec: env.Spec, op: Any, store: ArtifactStore | None = None) -> None:
    """Publish the compiled ``op`` of ``spec`` (to the shared store by default) unless this
    cache marks it published, or installed, already."""
    info = nvcc_build.compiled_info(spec)
    if info is None or "artifact" in info or (store := store or shared_store()) is None:
        return
    try:
        publish(store, spec, op)
    except (LookupError, ArtifactError, StoreError, OSError, sqlite3.Error) as e:
        log.warning("kernel %s not stored as an artifact: %s", spec.digest, e)
        return
    nvcc_build.record(spec, "compiled", {**info, "artifact": artifact_spec(spec).id})


def compile_run(
    specs_of: Sequence[Sequence[env.Spec]],
    ready: Callable[[int], None],
    needs: Callable[[], str | None],
) -> None:
    """A tuning run's kernels (``Source.precompile_run``): every distinct spec of ``specs_of``
    (one list per problem) installed or compiled once, on every core, in the order first needed;
    ``ready(i)`` once the specs of problem i are all compiled (or failed); ``needs`` as
    ``nvcc_build.compile_all``'s."""
    specs = list(dict.fromkeys(s for specs in specs_of for s in specs))
    missing = [set(specs) for specs in specs_of]
    lock = threading.Lock()

    def done(spec: env.Spec) -> None:
        with lock:
            for i, need in enumerate(missing):
                if spec in need:
                    need.discard(spec)
                    if not need:
                        ready(i)

    for i, need in enumerate(missing):
        if not need:
            ready(i)
    install_missing(specs)
    nvcc_build.compile_all(specs, on_done=done, needs=needs)
