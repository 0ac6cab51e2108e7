"""Settings: a TOML file gives defaults, the environment wins, mistakes are named."""

import os
import subprocess
import sys

import pytest

from tuner.core.settings import read_config


def test_file_fills_what_the_environment_leaves_unset(tmp_path):
    """The file is read when the process dispatcher is made."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('mode = "record"\ncache = "/from/file.db"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    env |= {"TUNER_CONFIG": str(cfg), "TUNER_CACHE": "/from/env.db"}
    code = (
        "import os; from tuner.serving.dispatcher import get_dispatcher; get_dispatcher(); "
        "print(os.environ['TUNER_MODE'], os.environ['TUNER_CACHE'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["record", "/from/env.db"]


def test_unknown_setting_is_named(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('mdoe = "record"\n')
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['mdoe'\]"):
        read_config(cfg)


def test_broken_file_is_reported_not_fatal(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text("mode = \n")
    env = os.environ | {"TUNER_CONFIG": str(cfg)}
    out = subprocess.run(
        [sys.executable, "-c", "import tuner; tuner.set_mode('off')"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "not valid TOML" in out.stderr
