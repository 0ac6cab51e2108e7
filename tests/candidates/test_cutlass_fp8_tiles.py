"""FP8 CUTLASS tiles the generator does not list (128x192 CTAs), on a machine without
cutlass_cppgen: which tiles may be derived, from which listed kernel, and that only FP8 specs
are. The listed kernels are stand-ins here (cutlass_cppgen needs a GPU to import); the GPU tests
build and run the derived kernels (test_fp8_libs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from tuner.candidates import cutlass_env, cutlass_fp8
from tuner.core.keys import GemmKey, lowbit_fields

COOP = "TmaWarpSpecializedCooperative"
ROWWISE = GemmKey(m=2048, n=4608, k=3584, **lowbit_fields("fp8-rowwise"))


@dataclass
class ListedTile:
    """What ``derived`` uses of a listed cutlass_cppgen TileDescription: ``clone_and_update``."""

    name: str
    updates: list[dict[str, Any]] = field(default_factory=list)

    def clone_and_update(self, td: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.updates.append(td)
        return self.name, td


def listing() -> dict[tuple[Any, ...], ListedTile]:
    """A listing as ``_tile_descriptions`` indexes it: (tile, cluster, kernel, scheduler,
    epilogue) -> td, with the FP8 generator's 128- and 256-wide CTAs."""
    return {
        ((128, 256, 128), (1, 2), COOP, "Default", "tma"): ListedTile("128x256 1x2"),
        ((256, 128, 128), (2, 1), COOP, "Default", "tma"): ListedTile("256x128 2x1"),
        ((128, 256, 128), (2, 1), COOP, "StreamK", "tma"): ListedTile("128x256 2x1 streamk"),
    }


def spec_of(tile: tuple[int, int], cluster: tuple[int, int], scheduler: str = "default"):
    return cutlass_fp8.kernel_spec(ROWWISE, cutlass_fp8._p(*tile, cluster, scheduler))


@pytest.mark.parametrize(
    ("tile", "cluster", "allowed"),
    [
        ((128, 384, 128), (1, 2), True),  # 128x192 CTAs
        ((256, 192, 128), (2, 1), True),  # 128x192 CTAs
        ((256, 192, 128), (1, 2), True),  # 256x96 CTAs
        ((128, 576, 128), (1, 2), False),  # 288 columns: wider than any wgmma
        ((128, 336, 128), (1, 2), False),  # 168 columns: not whole epilogue subtiles
        ((256, 193, 128), (2, 1), False),
        ((128, 192, 128), (1, 4), False),  # 48 columns
        ((256, 192, 128), (3, 1), False),  # no whole CTAs
    ],
)
def test_derivable_tiles_are_whole_ctas_of_whole_epilogue_subtiles(tile, cluster, allowed):
    assert cutlass_env.derivable(tile, cluster) is allowed


def test_a_derived_tile_clones_the_listed_kernel_of_its_cluster_and_schedules():
    listed = listing()
    name, updates = cutlass_env.derived(spec_of((128, 384), (1, 2)), listed.items())
    assert (name, updates) == ("128x256 1x2", {"threadblock_shape": [128, 384, 128]})
    name, _ = cutlass_env.derived(spec_of((256, 192), (2, 1)), listed.items())
    assert name == "256x128 2x1"
    name, _ = cutlass_env.derived(spec_of((256, 192), (2, 1), "streamk"), listed.items())
    assert name == "128x256 2x1 streamk"


def test_no_tile_is_derived_without_a_listed_kernel_of_the_same_kind():
    listed = listing()
    assert cutlass_env.derived(spec_of((128, 384), (1, 2), "streamk"), listed.items()) is None
    other_k = replace(spec_of((128, 384), (1, 2)), tile=(128, 384, 64))
    assert cutlass_env.derived(other_k, listed.items()) is None
    fast = cutlass_fp8.kernel_spec(
        GemmKey(m=2048, n=4608, k=3584, **lowbit_fields("fp8-rowwise-fast")),
        cutlass_fp8._p(128, 384, (1, 2)),
    )
    assert cutlass_env.derived(fast, listed.items()) is None  # the FP8FastAccum schedule
    assert cutlass_env.derived(spec_of((128, 576), (1, 2)), listed.items()) is None
    assert all(not td.updates for td in listed.values())


def test_tile_description_derives_for_fp8_specs_only(monkeypatch):
    """A listed tile is returned as listed; an unlisted one is derived for FP8 and missing
    (LookupError, so ``offers`` marks it absent) for every other dtype."""
    listed = listing()
    monkeypatch.setattr(cutlass_env, "_tile_descriptions", lambda *_plan: listed)
    monkeypatch.setattr(cutlass_env, "version", lambda: "4.2.0.0")
    spec = spec_of((128, 256), (1, 2))
    assert (
        cutlass_env.tile_description(spec)
        is listed[(spec.tile, spec.cluster, spec.kernel, spec.scheduler, spec.epilogue)]
    )
    assert cutlass_env.tile_description(spec_of((128, 384), (1, 2)))[0] == "128x256 1x2"
    plain = replace(spec_of((128, 384), (1, 2)), dtype="bf16", out_dtype="", scale="")
    with pytest.raises(LookupError, match="offers no SM90 kernel"):
        cutlass_env.tile_description(plain)
    with pytest.raises(LookupError, match="offers no SM90 kernel"):
        cutlass_env.tile_description(spec_of((128, 576), (1, 2)))


def test_the_prefill_shortlist_takes_128x192_ctas_and_no_fast_stream_k():
    specs = [cutlass_fp8.kernel_spec(ROWWISE, p) for p in cutlass_fp8.shortlist(ROWWISE)]
    ctas = {(s.tile[0] // s.cluster[0], s.tile[1] // s.cluster[1]) for s in specs}
    assert {(128, 192), (128, 128)} <= ctas
    assert all(cutlass_env.derivable(s.tile, s.cluster) for s in specs)
    assert "StreamK" in {s.scheduler for s in specs}
    fast = GemmKey(m=2048, n=4608, k=3584, **lowbit_fields("fp8-rowwise-fast"))
    fast_specs = [cutlass_fp8.kernel_spec(fast, p) for p in cutlass_fp8.shortlist(fast)]
    assert fast_specs and all(s.scheduler == "Default" for s in fast_specs)
    assert all(s.kernel.endswith(cutlass_fp8.FAST_ACCUM) for s in fast_specs)
