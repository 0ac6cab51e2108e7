"""What the dispatcher needs for low-bit GEMMs: call signatures, keys, and torch's own ops.

``tuner.scaled_mm`` takes ``torch._scaled_mm``'s arguments (FP8 operands, float32 scales,
tensorwise or rowwise); ``tuner.int4_linear`` takes an activation [..., K] and a weight in
torch's packed int4 format for its device (the tile-packed int32 tensor of
``_convert_weight_to_int4pack`` on CUDA, the [N, K / 2] uint8 of
``_convert_weight_to_int4pack_for_cpu`` on the CPU) with torch's ``scales_and_zeros``.

A signature holds everything that decides the runner, as for ``tuner.matmul``. Operands that
disagree (K, the scales' shapes and dtypes, the group size), or that torch's op on the device
would refuse (an activation dtype, another device's int4 packing, a rowwise scale_b not [1, N])
raise a ``ValueError`` naming the field before anything runs: torch's CPU int4 op does not
check its scales, and its errors name neither the argument nor the format. The field is named as
the caller named it: ``tuner.scaled_mm``'s and ``tuner.int4_linear``'s arguments by default,
aten's for the ops ``tuner.torch`` routes (``Int4Names``, ``ScaledMMNames``). A call that is valid
but outside the keys (f32 activations, fp8 output, ...) is served by torch's op as made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tuner.core.keys import DTYPE_NAMES, GemmKey, alignment, lowbit_fields, matrix_layout
from tuner.quant import fp8, int4, int4_torch
from tuner.quant.int4 import INT4_LINEAR_NAMES, Int4Names

FP8_NAMES = {dtype: f"fp8_{fmt}" for fmt, dtype in fp8.FORMATS.items()}


@dataclass(frozen=True)
class ScaledMMNames:
    """What ``check_scaled_mm``'s errors call the FP8 operands: by default ``tuner.scaled_mm``'s
    arguments. The scales are ``scale_a`` and ``scale_b`` in every signature (aten's too)."""

    a: str = "a"
    b: str = "b"


SCALED_MM_NAMES = ScaledMMNames()


class OperandError(ValueError, RuntimeError):
    """Operands that disagree: an error for the caller, where a call merely outside the keys
    (a plain ``ValueError`` from the key functions) goes to torch's op. Also a RuntimeError,
    what torch's ops raise for such operands: code that catches theirs catches ours."""


def check_operands(**operands: Any) -> None:
    """Why a call cannot be made of these operands, raised as torch's ops would: a TypeError
    naming the first that is not a tensor, a ValueError for a 0-d activation (``x``). Called
    where building a signature failed, so the hot path pays nothing for it."""
    for name, t in operands.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if name == "x" and t.dim() == 0:
            raise ValueError("x: expected an activation [..., K], got a 0-d tensor")


def scaled_mm_sig(a: Any, b: Any, scale_a: Any, scale_b: Any, out_dtype: Any, fast: bool) -> tuple:
    """What decides a ``_scaled_mm`` call's runner (bias and scale_result go to torch). The
    other operands' devices enter as one flag, "all on a's": that is all a runner may assume,
    and a flag is cheaper to hash and compare on every call than three devices. ``fast``'s type
    too: 1 == True, and only a bool is taken (a first call checks it)."""
    device = a.device
    return ("scaled_mm", a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype,
            scale_a.shape, scale_b.shape, scale_a.stride(), scale_b.stride(), scale_a.dtype,
            scale_b.dtype, out_dtype, type(fast), fast, device,
            b.device == device and scale_a.device == device and scale_b.device == device,
            a.data_ptr() % 16, b.data_ptr() % 16, a.requires_grad and torch.is_grad_enabled())  # fmt: skip


def int4_sig(x: Any, packed: Any, scales_and_zeros: Any, group_size: int) -> tuple:
    """What decides an ``int4_linear`` call's runner; ``x`` is the 2-D activation. The weight's
    devices enter as one flag, as in ``scaled_mm_sig``. On the CPU our own layout has torch's
    dtype and shape, so whether ``int4.pack`` made the weight enters too: a call with it is
    refused however many calls of the same shapes came before. The gradient flag last, as in
    every signature: the dispatcher reads it there."""
    device = x.device
    ours = packed.dtype is torch.uint8 and int4.made_by_pack(packed)
    return ("int4", x.shape, x.stride(), x.dtype, packed.shape, packed.stride(), packed.dtype,
            scales_and_zeros.shape, scales_and_zeros.stride(), scales_and_zeros.dtype,
            type(group_size), group_size, device,
            packed.device == device and scales_and_zeros.device == device,
            x.data_ptr() % 16, ours, x.requires_grad and torch.is_grad_enabled())  # fmt: skip


def group_int(group_size: Any, names: Int4Names = INT4_LINEAR_NAMES) -> int:
    """The int a group size of another type holds; ``OperandError`` naming the field unless
    it is one of the allowed sizes."""
    try:
        return int4.check_group(group_size, names.group_size)
    except ValueError as e:
        raise OperandError(str(e)) from e


def check_int4(
    x: Any, packed: Any, scales_and_zeros: Any, group_size: int,
    names: Int4Names = INT4_LINEAR_NAMES,
) -> tuple[int, int]:  # fmt: skip
    """The weight's (N, K); ``OperandError`` naming the field (as ``names`` has it) unless the
    activation, weight and scales agree."""
    try:
        int4_torch.check_activation(x, names)  # first: the scales' dtype is checked against x's
        n, k = int4_torch.check_packed(packed, x.device, names)
        if x.shape[-1] != k:
            raise ValueError(_k_mismatch(x, packed, k, names))
        int4.check_scales_and_zeros(
            scales_and_zeros, n, k, group_size, x.dtype, x.device, names=names
        )
    except ValueError as e:
        raise OperandError(str(e)) from e
    return n, k


def _k_mismatch(x: Any, packed: Any, k: int, names: Int4Names) -> str:
    """Which of x and the packed weight is wrong is the caller's to say: name both, and the
    likely slip of an unpacked [N, K] weight where the CPU's [N, K / 2] packing belongs."""
    xk, w = x.shape[-1], names.packed_w
    msg = (f"{names.x}.shape={tuple(x.shape)} has K={xk}, but {w}.shape={tuple(packed.shape)} "
           f"holds a weight of K={k}")  # fmt: skip
    if not x.is_cuda and packed.shape[-1] == xk:
        msg += (f"; either {names.x}'s K should be {k}, or {w} holds unpacked [N, K] values: "
                "pack them with aten._convert_weight_to_int4pack_for_cpu(w_int32, inner_k_tiles)")  # fmt: skip
    return msg


def check_scaled_mm(
    a: Any, b: Any, scale_a: Any, scale_b: Any, names: ScaledMMNames = SCALED_MM_NAMES
) -> bool:
    """Whether the scales are rowwise; ``OperandError`` naming the field (as ``names`` has it)
    unless the operands and their scales agree."""
    ab = f"{names.a}, {names.b}"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise OperandError(f"{ab}: expected [M, K] and [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")  # fmt: skip
    for name, t in ((names.a, a), (names.b, b)):
        # no scaled recipe of torch's takes these, and its error would blame the scales
        if t.dtype.itemsize > 1:
            raise OperandError(f"{name}.dtype={t.dtype}: _scaled_mm takes 8-bit float operands, "
                               f"one of {sorted(map(str, FP8_NAMES))}")  # fmt: skip
    for name, t in ((names.b, b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if t.device != a.device:  # a kernel would read another device's pointer
            raise OperandError(f"{name}.device={t.device}: must be {names.a}'s device ({a.device})")
    try:
        rowwise = fp8.check_scales(scale_a, scale_b, a.shape[0], b.shape[1], as_scaled_mm=True)
    except ValueError as e:
        raise OperandError(str(e)) from e
    if a.shape[1] == 0:  # no key: torch's op serves it (on the CPU, the dispatcher's zeros)
        raise ValueError(f"{ab}: K=0 ({tuple(a.shape)} and {tuple(b.shape)}): an empty product")
    return rowwise


def scaled_mm_key(
    a: Any, b: Any, scale_a: Any, scale_b: Any, out_dtype: Any, fast: bool,
    names: ScaledMMNames = SCALED_MM_NAMES,
) -> GemmKey:  # fmt: skip
    """The key of ``_scaled_mm(a, b, ...)``: a [M, K] row-major, b [K, N] column-major.
    ``names`` name the operands in the caller's errors (``check_scaled_mm``); why a valid call
    is outside the keys is a diagnostic of the tuner's (a stats row every caller of the
    signature shares) and keeps its own names."""
    rowwise = check_scaled_mm(a, b, scale_a, scale_b, names)
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_NAMES:
            raise ValueError(
                f"{name}.dtype={t.dtype}: must be one of {sorted(map(str, FP8_NAMES))}"
            )
    if (matrix_layout(a), matrix_layout(b)) != ("n", "t"):
        raise ValueError("layout: a must be row-major and b column-major, as _scaled_mm takes them")
    m, k = a.shape
    n = b.shape[1]
    out = DTYPE_NAMES.get(out_dtype if out_dtype is not None else a.dtype)
    if out is None:
        raise ValueError(f"out_dtype={out_dtype}: the tuner keys bf16, f16 and f32 outputs")
    spec = "fp8-rowwise" if rowwise else "fp8-tensorwise"
    fields = lowbit_fields(spec + "-fast" if fast else spec)
    return GemmKey(**{
        **fields, "m": m, "n": n, "k": k, "layout": "nt", "dtype": FP8_NAMES[a.dtype],
        "wdtype": FP8_NAMES[b.dtype], "out_dtype": out,
        "align": min(alignment(a, "n"), alignment(b, "t")),
    })  # fmt: skip


def int4_key(
    x: Any, packed: Any, scales_and_zeros: Any, group_size: int,
    names: Int4Names = INT4_LINEAR_NAMES,
) -> GemmKey:  # fmt: skip
    """The key of ``x [M, K] @ W[N, K].T`` with W int4 in groups of ``group_size``; ``names``
    as in ``scaled_mm_key``."""
    n, k = check_int4(x, packed, scales_and_zeros, group_size, names)
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, K], got {tuple(x.shape)}")
    act = DTYPE_NAMES.get(x.dtype)
    if act not in ("bf16", "f16"):
        raise ValueError(f"x.dtype={x.dtype}: int4 GEMMs take bf16 or f16 activations")
    if matrix_layout(x) != "n":
        raise ValueError("layout: x must be row-major")
    return GemmKey(**{
        **lowbit_fields(f"int4-g{group_size}"), "m": x.shape[0], "n": n, "k": k,
        "layout": "nt", "dtype": act, "out_dtype": act, "align": alignment(x, "n"),
    })  # fmt: skip
