"""The bare streaming read reads every word: its per-program sums add up to the buffer's sum."""

from __future__ import annotations

import torch

from tuner.candidates.triton_kernels.stream_read import read_all, sums_for


def test_every_word_is_read() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU through the interpreter
    buf = torch.randint(-1000, 1000, (3 * 4096 + 17,), dtype=torch.int32, device=device)
    sums = sums_for(buf)
    read_all(buf, sums)
    assert sums.sum().item() == buf.sum().item()
