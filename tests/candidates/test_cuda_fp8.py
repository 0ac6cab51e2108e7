"""The CUDA FP8 decode kernel (tuner.candidates.cuda_fp8): its config checks, shared-memory rule,
shortlists, the keys its source takes and why not the others, its libraries, operands it refuses,
and one library built by nvcc and loaded (CPU, where nvcc is); on a GPU, every config against
the float32 GEMM on the dequantized operands (ragged N, M of one n8 tile or two, e4m3 / e5m2
mixes, bf16 / f16 / f32 out, tensorwise and rowwise scales, clusters), bit-identical from one
call to the next, a planted wrong scale caught, a CUDA graph, a call that reads what the kernel
before it wrote, the runner's operand checks and every shortlisted config tuned through the
engine's numerics gate."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from tuner.cache.artifacts import ArtifactStore, unpack
from tuner.candidates import cuda_fp8 as cf
from tuner.candidates import cuda_library, kernel_artifacts, nvcc_build, registry
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.quant import fp8
from tuner.quant.tolerance import FP8_TENSOR_CORE_ACCUMULATE, excess, gemm_tolerance
from tuner.tuning.engine import TuneOptions, tune

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def key_of(spec: str, m: int, n: int = 4096, k: int = 14336, **extra) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **{**lowbit_fields(spec), **extra})


def cfg(
    slices: int = 2, stages: int = 3, warps: int = 8, cluster: int = 1, chunk: int = 128
) -> dict:
    return {"slices": slices, "stages": stages, "chunk": chunk, "warps": warps, "cluster": cluster}


@pytest.fixture
def store(tmp_path, monkeypatch) -> ArtifactStore:
    """A kernel cache and an artifact store of this test's own."""
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "cache"))
    shared = ArtifactStore(tmp_path / "store")
    monkeypatch.setattr(kernel_artifacts, "shared_store", lambda: shared)
    return shared


def test_configs_are_checked_field_by_field() -> None:
    cf.check_config(cfg(), 8, 4096, 14336)
    cf.check_config(cfg(4, 2, 8, 8), 16, 3584, 18944)
    bad = [
        (dict(cfg(), slices=3), 1, "config['slices']=3"),
        (dict(cfg(), slices=True), 1, "config['slices']=True"),
        (dict(cfg(), stages=9), 1, "config['stages']=9"),
        (dict(cfg(), chunk=64), 1, "config['chunk']=64"),
        (dict(cfg(), warps=0), 1, "config['warps']=0"),
        (dict(cfg(), cluster=9), 1, "config['cluster']=9"),
        ({**cfg(), "split": "k"}, 1, "unknown keys ['split']"),
        (cfg(), 17, "M=17"),
        (cfg(), 0, "M=0"),
        (cfg(2, 2, 16), 9, "config['warps']=16: allowed 1 to 8"),
    ]
    for config, m, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            cf.check_config(config, m, 4096, 4096)
    cf.check_config(cfg(1, 2, 16), 16, 4096, 4096)  # 16-row warps keep 16 warps at two n8 tiles
    with pytest.raises(ValueError, match="K=200"):
        cf.check_config(cfg(), 1, 64, 200)
    with pytest.raises(ValueError, match="K=128"):
        cf.check_config(cfg(cluster=2), 1, 64, 128)
    with pytest.raises(
        ValueError, match=re.escape("K=384: must be whole chunks of config['chunk']=256")
    ):
        cf.check_config(cfg(chunk=256), 1, 64, 384)
    with pytest.raises(ValueError, match="N=0"):
        cf.check_config(cfg(), 1, 0, 128)
    with pytest.raises(ValueError, match="shared memory"):  # 16 rings of 8 stages of 9 KB
        cf.check_config(cfg(4, 8, 16), 8, 4096, 4096)


def test_shared_memory_is_the_rings_or_the_partial_sums() -> None:
    # 32 rows: 4 KB of weight and one n8 tile of x (1 KB) a stage
    assert cf.smem_bytes(cfg(2, 3, 8), 1) == 8 * 3 * 5120
    # two n8 tiles of x past M = 8
    assert cf.smem_bytes(cfg(2, 3, 8), 9) == 8 * 3 * 6144
    # one warp of 64 rows, M = 16: 2 stages of 10 KB against 2 x 64 x 16 partial sums
    assert cf.smem_bytes(cfg(4, 2, 1), 16) == max(2 * 10240, 2 * 64 * 16 * 4)
    # a cluster adds an inbox: an mbarrier and a share of the 32 x 5 outputs from each of 3 ranks
    assert cf.smem_bytes(cfg(2, 2, 8, 3), 5) == 8 * 2 * 5120 + 8 + 3 * 54 * 4
    # chunks of 512 bytes: four times the bytes a stage
    assert cf.smem_bytes(cfg(1, 2, 8, chunk=512), 1) == 8 * 2 * (16 + 8) * 512


def test_each_compile_time_part_is_its_own_library(monkeypatch) -> None:
    a = cf.library(cfg(warps=4))
    assert a == cf.library(cfg(warps=8, cluster=2))  # launch parameters share the library
    assert cf.library(cfg(stages=6)) != a
    assert cf.Library.from_json(a.to_json()) == a
    assert cf.library(cfg(chunk=512)) != a
    command = cf.library(cfg(4, 5, chunk=256)).nvcc_command("nvcc", nvcc_build.library_path(a))
    assert {"-DGEMV_SLICES=4", "-DGEMV_STAGES=5", "-DGEMV_CHUNK=256",
            f"-arch={cuda_library.ARCH}"} <= set(command)  # fmt: skip
    spec = a.artifact_spec()
    assert spec.source == "cuda_fp8" and "warps" not in spec.config
    assert set(spec.toolchain) == {"fp8_gemv.cu", "nvcc", "flags"}


def test_a_library_is_keyed_by_its_source_and_the_headers_it_includes(tmp_path) -> None:
    """Both decode kernels include gemv_cluster.cuh: a change there must rebuild them."""
    assert cuda_library.sources_of(cf.SOURCE) == [cf.SOURCE, cf.SOURCE.parent / "gemv_cluster.cuh"]
    source, header = tmp_path / "k.cu", tmp_path / "h.cuh"
    source.write_text('#include <cuda.h>\n#include "h.cuh"\n#include "missing.cuh"\n')
    header.write_text('#pragma once\n#include "k.cu"\n')  # a cycle is followed once
    assert cuda_library.sources_of(source) == [source, header]
    before = cuda_library.source_digest(source)
    header.write_text("#pragma once\n// changed\n")
    cuda_library.source_digest.cache_clear()
    assert cuda_library.source_digest(source) != before


def test_registered_and_which_keys_it_takes() -> None:
    assert registry.BUILTIN["cuda_fp8"] == "tuner.candidates.cuda_fp8:CudaFp8"
    source = cf.CudaFp8()
    assert source.shares_kernels and source.builds_kernels
    assert source.unsupported(key_of("fp8-rowwise", 1)) is None
    assert source.unsupported(key_of("fp8-tensorwise-fast", 16)) is None
    assert source.unsupported(key_of("fp8-rowwise", 4, out_dtype="f32")) is None
    assert source.unsupported(key_of("int4-g128", 1)) == "fp8 operands only"
    assert source.unsupported(GemmKey(m=1, n=64, k=128)) == "fp8 operands only"
    assert "M <= 16" in source.unsupported(key_of("fp8-rowwise", 17))
    assert "runs of 128" in source.unsupported(key_of("fp8-rowwise", 1, k=4160))
    assert "align=8" in source.unsupported(key_of("fp8-rowwise", 1, k=256, align=8))
    assert "no GPU" in source.unavailable("cpu")


def entry(config: dict) -> tuple:
    return tuple(config[key] for key in cf.CONFIG_KEYS)


def test_the_decode_shortlists(store: ArtifactStore) -> None:
    assert [entry(c) for c in cf.configs(4, 4096, 14336)] == list(cf.SHORTLIST)
    assert [entry(c) for c in cf.configs(9, 4096, 14336)] == list(cf.WIDE_SHORTLIST)
    assert cf.configs(17, 4096, 14336) == []
    # one run of K: neither a cluster of two nor chunks of 512 fit
    assert [entry(c) for c in cf.configs(4, 64, 128)] == [
        e for e in cf.SHORTLIST if e[-1] == 1 and e[2] == 128
    ]
    key = key_of("fp8-rowwise", 2)
    assert cf.CudaFp8().candidates(key, "cuda") == cf.configs(2, 4096, 14336)
    first, *rest = cf.configs(2, 4096, 14336)
    nvcc_build.record(cf.library(first), "failed", {"error": "ptxas: too many resources"})
    assert cf.CudaFp8().candidates(key, "cuda") == [
        c for c in rest if cf.library(c) != cf.library(first)
    ]


def fp8_operands(m: int, n: int, k: int, a_dtype=E4M3, b_dtype=E4M3, rowwise=True, device="cuda"):
    quantize = fp8.quantize_rowwise if rowwise else fp8.quantize_tensorwise
    fmt = {E4M3: "e4m3", E5M2: "e5m2"}
    a8, sa = quantize(torch.randn(m, k, device=device), fmt[a_dtype])
    b8, sb = quantize(torch.randn(n, k, device=device) * 0.02, fmt[b_dtype])
    return a8, b8, sa, sb


def test_operands_the_kernel_would_refuse() -> None:
    m, n, k = 4, 64, 256
    a8, b8, sa, sb = fp8_operands(m, n, k, device="cpu")
    out = torch.empty(m, n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a\.device=cpu"):  # every other check passed
        cf.check_operands(a8, b8, sa, sb, out)
    with pytest.raises(ValueError, match="M=17"):
        cf.check_operands(*fp8_operands(17, n, k, device="cpu"), None)
    with pytest.raises(ValueError, match="K=192 must be whole runs of 128"):
        cf.check_operands(*fp8_operands(m, n, 192, device="cpu"), None)
    rows = torch.empty(m, k + 8, dtype=a8.dtype)[:, :k]  # rows 264 bytes apart
    with pytest.raises(ValueError, match=r"a: rows must start on 16-byte boundaries"):
        cf.check_operands(rows, b8, sa, sb, out)
    spread = torch.empty(n, 2)[:, :1]  # scale_b [N, 1] with its scales 8 bytes apart
    with pytest.raises(ValueError, match=r"scale_b\.stride\(\)=\(2, 1\)"):
        cf.check_operands(a8, b8, sa, spread, out)
    with pytest.raises(ValueError, match=r"out\.dtype=torch\.int32"):
        cf.check_operands(a8, b8, sa, sb, torch.empty(m, n, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out: expected \[4, 64\]"):
        cf.check_operands(a8, b8, sa, sb, torch.empty(n, m, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="e5m2 x e5m2"):  # torch's own refusal, by name
        cf.check_operands(*fp8_operands(m, n, k, E5M2, E5M2, device="cpu"), None)


@pytest.mark.skipif(nvcc_build.nvcc_path() is None, reason="needs nvcc")
def test_a_library_built_by_nvcc_loads_and_is_published(store: ArtifactStore) -> None:
    config = cf.configs(1, 4096, 14336)[0]
    lib = cf.library(config)
    assert cf.compile_all([config]) == {lib: None}
    path = nvcc_build.library_path(lib)
    assert unpack(store.get(lib.artifact_spec())) == {kernel_artifacts.LIBRARY: path.read_bytes()}
    entry = cf.load(path)
    assert entry.restype is ctypes.c_int  # the CUDA runtime is linked in: no GPU needed
    got = [ctypes.c_int() for _ in range(3)]
    ctypes.CDLL(str(path)).fp8_gemv_config(*map(ctypes.byref, got))
    assert [v.value for v in got] == [config["slices"], config["stages"], config["chunk"]]
    # refused before any CUDA call: two e5m2 operands (cudaErrorInvalidValue)
    assert entry(0, 0, 0, 0, 0, 1, 64, 128, 128, 128, 64, 1, 1, 0, 1, 8, 1, 0) == 1


# (M, N, K, a, b, out, rowwise): ragged N (not a multiple of 16), one chunk of K, an odd number
# of chunks, every e4m3 / e5m2 mix, every output dtype, tensorwise scales, two n8 tiles
SHAPES = [
    (1, 64, 128, E4M3, E4M3, torch.bfloat16, True),
    (3, 100, 384, E4M3, E4M3, torch.bfloat16, False),
    (8, 520, 1024, E4M3, E5M2, torch.float16, True),
    (9, 200, 2048, E5M2, E4M3, torch.float32, True),
    (16, 4100, 1152, E4M3, E4M3, torch.bfloat16, True),
    (5, 1024, 3584, E4M3, E4M3, torch.bfloat16, True),
    (12, 72, 640, E4M3, E4M3, torch.float16, False),
]
# 16-, 32- and 64-row warps; 16 warps; clusters of 2, 3 and 4 (K split unevenly); deep rings;
# chunks of 256 and 512 bytes
CONFIGS = [cfg(1, 3, 8, 1), cfg(2, 2, 16, 1), cfg(4, 2, 8, 2), cfg(2, 3, 4, 3), cfg(1, 8, 3, 1),
           cfg(2, 4, 8, 4), cfg(1, 2, 4, 1, 512), cfg(1, 3, 4, 2, 256)]  # fmt: skip


@pytest.fixture(scope="module")
def built() -> None:
    """Every library the GPU tests load, built at once in parallel (nvcc in child processes)."""
    assert not {lib: e for lib, e in cf.compile_all(CONFIGS).items() if e}


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def reference(a8, b8, sa, sb, out_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    da, db = fp8.dequantize(a8, sa), fp8.dequantize(b8, sb)
    ref = da @ db.T
    tol = gemm_tolerance(da, db, ref, operand_unit=0.0,
                         accumulate_unit=FP8_TENSOR_CORE_ACCUMULATE, out_dtype=out_dtype)  # fmt: skip
    return ref, tol


def _fits(config: dict, m: int, n: int, k: int) -> bool:
    try:
        cf.check_config(config, m, n, k)
    except ValueError as e:  # only a shape's limits: a cluster, warps of two tiles, shared memory
        if not re.search(r"config\['cluster'\]|config\['warps'\]|shared memory", str(e)):
            raise
        return False
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + str(s[5])[-4:])
def test_every_config_matches_the_float32_reference(shape: tuple, built: None) -> None:
    m, n, k, a_dtype, b_dtype, out_dtype, rowwise = shape
    a8, b8, sa, sb = fp8_operands(m, n, k, a_dtype, b_dtype, rowwise)
    ref, tol = reference(a8, b8, sa, sb, out_dtype)
    for config in filter(lambda c: _fits(c, m, n, k), CONFIGS):
        fn = cf.launcher(config)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        cf.run(fn, config, a8, b8, sa, sb, rowwise, out, stream())
        again = torch.full_like(out, float("nan"))
        cf.run(fn, config, a8, b8, sa, sb, rowwise, again, stream())
        torch.cuda.synchronize()
        assert excess(out, ref, tol) <= 1, (config, excess(out, ref, tol))
        assert torch.equal(out, again), config  # the sum order is fixed


@pytest.mark.gpu
def test_a_planted_wrong_scale_fails_the_gate(built: None) -> None:
    a8, b8, sa, sb = fp8_operands(4, 256, 1024)
    ref, tol = reference(a8, b8, sa, sb, torch.bfloat16)
    config = CONFIGS[0]
    out = torch.empty(4, 256, device="cuda", dtype=torch.bfloat16)
    cf.run(cf.launcher(config), config, a8, b8, sa, sb.roll(1, 0), True, out, stream())
    assert excess(out, ref, tol) > 1


@pytest.mark.gpu
def test_inside_a_cuda_graph_and_after_the_kernel_that_writes_its_input(built: None) -> None:
    """Replayed three times, a's values changed in place between replays by a kernel captured
    before ours in the same graph (quantizing a new activation into a8): each replay reads the
    a of its own time."""
    m, n, k = 2, 576, 896
    config = CONFIGS[2]
    x = torch.randn(m, k, device="cuda")
    a8, b8, sa, sb = fp8_operands(m, n, k)
    fn = cf.launcher(config)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        q, s = fp8.quantize_rowwise(x)
        a8.copy_(q)
        sa.copy_(s)
        cf.run(fn, config, a8, b8, sa, sb, True, out, stream())

    step()  # loads the module before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        q, s = fp8.quantize_rowwise(x)
        ref, tol = reference(q, b8, s, sb, torch.bfloat16)
        assert excess(out, ref, tol) <= 1


@pytest.mark.gpu
def test_the_runner_takes_scaled_mms_operands_and_checks_them(built: None) -> None:
    key = key_of("fp8-rowwise", 4, n=512, k=1024)
    runner = cf.CudaFp8().build(key, cf.configs(key.m, key.n, key.k)[0])
    a8, b8, sa, sb = fp8_operands(4, 512, 1024)
    got = runner(a8, b8.T, sa, sb.T)  # _scaled_mm's b [K, N] and scale_b [1, N]
    want = torch._scaled_mm(a8, b8.T, sa, sb.T, out_dtype=torch.bfloat16)
    ref, tol = reference(a8, b8, sa, sb, torch.bfloat16)
    assert excess(got, ref, tol) <= 1 and excess(want, ref, tol) <= 1
    with pytest.raises(ValueError, match=r"built for \(M, N, K\)=\(4, 512, 1024\)"):
        runner(a8[:2], b8.T, sa[:2], sb.T)
    with pytest.raises(ValueError, match=r"out\.dtype=torch\.float16"):
        runner(a8, b8.T, sa, sb.T, torch.empty(4, 512, device="cuda", dtype=torch.float16))


TUNED = [key_of("fp8-rowwise", 1, n=4096, k=2048), key_of("fp8-tensorwise", 6, n=528, k=384),
         key_of("fp8-rowwise-fast", 16, n=3584, k=1152)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("key", TUNED, ids=[k.label for k in TUNED])
def test_every_shortlisted_config_passes_the_engines_gate(key: GemmKey) -> None:
    options = TuneOptions(sources=["cuda_fp8"], budget_s=0.01, confirm_rounds=0,
                          cut_factor=1e9, late_cut=1e9, steady_cut=1e9)  # fmt: skip
    outcome = tune(key, options=options, device="cuda")
    ours = [m for m in outcome.measurements if m.source == "cuda_fp8"]
    assert len(ours) == len(cf.configs(key.m, key.n, key.k))
    assert all(m.status == "ok" and m.max_rel_err <= 1 for m in ours), ours
