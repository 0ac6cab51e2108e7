"""The library GEMM sources (cuBLAS, cuBLASLt, CUTLASS) on a machine without their packages or a
GPU: the column-major mapping, params (de)serialisation, shortlists, compile-failure memory and the
reasons they give for not running."""

from __future__ import annotations

import ctypes
import enum
import importlib.util
import json
import threading
import time

import numpy as np
import pytest
import torch

from tuner.candidates import cublas, cublaslt, cutlass_env, cutlass_gemm, nvcc_build
from tuner.candidates import gemm_operands as ops
from tuner.core.keys import GemmKey
from tuner.measure import samples
from tuner.measure.records import candidate_name

LAYOUTS = ("nn", "nt", "tn", "tt")


def emulate_blas(key: GemmKey, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """Run the column-major call the way a BLAS reads memory: through (1, ld) strides."""
    call = ops.colmajor_call(key, a, b, c)
    (rb, cb), (ra, ca), (rc, cc) = ops.stored_shapes(key)

    def colmajor(t: torch.Tensor, rows: int, cols: int, ld: int, stride: int, i: int):
        offset = t.storage_offset() + i * stride
        return torch.as_strided(t, (rows, cols), (1, ld), offset)

    for i in range(key.batch):
        first = colmajor(b, rb, cb, call.ld_first, call.stride_first, i)
        second = colmajor(a, ra, ca, call.ld_second, call.stride_second, i)
        first = first.T if call.trans_first == ops.OP_T else first
        second = second.T if call.trans_second == ops.OP_T else second
        colmajor(c, rc, cc, call.ld_out, call.stride_out, i).copy_(first @ second)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", [1, 3])
def test_colmajor_call_computes_a_at_b_for_every_layout(layout, batch):
    key = GemmKey(m=5, n=7, k=3, batch=batch, layout=layout, dtype="f32", out_dtype="f32", align=4)
    a, b = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    c = samples.output_like(key, (a, b))
    emulate_blas(key, a, b, c)
    assert torch.allclose(c, a @ b, atol=1e-5)
    assert ops.colmajor_call(key, a, b, c) == ops.packed_call(key)


def test_colmajor_call_follows_padded_strides_and_single_rows():
    key = GemmKey(m=1, n=6, k=4, layout="nt", dtype="f32", out_dtype="f32", align=4)
    a = torch.randn(1, 4)
    b = torch.randn(16, 6)[:4].T.contiguous().T  # column-major k x n
    padded = torch.zeros(10, 16)[:4, :6]  # row-major with a padded leading dimension
    padded.copy_(b)
    c = torch.full((1, 6), float("nan"))
    emulate_blas(
        GemmKey(m=1, n=6, k=4, layout="nn", dtype="f32", out_dtype="f32", align=4), a, padded, c
    )
    assert torch.allclose(c, a @ b, atol=1e-5)
    call = ops.colmajor_call(key, a, b, c)
    assert call.ld_second >= 4 and call.trans_first == ops.OP_T and call.trans_second == ops.OP_N


def test_output_buffer_is_the_callers_only_when_a_library_can_write_it():
    key = GemmKey(m=4, n=8, k=8, dtype="f32", out_dtype="f32")
    a = torch.randn(4, 8)
    good = torch.empty(4, 8)
    assert ops.output_for(key, a, good, 16)[0] is good
    transposed = torch.empty(8, 4).T
    c, out = ops.output_for(key, a, transposed, 16)
    assert c is not transposed and c.is_contiguous() and out is transposed
    c.fill_(2.0)
    assert ops.finish(c, out, lambda t: t) is transposed and bool((transposed == 2.0).all())
    wider = torch.empty(4, 8, dtype=torch.float64)  # another dtype: written through a copy
    c, out = ops.output_for(key, a, wider, 16)
    assert c is not wider and c.dtype == torch.float32 and out is wider
    with pytest.raises(ValueError, match=r"out.shape=\(3, 8\): expected \(4, 8\)"):
        ops.output_for(key, a, torch.empty(3, 8), 16)


def test_out_alignment_and_compute_types():
    assert ops.out_alignment(GemmKey(m=1, n=4099, k=8, align=2)) == 2
    assert ops.out_alignment(GemmKey(m=1, n=4096, k=8)) == 16
    tf32 = GemmKey(m=8, n=8, k=8, dtype="f32", out_dtype="f32", compute="tf32")
    assert ops.compute_type(tf32) == ops.CUBLAS_COMPUTE_32F_FAST_TF32
    assert ops.compute_type(GemmKey(m=8, n=8, k=8)) == ops.CUBLAS_COMPUTE_32F


# --- cuBLAS -------------------------------------------------------------------------------------


def test_stream_workspaces_are_one_per_stream_and_never_freed_while_a_graph_may_replay():
    spaces = ops.StreamWorkspaces(torch.device("cpu"))
    first, size = spaces.get(stream=1, nbytes=0)
    assert size == 1  # a launch takes a valid pointer even when nothing is needed
    assert spaces.get(stream=1, nbytes=1) == (first, 1)  # found again, not remade
    other, _ = spaces.get(stream=2, nbytes=1)
    assert other != first  # two streams never share one
    grown, size = spaces.get(stream=1, nbytes=4096)
    assert size == 4096 and grown != first
    assert [buf.data_ptr() for buf in spaces.outgrown] == [first]  # kept alive


def test_cublas_params_and_algos(monkeypatch):
    key = GemmKey(m=8, n=8, k=8)
    src = cublas.CublasGemm()
    assert src.candidates(key, "cuda") == [{"algo": -1}]
    monkeypatch.setenv("TUNER_CUBLAS_ALGOS", "all")
    assert [p["algo"] for p in src.candidates(key, "cuda")] == [-1, *range(99, 116)]
    monkeypatch.setenv("TUNER_CUBLAS_ALGOS", "-1,100")
    assert src.candidates(key, "cuda") == [{"algo": -1}, {"algo": 100}]
    for typo in ("99,abc", "99;100", "5"):  # the variable named, not only int()'s words
        monkeypatch.setenv("TUNER_CUBLAS_ALGOS", typo)
        with pytest.raises(ValueError, match=f"TUNER_CUBLAS_ALGOS={typo!r}"):
            src.candidates(key, "cuda")
    for bad in ({"algo": 5}, {"algo": "default"}, {"algo": -1, "tile": 3}):
        with pytest.raises(ValueError, match="algo"):
            src.build(key, bad)


NUMPY_DTYPES = {ops.CUDA_R_32F: np.float32, ops.CUDA_R_16F: np.float16}


class FakeCublas:
    """nvmath-python's ``cublas`` bindings as the runner calls them, taking the C API's
    arguments in its order (``cublasGemmEx``, ``cublasGemmStridedBatchedEx``) and doing the GEMM
    on the CPU from the pointers, so that a swapped argument shows as a wrong product. Its
    ``set_stream`` yields the GIL, as the binding's call does, so other threads run there."""

    def __init__(self) -> None:
        self.stream: dict[int, int] = {}  # handle -> the stream bound to it
        self.workspace: dict[int, tuple[int, int] | None] = {}  # handle -> (pointer, bytes)
        # (stream the caller asked for, stream bound, workspace bound)
        self.ran_on: list[tuple[int, int, tuple[int, int] | None]] = []

    def create(self) -> int:
        return 1

    def set_stream(self, handle: int, stream_id: int) -> None:
        self.stream[handle] = stream_id
        self.workspace[handle] = None  # as cuBLAS: back to its default pool
        time.sleep(1e-4)

    def set_workspace(self, handle: int, workspace: int, size: int) -> None:
        self.workspace[handle] = (workspace, size)

    def gemm_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb,
                beta, c, ctype, ldc, compute_type, algo) -> None:  # fmt: skip
        self.gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, 0, b,
                                     btype, ldb, 0, beta, c, ctype, ldc, 0, 1, compute_type, algo)  # fmt: skip

    def gemm_strided_batched_ex(self, handle, transa, transb, m, n, k, alpha, a, atype, lda,
                                stride_a, b, btype, ldb, stride_b, beta, c, ctype, ldc, stride_c,
                                batch_count, compute_type, algo) -> None:  # fmt: skip
        self.ran_on.append((threading.get_ident(), self.stream[handle], self.workspace[handle]))
        assert compute_type == ops.CUBLAS_COMPUTE_32F and algo == cublas.CUBLAS_GEMM_DEFAULT
        first = self.matrix(a, atype, (m, k) if transa == ops.OP_N else (k, m), lda, stride_a,
                            batch_count)  # fmt: skip
        second = self.matrix(b, btype, (k, n) if transb == ops.OP_N else (n, k), ldb, stride_b,
                             batch_count)  # fmt: skip
        first = first if transa == ops.OP_N else first.transpose(0, 2, 1)
        second = second if transb == ops.OP_N else second.transpose(0, 2, 1)
        out = self.matrix(c, ctype, (m, n), ldc, stride_c, batch_count)
        scale = np.frombuffer((ctypes.c_float * 2).from_address(alpha), np.float32)
        assert beta == alpha + 4 and list(scale) == [1.0, 0.0]  # beta 0: c is not read
        out[...] = first.astype(np.float64) @ second.astype(np.float64)

    def matrix(self, ptr: int, dtype: int, shape: tuple[int, int], ld: int, stride: int,
               batch: int) -> np.ndarray:  # fmt: skip
        """(batch, rows, cols) read column-major from ``ptr``, as cuBLAS reads it."""
        item = np.dtype(NUMPY_DTYPES[dtype]).itemsize
        rows, cols = shape
        span = (batch - 1) * stride + (cols - 1) * ld + rows
        flat = np.frombuffer((ctypes.c_char * (span * item)).from_address(ptr), NUMPY_DTYPES[dtype])
        strides = (stride * item, item, ld * item)
        return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), strides, writeable=True)


@pytest.fixture
def fake_cublas(monkeypatch: pytest.MonkeyPatch) -> FakeCublas:
    fake = FakeCublas()
    monkeypatch.setattr(cublas, "_library", lambda: fake)
    monkeypatch.setattr(cublas._HANDLES, "get", lambda device: fake.create())
    monkeypatch.setattr(cublas, "_WORKSPACES", {})
    monkeypatch.setattr(ops, "current_stream", lambda device: threading.get_ident())
    return fake


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "batch"), [("f32", 1), ("f32", 3), ("f16", 1)])
def test_cublas_runner_passes_the_c_apis_arguments_in_order(fake_cublas, layout, dtype, batch):
    key = GemmKey(m=5, n=7, k=3, batch=batch, layout=layout, dtype=dtype, out_dtype=dtype,
                   align=2 if dtype == "f16" else 4)  # fmt: skip
    a, b = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    runner = cublas.CublasGemm().build(key, {"algo": -1})
    want, tol = a.double() @ b.double(), samples.tolerance(key)
    assert samples.relative_error(runner(a, b), want) <= tol
    out = torch.full(tuple(want.shape), float("nan"), dtype=a.dtype)
    assert runner(a, b, out=out) is out and samples.relative_error(out, want) <= tol


def test_cublas_calls_from_two_threads_each_run_on_their_own_stream_and_workspace(fake_cublas):
    """The handle is one per device, shared by every runner and thread: a call binds its
    stream and that stream's workspace to it and enqueues before another thread may bind its
    own. Two streams' GEMMs never share a workspace (cuBLAS's default pool would be shared)."""
    key = GemmKey(m=4, n=8, k=8, dtype="f32", out_dtype="f32")
    a, b = samples.make_inputs(key, "cpu", torch.Generator().manual_seed(0))
    runner = cublas.CublasGemm().build(key, {"algo": -1})

    def calls() -> None:
        for _ in range(50):
            runner(a, b)

    threads = [threading.Thread(target=calls) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_cublas.ran_on) == 100
    assert [bound for caller, bound, _ in fake_cublas.ran_on if bound != caller] == []
    workspaces = {stream: space for _, stream, space in fake_cublas.ran_on}
    assert len(workspaces) == 2 and len(set(workspaces.values())) == 2
    assert all(space[1] == ops.WORKSPACE_BYTES for space in workspaces.values())
    assert {s for _, s, space in fake_cublas.ran_on if workspaces[s] != space} == set()


# --- cuBLASLt params ------------------------------------------------------------------------------


class MatmulTile(enum.IntEnum):
    TILE_UNDEFINED = 0
    TILE_64x64 = 5
    TILE_128x256 = 20


class MatmulStages(enum.IntEnum):
    STAGES_UNDEFINED = 0
    STAGES_64x4 = 14


class ClusterShape(enum.IntEnum):
    SHAPE_AUTO = 0
    SHAPE_2x1x1 = 3


ENUMS = {"MatmulTile": MatmulTile, "MatmulStages": MatmulStages, "ClusterShape": ClusterShape}
CONFIG = {
    "ID": 28, "TILE_ID": 20, "STAGES_ID": 14, "CLUSTER_SHAPE_ID": 3, "SPLITK_NUM": 1,
    "REDUCTION_SCHEME": 0, "CTA_SWIZZLING": 1, "CUSTOM_OPTION": 0, "INNER_SHAPE_ID": 2,
}  # fmt: skip


def test_cublaslt_params_round_trip_through_json():
    params = cublaslt.to_params(CONFIG, ENUMS)
    assert params == {
        "id": 28, "tile": "128x256", "stages": "64x4", "cluster": "2x1x1", "split_k": 1,
        "reduction": 0, "swizzle": 1, "custom": 0, "inner_shape": 2,
    }  # fmt: skip
    stored = json.loads(json.dumps(params))
    assert cublaslt.to_config(stored, ENUMS) == CONFIG
    assert candidate_name("cublaslt", stored) == candidate_name("cublaslt", params)


def test_cublaslt_unnamed_enum_values_and_negative_values_stay_integers():
    params = cublaslt.to_params({**CONFIG, "TILE_ID": 999, "SPLITK_NUM": -1}, ENUMS)
    assert params["tile"] == 999 and params["split_k"] == -1  # -1: what TF32 algos report
    assert cublaslt.to_config(params, ENUMS) == {**CONFIG, "TILE_ID": 999, "SPLITK_NUM": -1}


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"tile": "128x256"}, "'id'"),
        ({"id": 1, "tile": "7x7"}, "unknown MatmulTile"),
        ({"id": 1, "speed": 3}, "unknown cublaslt params"),
        ({"id": "28"}, "must be an integer"),
    ],
)
def test_cublaslt_bad_params_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        cublaslt.to_config(params, ENUMS)


# --- CUTLASS shortlist and specs --------------------------------------------------------------


def test_cutlass_shortlist_is_small_and_follows_the_shape():
    decode = cutlass_gemm.shortlist(GemmKey(m=1, n=6144, k=4096))
    medium = cutlass_gemm.shortlist(GemmKey(m=128, n=28672, k=4096))
    large = cutlass_gemm.shortlist(GemmKey(m=8192, n=8192, k=8192))
    unaligned = cutlass_gemm.shortlist(GemmKey(m=4096, n=4096, k=4100, align=8))
    for short in (decode, medium, large, unaligned):
        assert 3 <= len(short) <= 8
        assert len({json.dumps(p, sort_keys=True) for p in short}) == len(short)
    cta_rows = lambda p: p["tile"][0] // p["cluster"][0]  # noqa: E731
    assert min(cta_rows(p) for p in decode) == 64 and any(
        p["scheduler"] == "streamk" for p in decode
    )
    assert all(cta_rows(p) >= 128 for p in large)
    assert all(p["kernel"].startswith("cpasync") for p in unaligned)
    assert all(p["tile"][2] == 64 for p in large)
    tf32 = GemmKey(m=4096, n=4096, k=4096, dtype="f32", out_dtype="f32", compute="tf32")
    assert all(p["tile"][2] == 32 for p in cutlass_gemm.shortlist(tf32))


def test_cutlass_kernel_spec_is_shape_independent():
    params = cutlass_gemm.shortlist(GemmKey(m=8192, n=8192, k=8192))[0]
    big = cutlass_gemm.kernel_spec(GemmKey(m=8192, n=8192, k=8192), params)
    small = cutlass_gemm.kernel_spec(GemmKey(m=1024, n=512, k=4096), params)
    assert big == small and big.digest == small.digest
    assert big.align_ab == 8 and big.align_c == 8 and big.kernel == "TmaWarpSpecializedCooperative"
    assert cutlass_env.KernelSpec.from_json(big.to_json()) == big
    other = cutlass_gemm.kernel_spec(GemmKey(m=8192, n=8192, k=8192, layout="nt"), params)
    assert other.digest != big.digest
    assert cutlass_gemm.kernel_spec(GemmKey(m=64, n=64, k=64), {**params, "swizzle": 8}) == big
    unaligned = GemmKey(m=64, n=64, k=66, align=4)
    cp = cutlass_gemm.kernel_spec(unaligned, cutlass_gemm.shortlist(unaligned)[0])
    assert cp.align_ab == 2 and cp.kernel.startswith("CpAsync")


GOOD = cutlass_gemm.shortlist(GemmKey(m=8192, n=8192, k=8192))[0]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"tile": [128, 128, 64], "cluster": [1, 2], "kernel": "coop", "epilogue": "tma"}, "need"),
        ({**GOOD, "kernel": "fast"}, "'kernel'"),
        ({**GOOD, "tile": [128, 128]}, "'tile'"),
        ({**GOOD, "tile": [128, 128, 0]}, "'tile'"),
        ({**GOOD, "swizzle": 3}, "'swizzle'"),
        ({**GOOD, "stages": 4}, "unknown cutlass params"),
    ],
)
def test_cutlass_bad_params_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        cutlass_gemm.kernel_spec(GemmKey(m=64, n=64, k=64), params)


def test_cutlass_unsupported_keys_say_why():
    reason = cutlass_gemm.unsupported_reason
    assert "TF32" in reason(GemmKey(m=64, n=64, k=64, dtype="f32", out_dtype="f32"))
    assert "16-byte" in reason(GemmKey(m=64, n=4099, k=64, align=2))
    assert "2-byte aligned" in reason(GemmKey(m=64, n=64, k=4101, align=2))
    assert reason(GemmKey(m=64, n=64, k=64, dtype="f32", out_dtype="f32", compute="tf32")) is None


def test_cutlass_compile_failures_are_remembered_and_never_retried(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path))
    spec = cutlass_gemm.kernel_spec(GemmKey(m=64, n=64, k=64), GOOD)
    assert nvcc_build.failure(spec) is None and nvcc_build.compiled_info(spec) is None
    nvcc_build.record(spec, "failed", {"error": "static_assert failed: tile too large"})
    assert "static_assert" in nvcc_build.failure(spec)

    def no_compiling(*args, **kwargs):
        raise AssertionError("a remembered failure was compiled again")

    monkeypatch.setattr(nvcc_build, "_compile_child", no_compiling)
    errors = cutlass_env.compile_all([spec])
    assert errors == {spec: "static_assert failed: tile too large"}
    with pytest.raises(RuntimeError, match="static_assert"):
        cutlass_gemm.CutlassGemm().build(GemmKey(m=64, n=64, k=64), GOOD)


def test_cutlass_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "c"))
    assert nvcc_build.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("CUTLASS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvcc_build.cache_dir() == tmp_path / "tuner" / "cutlass"


# --- why they do not run here ----------------------------------------------------------------------

SOURCES = [
    (cublas.CublasGemm(), "nvmath", "package missing: nvmath-python"),
    (cublaslt.CublasLtGemm(), "nvmath", "package missing: nvmath-python"),
    (cutlass_gemm.CutlassGemm(), "cutlass_cppgen", "package missing: nvidia-cutlass"),
]


@pytest.mark.parametrize(
    ("source", "module", "reason"), SOURCES, ids=lambda x: getattr(x, "name", "")
)
def test_unavailable_reasons(source, module, reason):
    assert source.unavailable("cpu").startswith("no GPU")
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed here")
    assert source.unavailable("cuda").startswith(reason)


def test_cutlass_offers_asks_the_library_only_about_unknown_kernels(tmp_path, monkeypatch):
    """A compiled kernel is offered and a missing one is remembered: warm runs build no registry."""
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path))
    key = GemmKey(m=64, n=64, k=64)
    compiled = cutlass_gemm.kernel_spec(key, GOOD)
    missing = cutlass_gemm.kernel_spec(key, {**GOOD, "tile": [64, 64, 64]})
    unknown = cutlass_gemm.kernel_spec(key, {**GOOD, "tile": [128, 64, 64]})
    asked = []

    def lookup(spec: cutlass_env.KernelSpec) -> None:
        asked.append(spec)
        if spec == missing:
            raise LookupError("not in this library")

    nvcc_build.record(compiled, "compiled", {"seconds": 1.0, "name": "k"})
    assert cutlass_env.offers(compiled, lookup) and asked == []
    assert not cutlass_env.offers(missing, lookup) and asked == [missing]
    assert not cutlass_env.offers(missing, lookup) and asked == [missing]
    assert cutlass_env.offers(unknown, lookup) and asked == [missing, unknown]
