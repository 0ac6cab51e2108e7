"""FP8 (e4m3 / e5m2) quantization with the scales ``torch._scaled_mm`` takes.

``x ~= q * scale``: the scale is the *dequantization* factor, float32, and ``_scaled_mm`` (and our
kernel) multiplies it into the product. Tensorwise: one scale, a 0-d tensor. Rowwise: one scale
per row, [rows, 1]; for the weight operand (b = w.T of an [N, K] weight) ``_scaled_mm`` wants it
as [1, N], which is ``scale.T`` (a view). The amax maps to the format's largest finite value.
"""

from __future__ import annotations

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_DTYPES = tuple(FORMATS.values())
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale, not a division by zero


def fp8_dtype(fmt: str) -> torch.dtype:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: allowed {sorted(FORMATS)}")
    return FORMATS[fmt]


def _quantize(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    fmax = torch.finfo(dtype).max
    scale = amax.float().clamp(min=MIN_AMAX) / fmax
    q = (x.float() / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def quantize_tensorwise(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with one float32 0-d scale for the whole tensor."""
    return _quantize(x, x.abs().amax(), fp8_dtype(fmt))


def quantize_rowwise(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with a float32 [rows, 1] scale per row of a 2-d ``x``: on a GPU one fused
    kernel (``fp8_rows``), elsewhere ``quantize_rowwise_torch``, the same values."""
    if x.is_cuda:
        from tuner.quant import fp8_rows  # Triton: imported where it can run

        dtype = fp8_dtype(fmt)
        if fp8_rows.takes(x, dtype):
            return fp8_rows.quantize(x, dtype, MIN_AMAX)
    return quantize_rowwise_torch(x, fmt)


def quantize_rowwise_torch(x: torch.Tensor, fmt: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise`` by torch's ops on any device (the fused kernel's reference)."""
    if x.dim() != 2:
        raise ValueError(f"x.shape={tuple(x.shape)}: rowwise quantization takes a 2-d tensor")
    return _quantize(x, x.abs().amax(dim=1, keepdim=True), fp8_dtype(fmt))


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (scale 0-d or [rows, 1])."""
    return q.float() * scale


def check_scales(
    scale_a: torch.Tensor, scale_b: torch.Tensor, m: int, n: int, *, as_scaled_mm: bool = False
) -> bool:
    """ValueError naming the field unless both scales are float32 and either both tensorwise
    (one element) or rowwise (scale_a [M, 1], scale_b [N, 1] or [1, N]). Returns rowwise.

    ``as_scaled_mm``: rowwise only as ``torch._scaled_mm`` takes it (scale_b [1, N], both
    contiguous), so that a call the check passes also runs on torch's op."""
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32:
            raise ValueError(f"{name}.dtype={s.dtype}: must be torch.float32")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return False
    if tuple(scale_a.shape) != (m, 1):
        if scale_a.numel() == 1:  # tensorwise scale_a: scale_b is the odd one
            raise ValueError(f"scale_b.shape={tuple(scale_b.shape)}: expected one element, as "
                             f"scale_a is tensorwise (one element); rowwise takes scale_a ({m}, 1)")  # fmt: skip
        raise ValueError(f"scale_a.shape={tuple(scale_a.shape)}: expected one element or ({m}, 1)")
    if as_scaled_mm:
        if tuple(scale_b.shape) != (1, n):
            raise ValueError(
                f"scale_b.shape={tuple(scale_b.shape)}: expected (1, {n}) with a rowwise scale_a, "
                f"as torch._scaled_mm takes it (an [N, 1] scale's .t())"
            )
        for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
            if not s.is_contiguous():
                raise ValueError(f"{name}: must be contiguous for rowwise scaling, as "
                                 f"torch._scaled_mm takes it, got strides {s.stride()}")  # fmt: skip
    elif tuple(scale_b.shape) not in ((n, 1), (1, n)):
        raise ValueError(
            f"scale_b.shape={tuple(scale_b.shape)}: expected ({n}, 1) or (1, {n}) with a rowwise "
            "scale_a"
        )
    return True
