"""A hand-written CUDA W4A16 decode kernel (``cuda_kernels/w4a16_gemv.cu``) for INT4 keys, M <= 16.

GEMV-style: a CTA owns 16, 32 or 64 weight rows and a run of K, its warps split that run's
128-value chunks and sum in shared memory, and a cluster of CTAs that split K sums through
distributed shared memory; no partial ever goes through global memory, so there is no workspace
and no second pass, and the sum order is fixed (deterministic). It reads our packed layout
(``tuner.quant.int4``) as the Triton kernel does.

A config is the library's compile-time part (``slices`` of 16 rows per CTA, ``ntiles`` n8
tiles of activations: 1 for M <= 8, 2 for M <= 16, ``stages`` of each warp's copy ring) and its
launch part (``warps`` per CTA, ``cluster`` CTAs splitting K). Each compile-time part is one
shared library, built by nvcc for sm_90a in a child process and loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tuner.candidates.cutlass_env import nvcc_path
from tuner.quant.int4 import CHUNK, GROUP_SIZES

SOURCE = Path(__file__).parent / "cuda_kernels" / "w4a16_gemv.cu"
ARCH = "sm_90a"
SLICES, NTILES, STAGES = (1, 2, 4), (1, 2), range(2, 9)
MAX_WARPS, MAX_CLUSTER = 16, 8
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
COMPILE_TIMEOUT_S = 300.0
ACT_DTYPES = (torch.bfloat16, torch.float16)

Config = dict[str, Any]


def _choice(config: Config, key: str, allowed: Iterable[int]) -> int:
    value = config.get(key)
    allowed = tuple(allowed)
    if type(value) is not int or value not in allowed:
        raise ValueError(f"config[{key!r}]={value!r}: allowed {allowed}")
    return value


def check_config(config: Config, m: int, n: int, k: int, group: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K, group) problem."""
    extra = set(config) - {"slices", "ntiles", "stages", "warps", "cluster"}
    if extra:
        raise ValueError(f"config: unknown keys {sorted(extra)}")
    _choice(config, "slices", SLICES)
    ntiles = _choice(config, "ntiles", NTILES)
    _choice(config, "stages", STAGES)
    _choice(config, "warps", range(1, MAX_WARPS + 1))
    cluster = _choice(config, "cluster", range(1, MAX_CLUSTER + 1))
    if not 1 <= m <= 8 * ntiles:
        raise ValueError(f"M={m}: config['ntiles']={ntiles} takes M from 1 to {8 * ntiles}")
    if k % CHUNK or k < CHUNK * cluster:
        raise ValueError(f"K={k}: must be whole chunks of {CHUNK}, at least one per CTA of "
                         f"config['cluster']={cluster}")  # fmt: skip
    if group not in GROUP_SIZES or k % group:
        raise ValueError(f"group_size={group}: allowed {GROUP_SIZES}, dividing K={k}")
    if n < 1:
        raise ValueError(f"N={n}: must be at least 1")
    if smem_bytes(config, m, group) > SMEM_LIMIT:
        raise ValueError(f"config {config}: {smem_bytes(config, m, group)} bytes of shared memory "
                         f"at M={m}, more than a CTA's {SMEM_LIMIT}")  # fmt: skip


def smem_bytes(config: Config, m: int, group: int) -> int:
    """Shared memory of one CTA (as the launcher computes it): the warps' copy rings, or the
    partial sums after them if larger."""
    rows = 16 * config["slices"]
    groups = CHUNK // group if group < CHUNK else 1
    stage = -(-(rows * 64 + rows * 4 * groups + m * (2 * CHUNK + 16)) // 128) * 128
    ring = config["warps"] * config["stages"] * stage
    return max(ring, (config["warps"] + 1) * rows * m * 4)


def library_key(config: Config) -> tuple[int, int, int]:
    return config["slices"], config["ntiles"], config["stages"]


@functools.cache
def _source_digest() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def build_dir() -> Path:
    """Where the libraries live: ``$TUNER_CUDA_KERNELS``, else beside the CUTLASS cache."""
    if env := os.environ.get("TUNER_CUDA_KERNELS"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tuner" / "cuda"


def library_path(config: Config) -> Path:
    slices, ntiles, stages = library_key(config)
    name = f"w4a16_gemv_s{slices}_n{ntiles}_st{stages}_{ARCH}_{_source_digest()}.so"
    return build_dir() / name


def nvcc_command(nvcc: str, config: Config, out: Path) -> list[str]:
    slices, ntiles, stages = library_key(config)
    return [nvcc, "-O3", "-lineinfo", f"-arch={ARCH}", "-std=c++17", "-shared",
            "-Xcompiler", "-fPIC", f"-DGEMV_SLICES={slices}", f"-DGEMV_NTILES={ntiles}",
            f"-DGEMV_STAGES={stages}", "-o", str(out), str(SOURCE)]  # fmt: skip


def compile_library(config: Config, timeout_s: float = COMPILE_TIMEOUT_S) -> Path:
    """Build ``config``'s library (nvcc in a child process) unless it exists; its path.
    RuntimeError with nvcc's message if it fails."""
    path = library_path(config)
    if path.is_file():
        return path
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found: put it on PATH or set CUDA_INSTALL_PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run(nvcc_command(nvcc, config, partial), capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if proc.returncode:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"nvcc failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    partial.replace(path)
    return path


def compile_all(configs: Iterable[Config], jobs: int | None = None) -> dict[tuple, str | None]:
    """Build the libraries of ``configs`` in parallel: library key -> None or the error."""
    todo = {library_key(c): c for c in configs}

    def one(config: Config) -> str | None:
        try:
            compile_library(config)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        return None

    workers = jobs or max(1, min(len(todo), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(todo, pool.map(one, todo.values()), strict=True))


@functools.cache
def _load(path: Path) -> Any:
    lib = ctypes.CDLL(str(path))
    fn = lib.w4a16_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_longlong] * 2 + \
        [ctypes.c_int] * 3 + [ctypes.c_void_p]  # fmt: skip
    return fn


def launcher(config: Config) -> Any:
    """The library's ``w4a16_gemv`` entry point (built here if missing)."""
    return _load(compile_library(config))


def run(fn: Any, config: Config, x: torch.Tensor, weight: torch.Tensor,
        scales_and_zeros: torch.Tensor, group: int, out: torch.Tensor) -> None:  # fmt: skip
    """``out = x @ dequant(weight).T`` through ``fn`` (``launcher(config)``), on the current
    stream; the operands already checked (``check_inputs``)."""
    m, k = x.shape
    err = fn(x.data_ptr(), weight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(), m,
             weight.shape[0], k, group, x.stride(0), out.stride(0),
             int(x.dtype == torch.float16), config["warps"], config["cluster"],
             torch.cuda.current_stream(x.device).cuda_stream)  # fmt: skip
    if err:
        raise RuntimeError(f"w4a16_gemv launch failed: CUDA error {err}")
