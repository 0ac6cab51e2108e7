"""``tuner.scaled_mm`` and ``tuner.int4_linear`` on the CPU: torch's results, keys with the
low-bit fields recorded on a miss, bad input refused, and the drop-in routing torch's ops."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
from dropin_support import store_winners, triton_source

import tuner
import tuner.torch as tt
from tuner.cache import Store
from tuner.core.keys import GemmKey, parse_key
from tuner.measure import samples
from tuner.quant import fp8, int4, int4_torch
from tuner.serving import dispatcher as dispatch_module
from tuner.serving.dispatcher import Dispatcher
from tuner.serving.warmup import warmup

N, K, GROUP = 64, 256, 128
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture
def disp(cache_path, monkeypatch: pytest.MonkeyPatch) -> Dispatcher:
    """The process dispatcher, in record mode on a fresh cache."""
    d = Dispatcher(cache_path, mode="record")
    monkeypatch.setattr(dispatch_module, "_dispatcher", d)
    return d


def int4_weight(
    dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q, sz = int4.quantize(torch.randn(N, K, dtype=dtype, device=device) * 0.05, GROUP)
    return int4_torch.torch_pack(q), sz


def fp8_operands(m: int, rowwise: bool, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    torch.manual_seed(1)
    x, w = torch.randn(m, K, device=device), torch.randn(N, K, device=device)
    quant = fp8.quantize_rowwise if rowwise else fp8.quantize_tensorwise
    (a, sa), (b, sb) = quant(x), quant(w)
    return a, b.t(), sa, sb.t() if rowwise else sb


def recorded(d: Dispatcher) -> list[GemmKey]:
    keys = [parse_key(m["key"]) for m in Store(d.store_path).misses()]
    assert all(isinstance(k, GemmKey) for k in keys)
    return keys  # type: ignore[return-value]


@pytest.mark.cpu_host
def test_int4_linear_is_torchs_int4_op_and_records_its_key(disp: Dispatcher) -> None:
    packed, sz = int4_weight()
    x = torch.randn(3, 5, K, dtype=torch.bfloat16)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(15, K), packed, GROUP, sz)
    for _ in range(2):
        got = tuner.int4_linear(x, packed, sz, GROUP)
        assert got.shape == (3, 5, N)
        torch.testing.assert_close(got.reshape(15, N), want, rtol=0, atol=0)
    (key,) = recorded(disp)
    assert (key.m, key.n, key.k, key.layout, key.dtype) == (15, N, K, "nt", "bf16")
    assert (key.wdtype, key.group) == ("int4", GROUP)
    assert parse_key(str(key)) == key


@pytest.mark.cpu_host
def test_int4_linear_takes_a_weight_packed_under_inference_mode(disp: Dispatcher) -> None:
    """A model loaded under ``torch.inference_mode()`` holds inference tensors, which have no
    version counter: the check of whether ``int4.pack`` made the weight read one and raised."""
    q, sz = int4.quantize(torch.randn(N, K, dtype=torch.bfloat16) * 0.05, GROUP)
    with torch.inference_mode():
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        x = torch.randn(3, K, dtype=torch.bfloat16)
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
        torch.testing.assert_close(tuner.int4_linear(x, packed, sz, GROUP), want, rtol=0, atol=0)


@pytest.mark.cpu_host
def test_an_int4_call_needing_a_gradient_is_torchs_by_policy(
    disp: Dispatcher, caplog: pytest.LogCaptureFixture
) -> None:
    """An int4 call whose activation needs a gradient is torch's by policy, whether or not
    ``int4.pack`` made the weight: no miss is recorded, as a tuned kernel has no backward. The
    warning says so apart from plain GEMMs, and truly: torch's int4 op has no backward either."""
    tuner.matmul(torch.randn(3, K, requires_grad=True), torch.randn(K, N))
    packed, sz = int4_weight()
    x = torch.randn(3, K, dtype=torch.bfloat16, requires_grad=True)
    tuner.int4_linear(x, packed, sz, GROUP)
    assert [r.kind for r in disp.resolutions.values()] == ["default", "default"]
    assert not recorded(disp)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2 and "a tuned kernel has no backward" in said[0]
    assert "every such low-bit gemm call (neither it nor a tuned kernel" in said[1]


@pytest.mark.cpu_host
@pytest.mark.parametrize(("rowwise", "fast"), [(True, False), (False, False), (True, True)])
def test_scaled_mm_is_torchs_and_keys_scales_and_accumulation(
    disp: Dispatcher, rowwise: bool, fast: bool
) -> None:
    a, b, sa, sb = fp8_operands(8, rowwise)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    got = tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (key,) = recorded(disp)
    assert (key.m, key.n, key.k, key.dtype, key.wdtype) == (8, N, K, "fp8_e4m3", "fp8_e4m3")
    assert key.scale == ("row" if rowwise else "tensor")
    assert key.accum == ("fast" if fast else "f32")


def test_scaled_mm_with_bias_is_torchs(disp: Dispatcher) -> None:
    a, b, sa, sb = fp8_operands(4, False)
    bias = torch.randn(N, dtype=torch.bfloat16)
    want = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    got = tuner.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_scaled_mm_into_out_is_torchs_routed_or_not(disp: Dispatcher) -> None:
    """``out=`` is torch's call as made, through ``tuner.scaled_mm`` and under the drop-in."""
    a, b, sa, sb = fp8_operands(4, False)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    out = torch.empty(4, N, dtype=torch.bfloat16)
    assert tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.zero_()
    with tt.enabled(dispatcher=disp):
        assert torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, out=out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.cpu_host
@pytest.mark.parametrize("fast", [None, 1, np.False_])
def test_a_use_fast_accum_that_is_not_a_bool_raises_torchs_type_error(
    disp: Dispatcher, fast: object
) -> None:
    """Even after a call with the bool it equals (1 == True hashes alike)."""
    a, b, sa, sb = fp8_operands(4, False)
    with pytest.raises(TypeError) as torchs:
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=bool(fast))
    message = re.escape(str(torchs.value))
    with pytest.raises(TypeError, match=f"^{message}$"):
        tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    with tt.enabled(dispatcher=disp), pytest.raises(TypeError, match=f"^{message}$"):
        torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    assert len(recorded(disp)) == 1  # the bool's call alone


@pytest.mark.cpu_host
def test_stored_low_bit_winners_are_served(disp: Dispatcher) -> None:
    """Winners of the Triton W4A16 and FP8 kernels, stored, then loaded by warmup, serve the
    calls (hits, not torch's op) within the format's error bounds."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    a, b, sa, sb = fp8_operands(4, True)

    def calls() -> tuple[torch.Tensor, torch.Tensor]:
        return (tuner.int4_linear(x, packed, sz, GROUP),
                tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16))  # fmt: skip

    calls()  # a miss each: torch's ops, keys recorded
    keys = recorded(disp)
    store_winners(disp, keys, triton=True)
    disp.set_mode("lookup")
    assert warmup(progress=False, dispatcher=disp, fetch=False).loaded == 2
    got_int4, got_fp8 = calls()
    by_format = {key.wdtype: key for key in keys}
    for wdtype, inputs, got in (("int4", (x, packed, sz), got_int4),
                                ("fp8_e4m3", (a, b, sa, sb), got_fp8)):  # fmt: skip
        key = by_format[wdtype]  # within what the numerics gate accepts for the format
        assert samples.relative_error(got, samples.reference(key, inputs)) <= samples.tolerance(key)
    hits = [r for r in disp.resolutions.values() if r.kind == "hit"]
    assert hits and not any(r.by_torch for r in hits)
    served = {r.candidate.split(":")[0] for r in hits}
    assert served == {triton_source(k) for k in keys} == {"triton_w4a16", "triton_fp8"}


@pytest.mark.cpu_host
def test_an_inference_weight_written_in_place_is_read_anew_after_forget(disp: Dispatcher) -> None:
    """A tensor made under ``torch.inference_mode()`` has no version counter, so the layout a
    kernel made of the weight on its first call cannot see a write in place: ``tuner.forget``
    drops it, and the next call reads the new weight."""
    torch.manual_seed(2)
    q1, sz = int4.quantize(torch.randn(N, K, dtype=torch.bfloat16) * 0.05, GROUP)
    q2, _ = int4.quantize(torch.randn(N, K, dtype=torch.bfloat16) * 0.05, GROUP)
    x = torch.randn(2, K, dtype=torch.bfloat16)
    with torch.inference_mode():
        packed = int4_torch.torch_pack(q1)
        tuner.int4_linear(x, packed, sz, GROUP)  # a miss: its key recorded
    (key,) = recorded(disp)
    store_winners(disp, [key], triton=True)
    disp.set_mode("lookup")
    assert warmup(progress=False, dispatcher=disp, fetch=False).loaded == 1
    with torch.inference_mode():
        tuner.int4_linear(x, packed, sz, GROUP)  # the kernel's layout of q1 made and kept
        packed.copy_(int4_torch.torch_pack(q2))
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
        kept = tuner.int4_linear(x, packed, sz, GROUP)
        tuner.forget(packed)
        got = tuner.int4_linear(x, packed, sz, GROUP)
    bound = samples.tolerance(key)
    assert samples.relative_error(kept, want) > bound  # q1's layout: what forget is for
    assert samples.relative_error(got, want) <= bound
    hits = [r for r in disp.resolutions.values() if r.kind == "hit"]
    assert hits and {r.candidate.split(":")[0] for r in hits} == {"triton_w4a16"}


def test_bad_input_raises_torchs_error_or_names_the_field(disp: Dispatcher) -> None:
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales_and_zeros\.shape"):
        tuner.int4_linear(x, packed, sz[:1], GROUP)
    with pytest.raises(ValueError, match=r"scales_and_zeros\.shape"):
        tuner.int4_linear(x, packed, sz, 64)  # a group size the scales were not made for
    with pytest.raises(ValueError, match=r"x\.shape"):
        tuner.int4_linear(torch.randn(2, K - 32, dtype=torch.bfloat16), packed, sz, GROUP)
    a, b, sa, sb = fp8_operands(4, True)
    with pytest.raises(ValueError, match=r"scale_b\.shape=\(1, 63\)"):
        tuner.scaled_mm(a, b, sa, sb[:, :-1], out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale_a\.dtype=torch\.float64: must be torch\.float32"):
        tuner.scaled_mm(a, b, sa.double(), sb, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale_b\.shape=\(1, 2\): expected one element"):
        tuner.scaled_mm(a, b, sa.max(), sb[:, :2], out_dtype=torch.bfloat16)  # tensorwise scale_a
    assert recorded(disp) == []  # nothing keyed from bad input


def test_an_fp8_gemm_of_empty_k_is_zeros_on_the_cpu(disp: Dispatcher) -> None:
    """torch's CPU op returns uninitialized memory for K = 0, where the product is zeros:
    ``tuner.scaled_mm`` returns the zeros (bad scales are still named first)."""
    a, b, sa, sb = fp8_operands(4, rowwise=False)
    got = tuner.scaled_mm(a[:, :0], b[:0], sa, sb, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (4, 64) and not got.any()
    assert tuner.scaled_mm(a[:, :0], b[:0], sa, sb).dtype == a.dtype  # torch's default out
    with pytest.raises(ValueError, match=r"scale_a\.dtype=torch\.float64"):
        tuner.scaled_mm(a[:, :0], b[:0], sa.double(), sb, out_dtype=torch.bfloat16)
    assert recorded(disp) == []


def test_a_packed_weight_not_in_the_devices_format_is_named_with_the_format(
    disp: Dispatcher,
) -> None:
    """On the CPU torch packs uint8 [N, K / 2] (not CUDA's int32 4-d tiles): a weight of another
    dtype or rank, an unpacked [N, K] weight, our own layout or a transposed view is refused naming
    ``packed_w`` (the caller's argument), its dtype, shape and device, and what the CPU takes."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    cpu_format = (r"packed_w: expected torch's uint8 \[N, K / 2\] from "
                  r"aten\._convert_weight_to_int4pack_for_cpu on cpu, got ")  # fmt: skip
    for wrong in (packed.int(), packed.to(torch.int8), packed.float(), packed.reshape(-1),
                  torch.zeros(N // 8, K // 256, 32, 4, dtype=torch.int32)):  # fmt: skip
        shape = re.escape(str(tuple(wrong.shape)))
        with pytest.raises(ValueError, match=cpu_format + rf"{wrong.dtype} {shape} on cpu$"):
            tuner.int4_linear(x, wrong, sz, GROUP)
    q = int4_torch.nibbles(packed)  # [N, K] values: the weight before torch's packing
    with pytest.raises(ValueError, match=r"packed_w\.shape=\(64, 256\) holds a weight of K=512.*"
                       r"either x's K should be 512, or packed_w holds unpacked.*"
                       r"_convert_weight_to_int4pack_for_cpu"):  # fmt: skip
        tuner.int4_linear(x, q, sz, GROUP)
    # our own layout has torch's CPU dtype and shape, and other bytes: refused, not read as torch's
    with pytest.raises(ValueError, match=r"^packed_w: is tuner's own layout \(tuner\.quant\."
                       r"int4\.pack\), not torch's uint8 .*int4_torch\.torch_pack$"):  # fmt: skip
        tuner.int4_linear(x, int4.pack(q), sz, GROUP)
    square = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (K // 2, K), dtype=torch.int32), 2
    )  # [K / 2, K / 2]: its transpose has the same shape
    with pytest.raises(ValueError, match=r"packed_w: must be contiguous"):
        tuner.int4_linear(x, square.t(), torch.ones(K // GROUP, K // 2, 2, dtype=x.dtype), GROUP)
    assert recorded(disp) == []


def test_our_own_layout_is_refused_after_calls_of_the_same_shapes_were_served(
    disp: Dispatcher,
) -> None:
    """A served call makes its signature hot; our layout (same dtype and shape on the CPU) must
    still be refused, not read as torch's packing."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    want = tuner.int4_linear(x, packed, sz, GROUP)
    ours = int4.pack(int4_torch.nibbles(packed))
    assert (ours.dtype, ours.shape, ours.stride()) == (packed.dtype, packed.shape, packed.stride())
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^packed_w: is tuner's own layout"):
            tuner.int4_linear(x, ours, sz, GROUP)
    assert torch.equal(tuner.int4_linear(x, packed, sz, GROUP), want)


def test_a_cpu_weight_of_n_rows_torch_cannot_pack_is_named_and_not_recorded(
    disp: Dispatcher,
) -> None:
    """torch's CPU packing holds N in blocks of 16: a uint8 [N, K / 2] tensor of 72 rows has the
    format's dtype and rank, but torch's op fails on it naming neither the weight nor N
    ("Unsupported n block size"), and its key could never be tuned here."""
    x = torch.randn(2, K, dtype=torch.bfloat16)
    rows = torch.randint(0, 256, (72, K // 2), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^packed_w\.shape=\(72, 128\): N=72; torch's int4 "
                       r"packing on cpu needs N a multiple of 16$"):  # fmt: skip
        tuner.int4_linear(x, rows, torch.ones(K // GROUP, 72, 2, dtype=x.dtype), GROUP)
    assert recorded(disp) == []


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])]
)  # fmt: skip
def test_int4_operands_on_another_device_are_named_even_after_a_good_call(
    disp: Dispatcher, device: str
) -> None:
    """A weight or scales left on another device than x is refused naming the field, also once
    a call of the same shapes was served (the runner memoized for it must not be reused: a CUDA
    kernel handed a host pointer would read out of bounds). The meta device stands in for a
    second device on a CPU."""
    packed, sz = int4_weight(device=device)
    x = torch.randn(2, K, dtype=torch.bfloat16, device=device)
    good = tuner.int4_linear(x, packed, sz, GROUP)
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match=rf"^packed_w\.device={other}: must be x's device"):
        tuner.int4_linear(x, packed.to(other), sz, GROUP)
    with pytest.raises(ValueError, match=rf"^scales_and_zeros\.device={other}: must be x's device"):
        tuner.int4_linear(x, packed, sz.to(other), GROUP)
    torch.testing.assert_close(tuner.int4_linear(x, packed, sz, GROUP), good, rtol=0, atol=0)


def test_fp8_operands_on_another_device_are_named_even_after_a_good_call(
    disp: Dispatcher,
) -> None:
    """b or a scale on another device than a is refused naming the field, also once a call of
    the same shapes was served (torch's CPU op reads garbage for them; a CUDA kernel would be
    handed a host pointer). The meta device stands in for a second device on a CPU."""
    a, b, sa, sb = fp8_operands(4, rowwise=False)
    good = tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    for name, i in (("b", 1), ("scale_a", 2), ("scale_b", 3)):
        operands = [a, b, sa, sb]
        operands[i] = operands[i].to("meta")
        with pytest.raises(ValueError, match=rf"^{name}\.device=meta: must be a's device \(cpu\)$"):
            tuner.scaled_mm(*operands, out_dtype=torch.bfloat16)
    again = tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    torch.testing.assert_close(again, good, rtol=0, atol=0)


@pytest.mark.gpu
@GPU
def test_int4_linear_on_cuda_names_the_bf16_it_takes(disp: Dispatcher) -> None:
    """torch's CUDA int4 op, every INT4 key's baseline, takes bf16 only: a float16 x is named
    with the cast to make, not left to torch's error from inside the call."""
    packed, sz = int4_weight(device="cuda")
    x = torch.randn(2, K, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=r"^x\.dtype=torch\.float16: allowed on cuda: "
                       r"torch\.bfloat16; cast x and scales_and_zeros to torch\.bfloat16$"):  # fmt: skip
        tuner.int4_linear(x, packed, sz.half(), GROUP)
    got = tuner.int4_linear(x.bfloat16(), packed, sz, GROUP)
    want = torch.ops.aten._weight_int4pack_mm(x.bfloat16(), packed, GROUP, sz)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert recorded(disp)[0].dtype == "bf16"


def test_int4_activations_are_checked_before_the_scales(disp: Dispatcher) -> None:
    """x's dtype is checked first, against what torch's CPU op takes (bf16, f16, f32): a wrong x
    is named as such, not taken for the scales' fault; a strided x is refused by name."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    allowed = r"allowed on cpu: torch\.bfloat16, torch\.float16, torch\.float32"
    for dtype in (torch.int32, torch.int64, torch.float64):
        with pytest.raises(ValueError, match=rf"^x\.dtype={dtype}: {allowed}$"):
            tuner.int4_linear(x.to(dtype), packed, sz, GROUP)
    with pytest.raises(ValueError, match=r"^x\.dtype=torch\.float64: "):  # scales of x's dtype too
        tuner.int4_linear(x.double(), packed, sz.double(), GROUP)
    with pytest.raises(ValueError, match=r"scales_and_zeros\.dtype=torch\.bfloat16: must be the "
                       r"activation's \(x\.dtype=torch\.float32\)"):  # fmt: skip
        tuner.int4_linear(x.float(), packed, sz, GROUP)
    strided = x.t().contiguous().t()
    with tt.enabled(dispatcher=disp), pytest.raises(RuntimeError, match=r"must be contiguous"):
        torch.ops.aten._weight_int4pack_mm_for_cpu(strided, packed, GROUP, sz)  # as torch refuses
    assert recorded(disp) == []
    # tuner.int4_linear copies it, as the reshape of a 3-D x does
    torch.testing.assert_close(tuner.int4_linear(strided, packed, sz, GROUP),
                               tuner.int4_linear(x, packed, sz, GROUP), rtol=0, atol=0)  # fmt: skip
    for dtype in (torch.float16, torch.float32):  # torch's CPU op computes in these
        got = tuner.int4_linear(x.to(dtype), packed, sz.to(dtype), GROUP)
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(dtype), packed, GROUP, sz.to(dtype))
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cpu_host
def test_rowwise_scale_b_is_checked_as_torch_scaled_mm_takes_it(disp: Dispatcher) -> None:
    """torch._scaled_mm takes a rowwise scale_b as (1, N), contiguous, only: the check refuses
    what torch would, and what its message asks for runs."""
    a, b, sa, sb = fp8_operands(4, True)
    assert sb.shape == (1, N)
    with pytest.raises(ValueError, match=rf"scale_b\.shape=\({N}, 1\): expected \(1, {N}\) "):
        tuner.scaled_mm(a, b, sa, sb.t().contiguous(), out_dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match="Invalid scaling configuration"):
        torch._scaled_mm(a, b, sa, sb.t().contiguous(), out_dtype=torch.bfloat16)
    strided = torch.ones(1, 2 * N)[:, ::2]
    with pytest.raises(ValueError, match=r"scale_b: must be contiguous for rowwise scaling"):
        tuner.scaled_mm(a, b, sa, strided, out_dtype=torch.bfloat16)
    tuner.scaled_mm(a, b, sa, sb.contiguous(), out_dtype=torch.bfloat16)  # resolves the shapes
    with pytest.raises(ValueError, match=r"scale_b: must be contiguous"):  # same shape, strided
        tuner.scaled_mm(a, b, sa, strided, out_dtype=torch.bfloat16)
    want = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    torch.testing.assert_close(tuner.scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), want)


@pytest.mark.cpu_host
def test_operands_that_are_not_tensors_raise_torchs_type_error(disp: Dispatcher) -> None:
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    with pytest.raises(
        TypeError, match=r"scales_and_zeros: expected a torch\.Tensor, got NoneType"
    ):
        tuner.int4_linear(x, packed, None, GROUP)
    with pytest.raises(TypeError, match=r"packed_w: expected a torch\.Tensor, got float"):
        tuner.int4_linear(x, 1.0, sz, GROUP)
    with pytest.raises(ValueError, match="x: expected an activation"):
        tuner.int4_linear(torch.tensor(1.0, dtype=torch.bfloat16), packed, sz, GROUP)
    for group in (128.0, True):
        with pytest.raises(ValueError, match=rf"group_size={group!r}: must be an int"):
            tuner.int4_linear(x, packed, sz, group)
    a, b, _, sb = fp8_operands(4, True)
    with pytest.raises(TypeError, match=r"scale_a: expected a torch\.Tensor, got NoneType"):
        tuner.scaled_mm(a, b, None, sb, out_dtype=torch.bfloat16)
    assert recorded(disp) == []
    np = pytest.importorskip("numpy")  # a NumPy integer is a group size, as torch's ops take it
    assert tuner.int4_linear(x, packed, sz, np.int64(GROUP)).shape == (2, N)
    assert [k.group for k in recorded(disp)] == [GROUP]
    assert tuner.int4_linear(x, packed, sz, GROUP).shape == (2, N)
    # refused alike once a call of group 128 was served (128.0 == 128 as a memo's key)
    with pytest.raises(ValueError, match=r"group_size=128\.0: must be an int"):
        tuner.int4_linear(x, packed, sz, 128.0)


@pytest.mark.cpu_host
def test_a_group_size_held_in_a_tensor_shares_one_signature(disp: Dispatcher) -> None:
    """A 0-d integer tensor is a group size, as torch's ops take it, and its calls resolve
    once: a signature holding the tensor itself would grow the dispatcher's memo per call.
    Under the drop-in, torch serves a tensor group size as it would (it takes even 128.0)."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    want = tuner.int4_linear(x, packed, sz, GROUP)
    for _ in range(3):
        torch.testing.assert_close(tuner.int4_linear(x, packed, sz, torch.tensor(GROUP)), want)
    assert len(disp._hot) == 1 and [k.group for k in recorded(disp)] == [GROUP]
    with pytest.raises(ValueError, match=r"group_size=tensor\(96\): allowed \(32, 64"):
        tuner.int4_linear(x, packed, sz, torch.tensor(96))
    op = torch.ops.aten._weight_int4pack_mm_for_cpu
    for group in (torch.tensor(GROUP), torch.tensor(float(GROUP))):
        with tt.enabled(dispatcher=disp):
            tt.reset_stats(disp)
            got = op(x, packed, group, sz)
        assert sum(r.calls for r in tt.stats(disp).rows) == 0  # torch served it
        torch.testing.assert_close(got, op(x, packed, group, sz))


def test_scales_that_are_not_contiguous_are_checked_on_every_signature(disp: Dispatcher) -> None:
    """A signature holds the scales' strides: once a call of contiguous scales has resolved, a
    call of the same shapes with a transposed copy is checked again, not served wrongly by the
    runner of the first (torch's CPU op does not look at strides)."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    tuner.int4_linear(x, packed, sz, GROUP)
    strided = sz.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    assert strided.shape == sz.shape and not strided.is_contiguous()
    said = (
        r"scales_and_zeros: must be contiguous, got .* strides \(2, 4, 1\); pass .*\.contiguous\(\)"
    )
    with pytest.raises(ValueError, match=said):
        tuner.int4_linear(x, packed, strided, GROUP)


def test_a_low_bit_field_left_out_of_a_key_string_is_named_as_missing() -> None:
    fp8 = "gemm:m=16,n=4096,k=4096,layout=nt,dtype=fp8_e4m3,out_dtype=bf16,scale=row"
    with pytest.raises(ValueError, match=r"accum is missing: it must be one of \['f32', 'fast'\]"):
        parse_key(fp8)
    assert parse_key(fp8 + ",accum=fast").accum == "fast"
    int4 = "gemm:m=2,n=64,k=256,layout=nt,dtype=bf16,wdtype=int4"
    with pytest.raises(
        ValueError, match=r"group is missing or 0: it must be one of \[32, 64, 128, 256\]"
    ):
        parse_key(int4)


def test_key_errors_name_the_field() -> None:
    from tuner.serving.lowbit import int4_key, scaled_mm_key

    packed, sz = int4_weight()
    with pytest.raises(ValueError, match=r"scales_and_zeros\.shape"):
        int4_key(torch.randn(2, K, dtype=torch.bfloat16), packed, sz[:1], GROUP)
    with pytest.raises(ValueError, match=r"x\.dtype"):
        int4_key(torch.randn(2, K), packed, sz, GROUP)
    a, b, sa, sb = fp8_operands(4, True)
    with pytest.raises(ValueError, match=r"scale_b\.shape"):
        scaled_mm_key(a, b, sa, sb[:, :-1], torch.bfloat16, False)
    with pytest.raises(ValueError, match="layout"):
        scaled_mm_key(a, b.t().contiguous().t().contiguous(), sa, sb, torch.bfloat16, False)


@pytest.mark.parametrize(
    ("device", "op_name"),
    [pytest.param("cpu", "_weight_int4pack_mm_for_cpu", marks=pytest.mark.cpu_host),
     pytest.param("cuda", "_weight_int4pack_mm", marks=[pytest.mark.gpu, GPU])],
)  # fmt: skip
def test_drop_in_routes_the_low_bit_ops_and_restores_them(tmp_path, device, op_name) -> None:
    scaled_mm, int4_op = torch._scaled_mm, getattr(torch.ops.aten, op_name)
    int4_alias = getattr(torch, op_name)  # torch's own name of the aten op: routed as well
    d = Dispatcher(tmp_path / "c.db", mode="record")
    packed, sz = int4_weight(device=device)
    x = torch.randn(6, K, dtype=torch.bfloat16, device=device)
    a, b, sa, sb = fp8_operands(8, True, device)
    want_int4 = int4_op(x, packed, GROUP, sz)
    want_fp8 = scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
    with tt.enabled(dispatcher=d):
        assert torch._scaled_mm is not scaled_mm
        routed = getattr(torch.ops.aten, op_name)
        assert routed is not int4_op and routed.default is int4_op.default  # overloads stay
        assert getattr(torch, op_name) is not int4_alias
        for _ in range(3):
            got_int4 = getattr(torch.ops.aten, op_name)(x, packed, GROUP, sz)
            got_alias = getattr(torch, op_name)(x, packed, GROUP, sz)
            got_fp8 = torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)
        stats = tt.stats(d)
    torch.testing.assert_close(got_int4, want_int4, rtol=0, atol=0)
    torch.testing.assert_close(got_alias, want_int4, rtol=0, atol=0)
    torch.testing.assert_close(got_fp8, want_fp8, rtol=0, atol=0)
    assert torch._scaled_mm is scaled_mm
    assert getattr(torch.ops.aten, op_name) is int4_op
    assert getattr(torch, op_name) is int4_alias
    calls = {parse_key(r.key).wdtype: r.calls for r in stats.rows if r.kind == "miss"}
    assert calls == {"int4": 6, "fp8_e4m3": 3}
    assert stats.misses == 9


def aten_args(packet: object) -> list[str]:
    """The argument names of an aten op (its default overload) in the installed torch."""
    return [arg.name for arg in packet.default._schema.arguments]  # type: ignore[attr-defined]


def test_cudas_int4_op_on_cpu_tensors_is_refused_by_torch_as_without_the_drop_in(
    disp: Dispatcher,
) -> None:
    """torch has ``aten._weight_int4pack_mm`` for CUDA only: routed, a call of it on the CPU's
    packing fails as it does unrouted, though the problem has a winner the CPU could run."""
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    tuner.int4_linear(x, packed, sz, GROUP)
    store_winners(disp, recorded(disp), triton=True)
    with pytest.raises(NotImplementedError) as unrouted:
        torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)
    with tt.enabled(dispatcher=disp):
        for op in (torch.ops.aten._weight_int4pack_mm, torch._weight_int4pack_mm):
            with pytest.raises(NotImplementedError) as routed:
                op(x, packed, GROUP, sz)
            assert str(routed.value) == str(unrouted.value)


@pytest.mark.parametrize(
    ("device", "op_name"),
    [("cpu", "_weight_int4pack_mm_for_cpu"),
     pytest.param("cuda", "_weight_int4pack_mm", marks=[pytest.mark.gpu, GPU])],
)  # fmt: skip
def test_routed_int4_op_errors_name_atens_arguments(
    disp: Dispatcher, device: str, op_name: str
) -> None:
    """Bad input to torch's int4 op under the drop-in is refused by ``tuner.int4_linear``'s
    checks naming the argument as the caller wrote it, aten's (self, mat2, qGroupSize,
    qScaleAndZeros), positional or by keyword; a direct ``int4_linear`` call keeps its own."""
    assert aten_args(getattr(torch.ops.aten, op_name)) == [
        "self", "mat2", "qGroupSize", "qScaleAndZeros"
    ]  # fmt: skip
    packed, sz = int4_weight(device=device)
    x = torch.randn(2, K, dtype=torch.bfloat16, device=device)
    other = "meta" if device == "cpu" else "cpu"  # the meta device stands in for a second one
    w = re.escape(str(tuple(packed.shape)))
    cases = [
        ((x, packed, GROUP, sz[:1]), r"^qScaleAndZeros\.shape=\(1, 64, 2\): expected \(2, 64, 2\) "
                                     r"\(\[K / qGroupSize, N, 2\] for N=64, K=256, qGroupSize=128\)$"),
        ((x, packed, 96, sz), r"^qGroupSize=96: allowed \(32, 64, 128, 256\)$"),
        ((x[:, :224].contiguous(), packed, GROUP, sz),
         rf"^self\.shape=\(2, 224\) has K=224, but mat2\.shape={w} holds a weight of K=256"),
        ((x.double(), packed, GROUP, sz), rf"^self\.dtype=torch\.float64: allowed on {device}: "),
        ((x, packed.to(other), GROUP, sz), rf"^mat2\.device={other}: must be self's device"),
        ((x, packed, GROUP, sz.to(other)), rf"^qScaleAndZeros\.device={other}: must be self's "),
    ]  # fmt: skip
    with tt.enabled(dispatcher=disp):
        op = getattr(torch.ops.aten, op_name)
        for args, message in cases:
            with pytest.raises(ValueError, match=message):
                op(*args)
        with pytest.raises(ValueError, match=r"^qScaleAndZeros\.shape=\(1, 64, 2\)"):
            op(x, mat2=packed, qGroupSize=GROUP, qScaleAndZeros=sz[:1])
    with pytest.raises(ValueError, match=r"^scales_and_zeros\.shape=\(1, 64, 2\)"):
        tuner.int4_linear(x, packed, sz[:1], GROUP)
    assert recorded(disp) == []


def test_routed_scaled_mm_errors_name_atens_arguments(disp: Dispatcher) -> None:
    """Bad input to ``torch._scaled_mm`` under the drop-in is refused by ``tuner.scaled_mm``'s
    checks naming the operands as the caller wrote them, aten's self and mat2 (the scales are
    scale_a and scale_b in both), positional or by keyword; a direct call keeps a and b."""
    assert aten_args(torch.ops.aten._scaled_mm)[:4] == ["self", "mat2", "scale_a", "scale_b"]
    a, b, sa, sb = fp8_operands(4, rowwise=True)
    cases = [
        ((a, b[:-1], sa, sb),
         r"^self, mat2: expected \[M, K\] and \[K, N\], got \(4, 256\) and \(255, 64\)$"),
        ((a, b.to("meta"), sa, sb), r"^mat2\.device=meta: must be self's device \(cpu\)$"),
        ((a, b, sa, sb.to("meta")), r"^scale_b\.device=meta: must be self's device \(cpu\)$"),
        ((a, b, sa, sb[:, :-1]), r"^scale_b\.shape=\(1, 63\): expected \(1, 64\) with a rowwise"),
        # torch's own error for a 16-bit operand blames scale_a, which is right
        ((a.bfloat16(), b, sa, sb), r"^self\.dtype=torch\.bfloat16: _scaled_mm takes 8-bit float "
                                    r"operands, one of \['torch\.float8_e4m3fn', "),
        ((a, b.float(), sa, sb), r"^mat2\.dtype=torch\.float32: _scaled_mm takes 8-bit float"),
    ]  # fmt: skip
    with tt.enabled(dispatcher=disp):
        for args, message in cases:
            with pytest.raises(ValueError, match=message):
                torch._scaled_mm(*args, out_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"^self, mat2: expected"):
            torch._scaled_mm(a, mat2=b[:-1], scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^a, b: expected \[M, K\] and \[K, N\]"):
        tuner.scaled_mm(a, b[:-1], sa, sb, out_dtype=torch.bfloat16)
    assert recorded(disp) == []


def test_routed_low_bit_calls_torchs_signature_refuses_raise_torchs_own_type_error(
    disp: Dispatcher,
) -> None:
    """A misspelt keyword or a missing argument under the drop-in raises torch's own error
    (a TypeError from ``torch._scaled_mm``, a RuntimeError from the aten op), naming torch's
    function, not the tuner's helper that reads the call's arguments."""
    a, b, sa, sb = fp8_operands(4, rowwise=True)
    packed, sz = int4_weight()
    x = torch.randn(2, K, dtype=torch.bfloat16)
    calls = {
        "misspelt out_dtype": lambda: torch._scaled_mm(a, b, sa, sb, outdtype=torch.bfloat16),
        "no scale_b": lambda: torch._scaled_mm(a, b, sa),
        "misspelt qGroupSize": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, group_size=GROUP, qScaleAndZeros=sz
        ),
        "no scales": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP),
    }
    for name, fn in calls.items():
        with pytest.raises((TypeError, RuntimeError)) as want:
            fn()
        with tt.enabled(dispatcher=disp), pytest.raises((TypeError, RuntimeError)) as got:
            fn()
        assert (got.type, str(got.value)) == (want.type, str(want.value)), name
    assert recorded(disp) == []
