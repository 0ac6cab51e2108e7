"""Winners whose build may compile are built off the hot path: the baseline serves meanwhile, the
dispatcher switches to the built runner exactly once, and a failed build leaves the baseline,
reported. The slow build is a planted source whose compile step blocks until the test allows it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tuner.cache import Store
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.candidates.triton_gemm import TritonGemm
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure.records import Winner
from tuner.serving.background import BackgroundLoader, may_compile
from tuner.serving.dispatcher import Dispatcher

# where this host's dispatcher serves: on a GPU host, calls on the CPU go to torch's default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# on a GPU the loader calls a fresh runner once before it serves (``background.run_once``)
WARM_CALLS = 1 if DEVICE == "cuda" else 0


class SlowBuild(Source):
    """A source with a compile step that waits for ``release``; its runner counts its calls and
    computes a @ b + 0 (a result of its own, equal to the baseline's)."""

    name = "slow_build"
    op = "gemm"
    builds_kernels = True

    def __init__(self, error: str | None = None) -> None:
        self.release = threading.Event()
        self.error = error
        self.compiles = 0
        self.calls = 0

    def candidates(self, key, device):
        return [{}]

    def precompile(self, key, shortlist):
        self.release.wait(60)
        self.compiles += 1

    def build(self, key, params):
        if self.error:
            raise RuntimeError(self.error)

        def run(a, b, out=None):
            self.calls += 1
            return torch.matmul(a, b, out=out)

        return run


@pytest.fixture
def compiling_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host where Triton compiles (not its interpreter): builds with a compile step go to the
    background. Every source module is imported first: Triton decides interpreter or compiler
    when a kernel is decorated, so a module first imported here would keep compiled kernels
    for the rest of the session."""
    registry.all_sources()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@contextmanager
def planted(
    cache_path: Path, source: SlowBuild
) -> Iterator[tuple[Dispatcher, torch.Tensor, torch.Tensor]]:
    """A dispatcher whose store holds ``source``'s winner for (8, 16) @ (16, 4) on ``DEVICE``."""
    a, b = torch.randn(8, 16, device=DEVICE), torch.randn(16, 4, device=DEVICE)
    key = str(GemmKey.from_tensors(a, b))
    winner = Winner(fingerprint().device_class, key, source.name, {}, 1.0, 2.0)
    Store(cache_path).put_winners([winner])
    registry.register(source)
    try:
        yield Dispatcher(cache_path, mode="lookup"), a, b
    finally:
        source.release.set()
        registry.unregister(source.name)


def kinds(d: Dispatcher) -> set[str]:
    return {r.kind for r in d.resolutions.values()}


@pytest.fixture
def slow(
    cache_path: Path, compiling_host: None
) -> Iterator[tuple[Dispatcher, SlowBuild, torch.Tensor, torch.Tensor]]:
    source = SlowBuild()
    with planted(cache_path, source) as (d, a, b):
        yield d, source, a, b


def test_the_baseline_serves_until_the_build_is_done_then_the_runner_switches_once(slow) -> None:
    d, source, a, b = slow
    want = a @ b
    callers = [threading.Thread(target=lambda: d.matmul(a, b)) for _ in range(4)]
    for t in callers:
        t.start()
    for _ in range(3):  # the build blocks in its compile step: these calls cannot be waiting
        torch.testing.assert_close(d.matmul(a, b), want)
    for t in callers:
        t.join()
    assert source.calls == 0 and kinds(d) == {"loading"}
    assert d.loader.stats().in_flight == 1  # one build, however many calls

    source.release.set()
    assert d.loader.wait(60)
    for _ in range(3):
        torch.testing.assert_close(d.matmul(a, b), want)
    assert source.calls == WARM_CALLS + 3 and source.compiles == 1
    assert d.switches == 1 and "hit" in kinds(d)
    assert d.loader.stats().built == 1

    d.reload()  # e.g. a fleet sync: the loaded runner is reused, not built again
    d.matmul(a, b)
    assert source.compiles == 1 and source.calls == WARM_CALLS + 4 and d.switches == 1


def test_a_build_in_flight_is_asked_whether_it_can_serve_once(slow, monkeypatch) -> None:
    """Another signature of the key (a padded row stride) while its winner builds: served by the
    baseline as loading, without asking the source again whether it can serve here (for a CUDA
    library, a read of the artifact store), and switched with the first once built."""
    d, source, a, b = slow
    asked = []
    monkeypatch.setattr(source, "unavailable", lambda device: asked.append(device))
    padded = torch.randn(a.shape[0], 2 * a.shape[1], device=DEVICE)[:, : a.shape[1]]
    padded.copy_(a)
    for x in (a, padded, padded):
        torch.testing.assert_close(d.matmul(x, b), a @ b)
    assert len(asked) == 1 and kinds(d) == {"loading"}
    source.release.set()
    assert d.loader.wait(60)
    torch.testing.assert_close(d.matmul(padded, b), a @ b)
    assert d.switches == 2 and len(asked) == 1


def test_a_failed_build_leaves_the_baseline_and_is_reported(cache_path, compiling_host) -> None:
    source = SlowBuild(error="ptxas fatal: out of registers")
    source.release.set()
    with planted(cache_path, source) as (d, a, b):
        torch.testing.assert_close(d.matmul(a, b), a @ b)
        assert d.loader.wait(60)
        for _ in range(2):
            torch.testing.assert_close(d.matmul(a, b), a @ b)
        (error,) = d.loader.stats().failures.values()
        assert "ptxas fatal" in error
        failed = [r for r in d.resolutions.values() if r.kind == "failed"]
        assert failed and failed[0].candidate.startswith("slow_build") and failed[0].by_torch
        assert source.compiles == 1 and d.switches == 0  # not retried on every call


def synced_winner(cache_path: Path, source: str, params: dict, dtype: torch.dtype) -> tuple:
    """A store holding ``source``'s winner for (8, 16) @ (16, 16) in ``dtype`` on this CPU, as
    a fleet sync brings it from a host where it ran; its operands."""
    a, b = torch.randn(8, 16, dtype=dtype), torch.randn(16, 16, dtype=dtype)
    key = str(GemmKey.from_tensors(a, b))
    Store(cache_path).put_winners([Winner(fingerprint("cpu").device_class, key, source, params,
                                          1.0, 2.0)])  # fmt: skip
    return a, b


TRITON_PARAMS = {"bm": 16, "bn": 16, "bk": 16, "group_m": 1, "warps": 4, "stages": 1}


@pytest.mark.cpu_host
def test_a_synced_winner_that_cannot_run_here_leaves_the_baseline_with_the_reason(
    cache_path, compiling_host, monkeypatch
) -> None:
    """A Triton winner on a CPU without Triton's interpreter is not built (its launch would
    raise in the caller's call): the baseline serves, the reason is recorded, and warmup names
    it. A reload (after a sync) asks again: what the host lacked may be here now."""
    from tuner.serving.warmup import warmup

    a, b = synced_winner(cache_path, "triton_gemm", TRITON_PARAMS, torch.float32)
    d = Dispatcher(cache_path, mode="lookup")
    for _ in range(2):
        torch.testing.assert_close(d.matmul(a, b), a @ b)
    (error,) = d.loader.stats().failures.values()
    assert error.startswith("no GPU (set TRITON_INTERPRET=1")
    assert kinds(d) == {"failed"} and d.loader.stats().built == 0
    report = warmup(progress=False, dispatcher=d, fetch=False)
    (failure,) = report.failures
    assert "triton_gemm" in failure.error and "cannot serve here: no GPU" in failure.error
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d.reload()
    torch.testing.assert_close(d.matmul(a, b), a @ b)
    assert d.loader.stats().failures == {} and "hit" in kinds(d)


@pytest.mark.cpu_host
def test_a_synced_winner_that_cannot_take_the_key_here_leaves_the_baseline(
    cache_path, monkeypatch
) -> None:
    """Under Triton's interpreter a bf16 Triton GEMM computes wrongly: a bf16 winner synced
    from a GPU host is not served here."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, b = synced_winner(cache_path, "triton_gemm", TRITON_PARAMS, torch.bfloat16)
    d = Dispatcher(cache_path, mode="lookup")
    torch.testing.assert_close(d.matmul(a, b), a @ b)
    (error,) = d.loader.stats().failures.values()
    assert "computes bf16 tl.dot wrongly" in error and kinds(d) == {"failed"}


def test_which_builds_go_to_the_background(monkeypatch) -> None:
    """Triton's interpreter compiles nothing: its sources build on the call; off it they (and
    any source with a compile step) build in the background; sources without one never do."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not may_compile(TritonGemm()) and not may_compile(SlowBuild())
    monkeypatch.delenv("TRITON_INTERPRET")
    assert may_compile(TritonGemm()) and may_compile(SlowBuild())
    assert not may_compile(registry.baseline("gemm"))


def test_the_loader_runs_one_build_per_job_and_reports_errors() -> None:
    loader = BackgroundLoader(workers=2)
    gate = threading.Event()
    done: list[object] = []
    failed: list[str] = []
    assert loader.submit("k", lambda: gate.wait(60) and "runner", done.append, failed.append)
    assert not loader.submit("k", lambda: "again", done.append, failed.append)  # in flight
    assert loader.submit("bad", lambda: 1 / 0, done.append, failed.append)
    gate.set()
    assert loader.wait(60)
    assert done == ["runner"] and failed == ["ZeroDivisionError: division by zero"]
    stats = loader.stats()
    assert stats.built == 1 and stats.in_flight == 0
    assert stats.failures == {"bad": "ZeroDivisionError: division by zero"}
    assert loader.submit("k", lambda: "rebuilt", done.append, failed.append)  # done: may again
    assert loader.wait(60) and done[-1] == "rebuilt"
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        BackgroundLoader(workers=0)
