"""A bare streaming read: every byte of a buffer loaded once, one small sum per program written.

It is the floor a memory-bound kernel is judged against (a GEMM that reads its weight once can
at best match it), so it is written like one: wide loads, many independent programs, no reuse.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle

BLOCK = 4096  # int32 words per program


@triton.jit
def _stream_read(src, sums, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sums + tl.program_id(0), tl.sum(tl.load(src + offs, mask=offs < n, other=0), 0))


def sums_for(buf: torch.Tensor) -> torch.Tensor:
    """The per-program output ``read_all`` writes for ``buf``."""
    return torch.empty(triton.cdiv(buf.numel() * buf.element_size() // 4, BLOCK),
                       dtype=torch.int32, device=buf.device)  # fmt: skip


def read_all(buf: torch.Tensor, sums: torch.Tensor) -> None:
    """Read every byte of ``buf`` (contiguous, a whole number of int32 words) once."""
    words = buf.view(-1).view(torch.int32)
    grid = (triton.cdiv(words.numel(), BLOCK),)
    _stream_read[grid](words, sums, words.numel(), BLOCK=BLOCK, num_warps=8)


settle(globals())  # last: every JIT function above is defined
