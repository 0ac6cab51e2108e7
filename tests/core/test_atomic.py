"""write_atomic on real files: whole content or the old one, no temporary files left behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tuner.core.atomic import write_atomic


def test_writes_text_and_bytes_and_replaces_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    write_atomic(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}'
    write_atomic(path, b"\x00\x01", durable=True)
    assert path.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["report.json"]


def test_a_failed_write_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()  # a folder cannot be replaced by a file
    (target / "kept").write_text("x")
    with pytest.raises(OSError):
        write_atomic(target, "new")
    assert (target / "kept").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["taken"]


def test_the_new_file_gets_the_permissions_open_would_give(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "out.txt", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == 0o644
