"""The CUDA FP8 decode kernel (tuner.candidates.cuda_fp8): its config checks, shared-memory rule,
shortlist, the keys its source takes and why not the others, its libraries (sm_90a code only),
operands it refuses, one library built by nvcc and loaded, and the bench's trace build (CPU,
where nvcc is); on a GPU, its libraries run at every cluster size on small, ragged and model
shapes, with tensorwise and rowwise scales and every output dtype, against the float32 GEMM on
the dequantized operands, bit-identical from one call to the next; a planted wrong scale caught,
a CUDA graph, calls chained on one stream behind the kernels that write their inputs, and
every shortlisted config tuned through the engine's numerics gate."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tests.bench_scripts import load_script
from tests.candidates.gate import assert_every_config_passes
from tuner.cache.artifacts import ArtifactStore, unpack
from tuner.candidates import cuda_fp8 as cf
from tuner.candidates import cuda_library, kernel_artifacts, nvcc_build, registry
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.quant import fp8
from tuner.quant.tolerance import FP8_TENSOR_CORE_ACCUMULATE, excess, gemm_tolerance


def key_of(spec: str, m: int, n: int = 4096, k: int = 14336, **extra) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **{**lowbit_fields(spec), **extra})


def cfg(stages: int = 6, atoms: int = 2, cluster: int = 2) -> dict:
    return {"stages": stages, "atoms": atoms, "cluster": cluster}


def test_configs_are_checked_field_by_field() -> None:
    cf.check_config(cfg(), 1, 4096, 14336)
    cf.check_config(cfg(10, 1, 4), 16, 3584, 18944)
    bad = [
        (dict(cfg(), stages=2), "config['stages']=2"),
        (dict(cfg(), stages=13), "config['stages']=13"),
        (dict(cfg(), atoms=3), "config['atoms']=3"),
        (dict(cfg(), cluster=3), "config['cluster']=3"),
        (dict(cfg(), cluster=2.0), "config['cluster']=2.0"),
        ({"stages": 6, "atoms": 2}, "config['cluster']=None"),
        ({**cfg(), "warps": 4}, "unknown keys ['warps']"),
    ]
    for config, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            cf.check_config(config, 1, 4096, 4096)
    with pytest.raises(ValueError, match="M=17"):
        cf.check_config(cfg(), 17, 4096, 4096)
    with pytest.raises(ValueError, match="N=0"):
        cf.check_config(cfg(), 1, 0, 4096)
    # two atoms a stage: K in whole 256-byte stages, one per CTA of the cluster at least
    with pytest.raises(ValueError, match=r"K=384: must be whole stages of 256"):
        cf.check_config(cfg(), 1, 64, 384)
    cf.check_config(cfg(atoms=1), 1, 64, 384)
    with pytest.raises(ValueError, match=r"K=256: .* config\['cluster'\]=2"):
        cf.check_config(cfg(), 1, 64, 256)
    with pytest.raises(ValueError, match="shared memory"):
        cf.check_config(cfg(12, 2, 1), 16, 4096, 4096)


def test_shared_memory_is_the_ring_or_the_sums_then_the_inbox() -> None:
    # 1 KB of alignment, then stages of 64 weight rows and 8 rows of x, 256 K bytes each; the
    # scales' static 1 KB after
    assert cf.smem_bytes(cfg(6, 2, 1), 1) == 1024 + 6 * 72 * 256 + 1024
    # past M = 8, x takes 16 rows a stage
    assert cf.smem_bytes(cfg(5, 1, 1), 9) == 1024 + 5 * 80 * 128 + 1024
    # a cluster adds an mbarrier (in 16 bytes, aligning the sums) and, from each rank, its share
    # of the 64 x M outputs
    assert cf.smem_bytes(cfg(6, 2, 4), 3) == 1024 + 6 * 72 * 256 + 16 + 4 * 48 * 4 + 1024
    assert all(cf.smem_bytes(dict(zip(cf.CONFIG_KEYS, e, strict=True)), 16) <= cf.SMEM_LIMIT
               for e in cf.SHORTLIST)  # fmt: skip


def test_each_compile_time_part_is_its_own_library(monkeypatch) -> None:
    a = cf.library(cfg(cluster=1))
    assert a == cf.library(cfg(cluster=4))  # the cluster is a launch parameter
    assert cf.library(cfg(stages=5)) != a and cf.library(cfg(atoms=1)) != a
    assert cf.Library.from_json(a.to_json()) == a
    command = a.nvcc_command("nvcc", nvcc_build.library_path(a))
    # sm_90a code only: FP8 wgmma has no compute_90 form for -arch to emit beside it
    assert {"-DFP8_GEMV_STAGES=6", "-DFP8_GEMV_ATOMS=2", "arch=compute_90a,code=sm_90a"} <= set(
        command
    )
    assert not any(flag.startswith("-arch") for flag in command)
    spec = a.artifact_spec()
    assert spec.source == "cuda_fp8" and spec.arch == cuda_library.ARCH
    assert set(spec.toolchain) == {"fp8_gemv.cu", "nvcc", "flags"}
    monkeypatch.setattr(cuda_library, "toolkit", lambda: "12.8")
    assert a.artifact_spec().toolchain["nvcc"] == "12.8" and a.artifact_spec().id != spec.id


def test_a_library_digest_covers_the_headers_its_source_includes(tmp_path) -> None:
    """Both kernels include the launch they share (``cluster_launch.cuh``): a change there must
    rebuild their libraries as a change in the kernel's own file does."""
    assert [p.name for p in cuda_library.sources_of(cf.SOURCE)] == [
        "fp8_gemv.cu",
        "cluster_launch.cuh",
    ]
    kernel, header = tmp_path / "k.cu", tmp_path / "h.cuh"
    kernel.write_text('#include <cuda_runtime.h>\n#include "h.cuh"\n#include "missing.cuh"\n')
    header.write_text('#include "k.cu"\n// one\n')  # a cycle is read once
    assert cuda_library.sources_of(kernel) == [kernel, header]
    before = cuda_library.source_digest(kernel)
    header.write_text("// two\n")
    cuda_library.source_digest.cache_clear()
    assert cuda_library.source_digest(kernel) != before


def test_registered_and_which_keys_it_takes() -> None:
    assert registry.BUILTIN["cuda_fp8"] == "tuner.candidates.cuda_fp8:CudaFp8"
    source = cf.CudaFp8()
    assert source.shares_kernels and source.builds_kernels
    for spec in ("fp8-rowwise", "fp8-tensorwise", "fp8-rowwise-fast"):
        assert source.unsupported(key_of(spec, 1)) is None
    assert source.unsupported(key_of("fp8-rowwise", 16, out_dtype="f32")) is None
    assert "e4m3" in source.unsupported(key_of("fp8-rowwise", 1, wdtype="fp8_e5m2"))
    assert "e4m3" in source.unsupported(key_of("int4-g128", 1))
    assert "e4m3" in source.unsupported(GemmKey(m=1, n=64, k=128))
    assert "M <= 16" in source.unsupported(key_of("fp8-rowwise", 17))
    assert "align=8" in source.unsupported(key_of("fp8-rowwise", 1, k=256, align=8))
    assert "no config fits" in source.unsupported(key_of("fp8-rowwise", 1, k=160))
    assert "no GPU" in source.unavailable("cpu")


def test_the_decode_shortlist(store: ArtifactStore, monkeypatch) -> None:
    monkeypatch.setattr(cuda_library, "cannot_compile", lambda: None)  # as where nvcc is

    def entries(m: int, n: int, k: int) -> list[tuple]:
        return [tuple(c[key] for key in cf.CONFIG_KEYS) for c in cf.configs(m, n, k)]

    assert entries(1, 4096, 14336) == list(cf.SHORTLIST)
    assert entries(16, 3584, 18944) == list(cf.SHORTLIST)
    assert cf.configs(17, 4096, 14336) == []
    # K = 512: two 256-byte stages, so a cluster of 4 does not fit
    assert entries(1, 64, 512) == [e for e in cf.SHORTLIST if e[-1] <= 2]
    assert cf.CudaFp8().candidates(key_of("fp8-rowwise", 2), "cuda") == cf.configs(2, 4096, 14336)
    # a failed library is neither offered nor compiled again
    first, *rest = cf.configs(2, 4096, 14336)
    nvcc_build.record(cf.library(first), "failed", {"error": "ptxas: too many resources"})
    offered = cf.CudaFp8().candidates(key_of("fp8-rowwise", 2), "cuda")
    assert offered == [c for c in rest if cf.library(c) != cf.library(first)]
    with pytest.raises(RuntimeError, match="too many resources"):
        cf.launcher(first)


def test_operands_the_kernel_would_refuse() -> None:
    m, n, k = 4, 64, 256
    a, sa = fp8.quantize_rowwise(torch.randn(m, k))
    b, sb = fp8.quantize_rowwise(torch.randn(n, k))
    out = torch.empty(m, n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"a\.device=cpu"):  # every other check passed
        cf.check_operands(a, b, sa, sb, out)
    e5m2, _ = fp8.quantize_rowwise(torch.randn(n, k), "e5m2")
    with pytest.raises(ValueError, match=r"b\.dtype=torch\.float8_e5m2"):
        cf.check_operands(a, e5m2, sa, sb, out)
    rows = torch.empty(m, k + 8, dtype=a.dtype)[:, :k]  # rows 264 bytes apart
    with pytest.raises(ValueError, match=r"a: rows must start on 16-byte boundaries"):
        cf.check_operands(rows, b, sa, sb, out)
    big, sbig = fp8.quantize_rowwise(torch.randn(17, k))
    with pytest.raises(ValueError, match="M=17"):
        cf.check_operands(big, b, sbig, sb, None)
    strided = torch.empty(2 * n, 1)[::2]
    with pytest.raises(ValueError, match="scale_b: must be contiguous"):
        cf.check_operands(a, b, sa, strided, out)
    with pytest.raises(ValueError, match=r"out\.dtype=torch\.int32"):
        cf.check_operands(a, b, sa, sb, torch.empty(m, n, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"out: expected \[4, 64\]"):
        cf.check_operands(a, b, sa, sb, torch.empty(n, m, dtype=torch.bfloat16).T)
    one = torch.empty(n, dtype=torch.bfloat16).as_strided((1, n), (n // 2, 1))
    with pytest.raises(ValueError, match=r"rows at least 64 apart"):  # a one-row out too
        cf.check_operands(a[:1], b, sa[:1], sb, one)
    with pytest.raises(ValueError, match=r"scale_a\.shape"):  # torch's own scale rules
        cf.check_operands(a, b, sa[:2], sb, out)


@pytest.mark.skipif(nvcc_build.nvcc_path() is None, reason="needs nvcc")
def test_a_library_built_by_nvcc_loads_and_is_published(store: ArtifactStore) -> None:
    config = cf.configs(1, 4096, 14336)[0]
    lib = cf.library(config)
    assert cuda_library.compile_all([lib]) == {lib: None}
    path = nvcc_build.library_path(lib)
    assert unpack(store.get(lib.artifact_spec())) == {kernel_artifacts.LIBRARY: path.read_bytes()}
    entry = cuda_library.load(path, cf.ENTRY, cf.ARGTYPES)
    # refused before any CUDA call (the runtime is linked in: no GPU needed): a cluster of 3,
    # an out dtype the kernel has no store for
    assert entry(0, 0, 0, 0, 0, 1, 64, 512, 512, 512, 64, 1, 0, 3, 0) == 1  # cudaErrorInvalidValue
    assert entry(0, 0, 0, 0, 0, 1, 64, 512, 512, 512, 64, 1, 3, 2, 0) == 1
    # a product build stamps nothing
    ctas, fields = ctypes.c_int(), ctypes.c_int()
    ctypes.CDLL(str(path)).fp8_gemv_trace_shape(ctypes.byref(ctas), ctypes.byref(fields))
    assert (ctas.value, fields.value) == (0, 9)


@pytest.mark.skipif(nvcc_build.nvcc_path() is None, reason="needs nvcc")
def test_the_bench_builds_traced_and_variant_twins(
    store: ArtifactStore, tmp_path, monkeypatch
) -> None:
    """bench/fp8_decode_sweep.py's ``--cuda`` grid starts from the shortlist and builds each
    config's library, with ``--trace`` a twin of it that exports its stamps' shape, and with
    ``--variant`` a twin built with the variant's flags."""
    bench = load_script("fp8_decode_sweep")
    monkeypatch.setattr(bench, "TWIN_DIR", tmp_path / "twins")
    monkeypatch.setitem(bench.VARIANTS, "pdl", ["-DFP8_GEMV_DEPENDENT=1"])
    grid = bench.cuda_grid(1, 4096, 14336)
    assert grid[: len(cf.SHORTLIST)] == cf.configs(1, 4096, 14336)
    assert len(grid) == len({tuple(c.values()) for c in grid})  # each config once
    bench.build_cuda(grid[:1], ["trace", "pdl"])
    product = nvcc_build.library_path(cf.library(grid[0])).read_bytes()
    assert bench.twin_path(grid[0], "pdl").read_bytes() != product
    lib = ctypes.CDLL(str(bench.twin_path(grid[0], "trace")))
    ctas, fields = ctypes.c_int(), ctypes.c_int()
    lib.fp8_gemv_trace_shape(ctypes.byref(ctas), ctypes.byref(fields))
    assert (ctas.value, fields.value) == (1024, 9)
    assert nvcc_build.compiled_info(cf.library(grid[0])) is not None


# (M, N, K): a model's down projection, ragged N (a last CTA part past N), one 512-byte K run
# (the cluster of 2 at one stage a CTA), x's two n8 tiles, Qwen's qkv
SHAPES = [(1, 4096, 14336), (3, 200, 512), (9, 520, 2048), (16, 4608, 3584), (5, 64, 1024)]
CONFIGS = [cfg(6, 2, 2), cfg(5, 2, 1), cfg(5, 2, 4), cfg(10, 1, 2), cfg(3, 1, 1), cfg(8, 2, 4)]


@pytest.fixture(scope="module")
def built() -> None:
    """Every library the GPU tests load, built at once in parallel (nvcc in child processes)."""
    assert not {
        lib: e for lib, e in cuda_library.compile_all(map(cf.library, CONFIGS)).items() if e
    }


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def reference(a, sa, b, sb, out_dtype: torch.dtype = torch.bfloat16):
    """The float32 GEMM on the dequantized operands, and the format's tolerance around it."""
    da, db = fp8.dequantize(a, sa), fp8.dequantize(b, sb)
    ref = da @ db.T
    tol = gemm_tolerance(da, db, ref, operand_unit=0.0,
                         accumulate_unit=FP8_TENSOR_CORE_ACCUMULATE, out_dtype=out_dtype)  # fmt: skip
    return ref, tol


def problem(m: int, n: int, k: int, rowwise: bool, out_dtype: torch.dtype = torch.bfloat16):
    quant = fp8.quantize_rowwise if rowwise else fp8.quantize_tensorwise
    a, sa = quant(torch.randn(m, k, device="cuda"))
    b, sb = quant(torch.randn(n, k, device="cuda") * 0.05)
    return a, b, sa, sb, *reference(a, sa, b, sb, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rowwise", [True, False], ids=["rowwise", "tensorwise"])
def test_every_config_matches_the_float32_reference(shape: tuple, rowwise: bool, built) -> None:
    m, n, k = shape
    for out_dtype in cf.OUT_KINDS:
        a, b, sa, sb, ref, tol = problem(m, n, k, rowwise, out_dtype)
        for config in CONFIGS:
            try:
                cf.check_config(config, m, n, k)
            except ValueError as e:  # only a shape's limits: K's stages, shared memory
                assert "K=" in str(e) or "shared memory" in str(e)
                continue
            fn = cf.launcher(config)
            out, again = (torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
                          for _ in range(2))  # fmt: skip
            cf.run(fn, config, a, b, sa, sb, out, rowwise, stream())
            cf.run(fn, config, a, b, sa, sb, again, rowwise, stream())
            torch.cuda.synchronize()
            assert excess(out, ref, tol) <= 1, (config, out_dtype, excess(out, ref, tol))
            assert torch.equal(out, again), config  # the sum order is fixed


@pytest.mark.gpu
def test_padded_rows_are_read_and_written_where_their_strides_say(built) -> None:
    """a and b rows 16 bytes past K apart, out rows 8 elements past N apart (NaN there, left
    so), scale_b as _scaled_mm takes it ([1, N]): the same product as on packed operands."""
    m, n, k = 5, 200, 1024
    a, b, sa, sb, ref, tol = problem(m, n, k, rowwise=True)
    wide_a = torch.zeros(m, k + 16, device="cuda", dtype=a.dtype)[:, :k]
    wide_b = torch.zeros(n, k + 16, device="cuda", dtype=b.dtype)[:, :k]
    wide_a.copy_(a)
    wide_b.copy_(b)
    store = torch.full((m, n + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = store[:, :n]
    for config in CONFIGS[:3]:
        cf.check_operands(wide_a, wide_b, sa, sb.T, out)
        cf.run(cf.launcher(config), config, wide_a, wide_b, sa, sb.T, out, True, stream())
        torch.cuda.synchronize()
        assert excess(out, ref, tol) <= 1, config
        assert store[:, n:].isnan().all(), config


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd_offset"])
def test_outputs_past_whole_runs_of_four_are_stored_one_by_one(offset: int, built) -> None:
    """N = 203 (the last CTA's last run of four outputs is cut at N) and out rows 212 elements
    apart (whole runs of four), the view starting ``offset`` elements into its store (at 1, no
    run is aligned): where a run of four cannot be one store it is stored one by one, every
    output is written once, and the NaN around out stays."""
    m, n, k = 3, 203, 1024
    for out_dtype in cf.OUT_KINDS:
        a, b, sa, sb, ref, tol = problem(m, n, k, rowwise=True, out_dtype=out_dtype)
        store = torch.full((m, n + 9), float("nan"), device="cuda", dtype=out_dtype)
        out = store[:, offset : offset + n]
        for config in CONFIGS[:3]:  # clusters of 2, 1 and 4
            cf.check_operands(a, b, sa, sb, out)
            cf.run(cf.launcher(config), config, a, b, sa, sb, out, True, stream())
            torch.cuda.synchronize()
            assert excess(out, ref, tol) <= 1, (config, out_dtype)
            outside = torch.cat([store[:, :offset], store[:, offset + n :]], dim=1)
            assert outside.isnan().all(), (config, out_dtype)


@pytest.mark.gpu
def test_a_planted_wrong_scale_fails_the_gate(built) -> None:
    """Rowwise scales read as tensorwise (each output scaled by the first row's scales only)."""
    a, b, sa, sb, ref, tol = problem(4, 256, 1024, rowwise=True)
    out = torch.empty(4, 256, device="cuda", dtype=torch.bfloat16)
    cf.run(cf.launcher(CONFIGS[0]), CONFIGS[0], a, b, sa, sb, out, False, stream())
    assert excess(out, ref, tol) > 1


@pytest.mark.gpu
def test_inside_a_cuda_graph(built) -> None:
    """Replayed three times, a changed in place between replays: each replay reads the a of
    its own time."""
    m, n, k = 2, 576, 1024
    a, b, sa, sb, _, _ = problem(m, n, k, rowwise=True)
    fn, config = cf.launcher(CONFIGS[0]), CONFIGS[0]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cf.run(fn, config, a, b, sa, sb, out, True, stream())  # loads the module before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cf.run(fn, config, a, b, sa, sb, out, True, stream())
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert excess(out, *reference(a, sa, b, sb)) <= 1
        a.copy_(fp8.quantize_rowwise(torch.randn(m, k, device="cuda"))[0])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_a_call_reads_what_the_kernel_before_it_wrote(m: int, graphed: bool, built) -> None:
    """Each call's a and its scales are copied in by the kernels just before it on the stream
    (after a NaN fill of the output): a kernel that started early (a programmatic dependent
    launch without its wait) would read the a of the call before. Eager and as one CUDA graph,
    three times with new a."""
    n, k, config = 4096, 4096, CONFIGS[2]
    fn = cf.launcher(config)
    a, b, sa, sb, _, _ = problem(m, n, k, rowwise=True)
    src_a, src_sa = a.clone(), sa.clone()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        out.fill_(float("nan"))
        a.copy_(src_a)
        sa.copy_(src_sa)
        cf.run(fn, config, a, b, sa, sb, out, True, stream())

    step()  # loads the module before a capture
    graph = torch.cuda.CUDAGraph()
    if graphed:
        with torch.cuda.graph(graph):
            step()
    for _ in range(3):
        new_a, new_sa = fp8.quantize_rowwise(torch.randn(m, k, device="cuda"))
        src_a.copy_(new_a)
        src_sa.copy_(new_sa)
        graph.replay() if graphed else step()
        torch.cuda.synchronize()
        assert excess(out, *reference(new_a, new_sa, b, sb)) <= 1


# N a multiple of 16: torch's _scaled_mm, the baseline the engine runs first, takes no other
TUNED = [key_of("fp8-rowwise", 1, n=4096, k=4096), key_of("fp8-tensorwise", 6, n=528, k=2048),
         key_of("fp8-rowwise", 16, n=3584, k=3584), key_of("fp8-rowwise-fast", 8, n=1024, k=1024)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("key", TUNED, ids=[k.label for k in TUNED])
def test_every_shortlisted_config_passes_the_engines_gate(key: GemmKey) -> None:
    assert_every_config_passes(key, "cuda_fp8", len(cf.configs(key.m, key.n, key.k)))
