"""TensorMemo: a value made once per tensor, kept while the tensor lives unchanged."""

from __future__ import annotations

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
