"""The FP8 library sources (cuBLASLt through nvmath, CUTLASS SM90) without a GPU: which keys they
take and why they decline the others, CUTLASS FP8 kernel specs and params, scale operands, and
plain CUTLASS specs whose digests (the addresses of stored kernels) must not move."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from tuner.candidates import cutlass_env, cutlass_fp8, cutlass_gemm, registry
from tuner.candidates import gemm_operands as ops
from tuner.candidates.cublaslt_fp8 import CLUSTER_TWIN, CublasLtFp8, with_cluster_twin
from tuner.candidates.cutlass_fp8 import CutlassFp8
from tuner.core.keys import GemmKey, lowbit_fields

SEEDED_CACHE = Path(__file__).parents[2] / "bench/results/cutlass_cache_h200_sm90.tar.xz"
CUTLASS_VERSION = "4.2.0.0"  # the nvidia-cutlass that built SEEDED_CACHE (.whl/)


def fp8(spec: str, m: int = 16, n: int = 4096, k: int = 4096, **fields) -> GemmKey:
    return GemmKey(m=m, n=n, k=k, **{**lowbit_fields(spec), **fields})


DECLINED = [  # key, reason of cublaslt_fp8 (None: taken), reason of cutlass_fp8
    (GemmKey(m=16, n=256, k=256, layout="nt"), "fp8 operands only", "fp8 operands only"),
    (fp8("int4-g128"), "fp8 operands only", "fp8 operands only"),
    (fp8("fp8-tensorwise", k=4104, align=8), "align=8", "align=8"),
    (fp8("fp8-tensorwise", wdtype="fp8_e5m2"), None, "e4m3 x e4m3 kernels only"),
    (fp8("fp8-tensorwise-fast", out_dtype="f16"), None, "bf16 output kernels only"),
    (fp8("fp8-rowwise", n=4100), None, "output rows are not 16-byte aligned"),
]


@pytest.mark.parametrize(("key", "lt_reason", "cutlass_reason"), DECLINED, ids=lambda v: str(v))
def test_fp8_sources_say_which_keys_they_decline(key, lt_reason, cutlass_reason):
    lt = CublasLtFp8().unsupported(key)
    assert lt == lt_reason if lt_reason is None else lt_reason in lt
    assert cutlass_reason in CutlassFp8().unsupported(key)


@pytest.mark.parametrize(
    "spec", ["fp8-tensorwise", "fp8-rowwise", "fp8-tensorwise-fast", "fp8-rowwise-fast"]
)
def test_fp8_sources_take_both_granularities_and_accumulations(spec):
    """cuBLASLt (FAST_ACCUM) and CUTLASS (FP8FastAccum kernels) honour both accumulation
    contracts; cuBLASLt's rowwise keys are asked of its heuristic on a GPU."""
    key = fp8(spec, m=5, n=256, k=512)
    assert CutlassFp8().unsupported(key) is None
    if key.scale == "tensor" or not torch.cuda.is_available():
        assert CublasLtFp8().unsupported(key) is None


def test_fp8_sources_need_a_gpu_and_dense_ones_point_to_them():
    for name in ("cublaslt_fp8", "cutlass_fp8"):
        assert "no GPU" in registry.get(name).unavailable("cpu")
    key = fp8("fp8-rowwise")
    assert "cublaslt_fp8" in registry.get("cublaslt").unsupported(key)
    assert "cutlass_fp8" in registry.get("cutlass").unsupported(key)


def test_cutlass_fp8_shortlist_is_small_and_shape_aware():
    small, large = (
        cutlass_fp8.shortlist(fp8("fp8-rowwise", m=16)),
        cutlass_fp8.shortlist(fp8("fp8-rowwise", m=2048)),
    )
    assert 3 <= len(small) <= 4 and 2 <= len(large) <= 3
    assert all(p["scheduler"] == "streamk" for p in small[:2])
    assert small != large
    fast = cutlass_fp8.shortlist(fp8("fp8-rowwise-fast", m=16))
    assert all(p["scheduler"] == "default" for p in fast)  # cutlass_cppgen: no fast stream-K
    assert cutlass_fp8.kernel_spec(fp8("fp8-rowwise-fast"), fast[0]).kernel == (
        "TmaWarpSpecializedPingpongFP8FastAccum"
    )
    for key, shortlist in ((fp8("fp8-tensorwise", m=16), small), (fp8("fp8-rowwise"), large)):
        specs = [cutlass_fp8.kernel_spec(key, p) for p in shortlist]
        assert len(set(specs)) == len(specs)
        assert all(s.tile[2] == cutlass_fp8.TILE_K and s.epilogue == "tma" for s in specs)


def test_cutlass_fp8_kernel_spec_follows_scale_and_accumulation_not_shape():
    params = cutlass_fp8.LARGE[0]
    spec = cutlass_fp8.kernel_spec(fp8("fp8-rowwise", m=2048), params)
    assert spec == cutlass_fp8.kernel_spec(fp8("fp8-rowwise", m=1, n=256, k=512), params)
    assert (spec.dtype, spec.wdtype, spec.out_dtype, spec.scale) == ("fp8_e4m3", "", "bf16", "row")
    assert (spec.align_ab, spec.align_c) == (16, 8)
    assert spec.kernel == "TmaWarpSpecializedCooperative"
    fast = cutlass_fp8.kernel_spec(fp8("fp8-rowwise-fast"), params)
    assert fast.kernel == "TmaWarpSpecializedCooperativeFP8FastAccum"
    tensor = cutlass_fp8.kernel_spec(fp8("fp8-tensorwise"), params)
    assert len({spec.digest, fast.digest, tensor.digest}) == 3
    assert cutlass_env.KernelSpec.from_json(spec.to_json()) == spec
    assert json.loads(spec.to_json())["scale"] == "row"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"kernel": "cpasync_coop"}, "'kernel'"),
        ({"epilogue": "default"}, "'epilogue'"),
        ({"tile": [128, 128]}, "'tile'"),
        ({"scheduler": "split"}, "'scheduler'"),
        ({"stages": 4}, "unknown cutlass params"),
    ],
)
def test_cutlass_fp8_params_are_validated_naming_the_field(change, field):
    params = {**cutlass_fp8.SMALL[0], **change}
    with pytest.raises(ValueError, match=field):
        cutlass_fp8.kernel_spec(fp8("fp8-tensorwise"), params)


def test_plain_cutlass_specs_keep_the_digests_of_their_stored_kernels(monkeypatch):
    """Every compiled-kernel marker of a cache built before scaled specs existed is still found
    under the digest of the spec it records, and the spec serialises as it was stored."""
    monkeypatch.setattr(cutlass_env, "version", lambda: CUTLASS_VERSION)
    checked = 0
    with tarfile.open(SEEDED_CACHE) as tar:
        for member in tar.getmembers():
            path = Path(member.name)
            if path.parent.name != "compiled" or path.suffix != ".json":
                continue
            stored = json.load(tar.extractfile(member))["spec"]
            spec = cutlass_env.KernelSpec.from_json(json.dumps(stored))
            assert spec.digest == path.stem
            assert spec.to_json() == json.dumps(stored, sort_keys=True)
            checked += 1
    assert checked > 0


def test_scale_pointer_names_the_bad_scale():
    cpu = torch.device("cpu")
    good = torch.ones(4, 1)
    assert ops.scale_pointer("scale_a", good, 4, cpu) == good.data_ptr()
    assert ops.scale_pointer("scale_b", good.T, 4, cpu) == good.data_ptr()  # [1, N] view
    assert ops.scale_pointer("scale_a", torch.tensor(2.0), 1, cpu)
    bad = [
        good.double(),  # dtype
        torch.ones(5, 1),  # length
        torch.ones(8, 1)[::2],  # not contiguous
        torch.ones(5, 1)[1:],  # 4 bytes past an aligned start
    ]
    for scale in bad:
        with pytest.raises(ValueError, match=r"scale_b: expected a contiguous torch\.float32"):
            ops.scale_pointer("scale_b", scale, 4, cpu)
    with pytest.raises(ValueError, match="on cuda:0"):
        ops.scale_pointer("scale_a", good, 4, torch.device("cuda", 0))


def test_plain_cutlass_params_still_make_plain_specs():
    key = GemmKey(m=256, n=512, k=384)
    spec = cutlass_gemm.kernel_spec(key, cutlass_gemm.shortlist(key)[0])
    assert (spec.wdtype, spec.out_dtype, spec.scale) == ("", "", "")
    assert set(json.loads(spec.to_json())) == {
        "dtype", "layout", "align_ab", "align_c", "tile", "cluster", "kernel", "epilogue",
        "scheduler",
    }  # fmt: skip


def test_cublaslt_fp8_offers_the_rowwise_algorithm_on_a_1x2_cluster_past_decode():
    H100 = (9, 0)
    first = {"id": 66, "tile": "128x128", "cluster": "1x1x1", "custom": 7}
    other = {**first, "tile": "64x128"}
    for m in (16, 256):
        assert with_cluster_twin(fp8("fp8-rowwise", m=m), [first, other], H100) == [first, other]
    prefill = fp8("fp8-rowwise", m=2048)
    twin = {**first, "cluster": CLUSTER_TWIN}
    assert with_cluster_twin(prefill, [first, other], H100) == [first, other, twin]
    assert with_cluster_twin(prefill, [twin, first], H100) == [twin, first]  # no repeat
    assert with_cluster_twin(prefill, [], H100) == []
    assert with_cluster_twin(prefill, [first], (8, 9)) == [first]  # sm89: no clusters
    tensorwise = fp8("fp8-tensorwise", m=2048)  # its heuristic offers clusters of its own
    assert with_cluster_twin(tensorwise, [first], H100) == [first]
