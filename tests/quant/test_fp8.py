"""FP8 quantization: scales' shapes and meaning, error within the format's rounding, the errors
on bad scales; on a GPU, torch._scaled_mm takes the scales as they come."""

from __future__ import annotations

import pytest
import torch

from tuner.quant import fp8
from tuner.quant.tolerance import FP8_TENSOR_CORE_ACCUMULATE, excess, gemm_tolerance


def _bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest: half an ulp relative for normals, half the subnormal spacing else."""
    fi = torch.finfo(dtype)
    return fi.eps / 2 * x.abs() + scale * fi.smallest_normal * fi.eps / 2 + 1e-12


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rowwise_scales_map_each_rows_amax_to_the_largest_value(fmt: str) -> None:
    x = torch.randn(8, 64) * torch.logspace(-3, 3, 8)[:, None]
    q, scale = fp8.quantize_rowwise(x, fmt)
    dtype = fp8.fp8_dtype(fmt)
    assert q.dtype == dtype and scale.shape == (8, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((8,), torch.finfo(dtype).max))
    assert ((fp8.dequantize(q, scale) - x).abs() <= _bound(x, scale, dtype)).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_tensorwise_scale_is_one_float(fmt: str) -> None:
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    q, scale = fp8.quantize_tensorwise(x, fmt)
    assert scale.shape == () and scale.dtype == torch.float32
    assert ((fp8.dequantize(q, scale) - x.float()).abs() <= _bound(x.float(), scale, q.dtype)).all()


def test_an_all_zero_row_stays_finite() -> None:
    q, scale = fp8.quantize_rowwise(torch.zeros(2, 16))
    assert torch.isfinite(scale).all() and torch.equal(q.float(), torch.zeros(2, 16))


def test_bad_scales_name_the_field() -> None:
    one = torch.ones((), dtype=torch.float32)
    with pytest.raises(ValueError, match="fmt='e3m4'"):
        fp8.quantize_tensorwise(torch.ones(2), "e3m4")
    with pytest.raises(ValueError, match=r"scale_a\.dtype"):
        fp8.check_scales(one.half(), one, 4, 8)
    with pytest.raises(ValueError, match=r"scale_a\.shape"):
        fp8.check_scales(torch.ones(8, 1), torch.ones(8, 1), 4, 8)
    with pytest.raises(ValueError, match=r"scale_b\.shape"):
        fp8.check_scales(torch.ones(4, 1), torch.ones(4, 2), 4, 8)
    assert fp8.check_scales(one, one, 4, 8) is False
    assert fp8.check_scales(torch.ones(4, 1), torch.ones(1, 8), 4, 8) is True
    assert fp8.check_scales(torch.ones(4, 1), torch.ones(8, 1), 4, 8) is True  # our kernels'


def test_scales_as_scaled_mm_takes_them() -> None:
    """``as_scaled_mm``: a rowwise scale_b only as torch._scaled_mm takes it, (1, N) and
    contiguous, the shape named in the message (an (N, 1) scale_b is refused by torch)."""
    rows = torch.ones(4, 1)
    assert fp8.check_scales(rows, torch.ones(1, 8), 4, 8, as_scaled_mm=True) is True
    assert fp8.check_scales(rows, torch.ones(8, 1).t(), 4, 8, as_scaled_mm=True) is True
    with pytest.raises(ValueError, match=r"scale_b\.shape=\(8, 1\): expected \(1, 8\) with"):
        fp8.check_scales(rows, torch.ones(8, 1), 4, 8, as_scaled_mm=True)
    with pytest.raises(ValueError, match=r"scale_b: must be contiguous .* strides \(16, 2\)"):
        fp8.check_scales(rows, torch.ones(1, 16)[:, ::2], 4, 8, as_scaled_mm=True)
    with pytest.raises(ValueError, match=r"scale_a: must be contiguous .* strides \(2, 1\)"):
        fp8.check_scales(torch.ones(4, 2)[:, :1], torch.ones(1, 8), 4, 8, as_scaled_mm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rowwise", [True, False])
def test_scaled_mm_takes_these_scales(rowwise: bool) -> None:
    x = torch.randn(32, 256, device="cuda")
    w = torch.randn(64, 256, device="cuda")
    quant = fp8.quantize_rowwise if rowwise else fp8.quantize_tensorwise
    (a, sa), (b, sb) = quant(x), quant(w)
    out = torch._scaled_mm(a, b.T, sa, sb.T if rowwise else sb, out_dtype=torch.bfloat16)
    da, db = fp8.dequantize(a, sa), fp8.dequantize(b, sb)
    ref = da @ db.T
    tol = gemm_tolerance(da, db, ref, operand_unit=0.0,
                         accumulate_unit=FP8_TENSOR_CORE_ACCUMULATE, out_dtype=torch.bfloat16)  # fmt: skip
    assert excess(out, ref, tol) <= 1
