"""Which candidates are worth compiling: those whose shape, tile or predicted time can still win.

Compiling is most of a cold tuning run, so a candidate that cannot beat the baseline is dropped
before it is compiled, with its reason:

- **tile**: a tile that covers more than ``WASTE_LIMIT`` times the output area that the
  least-wasteful tile of the same source covers (a 128x256 tile on M=1 computes 128 rows for one);
  it loses to that source's own smaller tile, so at least one tile of each source stays;
- **roofline** (on the GPU): the candidate's floor (the shape's bytes over this device's measured copy
  bandwidth, or the FLOPs of its padded tiles over the measured matmul peak, whichever is larger,
  both with ``HEADROOM`` to spare) is not below the baseline's measured time by the margin a
  challenger must win by.

Only GEMM keys are pruned: attention and low-bit formats have no floor here and keep every
candidate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from tuner.candidates.base import Params, Source
from tuner.core.keys import GemmKey, Key
from tuner.measure.records import Measurement

WASTE_LIMIT = 4.0  # padded output area over the smallest padded area of the same source
HEADROOM = 1.25  # a kernel may beat the measured copy/matmul rates by this factor


@dataclass(frozen=True)
class Roof:
    """This device's measured rates: bytes per second copied and FLOPs per second multiplied."""

    bandwidth: float
    peak: float


RULES = ("tile", "roofline")
PRUNED = "pruned"  # how a pruned candidate's measurement (status ``cut``) starts its error


@dataclass(frozen=True)
class Pruned:
    params: Params
    rule: str  # one of RULES
    reason: str


def describe(p: Pruned) -> str:
    return f"{PRUNED} ({p.rule}): {p.reason}"


def count(measurements: Iterable[Measurement]) -> dict[str, int]:
    """Pruned candidates among ``measurements``, by rule."""
    out: dict[str, int] = {}
    for m in measurements:
        for rule in RULES:
            if m.status == "cut" and m.error.startswith(f"{PRUNED} ({rule})"):
                out[rule] = out.get(rule, 0) + 1
    return out


def tile_of(params: Params) -> tuple[int, int] | None:
    """The (rows, cols) of the output tile a config computes per program, when it names one: a
    ``tile`` list (CUTLASS) or ``bm``/``bn`` of a tiled kernel (Triton; its GEMV has none)."""
    tile = params.get("tile")
    if isinstance(tile, list | tuple) and len(tile) >= 2:
        return int(tile[0]), int(tile[1])
    if "bm" in params and "bn" in params and params.get("kernel", "tiled") != "gemv":
        return int(params["bm"]), int(params["bn"])
    return None


def padded_area(key: GemmKey, tile: tuple[int, int]) -> int:
    tm, tn = tile
    return math.ceil(key.m / tm) * tm * math.ceil(key.n / tn) * tn


def floor_us(key: GemmKey, roof: Roof, tile: tuple[int, int] | None) -> float:
    """The least time the shape can take on this device with that tile (None: no padding)."""
    area = key.m * key.n if tile is None else padded_area(key, tile)
    flops = 2.0 * key.batch * area * key.k
    return max(key.min_bytes / roof.bandwidth, flops / roof.peak) / HEADROOM * 1e6


def prunable(key: Key) -> bool:
    return isinstance(key, GemmKey) and not key.lowbit


def prune(
    key: Key,
    shortlist: list[Params],
    *,
    roof: Roof | None = None,
    baseline_us: float | None = None,
    margin: float = 0.0,
) -> tuple[list[Params], list[Pruned]]:
    """Split one source's ``shortlist`` into (kept, pruned with reasons), in shortlist order.

    The roofline rule needs both ``roof`` and the baseline's measured time; a challenger must
    beat that by ``margin`` (a share) to win. It is not applied where the baseline ran below
    its own unpadded floor: there the rates measured are no bound."""
    if not prunable(key):
        return list(shortlist), []
    assert isinstance(key, GemmKey)
    if roof is not None and baseline_us is not None and floor_us(key, roof, None) > baseline_us:
        roof = None  # the baseline beat its own floor: the measured rates are no bound here
    tiles = [tile_of(p) for p in shortlist]
    areas = [padded_area(key, t) for t in tiles if t is not None]
    least = min(areas, default=0)
    kept: list[Params] = []
    pruned: list[Pruned] = []
    for params, tile in zip(shortlist, tiles, strict=True):
        if tile is not None and padded_area(key, tile) > WASTE_LIMIT * least:
            share = key.m * key.n / padded_area(key, tile)
            reason = (
                f"tile {tile[0]}x{tile[1]} uses {share:.1%} of its work on {key.m}x{key.n}: more "
                f"than {WASTE_LIMIT:g}x the output area of this source's smallest tile"
            )
            pruned.append(Pruned(params, "tile", reason))
            continue
        if roof is not None and baseline_us is not None:
            floor = floor_us(key, roof, tile)
            if floor >= baseline_us * (1 - margin):
                reason = (
                    f"roofline floor {floor:.2f} us is not {margin:.0%} below the baseline's "
                    f"{baseline_us:.2f} us"
                )
                pruned.append(Pruned(params, "roofline", reason))
                continue
        kept.append(params)
    return kept, pruned


def prune_challengers(
    key: Key,
    source: Source,
    shortlist: list[Params],
    *,
    enabled: bool = True,
    roof: Roof | None = None,
    baseline_us: float | None = None,
    margin: float = 0.0,
) -> tuple[list[Params], list[Pruned]]:
    """``source``'s challengers in ``shortlist`` (its baseline left out: it is never pruned),
    split by ``prune`` into (kept, pruned); with ``enabled`` off every challenger is kept."""
    challengers = [p for p in shortlist if not source.is_baseline(p)]
    if not enabled:
        return challengers, []
    return prune(key, challengers, roof=roof, baseline_us=baseline_us, margin=margin)


# --- this device's rates -------------------------------------------------------------------


@functools.cache
def measured_roof(device: str, dtype: str, compute: str) -> Roof:
    """Copy bandwidth and matmul peak of ``device`` for one dtype, measured once per process
    with torch (large enough to be near the device's rates, small enough to take milliseconds).
    """
    import torch

    from tuner.candidates.torch_ref import tf32_mode
    from tuner.core.keys import DTYPES
    from tuner.measure import timing

    big = device == "cuda"
    bandwidth = timing.copy_bandwidth_gbs(device, 256 << 20) * 1e9
    side = 4096 if big else 256
    dt = DTYPES[dtype]
    a = torch.randn(side, side, device=device).to(dt)
    b = torch.randn(side, side, device=device).to(dt)
    with tf32_mode(compute == "tf32"):
        t = timing.measure(lambda _i: a @ b, device=device, budget_s=0.05, max_reps=20)
    peak = 2 * side**3 / (t.median_us * 1e-6)
    return Roof(bandwidth, peak)
