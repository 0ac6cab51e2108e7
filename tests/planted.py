"""A test-only candidate source whose candidates are wrong in known ways."""

from __future__ import annotations

import os
import signal
import time

import torch

from tuner.candidates.base import Source


class PlantedGemm(Source):
    """A test-only source whose candidates are wrong in known ways."""

    name = "planted"
    op = "gemm"

    def candidates(self, key, device):
        return [
            {"bug": "drops_last_k"},
            {"bug": "nan"},
            {"bug": "build_error"},
            {"bug": "raises"},
            {"bug": "slow"},
        ]

    def build(self, key, params):
        bug = params["bug"]
        if bug == "build_error":
            raise RuntimeError("static_assert failed: tile too large")

        def run(a, b, out=None):
            if bug == "drops_last_k":
                c = a[..., :-1] @ b[..., :-1, :]
            elif bug == "nan":
                c = torch.full(
                    (a.shape[-2], b.shape[-1]), float("nan"), dtype=a.dtype, device=a.device
                )
            elif bug == "raises":
                raise RuntimeError("illegal memory access")
            else:
                time.sleep(0.02)
                c = a @ b
            if out is not None:
                out.copy_(c)
                return out
            return c

        return run


class Memoized(Source):
    """A challenger that is truly faster than torch on tiny problems (it serves a memoized
    product), and that a test can make slow at any moment (``slow = True``): a lucky
    measurement followed by a slow reality."""

    name = "memoized"
    op = "gemm"
    slow = False
    first_sight_s = 0.0  # the time of its first call on an operand

    def candidates(self, key, device):
        return [{}]

    def build(self, key, params):
        cache: dict[int, torch.Tensor] = {}

        def run(a, b, out=None):
            if Memoized.slow:
                time.sleep(0.002)
            c = cache.get(a.data_ptr())
            if c is None:
                time.sleep(self.first_sight_s)
                c = cache[a.data_ptr()] = a @ b
            if out is not None:
                out.copy_(c)
                return out
            return c

        return run


class Counted(Source):
    """One candidate whose product depends on how many times its runner was called: ``product(n,
    a, b)`` for the n-th call (from 1)."""

    op = "gemm"

    def candidates(self, key, device):
        return [{}]

    def product(self, n, a, b):
        raise NotImplementedError

    def build(self, key, params):
        calls = [0]

        def run(a, b, out=None):
            calls[0] += 1
            c = self.product(calls[0], a, b)
            if out is not None:
                out.copy_(c)
                return out
            return c

        return run


class RightOnce(Counted):
    """Right on its first call, wrong on every later one: the path that is timed and served."""

    name = "right_once"

    def product(self, n, a, b):
        return a @ b if n == 1 else (a @ b) * 1.5


class Uncapturable(Memoized):
    """Memoized's speed, but it raises inside a CUDA-graph capture (as a library that launches
    on a stream of its own would): it could not serve a caller that replays graphs."""

    name = "uncapturable"

    def build(self, key, params):
        run = super().build(key, params)

        def guarded(a, b, out=None):
            if a.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("operation not permitted when stream is capturing")
            return run(a, b, out)

        return guarded


class Twin(Source):
    """The baseline's own kernel under another name: any win it shows is noise."""

    name = "twin"
    op = "gemm"

    def candidates(self, key, device):
        return [{}]

    def build(self, key, params):
        def run(a, b, out=None):
            return torch.matmul(a, b, out=out)

        return run


class BrokenInDuel(Memoized):
    """Memoized, faster than torch in its trial, whose runner raises once a test sets
    ``broken`` (as a sticky CUDA error would in its duel)."""

    name = "broken_in_duel"
    broken = False

    def build(self, key, params):
        run = super().build(key, params)

        def maybe_raise(a, b, out=None):
            if type(self).broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return run(a, b, out)

        return maybe_raise


class Level(Memoized):
    """torch's own matmul, level with the baseline however loaded the host, until a test sets
    ``ahead``: then Memoized's product, far ahead."""

    name = "level"
    ahead = False

    def build(self, key, params):
        memoized = super().build(key, params)

        def run(a, b, out=None):
            return memoized(a, b, out) if type(self).ahead else torch.matmul(a, b, out=out)

        return run


class Busy(Memoized):
    """Memoized's product behind ``busy_s`` of host work per call (a busy wait, not a sleep: as
    steady as the clock), which a test may change at any moment."""

    name = "busy"
    busy_s = 100e-6

    def build(self, key, params):
        run = super().build(key, params)

        def busy(a, b, out=None):
            until = time.perf_counter() + type(self).busy_s
            while time.perf_counter() < until:
                pass
            return run(a, b, out)

        return busy


class GpuBusy(Busy):
    """Busy's host work, then ``gpu_cycles`` of a spinning kernel on the GPU: as quick to
    launch as Busy, slower on the GPU."""

    name = "gpubusy"
    gpu_cycles = 50_000

    def build(self, key, params):
        run = super().build(key, params)

        def spin(a, b, out=None):
            if a.is_cuda:
                torch.cuda._sleep(type(self).gpu_cycles)
            return run(a, b, out)

        return spin


class HostHeavy(Busy):
    """Memoized's GPU work (none, after the first call) behind 200 us of host work per call:
    slowest eagerly, fastest in a CUDA graph, where the host's work is not replayed."""

    name = "hostheavy"
    busy_s = 200e-6


class ConvertsOnFirstSight(Memoized):
    """Memoized's speed, but its first call on each operand tensor is slow: it converts the
    tensor first (a layout made once per tensor, as the INT4 runners' is)."""

    name = "converts_on_first_sight"
    first_sight_s = 0.05


class Disturbed(Counted):
    """torch's kernel, disturbed while its first timing runs: each of its calls 60 to 159 waits
    1 ms (as a call would beside a compile), about a fifth of that timing's calls, and none
    after. The engine must see the disturbance and time it again."""

    name = "disturbed"
    window = range(60, 160)
    wait_s = 0.001

    def product(self, n, a, b):
        if n in self.window:
            time.sleep(self.wait_s)
        return a @ b


class SharedMemoized(Memoized):
    """Memoized's speed from a source whose kernels serve every shape, as CUTLASS's do: a run
    times it in a problem's second pass, once the run's shared kernels are compiled."""

    name = "shared_memoized"
    shares_kernels = True


class SharedTwin(Twin):
    """The baseline's own kernel from a source that shares kernels: never a win."""

    name = "shared_twin"
    shares_kernels = True


class SlowSharedMemoized(SharedMemoized):
    """SharedMemoized whose first call on each operand takes seconds: a second pass that runs
    past a problem's time limit."""

    name = "slow_shared_memoized"
    first_sight_s = 4.0


class SharedRaises(SharedMemoized):
    """A source that shares kernels whose own check raises: a second pass that crashes (the
    engine lets its own errors out, as a bug of its would)."""

    name = "shared_raises"

    def unsupported(self, key):
        raise RuntimeError("shared_raises cannot tell")


class SharedKills(SharedMemoized):
    """A source that shares kernels whose build kills the process that runs it, as a kernel
    that segfaults does: a second pass whose worker dies."""

    name = "shared_kills"

    def build(self, key, params):
        os.kill(os.getpid(), signal.SIGKILL)


class SlowToBuild(Twin):
    """torch's kernel behind a build of ``build_s`` (a long compile in the tuning process): a
    pass whose length a test sets."""

    name = "slow_to_build"
    build_s = 4.0

    def build(self, key, params):
        time.sleep(type(self).build_s)
        return super().build(key, params)


class SharedSlowToBuild(SlowToBuild):
    """SlowToBuild from a source that shares kernels: a second pass whose length a test sets."""

    name = "shared_slow_to_build"
    shares_kernels = True
