"""The low-bit sources: torch's baselines and the Triton W4A16 / FP8 candidates tuned through the
engine (CPU: Triton's interpreter, small shapes), a served
INT4 runner converting each weight once, clear errors, and the reasons a source sits out."""

from __future__ import annotations

import pytest
import torch

from tests.candidates.gate import tune_uncut
from tuner.candidates import registry
from tuner.candidates.torch_lowbit import TorchLowbit
from tuner.candidates.triton_fp8 import TritonFp8
from tuner.candidates.triton_w4a16 import TritonW4A16
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.core.triton_launch import interpreting
from tuner.measure import samples
from tuner.quant import int4_torch
from tuner.tuning.engine import TuneOptions, tune

HAS_GPU = torch.cuda.is_available()
DENSE_SOURCES = ("torch", "triton_gemm", "cublas", "cublaslt", "cutlass")


def key_of(spec: str, m: int, n: int = 32, k: int = 128, dtype: str | None = None) -> GemmKey:
    fields = lowbit_fields(spec)
    if dtype:
        fields.update(dtype=dtype, out_dtype=dtype)
    return GemmKey(m=m, n=n, k=k, **fields)


CPU_KEYS = [
    (key_of("int4-g32", 3), "triton_w4a16"),
    (key_of("int4-g128", 8, k=256, dtype="f16"), "triton_w4a16"),
    (key_of("fp8-rowwise", 5), "triton_fp8"),
    (key_of("fp8-tensorwise-fast", 5), "triton_fp8"),
]


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path; GPU hosts run the GPU test")
@pytest.mark.parametrize(("key", "source"), CPU_KEYS, ids=[k.label for k, _ in CPU_KEYS])
def test_lowbit_keys_tune_on_the_cpu_with_triton_candidates(monkeypatch, key, source):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    outcome = tune_uncut(key, "cpu", [source], budget_s=0.005)
    ours = [m for m in outcome.measurements if m.source == source]
    assert ours and all(m.status == "ok" and m.max_rel_err <= 1 for m in ours), ours
    assert outcome.winner.source in ("torch_lowbit", source)
    assert outcome.winner.baseline_us > 0


def test_baselines_by_key():
    assert registry.baseline("gemm").name == "torch"
    assert registry.baseline("gemm", key_of("int4-g128", 1, k=256)).name == "torch_lowbit"
    assert registry.baseline("gemm", key_of("fp8-rowwise", 1)).name == "torch_lowbit"
    assert registry.baseline("gemm", GemmKey(m=8, n=8, k=8)).name == "torch"


def test_sources_say_which_keys_they_take(monkeypatch):
    plain = GemmKey(m=8, n=8, k=8)
    assert "low-bit GEMMs only" in TorchLowbit().unsupported(plain)
    assert TritonW4A16().unsupported(key_of("fp8-rowwise", 1)) == "int4 weights only"
    assert TritonFp8().unsupported(key_of("int4-g32", 1)) == "fp8 operands only"
    # our layout packs K in whole chunks of 128 values
    assert "chunks of 128" in TritonW4A16().unsupported(key_of("int4-g32", 1, k=96))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonW4A16().unsupported(key_of("int4-g32", 8)) is None
    assert TritonW4A16().unsupported(key_of("int4-g32", 8, dtype="f16")) is None
    if not HAS_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        for src in (TritonW4A16(), TritonFp8()):
            assert "TRITON_INTERPRET=1" in src.unavailable("cpu")


def test_dense_sources_decline_lowbit_keys_with_a_reason():
    for spec in ("int4-g128", "fp8-rowwise", "fp8-tensorwise-fast"):
        key = key_of(spec, 16, n=256, k=256)
        for name in DENSE_SOURCES:
            reason = registry.get(name).unsupported(key)
            assert reason, name
            assert "low-bit" in reason or "plain GEMMs only" in reason, (name, reason)
    plain = GemmKey(m=16, n=256, k=256, layout="nt")
    assert all(registry.get(n).unsupported(plain) is None for n in ("cublas", "cublaslt"))


@pytest.mark.skipif(HAS_GPU, reason="the interpreter path; GPU hosts run the GPU test")
def test_unrestricted_tune_of_an_int4_key_records_no_dense_failures(monkeypatch):
    """Every source allowed: the dense GEMM sources sit out with their reason, none is timed
    (or fails) on the int4 key's operands."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    key = key_of("int4-g32", 8, dtype="f16")
    outcome = tune_uncut(key, "cpu", budget_s=0.005)
    dense = [m for m in outcome.measurements if m.source in DENSE_SOURCES]
    assert dense and all(m.status == "unsupported" and m.error for m in dense), dense
    (triton_gemm,) = [m for m in dense if m.source == "triton_gemm"]
    assert "plain GEMMs only" in triton_gemm.error
    assert not [m for m in outcome.measurements if m.status == "failed"], outcome.measurements
    assert outcome.winner.source in ("torch_lowbit", "triton_w4a16")


@pytest.mark.cpu_host
def test_served_int4_runner_converts_each_weight_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    key = key_of("int4-g32", 2, k=256)
    x, packed, sz = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    fresh = packed.clone()  # a weight packed elsewhere: our layout is not known for it yet
    params = TritonW4A16().candidates(key, "cpu")[0]
    run = TritonW4A16().build(key, params)
    ref = samples.reference(key, (x, packed, sz))
    assert samples.relative_error(run(x, fresh, sz), ref) <= 1
    layout = int4_torch.ours(fresh)
    assert samples.relative_error(run(x, fresh, sz), ref) <= 1
    assert int4_torch.ours(fresh) is layout  # kept, not repacked
    fresh.copy_(int4_torch.torch_pack(torch.zeros(32, 256, dtype=torch.uint8)))  # changed in place
    assert int4_torch.ours(fresh) is not layout
    assert int(int4_torch.nibbles(fresh).max()) == 0


def test_bad_lowbit_inputs_raise_naming_the_field(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    key = key_of("int4-g32", 2, k=256)
    x, packed, sz = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    run = TritonW4A16().build(key, TritonW4A16().candidates(key, "cpu")[0])
    with pytest.raises(ValueError, match=r"scales_and_zeros\.shape"):
        run(x, packed, sz[:4].contiguous())
    with pytest.raises(ValueError, match=r"x\.dtype"):
        run(x.float(), packed, sz)
    with pytest.raises(ValueError, match=r"out: expected a \[2, 32\]"):
        run(x, packed, sz, out=torch.empty(2, 16, dtype=x.dtype))  # too small: never written
    with pytest.raises(ValueError, match=r"built for \(M, N, K\)=\(2, 32, 256\)"):
        run(x[:1], packed, sz)
    with pytest.raises(ValueError, match="config\\['bk'\\]"):
        TritonW4A16().build(key, {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 64})
    fkey = key_of("fp8-rowwise", 4)
    a, b, sa, sb = samples.make_inputs(fkey, "cpu", torch.Generator().manual_seed(0))
    frun = TritonFp8().build(fkey, TritonFp8().candidates(fkey, "cpu")[0])
    with pytest.raises(ValueError, match=r"scale_a\.dtype"):
        frun(a, b, sa.double(), sb)
    with pytest.raises(ValueError, match=r"b\.shape"):
        frun(a, b[:64], sa, sb)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize(
    "key",
    [key_of("int4-g128", m, n=4096, k=4096) for m in (1, 16, 256)]
    + [
        key_of(spec, m, n=4096, k=4096)
        for spec in ("fp8-rowwise", "fp8-tensorwise-fast")
        for m in (1, 16, 2048)
    ],
    ids=lambda k: k.label,
)
def test_lowbit_keys_tune_on_the_gpu(key):
    assert not interpreting()
    outcome = tune(key, options=TuneOptions(budget_s=0.05), device="cuda")
    assert any(
        m.is_baseline and m.source == "torch_lowbit" and m.status == "ok"
        for m in outcome.measurements
    )
    assert not [m for m in outcome.measurements if m.status == "rejected"]
    assert not [
        m for m in outcome.measurements if m.source in DENSE_SOURCES and m.status != "unsupported"
    ]
    ours = [
        m
        for m in outcome.measurements
        if m.source.startswith("triton_") and m.status in ("ok", "cut")
    ]
    assert ours, outcome.measurements
    assert outcome.winner.median_us <= outcome.winner.baseline_us


@pytest.mark.parametrize(
    ("capability", "refused"),
    [((7, 5), {"triton_w4a16", "dequant_gemm", "triton_fp8"}), ((8, 6), {"triton_fp8"}),
     ((8, 9), set())],
)  # fmt: skip
def test_triton_sources_refuse_gpus_below_their_formats_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], refused: set[str]
) -> None:
    """INT4 kernels need sm80, FP8 ones sm89: below that a source says why, naming both."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    reasons = {name: registry.get(name).unavailable("cuda")
               for name in ("triton_w4a16", "dequant_gemm", "triton_fp8")}  # fmt: skip
    assert {name for name, why in reasons.items() if why} == refused
    for name in refused:
        needs = "sm89" if name == "triton_fp8" else "sm80"
        assert f"compute capability {capability}" in reasons[name] and needs in reasons[name]
