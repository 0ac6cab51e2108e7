"""A cache file that cannot be written while its folder can: the immutable flag (``chattr +i``)
binds root too, where a file mode would not."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[bytes]:
    """``path`` immutable inside the block (its bytes given), writable again after it so the
    test's folder can be removed; the test is skipped where the flag cannot be set."""
    if shutil.which("chattr") is None:
        pytest.skip("no chattr here")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("chattr +i refused (not root, or a filesystem without the flag)")
    try:
        yield path.read_bytes()
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
