"""``candidate_label``: the short name tables and progress lines give a candidate, beside the
full ``candidate_name`` that JSON and exports keep."""

from __future__ import annotations

import itertools

import pytest

from tuner.measure.records import (
    ELLIPSIS,
    LABEL_WIDTH,
    Winner,
    candidate_label,
    candidate_name,
)

TRITON_TILED = {"bk": 256, "bm": 16, "bn": 32, "group_m": 8, "kernel": "tiled", "stages": 4,
                "warps": 4}  # fmt: skip
CUDA_W4A16 = {"cluster": 1, "slices": 4, "split": "k", "stages": 2, "stagger": False, "teams": 1,
              "warps": 2}  # fmt: skip
CUBLASLT = {"cluster": "2x1x1", "custom": 0, "id": 66, "inner_shape": 0, "reduction": 0,
            "split_k": 1, "stages": "64xAUTO", "swizzle": 0, "tile": "112x128"}  # fmt: skip


@pytest.mark.parametrize(
    ("source", "params", "label"),
    [
        # the baseline: its source alone
        ("torch", {}, "torch"),
        # Triton's bm/bn/bk read as one M x N x K tile; w warps, s stages, g group_m
        ("triton_gemm", {"bk": 512, "bm": 1, "bn": 8, "kernel": "gemv", "warps": 4},
         "triton_gemm gemv 1x8x512 w4"),
        ("triton_gemm", TRITON_TILED, "triton_gemm tiled 16x32x256 w4 s4 g8"),
        # a true flag is its name, right after the tile
        ("triton_gemm", {**TRITON_TILED, "kernel": "persistent_tma", "pad_k": True},
         "triton_gemm persistent_tma 16x32x256 pad_k w4 s4 g8"),
        # cuBLASLt: tile, cluster, algorithm id; values that change nothing are left out
        ("cublaslt", CUBLASLT, "cublaslt 112x128 c2x1x1 id66 s64xAUTO"),
        ("cublaslt", {**CUBLASLT, "split_k": 12, "reduction": 2, "custom": 3},
         "cublaslt 112x128 c2x1x1 id66 sk12 red2 custom3 s64xAUTO"),
        # stages left for cuBLASLt to pick are no choice either
        ("cublaslt", {**CUBLASLT, "cluster": "AUTO", "stages": "UNDEFINED"},
         "cublaslt 112x128 cAUTO id66"),
        # cuBLAS's default algorithm is plain cuBLAS
        ("cublas", {"algo": -1}, "cublas"),
        ("cublas", {"algo": 5}, "cublas algo5"),
        # CUTLASS: schedule, tile, cluster; its swizzle 1 is no swizzle, stream-K is a word
        ("cutlass", {"cluster": [2, 1], "epilogue": "tma", "kernel": "coop",
                     "scheduler": "default", "swizzle": 1, "tile": [128, 256, 64]},
         "cutlass coop 128x256x64 c2x1 epi=tma"),
        ("cutlass_w4a16", {"cluster": [2, 1], "epilogue": "tma", "kernel": "coop",
                           "scheduler": "streamk", "swizzle": 4, "tile": [128, 256, 64]},
         "cutlass_w4a16 coop streamk 128x256x64 c2x1 swz4 epi=tma"),
        # a false flag is left out
        ("triton_decode", {"bn": 64, "fused": False, "pdl": True, "splits": 16, "stages": 3,
                           "warps": 4},
         "triton_decode bn64 splits16 pdl w4 s3"),
        ("torch_sdpa", {"backend": "cudnn"}, "torch_sdpa cudnn"),
        # our W4A16 decode kernel: a row block a CTA and the driver's carveout (None) are plain
        ("cuda_w4a16", {**CUDA_W4A16, "carveout": None}, "cuda_w4a16 c1 split=k slices=4 w2 s2"),
        ("cuda_w4a16", {**CUDA_W4A16, "carveout": 72},
         "cuda_w4a16 c1 split=k carveout72 slices=4 w2 s2"),
        ("cuda_w4a16", {**CUDA_W4A16, "teams": 4, "warps": 12},
         "cuda_w4a16 c1 split=k slices=4 teams=4 w12 s2"),
        # params it has no short word for: key=value, after the ones it knows
        ("my_plugin", {"variant": "fast", "depth": 3, "cache": True},
         "my_plugin depth=3 variant=fast cache"),
    ],
)  # fmt: skip
def test_label(source: str, params: dict, label: str) -> None:
    assert candidate_label(candidate_name(source, params)) == label


def test_a_name_that_is_not_source_and_json_is_shown_as_it_is() -> None:
    assert candidate_label("torch_sdpa") == "torch_sdpa"
    assert candidate_label("odd:not json") == "odd:not json"


def test_past_its_width_a_label_loses_its_last_words_for_an_ellipsis() -> None:
    name = candidate_name("cublaslt", {**CUBLASLT, "split_k": 12, "reduction": 2, "custom": 3})
    assert candidate_label(name, 40) == f"cublaslt 112x128 c2x1x1 id66 sk12 red2 {ELLIPSIS}"
    assert candidate_label(name, 20) == f"cublaslt 112x128 {ELLIPSIS}"
    assert candidate_label(name, 8) == f"cublasl{ELLIPSIS}"  # not even the source fits
    short = candidate_name("triton_gemm", TRITON_TILED)
    assert candidate_label(short, 100) == candidate_label(short)  # nothing to cut


def test_different_candidates_of_a_source_get_different_labels() -> None:
    """Over a grid of every param the built-in Triton and cuBLASLt sources vary."""
    triton = [
        {"kernel": kernel, "bm": bm, "bn": bn, "bk": bk, "warps": w, "stages": s, "group_m": 8,
         **({"pad_k": True} if pad else {}), **({"split_k": sk} if sk > 1 else {})}
        for kernel, bm, bn, bk, w, s, pad, sk in itertools.product(
            ("tiled", "splitk", "persistent_tma"), (16, 64, 128), (32, 256), (64, 256), (4, 8),
            (3, 4), (False, True), (1, 4))
    ]  # fmt: skip
    cublaslt = [
        {**CUBLASLT, "tile": tile, "cluster": cluster, "custom": custom, "split_k": sk,
         "reduction": red, "swizzle": swz}
        for tile, cluster, custom, sk, red, swz in itertools.product(
            ("64x8", "112x128"), ("1x1x1", "2x1x1"), (0, 1), (1, 7), (0, 2), (0, 1))
    ]  # fmt: skip
    for source, grid in (("triton_gemm", triton), ("cublaslt", cublaslt)):
        labels = {candidate_label(candidate_name(source, p)) for p in grid}
        assert len(labels) == len(grid), source


def test_a_tables_labels_of_the_shortlisted_decode_configs_stay_apart() -> None:
    """Cut to a table's width, the labels of the longest built-in configs (Triton's FP8 and INT4
    decode ones, CUTLASS INT4's stream-K ones) still tell them apart: two FP8 configs that differ
    only in their stages must not read alike."""
    from tuner.candidates import cutlass_w4a16
    from tuner.candidates.triton_kernels import fp8, w4a16

    shapes = [(m, n, k) for m in (1, 8, 16) for n, k in ((1024, 4096), (4096, 14336))]
    grids = {
        "triton_fp8": [c for m, n, k in shapes for c in fp8.configs(m, n, k)],
        "triton_w4a16": [c for m, n, k in shapes for c in w4a16.configs(m, n, k, 128)],
        "cutlass_w4a16": [*cutlass_w4a16.SMALL, *cutlass_w4a16.MEDIUM, *cutlass_w4a16.LARGE],
    }
    for source, grid in grids.items():
        names = {candidate_name(source, p) for p in grid}
        labels = {candidate_label(name, LABEL_WIDTH) for name in names}
        assert len(labels) == len(names), source


def test_a_records_candidate_name_is_unchanged() -> None:
    """The label is for people; the record's name, its row and its JSON keep the params."""
    w = Winner("gpu", "gemm:m=1", "triton_gemm", TRITON_TILED, 1.0, 2.0)
    assert w.candidate == candidate_name("triton_gemm", TRITON_TILED)
    assert w.to_row()["candidate"].startswith('triton_gemm:{"bk":256,')
