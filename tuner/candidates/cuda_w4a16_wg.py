"""The INT4 decode kernel on wgmma (``cuda_kernels/w4a16_wgmma.cu``), W4A16 at M <= 16.

The FP8 decode kernel's shape with the weight dequantized in registers: a CTA (one warpgroup)
owns ``groups`` 64-row blocks of the weight (one m64 wgmma each, A from registers) and a run of
K, and a cluster of 1, 2, 4 or 8 CTAs that split K sums through distributed shared memory (no
workspace, a fixed sum order). x's M rows are wgmma's n (8 or 16), from a ring of 128-byte
swizzled stages that also carries each chunk's weight runs and scales. Groups of 128 only (a
stage is one group). It reads our packed layout (``tuner.quant.int4``), as ``cuda_w4a16`` does.

A config is the library's compile-time part (``stages``: a ``Library``) and its launch part
(``groups``, ``cluster``).
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuner.candidates import cuda_library
from tuner.candidates.cuda_library import Launcher, choice

SOURCE = cuda_library.KERNELS / "w4a16_wgmma.cu"
STAGES, GROUPS, CLUSTERS = range(2, 17), (1, 2), (1, 2, 4, 8)
GROUP_SIZE = 128  # a stage's K: one group of scales
BLOCK = 64  # weight rows a block: wgmma's m
MAX_M, NARROW_M = 16, 8  # x's rows: wgmma's n is 8 up to NARROW_M, else 16
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
BUILDER = "tuner.candidates.cuda_w4a16_wg"  # this module, also when it runs as __main__

Config = dict[str, Any]
CONFIG_KEYS = ("stages", "groups", "cluster")


def check_config(config: Config, m: int, n: int, k: int, group: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K, group) problem."""
    extra = set(config) - set(CONFIG_KEYS)
    if extra:
        raise ValueError(f"config: unknown keys {sorted(extra)}; allowed {list(CONFIG_KEYS)}")
    choice(config, "stages", STAGES)
    choice(config, "groups", GROUPS)
    cluster = choice(config, "cluster", CLUSTERS)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M={m}: allowed 1 to {MAX_M} (wgmma's n of 8 or 16)")
    if n < 1:
        raise ValueError(f"N={n}: must be at least 1")
    if group != GROUP_SIZE:
        raise ValueError(f"group_size={group}: this kernel takes {GROUP_SIZE} (a stage a group)")
    if k % GROUP_SIZE or k < GROUP_SIZE * cluster:
        raise ValueError(f"K={k}: must be whole groups of {GROUP_SIZE}, at least one per CTA of "
                         f"config['cluster']={cluster}")  # fmt: skip
    if smem_bytes(config, m) > SMEM_LIMIT:
        raise ValueError(f"config {config}: {smem_bytes(config, m)} bytes of shared memory at "
                         f"M={m}, more than a CTA's {SMEM_LIMIT}")  # fmt: skip


def smem_bytes(config: Config, m: int) -> int:
    """Shared memory of one CTA, as the launcher computes it: the ring (1 KB of alignment, then
    stages of x's 8 or 16 rows x 256 bytes and each block's 4 KB chunk and 64 scale words, each
    stage 1 KB aligned), or the CTA's [M, rows] sums if larger; then, in a cluster, the inbox:
    its mbarrier in 16 bytes and, from each rank, its sums of this rank's share."""
    groups, cluster = config["groups"], config["cluster"]
    stage = -(-((16 if m > NARROW_M else 8) * 256 + groups * (4096 + BLOCK * 4)) // 1024) * 1024
    rows = BLOCK * groups
    rings, sums = 1024 + config["stages"] * stage, rows * m * 4
    inbox = 16 + cluster * -(-rows * m // cluster) * 4 if cluster > 1 else 0
    return max(rings, sums) + inbox


@dataclass(frozen=True)
class Library(cuda_library.CudaLibrary):
    """A config's compile-time part: one shared library."""

    kind: ClassVar[str] = "cuda_w4a16_wg"
    source: ClassVar[Path] = SOURCE
    builder: ClassVar[str] = BUILDER
    # sm_90a code only: wgmma has no compute_90 PTX
    arch_flags: ClassVar[tuple[str, ...]] = ("-gencode", "arch=compute_90a,code=sm_90a")

    stages: int

    def defines(self) -> list[str]:
        return [f"-DW4_WG_STAGES={self.stages}"]


def library(config: Config) -> Library:
    return Library(config["stages"])


ENTRY = "w4a16_wgmma"
ARGTYPES = (*[ctypes.c_void_p] * 4, *[ctypes.c_int] * 3, *[ctypes.c_longlong] * 2,
            *[ctypes.c_int] * 3, ctypes.c_void_p)  # fmt: skip


def launcher(config: Config) -> Launcher:
    """The ``w4a16_wgmma`` entry point of ``config``'s library: installed from the artifact
    store, else compiled here, unless it failed before (RuntimeError with the error)."""
    return cuda_library.built(library(config), ENTRY, ARGTYPES)


def run(fn: Launcher, config: Config, x: torch.Tensor, weight: torch.Tensor,
        scales_and_zeros: torch.Tensor, out: torch.Tensor, stream: int) -> None:  # fmt: skip
    """``out = x @ dequant(weight).T`` through ``fn`` (``launcher(config)``) on ``stream``; the
    operands already checked (``cuda_w4a16.check_operands``: the same constraints)."""
    m, k = x.shape
    err = fn(x.data_ptr(), weight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(), m,
             weight.shape[0], k, x.stride(0), out.stride(0), int(x.dtype == torch.float16),
             config["groups"], config["cluster"], stream)  # fmt: skip
    if err:
        raise RuntimeError(f"w4a16_wgmma launch failed: CUDA error {err}")


if __name__ == "__main__":
    sys.exit(cuda_library.builder_main(Library, sys.argv[1:]))
