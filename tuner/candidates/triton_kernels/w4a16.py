"""INT4 weight-only GEMM (W4A16): ``out = x @ dequant(w).T`` with bf16 or fp16 activations.

The weight is our packed layout (``tuner.quant.int4``): uint8 [N, K / 2], K in chunks of 128
values (64 bytes of a row), tile-major (one chunk of a 64-row block is one contiguous 4 KB run,
so a [BN, 128] weight tile is one run or BN / 64 of them; hence BN divides 64 or is a multiple
of it), permuted inside each chunk so that the 16 bytes a thread loads are the 32 values it
owns in Hopper's wgmma register-operand layout (the same per-warp fragment as Ampere's mma,
where the kernel also runs): after the reshapes below the dequantized tile is in the
operand's order (how Triton lowers them, in registers or through shared memory, is its choice:
check the SASS for ``STS`` of the weight). ``scales_and_zeros`` is torch's [K / group, N, 2].

The kernel computes out.T = W x.T: the dequantized [BN, BK] weight tile is the dot's first
operand, which wgmma takes from registers; x's [BM, BK] tiles are the second, so BM (activation
rows) may be 16 for decode. Dequantization: a nibble becomes a 16-bit float through the
mantissa of 128 (bf16) or 1024 (fp16) with one ``lop3`` per pair of values (inline PTX; a
pure-Triton path serves the interpreter), then one packed subtract and one packed fused
multiply-add with the group's scale and zero, rounded once. ``DOTS`` dots per loop iteration:
two keep Triton from splitting a register-operand dot into 16-wide wgmmas that each wait for the
last (a fence per 512 weight bytes); one takes half the shared memory a stage (more CTAs fit
per SM). Split-K: K's steps in runs of whole steps (any count of them), fp32 partials
[SPLIT_K, M, N]; the last program of an output tile to finish (an atomic count per tile), or the
tile's last split once the others arrived (``split_wait``), sums them in split order, so the
result is deterministic and needs no second launch (while a CUDA graph is being captured before
the counts exist, a reduce launch does it instead). Where a decode problem has more tiles than
SMs, a hybrid (``whole_tiles``) takes whole waves of tiles whole and splits the others' K, so that
no SM is left a whole tile more than others.

Entry point for a candidate source: ``w4a16_matmul(x, weight, scales_and_zeros, group_size,
config)`` and ``configs(m, n, k, group_size)``, the configs worth timing for a shape;
``checked_plan(...).jobs(dtype)`` lists what a config's first call compiles, for
``launch.precompile`` to compile ahead in worker processes.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.candidates.triton_kernels.launch import ConfigKey, FakeTensor, WarmJob, config_key
from tuner.candidates.triton_kernels.splitk_arrival import (
    ArrivalCounts,
    arrive,
    reduce_if_last,
    sum_when_arrived,
)
from tuner.candidates.triton_kernels.tiled import splitk_reduce, tile_coords
from tuner.core.triton_launch import Launcher, current_gpu, interpreting, verify_direct
from tuner.quant.int4 import BLOCK_ROWS, CHUNK, check_group_size, check_scales_and_zeros

Config = dict[str, Any]
KERNELS = ("tiled",)
ACT_DTYPES = (torch.bfloat16, torch.float16)
MIN_CAPABILITY = (8, 0)
REDUCE_BLOCK = 1024

_counts = ArrivalCounts()
CHUNK_K: tl.constexpr = tl.constexpr(CHUNK)

# lo, hi = 16-bit floats (magic + low nibble, magic + high nibble) of each byte, elementwise, so
# the result does not depend on which 4 bytes Triton packs into one register; each output
# register holds the values of two neighbouring bytes (k and k + 8 in our layout), and the
# permute in ``_weight_tile`` puts them in k order for the packed ops and the tensor cores
_VALUES_PTX = """{
.reg .b32 t, u;
prmt.b32 t, $4, 0, 0x4140;
prmt.b32 u, $4, 0, 0x4342;
lop3.b32 $0, t, 0x000f000f, MAGIC, 0xea;
lop3.b32 $1, u, 0x000f000f, MAGIC, 0xea;
shr.u32 t, t, 4;
shr.u32 u, u, 4;
lop3.b32 $2, t, 0x000f000f, MAGIC, 0xea;
lop3.b32 $3, u, 0x000f000f, MAGIC, 0xea;
}"""
BF16_VALUES_PTX: tl.constexpr = tl.constexpr(_VALUES_PTX.replace("MAGIC", "0x43004300"))
F16_VALUES_PTX: tl.constexpr = tl.constexpr(_VALUES_PTX.replace("MAGIC", "0x64006400"))


@triton.jit
def _values(b, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """(magic + low nibble, magic + high nibble) of each byte of ``b`` in ``dtype``, exact:
    magic 128 (bf16) or 1024 (fp16). The interpreter, whose bf16 arithmetic is wrong, gets the
    same values in fp32."""
    if INTERPRET:
        magic: tl.constexpr = 128.0 if dtype == tl.bfloat16 else 1024.0
        w = b.to(tl.int32)
        return (w & 15).to(tl.float32) + magic, (w >> 4).to(tl.float32) + magic
    elif dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(BF16_VALUES_PTX, "=r,=r,=r,=r,r", [b],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)  # fmt: skip
    else:
        return tl.inline_asm_elementwise(F16_VALUES_PTX, "=r,=r,=r,=r,r", [b],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=4)  # fmt: skip


@triton.jit
def _weight_tile(w_ptr, sz_ptr, n0, k0, N, half, dtype: tl.constexpr, BN: tl.constexpr,
                 GROUP: tl.constexpr, RAGGED: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """The dequantized [BN, CHUNK] tile of weight rows ``n0 + arange(BN)`` at K offset ``k0``
    (a whole chunk), in ``dtype`` (fp32 in the interpreter). BN divides 64 or is a multiple of
    it, so the tile's rows fill part of one 64-row block or whole blocks; ``RAGGED``: N % 64 > 0,
    the last block has fewer rows (a narrower stride). Addresses are a scalar base plus offsets
    that do not depend on ``n0`` or ``k0`` (but for a ragged block's rows), so the K loop keeps
    the per-element part out of the loop.

    Tile-major layout (``int4.pack``): block b of r rows starts at byte 64 b * half and holds
    chunk c of its row i at 64 (c r + i). A chunk's byte b (0..63) holds, for c = b // 16 and
    i = b % 16, the values at k = 2c + ((i >> 1) & 1) + 8 (i & 1) + 16 (i >> 2) in its low
    nibble and k + 64 in its high one: unpacked as [byte, nibble] the k bits come out in the
    order (k6, k3, k0, k4, k5, k1, k2) from the lowest; the permute puts them back to (k0 .. k6)."""
    rl = tl.arange(0, BN)
    rows = rl[:, None] < N - n0
    chunk = k0 // CHUNK_K
    cols = tl.arange(0, CHUNK_K // 2)[None, :]
    if BN <= 64:  # rows n0 % 64 + rl of block n0 // 64
        first = n0 // 64 * 64
        stride = tl.minimum(N - first, 64) if RAGGED else 64  # the block's rows
        base = first.to(tl.int64) * half + (chunk * stride + n0 - first) * 64
        offs = rl[:, None] * 64 + cols
    else:  # n0 % 64 == 0: rows rl % 64 of block (n0 + rl) // 64
        base = n0.to(tl.int64) * half + chunk * 4096
        offs = (rl // 64 * 64 * half + rl % 64 * 64)[:, None] + cols
        if RAGGED:  # the last block's rows: chunk * (its rows - 64) * 64 bytes nearer
            offs += (chunk * 64 * (tl.minimum(N - n0 - rl // 64 * 64, 64) - 64))[:, None]
    b = tl.load(w_ptr + base + offs, mask=rows, other=0)
    lo, hi = _values(b, dtype, INTERPRET)
    v = tl.join(lo, hi).reshape(BN, 2, 2, 2, 2, 2, 2, 2)
    v = v.permute(0, 7, 3, 4, 6, 1, 2, 5).reshape(BN, CHUNK_K)
    offset = tl.full((), 136.0 if dtype == tl.bfloat16 else 1032.0, v.dtype)  # magic + 8
    NG: tl.constexpr = CHUNK_K // GROUP if CHUNK_K > GROUP else 1  # groups in the tile
    # each (scale, zero) pair as one 32-bit word: 4-byte loads, which Triton's pipeliner copies
    # ahead asynchronously (2-byte ones it loads in the iteration that uses them)
    pairs = sz_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    sz = tl.load(pairs + (k0 // GROUP * N + n0) + (tl.arange(0, NG)[None, :] * N + rl[:, None]),
                 mask=rows, other=0)  # fmt: skip
    s = (sz & 0xFFFF).to(tl.int16).to(dtype, bitcast=True).to(v.dtype)
    z = (sz >> 16).to(tl.int16).to(dtype, bitcast=True).to(v.dtype)
    s = tl.broadcast_to(s[:, :, None], (BN, NG, CHUNK_K // NG)).reshape(BN, CHUNK_K)
    z = tl.broadcast_to(z[:, :, None], (BN, NG, CHUNK_K // NG)).reshape(BN, CHUNK_K)
    return tl.fma(v - offset, s, z)


@triton.jit
def _step(acc, x_ptrs, mask_m, w_ptr, sz_ptr, n0, k0, N, half, BN: tl.constexpr, BK: tl.constexpr,
          DOTS: tl.constexpr, GROUP: tl.constexpr, RAGGED: tl.constexpr,
          STEP_SUM: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """``acc`` [BN, BM] plus the ``DOTS`` dots of weight rows from ``n0`` and x's rows at K
    offset ``k0`` (one step of DOTS * BK; BK is one chunk). ``STEP_SUM``: the step's dots start
    from zero and their sum is added to ``acc`` after them, so that no wgmma's accumulator is
    carried around the loop (which makes ptxas serialize a 64-row tile's wgmmas, C7515)."""
    part = tl.zeros_like(acc) if STEP_SUM else acc
    for d in tl.static_range(DOTS):
        xt = tl.load(x_ptrs + k0 + d * BK, mask=mask_m, other=0.0)
        w = _weight_tile(w_ptr, sz_ptr, n0, k0 + d * BK, N, half, xt.dtype, BN, GROUP, RAGGED,
                         INTERPRET)  # fmt: skip
        if INTERPRET:  # the interpreter's bf16 dot is wrong: the same sums in fp32
            part = tl.dot(w, tl.trans(xt.to(tl.float32)), part)
        else:
            part = tl.dot(w, tl.trans(xt), part)
    if STEP_SUM:
        part += acc
    return part


@triton.jit
def w4a16_tiled(
    x_ptr, w_ptr, sz_ptr, out_ptr, ws_ptr, counts_ptr, M, N, half, ldx, ldo, steps, whole,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOTS: tl.constexpr,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr,
    REDUCE_HERE: tl.constexpr, RAGGED: tl.constexpr, STEP_SUM: tl.constexpr,
    SPLIT_WAIT: tl.constexpr, HYBRID: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Tensor cores on out.T = W x.T, ``DOTS`` [BN, BK] weight tiles per iteration; K's
    ``steps`` of DOTS * BK cut into ``SPLIT_K`` runs of whole steps (their lengths differ by one
    at most), whose partials, when ``REDUCE_HERE``, the tile's last program to arrive sums, or
    (``SPLIT_WAIT``) the program of its last split once the others have arrived. ``HYBRID``
    (a 1-d grid): the first ``whole`` tiles take one program each over all of K, and each later
    tile its ``SPLIT_K`` programs in turn, so that a wave of whole tiles and the short split
    programs even out the work per SM."""
    if HYBRID:
        p = tl.program_id(0)
        q = tl.maximum(p - whole, 0)
        tile = tl.where(p < whole, p, whole + q // SPLIT_K)
        split = tl.where(p < whole, 0, q % SPLIT_K)
        runs = tl.where(p < whole, 1, SPLIT_K)
    else:
        tile, split, runs = tl.program_id(0), tl.program_id(1), SPLIT_K
    pid_m, pid_n = tile_coords(tile, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    k_lo = split * steps // runs * (DOTS * BK)
    k_hi = (split + 1) * steps // runs * (DOTS * BK)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * ldx + tl.arange(0, BK)[None, :]
    mask_m = rm[:, None] < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, DOTS * BK):
        acc = _step(acc, x_ptrs, mask_m, w_ptr, sz_ptr, pid_n * BN, k0, N, half, BN, BK, DOTS,
                    GROUP, RAGGED, STEP_SUM, INTERPRET)  # fmt: skip
    mask = (rn[:, None] < N) & (rm[None, :] < M)
    out_ptrs = out_ptr + rm[None, :].to(tl.int64) * ldo + rn[:, None]
    part = rm[None, :].to(tl.int64) * N + rn[:, None]
    plane = tl.cast(M, tl.int64) * N  # M may arrive as the constant 1
    if SPLIT_K == 1:
        _store_whole(out_ptr, acc, rm, rn, mask, ldo)
    elif HYBRID:
        if runs == 1:  # reduced apart, a whole tile is plane 0 of a zeroed workspace
            if REDUCE_HERE:
                _store_whole(out_ptr, acc, rm, rn, mask, ldo)
            else:
                tl.store(ws_ptr + part, acc, mask=mask)
        else:
            _store_split(ws_ptr, counts_ptr, tile, split, acc, part, plane, mask, out_ptrs,
                         SPLIT_K, REDUCE_HERE, SPLIT_WAIT)  # fmt: skip
    else:
        _store_split(ws_ptr, counts_ptr, tile, split, acc, part, plane, mask, out_ptrs, SPLIT_K,
                     REDUCE_HERE, SPLIT_WAIT)  # fmt: skip


@triton.jit
def _store_whole(out_ptr, acc, rm, rn, mask, ldo):
    """The [BN, BM] tile stored as [BM, BN]: stored as is, ptxas (Triton 3.6) serializes the
    loop's wgmmas on most tiles (C7515)."""
    tl.store(out_ptr + rm[:, None].to(tl.int64) * ldo + rn[None, :],
             tl.trans(acc.to(out_ptr.dtype.element_ty)), mask=tl.trans(mask))  # fmt: skip


@triton.jit
def _store_split(ws_ptr, counts_ptr, tile, split, acc, part, plane, mask, out_ptrs,
                 SPLIT_K: tl.constexpr, REDUCE_HERE: tl.constexpr, SPLIT_WAIT: tl.constexpr):  # fmt: skip
    """Split ``split``'s partial of ``tile``: stored in its plane, then summed by the tile's
    last program to arrive or (``SPLIT_WAIT``) by its last split, which launches after the
    tile's others."""
    if REDUCE_HERE and SPLIT_WAIT:
        if split == SPLIT_K - 1:
            sum_when_arrived(ws_ptr, counts_ptr, tile, acc, part, plane, mask, out_ptrs, SPLIT_K)
        else:
            tl.store(ws_ptr + split * plane + part, acc, mask=mask)
            arrive(counts_ptr, tile)
    else:
        tl.store(ws_ptr + split * plane + part, acc, mask=mask)
        if REDUCE_HERE:
            reduce_if_last(ws_ptr, counts_ptr, tile, part, plane, mask, out_ptrs, SPLIT_K)


def check_inputs(
    x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> tuple[int, int, int]:
    """(M, N, K), or a ValueError naming the field that this kernel cannot take."""
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"x.dtype={x.dtype}: allowed {ACT_DTYPES}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected a 2-d [M, K] tensor with unit stride along K, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous uint8 [N, K / 2] tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] * 2 != k:
        raise ValueError(f"weight.shape={tuple(weight.shape)}: K / 2 = {k // 2} columns expected "
                         f"for x.shape={tuple(x.shape)}")  # fmt: skip
    if k % CHUNK:
        raise ValueError(f"x.shape={tuple(x.shape)}: K={k} must be a multiple of {CHUNK}")
    check_scales_and_zeros(scales_and_zeros, n, k, group_size, x.dtype)
    check_group_size(group_size, k)
    for name, t in (("weight", weight), ("scales_and_zeros", scales_and_zeros)):
        if t.device != x.device:
            raise ValueError(f"{name}.device={t.device}: must be x's device {x.device}")
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < MIN_CAPABILITY:
        cap = torch.cuda.get_device_capability(x.device)
        raise ValueError(f"x.device: compute capability {cap}; INT4 kernels need sm80 or newer")
    return m, n, k


def check_config(config: Config, m: int, n: int, k: int) -> None:
    """A ValueError naming the config field that cannot run an (M, N, K) problem."""
    kernel, bk, dots = config.get("kernel"), config["bk"], config.get("dots", 1)
    if kernel not in KERNELS:
        raise ValueError(f"config['kernel']={kernel!r}: allowed {sorted(KERNELS)}")
    if bk != CHUNK:
        raise ValueError(f"config['bk']={bk}: must be {CHUNK}, one chunk of the layout per dot "
                         f"(config['dots'] lengthens a step)")  # fmt: skip
    bn = config["bn"]
    if bn % BLOCK_ROWS and BLOCK_ROWS % bn:
        raise ValueError(f"config['bn']={bn}: must divide {BLOCK_ROWS} or be a multiple of it "
                         f"(the weight's tile-major blocks of rows)")  # fmt: skip
    if dots not in (1, 2, 4):
        raise ValueError(f"config['dots']={dots}: allowed 1, 2, 4")
    step_sum = config.get("step_sum", False)
    if not isinstance(step_sum, bool) or (step_sum and dots == 1):
        raise ValueError(f"config['step_sum']={step_sum!r}: allowed True (with 2 or 4 dots a step, "
                         f"config['dots']={dots}) or False")  # fmt: skip
    if k % (bk * dots):
        raise ValueError(f"config['bk']={bk}, config['dots']={dots}: K={k} must be whole steps "
                         f"of bk * dots")  # fmt: skip
    split_wait = config.get("split_wait", False)
    split = config.get("split_k", 1)
    if not isinstance(split_wait, bool) or (split_wait and split == 1):
        raise ValueError(f"config['split_wait']={split_wait!r}: allowed True (config['split_k'] "
                         f">= 2) or False")  # fmt: skip
    steps = k // (bk * dots)
    if type(split) is not int or not 1 <= split <= steps:
        raise ValueError(f"config['split_k']={split!r}: allowed 1 .. {steps}, the bk * dots = "
                         f"{bk * dots} steps of K={k}")  # fmt: skip
    whole = config.get("whole_tiles", 0)
    tiles = triton.cdiv(m, config["bm"]) * triton.cdiv(n, bn)
    if type(whole) is not int or (whole != 0 and (not 1 <= whole < tiles or split == 1)):
        raise ValueError(f"config['whole_tiles']={whole!r}: allowed 0 (none), or from 1 to one "
                         f"less than the problem's {tiles} tiles with config['split_k'] >= 2")  # fmt: skip


def w4a16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    group_size: int,
    config: Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequant(weight).T`` in x's dtype; ``config`` from ``configs`` (None: the first)."""
    m, n, k = check_inputs(x, weight, scales_and_zeros, group_size)
    config = config or configs(m, n, k, group_size)[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    checked_plan(m, n, k, group_size, config)(x, weight, scales_and_zeros, out)
    return out


def checked_plan(m: int, n: int, k: int, group_size: int, config: Config) -> Plan:
    """``plan`` of ``config`` once ``check_config`` accepted it: what ``w4a16_matmul`` runs and
    a source precompiles (``Plan.jobs``)."""
    key = config_key(config, lambda: check_config(config, m, n, k))
    return plan(m, n, k, group_size, key, current_gpu())


@functools.lru_cache(maxsize=4096)
def plan(m: int, n: int, k: int, group_size: int, config: ConfigKey, gpu: int | None) -> Plan:
    """The launch plan of one shape and (name, type, value) config on one GPU (``gpu``, as
    ``current_gpu`` gives it), made once ``check_config`` passed it and kept across calls: the
    checks would take a good part of an eager call's host time."""
    values = {name: value for name, _, value in config}
    check_config(values, m, n, k)
    return Plan(m, n, k, group_size, values)


class Plan:
    """The kernel bound to one shape and config. Its first call goes through Triton's JIT (which
    loads the kernel from Triton's on-disk cache where ``jobs`` were precompiled); once
    a direct relaunch reproduced that call bit for bit (``verify_direct``), calls with the same
    strides and pointer alignments launch the compiled kernel directly: a decode GEMM's kernel
    is shorter than the JIT's dispatch. ``parts``: the most fp32 partials of one output tile
    (1: none, the kernel stores the output)."""

    def __init__(self, m: int, n: int, k: int, group_size: int, config: Config) -> None:
        self.m, self.n, self.k = m, n, k
        bm, bn, bk, dots = config["bm"], config["bn"], config["bk"], config.get("dots", 1)
        self.tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        meta = dict(BM=bm, BN=bn, BK=bk, DOTS=dots, GROUP=group_size, RAGGED=n % BLOCK_ROWS > 0,
                    STEP_SUM=config.get("step_sum", False), INTERPRET=interpreting())  # fmt: skip
        self.parts = config.get("split_k", 1)
        self.whole = config.get("whole_tiles", 0)
        self.kernel, self.grid = w4a16_tiled, (self.tiles, self.parts)
        if self.whole:
            self.grid = (self.whole + (self.tiles - self.whole) * self.parts,)
        self.meta = {**meta, "SPLIT_K": self.parts, "GROUP_M": config.get("group_m", 8),
                     "SPLIT_WAIT": config.get("split_wait", False), "HYBRID": self.whole > 0}  # fmt: skip
        self.tail = (k // (bk * dots), self.whole)  # steps of K, whole tiles
        self.warps_stages = dict(
            num_warps=config.get("warps", 4), num_stages=config.get("stages", 2)
        )
        self.main = Launcher(self.kernel, self.grid, {**self.meta, "REDUCE_HERE": self.parts > 1},
                             **self.warps_stages)  # fmt: skip
        self.checked = False

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor,
                 out: torch.Tensor) -> None:  # fmt: skip
        self._launch(x, weight, sz, out)
        if not self.checked:
            self.checked = verify_direct([self.main], out,
                                         lambda again: self._launch(x, weight, sz, again),
                                         f"w4a16 {self.m}x{self.n}x{self.k}")  # fmt: skip

    def _launch(self, x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor,
                out: torch.Tensor) -> None:  # fmt: skip
        parts = self.parts
        ws = torch.empty(parts, self.m, self.n, dtype=torch.float32, device=x.device) \
            if parts > 1 else out  # fmt: skip
        counts = _counts.get(x.device, self.tiles) if parts > 1 else out
        if counts is None:
            self._reduce_apart(x, weight, sz, out, ws)
            return
        ptrs = (x.data_ptr(), weight.data_ptr(), sz.data_ptr(), out.data_ptr(), ws.data_ptr(),
                counts.data_ptr())  # fmt: skip
        ldx, ldo = x.stride(0), out.stride(0)
        guard = (x.device, x.dtype, out.dtype, ldx, ldo, *(p % 16 for p in ptrs))
        if direct := self.main.ready(guard):
            direct(self._args(*ptrs, ldx, ldo))
        else:
            self.main(self._args(x, weight, sz, out, ws, counts, ldx, ldo), guard)

    def _args(self, x: Any, weight: Any, sz: Any, out: Any, ws: Any, counts: Any, ldx: int,
              ldo: int) -> tuple[Any, ...]:  # fmt: skip
        """The kernel's runtime arguments in declaration order (tensors, their pointers or
        ``FakeTensor``s): every launch and ``jobs`` build them here."""
        return (x, weight, sz, out, ws, counts, self.m, self.n, self.k // 2, ldx, ldo,
                *self.tail)  # fmt: skip

    def jobs(self, dtype: torch.dtype, align: int = 16) -> list[WarmJob]:
        """What the first eager call compiles for contiguous operands: x [M, K] (``align``-byte
        aligned) and scales_and_zeros in ``dtype``, our uint8 weight, an [M, N] output in
        ``dtype``, split-K's float32 partials and int32 arrival counts."""
        x, out = FakeTensor(dtype, align), FakeTensor(dtype)
        ws, counts = (FakeTensor(torch.float32), FakeTensor(torch.int32)) if self.parts > 1 \
            else (out, out)  # fmt: skip
        args = self._args(x, FakeTensor(torch.uint8), FakeTensor(dtype), out, ws, counts,
                          self.k, self.n)  # fmt: skip
        return [WarmJob(self.kernel, args, self.main.kwargs)]

    def _reduce_apart(self, x: torch.Tensor, weight: torch.Tensor, sz: torch.Tensor,
                      out: torch.Tensor, ws: torch.Tensor) -> None:  # fmt: skip
        """While a CUDA graph is captured before the arrival counts exist: partials, then a
        reduce launch (both through the JIT). A hybrid's whole tile fills only plane 0: the
        others must read as zeros."""
        m, n = self.m, self.n
        if self.whole:
            ws.zero_()
        self.kernel[self.grid](
            *self._args(x, weight, sz, out, ws, out, x.stride(0), out.stride(0)), **self.meta,
            REDUCE_HERE=False, **self.warps_stages,
        )  # fmt: skip
        total = m * n
        splitk_reduce[(triton.cdiv(total, REDUCE_BLOCK),)](
            ws, out, m, n, total, 0, out.stride(0), 1, SPLIT_K=self.parts, BLOCK=REDUCE_BLOCK
        )


def _splits(tiles: int, k: int, step: int, sms: int) -> int:
    """Enough K splits (a power of two up to 16) that ``tiles`` output tiles cover the SMs once;
    each split whole ``step``s of K."""
    split = 1
    while tiles * split < sms and k % (step * split * 2) == 0 and split < 16:
        split *= 2
    return split


def _resident_splits(tiles: int, steps: int, per_sm: int, sms: int) -> int:
    """K splits for ``tiles`` output tiles of ``steps`` steps each, their CTAs all resident at
    once (``per_sm`` per SM): the fewest step-times per SM, taking the longest run (splits differ
    by one step at most) times the CTAs per SM, and no fewer than 4 of them, below which the
    weight streams slower than the bytes in flight allow; the most splits among equals."""
    fits = range(1, max(1, min(steps, per_sm * sms // tiles)) + 1)
    knee = min(per_sm, 4) * sms
    return min(fits, key=lambda p: (-(-steps // p) * max(tiles * p, knee), -p))


def _hybrid(tiles: int, steps: int, per_sm: int, sms: int) -> tuple[int, int] | None:
    """(whole tiles, K splits of the others) where one program per tile leaves some SMs a tile
    more than the rest: whole waves of one tile per SM, then the other tiles' split programs,
    all resident, dealt one per SM in launch order. The split giving the fewest steps to the
    busiest SM, the fewest splits among equals; None where none gives fewer than one program
    per tile does."""
    whole, rest = tiles // sms * sms, tiles % sms
    if not whole or not rest:
        return None

    def busiest(split: int) -> int:
        return whole // sms * steps + -(-rest * split // sms) * -(-steps // split)

    fits = [p for p in range(2, steps + 1) if whole + rest * p <= per_sm * sms]
    best = min(fits, key=lambda p: (busiest(p), p), default=None)
    if best is None or busiest(best) >= -(-tiles // sms) * steps:
        return None
    return whole, best


def _dots(k: int, most: int) -> int:
    """The most dots per step, up to ``most``, whose steps cut K whole."""
    return next(d for d in (4, 2, 1) if d <= most and k % (d * CHUNK) == 0)


# Decode (M <= 16, one 16-row activation tile), split-K: (bn, warps, stages, most dots a step,
# CTAs per SM, more config keys), split by ``_resident_splits``: the weight streams at the rate
# of the bytes in flight, and a second wave or an idle slot loses that rate. Shared memory and
# registers set the CTAs per SM: x's [16, 128] tiles take a buffer per stage, the weight's one
# fewer (64 rows x 3 stages x 2 dots: 42 KB a CTA). ptxas serializes the wgmmas (C7515) of 64
# rows on 4 warps unless each step sums apart (``step_sum``, dropped where a step is one dot).
# The partials are summed by the last to arrive or (``split_wait``, where split > 1) by the last
# split; the shortlist keeps both. Where the tiles
# outnumber the SMs and one split is resident, the hybrid of ``_hybrid`` (``whole_tiles``) with
# split_wait takes the one split's place: an SM with a whole tile more than others sets the time.
DECODE_TILES = ((64, 4, 3, 2, 5, {"step_sum": True}),
                (64, 4, 3, 2, 5, {"step_sum": True, "split_wait": True}))  # fmt: skip
# Prefill: (bm activation rows, bn weight rows, warps, stages, dots, step_sum); one 128-wide K
# tile per dot, x's [bm, 128] tiles dominating shared memory. Triton serializes the wgmmas of a
# one-dot step, and of a two-dot step on 4 warps unless it sums apart (``step_sum``); at 2 stages
# a step waits for all its copies (nothing in flight while it computes), at 3 one step's copies
# stay in flight. 64 x 64 on 4 warps (two CTAs per SM) comes first up to M = 256.
PREFILL_TILES = ((128, 128, 8, 3, 1, False), (256, 128, 8, 2, 1, False), (128, 128, 8, 3, 2, False),
                 (64, 64, 4, 3, 2, True), (64, 128, 8, 3, 1, False), (128, 256, 8, 2, 1, False),
                 (64, 256, 8, 3, 1, False))  # fmt: skip
# A step's scales and zeros take shared memory per stage too: (bm, bn, dots) of the tiles whose
# 3-stage buffers overflow Hopper's shared memory once a step spans more than two groups (group
# size under 128), and the stages they keep there.
MANY_GROUPS_STAGES = {(128, 128, 2): 2}


def configs(m: int, n: int, k: int, group_size: int, sms: int = 132) -> list[Config]:
    """Configs worth timing for an (M, N, K) problem, the likeliest first."""
    out: list[Config] = []
    if m <= 16:
        for bn, warps, stages, most, per_sm, keys in DECODE_TILES:
            dots = _dots(k, most)
            tiles, steps = triton.cdiv(n, bn), k // (CHUNK * dots)
            split = _resident_splits(tiles, steps, per_sm, sms)
            layout: Config = {"split_k": split}
            hybrid = _hybrid(tiles, steps, per_sm, sms) if split == 1 else None
            if hybrid:  # in place of the one split, and always with split_wait
                layout = {"split_k": hybrid[1], "whole_tiles": hybrid[0], "split_wait": True}
            config = {"kernel": "tiled", "bm": 16, "bn": bn, "bk": CHUNK, "dots": dots,
                      "group_m": 1, "warps": warps, "stages": stages, **layout}  # fmt: skip
            config |= {key: on for key, on in keys.items() if (key != "step_sum" or dots > 1)
                       and (key != "split_wait" or config["split_k"] > 1)}  # fmt: skip
            if config not in out:
                out.append(config)
        return out
    for bm, bn, warps, stages, dots, step_sum in PREFILL_TILES:
        if bm <= 2 * max(m, 16) and k % (dots * CHUNK) == 0:
            split = _splits(triton.cdiv(m, bm) * triton.cdiv(n, bn), k, dots * CHUNK, sms)
            if dots * CHUNK > 2 * group_size:
                stages = MANY_GROUPS_STAGES.get((bm, bn, dots), stages)
            config = {"kernel": "tiled", "bm": bm, "bn": bn, "bk": CHUNK, "dots": dots,
                      "split_k": split, "group_m": 8, "warps": warps, "stages": stages}  # fmt: skip
            out.append({**config, "step_sum": True} if step_sum else config)
    out.sort(key=lambda c: -c["bm"] * c["bn"] if m > 256 else c["bm"])
    return out


settle(globals())  # last: every JIT function above is defined
