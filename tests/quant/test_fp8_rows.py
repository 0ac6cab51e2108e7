"""The fused rowwise FP8 quantization kernel computes what torch's ops compute on a GPU, bit for
bit, and ``quantize_rowwise`` takes it on a GPU.

Without a GPU the kernel runs in Triton's interpreter, and torch's reference is made here with
the arithmetic torch's ops do on a GPU, which is not their CPU's: there the scale is the amax
times the float32 reciprocal of the format's largest value (torch's GPU divides by a Python
number so; its CPU divides). The interpreter's casts to FP8 round some values wrong (a carry
into the exponent lost, ties the other way), so that reference is cast by the interpreter too:
the kernel's scales and divisions are checked bit for bit everywhere, the cast on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tuner.quant import fp8, fp8_rows

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
Quantized = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def _cast(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(q_ptr + cols, tl.load(x_ptr + cols, mask=cols < n).to(q_ptr.dtype.element_ty),
             mask=cols < n)  # fmt: skip


def _torchs(x: torch.Tensor, fmt: str = "e4m3") -> Quantized:
    """``fp8.quantize_rowwise_torch(x)`` as a GPU computes it (module docstring)."""
    if HAS_GPU:
        return fp8.quantize_rowwise_torch(x, fmt)
    dtype = fp8.fp8_dtype(fmt)
    fmax = torch.finfo(dtype).max
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=fp8.MIN_AMAX)
    scale = amax * (torch.ones(()) / fmax)
    values = (x.float() / scale).clamp(-fmax, fmax).contiguous()
    q = torch.empty(values.shape, dtype=dtype)
    _cast[(1,)](values, q, values.numel(), BLOCK=triton.next_power_of_2(max(values.numel(), 1)))
    return q, scale


def _same(got: Quantized, want: Quantized) -> None:
    (q, scale), (q_ref, scale_ref) = got, want
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape
    assert scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0, equal_nan=True)
    nan = q_ref.float().isnan()  # a NaN's sign bit is the arithmetic's choice
    assert torch.equal(q.float().isnan(), nan)
    assert torch.equal(q.view(torch.uint8)[~nan], q_ref.view(torch.uint8)[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (5, 1), (4, 1000)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fused_rows_are_torchs_bit_for_bit(
    dtype: torch.dtype, shape: tuple[int, int], fmt: str
) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * torch.logspace(-4, 4, shape[0])[:, None]
    x = x.to(DEVICE, dtype)
    _same(fp8_rows.quantize(x, fp8.fp8_dtype(fmt), fp8.MIN_AMAX), _torchs(x, fmt))


def test_zero_nan_and_strided_rows_as_torch() -> None:
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    x[1] = 0  # the smallest scale, no division by zero
    x[2, 7] = float("nan")  # the whole row's scale is NaN, as torch's amax makes it
    x = x.to(DEVICE)
    ref = _torchs(x)
    _same(fp8_rows.quantize(x, torch.float8_e4m3fn, fp8.MIN_AMAX), ref)
    wide = torch.zeros(4, 160, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 32:128] = x  # rows of a wider tensor: a row stride that is not K
    _same(fp8_rows.quantize(wide[:, 32:128], torch.float8_e4m3fn, fp8.MIN_AMAX), ref)
    by_columns = x.t().contiguous().t()  # made contiguous first
    _same(fp8_rows.quantize(by_columns, torch.float8_e4m3fn, fp8.MIN_AMAX), ref)


def test_no_rows_make_empty_outputs() -> None:
    q, scale = fp8_rows.quantize(
        torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE), torch.float8_e4m3fn, 1e-12
    )
    assert q.shape == (0, 64) and scale.shape == (0, 1)


def test_only_gpu_rows_it_can_hold_take_the_kernel() -> None:
    e4m3 = torch.float8_e4m3fn
    assert not fp8_rows.takes(torch.ones(2, 64), e4m3)  # the CPU: torch's ops
    if HAS_GPU:
        x = torch.ones(2, 64, device="cuda")
        fp8_capable = torch.cuda.get_device_capability() >= (8, 9)
        assert fp8_rows.takes(x, e4m3) == fp8_capable
        assert not fp8_rows.takes(x.to(torch.int32), e4m3)
        assert not fp8_rows.takes(torch.ones(2, fp8_rows.MAX_K + 1, device="cuda"), e4m3)
        assert not fp8_rows.takes(torch.ones(2, 3, 64, device="cuda"), e4m3)


@pytest.mark.gpu
def test_quantize_rowwise_on_a_gpu_is_the_fused_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    fused: list[tuple[int, ...]] = []
    quantize = fp8_rows.quantize

    def spy(x: torch.Tensor, *args: object) -> Quantized:
        fused.append(tuple(x.shape))
        return quantize(x, *args)

    monkeypatch.setattr(fp8_rows, "quantize", spy)
    x = torch.randn(16, 14336, device="cuda", dtype=torch.bfloat16)
    _same(fp8.quantize_rowwise(x), fp8.quantize_rowwise_torch(x))
    wide = torch.randn(2, fp8_rows.MAX_K + 8, device="cuda", dtype=torch.bfloat16)
    _same(fp8.quantize_rowwise(wide), fp8.quantize_rowwise_torch(wide))
    assert fused == [(16, 14336)]  # the wide rows took torch's ops


@pytest.mark.gpu
def test_a_capture_takes_the_kernel_only_once_it_has_run() -> None:
    """Compiling inside a capture would invalidate it: a first call of a shape there takes
    torch's ops; once the kernel ran for it, a capture holds the kernel."""
    x = torch.randn(3, 200, device="cuda", dtype=torch.float16)  # a BLOCK of 256: new here
    ref = fp8.quantize_rowwise_torch(x, "e5m2")
    torch.cuda.synchronize()
    for launched in (False, True):
        assert (fp8_rows._specialization(x, torch.float8_e5m2) in fp8_rows._LAUNCHED) == launched
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = fp8.quantize_rowwise(x, "e5m2")
        graph.replay()
        torch.cuda.synchronize()
        _same(got, ref)
        fp8.quantize_rowwise(x, "e5m2")  # eagerly: the kernel compiles and runs


def test_decode_rows_launch_directly_once_a_direct_launch_matched() -> None:
    """Up to ``DIRECT_ROWS`` rows the first call goes through Triton's JIT and checks a direct
    relaunch bit for bit (on a GPU); later calls of that shape launch directly, with torch's
    result. Above it every call takes the JIT, and no launcher is kept."""
    x = torch.randn(4, 320, device=DEVICE, dtype=torch.bfloat16)
    key = (*fp8_rows._specialization(x, torch.float8_e4m3fn), fp8.MIN_AMAX, 4, 320)
    fp8_rows._DIRECT.pop(key, None)
    first = fp8_rows.quantize(x, torch.float8_e4m3fn, fp8.MIN_AMAX)
    entry = fp8_rows._DIRECT[key]
    assert entry.checked
    if HAS_GPU:  # the interpreter has no compiled kernel to launch directly
        assert entry.launcher.verified and entry.launcher.compiled
        direct = []
        raw = entry.launcher.raw
        entry.launcher.raw = lambda *a: (direct.append(a), raw(*a))
        second = fp8_rows.quantize(x, torch.float8_e4m3fn, fp8.MIN_AMAX)
        assert len(direct) == 1
        _same(second, first)
        fp8_rows._DIRECT.pop(key)  # its spied launcher stays here
    _same(first, _torchs(x))
    many = torch.randn(fp8_rows.DIRECT_ROWS + 1, 64, device=DEVICE, dtype=torch.bfloat16)
    before = len(fp8_rows._DIRECT)
    _same(fp8_rows.quantize(many, torch.float8_e4m3fn, fp8.MIN_AMAX), _torchs(many))
    assert len(fp8_rows._DIRECT) == before
