"""torch's packed INT4 weights and our layout of them, made once per weight (``int4_torch``)."""

from __future__ import annotations

import torch

from tuner.quant import int4, int4_torch


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
