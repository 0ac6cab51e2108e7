"""bench/w4a16_decode_grid.py: its --config entries (CPU)."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_script

gemv = load_script("w4a16_decode_grid")


def test_a_config_is_five_numbers_then_an_optional_stagger_teams_and_carveout() -> None:
    assert gemv.parse_config("k,4,2,8,2") == ("k", 4, 2, 8, 2)
    assert gemv.parse_config("k,4,2,3,1,1") == ("k", 4, 2, 3, 1, True)
    assert gemv.parse_config("k,4,2,12,1,0,4") == ("k", 4, 2, 12, 1, False, 4)
    assert gemv.parse_config("k,4,2,2,1,0,1,72") == ("k", 4, 2, 2, 1, False, 1, 72)
    assert gemv.parse_config("k,4,2,2,1,0,1,-1") == ("k", 4, 2, 2, 1, False, 1, None)
    assert gemv.as_config(("k", 4, 2, 8, 2))["carveout"] is None
    assert gemv.as_config(("k", 4, 2, 8, 2))["stagger"] is False
    assert gemv.as_config(("k", 4, 2, 8, 2))["teams"] == 1
    assert gemv.as_config(gemv.parse_config("rows,2,4,8,8,0")) == {
        "split": "rows", "slices": 2, "stages": 4, "warps": 8, "cluster": 8, "stagger": False,
        "teams": 1, "carveout": None,
    }  # fmt: skip


@pytest.mark.parametrize(
    "text",
    [
        "k,4,2,8",
        "cols,4,2,8,2",
        "k,4,2,8,2,yes",
        "k,4,2,3,1,2",
        "k,4,2,12,1,0,four",
        "k,4,2,2,1,0,1,101",
        "k,4,2,2,1,0,1,-2",
        "k,4,2,2,1,0,-1",
        "k,4,2,2,1,0,1,72,1",
    ],
)
def test_a_malformed_config_names_the_text(text: str) -> None:
    with pytest.raises(ValueError, match=f"--config {text!r}"):
        gemv.parse_config(text)


def test_a_baseline_source_must_take_the_entry_points_arguments(tmp_path) -> None:
    source = gemv.cuda_w4a16.SOURCE.read_text()
    ours = gemv.entry_arguments(gemv.cuda_w4a16.SOURCE)
    assert ours is not None and "int teams" in ours
    # the same arguments, laid out and commented otherwise
    same = tmp_path / "same.cu"
    same.write_text(
        source.replace("int carveout, void* stream", "int carveout,  // one\n void* stream")
    )
    assert gemv.entry_arguments(same) == ours
    # an older entry point, without the carveout: its stream would take the carveout's place
    older = tmp_path / "older.cu"
    older.write_text(source.replace("int carveout, void* stream", "void* stream"))
    assert gemv.entry_arguments(older) not in (None, ours)
    empty = tmp_path / "empty.cu"
    empty.write_text("")
    assert gemv.entry_arguments(empty) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-warps", "18"],
            "--max-warps 18: allowed 17 to 32, with a --variant built with -DGEMV_MAX_WARPS=18",
        ),
        (["--max-warps", "40", "--variant", "w40=-DGEMV_MAX_WARPS=40"], "allowed 17 to 32"),
        (["--baseline", "no/such.cu"], "--baseline no/such.cu: no such file"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(
    argv: list[str], message: str, monkeypatch, capsys
) -> None:
    monkeypatch.setattr("sys.argv", ["w4a16_decode_grid.py", "--out", "x.json", *argv])
    monkeypatch.setattr(gemv, "VARIANTS", dict(gemv.VARIANTS))  # main() adds the --variant ones
    with pytest.raises(SystemExit):
        gemv.main()
    assert message in capsys.readouterr().err


def test_a_copy_made_elsewhere_is_rebuilt_when_the_kernel_folders_header_moves(
    tmp_path, monkeypatch
) -> None:
    """nvcc takes a header next to the source first, else the kernel folder's: the variant's
    digest follows the one it takes."""
    kernels, elsewhere = tmp_path / "kernels", tmp_path / "elsewhere"
    kernels.mkdir()
    elsewhere.mkdir()
    (kernels / "launch.cuh").write_text("// v1\n")
    source = elsewhere / "old.cu"
    source.write_text('#include "launch.cuh"\nint f() { return 0; }\n')
    monkeypatch.setattr(gemv.cuda_library, "KERNELS", kernels)

    def digest() -> str:
        gemv.cuda_library.source_digest.cache_clear()
        return gemv.build_digest(source)

    first = digest()
    (kernels / "launch.cuh").write_text("// v2\n")
    assert digest() != first
    (elsewhere / "launch.cuh").write_text("// its own\n")
    own = digest()
    (kernels / "launch.cuh").write_text("// v3\n")
    assert digest() == own
