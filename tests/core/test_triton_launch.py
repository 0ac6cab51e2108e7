"""Direct launches of compiled Triton kernels (``tuner.core.triton_launch``), on a real GPU."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tuner.core.triton_launch import Launcher, verify_direct

HAS_GPU = torch.cuda.is_available()
N = 4096


def _strided_copy_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def strided_copy(x_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i * stride, mask=i < n), mask=i < n)

    return strided_copy


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_gpu_a_direct_launch_keeps_its_specialization_when_another_is_compiled() -> None:
    """Two threads share one launcher: one finds stride 3's kernel ready, then the other's JIT
    call compiles stride 1 (which Triton specializes as a constant). The first thread's launch
    must still run stride 3's kernel, not read its arguments with the new one."""
    launcher = Launcher(_strided_copy_kernel(), (N // 1024,), {"BLOCK": 1024}, num_warps=4,
                        num_stages=1)  # fmt: skip
    x = torch.arange(3 * N, dtype=torch.float32, device="cuda")
    launcher((x, torch.empty(N, device="cuda"), N, 3), 3)  # JIT: stride 3's specialization
    if not launcher.compiled:
        pytest.skip("this Triton exposes no direct launch (or TUNER_TRITON_FAST_LAUNCH is off)")
    launcher.verified = True  # the owner's check (``verify_direct``), taken as passed here
    assert launcher.ready(1) is None, "stride 1 is another specialization: through the JIT"
    stride3 = launcher.ready(3)
    assert stride3 is not None

    ones = torch.empty(N, device="cuda")
    launcher((x, ones, N, 1), 1)  # another caller's JIT call binds stride 1's kernel
    assert launcher.ready(3) is None
    stride1 = launcher.ready(1)
    assert stride1 is not None and stride1.kernel is not stride3.kernel

    threes = torch.full((N,), -1.0, device="cuda")
    stride3((x.data_ptr(), threes.data_ptr(), N, 3))
    torch.cuda.synchronize()
    assert torch.equal(ones, x[:N])
    assert torch.equal(threes, x[::3][:N]), "stride 3's direct launch ran another kernel"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_gpu_a_disabled_launcher_offers_no_direct_launch() -> None:
    launcher = Launcher(_strided_copy_kernel(), (N // 1024,), {"BLOCK": 1024}, num_warps=4,
                        num_stages=1)  # fmt: skip
    x = torch.arange(N, dtype=torch.float32, device="cuda")
    out = torch.empty(N, device="cuda")
    launcher((x, out, N, 1), 1)
    launcher.verified = True
    launcher.disable()
    assert launcher.ready(1) is None and not launcher.compiled
    launcher((x, out, N, 1), 1)  # JIT again, and nothing kept
    assert launcher.ready(1) is None
    torch.cuda.synchronize()
    assert torch.equal(out, x)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_gpu_only_the_checking_thread_launches_directly_before_the_check_passes() -> None:
    """While ``verify_direct`` relaunches through the direct path, another thread's call still
    goes through the JIT: an unchecked direct launch serves nobody but the check."""
    launcher = Launcher(_strided_copy_kernel(), (N // 1024,), {"BLOCK": 1024}, num_warps=4,
                        num_stages=1)  # fmt: skip
    x = torch.arange(N, dtype=torch.float32, device="cuda")
    out = torch.empty(N, device="cuda")
    launcher((x, out, N, 1), 1)
    if not launcher.compiled:
        pytest.skip("this Triton exposes no direct launch (or TUNER_TRITON_FAST_LAUNCH is off)")
    seen: dict[str, Any] = {}

    def relaunch(again: torch.Tensor) -> None:
        other = threading.Thread(target=lambda: seen.setdefault("other", launcher.ready(1)))
        other.start()
        other.join()
        direct = seen["checker"] = launcher.ready(1)
        direct((x.data_ptr(), again.data_ptr(), N, 1))

    assert verify_direct([launcher], out, relaunch, "strided_copy")
    assert seen["other"] is None and seen["checker"] is not None
    assert launcher.verified and launcher.ready(1) is not None


class _Compiled:
    """What Triton's JIT returns for a launch: the compiled kernel and its launcher (``run``)."""

    run = function = packed_metadata = None


class _Jit:
    """A JIT function of no constexprs (Triton's own needs a GPU to compile)."""

    params: tuple = ()

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args, **kwargs: _Compiled()


def _bound_launcher(monkeypatch: pytest.MonkeyPatch) -> Launcher:
    """A launcher whose JIT call bound guard "g" (compiled, not verified)."""
    monkeypatch.setattr("tuner.core.triton_launch.interpreting", lambda: False)
    launcher = Launcher(_Jit(), (1,), {}, num_warps=4, num_stages=1)
    launcher((), "g")
    assert launcher.compiled and launcher.ready("g") is None  # not verified yet
    return launcher


def test_threads_checking_a_direct_launch_at_once_each_launch_it_and_no_other_thread_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two first calls of one shared plan check it at once: each one's relaunch goes direct (a
    relaunch through the JIT would compare the JIT with itself), a third thread meanwhile is
    sent through the JIT, and once the checks pass every thread launches directly."""
    launcher = _bound_launcher(monkeypatch)
    both_in, seen = threading.Barrier(2), {}

    def relaunch_of(name: str) -> Any:
        def relaunch(again: torch.Tensor) -> None:
            both_in.wait(10)
            seen[name] = launcher.ready("g") is not None
            other = threading.Thread(target=lambda: seen.setdefault("other", launcher.ready("g")))
            other.start()
            other.join(10)
            both_in.wait(10)
            again.fill_(1.0)

        return relaunch

    out = torch.ones(4)
    checkers = [threading.Thread(target=verify_direct, args=([launcher], out, relaunch_of(n), n))
                for n in ("A", "B")]  # fmt: skip
    for t in checkers:
        t.start()
    for t in checkers:
        t.join(10)
    assert seen == {"A": True, "B": True, "other": None}
    assert launcher.verified and not launcher.trials and launcher.ready("g") is not None


def test_a_direct_relaunch_that_differs_turns_the_direct_path_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launcher = _bound_launcher(monkeypatch)
    assert verify_direct([launcher], torch.ones(4), lambda again: again.fill_(2.0), "differs")
    assert not launcher.verified and not launcher.trials and not launcher.compiled
    assert launcher.ready("g") is None
