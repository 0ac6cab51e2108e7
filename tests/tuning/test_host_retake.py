"""A host reading that alone drops a faster challenger is taken again, and the lower one counts.

CPU timings read the host time from the timed calls themselves (a CPU call is synchronous), so
no CPU baseline can be quick to launch and slow to run. The baseline here is therefore a
measurement with a GPU's shape (a long kernel, a short launch) while the challengers are real
runners timed by the real trial. Its times are long enough that a disturbed challenger's reading
stays where the verdict hinges on it (between half the baseline's time and the tie ceiling) on
a loaded 2-core machine too, where a busy-wait reads several times what it asked for.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from tuner.candidates.base import Params, Source
from tuner.core.keys import GemmKey
from tuner.measure import timing
from tuner.measure.records import Measurement
from tuner.tuning.options import TuneOptions
from tuner.tuning.trials import Trial
from tuner.tuning.verdict import contenders, host_decides, ties

KEY = GemmKey(m=48, n=40, k=72, dtype="f32", out_dtype="f32")
BUSY_S = 40e-3  # host work per disturbed call: far above the kernel's few microseconds


def _in_timing() -> bool:
    """Whether the current call comes from inside ``timing.measure`` (a trial's or a duel's
    timing), not from a fresh host reading (``timing.host_reading``) or the numerics check."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is timing.measure.__code__:
            return True
        frame = frame.f_back
    return False


class Spinning(Source):
    """torch's kernel behind ``BUSY_S`` of host work on every call, where ``busy`` says so."""

    op = "gemm"

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return [{}]

    def busy(self) -> bool:
        return True

    def build(self, key: GemmKey, params: Params) -> Callable[..., torch.Tensor]:
        def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            if self.busy():
                until = time.perf_counter() + BUSY_S
                while time.perf_counter() < until:
                    pass
            return torch.matmul(a, b, out=out)

        return run


class DisturbedWhileTimed(Spinning):
    """Busy only while its timing runs (as beside another process), quiet when its host time
    is read again: its first host reading is disturbed, the retake is not."""

    name = "disturbed_while_timed"

    def busy(self) -> bool:
        return _in_timing()


class TrulySlowToLaunch(Spinning):
    """Busy on every call: each host reading is high."""

    name = "truly_slow_to_launch"


class Quiet(Spinning):
    """torch's kernel alone: quick to launch, nothing to read again."""

    name = "quiet"

    def busy(self) -> bool:
        return False


def gpu_shaped_baseline() -> Measurement:
    """A baseline long on the GPU and quick to launch: 60 ms a call, 2 ms of host time."""
    return Measurement(
        device_class="cpu", key=str(KEY), source="torch", params={}, status="ok",
        is_baseline=True, median_us=60000.0, p10_us=59900.0, p90_us=60100.0, reps=50,
        host_us=2000.0, launch="eager",
    )  # fmt: skip


def record(source: Source, params: Params, status: str, **fields: Any) -> Measurement:
    return Measurement(
        device_class="cpu", key=str(KEY), source=source.name, params=params, status=status,
        is_baseline=source.is_baseline(params), launch="eager", **fields,
    )  # fmt: skip


OPTIONS = TuneOptions(budget_s=0.02, confirm_rounds=1)


def trial_of(source: Source, base: Measurement) -> tuple[Trial, Measurement]:
    trial = Trial.for_key(KEY, "cpu", OPTIONS.seed, record)
    return trial, trial.run(source, {}, None, OPTIONS, None, base)


def test_the_verdict_hinges_on_the_host_reading_only_where_it_alone_drops_a_faster_one():
    base = gpu_shaped_baseline()
    base.median_us, base.host_us = 59.1, 45.0  # torch's FP8 op on a prefill row
    eager = TuneOptions()
    assert host_decides(56.6, 72.6, base, eager)  # a kernel 4.2% faster, its host read at 72.6
    assert not host_decides(56.6, 33.0, base, eager)  # a sibling's host time: in contention
    assert host_decides(60.0, 72.6, base, eager)  # a hair slower: a tie, but for that reading
    assert not host_decides(61.0, 72.6, base, eager)  # past the tie ceiling: decides nothing
    assert not host_decides(56.6, 72.6, base, TuneOptions(launch="graph"))  # no launch rule
    base.median_us, base.host_us = 100.0, 10.0
    assert host_decides(5.0, 103.0, base, eager)  # launch repaid, but past the ceiling eagerly
    assert not host_decides(5.0, 101.0, base, eager)  # a tie eagerly: it duels


def test_a_disturbed_host_reading_is_taken_again_and_the_challenger_contends(one_thread):
    base = gpu_shaped_baseline()
    trial, m = trial_of(DisturbedWhileTimed(), base)
    assert m.status == "ok", m.error
    assert m.median_us > BUSY_S * 1e6  # its timing was disturbed throughout
    assert m.host_us < base.host_us  # the retake's reading, the lower
    assert m.error.startswith("host time read again: ")
    assert contenders([base, m], OPTIONS) + ties([base, m], OPTIONS) == [m]
    # the duel's verdict follows the note, which says why the challenger got there
    trial.confirm(base, m, OPTIONS)
    assert "host time read again: " in m.error and "; confirmation: " in m.error


def test_a_truly_high_host_time_is_read_again_and_still_drops_the_challenger(one_thread):
    base = gpu_shaped_baseline()
    _, m = trial_of(TrulySlowToLaunch(), base)
    assert m.status == "ok", m.error
    assert m.host_us > BUSY_S * 1e6  # both readings high
    assert m.error.startswith("host time read again: ")
    assert contenders([base, m], OPTIONS) == ties([base, m], OPTIONS) == []


def test_a_host_reading_that_decides_nothing_is_not_taken_again(one_thread):
    base = gpu_shaped_baseline()
    _, m = trial_of(Quiet(), base)
    assert m.status == "ok" and m.error == ""
    assert contenders([base, m], OPTIONS) == [m]
