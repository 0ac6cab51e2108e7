"""nvidia-cutlass 4.2 (``cutlass_cppgen``) set up for the tuner, and its kernel compile cache.

What this module fixes or adds around ``cutlass_cppgen``:

- CUDA 13 imports: ``cuda.cuda``/``cuda.cudart``/``cuda.nvrtc`` are mapped onto
  ``cuda.bindings.driver/runtime/nvrtc`` and ``cuda.__version__`` is set before the import;
- ``-DNDEBUG`` joins the nvcc options (without it ptxas serialises wgmma), ``CUDA_INSTALL_PATH``
  is set from nvcc's location; without nvcc the package still imports and loads compiled
  kernels (``missing``: what loading needs, ``cannot_compile``: what compiling needs);
- ``compiled_cache.db`` and every scratch file live in ``nvcc_build``'s cache directory, never
  in the current directory, and only a compile changes directory (a load of a cached kernel
  leaves every thread's working directory and ``tempfile.tempdir`` as they were);
- the option registry holds SM90 GEMMs only (much faster to build than every arch's).

A compiled kernel is shape-independent: one per ``KernelSpec`` (dtypes, layouts, alignments, tile,
cluster, schedules), reused for every problem; ``nvcc_build.compile_all`` compiles missing specs,
each in a child process that runs this module (or the spec's ``BUILDERS`` module).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from tuner.candidates import nvcc_build
from tuner.core.keys import FP8

S = TypeVar("S", bound=nvcc_build.BuildSpec)

SM = 90
TMA_EPILOGUES = ("TmaWarpSpecialized", "TmaWarpSpecializedCooperative")
OPTIONAL_FIELDS = ("wdtype", "out_dtype", "scale", "a_layout")
# (batch, M, N) of the example tensors scaled epilogues are traced on: sizes other than 0 and 1
# keep every stride a runtime value, so that one kernel serves every shape.
EVT_EXAMPLE = (2, 256, 256)
# wdtype -> the module whose ``_main`` compiles such specs: kernels cutlass_cppgen cannot build,
# made as shared libraries of their own (``nvcc_build.build_library``); every other spec compiles
# here.
BUILDERS = {"int4": "tuner.candidates.cutlass_w4a16"}
# FP8 CTA widths ``derived`` may take: the cooperative TMA epilogue's subtile (32 columns) up to
# the widest wgmma (256)
DERIVED_N_STEP, DERIVED_N_MAX = 32, 256
_LOCK = threading.RLock()  # cutlass_cppgen keeps global state (cwd, tempfile.tempdir, plans)
# cutlass_cppgen's table of loaded kernels, one a GPU (``_kernels_of_this_gpu``)
_KERNELS_BY_GPU: dict[int, dict[str, Any]] = {}
CACHE_NAME = "compiled_cache.db"  # cutlass_cppgen's kernel cache, by its name


def missing() -> str | None:
    """Why compiled CUTLASS kernels cannot be loaded here (packages), without importing them.
    Loading needs no nvcc: a kernel built elsewhere is installed from the artifact store."""
    import importlib.util

    if importlib.util.find_spec("cutlass_cppgen") is None:
        return "package missing: nvidia-cutlass (import name cutlass_cppgen)"
    if (
        importlib.util.find_spec("cuda") is None
        or importlib.util.find_spec("cuda.bindings") is None
    ):
        return "package missing: cuda-bindings"
    return None


def cannot_compile() -> str | None:
    """Why CUTLASS kernels cannot be compiled here (``missing``, or no nvcc), else None."""
    return missing() or nvcc_build.missing_nvcc()


def compile_all(specs: Sequence[S], **options: Any) -> dict[S, str | None]:
    """``nvcc_build.compile_all`` for CUTLASS specs (CUTLASS's own and the mixed-input
    libraries built on its headers): refused where CUTLASS or nvcc is missing."""
    return nvcc_build.compile_all(specs, needs=cannot_compile, **options)


# --- the import -------------------------------------------------------------------------------


@contextlib.contextmanager
def _in_dir(path: Path) -> Iterator[None]:
    """Run cutlass_cppgen code whose files land in the current directory inside ``path``: its
    compiles only (a child process's, or a load that must compile), since the working directory
    is the whole process's, every thread's relative paths moving with it."""
    path.mkdir(parents=True, exist_ok=True)
    with _LOCK:
        before, tmp_before = os.getcwd(), tempfile.tempdir
        os.chdir(path)
        try:
            yield
        finally:
            os.chdir(before)
            tempfile.tempdir = tmp_before  # cutlass_cppgen sets it to "./" for good


@contextlib.contextmanager
def _cache_file_in(root: Path) -> Iterator[None]:
    """cutlass_cppgen's ArtifactManager, made as it is imported, opens ``compiled_cache.db`` in
    the working directory: while it imports, SQLite opens that name in ``root`` instead (and
    every other name as given), where changing directory would move every thread's paths."""
    import sqlite3

    connect = sqlite3.connect

    def connect_in_root(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        if database == CACHE_NAME:
            database = str(root / CACHE_NAME)
        return connect(database, *args, **kwargs)

    sqlite3.connect = connect_in_root
    try:
        yield
    finally:
        sqlite3.connect = connect


def _host_library(host_binary: bytes) -> Any:
    """cutlass_cppgen's ``CDLLBin``, which loads a cached kernel's host library, without the
    working directory: written in this process's work folder by its full path (the original
    sets ``tempfile.tempdir`` to "./" for good and writes wherever the process stands)."""
    import ctypes

    folder = nvcc_build.work_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix="host_func", suffix=".so") as f:
        f.write(host_binary)
        f.flush()
        return ctypes.CDLL(f.name)  # loaded: the file may go


def _compiling_in(manager: Any, folder: Callable[[], Path]) -> None:
    """``manager`` (the ArtifactManager) compiling in ``folder()``: the only cutlass_cppgen step
    that writes in the working directory (sources, nvcc's error files) once loads do not."""
    compile_kernels = manager.emit_compile_

    def emit_compile_in_folder(*args: Any) -> Any:
        with _in_dir(folder()):
            return compile_kernels(*args)

    manager.emit_compile_ = emit_compile_in_folder


def _map_cuda_bindings() -> None:
    """CUDA 13's cuda-bindings has no ``cuda.cuda``/``cuda.cudart``/``cuda.nvrtc`` any more."""
    import cuda
    import cuda.bindings
    from cuda.bindings import driver, nvrtc, runtime

    for name, module in (("cuda", driver), ("cudart", runtime), ("nvrtc", nvrtc)):
        sys.modules.setdefault(f"cuda.{name}", module)
    if not hasattr(cuda, "__version__"):
        cuda.__version__ = cuda.bindings.__version__


@functools.cache
def cutlass() -> Any:
    """``cutlass_cppgen``, imported with the fixes above (needs a GPU; nvcc only to compile)."""
    reason = missing()
    if reason:
        raise ImportError(reason)
    _map_cuda_bindings()
    nvcc = nvcc_build.nvcc_path()
    if nvcc is not None:
        os.environ.setdefault("CUDA_INSTALL_PATH", str(Path(nvcc).parent.parent))
        if shutil.which("nvcc") is None:  # cutlass_cppgen runs `which nvcc` itself
            os.environ["PATH"] = str(Path(nvcc).parent) + os.pathsep + os.environ.get("PATH", "")
    root = nvcc_build.cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with _LOCK, _cache_file_in(root):  # its ArtifactManager opens the file at import time
        import cutlass_cppgen
        import cutlass_library
        import cutlass_library.generator  # skipped by its __init__ whenever "-m" is in sys.argv
        from cutlass_cppgen.library_defaults import ArchOptions, OptionRegistry

        compiler_module = sys.modules["cutlass_cppgen.backend.compiler"]
        compiler_module.CACHE_FILE = str(root / CACHE_NAME)
        compiler_module.CDLLBin = _host_library
        manager = cutlass_cppgen.backend.compiler  # the ArtifactManager instance
        _compiling_in(manager, nvcc_build.work_dir)
        if "-DNDEBUG" not in manager._nvcc_compile_options:
            manager._nvcc_compile_options.append("-DNDEBUG")
        if nvcc is None:  # load only: what cutlass_cppgen would ask nvcc for, it never uses
            _without_nvcc(cutlass_cppgen)
        cutlass_cppgen.initialize_cuda_context()  # also reads nvcc's version
        registry = OptionRegistry.__new__(OptionRegistry)
        gemm = cutlass_library.OperationKind.Gemm
        kinds = [cutlass_library.GemmKind.Universal, cutlass_library.GemmKind.Universal3x]
        registry.registry = {SM: {gemm: ArchOptions(SM, SM, gemm, kinds)}}
        cutlass_cppgen._option_registry = registry
    return cutlass_cppgen


def _without_nvcc(cutlass_cppgen: Any) -> None:
    """Answer cutlass_cppgen's two nvcc questions on a host that only loads kernels: its CUDA
    install path (it runs ``which nvcc``) and nvcc's version (it runs ``nvcc --version`` to
    check it against cuda-bindings'). Loading a cached kernel uses neither; a compile on such a
    host fails at ``nvcc_build.compile_all`` with ``cannot_compile``'s reason, before
    cutlass_cppgen runs."""
    import cuda

    cutlass_cppgen._CUDA_INSTALL_PATH = os.environ.get("CUDA_INSTALL_PATH", "")
    cutlass_cppgen._NVCC_VERSION = cuda.__version__.split("rc")[0]


@functools.cache
def version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cutlass")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --- kernel specs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelSpec:
    """Everything that makes one compiled kernel (and nothing about the problem's shape).

    The last four fields describe low-precision GEMMs and are empty for plain ones; an empty
    field is left out of the spec's JSON and digest, so that plain specs, and the stored
    kernels their digests address, read exactly as before those fields existed."""

    dtype: str  # f16 / bf16 / f32 (A, B, C and D; fp32 accumulation), or A's FP8 type
    layout: str  # "nn", "nt", "tn", "tt" of A and B; C is row-major
    align_ab: int  # elements
    align_c: int  # elements
    tile: tuple[int, int, int]  # cutlass_cppgen's threadblock_shape (the cluster's tile)
    cluster: tuple[int, int]
    kernel: str  # KernelScheduleType name
    epilogue: str  # "tma" or "default" (no shared-memory epilogue)
    scheduler: str  # TileSchedulerType name: "Default" or "StreamK"
    wdtype: str = ""  # B's type where it is not dtype
    out_dtype: str = ""  # D's type where it is not dtype
    scale: str = ""  # "tensor" / "row": D = acc * scale_a * scale_b (an EVT epilogue)
    a_layout: str = ""  # the narrow operand's layout where not row-major: "reordered"

    def _fields(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: v for k, v in data.items() if v != "" or k not in OPTIONAL_FIELDS}

    @property
    def digest(self) -> str:
        fields = {**self._fields(), "sm": SM, "cutlass": version(), **builder_fields(self)}
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]

    def to_json(self) -> str:
        return json.dumps(self._fields(), sort_keys=True)

    @property
    def builder(self) -> str:
        """The module whose ``_main`` compiles this spec in a child process."""
        return BUILDERS.get(self.wdtype, "tuner.candidates.cutlass_env")

    @classmethod
    def from_json(cls, text: str) -> KernelSpec:
        data = json.loads(text)
        data["tile"], data["cluster"] = tuple(data["tile"]), tuple(data["cluster"])
        return cls(**data)


def builder_fields(spec: KernelSpec) -> dict[str, str]:
    """A builder's own host C++ is part of the libraries it makes (``BUILDERS``: its module's
    ``wrapper_fields``), so that a wrapper change addresses new ones; nothing for other specs."""
    module = BUILDERS.get(spec.wdtype)
    return {} if module is None else importlib.import_module(module).wrapper_fields(spec)


# What the CUTLASS artifact store keeps: CUTLASS kernels and other sources' own libraries.
Spec = KernelSpec | nvcc_build.LibrarySpec


# --- building (in this process) ---------------------------------------------------------------


def _element(dtype: str) -> Any:
    import cutlass_library as cl

    return {
        "bf16": cl.DataType.bf16, "f16": cl.DataType.f16, "f32": cl.DataType.f32,
        "fp8_e4m3": cl.DataType.e4m3, "fp8_e5m2": cl.DataType.e5m2,
    }[dtype]  # fmt: skip


@functools.cache
def _plan(dtype: str, layout: str, wdtype: str = "", out_dtype: str = "", scale: str = "") -> Any:
    cc = cutlass()
    import cutlass_library as cl

    major = {"n": cl.LayoutType.RowMajor, "t": cl.LayoutType.ColumnMajor}
    out = _element(out_dtype or dtype)
    plan = cc.Gemm(
        element_A=_element(dtype), element_B=_element(wdtype or dtype), element_C=out,
        element_D=out, element_accumulator=cl.DataType.f32, layout_A=major[layout[0]],
        layout_B=major[layout[1]], layout_C=cl.LayoutType.RowMajor, cc=SM, kernel_cc=SM,
    )  # fmt: skip
    if scale:
        plan.epilogue_visitor = scaled_epilogue(scale, out)
    return plan


def _plan_fields(spec: KernelSpec) -> tuple[str, ...]:
    return (spec.dtype, spec.layout, spec.wdtype, spec.out_dtype, spec.scale)


def _plan_of(spec: KernelSpec) -> Any:
    return _plan(*_plan_fields(spec))


def prepare(spec: KernelSpec) -> None:
    """Build what ``load`` of a kernel like ``spec`` needs first: the library's registry (seconds
    per process), the plan and its tile descriptions."""
    _tile_descriptions(*_plan_fields(spec))


# Parsed, not run: cutlass_cppgen traces this source into the epilogue (D names its output; a
# docstring here would be traced as a constant).
def _scale_product(accum: Any, scale_a: Any, scale_b: Any) -> Any:
    D = accum * scale_a * scale_b
    return D


def scaled_epilogue(scale: str, out_element: Any) -> Any:
    """The EVT epilogue ``D = acc * scale_a * scale_b`` (float32 math, D rounded once to
    ``out_element``): tensorwise, two device scalars (``Sm90ScalarBroadcast`` through a
    pointer, read by the kernel); rowwise, scale_a a column broadcast [M, 1] and scale_b a row
    broadcast [1, N]. Traced on example tensors of one fixed size, so that the emitted kernel
    (and its compile-cache entry) is the same for every problem; a launcher patches pointers
    and D's strides into the arguments per call."""
    cc = cutlass()
    import cutlass_library as cl

    batch, m, n = EVT_EXAMPLE
    shapes = {"tensor": ((1, 1), (1, 1)), "row": ((m, 1), (1, n))}
    if scale not in shapes:
        raise ValueError(f"scale={scale!r}: allowed {sorted(shapes)}")

    def example(element: Any, shape: tuple[int, ...]) -> Any:
        return cc.Tensor(element=element, shape=shape, layout_tag=cl.LayoutType.RowMajor)

    f32 = cl.DataType.f32
    sa, sb = shapes[scale]
    examples = {"accum": example(f32, (batch, m, n)), "scale_a": example(f32, sa),
                "scale_b": example(f32, sb), "D": example(out_element, (batch, m, n))}  # fmt: skip
    return cc.epilogue.trace(_scale_product, examples, cc=SM)


def offers(spec: KernelSpec, lookup: Callable[[KernelSpec], Any]) -> bool:
    """Whether the library offers ``spec`` (``lookup`` raises LookupError where it does not).

    Asking the library means building its kernel registry, seconds per process; a spec that
    compiled is offered, and a spec found missing is marked so (in the cache, per library
    version), so a warm run's shortlists need no registry."""
    if nvcc_build.compiled_info(spec) is not None:
        return True
    if nvcc_build.marker(spec, "absent").exists():
        return False
    try:
        lookup(spec)
    except LookupError:
        nvcc_build.record(spec, "absent", {})
        return False
    return True


def epilogue_kind(td: Any) -> str:
    return "tma" if td.epilogue_schedule.name in TMA_EPILOGUES else "default"


def tile_description(spec: KernelSpec) -> Any:
    """cutlass_cppgen's TileDescription of ``spec`` (listed, or for FP8 ``derived``);
    LookupError if it offers none."""
    index = _tile_descriptions(*_plan_fields(spec))
    found = index.get((spec.tile, spec.cluster, spec.kernel, spec.scheduler, spec.epilogue))
    if found is None and spec.dtype in FP8:
        found = derived(spec, index.items())
    if found is None:
        raise LookupError(f"cutlass_cppgen {version()} offers no SM90 kernel for {spec}")
    return found


def derivable(tile: tuple[int, int, int], cluster: tuple[int, int]) -> bool:
    """Whether an FP8 ``derived`` tile may take this (cluster tile, cluster): whole CTAs whose
    N is a multiple of the cooperative TMA epilogue's 32 columns, at most the widest wgmma's."""
    if any(t % c for t, c in zip(tile, cluster, strict=False)):
        return False
    cta_n = tile[1] // cluster[1]
    return cta_n % DERIVED_N_STEP == 0 and cta_n <= DERIVED_N_MAX


def derived(spec: KernelSpec, listed: Iterable[tuple[tuple[Any, ...], Any]]) -> Any:
    """A TileDescription for an FP8 tile the generator does not list (it lists 128- and
    256-wide CTAs only; SM90's CollectiveBuilder takes any wgmma width), cloned from a listed
    one of the same cluster, schedules and tile K: only ``threadblock_shape`` differs, which is
    all the SM90 emitter reads of it (the builder picks the wgmma from the tile). None where
    no listed kernel matches or the tile is not ``derivable``; the builder's static_asserts
    judge the rest, at compile time (a failure is recorded like any other)."""
    if not derivable(spec.tile, spec.cluster):
        return None
    for (tile, cluster, kernel, scheduler, epilogue), td in listed:
        if (cluster, kernel, scheduler, epilogue, tile[2]) == (
            spec.cluster, spec.kernel, spec.scheduler, spec.epilogue, spec.tile[2]
        ):  # fmt: skip
            return td.clone_and_update({"threadblock_shape": list(spec.tile)})
    return None


@functools.cache
def _tile_descriptions(*plan: str) -> dict[tuple[Any, ...], Any]:
    """A plan's tile descriptions by the spec fields that pick one (the first of equals wins):
    the plan builds its list anew on every call."""
    index: dict[tuple[Any, ...], Any] = {}
    for td in _plan(*plan).tile_descriptions():
        fields = (tuple(td.threadblock_shape), tuple(td.cluster_shape)[:2],
                  td.kernel_schedule.name, td.tile_scheduler.name, epilogue_kind(td))  # fmt: skip
        index.setdefault(fields, td)
    return index


def load(spec: KernelSpec) -> Any:
    """The compiled GemmOperationUniversal of ``spec``: from the cache, else compiled here (in
    the work folder, ``_compiling_in``); a load from the cache leaves the working directory be,
    so a model's threads keep theirs while a winner loads beside them."""
    with _LOCK:
        _kernels_of_this_gpu()
        plan = _plan_of(spec)
        td = tile_description(spec)
        return plan.compile(
            td, alignment_A=spec.align_ab, alignment_B=spec.align_ab, alignment_C=spec.align_c
        )


def _kernels_of_this_gpu() -> None:
    """Point cutlass_cppgen's table of loaded kernels at the current GPU's. It keeps one table,
    keyed by the kernel alone, while a kernel handle loaded in one GPU's context launches only
    there: with a table a GPU, a kernel another GPU loaded first is loaded again (from the
    cache file) for this one."""
    import torch

    manager = cutlass().backend.compiler  # the ArtifactManager instance
    manager.compiled_cache_device = _KERNELS_BY_GPU.setdefault(torch.cuda.current_device(), {})


# --- compiling (in a child process of nvcc_build.compile_all) ------------------------------------


def _compile_errors(workdir: Path) -> str:
    """The error lines of cutlass_cppgen's compile logs (static_assert and friends)."""
    lines: list[str] = []
    for log in sorted(workdir.glob("cutlass_python_compilation_*error.txt")):
        after = log.read_text(errors="replace").partition("Error Message:")[2]
        lines += [ln.strip() for ln in after.splitlines() if "error" in ln.lower()]
    return "\n".join(lines[:12])


def _compile_here(spec: KernelSpec) -> dict[str, Any]:
    """Child-process body: compile ``spec`` into the cache; a JSON-able verdict."""
    started = time.perf_counter()
    try:
        op = load(spec)
    except Exception as e:
        detail = _compile_errors(nvcc_build.work_dir())
        # cutlass_cppgen says "Invalid Kernel" for any failed nvcc: only its log's errors tell a
        # refused kernel from a killed compiler (``nvcc_build.killed``) or an unknown cause
        refused = "Invalid" in str(e) and bool(detail) and not nvcc_build.killed(detail)
        permanent = isinstance(e, LookupError | ValueError) or refused
        text = f"{type(e).__name__}: {e}" + (f"\n{detail}" if detail else "")
        return {"ok": False, "permanent": permanent, "error": text[:4000]}
    seconds = time.perf_counter() - started
    info = {"seconds": round(seconds, 2), "name": op.procedural_name()}
    nvcc_build.record(spec, "compiled", info)
    return {"ok": True, "seconds": seconds}


def _main(argv: list[str]) -> int:
    return nvcc_build.child_main(argv, lambda text: _compile_here(KernelSpec.from_json(text)))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
