"""How the stream-K ws kernel (``cutlass_w4a16`` kernel ``ws_streamk``) shares its steps out.

A step is one K tile of one cluster tile; cluster ``c`` runs the steps ``[runs[c], runs[c + 1])``.
A run that ends inside a tile writes that tile's head as a partial for the tile's owner (the
run that holds its last K tile), which adds every helper's partial before it stores the tile.
So besides the longest run, what a share-out costs is its split tiles: each partial is 64 KB
written and read back through L2, mostly at the end of the kernel when every CTA does the same.

- ``even``: runs of equal length (the longest run is shortest; a tile can be split three ways).
- ``cost``: the runs whose longest *cost* is least, where a run's cost is its steps plus what
  its split tiles and stores cost it, in steps (``Weights``): fewer split tiles, slightly longer
  runs.
- ``split``: each tile in as many equal parts as the clusters allow, no run crossing a tile
  (split-K): one store a run, and every partial written at the same time.

Which wins depends on the shape in ways no model here predicts, so the tuner times them.

The kernel reads the runs and their helpers from its workspace (``Layout.offset``), written
once per workspace (``workspace_words``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from typing import NamedTuple


class Layout(NamedTuple):
    """One problem's steps and where its share-out goes in the kernel's workspace."""

    clusters: int  # runs
    steps: int
    k_tiles: int  # steps a tile
    tiles: int
    offset: int  # bytes into the workspace of the share-out (int64s: ``workspace_words``)


class Weights(NamedTuple):
    """What a run pays, in steps, for a helper's partial (it ends inside a tile), for owning a
    split tile (it starts inside one) and for each tile it stores."""

    helper: float
    owner: float
    store: float


COST_WEIGHTS = Weights(helper=1.0, owner=2.0, store=1.0)


def even(layout: Layout) -> list[int]:
    return [c * layout.steps // layout.clusters for c in range(layout.clusters + 1)]


def by_cost(layout: Layout, weights: Weights = COST_WEIGHTS) -> list[int]:
    """The contiguous runs whose longest cost is least (to a quarter step): a binary search on
    the limit, each limit filled greedily (every run as long as the limit allows). Runs left
    over at the end are empty."""
    steps, k_tiles, clusters = layout.steps, layout.k_tiles, layout.clusters

    def cost(a: int, b: int) -> float:
        c = b - a + weights.store * (b // k_tiles - a // k_tiles)
        if a % k_tiles:
            c += weights.owner
        if b % k_tiles and b < steps:
            c += weights.helper
        return c

    def fill(limit: float) -> list[int] | None:
        runs, a = [0], 0
        for _ in range(clusters):
            b = min(steps, a + max(1, int(limit)))
            while b > a + 1 and cost(a, b) > limit:
                b -= 1
            if b > a and cost(a, b) > limit:  # not even one step fits
                return None
            runs.append(b)
            a = b
        return runs if a >= steps else None

    low = steps / clusters
    high = steps + weights.owner + weights.helper + weights.store * (layout.tiles + 1)
    best = fill(high)
    while high - low > 0.25:
        middle = (low + high) / 2
        runs = fill(middle)
        if runs is None:
            low = middle
        else:
            high, best = middle, runs
    assert best is not None  # the first limit fits every step into one run
    return best


def split(layout: Layout) -> list[int]:
    """Each tile in the same number of equal parts, as many as the clusters allow; the clusters
    left over run nothing. Even where there are more tiles than clusters."""
    if layout.tiles > layout.clusters:
        return even(layout)
    parts = layout.clusters // layout.tiles
    k_tiles = layout.k_tiles
    starts = [t * k_tiles + j * k_tiles // parts for t in range(layout.tiles) for j in range(parts)]
    return starts + [layout.steps] * (layout.clusters + 1 - len(starts))


SHARES: dict[str, Callable[[Layout], list[int]]] = {"even": even, "cost": by_cost, "split": split}
DEFAULT = "even"  # a config that names no share-out


def helpers(runs: list[int], layout: Layout) -> list[int]:
    """Per run that starts inside a tile: the runs before it that hold the tile's earlier
    steps (the partials its owner adds; the kernel reads it only where the run owns the tile,
    i.e. reaches its end); 0 for a run that starts a tile or is empty."""
    out = []
    for c, (a, b) in enumerate(itertools.pairwise(runs)):
        tile_first = a - a % layout.k_tiles
        out.append(c - (bisect.bisect_right(runs, tile_first) - 1) if b > a > tile_first else 0)
    return out


def workspace_words(runs: list[int], layout: Layout) -> list[int]:
    """What the kernel reads at ``layout.offset`` (int64s): the runs' first steps, then each
    run's helpers."""
    check(runs, layout)
    return [*runs, *helpers(runs, layout)]


def check(runs: list[int], layout: Layout) -> None:
    """ValueError unless ``runs`` covers every step once, in order, with its empty runs (if
    any) at the end: an owner counts every cluster between its first helper and itself as a
    helper, so an empty run among them would never be waited out."""
    if len(runs) != layout.clusters + 1 or runs[0] != 0 or runs[-1] != layout.steps:
        raise ValueError(
            f"a share-out must be {layout.clusters + 1} first steps from 0 to {layout.steps}, "
            f"got {len(runs)} from {runs[0] if runs else None} to {runs[-1] if runs else None}"
        )
    lengths = [b - a for a, b in itertools.pairwise(runs)]
    if any(n < 0 for n in lengths):
        raise ValueError("a share-out's first steps must not decrease")
    if 0 in lengths and any(lengths[lengths.index(0) :]):
        raise ValueError(f"a share-out's empty runs must come last, got lengths {lengths}")
