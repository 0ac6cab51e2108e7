"""cuBLASLt and CUTLASS FP8 candidates on the GPU, on small and Llama-3-8B-like shapes: every
candidate built and run into NaN-poisoned outputs against the float32 reference of the
dequantized operands (within the format's bound) and beside ``torch._scaled_mm``; a second input
set with other scales shows the scales are read per call; both tune through the engine. The
cuBLASLt runner also over moving scale pointers, new strides, a replayed graph and two threads."""

from __future__ import annotations

import pytest
import torch

from tests.candidates.test_cutlass_launcher import assert_right, assert_right_from_two_threads
from tuner.candidates import cutlass_env, cutlass_fp8, kernel_artifacts, registry
from tuner.candidates.torch_lowbit import scaled_mm_runner
from tuner.core.keys import DTYPES, GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant.tolerance import excess
from tuner.tuning.engine import TuneOptions, tune

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

SPECS = ("fp8-tensorwise", "fp8-rowwise", "fp8-tensorwise-fast", "fp8-rowwise-fast")
SHAPES = [(5, 256, 512), (16, 6144, 4096), (2048, 4096, 14336)]  # small; Llama-3-8B qkv, down


def fp8(spec: str, m: int, n: int, k: int, **fields) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **{**lowbit_fields(spec), **fields})


def source(name: str, key: GemmKey):
    src = registry.get(name)
    reason = src.unavailable("cuda") or src.unsupported(key)
    if reason:
        pytest.skip(f"{name}: {reason}")
    return src


def check(name: str, key: GemmKey, shortlist: list[dict]) -> None:
    """Each params' runner within the format's bound of the reference on two input sets (a stale
    scale would be off by 2x), into a caller's buffer and a fresh one, and within twice that
    bound of ``torch._scaled_mm`` on the same operands."""
    src = source(name, key)
    assert shortlist, f"{name} has no candidates for {key}"
    baseline = scaled_mm_runner(DTYPES[key.out_dtype], key.accum == "fast")
    gen = torch.Generator(device="cuda").manual_seed(0)
    first = samples.make_inputs(key, "cuda", gen)
    a, b, scale_a, scale_b = samples.make_inputs(key, "cuda", gen)
    sets = [first, (a, b, scale_a * 2, scale_b / 4)]  # scales far from the first set's
    refs = [samples.reference(key, inputs) for inputs in sets]
    for inputs, ref in zip(sets, refs, strict=True):
        assert samples.relative_error(baseline(*inputs), ref) <= 1
    failures = {}
    for params in shortlist:
        runner = src.build(key, params)
        for inputs, ref in zip(sets, refs, strict=True):
            out = samples.output_like(key, inputs)
            assert runner(*inputs, out=out) is out
            fresh = runner(*inputs)
            torch.cuda.synchronize()
            theirs = baseline(*inputs)
            errors = (
                samples.relative_error(out, ref),
                samples.relative_error(fresh, ref),
                excess(out, theirs.float(), 2 * ref.tol),
            )
            if not max(errors) <= 1:
                failures[str(params)] = errors
    assert not failures, failures


# --- cuBLASLt ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("spec", SPECS)
def test_cublaslt_fp8_every_heuristic_algorithm(spec, shape):
    key = fp8(spec, *shape)
    check("cublaslt_fp8", key, source("cublaslt_fp8", key).candidates(key, "cuda"))


@pytest.mark.parametrize("out_dtype", ["f16", "f32"])
def test_cublaslt_fp8_other_outputs_and_e5m2_weights(out_dtype):
    for key in (
        fp8("fp8-tensorwise", 64, 512, 1024, out_dtype=out_dtype),
        fp8("fp8-tensorwise-fast", 64, 512, 1024, out_dtype=out_dtype, wdtype="fp8_e5m2"),
    ):
        check("cublaslt_fp8", key, source("cublaslt_fp8", key).candidates(key, "cuda")[:4])


def test_cublaslt_fp8_rowwise_is_taken_or_declined_with_its_reason():
    src = registry.get("cublaslt_fp8")
    if src.unavailable("cuda"):
        pytest.skip(src.unavailable("cuda"))
    for accum in ("f32", "fast"):
        key = fp8("fp8-rowwise", 16, 4096, 4096, accum=accum)
        reason = src.unsupported(key)
        if reason is None:
            assert src.candidates(key, "cuda")
        else:
            assert "outer-vector (rowwise)" in reason, reason


def padded(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The same operands with 16 bytes of padding after every row of a and column of b."""
    a, b, scale_a, scale_b = inputs
    wide_a = torch.empty(a.shape[0], a.shape[1] + 16, dtype=a.dtype, device=a.device)
    wide_b = torch.empty(b.shape[1], b.shape[0] + 16, dtype=b.dtype, device=b.device)
    wide_a[:, : a.shape[1]] = a
    wide_b[:, : b.shape[0]] = b.T
    return wide_a[:, : a.shape[1]], wide_b[:, : b.shape[0]].T, scale_a, scale_b


@pytest.mark.parametrize("spec", ["fp8-rowwise", "fp8-tensorwise"])
def test_cublaslt_fp8_runner_follows_pointers_strides_and_graphs(spec):
    """One runner over input sets whose scales move every call, padded then packed rows, and a
    CUDA graph replayed after eager calls moved the scale pointers: each call gives its own
    inputs' result (the descriptors are found by strides and keep the last pointers set)."""
    key = fp8(spec, 384, 768, 512)
    run = source("cublaslt_fp8", key).build(
        key, registry.get("cublaslt_fp8").candidates(key, "cuda")[0]
    )
    gen = torch.Generator("cuda").manual_seed(4)
    sets = [samples.make_inputs(key, "cuda", gen) for _ in range(3)]
    for inputs in [*sets, padded(sets[1]), sets[1], *sets]:
        assert_right(run, key, inputs)
        assert_right(run, key, inputs, samples.output_like(key, inputs))
    out = samples.output_like(key, sets[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*sets[0], out=out)
    assert_right(run, key, sets[2])
    out.fill_(float("nan"))
    graph.replay()
    assert samples.relative_error(out, samples.reference(key, sets[0])) <= 1


def test_cublaslt_fp8_one_runner_called_from_two_threads():
    """The dispatcher hands one runner to every caller: threads on their own streams, with
    their own scales, must not run with one another's scale pointers or workspace."""
    key = fp8("fp8-rowwise", 384, 768, 512)
    run = source("cublaslt_fp8", key).build(
        key, registry.get("cublaslt_fp8").candidates(key, "cuda")[0]
    )
    assert_right_from_two_threads(run, key, seed=5)


def test_cublaslt_fp8_tunes_through_the_engine():
    key = fp8("fp8-tensorwise", 16, 4096, 4096)
    source("cublaslt_fp8", key)
    outcome = tune(key, options=TuneOptions(sources=["cublaslt_fp8"], budget_s=0.05), device="cuda")
    ours = [m for m in outcome.measurements if m.source == "cublaslt_fp8"]
    assert ours and all(m.status in ("ok", "cut") for m in ours), ours
    assert outcome.winner.median_us <= outcome.winner.baseline_us


# --- CUTLASS -------------------------------------------------------------------------------------

# Keys and how many of their shortlist's configs are tested: every (scale, accumulation) pair,
# small and large shapes; the large ones include the derived 128x192 CTAs, whose last column of
# tiles is partial where N = 4096.
CUTLASS_CASES = [
    (fp8("fp8-tensorwise", 16, 6144, 4096), 3),
    (fp8("fp8-rowwise", 2048, 4096, 14336), 3),
    (fp8("fp8-rowwise", 5, 256, 512), 1),
    (fp8("fp8-tensorwise-fast", 2048, 4096, 4096), 1),
    (fp8("fp8-rowwise-fast", 16, 6144, 4096), 2),
]


@pytest.fixture(scope="module")
def cutlass_compiled() -> dict[cutlass_env.KernelSpec, str | None]:
    """Every kernel the CUTLASS tests use, compiled at once (in parallel processes)."""
    src = registry.get("cutlass_fp8")
    if src.unavailable("cuda"):
        pytest.skip(src.unavailable("cuda"))
    specs = [
        cutlass_fp8.kernel_spec(key, p)
        for key, count in CUTLASS_CASES
        for p in cutlass_fp8.shortlist(key)[:count]
    ]
    kernel_artifacts.install_missing(specs)
    return cutlass_env.compile_all(specs)


@pytest.mark.parametrize(("key", "count"), CUTLASS_CASES, ids=lambda v: getattr(v, "label", v))
def test_cutlass_fp8_configs_against_scaled_mm(cutlass_compiled, key, count):
    shortlist = cutlass_fp8.shortlist(key)[:count]
    errors = {
        str(p): cutlass_compiled[cutlass_fp8.kernel_spec(key, p)]
        for p in shortlist
        if cutlass_compiled[cutlass_fp8.kernel_spec(key, p)] is not None
    }
    assert not errors, errors
    offered = registry.get("cutlass_fp8").candidates(key, "cuda")
    assert all(p in offered for p in shortlist), (shortlist, offered)
    check("cutlass_fp8", key, shortlist)


def test_cutlass_fp8_tunes_through_the_engine(cutlass_compiled):
    key = CUTLASS_CASES[0][0]
    outcome = tune(key, options=TuneOptions(sources=["cutlass_fp8"], budget_s=0.05), device="cuda")
    ours = [m for m in outcome.measurements if m.source == "cutlass_fp8"]
    assert ours and all(m.status in ("ok", "cut") for m in ours), ours
    assert outcome.winner.median_us <= outcome.winner.baseline_us
