"""A hand-written CUDA FP8 decode kernel (``cuda_kernels/fp8_gemv.cu``) for FP8 keys, M <= 16.

GEMV-style on Hopper's FP8 wgmma: a CTA (one warpgroup) owns 64 weight rows and a run of K, and a
cluster of 1, 2 or 4 CTAs that split K sums through distributed shared memory, so no partial goes
through global memory (no workspace, no second pass, a fixed sum order). The activations' M rows
are the n side of wgmma (8 or 16). Partial sums are promoted to fp32 every 128 products, the
precise contract of ``accum="f32"`` keys, which also serves ``accum="fast"`` ones (at least as
exact). e4m3 operands only; tensorwise or rowwise scales; bf16, f16 or f32 out.

A config is the library's compile-time part (``stages`` of its copy ring, ``atoms`` of 128 K
bytes a stage: a ``Library``) and its launch part (``cluster``). Each library serves every shape
and is built, stored and loaded as ``cuda_library`` says.

As a candidate source (``CudaFp8``) its runners take ``_scaled_mm``'s operands (b column-major
[K, N]) and pass the kernel b's [N, K] row-major view, as ``triton_fp8`` does.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuner.candidates import cuda_library, fp8_operands, operand_guard
from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params, Runner
from tuner.candidates.cuda_library import Launcher, LibrarySource, choice
from tuner.candidates.triton_kernels.fp8 import check_inputs
from tuner.core.keys import DTYPES, GemmKey

SOURCE = cuda_library.KERNELS / "fp8_gemv.cu"
STAGES, ATOMS, CLUSTERS = range(3, 13), (1, 2), (1, 2, 4)
ATOM = 128  # K bytes of one swizzle atom's rows: four k32 wgmma
ROWS = 64  # weight rows a CTA: wgmma's m
MAX_M, NARROW_M = 16, 8  # x's rows: wgmma's n is 8 up to NARROW_M, else 16
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
STATIC_SMEM = 1024  # the stores' scales, padded to the 1 KB alignment of the copy ring
ALIGN = 16  # bytes: rows and bases are copied in 16-byte pieces
OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
BUILDER = "tuner.candidates.cuda_fp8"  # this module, also when it runs as __main__

Config = dict[str, Any]
CONFIG_KEYS = ("stages", "atoms", "cluster")


def check_config(config: Config, m: int, n: int, k: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K) problem."""
    cuda_library.check_keys(config, CONFIG_KEYS)
    choice(config, "stages", STAGES)
    atoms = choice(config, "atoms", ATOMS)
    cluster = choice(config, "cluster", CLUSTERS)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M={m}: allowed 1 to {MAX_M} (wgmma's n of 8 or 16)")
    if n < 1:
        raise ValueError(f"N={n}: must be at least 1")
    stage = ATOM * atoms
    if k % stage or k < stage * cluster:
        raise ValueError(f"K={k}: must be whole stages of {stage} bytes (config['atoms']={atoms}),"
                         f" at least one per CTA of config['cluster']={cluster}")  # fmt: skip
    if smem_bytes(config, m) > SMEM_LIMIT:
        raise ValueError(f"config {config}: {smem_bytes(config, m)} bytes of shared memory at "
                         f"M={m}, more than a CTA's {SMEM_LIMIT}")  # fmt: skip


def smem_bytes(config: Config, m: int) -> int:
    """Shared memory of one CTA (as the launcher computes it, plus the static part): the copy
    ring (1 KB of alignment, then stages of the weight's 64 rows and x's 8 or 16, ``atoms`` x 128
    K bytes each), or the CTA's [M, 64] sums after it if larger; then, in a cluster, the inbox:
    its mbarrier in 16 bytes (the sums after it read as float4) and, from each rank, its sums of
    this rank's share of the outputs."""
    nb = 16 if m > NARROW_M else 8
    stage = (ROWS + nb) * ATOM * config["atoms"]
    rings, sums = 1024 + config["stages"] * stage, ROWS * m * 4
    cluster = config["cluster"]
    inbox = 16 + cluster * -(-ROWS * m // cluster) * 4 if cluster > 1 else 0
    return max(rings, sums) + inbox + STATIC_SMEM


@dataclass(frozen=True)
class Library(cuda_library.CudaLibrary):
    """A config's compile-time part: one shared library."""

    kind: ClassVar[str] = "cuda_fp8"
    source: ClassVar[Path] = SOURCE
    builder: ClassVar[str] = BUILDER
    arch_flags: ClassVar[tuple[str, ...]] = cuda_library.SM90A_ONLY  # FP8 wgmma

    stages: int
    atoms: int

    def defines(self) -> list[str]:
        return [f"-DFP8_GEMV_STAGES={self.stages}", f"-DFP8_GEMV_ATOMS={self.atoms}"]


def library(config: Config) -> Library:
    return Library(config["stages"], config["atoms"])


ENTRY = "fp8_gemv"
ARGTYPES = (*[ctypes.c_void_p] * 5, *[ctypes.c_int] * 3, *[ctypes.c_longlong] * 3,
            *[ctypes.c_int] * 3, ctypes.c_void_p)  # fmt: skip


def launcher(config: Config) -> Launcher:
    """The ``fp8_gemv`` entry point of ``config``'s library: installed from the artifact store,
    else compiled here, unless it failed before (RuntimeError with the error)."""
    return cuda_library.built(library(config), ENTRY, ARGTYPES)


def check_operands(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int, bool]:  # fmt: skip
    """(M, N, K, rowwise) for b the weight [N, K], or a ValueError naming the operand that the
    kernel's entry point would refuse (or read or write out of bounds); ``out`` None: one is
    made after."""
    m, n, k, rowwise = check_inputs(a, b, scale_a, scale_b)
    for name, t in (("a", a), ("b", b)):
        if t.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}.dtype={t.dtype}: this kernel takes torch.float8_e4m3fn")
        if t.data_ptr() % ALIGN or t.stride(0) % ALIGN:
            raise ValueError(f"{name}: rows must start on {ALIGN}-byte boundaries (data_ptr "
                             f"{t.data_ptr():#x}, strides {t.stride()})")  # fmt: skip
    if not 1 <= m <= MAX_M:
        raise ValueError(f"a.shape={tuple(a.shape)}: M={m}, allowed 1 to {MAX_M}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not s.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, strides {s.stride()}")
    if out is not None:
        if out.dtype not in OUT_KINDS:
            raise ValueError(f"out.dtype={out.dtype}: allowed {list(OUT_KINDS)}")
        if out.shape != (m, n) or out.stride(1) != 1 or out.stride(0) < n or out.device != a.device:
            raise ValueError(f"out: expected [{m}, {n}], unit column stride, rows at least {n} "
                             f"apart, on {a.device}; "
                             f"got {list(out.shape)} strides {out.stride()} on {out.device}")  # fmt: skip
    if not a.is_cuda:
        raise ValueError(f"a.device={a.device}: must be a CUDA device")
    return m, n, k, rowwise


def run(fn: Launcher, config: Config, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
        scale_b: torch.Tensor, out: torch.Tensor, rowwise: bool, stream: int) -> None:  # fmt: skip
    """``out = (a @ b.T) * scale_a * scale_b`` through ``fn`` (``launcher(config)``) on
    ``stream``; the operands already checked (``check_operands``)."""
    (m, k), n = a.shape, b.shape[0]
    err = fn(a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(), out.data_ptr(),
             m, n, k, a.stride(0), b.stride(0), out.stride(0), int(rowwise),
             OUT_KINDS[out.dtype], config["cluster"], stream)  # fmt: skip
    if err:
        raise RuntimeError(f"fp8_gemv launch failed: CUDA error {err}")


# Decode shortlist (stages, atoms, cluster), the likeliest first: two atoms a stage halve the
# loop's fixed work a byte; K over a cluster of 2 puts one CTA on nearly every SM where the
# weight has 64 row blocks (Llama's down projection); one CTA a row block where there are more
# blocks than SMs (the gate / up projections); a cluster of 4 where 56 row blocks leave SMs idle.
SHORTLIST = ((6, 2, 2), (5, 2, 2), (5, 2, 1), (6, 2, 1), (5, 2, 4))


def configs(m: int, n: int, k: int) -> list[Config]:
    """Configs worth timing for a decode problem (M <= ``MAX_M``), those that fit it."""
    return cuda_library.fitting(SHORTLIST, CONFIG_KEYS, lambda c: check_config(c, m, n, k))


def unsupported_reason(key: GemmKey) -> str | None:
    if key.dtype != "fp8_e4m3" or key.wdtype != "fp8_e4m3":
        return "fp8_e4m3 activations and weights only"
    if key.m > MAX_M:
        return f"m={key.m}: offered for decode at M <= {MAX_M} (wgmma's n of 8 or 16)"
    if DTYPES[key.out_dtype] not in OUT_KINDS:
        return f"out_dtype={key.out_dtype}: bf16, f16 or f32 only"
    if key.align < ALIGN:
        return f"align={key.align}: rows are copied in {ALIGN}-byte pieces"
    if not configs(key.m, key.n, key.k):
        return f"no config fits m={key.m}, n={key.n}, k={key.k}"
    return None


class CudaFp8(LibrarySource):
    name = "cuda_fp8"
    library = staticmethod(library)

    def libraries(self) -> Iterable[Library]:
        return dict.fromkeys(Library(stages, atoms) for stages, atoms, _ in SHORTLIST)

    def configs(self, key: GemmKey) -> list[Params]:
        return configs(key.m, key.n, key.k)

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def build(self, key: GemmKey, params: Params) -> Runner:
        check_config(params, key.m, key.n, key.k)
        config, fn, out_dtype = dict(params), launcher(params), DTYPES[key.out_dtype]
        rowwise = key.scale == "row"
        device = torch.device("cuda", torch.cuda.current_device())
        stream = ops.stream_getter(device)

        def check(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out: torch.Tensor | None) -> None:  # fmt: skip
            found = check_operands(a, b, scale_a, scale_b, out)
            fp8_operands.check_shape(found, key, a, b, scale_a, scale_b)
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
            run(fn, config, a, b, scale_a, scale_b, out, rowwise, stream())
            return out

        return runner


if __name__ == "__main__":
    sys.exit(cuda_library.builder_main(Library, sys.argv[1:]))
