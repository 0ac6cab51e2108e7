"""bench/fp8_decode_sweep.py and bench/nvcc_twins.py: variants of the CUDA configs (CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_scripts import load_script

sweep = load_script("fp8_decode_sweep")
twins = load_script("nvcc_twins")


def test_a_variant_is_a_new_name_and_its_flags() -> None:
    assert twins.parse_variant("pdl=-DFP8_GEMV_DEPENDENT=1", {"trace"}) == (
        "pdl", ["-DFP8_GEMV_DEPENDENT=1"]
    )  # fmt: skip
    assert twins.parse_variant("both=-DA=1  -DB=2", set())[1] == ["-DA=1", "-DB=2"]


@pytest.mark.parametrize("spec", ["plain", "plain=", "=-DA=1", "two words=-DA=1", "trace=-DA=1"])
def test_a_malformed_or_taken_variant_names_the_spec(spec: str) -> None:
    with pytest.raises(ValueError, match=f"--variant {spec!r}"):
        twins.parse_variant(spec, {"trace"})


def test_a_twin_command_is_the_librarys_own_with_the_flags_before_the_source(monkeypatch) -> None:
    monkeypatch.setattr(twins.nvcc_build, "nvcc_path", lambda: "/opt/cuda/bin/nvcc")
    lib = sweep.cuda_fp8.library({"stages": 6, "atoms": 2, "cluster": 2})
    own = lib.nvcc_command("/opt/cuda/bin/nvcc", Path("/tmp/a.so"))
    twin = twins.twin_command(lib, Path("/tmp/a.so"), ["-DFP8_GEMV_DEPENDENT=0"])
    assert twin == [*own[:-1], "-DFP8_GEMV_DEPENDENT=0", own[-1]]
    other = twins.twin_command(lib, Path("/tmp/a.so"), [], source=Path("/ab/old.cu"))
    assert other[-2:] == [f"-I{twins.cuda_library.KERNELS}", "/ab/old.cu"]


def test_each_cuda_config_is_followed_by_its_twins_and_labelled_by_variant() -> None:
    plain = sweep.candidates(1, 4096, 14336, "cuda")
    both = sweep.candidates(1, 4096, 14336, "cuda", ("plain",))
    cuda = [c for c in plain if "atoms" in c]
    assert both[: len(plain)] == plain
    assert both[len(plain) :] == [{**c, "variant": "plain"} for c in cuda]
    assert sweep.label(both[-1]).endswith(" [plain]")
    assert sweep.candidates(1, 4096, 14336, "shortlist", ("plain",)) == sweep.candidates(
        1, 4096, 14336, "shortlist"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", "pdl=-DFP8_GEMV_DEPENDENT=1"], "they need --cuda"),
        (["--cuda", "--variant", "trace=-DA=1"], "--variant 'trace=-DA=1'"),
        (["--cuda", "--m", "32"], "decode sizes only"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(
    argv: list[str], message: str, monkeypatch, capsys
) -> None:
    monkeypatch.setattr("sys.argv", ["fp8_decode_sweep.py", "--out", "x.json", *argv])
    monkeypatch.setattr(sweep, "VARIANTS", dict(sweep.VARIANTS))  # main() adds the --variant ones
    monkeypatch.setattr(sweep, "build_cuda", lambda *a: pytest.fail("built before refusing"))
    with pytest.raises(SystemExit):
        sweep.main()
    assert message in capsys.readouterr().err


def test_a_twins_file_name_follows_its_flags(monkeypatch) -> None:
    """A variant's name given other flags in a later run builds anew, never times the old one."""
    cfg = {"stages": 6, "atoms": 2, "cluster": 2}
    monkeypatch.setitem(sweep.VARIANTS, "pdl", ["-DFP8_GEMV_DEPENDENT=1"])
    first = sweep.twin_path(cfg, "pdl")
    monkeypatch.setitem(sweep.VARIANTS, "pdl", ["-DFP8_GEMV_DEPENDENT=0"])
    assert sweep.twin_path(cfg, "pdl") != first
    # the same flags in a later run: the same name (a digest of them, stable across processes)
    assert twins.tag("plain", ["-DA=1"]) == "plain-33909647"
