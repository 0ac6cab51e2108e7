"""``tuner.torch.quantize_linear`` on the CPU: a small MLP's linear layers replaced by int4 and
FP8 ones served by the tuner, outputs within the formats' error, unsupported shapes left."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dropin_support import store_winners, triton_source
from torch import nn

import tuner.torch as tt
from tuner.cache import Store
from tuner.candidates.triton_w4a16 import TritonW4A16
from tuner.core.keys import GemmKey, lowbit_fields, parse_key
from tuner.quant import fp8, int4, int4_torch
from tuner.quant.tolerance import (
    FP32_ACCUMULATE,
    excess,
    gemm_tolerance,
    unit_roundoff,
)
from tuner.serving import dispatcher as dispatch_module
from tuner.serving.dispatcher import Dispatcher
from tuner.serving.quantize import Fp8Linear, Int4Linear, QuantizedLinear
from tuner.serving.warmup import warmup


@pytest.fixture(autouse=True)
def disp(cache_path, monkeypatch: pytest.MonkeyPatch) -> Dispatcher:
    d = Dispatcher(cache_path, mode="record")
    monkeypatch.setattr(dispatch_module, "_dispatcher", d)
    return d


def mlp() -> nn.Sequential:
    """Two layers the formats hold, and a 10-wide head neither does (N not a multiple of 16)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 256), nn.Linear(256, 10))


# the fp8 layers quantize activations rowwise: on the CPU, torch builds older than CI's refuse that
FP8_CPU_HOST = pytest.param("fp8", marks=pytest.mark.cpu_host)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.detach().float() - want.detach().float()).norm() / want.detach().float().norm()
    )


@pytest.mark.parametrize(("fmt", "layer", "bound"), [("int4", Int4Linear, 0.1),
                                                     pytest.param("fp8", Fp8Linear, 0.1,
                                                                  marks=pytest.mark.cpu_host)])  # fmt: skip
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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
    with pytest.raises(ValueError, match=r"pass 'int4' and group_size=64\)"):
        tt.quantize_linear(mlp(), "int4-g64")
    with pytest.raises(ValueError, match=r"pass 'fp8', whose scales are rowwise"):
        tt.quantize_linear(mlp(), "fp8-rowwise")
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
    """An integer activation would come back truncated, an FP8 one fail inside the activations'
    quantization, and a wrong K deep inside the op: each is refused naming the field. A batch
    of no rows (an expert that got no tokens) gives no rows, as ``nn.Linear`` does."""
    layer = tt.quantize_linear(nn.Linear(256, 64), fmt)
    with pytest.raises(ValueError, match=r"x\.dtype=torch\.int64: expected a floating-point"):
        layer(torch.ones(2, 256, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^x\.dtype=torch\.float8_e4m3fn: expected a floating-"
                       r"point activation, one of torch\.float16, .*torch\.float64$"):  # fmt: skip
        layer(torch.randn(2, 256).to(torch.float8_e4m3fn))  # nn.Linear refuses it too
    with pytest.raises(
        ValueError, match=r"x\.shape=\(2, 128\): expected \[\.\.\., in_features=256\]"
    ):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match=r"x\.shape=\(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(  # not the op's operand names (a, b, packed_w), which the caller never gave
        ValueError, match=r"^x\.device=meta: the layer's weights are on cpu; move x there, or "
    ):  # fmt: skip
        layer(torch.randn(2, 256, device="meta"))
    empty = layer(torch.randn(0, 256))
    assert empty.shape == (0, 64) and empty.dtype == torch.float32
    assert layer(torch.randn(2, 0, 256)).shape == (2, 0, 64)


@pytest.mark.cpu_host
def test_an_fp8_layer_gives_nan_for_a_row_holding_an_inf_and_leaves_other_rows_be() -> None:
    """What README says of FP8 layers: each activation row is quantized by its own largest
    magnitude, so a row holding an inf has an infinite scale (inf / inf: NaN), where
    ``nn.Linear`` gives +-inf; the other rows are untouched by it."""
    linear = nn.Linear(256, 64)
    x = torch.randn(2, 256)
    x[0, 3] = float("inf")
    y = tt.quantize_linear(linear, "fp8")(x)
    assert y[0].isnan().all() and not linear(x)[0].isnan().all()
    assert y[1].isfinite().all()


@pytest.mark.parametrize("fmt", ["int4", FP8_CPU_HOST])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_layers_take_activations_of_any_strides(fmt, dtype) -> None:
    """As nn.Linear does: a sequence's last token (``h[:, -1, :]``), every other row, a
    transposed activation, each as its contiguous copy."""
    layer = tt.quantize_linear(nn.Linear(256, 64), fmt)
    h = torch.randn(2, 5, 256, dtype=dtype)
    for x in (h[:, -1, :], h[0, ::2], h[0].t().contiguous().t()):
        assert not x.is_contiguous()
        torch.testing.assert_close(layer(x), layer(x.contiguous()), rtol=0, atol=0)


def test_int4_layers_torch_cannot_pack_here_are_skipped_with_the_reason(caplog) -> None:
    """Each layer is checked against its own K and its device's packing (N a multiple of 16
    on the CPU), before torch's packer could fail half-way through a model; each layer left
    as it was is logged."""
    model = nn.Sequential(nn.Linear(256, 96), nn.Linear(96, 64), nn.Linear(64, 24))
    with caplog.at_level("WARNING", logger="tuner.serving.quantize"):
        q = tt.quantize_linear(model, "int4", group_size=64)
    assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [
        "1 left as it was",
        "2 left as it was",
    ]
    assert q.quantized_layers == ["0"]
    assert q.quantized_skipped == {
        "1": "group_size=64: 64 must divide K=96 (group_size=32 fits this layer)",
        "2": "int4 packing on cpu needs N % 16 == 0 (N=24, K=64)",
    }
    assert q(torch.randn(3, 256)).shape == (3, 24)


def test_a_bad_group_size_leaves_the_model_untouched() -> None:
    model = mlp()
    with pytest.raises(ValueError, match=r"group_size=48: allowed \(32, 64, 128, 256\)"):
        tt.quantize_linear(model, "int4", group_size=48)
    assert all(type(m) is nn.Linear for m in model if not isinstance(m, nn.GELU))


@pytest.mark.parametrize("fmt", ["int4", FP8_CPU_HOST])
@pytest.mark.parametrize("cast", ["float", "half", "bfloat16", "to_f32"])
def test_a_dtype_cast_of_the_model_keeps_the_quantized_tensors(fmt, cast) -> None:
    """``model.half()`` and the like cast every floating tensor; the quantized layers keep theirs
    (an e4m3 weight cast to f16 is no longer one) and serve the cast model's activations."""
    model = tt.quantize_linear(mlp(), fmt)
    x = torch.randn(3, 256)
    want = model(x)
    layer = model[0]
    dtypes = {name: t.dtype for name, t in [*layer.named_buffers(), *layer.named_parameters()]}
    cast_model = model.to(torch.float32) if cast == "to_f32" else getattr(model, cast)()
    assert {
        name: t.dtype for name, t in [*layer.named_buffers(), *layer.named_parameters()]
    } == dtypes
    dtype = next(model[3].parameters()).dtype  # the plain head took the cast
    got = cast_model(x.to(dtype))
    assert got.dtype == dtype
    assert rel_err(got, want) < 0.05  # the same quantized weights; the head in another dtype


@pytest.mark.parametrize("fmt", ["int4", FP8_CPU_HOST])
def test_layers_their_parents_read_are_left_in_place(fmt) -> None:
    """torch's transformer layers read their linear children's weights themselves (their fused
    paths), and nn.MultiheadAttention its out_proj's (a subclass of nn.Linear): a quantized layer
    there would break them, so those stay, listed with the reason; the head is quantized."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(256, 4, 512, batch_first=True),
                          nn.Linear(256, 128)).eval()  # fmt: skip
    x = torch.randn(2, 5, 256)
    want = model(x)
    q = tt.quantize_linear(model, fmt)
    assert q.quantized_layers == ["1"]
    assert set(q.quantized_skipped) == {"0.self_attn.out_proj", "0.linear1", "0.linear2"}
    assert "TransformerEncoderLayer reads" in q.quantized_skipped["0.linear1"]
    assert "reads" in q.quantized_skipped["0.self_attn.out_proj"]
    assert rel_err(q(x), want) < 0.1
    with pytest.raises(ValueError, match=r"subclass of nn\.Linear"):
        tt.quantize_linear(model[0].self_attn.out_proj, "fp8")


def test_an_uninitialized_lazy_linear_is_left_with_why() -> None:
    """A subclass of ``nn.Linear``, left in place: its weight has no shape yet to check."""
    q = tt.quantize_linear(nn.Sequential(nn.Linear(256, 64), nn.LazyLinear(64)), "int4")
    assert q.quantized_layers == ["0"]
    assert "LazyLinear is a subclass of nn.Linear" in q.quantized_skipped["1"]


def test_int4_weights_on_the_meta_device_are_left_with_why() -> None:
    """torch's int4 packer reads the values a weight on the meta device has not: listed (or
    named, for a bare layer), not failed on inside torch."""
    meta = nn.Sequential(nn.Linear(256, 64, device="meta"))
    assert tt.quantize_linear(meta, "int4").quantized_skipped == {
        "0": "int4 packing needs the weight's values, and it is on the meta device"
    }
    with pytest.raises(ValueError, match=r"^module: int4 packing needs the weight's values"):
        tt.quantize_linear(nn.Linear(256, 64, device="meta"), "int4")


@pytest.mark.parametrize("fmt", ["int4", FP8_CPU_HOST])
def test_a_quantized_model_moved_to_the_meta_device_gives_its_shapes(fmt) -> None:
    """A move to the meta device (shape inference, freeing memory) moves the packing as it is
    (there are no values to repack), and ``to_empty`` makes the packing back for a state dict."""
    model = mlp()
    tt.quantize_linear(model, fmt)
    x = torch.randn(3, 256)
    want, saved = model(x), model.state_dict()
    model.to("meta")
    assert all(t.is_meta for t in model.state_dict().values())
    assert model(torch.randn(3, 256, device="meta")).shape == (3, 10)
    model.to_empty(device="cpu")  # and back, as a model made on meta is loaded
    model.load_state_dict(saved)
    assert torch.equal(model(x), want)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_empty_layers_are_left_as_nn_linear_serves_them(fmt) -> None:
    """No rows or no columns to quantize (the formats' quantizers fail on either): listed with
    why, and served as ``nn.Linear`` serves them (a bias alone for K = 0)."""
    model = nn.Sequential(nn.Linear(0, 64), nn.Linear(64, 0))
    q = tt.quantize_linear(model, fmt)
    assert q.quantized_skipped == {
        "0": "the weight is empty (N=64, K=0): nothing to quantize",
        "1": "the weight is empty (N=0, K=64): nothing to quantize",
    }
    torch.testing.assert_close(q[0](torch.randn(3, 0)), q[0].bias.expand(3, 64))


def test_nothing_to_quantize_is_said_and_earlier_layers_stay_listed(caplog) -> None:
    with caplog.at_level("WARNING"):
        assert tt.quantize_linear(nn.Sequential(nn.ReLU()), "int4").quantized_layers == []
    assert "no nn.Linear layer in Sequential" in caplog.text
    model = tt.quantize_linear(mlp(), "int4")
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = tt.quantize_linear(model, "fp8")
    assert again.quantized_layers == ["0", "2"]  # still int4: they are no nn.Linear any more
    assert isinstance(again[0], Int4Linear) and isinstance(again[3], nn.Linear)
    with pytest.raises(TypeError, match=r"module: expected a torch\.nn\.Module, got Tensor"):
        tt.quantize_linear(torch.zeros(2, 2), "int4")


@pytest.mark.parametrize("fmt", ["int4", FP8_CPU_HOST])
def test_a_layer_reached_by_two_names_is_quantized_once_for_both(fmt) -> None:
    """A shared (tied) layer: every name gets the same quantized layer, so no name keeps
    running the float one (named_modules() gives a module under its first name only)."""
    torch.manual_seed(0)
    shared = nn.Linear(256, 256)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 256)
    want = model(x)
    q = tt.quantize_linear(model, fmt)
    assert q.quantized_layers == ["0", "2"] and q.quantized_skipped == {}
    assert q[0] is q[2] and isinstance(q[0], QuantizedLinear)
    assert 0 < rel_err(q(x), want) < 0.1
    assert tt.quantize_linear(q, fmt).quantized_layers == ["0", "2"]  # listed by both names again


def test_a_shared_layer_one_parent_reads_is_left_at_every_name_with_why() -> None:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(256, 4, 512, batch_first=True)
    model = nn.Module()
    model.enc, model.proj = encoder, encoder.linear1
    q = tt.quantize_linear(model, "int4")
    assert type(q.proj) is nn.Linear and q.proj is q.enc.linear1
    assert "TransformerEncoderLayer reads" in q.quantized_skipped["enc.linear1"]
    assert q.quantized_skipped["proj"].startswith("shared with enc.linear1: its parent")


@pytest.mark.parametrize("fmt", ["int4", FP8_CPU_HOST])
def test_a_quantized_model_compiles_whole(fmt) -> None:
    """torch.compile(fullgraph=True) takes the quantized layers as custom ops (tuner::int4_linear,
    tuner::scaled_mm) and gives what the eager model gives."""
    torch.manual_seed(0)
    model = tt.quantize_linear(
        nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 256)), fmt
    )
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for x in (torch.randn(3, 256), torch.randn(2, 5, 256)):  # a batch of sequences too
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def test_a_numpy_group_size_is_taken_as_an_int_and_compiles() -> None:
    """A NumPy int is a group size as a Python one is (``int4.check_group``): the layer keeps
    it as an int, which the custom op ``tuner::int4_linear`` takes under torch.compile."""
    model = tt.quantize_linear(nn.Sequential(nn.Linear(256, 128)), "int4", group_size=np.int64(64))
    assert type(model[0].group_size) is int
    x = torch.randn(3, 256)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@pytest.mark.cpu_host
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_a_quantized_layer_in_an_enabled_block_is_served_by_the_blocks_dispatcher(
    fmt: str, disp: Dispatcher, tmp_path
) -> None:
    """``tt.enabled(dispatcher=block)`` routes torch's ops through ``block``, and quantized layers
    called in it too: the block's winners, stats and cache (the record-mode miss here), not the
    process-wide dispatcher's; outside any block, the process-wide one serves them."""
    layer = tt.quantize_linear(nn.Linear(256, 64), fmt)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    block = Dispatcher(tmp_path / "block.db", mode="record")
    with tt.enabled(dispatcher=block):
        layer(x)
    (key,) = [parse_key(m["key"]) for m in Store(block.store_path).misses()]
    assert not disp.resolutions
    store_winners(block, [key], triton=True)
    block.set_mode("lookup")
    assert warmup(progress=False, dispatcher=block, fetch=False).loaded == 1
    with tt.enabled(dispatcher=block):
        got = layer(x)
    (hit,) = [r for r in tt.stats(block).rows if r.kind == "hit"]
    assert hit.calls == 1 and hit.candidate.startswith(triton_source(key)) and not hit.by_torch
    torch.testing.assert_close(got, layer(x), rtol=2e-2, atol=2e-2)  # outside: torch's op
    assert [r.kind for r in disp.resolutions.values()] == ["miss"]
    assert [m["key"] for m in Store(disp.store_path).misses()] == [str(key)]


HAS_GPU = torch.cuda.is_available()


def test_an_int4_state_dict_loads_into_a_fresh_quantized_model() -> None:
    model = tt.quantize_linear(mlp(), "int4")
    x = torch.randn(3, 256)
    fresh = tt.quantize_linear(nn.Sequential(nn.Linear(256, 128)), "int4")
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if k.startswith("0.")})
    assert torch.equal(fresh(x), model[0](x))


@pytest.mark.cpu_host
def test_an_int4_model_quantized_and_loaded_under_inference_mode_serves_the_loaded_weights(
    monkeypatch,
) -> None:
    """Quantizing under ``torch.inference_mode()`` raised (its tensors have no version counter);
    and a state dict loaded there in place must not leave a kernel reading what our layout was
    made of before (no version tells of the write)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    key = GemmKey(m=2, n=64, k=256, **lowbit_fields("int4-g64"))
    source = TritonW4A16()
    run = source.build(key, source.candidates(key, "cpu")[0])
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        layer = tt.quantize_linear(nn.Linear(256, 64, bias=False), "int4", group_size=64)
        run(x, layer.packed_weight, layer.scales_and_zeros)  # our layout of the first weights
        other = tt.quantize_linear(nn.Linear(256, 64, bias=False), "int4", group_size=64)
        layer.load_state_dict(other.state_dict())
        got = run(x, layer.packed_weight, layer.scales_and_zeros)
        want = int4_torch.int4_mm(x, other.packed_weight, 64, other.scales_and_zeros)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(HAS_GPU, reason="a host without a GPU")
def test_a_cuda_int4_packing_on_a_host_without_a_gpu_is_refused_by_name() -> None:
    model = tt.quantize_linear(nn.Sequential(nn.Linear(256, 128)), "int4")
    saved = model.state_dict()
    saved["0.packed_weight"] = torch.zeros(16, 4, 32, 4, dtype=torch.int32)  # CUDA's tiles
    with pytest.raises(ValueError, match=r"0\.packed_weight: .*packing for CUDA"):
        model.load_state_dict(saved)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("there", ["cuda", "cpu"])
def test_an_int4_model_moved_or_loaded_across_devices_is_repacked_for_them(there) -> None:
    """torch packs int4 its own way on each kind of device: a model quantized on one and moved
    to the other, or given the other's state dict, serves the same values."""
    here = "cpu" if there == "cuda" else "cuda"
    x = torch.randn(3, 256)
    on_there = tt.quantize_linear(mlp().to(there), "int4")
    want = on_there(x.to(there)).cpu()
    on_here = tt.quantize_linear(mlp().to(here), "int4")
    saved = on_here.state_dict()
    moved = on_here.to(there)
    assert moved[0].packed_weight.dtype == on_there[0].packed_weight.dtype
    got = moved(x.to(there))
    assert rel_err(got.cpu(), want) < 0.02  # quantized on another device: a rounding apart
    loaded = tt.quantize_linear(mlp().to(there), "int4")
    loaded.load_state_dict(saved)
    assert torch.equal(loaded(x.to(there)), got)  # the same values, packed for ``there``


@pytest.mark.cpu_host
def test_a_quantized_model_run_with_autograd_on_says_why_it_is_not_tuned(disp, caplog) -> None:
    """Forgetting torch.no_grad() serves torch's int4 op: a warning says why, once, not left to
    stats()."""
    q = tt.quantize_linear(mlp(), "int4")
    x = torch.randn(3, 256, requires_grad=True)
    q(x)
    q(x)
    said = [r.getMessage() for r in caplog.records if "needs a gradient" in r.getMessage()]
    assert len(said) == 1 and "dtype=int4" in said[0] and "torch.no_grad()" in said[0]
    assert {r.kind for r in disp.resolutions.values()} == {"default"}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_an_int4_layer_the_cpu_cannot_pack_stays_whole_on_the_gpu() -> None:
    """N = 24 packs on CUDA (8 rows a tile), not on the CPU (blocks of 16): the move is
    refused before anything moves, and the layer serves on as it was."""
    model = tt.quantize_linear(nn.Sequential(nn.Linear(256, 24)).cuda(), "int4")
    x = torch.randn(3, 256, device="cuda")
    want = model(x)
    with pytest.raises(
        ValueError, match=r"N=24: torch's int4 packing on cpu needs a multiple of 16"
    ):
        model.cpu()
    assert all(t.is_cuda for t in [*model.buffers(), *model.parameters()])
    assert torch.equal(model(x), want)
