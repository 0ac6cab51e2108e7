"""``tuner --help``, every command's ``--help`` and ``tuner --version`` load none of the heavy
libraries (torch takes seconds to import): the commands import them where they run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "triton", "cupy", "nvmath", "cutlass", "fastapi", "uvicorn")

# run in a fresh interpreter: this one has imported torch already
HELP_EVERYWHERE = f"""
import sys

import typer.main
from typer.testing import CliRunner

from tuner.cli.main import app


def paths(command, prefix=()):
    yield prefix
    for name, sub in getattr(command, "commands", {{}}).items():
        yield from paths(sub, (*prefix, name))


runner = CliRunner()
commands = list(paths(typer.main.get_command(app)))
assert ("bench", "sdpa") in commands and ("token", "create") in commands, commands
for args in [[*path, "--help"] for path in commands] + [["--version"]]:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (args, result.output)
    assert "Usage:" in result.output or args == ["--version"], (args, result.output)
loaded = [name for name in {HEAVY!r} if name in sys.modules]
assert not loaded, f"--help imported {{loaded}}"
print(len(commands), "commands")
"""


def test_help_and_version_import_no_heavy_library(tmp_path: Path) -> None:
    env = os.environ | {
        "TUNER_CONFIG": str(tmp_path / "config.toml"),  # none: no config file of the user's is read
        "TUNER_CACHE": str(tmp_path / "tuner.db"),
    }
    done = subprocess.run(
        [sys.executable, "-c", HELP_EVERYWHERE],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "commands" in done.stdout
