"""Our own CUDA kernels (``cuda_kernels/*.cu``), each config built as a shared library by nvcc.

What a hand-written kernel source (``cuda_w4a16``, ``cuda_fp8``) needs beyond its kernel: a
config's compile-time part is a frozen dataclass that mixes in ``CudaLibrary`` (its fields become ``-D``
defines); each library carries the CUDA runtime linked in statically, is built for sm_90a
through ``nvcc_build`` (``compile_all``: a child process per library, a failure remembered and
never compiled again) and loaded with ctypes. It is an artifact (``kernel_artifacts``), keyed by
the kernel source, nvcc's release and the flags, so a host without nvcc runs a library another
host built with the same toolkit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import re
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuner.cache.artifacts import ArtifactSpec
from tuner.candidates import gemm_operands as ops
from tuner.candidates import kernel_artifacts, nvcc_build
from tuner.candidates.base import Params, Source
from tuner.core.keys import GemmKey

ARCH = "sm_90a"
# sm_90a code only, for a kernel that issues wgmma: "-arch=sm_90a" also emits compute_90 PTX,
# where wgmma is not
SM90A_ONLY = ("-gencode", f"arch=compute_90a,code={ARCH}")
KERNELS = Path(__file__).parent / "cuda_kernels"

Launcher = Callable[..., int]


LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def sources_of(source: Path) -> list[Path]:
    """``source`` and the headers it includes from its own folder (``#include "x.cuh"``), each
    once, in the order first included."""
    found: list[Path] = []
    todo = [source]
    while todo:
        path = todo.pop(0)
        if path in found:
            continue
        found.append(path)
        for name in LOCAL_INCLUDE.findall(path.read_bytes()):
            if (header := path.parent / name.decode()).is_file():
                todo.append(header)
    return found


@functools.cache
def source_digest(source: Path) -> str:
    """The digest of ``source`` with its local headers: a library is rebuilt when either moves."""
    digest = hashlib.sha256()
    for path in sources_of(source):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def toolkit() -> str:
    """nvcc's release ("13.0"), which the libraries built here carry in their names; without
    nvcc, the CUDA release torch was built for: the toolkit whose libraries this host loads."""
    return nvcc_build.release() or torch.version.cuda or "none"


def cannot_compile() -> str | None:
    """Why libraries cannot be compiled here (no nvcc), else None."""
    return nvcc_build.missing_nvcc()


class CudaLibrary:
    """Mixin for a frozen dataclass naming one library of a kernel source: ``kind`` (the
    source's name, the artifacts' kind), ``source`` (the .cu file), ``builder`` (the module whose
    ``__main__`` compiles one in a child process) and ``defines()`` (its ``-D`` flags)."""

    kind: ClassVar[str]
    source: ClassVar[Path]
    builder: ClassVar[str]
    arch_flags: ClassVar[tuple[str, ...]] = (f"-arch={ARCH}",)

    def defines(self) -> list[str]:
        raise NotImplementedError

    def flags(self) -> list[str]:
        """nvcc's options, all but the output and the source."""
        return ["-O3", "-lineinfo", *self.arch_flags, "-std=c++17", "-shared", "-Xcompiler",
                "-fPIC", *self.defines()]  # fmt: skip

    def toolchain(self) -> dict[str, str]:
        """What besides the config decides the library: the source, nvcc's release, the flags."""
        flags = hashlib.sha256(" ".join(self.flags()).encode()).hexdigest()[:16]
        return {self.source.name: source_digest(self.source), "nvcc": toolkit(), "flags": flags}

    @property
    def digest(self) -> str:
        fields = {**asdict(self), "arch": ARCH, **self.toolchain()}  # type: ignore[call-overload]
        return (
            f"{self.kind}_"
            + hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls(**json.loads(text))

    def artifact_spec(self) -> ArtifactSpec:
        return ArtifactSpec(self.kind, asdict(self), ARCH, self.toolchain())  # type: ignore[call-overload]

    def nvcc_command(self, nvcc: str, out: Path) -> list[str]:
        return [nvcc, *self.flags(), "-o", str(out), str(self.source)]


def compile_library(lib: CudaLibrary) -> dict[str, Any]:
    """Child-process body of ``nvcc_build.compile_all``: build ``lib`` in the cache; a verdict."""
    nvcc = nvcc_build.nvcc_path()
    if nvcc is None:
        return {"ok": False, "permanent": False, "error": cannot_compile()}
    return nvcc_build.build_library(lib, lambda out: lib.nvcc_command(nvcc, out), {})


def builder_main(library: type[CudaLibrary], argv: list[str]) -> int:
    """A kernel source module's ``__main__``: build the ``library`` whose JSON is ``argv[0]``
    (the child process ``nvcc_build.compile_all`` starts)."""
    return nvcc_build.child_main(argv, lambda text: compile_library(library.from_json(text)))


def compile_all(libs: Iterable[CudaLibrary]) -> dict[Any, str | None]:
    """``libs`` installed from the artifact store, or compiled in parallel child processes (then
    published): library -> None or why it is missing."""
    libs = list(dict.fromkeys(libs))
    kernel_artifacts.install_missing(libs)
    errors = nvcc_build.compile_all(libs, needs=cannot_compile)
    publish(lib for lib, error in errors.items() if error is None)
    return errors


def publish(libs: Iterable[CudaLibrary]) -> None:
    """Store each built library in the artifact store, unless it came from there or is stored."""
    for lib in libs:
        if nvcc_build.compiled_info(lib) is not None:
            kernel_artifacts.publish_once(lib, nvcc_build.library_path(lib))


@functools.cache
def load(path: Path, entry: str, argtypes: tuple[Any, ...]) -> Launcher:
    """The C entry point ``entry`` of the library at ``path`` (loaded once), returning an int."""
    fn = getattr(ctypes.CDLL(str(path)), entry)
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn


def built(lib: CudaLibrary, entry: str, argtypes: tuple[Any, ...]) -> Launcher:
    """``entry`` of ``lib``: installed from the artifact store, else compiled here, unless it
    failed before (RuntimeError with the error)."""
    if error := compile_all([lib])[lib]:
        raise RuntimeError(f"{lib.kind} library {lib}: {error}")
    return load(nvcc_build.library_path(lib), entry, argtypes)


def any_stored(libs: Iterable[CudaLibrary]) -> bool:
    """Whether one of ``libs`` is built here or held by the artifact store (its index, read
    once, not the bytes)."""
    libs = list(libs)
    if any(nvcc_build.compiled_info(lib) is not None for lib in libs):
        return True
    store = kernel_artifacts.shared_store()
    if store is None:
        return False
    stored = store.hashes()
    return any(lib.artifact_spec().id in stored for lib in libs)


def usable(libs: Iterable[CudaLibrary]) -> list[CudaLibrary]:
    """``libs`` less those that failed to compile; without nvcc, only those built here or stored
    (installed now)."""
    chosen = [lib for lib in libs if nvcc_build.failure(lib) is None]
    if cannot_compile():
        kernel_artifacts.install_missing(chosen)
        chosen = [lib for lib in chosen if nvcc_build.compiled_info(lib) is not None]
    return chosen


def precompile_run(libs_of: list[list[CudaLibrary]], ready: Callable[[int], None]) -> None:
    """A tuning run's libraries (per key, in the order first needed), each once, on every core."""
    kernel_artifacts.compile_run(libs_of, ready, cannot_compile)
    publish(dict.fromkeys(lib for libs in libs_of for lib in libs))


def check_keys(config: dict[str, Any], allowed: Sequence[str]) -> None:
    """ValueError naming the keys of ``config`` that are not ``allowed``."""
    extra = set(config) - set(allowed)
    if extra:
        raise ValueError(f"config: unknown keys {sorted(extra)}; allowed {list(allowed)}")


def fitting(
    shortlist: Iterable[tuple[Any, ...]],
    keys: Sequence[str],
    check: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """The configs of ``shortlist`` (each entry ``keys``' values, in order) that ``check`` passes
    (it raises ValueError for one that cannot run the problem)."""
    out = []
    for entry in shortlist:
        config = dict(zip(keys, entry, strict=True))
        try:
            check(config)
        except ValueError:
            continue
        out.append(config)
    return out


def choice(config: dict[str, Any], key: str, allowed: Iterable[Any]) -> Any:
    """``config[key]`` if it is one of ``allowed`` (and of their type), else a ValueError
    naming the field and what is allowed."""
    value = config.get(key)
    allowed = tuple(allowed)
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(f"config[{key!r}]={value!r}: allowed {allowed}")
    return value


class LibrarySource(Source):
    """A candidate source of one of our kernels: a library per config's compile-time part,
    serving every shape, offered on Hopper where nvcc is or where its libraries are stored."""

    op = "gemm"
    builds_kernels = True
    shares_kernels = True

    @staticmethod
    @abstractmethod
    def library(params: Params) -> CudaLibrary:
        """The library that runs ``params``."""

    @abstractmethod
    def libraries(self) -> Iterable[CudaLibrary]:
        """Every library a shortlist of this source may name."""

    @abstractmethod
    def configs(self, key: GemmKey) -> list[Params]:
        """The shortlist for ``key``, before failed or missing libraries are left out."""

    def unavailable(self, device: str) -> str | None:
        if reason := ops.unavailable_reason(device, self.name, lambda: None):
            return reason
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"compute capability {cap}: the kernel is built for sm_90a (Hopper) only"
        if cannot_compile() and not any_stored(self.libraries()):
            return f"nvcc not found and no built {self.name} library here or in the artifact store"
        return None

    def candidates(self, key: Any, device: str) -> list[Params]:
        """The shortlist less configs whose library failed to compile; without nvcc, only
        those whose library is built here or stored (installed now)."""
        chosen = self.configs(key)
        ok = set(usable(map(self.library, chosen)))
        return [c for c in chosen if self.library(c) in ok]

    def precompile(self, key: Any, shortlist: list[Params]) -> None:
        compile_all(map(self.library, shortlist))  # failures are recorded, and raised by build

    def precompile_run(
        self, shortlists: list[tuple[Any, list[Params]]], ready: Callable[[int], None]
    ) -> None:
        precompile_run([[self.library(p) for p in s] for _, s in shortlists], ready)
