"""``report_usage_errors``: every way a command ends in error says why, in one line."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import typer

from tuner.cli.errors import FAILED, report_usage_errors, stdout_cut_off, write_output
from tuner.offline.problem_list import ConfigError


def test_an_abort_says_why_instead_of_ending_silently(capsys: pytest.CaptureFixture) -> None:
    """typer turns an EOFError inside a command into an Abort: the command still says so."""
    with pytest.raises(SystemExit) as ended, report_usage_errors():
        try:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        except EOFError as e:
            raise typer.Abort() from e
    assert ended.value.code == FAILED
    assert capsys.readouterr().err == (
        "error: aborted: Compressed file ended before the end-of-stream marker was reached\n"
    )


def test_a_broken_pipe_that_is_not_stdout_is_said(capsys: pytest.CaptureFixture) -> None:
    """Only a closed stdout ends a command quietly: a socket's broken pipe is a real error,
    which click would have ended the command on with status 1 and no word."""
    with pytest.raises(SystemExit) as ended, report_usage_errors(), stdout_cut_off():
        raise BrokenPipeError(32, "Broken pipe")  # (stdout here: pytest's capture file, open)
    assert ended.value.code == FAILED
    assert capsys.readouterr().err == (
        "error: closed by the other end (not stdout): [Errno 32] Broken pipe\n"
    )


@pytest.mark.parametrize("folder", [".", "..", "out"])
def test_an_output_that_is_a_folder_is_named_as_one(
    folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tuner export .`` and ``..`` are refused in the same words as every folder, not with
    the system's errors ("PosixPath('.') has an empty name", "Device or resource busy")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    with pytest.raises(
        ConfigError, match=f"^{re.escape(folder)}: cannot write: a folder, not a file$"
    ):
        write_output(Path(folder), "{}")


def test_an_output_that_is_no_regular_file_is_written_to_not_replaced(tmp_path: Path) -> None:
    """``tuner export /dev/null`` run as root replaced the device with a regular file; a FIFO
    was replaced the same way (its reader got nothing), and a link (its target kept the old
    content)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_output(fifo, "{}")
        assert os.read(reader, 100) == b"{}" and stat.S_ISFIFO(fifo.lstat().st_mode)
    finally:
        os.close(reader)
    target, link = tmp_path / "results.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    write_output(link, "{}")
    assert link.is_symlink() and target.read_text() == "{}"
