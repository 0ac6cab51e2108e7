"""torch's packed INT4 weights on each device, and our layout of them, made once per weight.

torch packs an [N, K] int4 weight differently per device: the int32 tile-packed tensor of
``_convert_weight_to_int4pack`` on CUDA, a blocked uint8 [N, K / 2] tensor of
``_convert_weight_to_int4pack_for_cpu`` on the CPU (not our layout, though its shape is). Both
run through their device's ``_weight_int4pack_mm``. A kernel that reads our layout
(``tuner.quant.int4``) takes ``ours(packed)``: it is worked out from torch's tensor once and
memoised per tensor (and per in-place version of it), so a served runner does not repack per
call and runners of several keys (M) sharing a weight share one copy: N * K / 2 extra bytes
per weight. ``torch_pack`` records our layout as it packs, so weights packed here (problem
inputs, quantized models) never need the conversion.
"""

from __future__ import annotations

import torch

from tuner.core.keys import INT4_CPU_N_BLOCK, INT4_N_TILE
from tuner.core.tensor_memo import TensorMemo
from tuner.quant import int4

_OURS: TensorMemo[torch.Tensor] = TensorMemo(int4.from_torch_int4pack)


def inner_k_tiles(k: int) -> int:
    """The largest of torch's inner K tiles (8, 4, 2) whose 16-wide tiles divide K."""
    for tiles in sorted(int4.INNER_K_TILES, reverse=True):
        if k % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"K={k}: torch's int4 packing needs a multiple of 32")


def n_multiple(device: torch.device) -> int:
    """What N must be a multiple of for torch's int4 packing on ``device``: 8 output rows per
    tile on CUDA, blocks of 16 on the CPU."""
    return INT4_N_TILE if device.type == "cuda" else INT4_CPU_N_BLOCK


def cannot_pack(n: int, device_kind: str) -> str | None:
    """Why torch's int4 packing on a ``device_kind`` device ("cuda", "cpu") cannot hold a
    weight of ``n`` output rows, or None: asked before a run, so a problem that cannot run
    here is said at its start, not after the others have been tuned."""
    multiple = n_multiple(torch.device(device_kind))
    if n % multiple:
        return f"N={n}: torch's int4 packing on {device_kind} needs a multiple of {multiple}"
    return None


def torch_pack(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 on a device -> torch's packed weight for that device; ValueError
    naming N or K where torch's packing cannot hold the shape (before torch fails inside)."""
    if why := cannot_pack(q.shape[0], q.device.type):
        raise ValueError(why)
    ours = int4.pack(q)
    tiles = inner_k_tiles(q.shape[1])
    if q.is_cuda:
        packed = int4.to_torch_int4pack(ours, tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)
    _OURS.put(packed, ours)
    return packed


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of torch's packed weight (either device's format)."""
    if packed.dim() == 2 and packed.dtype == torch.uint8:
        return packed.shape[0], packed.shape[1] * 2
    return int4.torch_int4pack_shape(packed)


# what torch's int4 op takes on a device type (off CUDA: the CPU op, as ``int4_mm`` picks it)
_CPU_FORMAT = "uint8 [N, K / 2] from aten._convert_weight_to_int4pack_for_cpu"
_CUDA_FORMAT = (
    "int32 [N / 8, K / (inner_k_tiles * 16), 32, inner_k_tiles / 2] tile-packed weight from "
    "aten._convert_weight_to_int4pack"
)
_CPU_ACTS = (torch.bfloat16, torch.float16, torch.float32)  # _weight_int4pack_mm_for_cpu's
# torch's CUDA op takes bf16 only, and as every INT4 key's baseline it runs before (and in place
# of) any tuned kernel: an f16 x on CUDA would only reach torch's own error
_CUDA_ACTS = (torch.bfloat16,)


def check_activation(x: torch.Tensor, names: int4.Int4Names = int4.INT4_LINEAR_NAMES) -> None:
    """ValueError naming ``x`` (as ``names`` has it) unless torch's int4 op on its device takes
    it: a dtype it computes in, contiguous (the op reads rows as stored, and refuses other
    strides)."""
    name = names.x
    allowed = _CUDA_ACTS if x.is_cuda else _CPU_ACTS
    if x.dtype not in allowed:
        cast = f"; cast {name} and {names.scales_and_zeros} to torch.bfloat16" if x.is_cuda else ""
        raise ValueError(f"{name}.dtype={x.dtype}: allowed on {x.device.type}: "
                         f"{', '.join(map(str, allowed))}{cast}")  # fmt: skip
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got shape {tuple(x.shape)} strides "
                         f"{x.stride()}; pass {name}.contiguous()")  # fmt: skip


def check_packed(
    packed: torch.Tensor, device: torch.device, names: int4.Int4Names = int4.INT4_LINEAR_NAMES
) -> tuple[int, int]:
    """(N, K) of torch's packed weight for ``device`` (where the op runs), or a ValueError naming
    the weight (``names.packed_w``), its dtype, shape and device and the format expected there:
    the devices' packings differ, and torch's own errors name neither (the CPU op's for N not a
    multiple of 16 is "Unsupported n block size")."""
    name = names.packed_w
    fmt = _CUDA_FORMAT if device.type == "cuda" else _CPU_FORMAT
    got = f"got {packed.dtype} {tuple(packed.shape)} on {packed.device}"
    if packed.device != device:
        raise ValueError(
            f"{name}.device={packed.device}: must be {names.x}'s device ({device}); {got}"
        )
    if device.type == "cuda":
        ok = packed.dtype == torch.int32 and packed.dim() == 4 and packed.shape[2] == 32
        ok = ok and packed.shape[3] * 2 in int4.INNER_K_TILES
    else:
        ok = packed.dtype == torch.uint8 and packed.dim() == 2
    if not ok:
        raise ValueError(f"{name}: expected torch's {fmt} on {device.type}, {got}")
    if int4.made_by_pack(packed):
        raise ValueError(f"{name}: is tuner's own layout (tuner.quant.int4.pack), not torch's "
                         f"{fmt}; pack the values with tuner.quant.int4_torch.torch_pack")  # fmt: skip
    if not packed.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, as torch packs it (a transposed or sliced "
                         f"view is another layout), got strides {packed.stride()}")  # fmt: skip
    n, k = packed_shape(packed)
    if n % n_multiple(device):
        raise ValueError(f"{name}.shape={tuple(packed.shape)}: N={n}; torch's int4 packing on "
                         f"{device.type} needs N a multiple of {n_multiple(device)}")  # fmt: skip
    return n, k


def int4_mm(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """torch's int4 GEMM for the weight's device: ``x @ dequant(W).T``."""
    op = (
        torch.ops.aten._weight_int4pack_mm
        if packed.is_cuda
        else torch.ops.aten._weight_int4pack_mm_for_cpu
    )
    return op(x, packed, group_size, scales_and_zeros)


def ours(packed: torch.Tensor) -> torch.Tensor:
    """Our uint8 [N, K / 2] layout of torch's packed weight, memoised per tensor."""
    return _OURS(packed)


def nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The [N, K] values 0..15 of torch's packed weight."""
    return int4.unpack(ours(packed))
