"""``tuner.torch.quantize_linear`` on the CPU: a small MLP's linear layers replaced by int4 and
FP8 ones served by the tuner, outputs within the formats' error, unsupported shapes left."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tuner.torch as tt
from tuner.candidates.triton_w4a16 import TritonW4A16
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.quant import fp8, int4, int4_torch
from tuner.quant.tolerance import (
    FP32_ACCUMULATE,
    excess,
    gemm_tolerance,
    unit_roundoff,
)
from tuner.serving import dispatcher as dispatch_module
from tuner.serving.dispatcher import Dispatcher
from tuner.serving.quantize import Fp8Linear, Int4Linear


@pytest.fixture(autouse=True)
def disp(cache_path, monkeypatch: pytest.MonkeyPatch) -> Dispatcher:
    d = Dispatcher(cache_path, mode="record")
    monkeypatch.setattr(dispatch_module, "_dispatcher", d)
    return d


def mlp() -> nn.Sequential:
    """Two layers the formats hold, and a 10-wide head neither does (N not a multiple of 16)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256), nn.Linear(256, 10))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.detach().float() - want.detach().float()).norm() / want.detach().float().norm()
    )


@pytest.mark.parametrize(("fmt", "layer", "bound"), [("int4", Int4Linear, 0.1),
                                                     ("fp8", Fp8Linear, 0.1)])  # fmt: skip
def test_mlp_quantized_close_to_float_and_layers_listed(fmt, layer, bound) -> None:
    model = mlp()
    x = torch.randn(4, 7, 256)
    want = model(x)
    q = tt.quantize_linear(mlp(), fmt)
    assert q.quantized_layers == ["0", "2"]
    assert list(q.quantized_skipped) == ["3"] and "N=10" in q.quantized_skipped["3"]
    assert isinstance(q[0], layer) and isinstance(q[2], layer) and type(q[3]) is nn.Linear
    got = q(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < bound
    assert rel_err(got, want) > 0  # the weights really are quantized


def test_int4_layer_is_exact_to_its_dequantized_weight() -> None:
    lin = mlp()[0]
    q = tt.quantize_linear(lin, "int4", group_size=64)
    assert isinstance(q, Int4Linear)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    wq, sz = int4.quantize(lin.weight.detach().bfloat16(), 64)
    w = int4.dequantize(wq, sz, 64)
    ref = x.float() @ w.T + lin.bias.detach().bfloat16().float()
    tol = gemm_tolerance(x, w, ref, operand_unit=unit_roundoff(torch.bfloat16),
                         accumulate_unit=FP32_ACCUMULATE, out_dtype=torch.bfloat16)  # fmt: skip
    assert excess(q(x), ref, 2 * tol) <= 1  # the bias is added after rounding: twice the bound


def test_int4_layer_weight_is_served_by_triton_w4a16_with_no_conversion(monkeypatch) -> None:
    """The layer packs with ``int4_torch.torch_pack``: our layout is known from the start, so
    the W4A16 kernel never decodes torch's packed weight (a decode here fails the test)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(int4, "from_torch_int4pack", lambda *_: pytest.fail("weight converted"))
    lin = nn.Linear(256, 64, bias=False)
    q = tt.quantize_linear(lin, "int4", group_size=64)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    key = GemmKey(m=2, n=64, k=256, **lowbit_fields("int4-g64"))
    source = TritonW4A16()
    run = source.build(key, source.candidates(key, "cpu")[0])
    got = run(x, q.packed_weight, q.scales_and_zeros)
    want = int4_torch.int4_mm(x, q.packed_weight, 64, q.scales_and_zeros)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_fp8_layer_is_exact_to_its_quantized_operands() -> None:
    lin = nn.Linear(128, 64, bias=False)
    q = tt.quantize_linear(lin, "fp8")
    x = torch.randn(3, 128)
    (xq, sx), (wq, sw) = fp8.quantize_rowwise(x), fp8.quantize_rowwise(lin.weight.detach())
    da, db = fp8.dequantize(xq, sx), fp8.dequantize(wq, sw)
    ref = da @ db.T
    tol = gemm_tolerance(da, db, ref, operand_unit=0.0, accumulate_unit=FP32_ACCUMULATE,
                         out_dtype=torch.bfloat16)  # fmt: skip
    assert excess(q(x), ref, tol) <= 1


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="fmt must be one of"):
        tt.quantize_linear(mlp(), "int8")
    with pytest.raises(ValueError, match="group_size=100"):
        tt.quantize_linear(mlp(), "int4", group_size=100)
    with pytest.raises(ValueError, match="module: fp8 needs"):
        tt.quantize_linear(nn.Linear(128, 10), "fp8")
    with pytest.raises(ValueError, match=r"group_size=64: int4 only \(fp8 scales are per row\)"):
        tt.quantize_linear(mlp(), "fp8", group_size=64)
    for group in (128.0, True, "128"):  # a size is an int, shown as given
        with pytest.raises(ValueError, match=rf"group_size={group!r}: must be an int"):
            tt.quantize_linear(mlp(), "int4", group_size=group)


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_quantized_layers_refuse_what_nn_linear_refuses_and_take_empty_batches(fmt) -> None:
    """An integer activation would come back truncated, and a wrong K would fail deep inside
    the op: both are refused naming the field. A batch of no rows (an expert that got no
    tokens) gives no rows, as ``nn.Linear`` does."""
    layer = tt.quantize_linear(nn.Linear(256, 64), fmt)
    with pytest.raises(ValueError, match=r"x\.dtype=torch\.int64: expected a floating-point"):
        layer(torch.ones(2, 256, dtype=torch.int64))
    with pytest.raises(
        ValueError, match=r"x\.shape=\(2, 128\): expected \[\.\.\., in_features=256\]"
    ):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match=r"x\.shape=\(\)"):
        layer(torch.tensor(1.0))
    empty = layer(torch.randn(0, 256))
    assert empty.shape == (0, 64) and empty.dtype == torch.float32
    assert layer(torch.randn(2, 0, 256)).shape == (2, 0, 64)


def test_int4_layers_torch_cannot_pack_here_are_skipped_with_the_reason(caplog) -> None:
    """Each layer is checked against its own K and its device's packing (N a multiple of 16
    on the CPU), before torch's packer could fail half-way through a model; each layer left
    as it was is logged."""
    model = nn.Sequential(nn.Linear(256, 96), nn.Linear(96, 64), nn.Linear(64, 24))
    with caplog.at_level("WARNING", logger="tuner.serving.quantize"):
        q = tt.quantize_linear(model, "int4", group_size=64)
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [
        "1 left as nn.Linear",
        "2 left as nn.Linear",
    ]
    assert q.quantized_layers == ["0"]
    assert q.quantized_skipped == {
        "1": "group_size=64: 64 must divide K=96",
        "2": "int4 packing on cpu needs N % 16 == 0 (N=24, K=64)",
    }
    assert q(torch.randn(3, 256)).shape == (3, 24)


def test_a_bad_group_size_leaves_the_model_untouched() -> None:
    model = mlp()
    with pytest.raises(ValueError, match=r"group_size=48: allowed \(32, 64, 128, 256\)"):
        tt.quantize_linear(model, "int4", group_size=48)
    assert all(type(m) is nn.Linear for m in model if not isinstance(m, nn.GELU))
