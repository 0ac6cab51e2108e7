"""Fixtures of the engine's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test: steady CPU timings on a busy host (no thread of a
    multi-threaded kernel waiting for a core another process holds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
