"""PyTorch TunableOp CSV files: real files written by PyTorch in, our winners out.

The fixtures in tests/data/tunableop/ are real TunableOp output (see the README there for where
each comes from). The BLAS-to-row-major mapping is checked against keys taken from real torch
tensors, and against a model whose shapes are known (OPT-125m).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tuner.cache import Store
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure.records import Winner
from tuner.offline.problem_list import ConfigError
from tuner.offline.tunableop import (
    Entry,
    cublaslt_solution,
    entry_key,
    export,
    import_files,
    read,
    signature,
)
from tuner.tuning.engine import TuneOptions, tune

DATA = Path(__file__).parents[1] / "data" / "tunableop"


def key(m, n, k, layout, dtype, batch=1, align=16, compute="f32") -> GemmKey:
    return GemmKey(
        m=m, n=n, k=k, batch=batch, layout=layout, dtype=dtype, out_dtype=dtype,
        compute=compute, align=align,
    )  # fmt: skip


def test_cuda_results_file_with_validator_gives_its_keys():
    f = read(DATA / "cuda_pt2.11_results0.csv")
    assert f.kind == "results" and f.validators == {"PT_VERSION": "2.11.0"}
    assert [(e.solution, e.time_ms) for e in f.entries][:2] == [
        ("Default", 0.00779232),
        ("Default", 0.00805632),
    ]
    imported = import_files([f.path])
    sizes = (256, 512, 1024, 2048, 4096, 8192)
    # tn_S_S_S_ld_S_S_S: F.linear-style x @ W.T in bf16
    assert imported.keys == [key(s, s, s, "nt", "bf16") for s in sizes]
    assert imported.skipped == []


def test_untuned_file_of_opt125m_gives_the_models_shapes():
    """OPT-125m, fp16, 8 prompts x 128 tokens (M = 1024): hidden 768, FFN 3072, vocabulary 50272,
    12 heads of 64 (96 = 8 x 12 attention matrices)."""
    imported = import_files([DATA / "untuned_opt125m0.csv"])
    assert imported.files[0].kind == "untuned" and imported.files[0].validators == {}
    assert imported.keys == [
        key(1024, 768, 768, "nt", "f16"),  # q/k/v/out projections (GemmAndBias: bias dropped)
        key(128, 128, 64, "nt", "f32", batch=96),  # Q @ K^T
        key(128, 64, 128, "nn", "f32", batch=96),  # P @ V
        key(1024, 3072, 768, "nt", "f16"),  # fc1
        key(1024, 768, 3072, "nt", "f16"),  # fc2
        key(1024, 50272, 768, "nt", "f16"),  # LM head
    ]


def test_rocm_results_with_tt_tn_and_bias_lines():
    imported = import_files([DATA / "rocm_pt2.9.1_results0.csv"])
    assert imported.files[0].validators["GCN_ARCH_NAME"] == "gfx1151"
    keys = imported.keys
    # tt_512_784_512_ld_512_784_512: both operands column-major, A is 784 x 512 with ld 784
    assert keys[0] == key(784, 512, 512, "tt", "f32")
    assert keys[3] == key(212, 6625, 120, "tt", "f32")
    assert keys[4] == key(1374, 6625, 120, "nt", "f32")
    assert keys[7] == key(232, 360, 120, "nt", "f32")  # GemmAndBiasTunableOp_float_TN
    assert len(keys) == 11 and imported.skipped == []


def test_pre_2_6_params_without_leading_dims():
    f = read(DATA / "rocm_pt2.4_results0.csv")
    assert f.entries[4].solution == "Default" and f.entries[4].time_ms == float("inf")
    keys = import_files([f.path]).keys
    assert keys[0] == key(64, 32000, 8192, "nt", "f16")  # tn_32000_64_8192
    assert keys[-1] == key(1, 22016, 4096, "nt", "f16")  # a decode step: M = 1


def test_untuned_nn_file():
    assert import_files([DATA / "untuned_apollo0.csv"]).keys == [key(1024, 1024, 1024, "nn", "f32")]


def test_mapping_matches_keys_taken_from_torch_tensors():
    """TunableOp's README: F.linear(x 100x20, W 200x20) records tn_200_100_20; the blog's bmm
    line for Q @ K^T over 96 heads is tn_128_128_64_B_96_ld_64_64_128."""
    x, w = torch.randn(100, 20), torch.randn(200, 20)
    lin = GemmKey.from_tensors(x, w.t())
    assert signature(lin) == ("GemmTunableOp_float_TN", "tn_200_100_20_ld_20_20_200")
    q, k = torch.randn(96, 128, 64), torch.randn(96, 128, 64)
    qk = GemmKey.from_tensors(q, k.transpose(1, 2))
    assert signature(qk) == (
        "GemmStridedBatchedTunableOp_float_TN",
        "tn_128_128_64_B_96_ld_64_64_128",
    )
    p, v = torch.randn(96, 128, 128), torch.randn(96, 128, 64)
    pv = GemmKey.from_tensors(p, v)
    assert signature(pv) == (
        "GemmStridedBatchedTunableOp_float_NN",
        "nn_64_128_128_B_96_ld_64_128_64",
    )
    a_col = torch.randn(20, 100).t()  # column-major A
    tt = GemmKey.from_tensors(a_col, w.t())
    assert tt.layout == "tt" and signature(tt)[1] == "tt_200_100_20_ld_20_100_200"


@pytest.mark.parametrize("spec", ["int4-g128", "fp8-rowwise", "fp8-tensorwise"])
def test_a_low_bit_key_has_no_gemm_line(spec: str) -> None:
    """A low-bit key's dtype is its activations' (bf16 for INT4): as a GemmTunableOp line it
    would claim a plain bf16 GEMM, so it is refused whatever source won it."""
    lowbit = GemmKey(m=16, n=4096, k=4096, **lowbit_fields(spec))
    with pytest.raises(ValueError, match=f"low-bit weights \\({spec}\\) have no GemmTunableOp"):
        signature(lowbit)


def test_padded_leading_dimension_lowers_the_alignment_class():
    e = Entry(1, "GemmTunableOp_Half_NN", "nn_64_32_64_ld_68_64_64")
    assert entry_key(e) == key(32, 64, 64, "nn", "f16", align=8)  # 68 x 2 bytes: 8-aligned
    with pytest.raises(ValueError, match="smaller than the matrix extents"):
        entry_key(Entry(1, "GemmTunableOp_Half_NN", "nn_64_32_64_ld_60_64_64"))


@pytest.mark.parametrize(
    ("op", "params", "reason"),
    [
        ("GemmTunableOp_double_NN", "nn_8_8_8_ld_8_8_8", "unsupported data type 'double'"),
        (
            "ScaledGemmTunableOp_Float8_e4m3fn_TN",
            "tn_8_8_8_ld_8_8_8",
            "unsupported TunableOp operator",
        ),
        ("GemmTunableOp_Half_TN", "tn_*_8_8_ld_8_8_*", "wildcard"),
        ("GemmTunableOp_Half_TN", "nn_8_8_8", "disagree with operator"),
        ("GemmTunableOp_Half_TN", "tn_8_8_8_B_2", "disagree on batching"),
        ("GemmTunableOp_Half_TN", "tn_8_x_8", "are not '<ab>_<m>_<n>_<k>"),
        ("GemmTunableOp_BFloat16_XX", "tn_1_1_1", "transpose 'XX' .* must be NN, NT, TN or TT"),
    ],
)
def test_lines_without_a_key_say_why(op, params, reason):
    with pytest.raises(ValueError, match=reason):
        entry_key(Entry(3, op, params))


def test_tf32_from_blas_log_and_skipped_lines_are_reported(tmp_path):
    f = tmp_path / "untuned.csv"
    f.write_text(
        "GemmTunableOp_float_NN,nn_16_8_32_ld_16_32_16,BLAS_PARAMS: { function: matmul, "
        "compute_type: xf32_r }\nGemmTunableOp_double_NN,nn_8_8_8_ld_8_8_8\n"
    )
    imported = import_files([f])
    assert imported.keys == [key(8, 16, 32, "nn", "f32", compute="tf32")]
    ((_path, entry, reason),) = imported.skipped
    assert entry.line == 2 and "double" in reason


def test_a_file_that_is_not_tunableop_names_file_and_line(tmp_path):
    f = tmp_path / "x.csv"
    f.write_text("Validator,PT_VERSION,2.5.0\nm,n,k\n")
    with pytest.raises(ConfigError, match=r"x.csv:2: not a TunableOp line"):
        read(f)
    f.write_text("GemmTunableOp_BFloat16_TN,tn_4096_1_4096_ld_4096_4096_4096,Default,abc\n")
    with pytest.raises(ConfigError, match=r"x.csv:1: time 'abc' is not a number of milliseconds"):
        read(f)
    f.write_text("\n")
    assert read(f).kind == "empty"


def _winner(k: GemmKey, source: str = "torch", params: dict | None = None) -> Winner:
    return Winner("cuda-x", str(k), source, params or {}, median_us=12.5, baseline_us=13.0)


def test_export_round_trips_and_skips_what_tunableop_cannot_run():
    keys = [
        key(1, 6144, 4096, "nt", "bf16"),
        key(128, 128, 64, "nt", "f32", batch=96),
        key(784, 512, 512, "tt", "f32"),
        key(96, 200, 24, "tn", "f16"),
    ]
    winners = [_winner(k) for k in keys] + [
        _winner(key(8, 64, 64, "nn", "f16"), "triton_gemm", {"bm": 16}),
        _winner(key(8, 64, 64, "nn", "f32", compute="tf32")),
        _winner(key(8, 64, 64, "nn", "f32", align=4)),  # same TunableOp line as the next one
        _winner(key(8, 64, 64, "nn", "f32")),
    ]
    out = export(winners, "2.13.0")
    assert out.lines[0] == "Validator,PT_VERSION,2.13.0"
    assert "GemmTunableOp_BFloat16_TN,tn_6144_1_4096_ld_4096_4096_6144,Default,0.0125" in out.lines
    reasons = {k: r for k, r in out.skipped}
    assert "no TunableOp counterpart" in reasons[str(key(8, 64, 64, "nn", "f16"))]
    assert "TF32" in reasons[str(key(8, 64, 64, "nn", "f32", compute="tf32"))]
    assert "duplicate" in reasons[str(key(8, 64, 64, "nn", "f32", align=4))]
    assert out.written == 5
    back = [entry_key(Entry(i, *ln.split(",")[:2])) for i, ln in enumerate(out.lines[1:], 2)]
    assert set(back) == {*keys, key(8, 64, 64, "nn", "f32")}


def test_cublaslt_winners_export_under_pytorchs_algorithm_names():
    config = {"ID": 66, "TILE_ID": 20, "STAGES_ID": 8, "CLUSTER_SHAPE_ID": 2, "SPLITK_NUM": 1}
    name = (
        "Gemm_Cublaslt_id_66_tile_20_stages_8_splitk_1_red_0_swizzle_0_custom_0_inner_0_cluster_2"
    )
    assert cublaslt_solution(config) == name
    # PyTorch's reader parses it back with this format (GemmCublasLt.h: CublasltAlgoConfigFromName)
    fmt = r"Gemm_Cublaslt_id_(\d+)_tile_(\d+)_stages_(\d+)_splitk_(\d+)_red_(\d+)_swizzle_(\d+)_custom_(\d+)_inner_(\d+)_cluster_(\d+)"
    assert re.fullmatch(fmt, name)
    pytest.importorskip("tuner.candidates.cublaslt")  # the source's own params -> config mapping
    params = {"id": 66, "tile": 20, "stages": 8, "cluster": 2, "split_k": 1, "reduction": 0}
    w = _winner(key(2, 64, 64, "nn", "f16"), "cublaslt", params)
    assert (
        export([w], "2.13.0").lines[1]
        == f"GemmTunableOp_Half_NN,nn_64_2_64_ld_64_64_64,{name},0.0125"
    )


def test_cli_show_and_export(tmp_path, monkeypatch, capsys):
    from tuner.cli import main

    monkeypatch.setenv("TUNER_CACHE", str(tmp_path / "c.db"))
    monkeypatch.setenv("COLUMNS", "300")

    def tuner(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["tuner", *args])
        with pytest.raises(SystemExit) as exit_:
            main.main()
        out = capsys.readouterr()
        return exit_.value.code, out.out, out.err

    code, out, err = tuner("tunableop", "show", str(DATA / "untuned_opt125m0.csv"))
    assert code == 0, err
    assert "untuned file, 6 GEMM lines" in out
    assert "gemm:m=1024,n=50272,k=768,batch=1,layout=nt,dtype=f16" in out
    outcome = tune(
        key(4, 8, 16, "nt", "f32"), options=TuneOptions(budget_s=0.01, sources=["torch"])
    )
    with Store(tmp_path / "c.db") as store:
        store.save_run(outcome.measurements, outcome.winner)
    csv = tmp_path / "tunableop_results0.csv"
    code, out, err = tuner("tunableop", "export", str(csv), "--pt-version", "2.13.0")
    assert code == 0, err
    lines = csv.read_text().splitlines()
    assert lines[0] == "Validator,PT_VERSION,2.13.0" and len(lines) == 2
    assert lines[1].startswith("GemmTunableOp_float_TN,tn_8_4_16_ld_16_16_8,Default,")
    assert import_files([csv]).keys == [key(4, 8, 16, "nt", "f32")]
    monkeypatch.chdir(tmp_path)
    code, out, err = tuner("tunableop", "export", "-", "--pt-version", "2.13.0")
    assert code == 0 and out.splitlines() == lines and not (tmp_path / "-").exists()
    assert "wrote -: 1 GEMM (Validator PT_VERSION=2.13.0)" in err
    before = csv.read_text()
    code, out, err = tuner("tunableop", "export", str(csv))
    assert code == 2 and "exists: pass --force to replace it" in err
    assert csv.read_text() == before
    for bad in ("2.6.0,evil", "", "2.6\n0"):
        code, out, err = tuner("tunableop", "export", str(csv), "--pt-version", bad, "--force")
        assert code == 2 and f"--pt-version {bad!r}: expected a release" in err
    assert csv.read_text().splitlines() == lines
    code, out, err = tuner("tunableop", "show", str(DATA / "README.md"))
    assert code == 2 and "not a TunableOp line" in err and "Traceback" not in err
