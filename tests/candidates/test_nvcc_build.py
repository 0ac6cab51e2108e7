"""A compile that fails is remembered for good only when the compiler refused the source: one
killed from outside (the out-of-memory killer, while many nvcc run at once) is tried again.

The compiler here is a shell script standing in for nvcc (this host has none): it prints what
nvcc prints in each case and exits as nvcc does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner.candidates import cuda_library, cuda_w4a16, cutlass_env, nvcc_build

KILLED = "nvcc error   : 'cicc' died due to signal 9 (Kill signal)"
REFUSED = "kernel.cu(12): error: identifier undefined_thing is undefined"


def fake_nvcc(root: Path, first_stderr: str, first_exit: int, release: str = "13.0") -> Path:
    """An nvcc of ``release`` whose first compile fails with ``first_stderr`` and ``first_exit``;
    later ones write the output file and succeed. Returns the file counting its compiles."""
    bin_dir, count = root / "cuda" / "bin", root / "compiles"
    bin_dir.mkdir(parents=True, exist_ok=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release {release}, V{release}.1"; exit 0; fi
echo x >> {count}
if [ "$(wc -l < {count})" -eq 1 ]; then echo "{first_stderr}" >&2; exit {first_exit}; fi
for a in "$@"; do if [ "$prev" = "-o" ]; then echo ELF > "$a"; fi; prev="$a"; done
""")
    nvcc.chmod(0o755)
    return count


@pytest.fixture
def library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[cuda_w4a16.Library]:
    monkeypatch.setenv("CUDA_INSTALL_PATH", str(tmp_path / "cuda"))
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TUNER_ARTIFACTS", str(tmp_path / "artifacts"))
    forget_the_toolkit()
    config = dict(zip(cuda_w4a16.CONFIG_KEYS, cuda_w4a16.SHORTLIST[0], strict=True))
    yield cuda_w4a16.library(config)
    forget_the_toolkit()


def forget_the_toolkit() -> None:
    cuda_library.toolkit.cache_clear()
    nvcc_build.release.cache_clear()


def test_a_compile_killed_for_memory_is_tried_again(tmp_path: Path, library) -> None:
    compiles = fake_nvcc(tmp_path, KILLED, 9)  # nvcc exits 9 when its cicc was killed
    first = nvcc_build.compile_all([library], needs=cuda_library.cannot_compile)
    assert first == {library: KILLED}
    assert nvcc_build.failure(library) is None and cuda_library.usable([library]) == [library]
    assert nvcc_build.compile_all([library], needs=cuda_library.cannot_compile) == {library: None}
    assert len(compiles.read_text().splitlines()) == 2
    assert nvcc_build.compiled_info(library) is not None


@pytest.mark.parametrize(
    "refused", [REFUSED, "nvcc error   : 'ptxas' died due to signal 11 (Invalid memory reference)"]
)
def test_a_refused_source_is_never_compiled_again(tmp_path: Path, library, refused) -> None:
    """A compile error, or a compiler crashing on the source (a segfault: every time)."""
    compiles = fake_nvcc(tmp_path, refused, 1)
    assert nvcc_build.compile_all([library], needs=cuda_library.cannot_compile) == {
        library: refused
    }
    assert nvcc_build.failure(library) is not None and cuda_library.usable([library]) == []
    assert nvcc_build.compile_all([library], needs=cuda_library.cannot_compile) == {
        library: refused
    }
    assert len(compiles.read_text().splitlines()) == 1


def test_a_kill_recorded_as_final_by_an_older_tuner_is_tried_again(tmp_path: Path, library) -> None:
    """Markers written before kills were told apart hold a kill's error and no nvcc release."""
    fake_nvcc(tmp_path, REFUSED, 1)
    nvcc_build.record(library, "failed", {"error": KILLED})
    assert nvcc_build.failure(library) is None and cuda_library.usable([library]) == [library]


def test_a_source_refused_by_one_nvcc_release_is_compiled_again_under_another(
    tmp_path: Path, library
) -> None:
    """A toolkit upgrade may take what the old compiler refused (a compiler bug, a missing
    feature): a failure is remembered for the release that failed it."""
    fake_nvcc(tmp_path, REFUSED, 1, release="12.4")
    nvcc_build.compile_all([library], needs=cuda_library.cannot_compile)
    assert nvcc_build.failure(library) == REFUSED
    fake_nvcc(tmp_path, REFUSED, 1, release="13.0")
    nvcc_build.release.cache_clear()  # (toolkit() kept: one name, as a CUTLASS kernel's is)
    assert nvcc_build.failure(library) is None
    assert nvcc_build.compile_all([library], needs=cuda_library.cannot_compile) == {library: None}


@pytest.mark.parametrize(
    ("log", "permanent"),
    [
        (KILLED, False),
        ("g++: fatal error: Killed signal terminated program cc1plus", False),
        ("collect2: fatal error: ld terminated with signal 9 [Killed]", False),
        ("cc1plus: internal compiler error: Killed (program cc1plus)", False),
        ("virtual memory exhausted: Cannot allocate memory", False),
        ("nvcc error   : 'ptxas' died due to signal 11 (Invalid memory reference)", True),
        (None, False),  # no log to tell the cause: tried again
        ('gemm.cu(40): error: static assertion failed with "bad tile"', True),
    ],
)
def test_cutlass_kernels_fail_for_good_only_on_a_compile_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log: str | None, permanent: bool
) -> None:
    """cutlass_cppgen raises "Invalid Kernel" for any failed nvcc and writes nvcc's output to a
    log in the working directory: the log decides."""
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path))

    def compile_fails(spec: cutlass_env.KernelSpec) -> None:
        if log is not None:
            work = nvcc_build.work_dir()
            work.mkdir(parents=True, exist_ok=True)
            (work / "cutlass_python_compilation_device_error.txt").write_text(
                f"Compilation command:\nnvcc ...\n\nError Message:\n{log}\n"
            )
        raise Exception("Invalid Kernel. See './cutlass_python_compilation_device_error.txt'")

    monkeypatch.setattr(cutlass_env, "load", compile_fails)
    spec = cutlass_env.KernelSpec(
        "f16", "nn", 8, 8, (128, 128, 64), (1, 1), "KernelTmaWarpSpecializedCooperative",
        "tma", "Default",
    )  # fmt: skip
    verdict = cutlass_env._compile_here(spec)
    assert not verdict["ok"] and verdict["permanent"] is permanent
