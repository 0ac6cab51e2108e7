"""How the stream-K ws kernel's steps are shared out (tuner.candidates.stream_k_share): every
share-out covers each step once, in order, and the cost model trades split tiles for length."""

from __future__ import annotations

import itertools

import pytest

from tuner.candidates import stream_k_share as share
from tuner.candidates.stream_k_share import Layout

# (clusters, steps, k_tiles, tiles) of M = 256 projections on 132 SMs: Qwen qkv at 2 x 1,
# Llama o at 1 x 1, Llama down at 2 x 1; as many clusters as steps (the kernel's most)
LAYOUTS = [
    Layout(66, 36 * 56, 56, 36, 0),
    Layout(132, 64 * 64, 64, 64, 0),
    Layout(66, 32 * 224, 224, 32, 0),
    Layout(6, 6, 3, 2, 0),
    Layout(4, 6 * 3, 3, 6, 0),  # more tiles than clusters
]


def lengths(runs: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(runs)]


def split_tiles(runs: list[int], layout: Layout) -> int:
    """Runs that end inside a tile: the partials written."""
    return sum(1 for b in runs[1:-1] if b % layout.k_tiles and b < layout.steps)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(share.SHARES))
def test_every_share_out_covers_each_step_once_in_order(name: str, layout: Layout) -> None:
    runs = share.SHARES[name](layout)
    share.check(runs, layout)
    assert sum(lengths(runs)) == layout.steps


@pytest.mark.parametrize("layout", LAYOUTS)
def test_even_runs_differ_by_at_most_a_step(layout: Layout) -> None:
    runs = lengths(share.even(layout))
    assert max(runs) - min(runs) <= 1


def test_the_cost_model_splits_each_tile_once_where_two_runs_a_tile_fit() -> None:
    """Llama o at 1 x 1: 64 tiles of 64 steps on 132 clusters. Even runs (31-32 steps) split
    most tiles three ways; the cost model gives each tile two runs and leaves 4 clusters idle."""
    layout = LAYOUTS[1]
    runs = share.by_cost(layout)
    assert split_tiles(runs, layout) == 64 < split_tiles(share.even(layout), layout)
    assert all(a % layout.k_tiles == 0 for a in runs[::2])  # every other run starts a tile
    assert lengths(runs)[-4:] == [0, 0, 0, 0]


def test_weights_of_nothing_give_the_shortest_longest_run() -> None:
    layout = LAYOUTS[0]
    free = share.by_cost(layout, share.Weights(0, 0, 0))
    assert max(lengths(free)) == max(lengths(share.even(layout)))


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ([0, 3, 6], r"must be 7 first steps from 0 to 6, got 3 from 0 to 6"),
        ([0, 1, 2, 3, 4, 6, 5], r"from 0 to 6, got 7 from 0 to 5"),
        ([0, 2, 1, 3, 4, 5, 6], "must not decrease"),
        ([0, 1, 1, 3, 4, 5, 6], r"empty runs must come last, got lengths \[1, 0, 2"),
    ],
)
def test_a_share_out_the_kernel_cannot_run_is_refused_with_the_reason(
    runs: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        share.check(runs, LAYOUTS[3])


def test_empty_runs_at_the_end_are_allowed() -> None:
    share.check([0, 2, 4, 6, 6, 6, 6], LAYOUTS[3])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(share.SHARES))
def test_each_owner_is_told_how_many_runs_hold_its_tiles_head(name: str, layout: Layout) -> None:
    """The owner of a split tile (the run with its last step) waits for, and adds, one partial
    from every other run that holds a step of it: counted here step by step."""
    runs = share.SHARES[name](layout)
    told = share.helpers(runs, layout)
    run_of = [c for c, (a, b) in enumerate(itertools.pairwise(runs)) for _ in range(a, b)]
    for c, (a, b) in enumerate(itertools.pairwise(runs)):
        tile = a // layout.k_tiles
        owns = b > a and a % layout.k_tiles and b >= (tile + 1) * layout.k_tiles
        if owns:
            holders = {run_of[s] for s in range(tile * layout.k_tiles, a)}
            assert told[c] == len(holders) > 0
        elif a % layout.k_tiles == 0 or a == b:
            assert told[c] == 0
    words = share.workspace_words(runs, layout)
    assert words == [*runs, *told] and len(words) == 2 * layout.clusters + 1


def test_words_of_a_share_out_the_kernel_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="must not decrease"):
        share.workspace_words([0, 2, 1, 3, 4, 5, 6], LAYOUTS[3])


def test_split_gives_each_tile_equal_parts_and_no_run_crosses_a_tile() -> None:
    layout = LAYOUTS[2]  # Llama down at 2 x 1: 32 tiles of 224 steps on 66 clusters
    runs = share.split(layout)
    assert lengths(runs) == [112] * 64 + [0, 0]
    assert share.helpers(runs, layout) == [0, 1] * 32 + [0, 0]
    assert share.split(LAYOUTS[4]) == share.even(LAYOUTS[4])  # no tile to give a cluster whole


def test_the_cost_model_keeps_the_best_limit_it_found() -> None:
    """Seven tiles of two steps on 14 clusters: a run of one step costs an owner or helper its
    weight on top, so seven whole tiles (cost 3: two steps and a store) beat 14 halves."""
    layout = Layout(14, 14, 2, 7, 0)
    assert lengths(share.by_cost(layout)) == [2] * 7 + [0] * 7
