"""A hand-written CUDA W4A16 decode kernel (``cuda_kernels/w4a16_gemv.cu``) for INT4 keys, M <= 16.

GEMV-style: a warp owns 16, 32 or 64 weight rows, a CTA a run of K, and a cluster of CTAs that
split K sums through distributed shared memory. The CTA's warps split either K (``split`` "k":
the CTA's rows are one warp's, each warp takes every ``warps``-th 128-value chunk of the run from
its own copy ring, and the warps sum in shared memory) or rows (``split`` "rows": the CTA owns
``warps`` x its warp's rows, every warp takes every chunk from one ring the CTA shares, so each
chunk of x is copied once per CTA, not once per warp). No partial ever goes through global
memory, so there is no workspace and no second pass, and the sum order is fixed
(deterministic). It reads our packed layout (``tuner.quant.int4``) as the Triton kernel does.

A config is the library's compile-time part (``split``, ``slices`` of 16 rows per warp,
``ntiles`` n8 tiles of activations: 1 for M <= 8, 2 for M <= 16, ``stages`` of each copy ring)
and its launch part (``warps`` per CTA, ``cluster`` CTAs splitting K). Each compile-time part is one
shared library (the CUDA runtime linked in statically), built by nvcc for sm_90a in a child
process and loaded with ctypes; it is an artifact (``tuner.cache.artifacts``): ``precompile``
installs what another host built before compiling the rest, and publishes what it compiled, so
a host without nvcc runs a stored library.

As a candidate source (``CudaW4A16``) its runners take torch's packed weight, as the baseline
does, and read our layout of it (``int4_torch.ours``: made once per weight, memoised).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import sqlite3
import subprocess
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tuner.cache.artifacts import ArtifactError, ArtifactSpec, pack, shared_store, unpack
from tuner.cache.sqlite import StoreError
from tuner.candidates.base import Params, Runner, Source
from tuner.candidates.cutlass_env import nvcc_path
from tuner.candidates.triton_kernels.w4a16 import check_inputs
from tuner.core.atomic import write_atomic
from tuner.core.keys import GemmKey
from tuner.quant import int4_torch
from tuner.quant.int4 import CHUNK, GROUP_SIZES

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cuda_kernels" / "w4a16_gemv.cu"
ARCH = "sm_90a"
SPLITS, SLICES, NTILES, STAGES = ("k", "rows"), (1, 2, 4), (1, 2), range(2, 9)
MAX_WARPS, MAX_CLUSTER = 16, 8
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
COMPILE_TIMEOUT_S = 300.0
ACT_DTYPES = ("bf16", "f16")
ALIGN = 16  # bytes: x's rows and the weight are copied in 16-byte pieces
LIBRARY = "kernel.so"  # the artifact bundle's one file

Config = dict[str, Any]


def _choice(config: Config, key: str, allowed: Iterable[Any]) -> Any:
    value = config.get(key)
    allowed = tuple(allowed)
    if type(value) is not type(allowed[0]) or value not in allowed:
        raise ValueError(f"config[{key!r}]={value!r}: allowed {allowed}")
    return value


def check_config(config: Config, m: int, n: int, k: int, group: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K, group) problem."""
    extra = set(config) - {"split", "slices", "ntiles", "stages", "warps", "cluster"}
    if extra:
        raise ValueError(f"config: unknown keys {sorted(extra)}")
    _choice(config, "split", SPLITS)
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
    """Shared memory of one CTA (as the launcher computes it): the copy rings (one per warp, or
    the CTA's one when warps split rows), or the sums after them if larger (splitting K, the
    warps' partials and their sum; splitting rows, the CTA's [rows, M])."""
    rows, warps, by_rows = 16 * config["slices"], config["warps"], config["split"] == "rows"
    groups = CHUNK // group if group < CHUNK else 1
    parts = (warps if by_rows else 1) * (rows * 64 + rows * 4 * groups)
    stage = -(-(parts + m * (2 * CHUNK + 16)) // 128) * 128
    rings, sums = (1, warps) if by_rows else (warps, warps + 1)
    return max(rings * config["stages"] * stage, sums * rows * m * 4)


def library_key(config: Config) -> tuple[str, int, int, int]:
    return config["split"], config["slices"], config["ntiles"], config["stages"]


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
    split, slices, ntiles, stages = library_key(config)
    name = f"w4a16_gemv_{split}_s{slices}_n{ntiles}_st{stages}_{ARCH}_{_source_digest()}.so"
    return build_dir() / name


def nvcc_command(nvcc: str, config: Config, out: Path) -> list[str]:
    split, slices, ntiles, stages = library_key(config)
    return [nvcc, "-O3", "-lineinfo", f"-arch={ARCH}", "-std=c++17", "-shared", "-Xcompiler",
            "-fPIC", f"-DGEMV_SPLIT_ROWS={int(split == 'rows')}", f"-DGEMV_SLICES={slices}",
            f"-DGEMV_NTILES={ntiles}", f"-DGEMV_STAGES={stages}", "-o", str(out),
            str(SOURCE)]  # fmt: skip


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


def artifact_spec(config: Config) -> ArtifactSpec:
    """What stores ``config``'s library: its compile-time part, the arch, the source's digest."""
    split, slices, ntiles, stages = library_key(config)
    return ArtifactSpec("cuda_w4a16", {"split": split, "slices": slices, "ntiles": ntiles,
                                       "stages": stages},
                        ARCH, {"w4a16_gemv.cu": _source_digest()})  # fmt: skip


def install(config: Config) -> bool:
    """Write the stored library of ``config`` where ``launcher`` loads it; False if none is."""
    store = shared_store()
    data = store.get(artifact_spec(config)) if store is not None else None
    if data is None:
        return False
    files = unpack(data)
    if LIBRARY not in files:
        raise ArtifactError(f"not a cuda_w4a16 bundle: no {LIBRARY}")
    path = library_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, files[LIBRARY])
    return True


def ensure(configs: Iterable[Config]) -> dict[tuple, str | None]:
    """Every library of ``configs`` ready to load: installed from the artifact store, else
    compiled here (in parallel) and published. Library key -> None or why it is missing."""
    todo = {library_key(c): c for c in configs if not library_path(c).is_file()}
    for key, config in list(todo.items()):
        try:
            if install(config):
                del todo[key]
        except (ArtifactError, StoreError, OSError, sqlite3.Error) as e:
            log.warning("stored cuda_w4a16 library %s not installed, compiling it: %s", key, e)
    errors = compile_all(todo.values()) if todo else {}
    store = shared_store() if any(e is None for e in errors.values()) else None
    for key, error in errors.items():
        if error is None and store is not None:
            try:
                store.put(
                    artifact_spec(todo[key]), pack({LIBRARY: library_path(todo[key]).read_bytes()})
                )
            except (ArtifactError, StoreError, OSError, sqlite3.Error) as e:
                log.warning("cuda_w4a16 library %s not stored as an artifact: %s", key, e)
    return errors


def launcher(config: Config) -> Any:
    """The library's ``w4a16_gemv`` entry point (installed or built here if missing)."""
    error = ensure([config]).get(library_key(config))
    if error:
        raise RuntimeError(f"cuda_w4a16 library {library_key(config)}: {error}")
    return _load(library_path(config))


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


# Decode shortlist, M <= 8 (one n8 tile): (split, slices, stages, warps, cluster), the likeliest
# first. Warps splitting K: 32-row CTAs over all of K, one per SM (splitting K over a cluster, or
# 16- or 64-row CTAs, lost on every row); 16 warps of 3 stages keep more chunks in flight than 8
# of 4 on the narrow projections, 8 of 4 win the wide ones and M = 8. Warps splitting rows: 8
# warps of 32 rows share each chunk's x slab, K over a cluster of 8: ahead of the K split where
# x's slab weighs most (Qwen's down projection at M = 8), behind it where N's CTAs come in 16
# clusters of 8 (Llama's down); 16-row warps ran slower than 32-row ones.
# M > 8 is not offered: the K split copies x's [M, 128] slab per warp and chunk (at M = 16 as
# many bytes as the weight's), and the row split's two n8 tiles per warp lost to the Triton
# tiles on both down projections.
SHORTLIST = (("k", 2, 4, 8, 1), ("k", 2, 3, 16, 1), ("rows", 2, 4, 8, 8))
MAX_M = 8


def configs(m: int, n: int, k: int, group: int) -> list[Config]:
    """Configs worth timing for a decode problem (M <= ``MAX_M``), those that fit it."""
    out = []
    for split, slices, stages, warps, cluster in SHORTLIST if m <= MAX_M else ():
        config = {"split": split, "slices": slices, "ntiles": 1 if m <= 8 else 2,
                  "stages": stages, "warps": warps, "cluster": cluster}  # fmt: skip
        try:
            check_config(config, m, n, k, group)
        except ValueError:
            continue
        out.append(config)
    return out


def unsupported_reason(key: GemmKey) -> str | None:
    if key.wdtype != "int4":
        return "int4 weights only"
    if key.m > MAX_M:
        return f"m={key.m}: offered for decode at M <= {MAX_M} (x's slab per warp outweighs more)"
    if key.dtype not in ACT_DTYPES:
        return f"dtype={key.dtype}: bf16 or f16 activations only"
    if key.k % CHUNK:
        return f"k={key.k}: our layout packs K in whole chunks of {CHUNK}"
    if key.align < ALIGN:
        return f"align={key.align}: x's rows are copied in {ALIGN}-byte pieces"
    if not configs(key.m, key.n, key.k, key.group):
        return f"no config fits m={key.m}, n={key.n}, k={key.k}, group={key.group}"
    return None


class CudaW4A16(Source):
    name = "cuda_w4a16"
    op = "gemm"
    builds_kernels = True

    def unavailable(self, device: str) -> str | None:
        if device != "cuda":
            return "a CUDA kernel: needs an NVIDIA GPU"
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            return f"compute capability {cap}: the kernel is built for sm_90a (Hopper) only"
        if nvcc_path() is None and not any(_stored(c) for c in _all_configs()):
            return "nvcc not found and no built cuda_w4a16 library here or in the artifact store"
        return None

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return configs(key.m, key.n, key.k, key.group)

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        ensure(shortlist)  # failures are left for build to raise

    def build(self, key: GemmKey, params: Params) -> Runner:
        check_config(params, key.m, key.n, key.k, key.group)
        config, group, fn = dict(params), key.group, launcher(params)
        shape = (key.m, key.n, key.k)

        def runner(x, packed, scales_and_zeros, out=None):
            weight = int4_torch.ours(packed)
            if check_inputs(x, weight, scales_and_zeros, group) != shape:
                raise ValueError(f"x.shape={tuple(x.shape)}, weight N={weight.shape[0]}: this "
                                 f"runner is built for (M, N, K)={shape}")  # fmt: skip
            if x.data_ptr() % ALIGN or x.stride(0) * x.element_size() % ALIGN:
                raise ValueError(f"x: rows must start on {ALIGN}-byte boundaries (data_ptr "
                                 f"{x.data_ptr()}, strides {x.stride()})")  # fmt: skip
            if out is None:
                out = torch.empty(key.m, key.n, dtype=x.dtype, device=x.device)
            elif out.shape != (key.m, key.n) or out.dtype != x.dtype or out.stride(1) != 1:
                raise ValueError(f"out: expected a [{key.m}, {key.n}] {x.dtype} tensor with unit "
                                 f"stride along N, got {out.dtype} {tuple(out.shape)} strides "
                                 f"{out.stride()}")  # fmt: skip
            run(fn, config, x, weight, scales_and_zeros, group, out)
            return out

        return runner


def _all_configs() -> list[Config]:
    """One config per library the shortlists name."""
    return [{"split": split, "slices": s, "ntiles": 1, "stages": st, "warps": 1, "cluster": 1}
            for split, s, st, _, _ in SHORTLIST]  # fmt: skip


def _stored(config: Config) -> bool:
    """Whether ``config``'s library is here or in the artifact store."""
    if library_path(config).is_file():
        return True
    store = shared_store()
    try:
        return store is not None and store.get(artifact_spec(config)) is not None
    except (ArtifactError, StoreError, OSError, sqlite3.Error):
        return False
