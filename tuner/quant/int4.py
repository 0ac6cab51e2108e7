"""INT4 weights with per-group scales and zeros, and their packed layouts.

Values: ``q`` is an [N, K] integer tensor of 0..15; ``scales_and_zeros`` is torch's
[K / group_size, N, 2] tensor of (scale, zero) in the activation dtype; the weight is
``w[n, k] = (q[n, k] - 8) * scale[k // group_size, n] + zero[k // group_size, n]``
(the convention of ``torch.ops.aten._weight_int4pack_mm``).

Our layout (what ``tuner.candidates.triton_kernels.w4a16`` reads): uint8 [N, K / 2], K in
chunks of ``CHUNK`` = 128 values (64 bytes of a row), stored tile-major: rows in blocks of
``BLOCK_ROWS`` = 64 (the last block holds the N % 64 rows left, unpadded), and a block of r
rows stores, chunk after chunk, the chunk's [r rows x 64 bytes] contiguously (then its K tail
as [r rows x tail bytes]). A block starts at byte 64 b * K / 2, as its first row would row by
row; one K chunk of a whole block is one 4 KB run, which DRAM serves faster than 64 runs of 64
bytes a row apart (``bench/w4a16_read_patterns.py``). Byte b of a row's chunk, with c = b // 16
and i = b % 16, holds k = 2c + ((i >> 1) & 1) + 8 (i & 1) + 16 (i >> 2) in its low nibble and
k + 64 in its high nibble: the 16 bytes at 16c are the 32 values a thread with lane bits c holds
of that row in the tensor cores' register-operand layout, and in each 32-bit word the low
nibbles of bytes 0 and 2 are an operand pair (k, k + 1), those of bytes 1 and 3 the pair
(k + 8, k + 9): one masked OR of a word (or of it shifted by 4, 8, 12) makes a pair in k order,
so one 16-byte load gives the kernel its operand with x in its own order. A tail of K % 128
values (K even), which the kernel does not take, keeps k = 2j in the low and 2j + 1 in the high
nibble of the row's tail byte j. torch's packer takes the even k in the high nibble of its bytes, so
``to_torch_int4pack`` reorders once.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from tuner.core.keys import INT4_GROUPS
from tuner.core.tensor_memo import TensorMemo

GROUP_SIZES = INT4_GROUPS  # the group sizes a key may name: torch's int4 GEMM's
CHUNK = 128  # values per permuted run of a row
BLOCK_ROWS = 64  # rows per tile-major block
INNER_K_TILES = (2, 4, 8)


@dataclass(frozen=True)
class Int4Names:
    """What the checks' errors call an int4 GEMM's operands: by default the arguments of
    ``tuner.int4_linear(x, packed_w, scales_and_zeros, group_size)``; a caller of another
    signature passes its own (``tuner.torch`` passes aten's for the ops it routes)."""

    x: str = "x"
    packed_w: str = "packed_w"
    scales_and_zeros: str = "scales_and_zeros"
    group_size: str = "group_size"


INT4_LINEAR_NAMES = Int4Names()


def check_group(group_size: int, name: str = "group_size") -> int:
    """``group_size`` as a Python int; ValueError naming the value (as ``name``) unless it is
    one of ``GROUP_SIZES``, as an integer (a Python or NumPy int or a 0-d integer tensor, as
    torch's ops take; ``128.0``, ``True`` or ``"128"`` are refused, not taken for a size)."""
    try:
        if isinstance(group_size, bool):
            raise TypeError
        size = operator.index(group_size)
    except TypeError:
        raise ValueError(f"{name}={group_size!r}: must be an int, one of {GROUP_SIZES}") from None
    if size not in GROUP_SIZES:
        raise ValueError(f"{name}={group_size!r}: allowed {GROUP_SIZES}")
    return size


def check_group_size(group_size: int, k: int, name: str = "group_size") -> None:
    """``check_group``, and the group must divide K."""
    check_group(group_size, name)
    if k % group_size:
        raise ValueError(f"{name}={group_size}: {group_size} must divide K={k}")


def check_scales_and_zeros(
    scales_and_zeros: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    *,
    names: Int4Names = INT4_LINEAR_NAMES,
) -> None:
    """ValueError naming the field (as ``names`` has it) unless the tensor is torch's
    [K / group, N, 2] of ``dtype`` (on ``device``, the activation's, where given: a kernel
    would read it there)."""
    check_group_size(group_size, k, names.group_size)
    sz, x, group = names.scales_and_zeros, names.x, names.group_size
    if device is not None and scales_and_zeros.device != device:
        raise ValueError(f"{sz}.device={scales_and_zeros.device}: must be {x}'s device ({device})")
    want = (k // group_size, n, 2)
    if tuple(scales_and_zeros.shape) != want:
        raise ValueError(
            f"{sz}.shape={tuple(scales_and_zeros.shape)}: expected {want} "
            f"([K / {group}, N, 2] for N={n}, K={k}, {group}={group_size})"
        )
    if scales_and_zeros.dtype != dtype:
        raise ValueError(
            f"{sz}.dtype={scales_and_zeros.dtype}: must be the activation's ({x}.dtype={dtype})"
        )
    if not scales_and_zeros.is_contiguous():
        raise ValueError(f"{sz}: must be contiguous, got shape {tuple(scales_and_zeros.shape)} "
                         f"strides {scales_and_zeros.stride()}; pass {sz}.contiguous()")  # fmt: skip


# weights ``quantize`` takes: its scales come out in the weight's dtype, so an integer one would
# truncate them to whole numbers (and an FP8 one round them to a few bits) without a word
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric per-group quantization of an [N, K] weight: (q uint8 [N, K] in 0..15,
    scales_and_zeros [K / group, N, 2] in w's dtype). Min maps to 0, max to 15. A ValueError
    names ``w``'s shape or dtype where it is not a 2-d weight of ``WEIGHT_DTYPES``."""
    if w.dim() != 2:
        raise ValueError(f"w.shape={tuple(w.shape)}: expected a 2-d [N, K] weight")
    if w.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"w.dtype={w.dtype}: expected one of {', '.join(map(str, WEIGHT_DTYPES))} "
                         "(the scales and zeros come out in the weight's dtype)")  # fmt: skip
    n, k = w.shape
    check_group_size(group_size, k)
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    zero = lo + 8 * scale
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(w.dtype)
    return q.reshape(n, k).to(torch.uint8), sz


def dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight that ``q`` (values 0..15) and the scales stand for."""
    n, k = q.shape
    check_scales_and_zeros(scales_and_zeros, n, k, group_size, scales_and_zeros.dtype)
    sz = scales_and_zeros.float().repeat_interleave(group_size, dim=0)  # [K, N, 2]
    return (q.float() - 8) * sz[..., 0].T + sz[..., 1].T


# a chunk's [k6, k5, .., k0] bits (big-endian dims 2..8 of a [N, C, 2, .., 2] view) in byte
# order: nibble (k6), then the byte's bits c1 c0 i3 i2 i1 i0 = k2 k1 k5 k4 k0 k3
_TO_BYTES = (0, 1, 2, 6, 7, 3, 4, 8, 5)
_FROM_BYTES = tuple(_TO_BYTES.index(d) for d in range(9))


def _blocks(n: int) -> list[tuple[int, int, int]]:
    """(first row, blocks, rows per block) of N rows: the whole blocks, then the ragged one."""
    whole = n // BLOCK_ROWS
    spans = [(0, whole, BLOCK_ROWS)]
    return [*spans, (whole * BLOCK_ROWS, 1, n % BLOCK_ROWS)] if n % BLOCK_ROWS else spans


def _tile_major(rows: torch.Tensor) -> torch.Tensor:
    """Row-major [N, K / 2] bytes -> the same bytes stored block by block, chunk by chunk."""
    n, h = rows.shape
    body = h - h % (CHUNK // 2)  # bytes in whole chunks
    parts = []
    for lo, blocks, r in _blocks(n):
        v = rows[lo : lo + blocks * r].reshape(blocks, r, h)
        chunks = v[..., :body].reshape(blocks, r, body * 2 // CHUNK, CHUNK // 2).transpose(1, 2)
        parts.append(torch.cat([chunks.reshape(blocks, r * body),
                                v[..., body:].reshape(blocks, r * (h - body))], dim=1).reshape(-1))  # fmt: skip
    return torch.cat(parts).reshape(n, h)


def _row_major(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_tile_major``."""
    n, h = packed.shape
    body = h - h % (CHUNK // 2)
    flat = packed.reshape(-1)
    parts = []
    for lo, blocks, r in _blocks(n):
        t = flat[lo * h : (lo + blocks * r) * h].reshape(blocks, r * h)
        chunks = t[:, : body * r].reshape(blocks, body * 2 // CHUNK, r, CHUNK // 2).transpose(1, 2)
        parts.append(torch.cat([chunks.reshape(blocks, r, body),
                                t[:, body * r :].reshape(blocks, r, h - body)],
                               dim=2).reshape(blocks * r, h))  # fmt: skip
    return torch.cat(parts)


# the tensors ``pack`` made, while they live unchanged (any other tensor: False)
_MADE_BY_PACK: TensorMemo[bool] = TensorMemo(lambda t: False)


def pack(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integer values 0..15 -> our uint8 [N, K / 2] layout (see the module docstring).
    A float tensor is refused: its values would be truncated (a float weight passed in place of
    ``quantize``'s values, all within (-1, 1), would pack as zeros without a word)."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q.shape={tuple(q.shape)}: expected [N, K] with K even")
    if q.is_floating_point() or q.is_complex():
        raise ValueError(f"q.dtype={q.dtype}: expected integer values 0..15, as int4.quantize "
                         "returns them (uint8); quantize a float weight first")  # fmt: skip
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("q: values must lie in 0..15")
    n, k = q.shape
    main = k - k % CHUNK  # values in whole chunks
    v = q[:, :main].to(torch.uint8).reshape(n, main // CHUNK, *[2] * 7).permute(*_TO_BYTES)
    v = v.reshape(n, main // CHUNK, 2, CHUNK // 2)
    tail = q[:, main:].to(torch.uint8).reshape(n, -1, 2)
    packed = _tile_major(torch.cat([(v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, main // 2),
                                    tail[..., 0] | (tail[..., 1] << 4)], dim=1))  # fmt: skip
    _MADE_BY_PACK.put(packed, True)
    return packed


def made_by_pack(t: torch.Tensor) -> bool:
    """Whether ``t`` is our layout as ``pack`` made it: on a CPU it has the dtype and shape of
    torch's packing (uint8 [N, K / 2]), so only this tells a slip of one for the other."""
    return _MADE_BY_PACK(t)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Our uint8 [N, K / 2] layout -> [N, K] uint8 values 0..15."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed: expected a uint8 [N, K / 2] tensor, got {packed.dtype} "
                         f"{tuple(packed.shape)}")  # fmt: skip
    rows = _row_major(packed)
    n, k = packed.shape[0], packed.shape[1] * 2
    main = k - k % CHUNK  # values in whole chunks
    b = rows[:, : main // 2].reshape(n, main // CHUNK, 1, CHUNK // 2)
    v = torch.cat([b & 15, b >> 4], dim=2).reshape(n, main // CHUNK, *[2] * 7)
    v = v.permute(*_FROM_BYTES).reshape(n, main)
    t = rows[:, main // 2 :]
    tail = torch.stack([t & 15, t >> 4], dim=2).reshape(n, k - main)
    return torch.cat([v, tail], dim=1)


def to_torch_int4pack(packed: torch.Tensor, inner_k_tiles: int = 8) -> torch.Tensor:
    """Our layout (on a CUDA device) -> torch's tile-packed int32 weight for
    ``aten._weight_int4pack_mm``: [N / 8, K / (inner_k_tiles * 16), 32, inner_k_tiles / 2]."""
    if inner_k_tiles not in INNER_K_TILES:
        raise ValueError(f"inner_k_tiles={inner_k_tiles}: allowed {INNER_K_TILES}")
    if not packed.is_cuda:
        raise ValueError(f"packed.device={packed.device}: torch's tile packing runs on CUDA")
    q = unpack(packed)
    pairs = (q[:, 0::2] << 4) | q[:, 1::2]  # torch's input: the even k in the high nibble
    return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)


def torch_int4pack_shape(tpacked: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight in torch's tile-packed format."""
    if tpacked.dim() != 4 or tpacked.dtype != torch.int32:
        raise ValueError(f"tpacked: expected torch's int32 4-d tile-packed weight, got "
                         f"{tpacked.dtype} {tuple(tpacked.shape)}")  # fmt: skip
    n_tiles, k_tiles, _, half_inner = tpacked.shape
    return n_tiles * 8, k_tiles * half_inner * 2 * 16


def from_torch_int4pack(tpacked: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """torch's packed weight -> our uint8 [N, K / 2] layout, once, at load time. Either device's
    packing: the tile-packed int32 tensor of ``_convert_weight_to_int4pack`` on CUDA, the blocked
    uint8 [N, K / 2] tensor of ``_convert_weight_to_int4pack_for_cpu`` on the CPU.

    Decodes through torch's own kernel for the device rather than its undocumented tile order:
    with unit scales and zeros of 8, ``x @ W.T`` returns the nibbles themselves, exactly (0..15
    are exact in bf16), for the rows of an identity ``x``, ``chunk`` rows at a time. Cost: one
    int4 GEMM of K x K x N (2 K^2 N flops at torch's int4 rate, which is slow for large M; paid
    once per weight); extra memory: a [chunk, K] identity slice and a [chunk, N] bf16 result
    alive at a time, plus the [N, K] uint8 nibbles before packing.
    """
    if tpacked.is_cuda:
        n, k = torch_int4pack_shape(tpacked)
        mm = torch.ops.aten._weight_int4pack_mm.default  # an overload: never routed to the tuner
    elif tpacked.dim() == 2 and tpacked.dtype == torch.uint8:
        n, k = tpacked.shape[0], 2 * tpacked.shape[1]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    else:
        raise ValueError(f"tpacked: expected torch's uint8 [N, K / 2] CPU packing, got "
                         f"{tpacked.dtype} {tuple(tpacked.shape)}")  # fmt: skip
    unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16, device=tpacked.device)
    unit = unit.expand(k // 32, n, 2).contiguous()
    q = torch.empty(n, k, dtype=torch.uint8, device=tpacked.device)
    for k0 in range(0, k, chunk):
        rows = min(chunk, k - k0)
        eye = torch.zeros(rows, k, dtype=torch.bfloat16, device=tpacked.device)
        eye.diagonal(k0).fill_(1)
        q[:, k0 : k0 + rows] = mm(eye, tpacked, 32, unit).T.to(torch.uint8)
    return pack(q)
