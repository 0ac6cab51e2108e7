"""CUTLASS 3 SM90 GEMMs (TMA warp-specialized cooperative / pingpong, stream-K) via cutlass_cppgen.

Params describe one compiled kernel plus a launch-time option::

    {"tile": [256, 128, 64], "cluster": [2, 1], "kernel": "coop", "epilogue": "tma",
     "scheduler": "default", "swizzle": 1}

``tile`` is cutlass_cppgen's threadblock shape (the whole cluster's tile: each CTA computes
tile/cluster), ``kernel`` one of KERNELS, ``epilogue`` "tma" or "default" (no shared-memory
epilogue), ``scheduler`` "default" (persistent) or "streamk", ``swizzle`` the tile scheduler's
raster swizzle (1, 2, 4, 8: a runtime argument, no new kernel).

The shortlist is shape-aware and small (4-6 configs: 64-row tiles and stream-K for decode, 128/256
tiles with 2-CTA clusters for large problems). ``precompile`` compiles the shortlist's missing
kernels in parallel before any is timed (nvcc_build); kernels are shape-independent, so a warm
cache makes this free. Runners launch through the driver API with the kernel arguments patched per
call (pointers, strides): no per-call planning and no per-call allocation. Compiled kernels are
artifacts (``kernel_artifacts``): installed before compiling, published after a build, and
loaded without nvcc on a host that has none.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, ClassVar, Generic, TypeVar

import torch

from tuner.candidates import cutlass_env as env
from tuner.candidates import gemm_operands as ops
from tuner.candidates import kernel_artifacts, nvcc_build
from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import ITEMSIZE, GemmKey

KERNELS = {
    "ws": "TmaWarpSpecialized",
    "coop": "TmaWarpSpecializedCooperative",
    "pingpong": "TmaWarpSpecializedPingpong",
    "cpasync": "CpAsyncWarpSpecialized",
    "cpasync_coop": "CpAsyncWarpSpecializedCooperative",
}
SCHEDULERS = {"default": "Default", "streamk": "StreamK"}
EPILOGUES = ("tma", "default")
SWIZZLES = (1, 2, 4, 8)
PARAM_NAMES = ("tile", "cluster", "kernel", "epilogue", "scheduler", "swizzle")

T = TypeVar("T")


def _p(
    tm: int,
    tn: int,
    cluster: tuple[int, int],
    kernel: str,
    epilogue: str,
    scheduler: str = "default",
) -> Params:
    return {"tile": [tm, tn, 0], "cluster": list(cluster), "kernel": kernel,
            "epilogue": epilogue, "scheduler": scheduler, "swizzle": 1}  # fmt: skip


# Shape classes -> configs, best guesses first. K of the tile is filled in per dtype.
DECODE = [  # M <= 64: bandwidth-bound; 64-row tiles, stream-K to spread K over the SMs
    _p(64, 256, (1, 2), "pingpong", "tma"),
    _p(64, 256, (1, 2), "ws", "default"),
    _p(128, 128, (1, 2), "coop", "default", "streamk"),
    _p(128, 256, (1, 2), "coop", "default", "streamk"),
]
MEDIUM = [  # M <= 512: few tiles; stream-K and narrow tiles keep the SMs busy
    _p(128, 256, (1, 2), "coop", "tma"),
    _p(128, 128, (1, 2), "coop", "default", "streamk"),
    _p(64, 256, (1, 2), "pingpong", "tma"),
    _p(128, 256, (1, 2), "coop", "default", "streamk"),
    _p(128, 128, (2, 1), "pingpong", "tma"),
]
LARGE = [  # compute-bound: 128x128 / 256x128 CTAs, 2-CTA clusters
    _p(256, 128, (2, 1), "coop", "tma"),
    _p(128, 256, (1, 2), "coop", "tma"),
    _p(256, 256, (1, 2), "coop", "tma"),
    _p(256, 256, (2, 1), "coop", "tma"),
    _p(128, 256, (1, 2), "pingpong", "tma"),
    _p(256, 128, (2, 1), "coop", "default", "streamk"),
]
UNALIGNED = [  # operands 4- or 8-byte aligned: cp.async kernels (TMA needs 16 bytes)
    _p(128, 128, (1, 1), "cpasync_coop", "default"),
    _p(128, 256, (1, 1), "cpasync_coop", "default"),
    _p(128, 128, (1, 1), "cpasync_coop", "default", "streamk"),
]


def tile_k(key: GemmKey) -> int:
    return 32 if key.dtype == "f32" else 64


def shortlist(key: GemmKey) -> list[Params]:
    """The configs worth compiling and timing for this problem (before availability checks)."""
    if key.align < 16:
        base = UNALIGNED
    elif key.m <= 64:
        base = DECODE
    elif key.m <= 512 or key.n <= 512:
        base = MEDIUM
    else:
        base = LARGE
    k = tile_k(key)
    return [{**p, "tile": [p["tile"][0], p["tile"][1], k]} for p in base]


def check_params(params: Params) -> None:
    unknown = set(params) - set(PARAM_NAMES)
    if unknown:
        raise ValueError(f"unknown cutlass params {sorted(unknown)}; allowed: {list(PARAM_NAMES)}")
    missing = [p for p in PARAM_NAMES[:5] if p not in params]
    if missing:
        raise ValueError(f"cutlass params need {missing}")
    tile, cluster = params["tile"], params["cluster"]
    if not (
        isinstance(tile, list | tuple)
        and len(tile) == 3
        and all(isinstance(x, int) and x > 0 for x in tile)
    ):
        raise ValueError(f"cutlass param 'tile' must be 3 positive ints, got {tile!r}")
    if not (
        isinstance(cluster, list | tuple)
        and len(cluster) == 2
        and all(isinstance(x, int) and x > 0 for x in cluster)
    ):
        raise ValueError(f"cutlass param 'cluster' must be 2 positive ints, got {cluster!r}")
    for name, allowed in (("kernel", KERNELS), ("epilogue", EPILOGUES), ("scheduler", SCHEDULERS)):
        if params[name] not in allowed:
            raise ValueError(
                f"cutlass param {name!r} must be one of {list(allowed)}, got {params[name]!r}"
            )
    if params.get("swizzle", 1) not in SWIZZLES:
        raise ValueError(
            f"cutlass param 'swizzle' must be one of {SWIZZLES}, got {params['swizzle']!r}"
        )


def kernel_spec(key: GemmKey, params: Params) -> env.KernelSpec:
    """The compiled kernel ``params`` need for ``key`` (dtypes, layouts, alignments, config)."""
    check_params(params)
    item = ITEMSIZE[key.dtype]
    tma = params["kernel"] in ("ws", "coop", "pingpong")
    return env.KernelSpec(
        dtype=key.dtype,
        layout=key.layout,
        align_ab=16 // item if tma else min(key.align, 16) // item,
        align_c=16 // ITEMSIZE[key.out_dtype],
        tile=tuple(params["tile"]),
        cluster=tuple(params["cluster"]),
        kernel=KERNELS[params["kernel"]],
        epilogue=params["epilogue"],
        scheduler=SCHEDULERS[params["scheduler"]],
    )


def unsupported_reason(key: GemmKey) -> str | None:
    if key.lowbit:
        return "plain GEMMs only (FP8 keys: cutlass_fp8; no mixed-input kernels yet)"
    if key.dtype == "f32" and key.compute == "f32":
        return "CUTLASS SM90 fp32 GEMMs run on TF32 tensor cores; this key asks for IEEE fp32"
    if (key.n * ITEMSIZE[key.out_dtype]) % 16:
        return f"n={key.n}: output rows are not 16-byte aligned (CUTLASS epilogues store 16 bytes)"
    if key.align < 4:
        return f"operands are {key.align}-byte aligned; CUTLASS needs 4 (cp.async) or 16 (TMA)"
    return None


def in_library(spec: env.KernelSpec) -> bool:
    """Whether cutlass_cppgen offers the kernel ``spec`` describes."""
    return env.offers(spec, env.tile_description)


def offered(key: GemmKey) -> dict[env.KernelSpec, Params]:
    """The shortlist restricted to kernels cutlass_cppgen offers and that never failed to compile.

    A config whose TMA epilogue is not offered (fp32 row/row, say) falls back to the default one.
    """
    pairs = []
    for params in shortlist(key):
        spec = kernel_spec(key, params)
        if not in_library(spec) and params["epilogue"] == "tma":
            params = {**params, "epilogue": "default"}
            spec = replace(spec, epilogue="default")
        pairs.append((spec, params))
    return compilable(pairs)


def compilable(
    pairs: Iterable[tuple[env.KernelSpec, Params]],
    offers: Callable[[env.KernelSpec], bool] = in_library,
) -> dict[env.KernelSpec, Params]:
    """Kernel -> its first config, for the kernels the library ``offers`` that never failed to
    compile (a failure is remembered: ``nvcc_build.failure``)."""
    chosen: dict[env.KernelSpec, Params] = {}
    for spec, params in pairs:
        if offers(spec) and nvcc_build.failure(spec) is None:
            chosen.setdefault(spec, params)
    return chosen


# --- the launcher ------------------------------------------------------------------------------

PARAM_SETS = 64  # pointer sets whose built params a launcher keeps (a timing rotation uses <= 32)
CLUSTER_DIMENSION = 4  # CUlaunchAttributeID CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


@functools.cache
def _libc_free() -> Any:
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    return free


class LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value (a cluster
    dimension's x, y, z are its first three unsigned ints)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.c_void_p),
        ("num_attrs", ctypes.c_uint),
    ]


@functools.cache
def _driver() -> Any:
    """libcuda's launch and memset entry points, called through ctypes with prebuilt structures
    (cuda-bindings marshals its Python launch config and a stream object on every call)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    pointer, byte, size = ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t
    lib.cuMemsetD8Async.argtypes = [pointer, byte, size, ctypes.c_void_p]
    lib.cuMemsetD8Async.restype = ctypes.c_int
    return lib


class ParamSets(Generic[T]):
    """What ``build`` makes of each pointer set, for the ``size`` sets used last (the least
    recently used one dropped first). A kernel's params (TMA descriptors included) are a function
    of its arguments, so a launcher whose other arguments stay fixed keys them by its pointers."""

    def __init__(self, build: Callable[[tuple[int, ...]], T], size: int) -> None:
        if size < 1:
            raise ValueError(f"size={size}: a ParamSets keeps at least one pointer set")
        self._build, self._size = build, size
        self._known: dict[tuple[int, ...], T] = {}

    def __len__(self) -> int:
        return len(self._known)

    def __call__(self, pointers: tuple[int, ...]) -> T:
        known = self._known
        built = known.pop(pointers, None)
        if built is None:
            built = self._build(pointers)
            if len(known) >= self._size:
                del known[next(iter(known))]
        known[pointers] = built  # the most recently used last
        return built

    def clear(self) -> None:
        self._known.clear()


class KernelLauncher:
    """Launches one compiled kernel for one key. Arguments are built once; the kernel params the
    host library makes of them are kept per pointer set (``ParamSets``), so a call on known
    pointers only launches, through libcuda with a prebuilt launch configuration. Subclasses
    with another epilogue override ``_epilogue``, ``_point_out`` and ``_stride_out``, and with
    more pointers ``_point``."""

    def __init__(self, op: Any, key: GemmKey, swizzle: int, device: torch.device) -> None:
        from cuda.bindings import driver
        from cutlass_cppgen.backend import c_types as ct
        from cutlass_cppgen.shape import GemmCoord
        from cutlass_library import GemmUniversalMode

        self.driver, self.key, self.device = driver, key, device
        rt, td = op.rt_module, op.tile_description
        mainloop_t = ct.get_mainloop_arguments_3x(
            td.kernel_schedule, op.A.element, op.B.element, op.A.alignment, op.B.alignment
        )
        scheduler = ct.get_tile_scheduler_arguments_3x(td.tile_scheduler)
        scheduler.max_swizzle_size = swizzle
        default_epilogue = bool(rt.uses_default_epilogue())
        args_t, epilogue_t, _, hw_t = ct.get_gemm_arguments_3x(
            mainloop_t, op.epilogue_functor, scheduler, default_epilogue
        )
        call = ops.packed_call(key)
        self.call = call
        mode = GemmUniversalMode.Batched if key.batch > 1 else GemmUniversalMode.Gemm
        zero3 = ct.dim3_(0, 0, 0)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.args = args_t(
            int(mode),
            ct.GemmCoordBatched_(GemmCoord(key.m, key.n, key.k), key.batch),
            mainloop_t(0, ct.StrideBatched_(call.ld_second, call.stride_second),
                       0, ct.StrideBatched_(call.ld_first, call.stride_first), 4),
            self._epilogue(op, epilogue_t, default_epilogue),
            hw_t(device.index, sms, 0, zero3, zero3),
            scheduler,
        )  # fmt: skip
        self._stride_out(call)
        self.strides: tuple[Any, ...] = ()  # the tensors' strides self.call was made of
        self.get_args = rt.get_args
        self.rt, self.kernel = rt, int(rt.kernel)
        size = int(rt.get_kernel_workspace_size(ctypes.byref(self.args)))
        self.workspace_bytes = size
        self.workspaces = ops.StreamWorkspaces(device)
        self.zero_bytes = size  # stream-K's reduction flags start at zero every launch
        self.params = ParamSets(self._build, PARAM_SETS)
        self.cluster = LaunchAttribute(CLUSTER_DIMENSION)
        self.cluster.value[:3] = td.cluster_shape
        self.config: LaunchConfig | None = None  # made with the first params (the grid needs them)
        self.config_ptr = 0
        self.stream = ops.stream_getter(device)
        self.c_align = ops.out_alignment(key)
        self.lock = threading.Lock()

    def _launch_config(self, ws: ctypes.c_void_p) -> LaunchConfig:
        grid = self.rt.get_grid_shape(ctypes.byref(self.args), ws)
        block = self.rt.get_block_shape()
        return LaunchConfig(
            (grid.x, grid.y, grid.z),
            (block.x, block.y, block.z),
            self.rt.shared_memory_capacity,
            None,
            ctypes.addressof(self.cluster),
            1,
        )

    def _epilogue(self, op: Any, epilogue_t: Any, default_epilogue: bool) -> Any:
        """The epilogue's arguments: D = acc (alpha 1, beta 0), C and D at the output."""
        from cutlass_cppgen.backend import c_types as ct

        output_op = op.epilogue_type(1.0, 0.0)
        if not default_epilogue and hasattr(output_op, "to_evt_params"):
            output_op = output_op.to_evt_params()
        packed = ct.StrideBatched_(self.call.ld_out, self.call.stride_out)
        return epilogue_t(output_op, 0, packed, 0, packed)

    def _point(self, pointers: tuple[int, ...]) -> None:
        """Write a call's pointers into the arguments: A, B, the output, then a subclass's."""
        ml = self.args.mainloop
        ml.ptr_A, ml.ptr_B = pointers[0], pointers[1]
        self._point_out(pointers[2])

    def _point_out(self, pointer: int) -> None:
        ep = self.args.epilogue
        ep.ptr_C = ep.ptr_D = pointer

    def _stride_out(self, call: ops.ColMajorCall) -> None:
        for stride in (self.args.epilogue.stride_C, self.args.epilogue.stride_D):
            stride.major_stride, stride.batch_stride = call.ld_out, call.stride_out

    def _build(self, pointers: tuple[int, ...]) -> tuple[int, Any, Any]:
        """(address of the kernel's parameter list, what keeps it alive) for ``pointers`` (the
        operands', then the workspace's): the host library's params copied into memory of ours,
        its own buffer freed at once."""
        self._point(pointers[:-1])
        ws = ctypes.c_void_p(pointers[-1])
        made = self.get_args(ctypes.byref(self.args), ws)
        try:
            if self.config is None:
                self.config = self._launch_config(ws)
                self.config_ptr = ctypes.addressof(self.config)
            params = type(made.contents).from_buffer_copy(made.contents)
        finally:
            _libc_free()(ctypes.cast(made, ctypes.c_void_p))  # get_params returns new char[]
        packed = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        return ctypes.addressof(packed), params, packed

    def __call__(self, a: Any, b: Any, out: Any = None) -> Any:
        return self.launch(a, b, out)

    def launch(self, a: Any, b: Any, out: Any, *more: int) -> Any:
        """``a @ b`` into ``out`` (or a new tensor); ``more``: the pointers a subclass's
        ``_point`` writes after A, B and the output's."""
        ta, tb, convert = ops.as_tensors(a, b)
        if ta.device != self.device:
            raise ValueError(f"this cutlass runner was built on {self.device}, got {ta.device}")
        c, user_out = ops.output_for(self.key, ta, out, self.c_align)
        strides = (ta.stride(), tb.stride(), c.stride())
        pointers = (ta.data_ptr(), tb.data_ptr(), c.data_ptr(), *more)
        ops.bind_context(self.device)  # before the host library encodes TMA descriptors
        stream, lib = self.stream(), _driver()
        # the arguments, the kept params and the config's stream are shared state: a runner
        # called from two threads (the dispatcher hands one out to every caller) must not build
        # one thread's params with the other's pointers, or launch on the other's stream
        with self.lock:
            if strides != self.strides:
                self._restride(ops.colmajor_call(self.key, ta, tb, c), strides)
            ws = self.workspaces.get(stream, self.workspace_bytes)[0]
            kernel_params = self.params((*pointers, ws))[0]
            if self.zero_bytes:
                self._check(lib.cuMemsetD8Async(ws, 0, self.zero_bytes, stream))
            self.config.stream = stream  # the config is made with the first params, above
            self._check(lib.cuLaunchKernelEx(self.config_ptr, self.kernel, kernel_params, None))
        return ops.finish(c, user_out, convert)

    def _check(self, err: int) -> None:
        if err:
            raise RuntimeError(f"CUTLASS kernel launch failed: {self.driver.CUresult(err)!r}")

    def _restride(self, call: ops.ColMajorCall, strides: tuple[Any, ...]) -> None:
        """Tensors with other strides than the last call's: a new call (a padded leading
        dimension, say) rewrites the arguments' strides, and the params made with the old ones
        are dropped."""
        self.strides = strides
        if call == self.call:
            return
        ml = self.args.mainloop
        ml.stride_A.major_stride, ml.stride_A.batch_stride = call.ld_second, call.stride_second
        ml.stride_B.major_stride, ml.stride_B.batch_stride = call.ld_first, call.stride_first
        self._stride_out(call)
        self.call = call
        self.params.clear()
        self.config = None


class CutlassGemm(Source):
    builds_kernels = True
    name = "cutlass"
    op = "gemm"
    launcher: ClassVar[type[KernelLauncher]] = KernelLauncher

    def kernel_spec(self, key: GemmKey, params: Params) -> env.KernelSpec:
        """The compiled kernel ``params`` name for ``key``."""
        return kernel_spec(key, params)

    def offered(self, key: GemmKey) -> dict[env.KernelSpec, Params]:
        """The shortlist's kernels that cutlass_cppgen offers and that never failed to compile."""
        return offered(key)

    def unavailable(self, device: str) -> str | None:
        reason = ops.unavailable_reason(device, "CUTLASS", env.missing)
        if reason:
            return reason
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) != (9, 0):
            return f"needs sm90 (Hopper); this GPU is sm{major}{minor}"
        return None

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        chosen = self.offered(key)
        if env.cannot_compile():  # without nvcc only kernels built elsewhere can run
            kernel_artifacts.install_missing(chosen)
            chosen = {s: p for s, p in chosen.items() if nvcc_build.compiled_info(s) is not None}
        return list(chosen.values())

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        """Install the shortlist's kernels that the artifact store holds, compile the others in
        parallel processes; a config that fails is recorded by nvcc_build and raises, with its
        error, when the engine builds it."""
        specs = [self.kernel_spec(key, p) for p in shortlist]
        kernel_artifacts.install_missing(specs)
        env.compile_all(specs)

    shares_kernels = True

    def precompile_run(
        self, shortlists: list[tuple[GemmKey, list[Params]]], ready: Callable[[int], None]
    ) -> None:
        """Every distinct kernel of the run once, on every core, in the order first needed;
        a problem is ready once its own kernels are."""
        specs_of = [[self.kernel_spec(key, p) for p in shortlist] for key, shortlist in shortlists]
        kernel_artifacts.compile_run(specs_of, ready, env.cannot_compile)

    def prepare(self, key: GemmKey, shortlist: list[Params]) -> None:
        """cutlass_cppgen's registry and ``key``'s plan, which ``load`` needs."""
        env.prepare(self.kernel_spec(key, shortlist[0]))

    def load(self, spec: env.KernelSpec) -> Any:
        """The compiled kernel of ``spec``, as ``launcher`` takes it."""
        return env.load(spec)

    def build(self, key: GemmKey, params: Params) -> Runner:
        """Load the kernel: installed from the artifact store if stored, else compiled here and
        then stored (so that other hosts, or this one's next cache, need not compile it)."""
        spec = self.kernel_spec(key, params)
        kernel_artifacts.install_missing([spec])
        error = env.compile_all([spec])[spec]
        if error is not None:
            raise RuntimeError(f"CUTLASS kernel did not compile: {error}")
        op = self.load(spec)
        kernel_artifacts.publish_once(spec, op)
        device = torch.device("cuda", torch.cuda.current_device())
        return self.launcher(op, key, self.launch_options(params), device)

    def launch_options(self, params: Params) -> Any:
        """What ``launcher`` takes besides the kernel: the raster swizzle, a runtime argument."""
        return int(params.get("swizzle", 1))
