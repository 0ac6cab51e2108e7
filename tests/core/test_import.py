"""``import tuner`` is cheap: no torch, no dispatcher, no writes into the environment.

Each check runs in a fresh interpreter (``sys.modules`` and ``os.environ`` of the test process
say nothing about what an import does).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(code: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize(
    "module", ["tuner", "server", "tuner.cache", "tuner.core.keys", "tuner.core.tensor_memo"]
)
def test_import_loads_no_torch(module):
    loaded = run(
        f"import sys, json, {module}; print(json.dumps(sorted(m for m in sys.modules "
        "if m == 'torch' or m.startswith('tuner.serving'))))"
    )
    assert json.loads(loaded) == []


def test_server_imports_neither_torch_nor_the_dispatcher():
    loaded = run(
        "import sys, json, server.app, server.live, server.store; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
        "or m.startswith(('tuner.serving', 'tuner.tuning', 'tuner.candidates')))))"
    )
    assert json.loads(loaded) == []


def test_import_leaves_the_environment_alone_with_a_config_file(tmp_path: Path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('mode = "record"\ncache = "/from/file.db"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    env["TUNER_CONFIG"] = str(cfg)
    code = (
        "import os, json; before = dict(os.environ); import tuner; "
        "print(json.dumps(dict(os.environ) == before))"
    )
    assert json.loads(run(code, env)) is True


def test_lazy_names_resolve_and_matmul_computes():
    code = (
        "import tuner, torch; "
        "assert {'matmul', 'sdpa', 'set_mode', '__version__'} <= set(dir(tuner)); "
        "tuner.set_mode('off'); a = torch.ones(4, 8); b = torch.ones(8, 3); "
        "print(float(tuner.matmul(a, b).sum()))"
    )
    assert float(run(code, {**os.environ, "TUNER_MODE": "off"})) == 4 * 3 * 8.0


def test_unknown_attribute_is_an_attribute_error():
    import tuner

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tuner.nope  # noqa: B018


def test_pyproject_takes_the_version_from_tuner_version():
    import tomllib

    from tuner.version import __version__

    meta = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tuner.version.__version__"}
    assert __version__.count(".") == 2
