"""torch's packed INT4 weights and our layout of them, made once per weight (``int4_torch``)."""

from __future__ import annotations

import torch

from tuner.quant import int4, int4_torch


def test_memo_keeps_a_value_per_live_unchanged_tensor_only() -> None:
    """A tensor changed in place is made again, a dead one is forgotten, and a new tensor (which
    may take a dead one's id) always gets a value made from itself."""
    made: list[torch.Tensor] = []
    memo = int4_torch.TensorMemo(lambda t: made.append(t.clone()) or len(made) - 1)
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


def test_a_weight_packed_here_carries_our_layout_and_one_packed_elsewhere_is_converted() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 256), generator=gen, dtype=torch.uint8)
    packed = int4_torch.torch_pack(q)  # this device's packing (the CPU's here)
    ours = int4_torch.ours(packed)
    assert int4_torch.ours(packed) is ours and torch.equal(int4.unpack(ours), q)
    foreign = packed.clone()  # the same bytes, packed by someone else: converted once
    converted = int4_torch.ours(foreign)
    assert converted is not ours and torch.equal(converted, ours)
    assert int4_torch.ours(foreign) is converted
