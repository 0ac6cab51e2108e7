"""Split-K partials summed inside the kernel by each output tile's last program to finish.

The alternative, ``tiled.splitk_reduce``, is a second launch; in a decode step (a CUDA graph of
short kernels) that launch and the round trip of the partials through it are a visible share of
the GEMM's time. Here every program stores its float32 partial, bumps its tile's arrival count,
and the program that brings the count to ``SPLIT_K`` sums the partials in split order (the same
sum, bit for bit, as ``splitk_reduce``), stores the output and sets the count back to zero, so
the counts are ready for the next launch on the stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.core.fork_safe import ForkSafeLock
from tuner.core.triton_launch import current_stream

MIN_COUNTS = 4096  # counts kept per device (grown on demand)


@triton.jit
def reduce_if_last(ws_ptr, counts_ptr, tile, part, plane, mask, out_ptrs, PARTS: tl.constexpr):
    """Call after storing this program's partial at ``ws_ptr + rank * plane + part``: the
    tile's last program to arrive stores the sum of the ``PARTS`` partials at ``out_ptrs``.
    Unrolled, so that the loads are in flight together (a loop would wait for each load in
    turn), and never inside a K loop (Triton software-pipelines innermost loops only)."""
    tl.debug_barrier()  # every thread's partial is written before the count goes up
    if tl.atomic_add(counts_ptr + tile, 1, sem="acq_rel", scope="gpu") == PARTS - 1:
        total = tl.load(ws_ptr + part, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, PARTS):
            total += tl.load(ws_ptr + s * plane + part, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counts_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def arrive(counts_ptr, tile):
    """Call after storing this program's partial: count it in its tile's arrivals, released (the
    partial is visible before the count), without waiting for the count."""
    tl.debug_barrier()  # every thread's partial is written before the count goes up
    tl.atomic_add(counts_ptr + tile, 1, sem="release", scope="gpu")


@triton.jit
def sum_when_arrived(ws_ptr, counts_ptr, tile, acc, part, plane, mask, out_ptrs,
                     PARTS: tl.constexpr):  # fmt: skip
    """The program of a tile's last split, whose own partial is ``acc``: wait until the other
    ``PARTS - 1`` have ``arrive``d (rank r's partial at ``ws_ptr + r * plane + part``), store the
    sum in split order (the same sum, bit for bit, as ``reduce_if_last``) and zero the count.
    Its partial never makes the round trip through memory, and it waits for one count instead of
    bumping it. Only for the program launched after the tile's others (the highest linear block
    index among them): those are then running or done, so the wait cannot deadlock."""
    while tl.atomic_add(counts_ptr + tile, 0, sem="acquire", scope="gpu") < PARTS - 1:
        pass
    total = tl.load(ws_ptr + part, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, PARTS - 1):
        total += tl.load(ws_ptr + s * plane + part, mask=mask, other=0.0, cache_modifier=".cg")
    total += acc
    tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
    tl.atomic_xchg(counts_ptr + tile, 0, sem="relaxed", scope="gpu")


CAPTURED = -1  # the stream key of the counts that CUDA graphs are captured with


class ArrivalCounts:
    """Zeroed int32 counts, one per output tile, per device and CUDA stream; one instance per
    kernel family.

    Launches on two streams (two threads' streams, the background loader's side stream beside
    the calls it serves) run at once, and a program of one would take the other's arrivals for
    its own tile's: each stream has its own counts. A CUDA graph is captured with its capture
    stream's counts where that stream ran eager calls before, else with a set of its device's
    own (``CAPTURED``), made before any capture (an allocation during one belongs to the graph's
    memory pool) at the first call outside one. Outgrown counts are kept alive, since a graph
    captured with them replays on them.
    """

    def __init__(self) -> None:
        self._held: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._outgrown: list[torch.Tensor] = []
        self._growing = ForkSafeLock()  # two threads growing at once keep both outgrown

    def get(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        """Counts for ``tiles`` tiles on the current stream (or the capture's), or None while a
        CUDA graph is being captured before they exist: the caller then reduces with a second
        launch. A stream's own counts are found without asking about a capture."""
        key = (device, _stream(device))
        counts = self._held.get(key)
        if counts is not None and counts.numel() >= tiles:
            return counts
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            captured = self._held.get((device, CAPTURED))
            return captured if captured is not None and captured.numel() >= tiles else None
        with self._growing:
            for held in (key, (device, CAPTURED)) if device.type == "cuda" else (key,):
                self._grow(held, tiles)
            return self._held[key]

    def _grow(self, key: tuple[torch.device, int], tiles: int) -> None:
        counts = self._held.get(key)
        if counts is not None and counts.numel() >= tiles:
            return
        if counts is not None:
            self._outgrown.append(counts)
        self._held[key] = torch.zeros(max(MIN_COUNTS, triton.next_power_of_2(tiles)),
                                      dtype=torch.int32, device=key[0])  # fmt: skip

    def clear(self) -> None:
        self._held.clear()

    def __contains__(self, device: torch.device) -> bool:
        """Counts were made for ``device`` (on any stream)."""
        return any(d == device for d, _ in self._held)

    def __getitem__(self, device: torch.device) -> torch.Tensor:
        """The current stream's counts on ``device``."""
        return self._held[(device, _stream(device))]


def _stream(device: torch.device) -> int:
    """The current stream's raw handle on a GPU (its operands' GPU is the current one); 0 on
    the CPU (Triton's interpreter)."""
    return current_stream() if device.type == "cuda" else 0


settle(globals())  # last: every JIT function above is defined
