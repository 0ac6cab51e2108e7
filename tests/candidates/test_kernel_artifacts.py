"""A compiled CUTLASS kernel as an artifact: installed into an empty cutlass cache on the CPU, and
on a GPU built in one process and run in another that has no nvcc to compile with."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.cache.artifacts import ArtifactError, ArtifactStore, pack
from tuner.candidates import cutlass_env, kernel_artifacts, nvcc_build

SPEC = cutlass_env.KernelSpec(
    "bf16", "nn", 8, 8, (64, 256, 64), (1, 2), "TmaWarpSpecializedPingpong", "tma", "Default"
)


def test_install_writes_the_row_cutlass_cppgen_looks_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "cutlass"))
    meta = {"op_key": "<emitted source>name nvcc", "op_name": "k", "op_attrs": "[96]", "name": "n"}
    files = {
        "kernel.cubin": b"cubin",
        "host.so": b"\x7fELF so",
        "operation.json": json.dumps(meta).encode(),
    }
    with ArtifactStore(tmp_path / "artifacts") as store:
        assert not kernel_artifacts.install(store, SPEC)  # nothing stored yet
        spec = kernel_artifacts.artifact_spec(SPEC)
        store.put(spec, pack(files))
        assert kernel_artifacts.install(store, SPEC)
        assert kernel_artifacts.install(store, SPEC)  # again: no duplicate row
        other = replace(SPEC, dtype="f16")
        store.put(kernel_artifacts.artifact_spec(other), pack({"x": b""}))
        with pytest.raises(ArtifactError, match="not a CUTLASS kernel bundle"):
            kernel_artifacts.install(store, other)
    rows = (
        sqlite3.connect(tmp_path / "cutlass" / "compiled_cache.db")
        .execute("select * from compiled_operations")
        .fetchall()
    )
    assert rows == [("<emitted source>name nvcc", b"cubin", b"\x7fELF so", "k", "[96]")]
    assert nvcc_build.compiled_info(SPEC) is not None  # compile_all will not compile it


BUILD = textwrap.dedent(
    """
    import json
    from tuner.cache.artifacts import ArtifactStore
    from tuner.candidates import kernel_artifacts, cutlass_env, cutlass_gemm, nvcc_build
    from tuner.core.keys import GemmKey

    key = GemmKey(m=256, n=512, k=384)
    spec, params = next(iter(cutlass_gemm.offered(key).items()))
    assert cutlass_env.compile_all([spec])[spec] is None
    with ArtifactStore() as store:
        kernel_artifacts.publish(store, spec, cutlass_env.load(spec))
    print(json.dumps(params))
    """
)

LOAD = textwrap.dedent(
    """
    import json, sys
    runs = []
    sys.addaudithook(lambda event, args: event == "subprocess.Popen" and runs.append(args[1]))
    import torch
    from tuner.cache.artifacts import ArtifactStore
    from tuner.candidates import kernel_artifacts, cutlass_env, cutlass_gemm, nvcc_build

    nvcc_build.nvcc_path = lambda: None  # no nvcc anywhere, /usr/local/cuda's included
    assert cutlass_env.cannot_compile() and cutlass_env.missing() is None
    from tuner.core.keys import GemmKey

    key, params = GemmKey(m=256, n=512, k=384), json.loads(sys.argv[1])
    with ArtifactStore() as store:
        installed = kernel_artifacts.install(store, cutlass_gemm.kernel_spec(key, params))
    runner = cutlass_gemm.CutlassGemm().build(key, params)
    a = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    ref = (a.float() @ b.float())
    err = ((runner(a, b).float() - ref).abs().max() / ref.abs().max()).item()
    nvcc = [r for r in runs if any("nvcc" in str(a) or "which" in str(a) for a in (r or []))]
    print(json.dumps({"installed": installed, "nvcc": nvcc, "err": err}))
    """
)


@pytest.mark.gpu
def test_a_host_without_nvcc_runs_a_stored_kernel(tmp_path: Path) -> None:
    if reason := cutlass_env.cannot_compile():  # the building host compiles
        pytest.skip(reason)
    base = {**os.environ, "TUNER_ARTIFACTS": str(tmp_path / "artifacts")}
    build = subprocess.run(
        [sys.executable, "-c", BUILD],
        env={**base, "CUTLASS_CACHE_DIR": str(tmp_path / "built")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    params = build.stdout.strip().splitlines()[-1]

    nvcc_dirs = {str(Path(p).parent) for p in [nvcc_build.nvcc_path()] if p}
    path = [d for d in base["PATH"].split(os.pathsep) if d not in nvcc_dirs]
    env = {k: v for k, v in base.items() if k != "CUDA_INSTALL_PATH"}
    env |= {"PATH": os.pathsep.join(path), "CUTLASS_CACHE_DIR": str(tmp_path / "fresh")}
    load = subprocess.run(
        [sys.executable, "-c", LOAD, params], env=env, capture_output=True, text=True, timeout=600
    )
    assert load.returncode == 0, load.stderr[-3000:]
    result = json.loads(load.stdout.strip().splitlines()[-1])
    assert result["installed"] and result["nvcc"] == []  # nvcc never asked, not even its version
    assert result["err"] < 2e-2
