"""The low-bit Triton sources precompile their shortlists: ``jobs`` describe exactly the kernel
launches a first call makes (kernel, argument dtypes and alignments, integers, constexprs, warps
and stages), and on the GPU a candidate's first call after ``precompile`` compiles nothing in
the process that times it (it loads what the compile workers left in Triton's on-disk cache).
CPU: the interpreter runs the kernels (so the launches can be compared) and compiles nothing."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

from tuner.candidates.triton_fp8 import TritonFp8
from tuner.candidates.triton_kernels import fp8 as fp8_kernels
from tuner.candidates.triton_kernels import launch, w4a16
from tuner.candidates.triton_kernels.launch import WarmJob
from tuner.candidates.triton_w4a16 import TritonW4A16
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant import fp8, int4

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
LAUNCH_OPTIONS = ("num_warps", "num_stages")


def key_of(spec: str, m: int, n: int, k: int) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **lowbit_fields(spec))


def spec(arg: Any) -> Any:
    """What Triton specializes a kernel argument on: a tensor's dtype and 16-byte alignment (a
    ``FakeTensor`` stands for one); any other argument as is (a stricter comparison)."""
    if hasattr(arg, "data_ptr"):
        return arg.dtype, arg.data_ptr() % 16 == 0
    return arg


def launched(monkeypatch: pytest.MonkeyPatch, call: Callable[[], Any]) -> list[tuple]:
    """(kernel, argument specs, keyword arguments) of every Triton launch ``call`` makes."""
    kernel_type = type(w4a16.w4a16_tiled)
    run = kernel_type.run
    seen: list[tuple] = []

    def recording(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        seen.append((self, [spec(a) for a in args], kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(kernel_type, "run", recording)
        call()
    return seen


def described(jobs: list[WarmJob]) -> list[tuple]:
    return [(job.fn, [spec(a) for a in job.args], job.kwargs) for job in jobs]


W4_CASES = [  # (m, group, activation dtype, config)
    (3, 32, torch.bfloat16, {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 128, "dots": 2,
                             "split_k": 1, "group_m": 1, "warps": 4, "stages": 2}),
    (1, 64, torch.float16, {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 128, "dots": 1,
                            "split_k": 2, "group_m": 1, "warps": 4, "stages": 3}),
    (20, 128, torch.bfloat16, {"kernel": "tiled", "bm": 16, "bn": 16, "bk": 128, "dots": 1,
                               "split_k": 2}),
]  # fmt: skip


@pytest.mark.parametrize(("m", "group", "dtype", "config"), W4_CASES)
def test_w4a16_jobs_are_the_first_calls_launch(monkeypatch, m, group, dtype, config) -> None:
    n, k = 40, 256
    q, sz = int4.quantize(torch.randn(n, k, dtype=dtype, device=DEVICE), group)
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    w4a16.plan.cache_clear()  # a plan's first call goes through the JIT, later ones may not
    calls = launched(monkeypatch, lambda: w4a16.w4a16_matmul(x, int4.pack(q), sz, group, config))
    jobs = w4a16.checked_plan(m, n, k, group, config).jobs(dtype)
    assert calls == described(jobs)


FP8_CASES = [  # (m, rowwise, precise, out dtype, config)
    (5, True, True, torch.bfloat16, {"kernel": "tiled", "bm": 16, "bn": 16, "bk": 32, "split_k": 3}),
    (20, False, False, torch.float32, {"kernel": "tiled", "bm": 16, "bn": 32, "bk": 64,
                                       "group_m": 1, "warps": 4, "stages": 4}),
    (33, True, False, torch.bfloat16, {"kernel": "persistent_tma", "bm": 16, "bn": 32, "bk": 32}),
]  # fmt: skip


@pytest.mark.parametrize(("m", "rowwise", "precise", "out_dtype", "config"), FP8_CASES)
def test_fp8_jobs_are_the_first_calls_launches(
    monkeypatch, m, rowwise, precise, out_dtype, config
) -> None:
    n, k = 40, 96
    quant = fp8.quantize_rowwise if rowwise else fp8.quantize_tensorwise
    a, sa = quant(torch.randn(m, k, device=DEVICE), "e4m3")
    b, sb = quant(torch.randn(n, k, device=DEVICE), "e5m2")
    out = torch.empty(m, n, dtype=out_dtype, device=DEVICE)
    calls = launched(monkeypatch, lambda: fp8_kernels.fp8_matmul(a, b, sa, sb, config, out=out,
                                                                 precise=precise))  # fmt: skip
    jobs = fp8_kernels.jobs(m, n, k, config, rowwise=rowwise, precise=precise,
                            out_dtype=out_dtype, b_dtype=torch.float8_e5m2)  # fmt: skip
    assert len(calls) == 1  # split-K partials are summed in the kernel: no reduce launch
    assert calls == described(jobs)


SHORTLIST_KEYS = (
    [key_of("int4-g128", m, 4096, 4096) for m in (16, 256)]
    + [key_of("fp8-rowwise", m, 4096, 4096) for m in (16, 512)]
    + [key_of("fp8-rowwise-fast", 16, 4096, 4096)]
)  # fast accumulation: PROMOTE=None


def source_of(key: GemmKey) -> TritonW4A16 | TritonFp8:
    return TritonW4A16() if key.wdtype == "int4" else TritonFp8()


def jobs_of(key: GemmKey, params: dict[str, Any]) -> list[WarmJob]:
    if key.wdtype == "int4":
        return w4a16.checked_plan(key.m, key.n, key.k, key.group, params).jobs(torch.bfloat16)
    return fp8_kernels.jobs(key.m, key.n, key.k, params, rowwise=key.scale == "row",
                            precise=key.accum == "f32")  # fmt: skip


@pytest.mark.parametrize("key", SHORTLIST_KEYS, ids=lambda k: k.label)
def test_every_shortlisted_config_has_jobs_that_bind_to_its_kernels(key: GemmKey) -> None:
    """Each config of a tuning shortlist: its main kernel's job carries the config's tile,
    warps and stages, and every job binds to its kernel's signature argument for argument (a
    job that does not bind would compile nothing the runner launches)."""
    tile = {"bm": "BM", "bn": "BN", "bk": "BK", "group_m": "GROUP_M", "split_k": "SPLIT_K",
            "dots": "DOTS", "warps": "num_warps", "stages": "num_stages"}  # fmt: skip
    for params in source_of(key).candidates(key, "cuda"):
        jobs = jobs_of(key, params)
        main = jobs[0].kwargs
        assert {tile[p]: v for p, v in params.items() if p in tile} == {
            name: main[name] for p, name in tile.items() if p in params
        }, params
        for job in jobs:
            consts = {k: v for k, v in job.kwargs.items() if k not in LAUNCH_OPTIONS}
            inspect.signature(job.fn.fn).bind(*job.args, **consts)


@pytest.mark.skipif(HAS_GPU, reason="the interpreter's path")
@pytest.mark.parametrize("spec_name", ["int4-g32", "fp8-rowwise", "fp8-tensorwise-fast"])
def test_precompile_in_the_interpreter_compiles_nothing_and_candidates_still_run(
    spec_name: str,
) -> None:
    """A config that does not build is left out of the jobs (its build raises later)."""
    key = key_of(spec_name, 5, 32, 128)
    source = source_of(key)
    shortlist = source.candidates(key, "cpu")
    bad = {**shortlist[0], "kernel": "gemv"}
    source.precompile(key, [*shortlist, bad])
    report = source.last_warm
    assert report is not None and report.compiled == 0 and not report.errors
    assert report.requested == sum(len(jobs_of(key, p)) for p in shortlist) > 0
    inputs = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    ref = samples.reference(key, inputs)
    for params in shortlist:
        assert samples.relative_error(source.build(key, params)(*inputs), ref) <= 1, params


# --- GPU ---------------------------------------------------------------------------------------


def _new_compile_pool() -> None:
    """Shut the compile workers down: the next ``launch.warm`` spawns them with this
    environment (their Triton cache directory)."""
    with launch._pool_lock:
        if launch._pool is not None:
            launch._pool.shutdown(wait=True)
        launch._pool = None


@pytest.fixture
def empty_triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty Triton cache directory for this process and its compile workers: a kernel found
    there was compiled by ``precompile``."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    _new_compile_pool()
    yield
    monkeypatch.undo()
    _new_compile_pool()  # later tests' workers write to their cache directory again


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("key", SHORTLIST_KEYS, ids=lambda k: k.label)
def test_gpu_first_calls_after_precompile_compile_nothing(key: GemmKey, empty_triton_cache) -> None:
    source = source_of(key)
    shortlist = source.candidates(key, "cuda")
    source.precompile(key, shortlist)
    report = source.last_warm
    assert report is not None and not report.errors, report
    compiled: list[str] = []
    loaded: set[str] = set()

    def listener(*, src: Any, metadata: dict[str, Any], cache_hit: bool, **_: Any) -> None:
        if cache_hit:
            loaded.add(metadata["hash"])
        else:  # named with what it was specialized on, to compare with the jobs
            consts = {src.fn.arg_names[k[0]]: v for k, v in src.constants.items()}
            compiled.append(f"{src.name} {metadata['hash']} {consts} attrs={src.attrs}"
                            f" warps={metadata['num_warps']} stages={metadata['num_stages']}")  # fmt: skip

    # the samples first: a rowwise FP8 key quantizes its activations with a Triton kernel of its
    # own, compiled where the inputs are made, which no candidate's precompile is asked to cover
    inputs = samples.make_inputs(key, "cuda", torch.Generator(device="cuda").manual_seed(0))
    ref = samples.reference(key, inputs)
    knobs = triton.knobs.compilation
    before, knobs.listener = knobs.listener, listener
    try:
        for params in shortlist:
            out = source.build(key, params)(*inputs)
            assert samples.relative_error(out, ref) <= samples.tolerance(key), params
        torch.cuda.synchronize()
    finally:
        knobs.listener = before
    assert compiled == [], f"compiled in the timing process: {compiled}"
    assert len(loaded) == report.compiled  # each kernel precompile compiled, loaded once
