"""A hand-written CUDA FP8 decode kernel (``cuda_kernels/fp8_gemv.cu``) for FP8 keys, M <= 16.

What ``torch._scaled_mm(a, b.T, scale_a, scale_b)`` computes, tensorwise or rowwise, for the
decode sizes where the weight's bytes are the time. GEMV-style, as ``cuda_w4a16``: a warp owns
16, 32 or 64 rows of the weight, a CTA a run of K that its warps take chunk by chunk from their
own copy rings, and a cluster of CTAs that split K sums through distributed shared memory, so no
partial goes through global memory (no workspace, no arrival counter, a fixed sum order: the
split-K epilogue that bounds the Triton kernel's down projections is not there). The tensor
cores take both operands in their fp8 formats (mma.m16n8k32), and each chunk's 128 products are
added to the fp32 sum apart, as ``_scaled_mm`` promotes its partial sums without
``use_fast_accum``; so one kernel serves both accumulation modes. Launched with programmatic
dependent launch.

A config is the library's compile-time part (``slices`` of 16 rows per warp, ``stages`` of each
copy ring, ``chunk`` bytes of K a warp copies of each row at a time: a ``Library``) and its launch part (``warps`` per CTA, ``cluster`` CTAs splitting K).
Each library serves every shape and format and is built, stored and loaded as ``cuda_library``
says. Runners take ``_scaled_mm``'s operands (b column-major [K, N]), as ``triton_fp8``'s do.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuner.candidates import cuda_library, gemm_operands, nvcc_build, operand_guard
from tuner.candidates.base import Params, Runner, Source
from tuner.candidates.cuda_library import Launcher, choice
from tuner.candidates.triton_kernels.fp8 import check_inputs
from tuner.core.keys import DTYPES, GemmKey

SOURCE = cuda_library.KERNELS / "fp8_gemv.cu"
SLICES, STAGES = (1, 2, 4), range(2, 9)
CHUNKS = (128, 256, 512)  # K bytes a warp takes at a time: one row's run of DRAM addresses
RUN = 128  # K bytes of one chunk's four mma
MAX_M = 16  # two n8 tiles of activations
NARROW_M = 8  # one n8 tile
MAX_WARPS, WIDE_MAX_WARPS, MAX_CLUSTER = 16, 8, 8
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
ALIGN = 16  # bytes: rows are copied in 16-byte pieces
FORMATS = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}
OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
BUILDER = "tuner.candidates.cuda_fp8"  # this module, also when it runs as __main__

Config = dict[str, Any]
CONFIG_KEYS = ("slices", "stages", "chunk", "warps", "cluster")


def max_warps(slices: int, m: int) -> int:
    """Warps a CTA may have: 32- and 64-row warps over two n8 tiles need more registers."""
    return WIDE_MAX_WARPS if m > NARROW_M and slices > 1 else MAX_WARPS


def check_config(config: Config, m: int, n: int, k: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K) problem."""
    extra = set(config) - set(CONFIG_KEYS)
    if extra:
        raise ValueError(f"config: unknown keys {sorted(extra)}; allowed {list(CONFIG_KEYS)}")
    slices = choice(config, "slices", SLICES)
    choice(config, "stages", STAGES)
    chunk = choice(config, "chunk", CHUNKS)
    warps = choice(config, "warps", range(1, MAX_WARPS + 1))
    cluster = choice(config, "cluster", range(1, MAX_CLUSTER + 1))
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M={m}: allowed 1 to {MAX_M} (two n8 tiles of activations)")
    if warps > max_warps(slices, m):
        raise ValueError(f"config['warps']={warps}: allowed 1 to {max_warps(slices, m)} for "
                         f"config['slices']={slices} at M={m}")  # fmt: skip
    if k % chunk or k < chunk * cluster:
        raise ValueError(f"K={k}: must be whole chunks of config['chunk']={chunk}, at least one "
                         f"per CTA of config['cluster']={cluster}")  # fmt: skip
    if n < 1:
        raise ValueError(f"N={n}: must be at least 1")
    if smem_bytes(config, m) > SMEM_LIMIT:
        raise ValueError(f"config {config}: {smem_bytes(config, m)} bytes of shared memory at "
                         f"M={m}, more than a CTA's {SMEM_LIMIT}")  # fmt: skip


def smem_bytes(config: Config, m: int) -> int:
    """Shared memory of one CTA (as the launcher computes it): the warps' copy rings (a stage:
    the warp's slices of the weight, 16 rows x chunk bytes each, and x's n8 tiles, 8 rows x chunk
    bytes each), or the warps'
    partial sums and their sum if larger; then, in a cluster, the inbox: an 8-byte mbarrier
    and, from each rank, its sums of this rank's share of the outputs."""
    rows, warps, cluster = 16 * config["slices"], config["warps"], config["cluster"]
    stage = (config["slices"] * 16 + (2 if m > NARROW_M else 1) * 8) * config["chunk"]
    inbox = 8 + cluster * -(-rows * m // cluster) * 4 if cluster > 1 else 0
    return max(warps * config["stages"] * stage, (warps + 1) * rows * m * 4) + inbox


@dataclass(frozen=True)
class Library(cuda_library.CudaLibrary):
    """A config's compile-time part: one shared library."""

    kind: ClassVar[str] = "cuda_fp8"
    source: ClassVar[Path] = SOURCE
    builder: ClassVar[str] = BUILDER

    slices: int
    stages: int
    chunk: int

    def defines(self) -> list[str]:
        return [f"-DGEMV_SLICES={self.slices}", f"-DGEMV_STAGES={self.stages}",
                f"-DGEMV_CHUNK={self.chunk}"]  # fmt: skip


def library(config: Config) -> Library:
    return Library(config["slices"], config["stages"], config["chunk"])


def compile_all(configs: Iterable[Config]) -> dict[Library, str | None]:
    """The libraries of ``configs`` installed from the artifact store, or compiled in parallel
    child processes (then published): library -> None or why it is missing."""
    return cuda_library.compile_all(map(library, configs))


ENTRY = "fp8_gemv"
ARGTYPES = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 3, *[ctypes.c_longlong] * 3,
            *[ctypes.c_int] * 6, ctypes.c_void_p)  # fmt: skip


def load(path: Path) -> Launcher:
    """The ``fp8_gemv`` entry point of the library at ``path`` (loaded once)."""
    return cuda_library.load(path, ENTRY, ARGTYPES)


def launcher(config: Config) -> Launcher:
    """The ``fp8_gemv`` entry point of ``config``'s library: installed from the artifact store,
    else compiled here, unless it failed before (RuntimeError with the error)."""
    return cuda_library.built(library(config), ENTRY, ARGTYPES)


def _unit_stride(scale: torch.Tensor) -> bool:
    """Whether the scale's elements lie 4 bytes apart (a [rows, 1] or [1, rows] vector)."""
    return scale.numel() == 1 or max(scale.stride()[d] for d in range(2) if scale.shape[d] > 1) == 1


def check_operands(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, bool]:  # fmt: skip
    """(M, N, K, rowwise) for ``a`` [M, K] and the weight ``b`` [N, K] (row-major), or a
    ValueError naming the operand that the kernel's entry point would refuse (or read or write
    out of bounds); ``out`` None: one is made after."""
    m, n, k, rowwise = check_inputs(a, b, scale_a, scale_b)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"a.shape={tuple(a.shape)}: M={m}, allowed 1 to {MAX_M}")
    if k % RUN:
        raise ValueError(f"a.shape={tuple(a.shape)}: K={k} must be whole runs of {RUN}")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % ALIGN or t.stride(0) % ALIGN:
            raise ValueError(f"{name}: rows must start on {ALIGN}-byte boundaries (data_ptr "
                             f"{t.data_ptr():#x}, strides {t.stride()})")  # fmt: skip
    for name, scale in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not _unit_stride(scale):
            raise ValueError(f"{name}.stride()={scale.stride()}: the scales must lie next to "
                             f"each other")  # fmt: skip
    if out is not None:
        if out.dtype not in OUT_KINDS:
            raise ValueError(f"out.dtype={out.dtype}: allowed {list(OUT_KINDS)}")
        if out.shape != (m, n) or out.stride(1) != 1 or out.stride(0) < n:
            raise ValueError(f"out: expected [{m}, {n}] rows of unit stride at least {n} apart, "
                             f"got {list(out.shape)} strides {out.stride()}")  # fmt: skip
        if out.device != a.device:
            raise ValueError(f"out.device={out.device}: must be a's device {a.device}")
    if not a.is_cuda:
        raise ValueError(f"a.device={a.device}: must be a CUDA device")
    return m, n, k, rowwise


def run(fn: Launcher, config: Config, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
        scale_b: torch.Tensor, rowwise: bool, out: torch.Tensor, stream: int) -> None:  # fmt: skip
    """``out = (a @ b.T) * scale_a * scale_b`` through ``fn`` (``launcher(config)``) on
    ``stream``, b the weight [N, K]; the operands already checked (``check_operands``)."""
    (m, k), n = a.shape, b.shape[0]
    err = fn(a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(), out.data_ptr(),
             m, n, k, a.stride(0), b.stride(0), out.stride(0), FORMATS[a.dtype], FORMATS[b.dtype],
             OUT_KINDS[out.dtype], int(rowwise), config["warps"], config["cluster"], stream)  # fmt: skip
    if err:
        raise RuntimeError(f"fp8_gemv launch failed: CUDA error {err}")


# Decode shortlists (slices, stages, chunk, warps, cluster), the likeliest first.
SHORTLIST = ((2, 2, 128, 8, 1), (2, 3, 128, 8, 1), (1, 2, 128, 16, 1), (1, 2, 512, 8, 1))
WIDE_SHORTLIST = ((2, 2, 128, 8, 1), (4, 2, 128, 8, 2), (1, 2, 256, 8, 1))


def shortlist(m: int) -> tuple[tuple, ...]:
    """The shortlist for M: one n8 tile of x (M <= 8) or two."""
    return SHORTLIST if m <= NARROW_M else WIDE_SHORTLIST


def configs(m: int, n: int, k: int) -> list[Config]:
    """Configs worth timing for a decode problem (M <= ``MAX_M``), those that fit it."""
    out = []
    for entry in shortlist(m):
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
    if key.k % RUN:
        return f"k={key.k}: the kernel takes K in whole runs of {RUN}"
    if key.align < ALIGN:
        return f"align={key.align}: rows are copied in {ALIGN}-byte pieces"
    if DTYPES[key.out_dtype] not in OUT_KINDS:
        return f"out_dtype={key.out_dtype}: bf16, f16 or f32 only"
    if not configs(key.m, key.n, key.k):
        return f"no config fits m={key.m}, n={key.n}, k={key.k}"
    return None


class CudaFp8(Source):
    name = "cuda_fp8"
    op = "gemm"
    builds_kernels = True
    shares_kernels = True  # a library serves every shape

    def unavailable(self, device: str) -> str | None:
        shortlisted = dict.fromkeys(SHORTLIST + WIDE_SHORTLIST)
        libs = (library(dict(zip(CONFIG_KEYS, e, strict=True))) for e in shortlisted)
        return cuda_library.sm90_unavailable(device, "cuda_fp8", libs)

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        """The shortlist less configs whose library failed to compile; without nvcc, only
        those whose library is built here or stored (installed now)."""
        return cuda_library.usable_configs(configs(key.m, key.n, key.k), library)

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        compile_all(shortlist)  # failures are recorded, and raised by build

    def precompile_run(
        self, shortlists: list[tuple[GemmKey, list[Params]]], ready: Callable[[int], None]
    ) -> None:
        cuda_library.precompile_run([[library(p) for p in s] for _, s in shortlists], ready)

    def build(self, key: GemmKey, params: Params) -> Runner:
        check_config(params, key.m, key.n, key.k)
        config, fn, out_dtype = dict(params), launcher(params), DTYPES[key.out_dtype]
        shape, rowwise = (key.m, key.n, key.k), key.scale == "row"
        device = torch.device("cuda", torch.cuda.current_device())
        stream = gemm_operands.stream_getter(device)

        def check(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out: torch.Tensor | None) -> None:  # fmt: skip
            if check_operands(a, b, scale_a, scale_b, out) != (*shape, rowwise):
                raise ValueError(f"a.shape={tuple(a.shape)}, b.shape={tuple(b.shape)} with "
                                 f"{scale_a.numel()} / {scale_b.numel()} scales: this runner is "
                                 f"built for (M, N, K)={shape}, {key.scale} scales")  # fmt: skip
            if out is not None and out.dtype != out_dtype:
                raise ValueError(f"out.dtype={out.dtype}: this runner is built for {out_dtype}")
            if a.device != device:
                raise ValueError(f"a.device={a.device}: this runner is built for {device}")

        checked = operand_guard.CheckedOnce(check)

        def runner(a, b, scale_a, scale_b, out=None):
            b = b.T  # _scaled_mm's column-major [K, N]: the kernel's [N, K] row-major
            checked(a, b, scale_a, scale_b, out)
            if out is None:
                out = torch.empty(key.m, key.n, dtype=out_dtype, device=device)
            run(fn, config, a, b, scale_a, scale_b, rowwise, out, stream())
            return out

        return runner


def _main(argv: list[str]) -> int:
    return nvcc_build.child_main(
        argv, lambda text: cuda_library.compile_library(Library.from_json(text))
    )


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
