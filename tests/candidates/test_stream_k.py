"""Stream-K bookkeeping (``triton_kernels.stream_k``): runs of (tile, step) units per program."""

from __future__ import annotations

import pytest

from tuner.candidates.triton_kernels import stream_k

CASES = [(2, 6, 5), (224, 16, 264), (28, 74, 264), (3, 4, 12), (7, 3, 2), (3, 3, 4), (64, 56, 264)]


def runs(units: int, programs: int) -> list[range]:
    return [range(p * units // programs, (p + 1) * units // programs) for p in range(programs)]


@pytest.mark.parametrize(("tiles", "steps", "programs"), CASES)
def test_runs_cover_every_unit_once_and_owner_names_each_units_program(
    tiles: int, steps: int, programs: int
) -> None:
    units = tiles * steps
    cut = runs(units, programs)
    assert all(cut) and [u for r in cut for u in r] == list(range(units))
    assert all(stream_k.owner(u, units, programs) == p for p, r in enumerate(cut) for u in r)


@pytest.mark.parametrize(("tiles", "steps", "programs"), CASES)
def test_most_parts_is_the_most_runs_that_meet_in_one_tile(
    tiles: int, steps: int, programs: int
) -> None:
    cut = runs(tiles * steps, programs)
    meeting = max(sum(1 for r in cut if set(r) & set(range(t * steps, (t + 1) * steps)))
                  for t in range(tiles))  # fmt: skip
    assert stream_k.most_parts(tiles, steps, programs) == meeting
