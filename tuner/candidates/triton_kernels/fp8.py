"""FP8 GEMM with scales: ``out = (a @ b.T) * scale_a * scale_b`` in bf16, what
``torch._scaled_mm(a, b.T, scale_a, scale_b)`` computes.

a: [M, K] e4m3 / e5m2 (activations), b: [N, K] e4m3 / e5m2 (the weight, K-contiguous: the layout
the tensor cores take fp8 in). Scales (``tuner.quant.fp8``): tensorwise (one float32 each) or
rowwise (scale_a [M, 1], scale_b [N, 1] or [1, N]), applied to the fp32 accumulator once per tile.

Accumulation: on sm90 an fp8 ``tl.dot`` accumulates in the tensor cores' partial precision
unless told otherwise; ``precise=True`` (``_scaled_mm``'s ``use_fast_accum=False``) passes
``max_num_imprecise_acc`` so the partial sums are added into the fp32 accumulator every
``PROMOTE_EVERY`` products along K, as CUTLASS's and cuBLASLt's non-fast FP8 kernels do; a K
step of ``dots`` dots of at most that many products each sums them apart instead (one wait a
dot rather than one a wgmma).

- ``fp8_tiled``: one output tile per program, grouped ordering; ``SPLIT_K > 1`` runs several
  programs per tile over contiguous K ranges (small M: enough programs to keep the weight
  streaming), or with ``interleave`` over every SPLIT_K-th K step (a tile's splits, running
  together, read adjacent steps of the same rows: longer runs of DRAM addresses at once), each
  writing its *scaled* fp32 partial (scaling is linear), summed in split order by the tile's
  last program (``splitk_arrival``: no second launch in a decode step), or by the tiled
  family's ``splitk_reduce`` while a CUDA graph is captured before the counts exist. ``swap``
  computes the tile as b @ a.T: at decode a's few rows become a wgmma's n and b's 64 rows its m
  (native FP8 wgmma, where 16 rows of a as m would take mma.sync through fp16).
- ``fp8_persistent_tma`` (Hopper): one program per SM walks the tiles; A and B move through TMA
  descriptors made on the device, which zero-fill the K tail and out-of-range rows. TMA needs
  16-byte aligned bases and row strides (K % 16 == 0 for fp8).

Entry point for a candidate source: ``fp8_matmul(a, b, scale_a, scale_b, config)`` (checks its
operands on every call) or ``checked_plan(m, n, k, rowwise, precise, config)`` (a ``Plan``, made
once per shape and config, that a runner calls with operands it checked), and ``configs(m, n,
k)``; ``jobs(m, n, k, config, ...)`` lists what a config's first call compiles (the same
launches, described once), for ``launch.precompile`` to compile ahead in worker processes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels import launch
from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.candidates.triton_kernels.configs import SMEM_LIMIT
from tuner.candidates.triton_kernels.launch import FakeTensor, WarmJob
from tuner.candidates.triton_kernels.persistent import HAS_DEVICE_TMA
from tuner.candidates.triton_kernels.splitk_arrival import ArrivalCounts, reduce_if_last
from tuner.candidates.triton_kernels.tiled import splitk_reduce, tile_coords
from tuner.core import triton_launch
from tuner.core.triton_launch import interpreting
from tuner.quant.fp8 import FP8_DTYPES, check_scales

Config = dict[str, Any]
KERNELS = ("tiled", "persistent_tma")
MIN_CAPABILITY = (8, 9)
TMA_CAPABILITY = (9, 0)
REDUCE_BLOCK = 1024
PROMOTE_EVERY = 128  # K products between promotions of the partial sum to fp32 (precise mode)

_counts = ArrivalCounts()


@triton.jit
def _scaled(acc, sa_ptr, sb_ptr, rm, rn, M, N, ROWWISE: tl.constexpr):
    if ROWWISE:
        sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
        sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
        return acc * sa[:, None] * sb[None, :]
    return acc * (tl.load(sa_ptr) * tl.load(sb_ptr))


@triton.jit
def fp8_tiled(
    a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, ws_ptr, counts_ptr, M, N, K, lda, ldb, ldo, k_split,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, ROWWISE: tl.constexpr, EVEN_K: tl.constexpr, PROMOTE: tl.constexpr,
    REDUCE_HERE: tl.constexpr, INTERLEAVE: tl.constexpr, SWAP: tl.constexpr,
    DOTS: tl.constexpr, FRESH: tl.constexpr,
):  # fmt: skip
    """One output tile per program; split-K partials summed by the tile's last program when
    ``REDUCE_HERE``, else by a ``splitk_reduce`` launch. ``INTERLEAVE``: split s takes the K
    steps s, s + SPLIT_K, ... (not a contiguous range), so that a tile's splits, running
    together, read adjacent steps of the same rows. ``SWAP`` computes the tile's transpose,
    b @ a.T, so that on Hopper a 16-row a (decode) is the n of a wgmma whose m is b's 64 rows
    (FP8 wgmma, where a 16-row a alone takes mma.sync through fp16). A K step is ``DOTS`` dots
    of BK; ``FRESH``: each dot starts from zero and is added to the fp32 sum (the promotion of
    precise mode, one per dot of at most ``PROMOTE_EVERY``, without Triton's wait after each
    wgmma that ``max_num_imprecise_acc`` splits a longer dot with)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if INTERLEAVE:
        k_lo = tl.program_id(1) * BK * DOTS
        k_hi = K
    else:
        k_lo = tl.program_id(1) * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * lda + rk[None, :]
    b_ptrs = b_ptr + rn[:, None].to(tl.int64) * ldb + rk[None, :]
    mask_m = rm[:, None] < M
    mask_n = rn[:, None] < N
    acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK * DOTS * SPLIT_K if INTERLEAVE else BK * DOTS):
        for d in tl.static_range(DOTS):
            kd = k0 + d * BK
            if EVEN_K:
                a = tl.load(a_ptrs + kd, mask=mask_m, other=0.0)
                b = tl.load(b_ptrs + kd, mask=mask_n, other=0.0)
            else:
                in_k = (kd + rk)[None, :] < k_hi
                a = tl.load(a_ptrs + kd, mask=mask_m & in_k, other=0.0)
                b = tl.load(b_ptrs + kd, mask=mask_n & in_k, other=0.0)
            if SWAP:
                a, b = b, a
            if FRESH:
                acc += tl.dot(a, tl.trans(b), max_num_imprecise_acc=PROMOTE)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=PROMOTE)
    if SWAP:
        acc = tl.trans(acc)
    acc = _scaled(acc, sa_ptr, sb_ptr, rm, rn, M, N, ROWWISE)
    mask = mask_m & (rn[None, :] < N)
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * ldo + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = rm[:, None].to(tl.int64) * N + rn[None, :]
        plane = tl.cast(M, tl.int64) * N  # M may arrive as the constant 1
        tl.store(ws_ptr + tl.program_id(1) * plane + part, acc, mask=mask)
        if REDUCE_HERE:
            reduce_if_last(ws_ptr, counts_ptr, tl.program_id(0), part, plane, mask, out_ptrs,
                           SPLIT_K)  # fmt: skip


@triton.jit
def fp8_persistent_tma(
    a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, M, N, K, lda, ldb, ldo, num_programs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ROWWISE: tl.constexpr, PROMOTE: tl.constexpr,
):  # fmt: skip
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[lda, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[ldb, 1], block_shape=[BN, BK])
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, num_programs, flatten=True):
        pid_m, pid_n = tile_coords(tile, grid_m, grid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kt in range(k_tiles):
            a = a_desc.load([off_m, kt * BK])
            b = b_desc.load([off_n, kt * BK])
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=PROMOTE)
        rm = off_m + tl.arange(0, BM)
        rn = off_n + tl.arange(0, BN)
        c = _scaled(acc, sa_ptr, sb_ptr, rm, rn, M, N, ROWWISE).to(out_ptr.dtype.element_ty)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * ldo + rn[None, :], c, mask=mask)


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the TMA descriptors a kernel makes on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def check_inputs(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> tuple[int, int, int, bool]:
    """(M, N, K, rowwise), or a ValueError naming the field that this kernel cannot take."""
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype}: allowed {FP8_DTYPES}")
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"{name}: expected a 2-d tensor with unit stride along K, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")  # fmt: skip
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError("a.dtype, b.dtype: e5m2 x e5m2 is not allowed (as in torch._scaled_mm)")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(
            f"b.shape={tuple(b.shape)}: expected [N, {k}] for a.shape={tuple(a.shape)}"
        )
    rowwise = check_scales(scale_a, scale_b, m, n)
    for name, t in (("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if t.device != a.device:
            raise ValueError(f"{name}.device={t.device}: must be a's device {a.device}")
    if a.is_cuda and torch.cuda.get_device_capability(a.device) < MIN_CAPABILITY:
        cap = torch.cuda.get_device_capability(a.device)
        raise ValueError(f"a.device: compute capability {cap}; FP8 kernels need sm89 or newer")
    return m, n, k, rowwise


def tma_unsupported(device: torch.device, rows: dict[str, tuple[int, int]]) -> str | None:
    """Why the persistent TMA kernel cannot take operands on ``device`` whose (row stride, data
    pointer) are ``rows[name]``, or None."""
    if not HAS_DEVICE_TMA:
        return "this Triton has no device-side tensor descriptors"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < TMA_CAPABILITY:
        return "TMA needs sm90"
    for name, (ld, ptr) in rows.items():
        if ld % 16 or ptr % 16:
            return f"{name}: TMA needs 16-byte aligned rows and base"
    return None


@dataclass(frozen=True)
class _Launch:
    """One kernel launch, ``fn[grid](*args, **kwargs)``: run by a call, compiled ahead as a
    ``WarmJob`` (same arguments) by ``jobs``."""

    fn: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> None:
        self.fn[self.grid](*self.args, **self.kwargs)

    def job(self) -> WarmJob:
        return WarmJob(self.fn, self.args, self.kwargs)


def _k_per_split(k: int, bk: int, split: int) -> int:
    """Each split's share of K, in whole ``bk`` tiles (the last split takes what is left)."""
    return triton.cdiv(triton.cdiv(k, split), bk) * bk


def split_fits(k: int, bk: int, split: int) -> bool:
    """Whether K in ``bk`` tiles leaves every one of ``split`` splits some work."""
    return split >= 1 and _k_per_split(k, bk, split) * (split - 1) < k


def _launches(
    operands: tuple[Any, Any, Any, Any, Any],
    mnk: tuple[int, int, int],
    lds: tuple[int, int, int],
    config: Config,
    rowwise: bool,
    precise: bool,
    device: torch.device,
    workspace: Callable[[int], Any],
    counts: Callable[[int], Any | None],
) -> list[_Launch]:
    """The launches of one ``fp8_matmul`` call, in order. ``operands``: a, b, the flat scales and
    out (tensors or ``FakeTensor``s), ``lds`` their row strides (a, b, out); ``workspace(planes)``
    gives the float32 partials, ``counts(tiles)`` the arrival counts of the in-kernel reduction
    (None: reduce with a second launch). A ValueError names a config that cannot run them."""
    a, b, sa, sb, out = operands
    m, n, k = mnk
    lda, ldb, ldo = lds
    bm, bn, bk = config["bm"], config["bn"], config["bk"]
    group_m = config.get("group_m", 8)
    options = dict(num_warps=config.get("warps", 4), num_stages=config.get("stages", 3),
                   PROMOTE=min(bk, PROMOTE_EVERY) if precise else None)  # fmt: skip
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    kernel = config.get("kernel")
    if kernel == "persistent_tma":
        why = tma_unsupported(device, {"a": (lda, a.data_ptr()), "b": (ldb, b.data_ptr())})
        if why:
            raise ValueError(f"config['kernel']='persistent_tma': {why}")
        sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 4  # fmt: skip
        programs = min(sms, tiles)
        args = (a, b, sa, sb, out, m, n, k, lda, ldb, ldo, programs)
        consts = dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, ROWWISE=rowwise, **options)
        return [_Launch(fp8_persistent_tma, (programs,), args, consts)]
    if kernel != "tiled":
        raise ValueError(f"config['kernel']={kernel!r}: allowed {', '.join(KERNELS)}")
    split, interleave = config.get("split_k", 1), config.get("interleave", False)
    swap, dots = config.get("swap", False), config.get("dots", 1)
    for name, value in (("interleave", interleave), ("swap", swap)):
        if value not in (True, False):
            raise ValueError(f"config['{name}']={value!r}: allowed True, False")
    if dots not in (1, 2, 4):
        raise ValueError(f"config['dots']={dots!r}: allowed 1, 2, 4 dots of bk a K step")
    step = bk * dots
    if not (1 <= split <= triton.cdiv(k, step) if interleave else split_fits(k, step, split)):
        raise ValueError(f"config['split_k']={split}: more splits than the {step}-wide steps "
                         f"(bk={bk} x dots={dots}) of K={k}")  # fmt: skip
    k_split = _k_per_split(k, step, split)
    ws = workspace(split) if split > 1 else out
    arrivals = counts(tiles) if split > 1 else None
    args = (a, b, sa, sb, out, ws, out if arrivals is None else arrivals, m, n, k, lda, ldb, ldo,
            k_split)  # fmt: skip
    consts = dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, SPLIT_K=split, ROWWISE=rowwise,
                  EVEN_K=k % step == 0 and (interleave or k_split * split == k),
                  REDUCE_HERE=arrivals is not None, INTERLEAVE=interleave, SWAP=swap,
                  DOTS=dots, FRESH=precise and dots > 1, **options)  # fmt: skip
    tiled = _Launch(fp8_tiled, (tiles, split), args, consts)
    if split == 1 or arrivals is not None:
        return [tiled]
    return [tiled, _reduce(ws, out, m, n, ldo, split)]


def _reduce(ws: Any, out: Any, m: int, n: int, ldo: int, planes: int) -> _Launch:
    """The second launch that sums ``planes`` partials into ``out`` (split order)."""
    total = m * n
    return _Launch(splitk_reduce, (triton.cdiv(total, REDUCE_BLOCK),),
                   (ws, out, m, n, total, 0, ldo, 1),
                   dict(SPLIT_K=planes, BLOCK=REDUCE_BLOCK))  # fmt: skip


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    config: Config | None = None,
    out: torch.Tensor | None = None,
    precise: bool = False,
) -> torch.Tensor:
    """bf16 ``(a @ b.T) * scale_a * scale_b``; ``config`` from ``configs`` (None: the first);
    ``precise``: promote the partial sums to fp32 along K (not fast accumulation)."""
    m, n, k, rowwise = check_inputs(a, b, scale_a, scale_b)
    config = config or configs(m, n, k)[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    checked_plan(m, n, k, rowwise, precise, config)(a, b, scale_a, scale_b, out)
    return out


def _through_jit(
    a: torch.Tensor,
    b: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    config: Config,
    rowwise: bool,
    precise: bool,
) -> None:
    """Every launch of one call through Triton's JIT, as ``_launches`` lists them."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    sa, sb = scales

    def workspace(planes: int) -> torch.Tensor:
        return torch.empty(planes, m, n, dtype=torch.float32, device=a.device)

    launches = _launches((a, b, sa, sb, out), (m, n, k), (a.stride(0), b.stride(0), out.stride(0)),
                         config, rowwise, precise, a.device, workspace,
                         lambda tiles: _counts.get(a.device, tiles))  # fmt: skip
    if launches[0].fn is fp8_persistent_tma:
        triton.set_allocator(_tma_scratch)
    for step in launches:
        step()


def checked_plan(m: int, n: int, k: int, rowwise: bool, precise: bool, config: Config) -> Plan:
    """``plan`` of ``config`` once ``_launches`` accepted it (a ValueError names what it cannot
    run): what ``fp8_matmul`` and the candidate source's runners call."""

    def check() -> None:
        jobs(m, n, k, config, rowwise=rowwise, precise=precise)

    return plan(
        m, n, k, rowwise, precise, launch.config_key(config, check), triton_launch.current_gpu()
    )


@functools.lru_cache(maxsize=4096)
def plan(
    m: int, n: int, k: int, rowwise: bool, precise: bool, config: launch.ConfigKey,
    gpu: int | None,
) -> Plan:  # fmt: skip
    """The plan of one shape, scaling, accumulation and (name, type, value) config on one GPU
    (``gpu``, as ``current_gpu`` gives it), made once and kept across calls: deriving the
    launches takes a good part of an eager call's host time."""
    return Plan(m, n, k, rowwise, precise, {name: value for name, _, value in config})


class Plan:
    """One shape's launches bound to a config. A tiled config's kernel launches directly once a
    direct relaunch reproduced its first (JIT) call bit for bit (``triton_launch.verify_direct``), for
    calls with the same strides, dtypes and pointer alignments; the persistent TMA kernel, and a
    split-K call while a CUDA graph is captured before the arrival counts exist, go through the
    JIT (``_through_jit``). Scales: contiguous ones are read in place."""

    def __init__(self, m: int, n: int, k: int, rowwise: bool, precise: bool, config: Config):
        self.m, self.n, self.k, self.rowwise, self.precise = m, n, k, rowwise, precise
        self.config = config
        fake = FakeTensor(torch.float32)
        first = _fake_launches((fake,) * 4, (m, n, k), config, rowwise, precise)[0]
        self.direct = first.fn is fp8_tiled
        self.tiles, self.splits = first.grid[0], first.grid[1] if self.direct else 1
        self.k_split = first.args[-1] if self.direct else 0  # the tiled kernel's last argument
        consts = dict(first.kwargs)
        warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
        self.main = triton_launch.Launcher(
            first.fn, first.grid, consts, num_warps=warps, num_stages=stages
        )
        self.checked = False

    def __call__(self, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                 scale_b: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
        sa = scale_a if scale_a.is_contiguous() else scale_a.reshape(-1).contiguous()
        sb = scale_b if scale_b.is_contiguous() else scale_b.reshape(-1).contiguous()
        if not self.direct or not self._launch(a, b, sa, sb, out):
            _through_jit(a, b, (sa, sb), out, self.config, self.rowwise, self.precise)
            return
        if not self.checked:
            self.checked = triton_launch.verify_direct([self.main], out,
                                                lambda again: self._launch(a, b, sa, sb, again),
                                                f"fp8 {self.m}x{self.n}x{self.k}")  # fmt: skip

    def _launch(self, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                out: torch.Tensor) -> bool:  # fmt: skip
        """The tiled kernel's one launch; False where it cannot reduce in place (a CUDA graph
        captured before the arrival counts exist)."""
        m, n, splits = self.m, self.n, self.splits
        if splits > 1:
            counts = _counts.get(a.device, self.tiles)
            if counts is None:
                return False
            ws = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
        else:
            ws = counts = out
        lda, ldb, ldo = a.stride(0), b.stride(0), out.stride(0)
        tail = (m, n, self.k, lda, ldb, ldo, self.k_split)
        ptrs = (a.data_ptr(), b.data_ptr(), sa.data_ptr(), sb.data_ptr(), out.data_ptr(),
                ws.data_ptr(), counts.data_ptr())  # fmt: skip
        guard = (a.device, a.dtype, b.dtype, out.dtype, lda, ldb, ldo, *(p % 16 for p in ptrs))
        if direct := self.main.ready(guard):
            direct((*ptrs, *tail))
        else:
            self.main((a, b, sa, sb, out, ws, counts, *tail), guard)
        return True


def jobs(
    m: int,
    n: int,
    k: int,
    config: Config,
    *,
    rowwise: bool,
    precise: bool,
    out_dtype: torch.dtype = torch.bfloat16,
    a_dtype: torch.dtype = torch.float8_e4m3fn,
    b_dtype: torch.dtype = torch.float8_e4m3fn,
    align: int = 16,
) -> list[WarmJob]:
    """What ``fp8_matmul``'s first call with ``config`` compiles for contiguous operands of an
    (M, N, K) problem: a [M, K] in ``a_dtype`` (``align``-byte aligned), b [N, K] row-major in
    ``b_dtype`` (as ``TritonFp8`` passes ``_scaled_mm``'s column-major b), float32 scales and an
    [M, N] output in ``out_dtype``. A ValueError for a config that cannot run here."""
    scale = FakeTensor(torch.float32)
    a, b, out = FakeTensor(a_dtype, align), FakeTensor(b_dtype), FakeTensor(out_dtype)
    steps = _fake_launches((a, b, out, scale), (m, n, k), config, rowwise, precise)
    return [step.job() for step in steps]


def _fake_launches(
    operands: tuple[FakeTensor, FakeTensor, FakeTensor, FakeTensor],
    mnk: tuple[int, int, int],
    config: Config,
    rowwise: bool,
    precise: bool,
) -> list[_Launch]:
    """``_launches`` for contiguous ``FakeTensor`` operands (a, b, out, the scales) on this
    process's device; a ValueError for a config that cannot run here."""
    on_gpu = not interpreting()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    a, b, out, scale = operands
    _, n, k = mnk
    return _launches((a, b, scale, scale, out), mnk, (k, k, n), config, rowwise, precise, device,
                     lambda planes: FakeTensor(torch.float32),
                     lambda tiles: FakeTensor(torch.int32))  # fmt: skip


# Decode (M <= 16), tiled kernel: the tiles that won a decode row of the grid bench
# (``bench/fp8_decode_sweep.py``, figures in bench/NOTES.md).
# N narrower than two waves of 64-row tiles: (bn, bk, stages, splits, least M), splits:
# "wave", the most whose programs fit one wave at two per SM; "per_sm", the most whose
# programs fit one wave at one per SM (a deep pipeline), offered where they fill 3/4 of it at
# least; "fill", one, offered where N / bn programs alone are more than one wave at one per SM.
# Splits are interleaved (a tile's splits, running together, read adjacent steps of the same
# rows). 32 x 512 x 6 from M = 2: Triton's M = 1 specialization of it reads slower. The 64-row
# tiles run ``swapped``.
NARROW_TILES = ((64, 256, 4, "wave", 1), (64, 256, 6, "per_sm", 1), (32, 512, 6, "per_sm", 2),
                (32, 256, 8, "per_sm", 1), (32, 512, 4, "fill", 1))  # fmt: skip
# N that fills two waves of 64-row tiles: one split each, (bn, bk, stages).
WIDE_TILES = ((64, 256, 3), (64, 256, 4))


def _splits(tiles: int, k: int, bk: int, programs: int) -> int:
    """The most splits (a power of two up to 16, doubled while the current count leaves each at
    least 4 ``bk`` steps: the last doubling may leave 2) whose ``tiles`` x splits programs are at
    most ``programs``."""
    split = 1
    while tiles * split * 2 <= programs and k >= bk * split * 4 and split < 16 \
            and split_fits(k, bk, split * 2):  # fmt: skip
        split *= 2
    return split


def wide(n: int, sms: int) -> bool:
    """Whether N gives two waves of 64-row tiles: then decode takes one split per tile."""
    return triton.cdiv(n, 64) >= 2 * sms


def swapped(config: Config) -> Config:
    """A decode tile of 64 weight rows and 256-byte steps as a wgmma's m (``swap``), each step
    two 128-byte dots (``dots``): in precise mode each dot's sum is added apart."""
    if config["bn"] != 64 or config["bk"] != 256:
        return config
    return {**config, "bk": 128, "dots": 2, "swap": True}


def decode_configs(m: int, n: int, k: int, sms: int = 132) -> list[Config]:
    """``configs`` for M <= 16."""
    return [swapped(c) for c in _decode_tiles(m, n, k, sms)]


def _decode_tiles(m: int, n: int, k: int, sms: int) -> list[Config]:
    tile = {"kernel": "tiled", "bm": 16, "group_m": 1, "warps": 4}
    if wide(n, sms):
        return [
            {**tile, "bn": bn, "bk": bk, "stages": st, "split_k": 1} for bn, bk, st in WIDE_TILES
        ]
    out: list[Config] = []
    for bn, bk, stages, rule, least_m in NARROW_TILES:
        tiles = triton.cdiv(n, bn)
        split = _splits(tiles, k, bk, 2 * sms if rule == "wave" else sms) if rule != "fill" else 1
        programs = tiles * split
        offered = {"wave": True, "per_sm": 3 * sms <= 4 * programs <= 4 * sms, "fill": tiles > sms}
        if m < least_m or not offered[rule]:
            continue
        interleave = {"interleave": True} if split > 1 else {}
        out.append({**tile, "bn": bn, "bk": bk, "stages": stages, "split_k": split, **interleave})
    return out


def configs(m: int, n: int, k: int, sms: int = 132, out_bytes: int = 2) -> list[Config]:
    """Configs worth timing for an (M, N, K) problem, the likeliest first. ``out_bytes``: the
    output's element size (the persistent kernel stages its output tile in shared memory)."""
    if m <= 16:
        return decode_configs(m, n, k, sms)
    if m <= 256:
        shortlist = [
            {"kernel": "tiled", "bm": 64, "bn": 128, "bk": 128, "group_m": 8, "warps": 4, "stages": 4},
            {"kernel": "persistent_tma", "bm": 64, "bn": 128, "bk": 128, "group_m": 8, "warps": 4, "stages": 4},
            {"kernel": "tiled", "bm": 128, "bn": 128, "bk": 128, "group_m": 8, "warps": 8, "stages": 4},
            {"kernel": "tiled", "bm": 64, "bn": 64, "bk": 128, "group_m": 8, "warps": 4, "stages": 5},
        ]  # fmt: skip
    else:
        shortlist = [
            {"kernel": "persistent_tma", "bm": 128, "bn": 256, "bk": 128, "group_m": 8, "warps": 8, "stages": 3},
            {"kernel": "persistent_tma", "bm": 128, "bn": 128, "bk": 128, "group_m": 8, "warps": 8, "stages": 4},
            {"kernel": "tiled", "bm": 128, "bn": 128, "bk": 128, "group_m": 8, "warps": 4, "stages": 4},
        ]  # fmt: skip
    return [fitted(c, out_bytes) for c in shortlist]


def fitted(config: Config, out_bytes: int) -> Config:
    """``config`` with as many pipeline stages as fit in shared memory beside the persistent
    kernel's output tile (a wider output leaves room for fewer)."""
    if config["kernel"] != "persistent_tma":
        return config
    bm, bn, bk = config["bm"], config["bn"], config["bk"]
    room = (SMEM_LIMIT - bm * bn * out_bytes) // ((bm + bn) * bk)  # FP8 operands: 1 byte each
    return {**config, "stages": max(2, min(config["stages"], room))}


settle(globals())  # last: every JIT function above is defined
