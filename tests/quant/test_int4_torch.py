"""torch's packed INT4 weights and our layout of them, made once per weight (``int4_torch``)."""

from __future__ import annotations

import pytest
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


def test_a_float_weight_passed_in_place_of_its_nibbles_is_refused_not_packed_as_zeros() -> None:
    """``torch_pack(w)`` for ``torch_pack(int4.quantize(w, g)[0])``: a weight's values mostly lie
    in (-1, 1) (here all), so a range check alone passes them and truncation packs them as 0."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.02
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(
            ValueError, match=rf"^q\.dtype={dtype}: expected integer values 0\.\.15"
        ):
            int4_torch.torch_pack(w.to(dtype))
    q, _ = int4.quantize(w, 128)
    assert torch.equal(int4_torch.nibbles(int4_torch.torch_pack(q.int())), q)
