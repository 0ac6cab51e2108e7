"""tuner.core.console: output to a pipe or a file is laid out wide, a terminal keeps its width,
and a width asked for wins."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from tuner.core import console
from tuner.core.console import PIPED_WIDTH, output_console, width_for


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_is_laid_out_wide_and_a_terminal_keeps_its_own_width(monkeypatch) -> None:
    for var in ("COLUMNS", "TERMINAL_WIDTH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(console, "_terminal_near", lambda: False)  # a CI log: no terminal at all
    assert width_for(io.StringIO()) == PIPED_WIDTH
    assert width_for(Terminal()) is None
    monkeypatch.setattr(console, "_terminal_near", lambda: True)  # `| tee` from a terminal
    assert width_for(io.StringIO()) is None  # rich takes that terminal's width
    monkeypatch.setenv("TERMINAL_WIDTH", "100")  # typer's variable, which rich does not read
    assert width_for(io.StringIO()) == 100 and output_console().width == 100
    monkeypatch.setenv("COLUMNS", "90")
    assert width_for(io.StringIO()) is None  # rich reads COLUMNS itself
    assert output_console().width == 90


def test_a_table_printed_into_a_pipe_is_not_wrapped_at_80_columns() -> None:
    """A wide table from a process whose stdout is a pipe, no width asked for: one line each
    row, PIPED_WIDTH wide, where rich alone would wrap it at 80 columns."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    script = (
        "from rich.table import Table\n"
        "from tuner.core.console import output_console\n"
        "t = Table()\n"
        "t.add_column('problem')\n"
        "t.add_column('us')\n"
        "t.add_row('x' * 90, '8008.59')\n"
        "output_console().print(t)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         stdin=subprocess.DEVNULL, text=True, check=True).stdout  # fmt: skip
    assert any("x" * 90 in line and "8008.59" in line for line in out.splitlines())
    assert max(len(line) for line in out.splitlines()) <= PIPED_WIDTH
