"""CUTLASS SM90 mixed-input INT4 GEMMs (tuner.candidates.cutlass_w4a16): the keys it takes and
why not the others, its kernel specs, the library's C++ (cutlass_library, where installed), the
weight and scale conversions on real tensors, its artifact bundle; on a GPU, compiled kernels
against the float32 GEMM on the dequantized weight, through the tuner's own numerics gate."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tuner.cache.artifacts import ArtifactStore
from tuner.candidates import (
    cutlass_env,
    cutlass_gemm,
    kernel_artifacts,
    nvcc_build,
    registry,
    stream_k_share,
)
from tuner.candidates import cutlass_w4a16 as w4
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure import samples
from tuner.quant import int4, int4_torch

HAS_LIBRARY = importlib.util.find_spec("cutlass_library") is not None
needs_library = pytest.mark.skipif(not HAS_LIBRARY, reason="needs nvidia-cutlass (cutlass_library)")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def key_of(spec: str, m: int, n: int = 256, k: int = 512, dtype: str = "bf16") -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **{**lowbit_fields(spec), "dtype": dtype, "out_dtype": dtype})


def test_registered_beside_the_other_sources() -> None:
    assert registry.BUILTIN["cutlass_w4a16"] == "tuner.candidates.cutlass_w4a16:CutlassW4A16"


def test_which_keys_it_takes_and_why_not_the_others() -> None:
    source = w4.CutlassW4A16()
    assert source.unsupported(key_of("int4-g128", 16)) is None
    assert source.unsupported(key_of("int4-g64", 300, dtype="f16")) is None
    fp8 = GemmKey(m=16, n=256, k=512, **lowbit_fields("fp8-rowwise"))
    assert source.unsupported(fp8) == "int4 weights only"
    assert source.unsupported(GemmKey(m=8, n=8, k=8)) == "int4 weights only"
    assert "group=32" in source.unsupported(key_of("int4-g32", 16))


def test_unaligned_activations_are_refused_with_the_reason() -> None:
    key = GemmKey(m=4, n=256, k=512, **{**lowbit_fields("int4-g128"), "align": 8})
    assert "align=8" in w4.unsupported_reason(key)


def test_shortlists_by_m_and_their_specs() -> None:
    small, medium, large = (key_of("int4-g128", m) for m in (1, 300, 4096))
    assert w4.shortlist(small) == w4.SMALL
    assert w4.shortlist(medium) == w4.MEDIUM
    assert w4.shortlist(large) == w4.LARGE
    spec = w4.kernel_spec(small, w4.SMALL[2])
    assert (spec.wdtype, spec.dtype, spec.layout, spec.align_ab, spec.align_c) == (
        "int4", "bf16", "nt", 8, 8
    )  # fmt: skip
    assert (spec.tile, spec.cluster, spec.scheduler) == ((128, 128, 64), (2, 1), "StreamK")
    assert (spec.kernel, spec.a_layout) == ("TmaWarpSpecializedCooperative", "reordered")
    # one kernel per config and dtype, whatever the shape or group size
    assert w4.kernel_spec(key_of("int4-g64", 7, n=4096, k=4096), w4.SMALL[2]) == spec
    assert w4.kernel_spec(key_of("int4-g128", 1, dtype="f16"), w4.SMALL[2]) != spec
    # N out of the reordered atom's 16s: the same tiles on the row-major A
    odd_n = w4.shortlist(key_of("int4-g128", 300, n=264))
    assert odd_n == [w4.row_major(p) for p in w4.MEDIUM] and "a_layout" not in odd_n[0]
    plain_params = w4.row_major(w4.SMALL[2])
    plain = cutlass_gemm.kernel_spec(GemmKey(m=8, n=256, k=512, layout="nt"), plain_params)
    assert plain.digest != spec.digest
    assert cutlass_env.BUILDERS[spec.wdtype] == w4.__name__


def test_the_wrapper_text_is_part_of_int4_kernel_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper change addresses new int4 libraries, in the local cache and in the artifact
    store (old ones are never loaded with a new Python side); plain kernels' keys do not
    depend on it."""
    spec = w4.kernel_spec(key_of("int4-g128", 16), w4.row_major(w4.SMALL[0]))
    plain_params = w4.row_major(w4.SMALL[0])
    plain = cutlass_gemm.kernel_spec(GemmKey(m=8, n=256, k=512, layout="nt"), plain_params)

    def keys() -> tuple[str, ...]:
        ids = (kernel_artifacts.artifact_spec(s).id for s in (spec, plain))
        return (spec.digest, plain.digest, *ids)

    before = keys()
    assert cutlass_env.builder_fields(spec) == {"wrapper": w4.WRAPPER_DIGEST}
    assert cutlass_env.builder_fields(plain) == {}
    monkeypatch.setattr(w4, "WRAPPER_DIGEST", "another")
    after = keys()
    assert (after[0] != before[0], after[1] == before[1]) == (True, True)
    assert (after[2] != before[2], after[3] == before[3]) == (True, True)


def test_bad_params_name_the_field() -> None:
    key = key_of("int4-g128", 16)
    with pytest.raises(ValueError, match="'kernel' must be one of"):
        w4.kernel_spec(key, {**w4.SMALL[0], "kernel": "cpasync"})
    with pytest.raises(ValueError, match="'epilogue' must be 'tma'"):
        w4.kernel_spec(key, {**w4.SMALL[0], "epilogue": "default"})
    with pytest.raises(ValueError, match="'tile' must be 3 positive ints"):
        w4.kernel_spec(key, {**w4.SMALL[0], "tile": [64, 128]})


STREAM_K = w4._p(128, 256, (2, 1), "coop", "streamk")
WS_STREAM_K = w4._p(64, 256, (2, 1), "ws_streamk", share="even")  # one of MEDIUM's


def test_the_stream_k_ws_kernel_is_a_kernel_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ws_streamk``: the ws kernel's tile and mainloop under our own name, its header's digest
    in its spec's, so that a change to the header addresses new libraries."""
    key = key_of("int4-g128", 256)
    assert WS_STREAM_K in w4.MEDIUM
    spec = w4.kernel_spec(key, WS_STREAM_K)
    assert (spec.kernel, spec.cluster, spec.tile) == (w4.STREAM_K_KERNEL, (2, 1), (64, 256, 64))
    ws = w4.kernel_spec(key, w4.MEDIUM[0])
    assert spec != ws and ws.cluster == spec.cluster
    assert w4.kernel_spec(key, {**WS_STREAM_K, "cluster": [1, 1]}) != spec
    assert w4.wrapper_fields(spec).keys() == {"wrapper", "reordered", "streamk", "streamk_c"}
    assert w4.wrapper_fields(spec)["streamk_c"] == w4.STREAM_K_C
    assert set(w4.wrapper_fields(ws)) == {"wrapper", "reordered"}
    digests = spec.digest, ws.digest  # a digest reads the header when it is asked for
    edited = tmp_path / "streamk.hpp"
    edited.write_text(w4.STREAM_K_HEADER.read_text() + "\n")
    monkeypatch.setattr(w4, "STREAM_K_HEADER", edited)
    assert (spec.digest, ws.digest) != digests and ws.digest == digests[1]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({**STREAM_K, "splits": 0}, r"'splits' must be an int in 1\.\.16, got 0"),
        ({**STREAM_K, "splits": 3.0, "decomposition": "splitk"}, "'splits' must be an int"),
        ({**STREAM_K, "splits": True}, "'splits' must be an int"),
        ({**STREAM_K, "decomposition": "split-k"}, r"'decomposition' must be one of \['heur"),
        ({**STREAM_K, "raster": "m"}, r"'raster' must be one of \['heuristic', 'weight', 'x'\]"),
        ({**STREAM_K, "decomposition": "splitk"}, "'splitk' takes 2 or more splits"),
        ({**STREAM_K, "splits": 2}, r"'splits'=2 and 'decomposition'='heuristic'"),
        ({**w4.MEDIUM[0], "decomposition": "streamk"}, "needs scheduler 'streamk', got 'default'"),
        ({**w4.MEDIUM[0], "raster": "x"}, "the 'ws' kernel is not persistent"),
        ({**WS_STREAM_K, "raster": "x"}, "the 'ws_streamk' kernel takes the steps in its own"),
        ({**WS_STREAM_K, "cluster": [4, 1]}, r"'cluster' must be one of \[\[1, 1\], \[2, 1\]\]"),
        ({**WS_STREAM_K, "scheduler": "streamk"}, r"'scheduler' must be one of \['default'\] for"),
        ({**WS_STREAM_K, "swizzle": 2}, r"'swizzle' must be one of \[1\] for kernel 'ws_streamk'"),
        (
            {**WS_STREAM_K, "share": "fair"},
            r"'share' must be one of \['even', 'cost', 'split'\] for",
        ),
        (
            {**w4.MEDIUM[0], "share": "even"},
            "'share' is the 'ws_streamk' kernel's, got kernel 'ws'",
        ),
        ({**WS_STREAM_K, "tile": [64, 128, 64]}, r"'tile' must be one of \[\[64, 256, 64\]\] for"),
        ({k: v for k, v in WS_STREAM_K.items() if k != "kernel"}, r"need \['kernel'\]"),
        (
            {**STREAM_K, "reduction": "nondeterministic"},
            r"unknown cutlass_w4a16 params \['reduction'\]; allowed: \[.*'splits', 'decomposition'",
        ),
        ({**STREAM_K, "split": 2}, r"unknown cutlass_w4a16 params \['split'\]"),
    ],
)
def test_bad_scheduler_params_name_the_field_and_the_allowed_values(
    params: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        w4.kernel_spec(key_of("int4-g128", 256), params)


def test_scheduler_params_are_runtime_arguments_of_one_kernel() -> None:
    """Splits, decomposition and raster order reach the launcher as CUTLASS's enum values and
    address no new library."""
    key = key_of("int4-g128", 256)
    split = {**STREAM_K, "decomposition": "splitk", "splits": 3, "swizzle": 2}
    assert w4.kernel_spec(key, split) == w4.kernel_spec(key, STREAM_K)
    assert w4.scheduler_args(split) == w4.Scheduler(swizzle=2, splits=3, decomposition=2, raster=0)
    assert w4.scheduler_args(STREAM_K) == w4.Scheduler(1, 1, 0, 0)
    forced = {**STREAM_K, "decomposition": "streamk", "raster": "x"}
    assert w4.scheduler_args(forced) == w4.Scheduler(1, 1, 3, 2)
    pingpong = {**w4.MEDIUM[1], "raster": "weight"}
    assert w4.scheduler_args(pingpong) == w4.Scheduler(1, 1, 0, 1)
    assert w4.CutlassW4A16().launch_options(split) == w4.Options(w4.scheduler_args(split), True)


def test_the_share_out_is_a_runtime_argument_of_the_stream_k_ws_kernel() -> None:
    """``share`` reaches the launcher and addresses no new library; the ws kernel has none."""
    key = key_of("int4-g128", 256)
    cost = {**WS_STREAM_K, "share": "cost"}
    assert w4.kernel_spec(key, cost) == w4.kernel_spec(key, WS_STREAM_K)
    assert w4.launch_options(cost).share == "cost"
    assert w4.launch_options(WS_STREAM_K).share == "even"
    assert w4.launch_options(w4.MEDIUM[0]).share is None


@needs_library
def test_configs_that_share_a_kernel_are_all_candidates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Configs that differ in scheduler arguments share one kernel: each stays a candidate while
    the kernel can run, and all go with it once it failed to compile."""
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path))
    split = [{**STREAM_K, "decomposition": "splitk", "splits": s} for s in (2, 3)]
    listed = [*w4.MEDIUM, *split, {**STREAM_K, "raster": "x"}]
    monkeypatch.setattr(w4, "MEDIUM", listed)
    key = key_of("int4-g128", 256)
    specs = [w4.kernel_spec(key, p) for p in listed]
    for spec in specs:
        nvcc_build.record(spec, "compiled", {"seconds": 1.0})
    source = w4.CutlassW4A16()
    assert source.candidates(key, "cuda") == listed
    shared = w4.kernel_spec(key, STREAM_K)
    (tmp_path / "compiled" / f"{shared.digest}.json").unlink()
    nvcc_build.record(shared, "failed", {"error": "ptxas: too many resources"})
    left = source.candidates(key, "cuda")
    assert left == [p for p in listed if w4.kernel_spec(key, p) != shared]
    assert len(left) == len(listed) - 4


@needs_library
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_every_shortlisted_kernel_is_one_the_generator_lists(dtype: str) -> None:
    for m in (1, 300, 4096):
        key = key_of("int4-g128", m, dtype=dtype)
        offered = w4.CutlassW4A16().offered(key)
        assert list(offered) == list(
            dict.fromkeys(w4.kernel_spec(key, p) for p in w4.shortlist(key))
        )
    odd = w4.kernel_spec(key_of("int4-g128", 1), {**w4.SMALL[0], "tile": [64, 64, 64]})
    assert not w4.in_library(odd)
    with pytest.raises(LookupError, match="lists no SM90 int4 GEMM"):
        w4.source(odd)


@needs_library
def test_the_stream_k_source_renames_the_ws_kernel_and_sets_its_cluster() -> None:
    spec = w4.kernel_spec(key_of("int4-g128", 256), WS_STREAM_K)
    text = w4.source(spec)
    name = w4.operation(spec).procedural_name()
    assert "_2x1x1_" in name and w4.operation(spec).kernel_schedule.name == "TmaWarpSpecialized"
    base = "cutlass::gemm::kernel::GemmUniversal<"  # only in the header: the emitted kernel's
    assert f"{name}_base = tuner::GemmStreamK1<" in text
    assert text.count(base) == w4.STREAM_K_HEADER.read_text().count(base)
    assert "cute::Shape<cute::_2, cute::_1, cute::_1>" in text
    assert 'extern "C" int tuner_streamk_layout(' in text
    assert "tuner_streamk_layout" not in w4.source(
        w4.kernel_spec(key_of("int4-g128", 256), w4.MEDIUM[0])
    )
    epilogue = text.split("epilogue::collective::CollectiveBuilder<")[1].split("::CollectiveOp")[0]
    assert "void, cutlass::layout::ColumnMajor" in epilogue  # no C (beta is 0), D is bf16
    assert "cutlass::bfloat16_t, cutlass::layout::ColumnMajor" in epilogue
    ws = w4.kernel_spec(key_of("int4-g128", 256), w4.MEDIUM[0])
    assert w4.operation(ws).C.element.name == "bf16"  # the listed op is left as it was
    one = w4.kernel_spec(key_of("int4-g128", 256), {**WS_STREAM_K, "cluster": [1, 1]})
    assert "_1x1x1_" in w4.operation(one).procedural_name()  # the listed 2 x 1 op, made 1 x 1
    assert "cute::Shape<cute::_1, cute::_1, cute::_1>" in w4.source(one)
    assert w4.in_library(spec) and w4.in_library(one)


@needs_library
def test_compile_all_hands_int4_specs_to_this_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child process runs this module's compile; a kernel the generator does not list fails
    there for good (recorded, never compiled again)."""
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path))
    odd = w4.kernel_spec(key_of("int4-g128", 1), {**w4.SMALL[0], "tile": [64, 64, 64]})
    error = nvcc_build._compile_child(odd, timeout_s=300)
    assert error is not None and "lists no SM90 int4 GEMM" in error
    assert nvcc_build.failure(odd) == error


@needs_library
def test_the_library_source_is_a_scale_and_zero_kernel_with_our_wrapper() -> None:
    spec = w4.kernel_spec(key_of("int4-g128", 16), w4.row_major(w4.SMALL[2]))
    text = w4.source(spec)
    name = w4.operation(spec).procedural_name()
    assert "_s4_bf16_" in name and "_sclzr_" in name and "shfl" not in name
    assert "cute::tuple<cutlass::int4b_t, cutlass::bfloat16_t, cutlass::bfloat16_t>" in text
    assert f"GemmUniversalAdapter<{name}>" in text
    assert 'extern "C"' in text and "int tuner_plan_run(" in text and "${" not in text
    assert "decompose(args.scheduler, sched.splits, sched.decomposition, 0);" in text
    command = w4.nvcc_command(spec, Path("k.cu"), Path("k.so"))
    assert "-gencode=arch=compute_90a,code=sm_90a" in command and "-DNDEBUG" in command


def test_weight_bytes_round_trip_and_hold_signed_nibbles() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (24, 256), generator=gen, dtype=torch.uint8)
    packed = w4.to_cutlass(q)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 128)
    assert torch.equal(w4.from_cutlass(packed), q)
    low = (packed & 15).to(torch.int16)
    signed = torch.where(low >= 8, low - 16, low)  # int4b_t's two's complement
    assert torch.equal(signed, q[:, 0::2].to(torch.int16) - 8)
    with pytest.raises(ValueError, match=r"q.shape=\(4, 3\)"):
        w4.to_cutlass(q[:4, :3])
    with pytest.raises(ValueError, match="packed: expected a uint8"):
        w4.from_cutlass(packed.to(torch.int32))


def test_torch_packed_weight_converts_once_per_tensor_version() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (16, 256), generator=gen, dtype=torch.uint8)
    packed = int4_torch.torch_pack(q)  # this device's packing (the CPU's here)
    converted = w4.weight(packed)
    assert torch.equal(w4.from_cutlass(converted), q)
    assert w4.weight(packed) is converted
    packed.copy_(int4_torch.torch_pack(torch.full_like(q, 3)))  # changed in place
    assert int(w4.from_cutlass(w4.weight(packed)).max()) == 3


def test_reorder_places_each_nibble_where_the_atom_says() -> None:
    """Nibble (m, k) lands at 256 (N / 16) kt + 256 mt + 32 m0 + 8 k1 + 4 k0 + 2 k2 + m1, with
    m = 16 mt + 8 m1 + m0 and k = 16 kt + 8 k2 + 2 k1 + k0 (CUTLASS's 16 x 16 reorder atom for
    bf16 / f16 MMAs, tiled along N first); element e is byte e // 2's low nibble when e is even."""
    n, k = 48, 64
    q = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
    a = w4.to_cutlass(q)
    out = w4.reorder(a)
    assert out.shape == a.shape and out.dtype == torch.uint8
    flat = torch.stack([out & 15, out >> 4], dim=2).reshape(-1)
    for m in range(n):
        for kk in range(k):
            mt, m1, m0 = m // 16, (m // 8) % 2, m % 8
            kt, k2, k1, k0 = kk // 16, (kk // 8) % 2, (kk // 2) % 4, kk % 2
            e = 256 * (n // 16) * kt + 256 * mt + 32 * m0 + 8 * k1 + 4 * k0 + 2 * k2 + m1
            assert int(flat[e]) == int(q[m, kk]) ^ 8
    assert torch.equal(w4.unreorder(out), a)
    with pytest.raises(ValueError, match="N and K in 16s, got N=40, K=64"):
        w4.reorder(a[:40])
    with pytest.raises(ValueError, match="a: expected a uint8"):
        w4.reorder(a.to(torch.int32))


def test_the_reordered_layout_is_a_kernel_of_its_own() -> None:
    """``a_layout`` names another library (its own wrapper code in the digest) and reaches the
    launcher; row-major kernels' digests and artifact ids do not move."""
    key = key_of("int4-g128", 256)
    plain, reordered = w4.row_major(w4.MEDIUM[0]), w4.MEDIUM[0]
    spec = w4.kernel_spec(key, reordered)
    assert spec.a_layout == "reordered" and spec != w4.kernel_spec(key, plain)
    assert "a_layout" not in w4.kernel_spec(key, plain).to_json()
    assert cutlass_env.builder_fields(spec) == {
        "wrapper": w4.WRAPPER_DIGEST,
        "reordered": w4.REORDERED_DIGEST,
    }
    assert w4.launch_options(reordered) == w4.Options(w4.scheduler_args(plain), True)
    assert w4.launch_options(plain).reordered is False
    with pytest.raises(ValueError, match="'a_layout' must be one of \\['reordered'\\]"):
        w4.kernel_spec(key, {**plain, "a_layout": "shuffled"})
    with pytest.raises(ValueError, match=r"needs N in 16s .* got N=264"):
        w4.kernel_spec(key_of("int4-g128", 256, n=264), reordered)


def test_scales_split_into_two_contiguous_n_major_tensors() -> None:
    gen = torch.Generator().manual_seed(2)
    sz = torch.randn(4, 24, 2, generator=gen).to(torch.bfloat16)
    scale, zero = w4.scales(sz)
    assert scale.is_contiguous() and zero.is_contiguous() and scale.shape == (4, 24)
    assert torch.equal(scale, sz[..., 0]) and torch.equal(zero, sz[..., 1])
    assert w4.scales(sz)[0] is scale
    with pytest.raises(ValueError, match=r"scales_and_zeros.shape=\(4, 24\)"):
        w4.split_scales(sz[..., 0])


def test_a_library_bundle_installs_where_the_launcher_loads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "cutlass"))
    spec = w4.kernel_spec(key_of("int4-g128", 16), w4.SMALL[0])
    built = tmp_path / "built.so"
    built.write_bytes(b"\x7fELF library")
    with ArtifactStore(tmp_path / "artifacts") as store:
        assert not kernel_artifacts.install(store, spec)
        kernel_artifacts.publish(store, spec, built)
        assert kernel_artifacts.install(store, spec)
    assert w4.CutlassW4A16().load(spec).read_bytes() == b"\x7fELF library"
    assert nvcc_build.compiled_info(spec) is not None  # compile_all will not compile it


# --- on a GPU -----------------------------------------------------------------------------------

GPU_CASES = [  # the shortlists' kernels, A reordered, and one on the row-major A
    ("int4-g128", 16, 0, "bf16", False),  # decode, warp-specialized
    ("int4-g64", 200, 2, "f16", False),  # stream-K, a partial tile of x
    ("int4-g256", 600, 1, "bf16", False),  # a large-M config
    ("int4-g128", 256, 0, "bf16", True),  # the 64 x 256 ws kernel on the row-major A
]


def _key(fmt: str, m: int, dtype: str = "bf16") -> GemmKey:
    return key_of(fmt, m, n=384, k=1024, dtype=dtype)


def _params(key: GemmKey, index: int, row_major: bool) -> dict:
    params = w4.shortlist(key)[index]
    return w4.row_major(params) if row_major else params


@pytest.fixture(scope="module")
def source() -> w4.CutlassW4A16:
    """The source, with every kernel these tests run compiled at once (in parallel)."""
    source = w4.CutlassW4A16()
    cases = [(_key(fmt, m, dtype), index, rows) for fmt, m, index, dtype, rows in GPU_CASES]
    specs = [w4.kernel_spec(key, _params(key, index, rows)) for key, index, rows in cases]
    specs.append(w4.kernel_spec(_key("int4-g128", 256), w4.MEDIUM[0]))  # reordered, beside it
    specs += [
        w4.kernel_spec(_key("int4-g128", 256, d), {**WS_STREAM_K, "cluster": c})
        for d in ("bf16", "f16")
        for c in ([2, 1], [1, 1])
    ]
    assert cutlass_env.compile_all(specs) == dict.fromkeys(specs)
    return source


def _nibble_pairs_swapped(key: GemmKey, packed: torch.Tensor) -> torch.Tensor:
    """``packed`` with each pair of neighbouring k swapped: a planted wrong weight."""
    q = int4_torch.nibbles(packed)
    return int4_torch.torch_pack(q.reshape(key.n, -1, 2).flip(-1).reshape(key.n, key.k))


def _runner(source: w4.CutlassW4A16, key: GemmKey, index: int, row_major: bool = False):
    assert source.unavailable("cuda") is None and source.unsupported(key) is None
    return source.build(key, _params(key, index, row_major))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("fmt", "m", "index", "dtype", "row_major"), GPU_CASES)
def test_compiled_kernels_match_the_dequantized_fp32_gemm(
    source: w4.CutlassW4A16, fmt: str, m: int, index: int, dtype: str, row_major: bool
) -> None:
    key = _key(fmt, m, dtype)
    inputs = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(3))
    out = samples.output_like(key, inputs)
    assert _runner(source, key, index, row_major)(*inputs, out=out) is out
    assert samples.relative_error(out, samples.reference(key, inputs)) <= 1


@pytest.mark.gpu
@needs_gpu
def test_the_reordered_kernel_reads_what_the_row_major_one_reads(source: w4.CutlassW4A16) -> None:
    """The same tile on either A layout passes the gate, and a wrong weight (nibble pairs
    swapped) or the row-major bytes handed to the reordered kernel fail it."""
    key = _key("int4-g128", 256)
    x, packed, sz = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(8))
    ref = samples.reference(key, (x, packed, sz))
    reordered = _runner(source, key, 0)
    assert samples.relative_error(reordered(x, packed, sz), ref) <= 1
    assert samples.relative_error(_runner(source, key, 0, row_major=True)(x, packed, sz), ref) <= 1
    swapped = _nibble_pairs_swapped(key, packed)
    assert samples.relative_error(reordered(x, swapped, sz), ref) > 1
    (w, *rest), c, _ = reordered.operands(x, packed, sz)
    assert w == w4.reordered_weight(packed).data_ptr()
    row_major = w4.weight(packed)
    rows = [row_major.data_ptr(), *rest]
    assert reordered.run(reordered.plan(reordered.stream()), *rows, reordered.stream()) == 0
    assert samples.relative_error(c, ref) > 1


@pytest.mark.gpu
@needs_gpu
def test_a_planted_wrong_weight_is_caught(source: w4.CutlassW4A16) -> None:
    key = _key("int4-g128", 16)
    x, packed, sz = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(4))
    ref = samples.reference(key, (x, packed, sz))
    run = _runner(source, key, 0)
    assert samples.relative_error(run(x, packed, sz), ref) <= 1
    swapped = _nibble_pairs_swapped(key, packed)
    assert samples.relative_error(run(x, swapped, sz), ref) > 1
    other_groups = sz.roll(1, dims=0).contiguous()
    assert samples.relative_error(run(x, packed, other_groups), ref) > 1
    wd = int4.dequantize(int4_torch.nibbles(packed), sz, key.group)
    assert torch.allclose(ref.ref, x.float() @ wd.T)


@pytest.mark.gpu
@needs_gpu
def test_known_and_new_pointer_sets_each_give_their_own_result(
    source: w4.CutlassW4A16, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launcher keeps initialized params per operand pointer set: a known set only launches
    (stream-K's workspace re-zeroed each call), a new x or out is initialized anew, and a set
    evicted from a full plan comes back right."""
    monkeypatch.setattr(w4, "PLAN_ENTRIES", 2)
    key = _key("int4-g64", 200, "f16")
    run = _runner(source, key, 2)
    assert w4.shortlist(key)[2]["scheduler"] == "streamk"
    gen = torch.Generator("cuda").manual_seed(5)
    sets = [samples.make_inputs(key, "cuda", gen) for _ in range(3)]
    refs = [samples.reference(key, s) for s in sets]
    outs = [samples.output_like(key, s) for s in sets]
    for i in (0, 0, 0, 1, 0, 2, 1, 2, 0, 1):  # 3 sets through 2 entries: hits and evictions
        outs[i].fill_(float("nan"))  # an element left unwritten fails
        assert run(*sets[i], out=outs[i]) is outs[i]
        assert samples.relative_error(outs[i], refs[i]) <= 1
    x, (_, packed, sz) = sets[1][0], sets[0]  # only x differs from a known set
    mixed = samples.reference(key, (x, packed, sz))
    assert samples.relative_error(run(x, packed, sz, out=outs[0]), mixed) <= 1
    fresh = samples.output_like(key, sets[0])  # only out differs
    assert run(*sets[0], out=fresh) is fresh
    assert samples.relative_error(fresh, refs[0]) <= 1
    assert samples.relative_error(run(*sets[2]), refs[2]) <= 1  # out allocated by the launcher


@pytest.mark.gpu
@needs_gpu
def test_activations_it_cannot_take_are_refused_with_the_reason(source: w4.CutlassW4A16) -> None:
    key = _key("int4-g128", 16)
    x, packed, sz = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(6))
    run = _runner(source, key, 0)
    with pytest.raises(ValueError, match=r"x: expected torch.bfloat16 \[16, 1024\]"):
        run(x.float(), packed, sz)
    with pytest.raises(ValueError, match=r"x: expected .* got torch.bfloat16 \[8, 1024\]"):
        run(x[:8], packed, sz)
    with pytest.raises(ValueError, match="must be contiguous and 16-byte aligned"):
        run(x.t().contiguous().t(), packed, sz)
    with pytest.raises(ValueError, match=r"with scales \[4, .*group=128"):
        run(x, packed, sz[:4].contiguous())  # half the groups of K
    assert samples.relative_error(run(x, packed, sz), samples.reference(key, (x, packed, sz))) <= 1


# (fmt, m, n, k, dtype): a tile split over up to 16 CTAs (fewer steps than SMs), tiles of weight
# rows that do not fill the last cluster, a partial tile of x in f16, a narrow projection's shape
# (72 tiles of 56 steps on every SM), whole tiles between a CTA's partial ones (several stores a
# CTA), and a shape whose cost share-out leaves the last clusters idle (64 tiles, 2 runs each)
WS_STREAM_K_CASES = [
    ("int4-g128", 256, 384, 1024, "bf16"),
    ("int4-g128", 256, 320, 1024, "bf16"),  # 5 tiles of weight rows: a cluster's second CTA idle
    ("int4-g64", 200, 384, 1024, "f16"),
    ("int4-g128", 256, 4608, 3584, "bf16"),
    ("int4-g128", 300, 8192, 1024, "bf16"),
    ("int4-g128", 256, 4096, 4096, "bf16"),
]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("share", list(stream_k_share.SHARES))
@pytest.mark.parametrize("cluster", [[2, 1], [1, 1]])
@pytest.mark.parametrize(("fmt", "m", "n", "k", "dtype"), WS_STREAM_K_CASES)
def test_the_stream_k_ws_kernel_sums_split_tiles_right_and_bit_for_bit(
    source: w4.CutlassW4A16,
    fmt: str,
    m: int,
    n: int,
    k: int,
    dtype: str,
    cluster: list[int],
    share: str,
) -> None:
    """Every element written, within the numerics gate, the same bits on every call (partials
    summed in CTA order; the owners reset the flags the next call counts on), and a planted
    wrong weight caught; under each share-out."""
    key = key_of(fmt, m, n=n, k=k, dtype=dtype)
    run = source.build(key, {**WS_STREAM_K, "cluster": cluster, "share": share})
    inputs = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(9))
    ref = samples.reference(key, inputs)
    first = samples.output_like(key, inputs).fill_(float("nan"))
    assert run(*inputs, out=first) is first
    ((_, workspace),) = run.plans.values()  # the share-out is in the workspace the kernel read
    offset, words = run.share_out
    assert torch.equal(workspace[offset : offset + words.numel() * 8].view(torch.int64), words)
    clusters = (words.numel() - 1) // 2
    # the weight's 64-row tiles over the cluster, x's 256-row tiles, K's 64-value tiles
    steps = math.ceil(math.ceil(n / 64) / cluster[0]) * math.ceil(m / 256) * math.ceil(k / 64)
    assert (int(words[0]), int(words[clusters])) == (0, steps)
    assert samples.relative_error(first, ref) <= 1
    for _ in range(3):
        assert torch.equal(run(*inputs), first)
    x, packed, sz = inputs
    swapped = _nibble_pairs_swapped(key, packed)
    assert samples.relative_error(run(x, swapped, sz), ref) > 1
    assert torch.equal(run(*inputs), first)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    "runtime",
    [
        {"decomposition": "splitk", "splits": 3},
        {"decomposition": "splitk", "splits": 16},  # more splits than K steps: CUTLASS caps them
        {"decomposition": "streamk"},
        {"decomposition": "dataparallel", "raster": "x"},
    ],
)
def test_scheduler_arguments_keep_the_result_and_repeat_it_bit_for_bit(
    source: w4.CutlassW4A16, runtime: dict
) -> None:
    """The stream-K kernel of GPU_CASES under each decomposition: every element written, within
    the numerics gate, and the same bits on every call (partial tiles summed in a fixed order)."""
    key = _key("int4-g64", 200, "f16")
    run = source.build(key, {**w4.shortlist(key)[2], **runtime})
    inputs = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(7))
    first = samples.output_like(key, inputs).fill_(float("nan"))
    run(*inputs, out=first)
    assert samples.relative_error(first, samples.reference(key, inputs)) <= 1
    for _ in range(3):
        assert torch.equal(run(*inputs), first)
