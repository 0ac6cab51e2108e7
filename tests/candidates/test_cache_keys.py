"""Every Triton kernel module hashes its JIT functions while it is imported, so a kernel's cache
key is the same in every process, whatever that process compiled or hashed first: the compile
workers (fresh processes) and the process that times the candidates must agree on it, or the
latter compiles again what the workers compiled. Each check runs in fresh Python processes
without the interpreter (whose functions have no cache key); no GPU is needed to hash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL_MODULES = [
    "tuner.candidates.triton_kernels.tiled",
    "tuner.candidates.triton_kernels.splitk_arrival",
    "tuner.candidates.triton_kernels.w4a16",
    "tuner.candidates.triton_kernels.dequant",
    "tuner.candidates.triton_kernels.fp8",
    "tuner.candidates.triton_kernels.persistent",
    "tuner.candidates.triton_kernels.gemv",
    "tuner.candidates.triton_kernels.pad",
    "tuner.candidates.triton_kernels.stream_read",
    "tuner.candidates.triton_attention",
    "tuner.candidates.triton_decode",
]

# In a fresh process: import `first` and hash `touch` (a function of it) before anything else,
# then import every kernel module and print the key of each JIT function they define.
SCRIPT = """
import importlib, json, sys
from triton.runtime.jit import JITFunction
first, touch, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
if touch:
    getattr(importlib.import_module(first), touch).cache_key
keys, unhashed = {}, []
for name in [first, *modules]:
    for attr, value in vars(importlib.import_module(name)).items():
        if isinstance(value, JITFunction) and value.module == name:
            if value.hash is None:
                unhashed.append(f"{name}.{attr}")
            keys[f"{name}.{attr}"] = value.cache_key
print(json.dumps({"keys": keys, "unhashed": unhashed}))
"""


def hashed(first: str, touch: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, first, touch, *KERNEL_MODULES],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_jit_function_is_hashed_once_its_module_is_imported() -> None:
    result = hashed("tuner.candidates.triton_kernels.w4a16")
    assert result["unhashed"] == []
    assert len(result["keys"]) >= 20  # every kernel module was seen


@pytest.mark.parametrize(
    ("first", "touch"),
    [
        ("tuner.candidates.triton_kernels.dequant", "dequant_rows"),  # shares _weight_tile
        ("tuner.candidates.triton_kernels.w4a16", "_values"),  # a helper before its callers
        ("tuner.candidates.triton_kernels.fp8", ""),  # another importer of tiled's helpers
        ("tuner.candidates.triton_decode", ""),
    ],
)
def test_cache_keys_do_not_depend_on_what_a_process_hashed_first(first: str, touch: str) -> None:
    fresh = hashed("tuner.candidates.triton_kernels.w4a16", "w4a16_tiled")
    assert hashed(first, touch)["keys"] == fresh["keys"]
