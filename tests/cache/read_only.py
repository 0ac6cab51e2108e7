"""A cache file, or its whole folder, that cannot be written: the immutable flag (``chattr +i``)
binds root too, where a file mode would not."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def _immutable(path: Path) -> Iterator[None]:
    """``path`` immutable inside the block, writable again after it so the test's folder can be
    removed; the test is skipped where the flag cannot be set."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i refused (not root, or a filesystem without the flag)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[bytes]:
    """The file ``path`` immutable inside the block; its bytes given."""
    with _immutable(path):
        yield path.read_bytes()


@contextlib.contextmanager
def frozen_folder(folder: Path) -> Iterator[dict[str, bytes]]:
    """No file can be made, removed or renamed in ``folder`` inside the block (a read-only
    mount's folder); its files' bytes given, by name."""
    with _immutable(folder):
        yield {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
