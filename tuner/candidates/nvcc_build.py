"""Building compiled kernels with nvcc, each in a child process, into one compile cache.

Every source that compiles CUDA code ahead of timing builds here: CUTLASS kernels
(``cutlass_env``), CUTLASS mixed-input kernels and our own CUDA kernels built as shared libraries
of their own (``cutlass_w4a16``, ``cuda_w4a16``). What they share:

- the cache directory (``$CUTLASS_CACHE_DIR``, else ``$XDG_CACHE_HOME/tuner/cutlass``, else
  ``~/.cache/tuner/cutlass``) with a marker per spec (``compiled/``, ``failed/``, named by the
  spec's digest) and the shared libraries (``lib/``);
- ``compile_all``: missing specs compiled in parallel, each in its own process running its
  ``builder`` module (a compiler crash cannot take the tuner down); a spec whose source the
  compiler refuses is remembered with its error and never compiled again (one whose compiler
  was killed, ``killed``, is tried again);
- ``build_library``: a builder's nvcc run that makes one shared library, written in one step.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tuner.core.atomic import write_atomic
from tuner.core.lifetime import group_dies_with_parent, run_group
from tuner.core.settings import env_number

if TYPE_CHECKING:
    from tuner.cache.artifacts import ArtifactSpec

COMPILE_TIMEOUT_S = env_number("TUNER_CUTLASS_COMPILE_TIMEOUT", 900.0)


def cache_dir() -> Path:
    if env := os.environ.get("CUTLASS_CACHE_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tuner" / "cutlass"


def work_dir() -> Path:
    """This process's scratch directory in the cache (sources, compiler logs)."""
    return cache_dir() / "work" / f"p{os.getpid()}"


def nvcc_path() -> str | None:
    """nvcc from $CUDA_INSTALL_PATH, PATH, or /usr/local/cuda, whichever comes first."""
    candidates = []
    if root := os.environ.get("CUDA_INSTALL_PATH"):
        candidates.append(Path(root) / "bin" / "nvcc")
    if found := shutil.which("nvcc"):
        candidates.append(Path(found))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(p) for p in candidates if p.is_file()), None)


@functools.cache
def release() -> str:
    """nvcc's release ("13.0"); "" without nvcc."""
    nvcc = nvcc_path()
    if nvcc is None:
        return ""
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release (\d+\.\d+)", text)
    return found.group(1) if found else ""


def missing_nvcc() -> str | None:
    """Why nothing can be compiled here (no nvcc), else None."""
    if nvcc_path() is None:
        return "nvcc not found: put it on PATH or set CUDA_INSTALL_PATH"
    return None


class BuildSpec(Protocol):
    """What ``compile_all`` builds: its ``builder`` module's ``_main`` takes ``to_json()`` in a
    child process and prints a verdict; ``digest`` names its markers and library."""

    @property
    def digest(self) -> str: ...

    @property
    def builder(self) -> str: ...

    def to_json(self) -> str: ...


class LibrarySpec(BuildSpec, Protocol):
    """A kernel of a source's own built as a shared library (``build_library``), stored in the
    artifact store under its own ``artifact_spec()``."""

    def artifact_spec(self) -> ArtifactSpec: ...


S = TypeVar("S", bound=BuildSpec)


def marker(spec: BuildSpec, kind: str) -> Path:
    """The file that marks ``spec`` as ``kind`` (compiled, failed, or a builder's own kind)."""
    return cache_dir() / kind / f"{spec.digest}.json"


def library_path(spec: BuildSpec) -> Path:
    """Where a kernel built as a shared library of its own (``build_library``) lives."""
    return cache_dir() / "lib" / f"{spec.digest}.so"


def compiled_info(spec: BuildSpec) -> dict[str, Any] | None:
    """The compiled marker's data (compile seconds, the builder's info) once built, else None."""
    path = marker(spec, "compiled")
    return json.loads(path.read_text()) if path.exists() else None


def failure(spec: BuildSpec) -> str | None:
    """The recorded compile error of ``spec``, or None if it never failed, failed under another
    nvcc release than this host's (a new compiler may take what an old one refused), or was
    killed."""
    path = marker(spec, "failed")
    if not path.exists():
        return None
    failed = json.loads(path.read_text())
    under, now = failed.get("nvcc", ""), release()
    if killed(failed["error"]) or (under and now and under != now):
        return None  # (a kill was recorded as final before ``killed`` was asked)
    return failed["error"]


def record(spec: BuildSpec, kind: str, data: dict[str, Any]) -> None:
    """Mark ``spec`` as ``kind`` with ``data``; the marker is written atomically."""
    path = marker(spec, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"spec": json.loads(spec.to_json()), **data}))


def _compile_child(spec: BuildSpec, timeout_s: float) -> str | None:
    """Compile ``spec`` in a fresh process. None on success, else the error (recorded if final)."""
    cmd = [sys.executable, "-m", spec.builder, spec.to_json()]
    try:
        proc = run_group(cmd, timeout_s)  # the child's nvcc dies with it, and it with this run
    except subprocess.TimeoutExpired:
        return f"compile timed out after {timeout_s:.0f} s"
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        verdict = json.loads(last[0])
    except json.JSONDecodeError:
        return f"compiler process exited with {proc.returncode}: {proc.stderr.strip()[-1500:]}"
    if verdict["ok"]:
        return None
    if verdict["permanent"]:
        record(spec, "failed", {"error": verdict["error"], "nvcc": release()})
    return verdict["error"]


def child_main(argv: list[str], build: Callable[[str], dict[str, Any]]) -> int:
    """A builder module's ``_main``, the child process ``compile_all`` starts: ``build`` the spec
    whose JSON is ``argv[0]``, drop this process's scratch directory, print the verdict as the
    last line of stdout (what ``_compile_child`` reads). The child dies with its parent. Its
    compilers speak English (``killed`` reads their words)."""
    group_dies_with_parent()
    os.environ["LC_ALL"] = "C"
    verdict = build(argv[0])
    shutil.rmtree(work_dir(), ignore_errors=True)
    print(json.dumps(verdict), flush=True)
    return 0


def default_jobs(n: int) -> int:
    return int(env_number("TUNER_CUTLASS_JOBS", max(1, min(n, os.cpu_count() or 1, 16))))


def compile_all(
    specs: Sequence[S],
    *,
    needs: Callable[[], str | None],
    jobs: int | None = None,
    timeout_s: float = COMPILE_TIMEOUT_S,
    on_done: Callable[[S], None] | None = None,
) -> dict[S, str | None]:
    """Compile every spec not yet compiled or failed, in parallel processes, in the order given.

    Returns spec -> None (compiled, now or earlier) or its error (now or recorded earlier);
    ``on_done(spec)`` is called as each spec's outcome is known (from the compiling threads).
    ``needs``: why the specs cannot be compiled here (their builder's tools missing), else None;
    asked once, before any child starts, so that a host without the tools spawns none.
    """
    done = on_done or (lambda _spec: None)
    result: dict[S, str | None] = {}
    todo: list[S] = []
    for spec in dict.fromkeys(specs):
        if compiled_info(spec) is not None:
            result[spec] = None
        elif (error := failure(spec)) is not None:
            result[spec] = error
        else:
            todo.append(spec)
            continue
        done(spec)
    if todo and (reason := needs()):
        for spec in todo:
            result[spec] = reason
            done(spec)
        todo = []

    def compile_one(spec: S) -> str | None:
        error = _compile_child(spec, timeout_s)
        result[spec] = error
        done(spec)
        return error

    if todo:
        with ThreadPoolExecutor(max_workers=jobs or default_jobs(len(todo))) as pool:
            list(pool.map(compile_one, todo))
    return {spec: result[spec] for spec in dict.fromkeys(specs)}


# what a compiler stage killed from outside prints (nvcc for cicc or ptxas, g++ for cc1plus,
# collect2 for ld: a SIGKILL, the out-of-memory killer's; or the allocation that failed first):
# the source is not at fault, and a later try may pass. Other signals (a segfault, an abort)
# crash every time.
_KILLED = re.compile(
    r"died due to signal 9\b|Killed signal|terminated with signal 9\b|internal compiler error: "
    r"Killed\b|bad_alloc|out of memory|memory exhausted",
    re.IGNORECASE,
)


def killed(output: str) -> bool:
    """Whether a failed compile's ``output`` says a compiler stage was killed, not refused."""
    return _KILLED.search(output) is not None


def build_library(
    spec: BuildSpec, command: Callable[[Path], list[str]], info: dict[str, Any]
) -> dict[str, Any]:
    """Child-process body of a builder: ``command(out)`` (nvcc) writes a file of this process's
    own, which then replaces ``library_path(spec)`` in one step, so that no loader opens a
    library being written and two builds of one spec never share a file; ``spec`` is then marked
    compiled with ``info``. The verdict ``compile_all`` reads: a compile error fails for good, a
    killed nvcc (a negative exit) or compiler stage (``killed``) may pass later."""
    started = time.perf_counter()
    out = library_path(spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run(command(tmp), capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or [
            f"nvcc exited with {proc.returncode}: {proc.stderr.strip()[-1500:]}"
        ]
        text = "\n".join(errors[:12])[:4000]
        permanent = proc.returncode > 0 and not killed(proc.stderr)
        return {"ok": False, "permanent": permanent, "error": text}
    tmp.replace(out)
    seconds = time.perf_counter() - started
    record(spec, "compiled", {"seconds": round(seconds, 2), **info})
    return {"ok": True, "seconds": seconds}
