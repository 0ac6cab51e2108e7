"""Fixtures the candidate tests share."""

from __future__ import annotations

import pytest

from tuner.cache.artifacts import ArtifactStore
from tuner.candidates import kernel_artifacts


@pytest.fixture
def store(tmp_path, monkeypatch) -> ArtifactStore:
    """A kernel cache and an artifact store of this test's own."""
    monkeypatch.setenv("CUTLASS_CACHE_DIR", str(tmp_path / "cache"))
    shared = ArtifactStore(tmp_path / "store")
    monkeypatch.setattr(kernel_artifacts, "shared_store", lambda: shared)
    return shared
