"""The CUTLASS launcher's host side without a GPU: the per-launcher store of built kernel params
(by pointer set, least recently used dropped) and the launch structures it hands to libcuda,
laid out as cuda.h declares them."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from tuner.candidates import cutlass_gemm as cg

CUDA_H = Path("/usr/local/cuda/include/cuda.h")


def counting_sets(size: int) -> tuple[cg.ParamSets[tuple[int, ...]], list[tuple[int, ...]]]:
    built: list[tuple[int, ...]] = []

    def build(pointers: tuple[int, ...]) -> tuple[int, ...]:
        built.append(pointers)
        return tuple(p * 2 for p in pointers)

    return cg.ParamSets(build, size), built


def test_params_are_built_once_per_pointer_set() -> None:
    sets, built = counting_sets(4)
    assert sets((1, 2, 3)) == (2, 4, 6)
    assert sets((1, 2, 5)) == (2, 4, 10)  # one pointer differs: a set of its own
    assert sets((1, 2, 3)) == (2, 4, 6)
    assert built == [(1, 2, 3), (1, 2, 5)]
    assert len(sets) == 2


def test_the_least_recently_used_set_is_dropped_and_rebuilt_when_met_again() -> None:
    sets, built = counting_sets(2)
    sets((1,))
    sets((2,))
    sets((1,))  # (2,) is now the least recently used
    sets((3,))  # drops (2,)
    assert len(sets) == 2
    sets((1,))
    assert built == [(1,), (2,), (3,)]
    sets((2,))  # dropped: built again, which drops (3,)
    sets((1,))
    assert built == [(1,), (2,), (3,), (2,)]


def test_clear_forgets_every_set() -> None:
    sets, built = counting_sets(3)
    sets((1,))
    sets.clear()
    assert len(sets) == 0
    sets((1,))
    assert built == [(1,), (1,)]


def test_a_store_of_no_sets_is_refused_naming_the_size() -> None:
    with pytest.raises(ValueError, match="size=0"):
        cg.ParamSets(lambda p: p, 0)


@pytest.mark.skipif(
    not CUDA_H.exists() or shutil.which("cc") is None, reason="needs cuda.h and a C compiler"
)
def test_launch_structures_match_cuda_h(tmp_path: Path) -> None:
    """Sizes and offsets of CUlaunchConfig / CUlaunchAttribute as a C compiler lays them out."""
    fields = {
        "CUlaunchConfig": ("gridDimX", "blockDimX", "sharedMemBytes", "hStream", "attrs",
                           "numAttrs"),
        "CUlaunchAttribute": ("id", "value"),
    }  # fmt: skip
    lines = [
        f'printf("%zu %zu\\n", sizeof({t}), offsetof({t}, {f}));'
        for t, names in fields.items()
        for f in names
    ]
    lines.append('printf("%d\\n", (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);')
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n"
        "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(["cc", f"-I{CUDA_H.parent}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    ours = {
        "CUlaunchConfig": (cg.LaunchConfig, ("grid", "block", "shared_mem_bytes", "stream",
                                             "attrs", "num_attrs")),
        "CUlaunchAttribute": (cg.LaunchAttribute, ("id", "value")),
    }  # fmt: skip
    expected = [
        (ctypes.sizeof(struct), getattr(struct, name).offset)
        for struct, names in ours.values()
        for name in names
    ]
    pairs = [(int(out[2 * i]), int(out[2 * i + 1])) for i in range(len(expected))]
    assert pairs == expected
    assert int(out[-1]) == cg.CLUSTER_DIMENSION
