"""The bare streaming read reads every word: its per-program sums add up to the buffer's sum."""

from __future__ import annotations

import torch

from tuner.candidates.triton_kernels.stream_read import read_all, sums_for


def test_every_word_is_read() -> None:
    buf = torch.randint(-1000, 1000, (3 * 4096 + 17,), dtype=torch.int32)
    sums = sums_for(buf)
    read_all(buf, sums)
    assert sums.sum().item() == buf.sum().item()
