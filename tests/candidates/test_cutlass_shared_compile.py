"""CUTLASS kernels serve every shape: a run's shortlists become one list of distinct kernels,
and each problem is ready once its own kernels are (tuner.candidates.cutlass_gemm)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.candidates import cutlass_env, cutlass_gemm, nvcc_build
from tuner.core.keys import GemmKey


@pytest.mark.skipif(
    cutlass_env.cannot_compile() is None, reason="here CUTLASS would really compile (GPU check)"
)
def test_a_problem_whose_kernels_are_built_is_ready_before_any_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "cutlass"))
    monkeypatch.setenv("TUNER_ARTIFACTS", str(tmp_path / "artifacts"))
    decode, decode_too, large = (GemmKey(m=m, n=4096, k=4096, dtype="bf16") for m in (1, 8, 2048))
    shortlists = [(k, cutlass_gemm.shortlist(k)) for k in (large, decode, decode_too)]
    for params in cutlass_gemm.shortlist(decode):  # built earlier (or installed from the fleet)
        nvcc_build.record(cutlass_gemm.kernel_spec(decode, params), "compiled", {"seconds": 1})
    ready: list[int] = []
    cutlass_gemm.CutlassGemm().precompile_run(shortlists, ready.append)
    assert ready == [1, 2, 0]  # the decode problems first: nothing of theirs to compile
    specs = [cutlass_gemm.kernel_spec(large, p) for p in cutlass_gemm.shortlist(large)]
    errors = cutlass_env.compile_all(specs)
    assert set(errors.values()) == {cutlass_env.cannot_compile()}
