"""cuBLAS, cuBLASLt and CUTLASS candidates on the GPU: every layout and dtype against fp64, tuning
through the engine, and rebuilt cuBLASLt winners that are the same algorithm."""

from __future__ import annotations

import pytest
import torch

from tuner.candidates import registry
from tuner.core.keys import GemmKey
from tuner.measure import samples, timing
from tuner.tuning.engine import TuneOptions, tune

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

LAYOUTS = ("nn", "nt", "tn", "tt")
MODES = [("bf16", "f32"), ("f16", "f32"), ("f32", "f32"), ("f32", "tf32")]


def key_of(
    dtype: str, compute: str, layout: str, m=192, n=256, k=320, batch=1, align=16
) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, batch=batch, layout=layout, dtype=dtype, out_dtype=dtype,
                   compute=compute, align=align)  # fmt: skip


def source(name: str):
    src = registry.get(name)
    reason = src.unavailable("cuda")
    if reason:
        pytest.skip(f"{name}: {reason}")
    return src


def errors(name: str, key: GemmKey, params_list: list[dict]) -> dict[str, float]:
    """Relative error against fp64 of every params' runner, into NaN-poisoned outputs."""
    src = source(name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = samples.make_inputs(key, "cuda", gen)
    ref = samples.reference(key, inputs)
    out: dict[str, float] = {}
    for params in params_list:
        runner = src.build(key, params)
        c = samples.output_like(key, inputs)
        assert runner(*inputs, out=c) is c
        fresh = runner(*inputs)
        torch.cuda.synchronize()
        out[str(params)] = max(samples.relative_error(c, ref), samples.relative_error(fresh, ref))
    return out


def assert_accurate(name: str, key: GemmKey, params_list: list[dict]) -> None:
    tol = samples.tolerance(key)
    errs = errors(name, key, params_list)
    bad = {p: e for p, e in errs.items() if not e <= tol}
    assert not bad, f"{name} {key}: errors above {tol}: {bad}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "compute"), MODES)
def test_cublas_every_layout_and_dtype(dtype, compute, layout):
    key = key_of(dtype, compute, layout)
    assert_accurate("cublas", key, source("cublas").candidates(key, "cuda"))


@pytest.mark.parametrize(("dtype", "compute"), MODES)
def test_cublas_odd_shapes_and_batches(dtype, compute):
    for key in (
        key_of(dtype, compute, "nn", m=33, n=47, k=61, align=4 if dtype == "f32" else 2),
        key_of(dtype, compute, "tn", batch=3, m=64, n=40, k=24),
    ):
        assert_accurate("cublas", key, [{"algo": -1}])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "compute"), MODES)
def test_cublaslt_every_heuristic_algorithm(dtype, compute, layout):
    key = key_of(dtype, compute, layout)
    candidates = source("cublaslt").candidates(key, "cuda")
    assert len(candidates) >= 2, candidates
    assert_accurate("cublaslt", key, candidates)


@pytest.mark.parametrize(("dtype", "compute"), MODES)
def test_cublaslt_odd_shapes_and_batches(dtype, compute):
    for key in (
        key_of(dtype, compute, "nn", m=33, n=47, k=61, align=4 if dtype == "f32" else 2),
        key_of(dtype, compute, "nt", batch=3, m=64, n=40, k=24),
    ):
        assert_accurate("cublaslt", key, source("cublaslt").candidates(key, "cuda")[:4])


def test_cublaslt_rebuilt_winner_is_the_same_algorithm():
    from tuner.candidates import cublaslt

    source("cublaslt")
    key = GemmKey(m=128, n=28672, k=4096)
    outcome = tune(key, options=TuneOptions(budget_s=0.05, sources=["cublaslt"]))
    timed = [m for m in outcome.measurements if m.source == "cublaslt" and m.status == "ok"]
    assert len(timed) >= 2
    best = min(timed, key=lambda m: m.median_us)
    runner = registry.get("cublaslt").build(key, best.params)
    assert runner.rebuilt  # AlgoInit + config attributes passed AlgoCheck
    assert cublaslt.read_config(runner.algo) == cublaslt.to_config(best.params, cublaslt._enums())
    # the winner is still among the heuristic's algorithms, with exactly this configuration
    heuristic = cublaslt._Descriptors(key, cublaslt.ops.packed_call(key)).heuristic(
        runner.handle, cublaslt._Alignments.of(key), cublaslt.HEURISTIC_LIMIT
    )
    configs = [cublaslt.read_config(heuristic["algo"][i : i + 1]) for i in range(len(heuristic))]
    assert cublaslt.read_config(runner.algo) in configs
    # and it computes what the timed candidate computed
    assert_accurate("cublaslt", key, [best.params])


def test_cuda_arrays_of_cupy_come_back_as_cupy():
    cupy = pytest.importorskip("cupy")
    key = key_of("f16", "f32", "nn")
    a = cupy.random.standard_normal((key.m, key.k), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((key.k, key.n), dtype=cupy.float32).astype(cupy.float16)
    ref = torch.from_dlpack(a).double() @ torch.from_dlpack(b).double()
    for name in ("cublas", "cublaslt"):
        src = source(name)
        c = src.build(key, src.candidates(key, "cuda")[0])(a, b)
        assert isinstance(c, cupy.ndarray)
        assert samples.relative_error(torch.from_dlpack(c), ref) < 5e-3


def queued_behind_a_busy_stream(runner, key: GemmKey) -> float:
    """Launch on a side stream kept busy: what the default stream sees right after, and later."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    a, b = samples.make_inputs(key, "cuda", gen)
    out = torch.zeros(key.m, key.n, dtype=a.dtype, device="cuda")
    runner(a, b, out=out)  # first calls load libraries and make handles: longer than the sleep
    out.zero_()
    # the read below, once first: its first run in a process waits for the side stream's work, so
    # whichever runner came first would fail (cuBLASLt too, run alone)
    out.float().abs().sum().item()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time before the GEMM on this stream
        runner(a, b, out=out)
    early = out.float().abs().sum().item()  # on the default stream: must not wait for the GEMM
    stream.synchronize()
    assert samples.relative_error(out, a.double() @ b.double()) <= samples.tolerance(key)
    return early


@pytest.mark.parametrize("name", ["cublas", "cublaslt"])
def test_runners_use_the_current_stream(name):
    key = key_of("bf16", "f32", "nn", m=1024, n=1024, k=1024)
    src = source(name)
    assert queued_behind_a_busy_stream(src.build(key, src.candidates(key, "cuda")[0]), key) == 0.0


@pytest.mark.parametrize("name", ["cublas", "cublaslt"])
def test_runners_are_captured_in_a_cuda_graph(name):
    """A runner that cannot be captured cannot serve a step run as a graph, and loses every duel."""
    key = key_of("bf16", "f32", "nt", m=256, n=1024, k=1024)
    src = source(name)
    runner = src.build(key, src.candidates(key, "cuda")[0])
    a, b = samples.make_inputs(key, "cuda", torch.Generator(device="cuda").manual_seed(0))
    assert timing.graph_time(lambda i: runner(a, b)).median_us > 0  # raises if not captured
    out = torch.empty_like(runner(a, b))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runner(a, b, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert samples.relative_error(out, a.double() @ b.double()) <= samples.tolerance(key)


def test_cublas_gemms_on_two_streams_at_once_each_have_their_own_workspace():
    """Long-K GEMMs (split-K: their partial sums live in the workspace) on two streams at once
    stay right: each stream has its own workspace, not cuBLAS's default pool, shared."""
    from tuner.candidates import cublas

    key = key_of("bf16", "f32", "nn", m=64, n=128, k=32768)
    runner = source("cublas").build(key, {"algo": -1})
    gen = torch.Generator(device="cuda").manual_seed(2)
    pairs = [samples.make_inputs(key, "cuda", gen) for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[torch.empty(key.m, key.n, dtype=torch.bfloat16, device="cuda") for _ in range(20)]
            for _ in streams]  # fmt: skip
    torch.cuda.synchronize()
    for i in range(20):
        for s, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                runner(*pairs[s], out=outs[s][i])
    torch.cuda.synchronize()
    for (a, b), written in zip(pairs, outs, strict=True):
        want = a.double() @ b.double()
        assert max(samples.relative_error(o, want) for o in written) <= samples.tolerance(key)
    handle = cublas._HANDLES.get(torch.device("cuda"))
    spaces = cublas._WORKSPACES[handle].by_stream
    assert {s.cuda_stream for s in streams} <= set(spaces)
    assert len({spaces[s.cuda_stream][0] for s in streams}) == 2


def test_graph_timings_reuse_one_side_stream_so_workspaces_do_not_pile_up():
    """Every duel times graphs: a fresh capture stream each time would leave the cuBLAS runner
    a 32 MiB workspace per stream torch's pool hands out (32 of them), for the process's life."""
    from tuner.candidates import cublas

    key = key_of("bf16", "f32", "nt", m=64, n=256, k=512)
    runner = source("cublas").build(key, {"algo": -1})
    a, b = samples.make_inputs(key, "cuda", torch.Generator(device="cuda").manual_seed(0))
    runner(a, b)
    spaces = cublas._WORKSPACES[cublas._HANDLES.get(torch.device("cuda"))].by_stream
    before = set(spaces)
    for _ in range(40):
        timing.graph_time(lambda i: runner(a, b), calls=2, budget_s=0.001)
    assert set(spaces) <= before | {timing.side_stream().cuda_stream}  # at most one more


# --- CUTLASS: one compile per (dtypes, layouts, config), all compiled in parallel up front -------

CUTLASS_KEYS = [key_of("bf16", "f32", layout, m=512, n=512, k=512) for layout in LAYOUTS] + [
    key_of("f16", "f32", "nn", m=512, n=512, k=512),
    key_of("f32", "tf32", "nt", m=512, n=512, k=512),
    key_of("bf16", "f32", "nn", m=384, n=256, k=512, batch=3),
]


@pytest.fixture(scope="module")
def cutlass_params():
    """The first offered large-problem config per key, all compiled in parallel up front."""
    from dataclasses import replace

    from tuner.candidates import cutlass_env, cutlass_gemm

    source("cutlass")
    chosen = {}
    for key in CUTLASS_KEYS:
        large = replace(key, m=4096, n=4096, k=4096, batch=1)
        chosen[key] = next(iter(cutlass_gemm.offered(large).values()))
    specs = [cutlass_gemm.kernel_spec(k, p) for k, p in chosen.items()]
    return chosen, cutlass_env.compile_all(specs)


@pytest.mark.parametrize("index", range(len(CUTLASS_KEYS)))
def test_cutlass_layouts_and_dtypes(cutlass_params, index):
    from tuner.candidates import cutlass_gemm

    chosen, compile_errors = cutlass_params
    key = CUTLASS_KEYS[index]
    spec = cutlass_gemm.kernel_spec(key, chosen[key])
    assert compile_errors[spec] is None, compile_errors[spec]
    assert_accurate("cutlass", key, [chosen[key], {**chosen[key], "swizzle": 2}])


def test_cutlass_tunes_through_the_engine():
    source("cutlass")
    key = GemmKey(m=4096, n=4096, k=4096)
    outcome = tune(key, options=TuneOptions(budget_s=0.05, sources=["cutlass"], max_candidates=3))
    timed = [m for m in outcome.measurements if m.source == "cutlass" and m.status == "ok"]
    assert timed, [(m.candidate, m.status, m.error) for m in outcome.measurements]


def test_cutlass_runs_on_the_current_stream(cutlass_params):
    chosen, _ = cutlass_params
    key = CUTLASS_KEYS[0]
    runner = registry.get("cutlass").build(key, chosen[key])
    assert queued_behind_a_busy_stream(runner, key) == 0.0


def test_cutlass_prepare_builds_the_plan_that_load_needs():
    """The engine runs ``prepare`` while the compile pool works and only logs its failures, so a
    broken ``prepare`` would go unseen: call it directly, from an empty plan cache."""
    from tuner.candidates import cutlass_env

    cutlass = source("cutlass")
    key = CUTLASS_KEYS[0]
    cutlass_env._tile_descriptions.cache_clear()
    cutlass.prepare(key, cutlass.candidates(key, "cuda"))
    assert cutlass_env._tile_descriptions.cache_info().currsize == 1


LOAD_IN_A_FRESH_PROCESS = """
import json, os, sys, tempfile
moves, chdir = [], os.chdir
os.chdir = lambda path: (moves.append(str(path)), chdir(path))[1]
from tuner.candidates import cutlass_env
op = cutlass_env.load(cutlass_env.KernelSpec.from_json(sys.argv[1]))
print(json.dumps({"name": op.procedural_name(), "moves": moves, "tempdir": tempfile.tempdir,
                  "cwd": os.getcwd(), "files": sorted(os.listdir("."))}))
"""


def test_loading_a_compiled_kernel_leaves_the_working_directory_be(cutlass_params, tmp_path):
    """A winner loads in a background thread while the model's threads run: a load from the
    compile cache (a fresh process, so from the file) changes no directory and writes nothing
    where the process stands, and leaves ``tempfile.tempdir`` as it was."""
    import json
    import os
    import subprocess
    import sys

    from tuner.candidates import cutlass_gemm, nvcc_build

    chosen, compile_errors = cutlass_params
    spec = cutlass_gemm.kernel_spec(CUTLASS_KEYS[0], chosen[CUTLASS_KEYS[0]])
    assert compile_errors[spec] is None, compile_errors[spec]
    env = os.environ | {"CUTLASS_CACHE_DIR": str(nvcc_build.cache_dir().resolve())}
    run = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, spec.to_json()],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert loaded["name"]
    assert loaded["moves"] == [] and loaded["cwd"] == str(tmp_path)
    assert loaded["tempdir"] is None and loaded["files"] == []
