"""A hand-written CUDA FP8 decode kernel (``cuda_kernels/fp8_gemv.cu``) for FP8 keys, M <= 16.

A weight stream with nothing between the loads and the tensor cores: each lane loads 16 bytes
of K from two weight rows straight into the registers of an mma's A operand (in a dot product
the order of K is free as long as x follows it, so the weight needs no layout of its own), and
the warps of a CTA split K and sum in shared memory, in a fixed order (deterministic, no
workspace, no second pass). Each span of 64 K products is summed in fp32 apart from the others,
so every key, ``accum`` "f32" or "fast", gets at least the precision ``_scaled_mm`` gives
without fast accumulation. Launched with programmatic dependent launch.

A config is the library's compile-time part (``slices`` of 16 rows per warp, ``unroll``: spans
of 64 bytes of K whose loads a warp issues before their mma: a ``Library``) and its launch part
(``warps`` per CTA). Each library serves every shape, dtype pair, scaling and output dtype; it
is built, stored and loaded as ``cuda_library`` says.

As a candidate source (``CudaFp8``) its runners take ``_scaled_mm``'s operands (b column-major
[K, N]) as ``TritonFp8``'s do.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuner.candidates import cuda_library, nvcc_build, operand_guard
from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params, Runner, Source
from tuner.candidates.cuda_library import Launcher
from tuner.candidates.triton_kernels.fp8 import check_inputs
from tuner.core.keys import DTYPES, GemmKey

SOURCE = cuda_library.KERNELS / "fp8_gemv.cu"
BUILDER = "tuner.candidates.cuda_fp8"  # this module, also when it runs as __main__
SLICES, UNROLL, STAGES = (1, 2, 4), (1, 2, 4), range(2, 9)
MAX_M, NARROW_M = 16, 8  # two n8 tiles of x; one up to NARROW_M
MAX_WARPS = 16
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
ALIGN = 16  # bytes: x's and w's rows are loaded in 16-byte pieces
FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
OUT_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

Config = dict[str, Any]
CONFIG_KEYS = ("slices", "unroll", "stages", "warps")


def _choice(config: Config, key: str, allowed: Iterable[Any]) -> Any:
    value = config.get(key)
    allowed = tuple(allowed)
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(f"config[{key!r}]={value!r}: allowed {allowed}")
    return value


def smem_bytes(config: Config, m: int) -> int:
    """Shared memory of one CTA (as the launcher computes it): each warp's ring (``stages`` x
    ``unroll`` spans of its two rows a slice and its n8 tiles of x, 512 bytes each) and its
    [n8 tiles x 8, rows] float32 partials."""
    tiles, slices = (2 if m > NARROW_M else 1), config["slices"]
    ring = config["stages"] * config["unroll"] * (2 * slices + tiles) * 512
    return config["warps"] * (ring + tiles * 8 * 16 * slices * 4)


def check_config(config: Config, m: int, n: int, k: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K) problem."""
    extra = set(config) - set(CONFIG_KEYS)
    if extra:
        raise ValueError(f"config: unknown keys {sorted(extra)}; allowed {list(CONFIG_KEYS)}")
    _choice(config, "slices", SLICES)
    _choice(config, "unroll", UNROLL)
    _choice(config, "stages", STAGES)
    _choice(config, "warps", range(1, MAX_WARPS + 1))
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M={m}: allowed 1 to {MAX_M} (two n8 tiles of activations)")
    if k < ALIGN or k % ALIGN:
        raise ValueError(f"K={k}: must be a positive multiple of {ALIGN} (16-byte loads)")
    if n < 1:
        raise ValueError(f"N={n}: must be at least 1")
    if smem_bytes(config, m) > SMEM_LIMIT:
        raise ValueError(f"config {config}: {smem_bytes(config, m)} bytes of shared memory at M={m}, "
                         f"more than a CTA's {SMEM_LIMIT}")  # fmt: skip


@dataclass(frozen=True)
class Library(cuda_library.CudaLibrary):
    """A config's compile-time part: one shared library."""

    kind: ClassVar[str] = "cuda_fp8"
    source: ClassVar[Path] = SOURCE
    builder: ClassVar[str] = BUILDER

    slices: int
    unroll: int
    stages: int

    def defines(self) -> list[str]:
        return [f"-DFP8_SLICES={self.slices}", f"-DFP8_UNROLL={self.unroll}",
                f"-DFP8_STAGES={self.stages}"]  # fmt: skip


def library(config: Config) -> Library:
    return Library(config["slices"], config["unroll"], config["stages"])


def compile_all(configs: Iterable[Config]) -> dict[Library, str | None]:
    """The libraries of ``configs`` installed from the artifact store, or compiled in parallel
    child processes (then published): library -> None or why it is missing."""
    return cuda_library.compile_all(map(library, configs))


ENTRY = "fp8_gemv"
ARGTYPES = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 3, *[ctypes.c_longlong] * 3,
            *[ctypes.c_int] * 5, ctypes.c_void_p)  # fmt: skip


def launcher(config: Config) -> Launcher:
    """The ``fp8_gemv`` entry point of ``config``'s library: installed from the artifact store,
    else compiled here, unless it failed before (RuntimeError with the error)."""
    return cuda_library.built(library(config), ENTRY, ARGTYPES)


def check_operands(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, bool]:  # fmt: skip
    """(M, N, K, rowwise) for ``out = (a @ b.T) * scale_a * scale_b`` (b [N, K]), or a
    ValueError naming the operand that the kernel's entry point would refuse (or read or write
    out of bounds)."""
    m, n, k, rowwise = check_inputs(a, b, scale_a, scale_b)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"a.shape={tuple(a.shape)}: M={m}, allowed 1 to {MAX_M}")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % ALIGN or t.stride(0) % ALIGN or k % ALIGN:
            raise ValueError(f"{name}: rows must start on {ALIGN}-byte boundaries and K be a "
                             f"multiple of {ALIGN} (data_ptr {t.data_ptr():#x}, strides "
                             f"{t.stride()}, K={k})")  # fmt: skip
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        strides = [st for st, size in zip(s.stride(), s.shape, strict=True) if size > 1]
        if strides and strides != [1]:
            raise ValueError(f"{name}.stride()={s.stride()}: its {s.numel()} scales must be "
                             "adjacent in memory")  # fmt: skip
    if out is not None:
        if out.dtype not in OUT_DTYPES or tuple(out.shape) != (m, n) or out.stride(1) != 1:
            raise ValueError(f"out: expected a ({m}, {n}) tensor of {list(OUT_DTYPES)} with unit "
                             f"stride along N, got {out.dtype} {tuple(out.shape)} strides "
                             f"{out.stride()}")  # fmt: skip
        if out.device != a.device:
            raise ValueError(f"out.device={out.device}: must be a's device {a.device}")
    if not a.is_cuda:
        raise ValueError(f"a.device={a.device}: must be a CUDA device")
    return m, n, k, rowwise


def run(fn: Launcher, config: Config, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
        scale_b: torch.Tensor, out: torch.Tensor, rowwise: bool, stream: int) -> None:  # fmt: skip
    """``out = (a @ b.T) * scale_a * scale_b`` through ``fn`` (``launcher(config)``) on
    ``stream``; the operands already checked (``check_operands``)."""
    m, k = a.shape
    err = fn(a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(), out.data_ptr(),
             m, b.shape[0], k, a.stride(0), b.stride(0), out.stride(0), FORMATS[a.dtype],
             FORMATS[b.dtype], OUT_DTYPES[out.dtype], int(rowwise), config["warps"], stream)  # fmt: skip
    if err:
        raise RuntimeError(f"fp8_gemv launch failed: CUDA error {err}")


def fp8_gemv(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             config: Config, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """bf16 ``(a @ b.T) * scale_a * scale_b`` (b [N, K], K-contiguous), as ``fp8_matmul``;
    checks every call (a runner checks once)."""
    m, n, k, rowwise = check_operands(a, b, scale_a, scale_b, out)
    check_config(config, m, n, k)
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    run(launcher(config), config, a, b, scale_a, scale_b, out, rowwise, stream)
    return out


# Decode shortlist (slices, unroll, stages, warps), the likeliest first.
SHORTLIST = ((1, 1, 8, 8), (1, 2, 4, 8), (2, 1, 8, 4), (1, 1, 4, 16))


def configs(m: int, n: int, k: int) -> list[Config]:
    """Configs worth timing for a decode problem (M <= ``MAX_M``), those that fit it."""
    out = []
    for entry in SHORTLIST:
        config = dict(zip(CONFIG_KEYS, entry, strict=True))
        try:
            check_config(config, m, n, k)
        except ValueError:
            continue
        out.append(config)
    return out


def unsupported_reason(key: GemmKey) -> str | None:
    if not key.lowbit or key.wdtype == "int4":
        return "fp8 operands only"
    if key.m > MAX_M:
        return f"m={key.m}: offered for decode at M <= {MAX_M} (two n8 tiles of activations)"
    if key.batch != 1:
        return f"batch={key.batch}: one GEMM a call"
    if key.k % ALIGN or key.align < ALIGN:
        return f"k={key.k}, align={key.align}: rows are loaded in {ALIGN}-byte pieces"
    if DTYPES[key.out_dtype] not in OUT_DTYPES:
        return f"out_dtype={key.out_dtype}: allowed bf16, f16, f32"
    if not configs(key.m, key.n, key.k):
        return f"no config fits m={key.m}, n={key.n}, k={key.k}"
    return None


class CudaFp8(Source):
    name = "cuda_fp8"
    op = "gemm"
    builds_kernels = True
    shares_kernels = True  # a library serves every shape

    def unavailable(self, device: str) -> str | None:
        if reason := ops.unavailable_reason(device, "cuda_fp8", lambda: None):
            return reason
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"compute capability {cap}: the kernel is built for sm_90a (Hopper) only"
        if cuda_library.cannot_compile() and not cuda_library.any_stored(
            library(dict(zip(CONFIG_KEYS, e, strict=True))) for e in SHORTLIST
        ):
            return "nvcc not found and no built cuda_fp8 library here or in the artifact store"
        return None

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        """The shortlist less configs whose library failed to compile; without nvcc, only
        those whose library is built here or stored (installed now)."""
        chosen = configs(key.m, key.n, key.k)
        usable = set(cuda_library.usable(map(library, chosen)))
        return [c for c in chosen if library(c) in usable]

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        compile_all(shortlist)  # failures are recorded, and raised by build

    def precompile_run(
        self, shortlists: list[tuple[GemmKey, list[Params]]], ready: Callable[[int], None]
    ) -> None:
        cuda_library.precompile_run([[library(p) for p in s] for _, s in shortlists], ready)

    def build(self, key: GemmKey, params: Params) -> Runner:
        check_config(params, key.m, key.n, key.k)
        config, fn = dict(params), launcher(params)
        shape, out_dtype = (key.m, key.n, key.k), DTYPES[key.out_dtype]
        device = torch.device("cuda", torch.cuda.current_device())
        stream = ops.stream_getter(device)

        def check(a, w, scale_a, scale_b, out) -> None:
            if check_operands(a, w, scale_a, scale_b, out)[:3] != shape or a.device != device:
                raise ValueError(f"a.shape={tuple(a.shape)}, b.shape={tuple(w.T.shape)} on "
                                 f"{a.device}: this runner is built for (M, N, K)={shape} on "
                                 f"{device}")  # fmt: skip

        checked = operand_guard.CheckedOnce(check)

        def runner(a, b, scale_a, scale_b, out=None):
            w = b.T  # _scaled_mm's column-major [K, N]: the kernel's row-major [N, K]
            checked(a, w, scale_a, scale_b, out)
            if out is None:
                out = torch.empty(shape[0], shape[1], dtype=out_dtype, device=device)
            run(fn, config, a, w, scale_a, scale_b, out, scale_a.numel() > 1, stream())
            return out

        return runner


def _main(argv: list[str]) -> int:
    return nvcc_build.child_main(
        argv, lambda text: cuda_library.compile_library(Library.from_json(text))
    )


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
