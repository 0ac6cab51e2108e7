"""TensorMemo: a value made once per tensor, kept while the tensor lives unchanged."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from tuner.core.tensor_memo import TensorMemo, forget


def test_memo_keeps_a_value_per_live_unchanged_tensor_only() -> None:
    """A tensor changed in place is made again, a dead one is forgotten, and a new tensor (which
    may take a dead one's id) always gets a value made from itself."""
    made: list[torch.Tensor] = []
    memo = TensorMemo(lambda t: made.append(t.clone()) or len(made) - 1)
    a = torch.zeros(4)
    assert (memo(a), memo(a), len(memo)) == (0, 0, 1)
    a.add_(1)
    assert memo(a) == 1 and len(memo) == 1
    del a
    assert len(memo) == 0
    for i in range(20):
        b = torch.full((4,), float(i))
        assert made[memo(b)][0] == i
        del b
    assert len(memo) == 0


def test_an_inference_tensor_is_kept_while_it_lives_and_forget_drops_it() -> None:
    """A tensor made under ``torch.inference_mode()`` has no version counter (reading one
    raised, so a weight loaded there failed its first int4 call): its value is kept while it
    lives, and ``forget`` drops it where the tensor was written in place."""
    made: list[int] = []
    memo = TensorMemo(lambda t: made.append(1) or len(made))
    with torch.inference_mode():
        a = torch.zeros(4)
    assert (memo(a), memo(a)) == (1, 1)
    forget(a)
    assert memo(a) == 2


def _made_across(memo_write: Callable[[torch.Tensor], None], inference: bool) -> list[float]:
    """Thread A's first call makes a value from ``a`` (its first element), and while it makes
    it ``memo_write(a)`` runs in this thread; then a later call. Returns the two calls' values."""
    read, written = threading.Event(), threading.Event()

    def make(t: torch.Tensor) -> float:
        value = float(t[0])
        read.set()
        written.wait(10)  # the other thread writes the tensor meanwhile
        return value

    memo = TensorMemo(make)
    with torch.inference_mode(inference):
        a = torch.zeros(4)
    first: list[float] = []
    maker = threading.Thread(target=lambda: first.append(memo(a)))
    maker.start()
    assert read.wait(10)
    memo_write(a)
    written.set()
    maker.join(10)
    read.clear()
    written.set()  # a later make waits no more
    return [first[0], memo(a)]


def test_a_value_made_while_its_tensor_is_written_in_place_is_not_served_again() -> None:
    """A hot reload writes a weight while another thread makes its layout from the old values:
    that layout is that call's, but the next call makes the new one."""
    assert _made_across(lambda a: a.add_(1), inference=False) == [0.0, 1.0]


def test_a_forget_while_a_value_is_made_is_not_undone_by_its_keeping() -> None:
    """An inference tensor written and ``forget``-ed (the documented way) while another thread
    makes its value from the old contents: the forget holds."""

    def write_and_forget(a: torch.Tensor) -> None:
        with torch.inference_mode():
            a.add_(1)
        forget(a)

    assert _made_across(write_and_forget, inference=True) == [0.0, 1.0]
