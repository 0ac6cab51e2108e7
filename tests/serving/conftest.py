"""Fixtures of the drop-in tests: torch left unpatched after every test, and a store with a
single Triton winner for the bucket and capture tests to borrow from."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dropin_support import store_winners

import tuner.torch as tt
from tuner.core.keys import GemmKey
from tuner.serving.dispatcher import Dispatcher


@pytest.fixture(autouse=True)
def _always_disabled() -> Iterator[None]:
    yield
    while tt.is_enabled():  # a failing test must not leave torch patched for the next one
        tt.disable()


@pytest.fixture(scope="module")
def bucket_disp(tmp_path_factory: pytest.TempPathFactory) -> Dispatcher:
    """A Triton winner for M=8 of x @ W^T (N=24, K=16), and nothing else."""
    disp = Dispatcher(tmp_path_factory.mktemp("buckets") / "c.db")
    key = GemmKey(m=8, n=24, k=16, layout="nt", dtype="f32", out_dtype="f32")
    store_winners(disp, [key], triton=True)
    return disp
