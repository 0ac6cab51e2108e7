"""The Triton GEMM family: every kernel on every layout (CPU: Triton's interpreter, f32/f16 only;
GPU: bf16 too and the shortlists the engine times), the config spaces' pruning, param checking."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.candidates.triton_gemm import GemmRunner, TritonGemm, make_runner, precision
from tuner.candidates.triton_kernels import configs
from tuner.candidates.triton_kernels.launch import warm
from tuner.core.keys import GemmKey
from tuner.measure import samples
from tuner.offline.model_config import dense_align, gemm_key
from tuner.tuning.engine import TuneOptions, tune

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"

# small tiles keep the interpreter fast; the GPU runs the real configs in the gpu tests below
SMALL = {"bm": 16, "bn": 32, "bk": 16, "group_m": 4, "warps": 4, "stages": 2}
VARIANTS = {
    "tiled": {"kernel": "tiled", **SMALL},
    "splitk": {"kernel": "splitk", **SMALL, "split_k": 3},
    "gemv": {"kernel": "gemv", "bm": 4, "bn": 8, "bk": 32, "warps": 4},
    "persistent_tma": {"kernel": "persistent_tma", **SMALL},
    "tiled+pad": {"kernel": "tiled", **SMALL, "pad_k": True},
    "persistent_tma+pad": {"kernel": "persistent_tma", **SMALL, "pad_k": True},
}


def key_for(m: int, n: int, k: int, layout: str, dtype: str, batch: int = 1) -> GemmKey:
    lda = k if layout[0] == "n" else m
    ldb = n if layout[1] == "n" else k
    return GemmKey(m=m, n=n, k=k, batch=batch, layout=layout, dtype=dtype, out_dtype=dtype,
                   align=dense_align(dtype, lda, ldb))  # fmt: skip


def run_checked(key: GemmKey, params: dict, seed: int = 0) -> tuple[torch.Tensor, float]:
    """Run on fresh random inputs into a NaN-poisoned output; the relative error vs fp64."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    inputs = samples.make_inputs(key, DEVICE, gen)
    out = samples.output_like(key, inputs)
    runner = make_runner(key, params)
    res = runner(*inputs, out=out)
    assert res is out
    if HAS_GPU:  # the second call launches the compiled kernel directly: same bits
        again = runner(*inputs, out=samples.output_like(key, inputs))
        torch.cuda.synchronize()
        assert torch.equal(again, out), f"{params}: the direct relaunch differs from the first call"
    return out, samples.relative_error(out, samples.reference(key, inputs))


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_kernel_every_layout(variant: str, dtype: str, layout: str) -> None:
    params = VARIANTS[variant]
    m = 3 if variant == "gemv" else 37
    # odd K (unaligned rows) for the padded variants; TMA needs 16-byte rows otherwise
    k = 71 if "pad" in variant else 72
    key = key_for(m, 48 if variant.startswith("persistent") else 45, k, layout, dtype)
    if variant == "persistent_tma" and key.align < 16:
        with pytest.raises(ValueError, match="TMA needs 16-byte aligned rows"):
            make_runner(key, params)
        return
    _, err = run_checked(key, params)
    assert err <= samples.tolerance(key), f"{variant} {key}: relative error {err:.3g}"


@pytest.mark.parametrize("variant", ["tiled", "splitk", "gemv", "tiled+pad"])
def test_batched(variant: str) -> None:
    key = key_for(3 if variant == "gemv" else 20, 33, 50, "nt", "f32", batch=3)
    _, err = run_checked(key, VARIANTS[variant])
    assert err <= samples.tolerance(key)


def test_splitk_is_deterministic() -> None:
    key = key_for(9, 40, 200, "nt", "f32")
    params = {**VARIANTS["splitk"], "split_k": 5}
    first, _ = run_checked(key, params, seed=3)
    second, _ = run_checked(key, params, seed=3)
    assert torch.equal(first, second)


def test_tf32x3_is_as_accurate_as_fp32_tolerance() -> None:
    key = key_for(32, 32, 64, "nn", "f32")
    _, err = run_checked(key, {**VARIANTS["tiled"], "precision": "tf32x3"})
    assert err <= samples.tolerance(key)  # 1e-4: plain TF32 (~5e-4) would fail this


def test_legacy_params_without_kernel_build_the_tiled_kernel() -> None:
    key = key_for(20, 20, 20, "nn", "f32")
    _, err = run_checked(key, {"bm": 32, "bn": 32, "bk": 32, "group_m": 8, "warps": 4, "stages": 1})
    assert err <= samples.tolerance(key)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({**VARIANTS["tiled"], "kernel": "magic"}, "'kernel' must be one of"),
        ({**VARIANTS["tiled"], "bm": 48}, "'bm' must be one of"),
        ({**VARIANTS["tiled"], "warps": 3}, "'warps' must be one of"),
        ({**VARIANTS["splitk"], "split_k": 1}, "'split_k' must be one of"),
        ({**VARIANTS["gemv"], "bm": 2}, "gemv covers M <= bm"),
        ({**VARIANTS["gemv"], "pad_k": True}, "pad_k applies to the tensor-core kernels"),
        ({**VARIANTS["tiled"], "precision": "bf16x9"}, "precision must be"),
    ],
)
def test_bad_params_are_rejected_with_the_reason(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_runner(key_for(4, 32, 32, "nn", "f32"), params)


def test_precision_follows_the_key() -> None:
    assert precision(key_for(8, 8, 8, "nn", "f32")) == "ieee"
    tf32 = dataclasses.replace(key_for(8, 8, 8, "nn", "f32"), compute="tf32")
    assert precision(tf32, {"precision": "tf32x3"}) == "tf32"  # the key's TF32 switch wins
    assert precision(key_for(8, 8, 8, "nn", "f32"), {"precision": "tf32x3"}) == "tf32x3"


def test_too_large_for_int32_indexing_is_refused() -> None:
    key = key_for(65536, 65536, 8, "nn", "f16")
    with pytest.raises(ValueError, match="int32"):
        make_runner(key, VARIANTS["tiled"])


# --- config spaces -----------------------------------------------------------------------------

SPACE_KEYS = [
    gemm_key(m, n, k, layout="nt", dtype=d)
    for (m, n, k) in [(1, 6144, 4096), (4, 4096, 4096), (16, 4096, 14336), (127, 5120, 3333),
                      (128, 28672, 4096), (4097, 4099, 4101), (8192, 8192, 8192), (33, 17, 9)]
    for d in ("bf16", "f16", "f32", "tf32")
]  # fmt: skip


@pytest.mark.parametrize(
    "key", SPACE_KEYS, ids=lambda k: f"{k.m}x{k.n}x{k.k}-{k.dtype}-{k.compute}"
)
def test_space_is_pruned_by_shape_and_shared_memory(key: GemmKey) -> None:
    space = configs.space(key)
    assert space, "every key gets some candidates"
    for p in space:
        target = configs.padded_key(key) if p.get("pad_k") else key
        if p["kernel"] != "gemv":
            c_tile = p["kernel"] == "persistent_tma" and configs.c_tma_ok(target)
            smem = configs.smem_bytes(target, p["bm"], p["bn"], p["bk"], p["stages"], c_tile=c_tile)
            assert smem <= configs.SMEM_LIMIT, p
        assert p["bm"] <= max(16, configs.pow2_at_least(key.m)), f"tile taller than M: {p}"
        if p["kernel"] == "persistent_tma" and not p.get("pad_k"):
            assert key.align == 16
        make_runner(key, p)  # every config of the space builds (checks params)
    if key.m <= 16:
        assert max(p["bm"] for p in space) == 16  # no 64/128/256-row tile for decode


@pytest.mark.parametrize(
    "key", SPACE_KEYS, ids=lambda k: f"{k.m}x{k.n}x{k.k}-{k.dtype}-{k.compute}"
)
def test_shortlist_is_small_and_ranked(key: GemmKey) -> None:
    short = configs.shortlist(key, limit=16)
    assert 1 <= len(short) <= 16
    assert all(p in configs.space(key) for p in short)
    assert len({str(sorted(p.items())) for p in short}) == len(short)


def test_shortlists_match_the_regime() -> None:
    decode = configs.shortlist(gemm_key(1, 6144, 4096, layout="nt", dtype="bf16"))
    assert {"gemv", "splitk"} <= {p["kernel"] for p in decode}
    odd = configs.shortlist(gemm_key(4097, 4099, 4101, layout="nt", dtype="bf16"))
    assert odd[0].get("pad_k"), "odd large shapes should try the K-padded kernels first"
    f32 = configs.shortlist(gemm_key(1024, 4096, 4096, layout="nt", dtype="f32"))
    assert all(p.get("precision") == "tf32x3" for p in f32)
    big = configs.shortlist(gemm_key(8192, 8192, 8192, layout="nt", dtype="bf16"))
    assert any(p["kernel"] == "persistent_tma" for p in big)


# --- the source through the engine -------------------------------------------------------------


def test_source_is_registered_and_warm_is_a_no_op_in_the_interpreter() -> None:
    assert isinstance(registry.get("triton_gemm"), TritonGemm)
    if not HAS_GPU:
        assert warm([]).compiled == 0


@pytest.mark.skipif(HAS_GPU, reason="the interpreter's path")
def test_precompile_compiles_nothing_in_the_interpreter_and_the_candidates_still_run() -> None:
    key = key_for(24, 40, 56, "nt", "f32")
    source = TritonGemm()
    shortlist = [*source.candidates(key, "cpu"), VARIANTS["gemv"]]  # gemv refuses M=24
    source.precompile(key, shortlist)
    assert source.last_warm is not None
    assert (source.last_warm.requested, source.last_warm.compiled) == (1, 0)  # the tiled kernel
    _, err = run_checked(key, shortlist[0])
    assert err <= samples.tolerance(key)


def test_precompile_is_on_every_source_and_does_nothing_by_default() -> None:
    """The engine calls ``precompile`` on every source: those without a compiler inherit the
    protocol's default, which leaves the shortlist alone."""
    torch_gemm = registry.get("torch")
    assert type(torch_gemm).precompile is Source.precompile
    key = key_for(4, 8, 16, "nn", "f32")
    shortlist = torch_gemm.candidates(key, "cpu")
    before = [dict(p) for p in shortlist]
    assert torch_gemm.precompile(key, shortlist) is None
    assert shortlist == before
    for src in registry.sources():
        assert callable(src.precompile)


@pytest.mark.skipif(HAS_GPU, reason="the CPU path of the engine")
def test_engine_times_the_triton_candidate_on_cpu() -> None:
    key = key_for(24, 40, 56, "nt", "f32")
    outcome = tune(
        key,
        options=TuneOptions(budget_s=0.01, cut_factor=1e9, late_cut=1e9, sources=["triton_gemm"]),
    )
    ours = [m for m in outcome.measurements if m.source == "triton_gemm"]
    assert ours and all(m.status == "ok" for m in ours), [m.error for m in ours]
    assert all(m.max_rel_err <= samples.tolerance(key) for m in ours)


# --- GPU ---------------------------------------------------------------------------------------

GPU_KEYS = [
    gemm_key(1, 4096, 4096, layout="nt", dtype="bf16"),
    gemm_key(16, 2048, 8192, layout="nt", dtype="bf16"),
    gemm_key(256, 1024, 1024, layout="nt", dtype="f16"),
    gemm_key(257, 259, 261, layout="nt", dtype="bf16"),
    gemm_key(512, 512, 512, layout="nn", dtype="tf32"),
    gemm_key(256, 512, 512, layout="tn", dtype="f32"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize(
    "key", GPU_KEYS, ids=lambda k: f"{k.m}x{k.n}x{k.k}-{k.layout}-{k.dtype}-{k.compute}"
)
def test_gpu_every_shortlisted_config_is_correct(key: GemmKey) -> None:
    source = TritonGemm()
    shortlist = source.candidates(key, "cuda")
    source.precompile(key, shortlist)
    assert shortlist
    for p in shortlist:
        _, err = run_checked(key, p)
        assert err <= samples.tolerance(key), f"{p}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_gpu_fast_relaunch_matches_the_jit_path() -> None:
    key = gemm_key(8, 1024, 2048, layout="nt", dtype="bf16")
    runner = make_runner(key, {"kernel": "gemv", "bm": 8, "bn": 8, "bk": 256, "warps": 4})
    gen = torch.Generator(device="cuda").manual_seed(0)
    a, b = samples.make_inputs(key, "cuda", gen)
    first = runner(a, b).clone()  # JIT path (compiles or loads), then the one-time direct check
    assert runner.main.verified, "the direct relaunch reproduced the JIT launch"
    second = runner(a, b)  # direct path
    torch.cuda.synchronize()
    assert torch.equal(first, second)
    a2 = a[:, : key.k // 2]  # different strides than the first call: back through the JIT
    ref = samples.reference(dataclasses.replace(key, k=key.k // 2), (a2, b[: key.k // 2]))
    half = make_runner(
        dataclasses.replace(key, k=key.k // 2),
        {"kernel": "gemv", "bm": 8, "bn": 8, "bk": 256, "warps": 4},
    )
    assert samples.relative_error(half(a2, b[: key.k // 2]), ref) <= samples.tolerance(key)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_gpu_engine_measures_every_candidate_of_an_odd_shape() -> None:
    key = gemm_key(127, 517, 333, layout="nt", dtype="bf16")
    outcome = tune(key, options=TuneOptions(budget_s=0.02, sources=["triton_gemm"]))
    ours = [m for m in outcome.measurements if m.source == "triton_gemm"]
    assert ours and all(m.status in ("ok", "cut") for m in ours), [
        (m.params, m.error) for m in ours if m.status not in ("ok", "cut")
    ]


class _FakeLauncher:
    compiled = True

    def __init__(self) -> None:
        self.verified = False
        self.disabled = False
        self.trials: set[int] = set()

    @property
    def direct(self) -> bool:  # as ``Launcher.ready``: verified, or this thread's trial
        return self.verified or bool(self.trials)

    def disable(self) -> None:
        self.disabled, self.verified = True, False


class _Runner(GemmRunner):
    """Writes 1.0 through the JIT and ``direct`` through a verified (direct) launch."""

    def __init__(self, direct: float) -> None:
        super().__init__(key_for(4, 8, 16, "nn", "f32"))
        self.fake = _FakeLauncher()
        self.direct = direct

    def launchers(self) -> list:
        return [self.fake]

    def launch(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        c.fill_(self.direct if self.fake.direct else 1.0)


@pytest.mark.parametrize(("direct", "kept"), [(1.0, True), (2.0, False)])
def test_direct_relaunch_is_checked_once_against_the_jit(
    direct: float, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tuner.core.triton_launch.interpreting", lambda: False)
    runner = _Runner(direct)
    a, b = torch.ones(4, 16), torch.ones(16, 8)
    assert torch.equal(runner(a, b), torch.ones(4, 8))  # the first call's result stands
    assert runner.fake.verified is kept and runner.fake.disabled is not kept
    runner(a, b)  # checked once only
    assert runner.fake.disabled is not kept


@pytest.mark.parametrize(("text", "fast"), [("off", False), ("false", False), ("no", False),
                                            ("1", True), ("", True)])  # fmt: skip
def test_fast_launch_is_turned_off_by_the_usual_words(text: str, fast: bool) -> None:
    """``TUNER_TRITON_FAST_LAUNCH=false`` kept it on: only ``0`` and empty turned it off."""
    code = "from tuner.core import triton_launch; print(triton_launch.fast_launch())"
    env = os.environ | {"TUNER_TRITON_FAST_LAUNCH": text}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    assert out.stdout.split() == [str(fast)]
