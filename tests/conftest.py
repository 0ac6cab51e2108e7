"""Shared fixtures. Tests marked ``gpu`` are skipped where no CUDA device is present, those marked
``cpu_host`` where one is."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Triton reads this when a kernel is *defined*, so it must be set before tuner imports them:
    # on a machine without a GPU every Triton kernel of the suite runs in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:  # the CPU path as a host without a GPU (CI's) runs it
        skip = pytest.mark.skip(reason="the CPU path of a host without a GPU")
        mark = "cpu_host"
    else:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        mark = "gpu"
    for item in items:
        if mark in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache file, also exported as TUNER_CACHE for subprocesses and the dispatcher."""
    path = tmp_path / "tuner.db"
    monkeypatch.setenv("TUNER_CACHE", str(path))
    return path


@pytest.fixture(autouse=True)
def memoized_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test meets the planted ``Memoized`` source fast; one that makes it slow (a lucky
    measurement, then a slow reality) does so for itself alone."""
    from planted import Memoized

    monkeypatch.setattr(Memoized, "slow", False)
