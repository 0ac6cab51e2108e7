"""Low-bit problem inputs are what torch's ops take, the reference and its bound accept torch's
own results, and candidates wrong in known ways are rejected by the engine's numerics gate
(on the CPU, through ``tuner.tuning.engine.tune``)."""

from __future__ import annotations

import pytest
import torch

from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.keys import DTYPES, GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant import fp8, int4, int4_torch
from tuner.tuning.engine import TuneOptions, tune

INT4_KEY = GemmKey(m=5, n=32, k=256, **lowbit_fields("int4-g32"))
FP8_ROW = GemmKey(m=5, n=32, k=128, **lowbit_fields("fp8-rowwise"))
FP8_TENSOR = GemmKey(m=5, n=32, k=128, **lowbit_fields("fp8-tensorwise-fast"))


def cpu_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes rowwise scales (older builds: tensorwise)."""
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.T, torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


# FP8_ROW where this torch runs it on the CPU
FP8_ROW_ON_CPU = pytest.param(FP8_ROW, marks=pytest.mark.skipif(
    not cpu_takes_rowwise_scales(), reason="this torch's CPU _scaled_mm takes tensorwise scales only"))  # fmt: skip


def inputs(key: GemmKey, seed: int = 0):
    return samples.make_inputs(key, "cpu", torch.Generator().manual_seed(seed))


def test_int4_inputs_are_torchs_packed_weight_and_scales():
    x, packed, sz = inputs(INT4_KEY)
    assert x.shape == (5, 256) and x.dtype == torch.bfloat16 and x.is_contiguous()
    assert int4_torch.packed_shape(packed) == (32, 256)
    assert sz.shape == (256 // 32, 32, 2) and sz.dtype == torch.bfloat16 and sz.is_contiguous()
    q = int4_torch.nibbles(packed)
    assert torch.equal(int4_torch.nibbles(packed.clone()), q)  # decoded, not only remembered
    # torch's CPU op on these inputs is within the bound; the reference is the dequantized GEMM
    ref = samples.reference(INT4_KEY, (x, packed, sz))
    torch.testing.assert_close(ref.ref, x.float() @ int4.dequantize(q, sz, 32).T)
    out = int4_torch.int4_mm(x, packed, 32, sz)
    assert samples.relative_error(out, ref) <= samples.tolerance(INT4_KEY) == 1.0
    assert samples.output_like(INT4_KEY, (x, packed, sz)).shape == (5, 32)


@pytest.mark.parametrize("key", [FP8_ROW_ON_CPU, FP8_TENSOR])
def test_fp8_inputs_are_what_scaled_mm_takes(key):
    a, b, sa, sb = inputs(key)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous()
    assert b.shape == (128, 32) and b.stride() == (1, 128)  # column-major, as _scaled_mm requires
    if key.scale == "row":
        assert sa.shape == (5, 1) and sb.shape == (1, 32)
    else:
        assert sa.dim() == sb.dim() == 0
    out = torch._scaled_mm(
        a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=key.accum == "fast"
    )
    ref = samples.reference(key, (a, b, sa, sb))
    assert samples.relative_error(out, ref) <= 1.0
    torch.testing.assert_close(
        ref.ref, fp8.dequantize(a, sa) @ fp8.dequantize(b.T, sb.T if key.scale == "row" else sb).T
    )


def test_lowbit_inputs_honour_the_keys_alignment_and_bytes():
    key = GemmKey(m=5, n=32, k=128, align=4, **lowbit_fields("fp8-rowwise"))
    a = inputs(key)[0]
    assert a.data_ptr() % 4 == 0 and a.data_ptr() % 8
    x = inputs(GemmKey(m=3, n=32, k=256, align=2, **lowbit_fields("int4-g64")))[0]
    assert x.data_ptr() % 2 == 0 and x.data_ptr() % 4
    assert samples.bytes_per_set(INT4_KEY) == INT4_KEY.min_bytes


def test_a_nan_never_passes_a_bounded_reference():
    x, packed, sz = inputs(INT4_KEY)
    out = int4_torch.int4_mm(x, packed, 32, sz)
    out[0, 0] = float("nan")
    err = samples.relative_error(out, samples.reference(INT4_KEY, (x, packed, sz)))
    assert not err <= 1.0


class PlantedLowbit(Source):
    """Low-bit candidates wrong in known ways, beside one right one."""

    name = "planted_lowbit"
    op = "gemm"
    INT4_BUGS = ("none", "swapped_nibbles", "next_group_scales", "scale_zero_swapped", "scales_transposed", "last_group_dropped")  # fmt: skip
    FP8_BUGS = ("none", "scale_b_reversed", "scale_a_ignored", "last_k_dropped")

    def candidates(self, key, device):
        return [{"bug": b} for b in (self.INT4_BUGS if key.wdtype == "int4" else self.FP8_BUGS)]

    def build(self, key, params):
        bug, dt = params["bug"], DTYPES[key.out_dtype]

        def run_int4(x, packed, sz, out=None):
            q = int4_torch.nibbles(packed)
            if bug == "swapped_nibbles":
                q = q.reshape(q.shape[0], -1, 2).flip(-1).reshape(q.shape)
            if bug == "next_group_scales":
                sz = sz.roll(1, dims=0).contiguous()
            if bug == "scale_zero_swapped":
                sz = sz.flip(-1).contiguous()
            if bug == "scales_transposed":  # [N, K / group] read as [K / group, N]
                sz = sz.transpose(0, 1).reshape(sz.shape).contiguous()
            w = int4.dequantize(q, sz, key.group)
            if bug == "last_group_dropped":
                w[:, -key.group :] = 0
            return (x.float() @ w.T).to(dt)

        def run_fp8(a, b, sa, sb, out=None):
            da, db = a.float(), b.float()
            if bug == "last_k_dropped":
                da[:, -16:] = 0
            sb = sb.flip(-1) if bug == "scale_b_reversed" else sb
            sa = torch.ones_like(sa) if bug == "scale_a_ignored" else sa
            return ((da * sa) @ (db * sb)).to(dt)

        return run_int4 if key.wdtype == "int4" else run_fp8


@pytest.fixture
def planted():
    registry.register(PlantedLowbit())
    yield
    registry.unregister(PlantedLowbit.name)


@pytest.mark.parametrize("key", [INT4_KEY, FP8_ROW_ON_CPU])
def test_planted_wrong_results_are_rejected_by_the_gate(planted, key):
    outcome = tune(key, options=TuneOptions(sources=["planted_lowbit"], budget_s=0.005, confirm_rounds=0), device="cpu")  # fmt: skip
    status = {m.params.get("bug", m.source): m.status for m in outcome.measurements}
    bugs = PlantedLowbit.INT4_BUGS if key.wdtype == "int4" else PlantedLowbit.FP8_BUGS
    assert status["torch_lowbit"] == "ok" and status["none"] in ("ok", "cut")
    assert {b: status[b] for b in bugs[1:]} == {b: "rejected" for b in bugs[1:]}
    assert "torch" not in status  # only the baseline that takes the key is tuned beside them
    assert registry.get("torch").unsupported(key)  # the plain-GEMM baseline declines it
