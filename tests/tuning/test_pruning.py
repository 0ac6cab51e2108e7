"""Pruning rules: which candidates go before compiling, and why (tuner.tuning.pruning)."""

from __future__ import annotations

from tuner.core.keys import GemmKey, SdpaKey, lowbit_fields
from tuner.tuning.pruning import Roof, floor_us, prune

DECODE = GemmKey(m=1, n=4096, k=4096, dtype="f32", out_dtype="f32", compute="tf32")
SQUARE = GemmKey(m=4096, n=4096, k=4096, dtype="bf16")
H100ISH = Roof(bandwidth=3.0e12, peak=7.0e14)


def tiled(bm: int, bn: int) -> dict:
    return {"kernel": "tiled", "bm": bm, "bn": bn, "bk": 64}


def test_a_wide_tile_on_m1_goes_and_the_smallest_stays():
    shortlist = [tiled(16, 64), tiled(64, 64), tiled(128, 256), {"tile": [128, 256, 64]}]
    kept, pruned = prune(DECODE, shortlist)
    assert kept == [tiled(16, 64), tiled(64, 64)]  # 64 rows: exactly 4x the smallest, kept
    assert [p.params for p in pruned] == [tiled(128, 256), {"tile": [128, 256, 64]}]
    assert all(p.rule == "tile" for p in pruned)
    assert "tile 128x256 uses 0.8% of its work on 1x4096" in pruned[0].reason


def test_every_tile_stays_where_none_wastes_the_shape():
    shortlist = [tiled(128, 256), tiled(64, 64), {"tile": [256, 128, 64]}, {"kernel": "gemv"}]
    assert prune(SQUARE, shortlist) == (shortlist, [])


def test_a_config_without_a_tile_is_never_pruned_by_tile():
    shortlist = [{"kernel": "gemv", "bm": 1, "bn": 128}, tiled(128, 128)]
    assert prune(DECODE, shortlist) == (shortlist, [])  # its one tile is the least wasteful


def test_roofline_prunes_what_cannot_beat_a_baseline_at_the_floor():
    floor = floor_us(DECODE, H100ISH, None)
    shortlist = [{"kernel": "gemv", "bm": 1, "bn": 128}, tiled(16, 64)]
    # the baseline runs 1% above the floor: no candidate can win by a 2% margin
    kept, pruned = prune(DECODE, shortlist, roof=H100ISH, baseline_us=floor * 1.01, margin=0.02)
    assert kept == [] and {p.rule for p in pruned} == {"roofline"}
    assert "is not 2% below the baseline's" in pruned[0].reason
    # twice the floor: room to win, all kept
    kept, pruned = prune(DECODE, shortlist, roof=H100ISH, baseline_us=floor * 2, margin=0.02)
    assert kept == shortlist and pruned == []


def test_padding_raises_the_floor_of_a_compute_bound_tile():
    key = GemmKey(m=260, n=4096, k=8192, dtype="bf16")  # 384 rows in 128-row tiles, 512 in 256
    ratio = floor_us(key, H100ISH, (256, 128)) / floor_us(key, H100ISH, (128, 128))
    assert abs(ratio - 512 / 384) < 1e-9
    baseline = floor_us(key, H100ISH, (128, 128)) * 1.2
    kept, pruned = prune(
        key, [tiled(128, 128), tiled(256, 128)], roof=H100ISH, baseline_us=baseline, margin=0.02
    )
    assert kept == [tiled(128, 128)] and [p.rule for p in pruned] == ["roofline"]


def test_a_baseline_below_its_own_floor_switches_the_roofline_off():
    """Rates measured too low (a busy device) must not prune what could win."""
    slow = Roof(bandwidth=1e9, peak=1e9)
    kept, pruned = prune(DECODE, [tiled(16, 64)], roof=slow, baseline_us=30.0, margin=0.02)
    assert kept == [tiled(16, 64)] and pruned == []


def test_attention_and_low_bit_keys_keep_everything():
    attn = SdpaKey(batch=1, q_heads=8, kv_heads=8, q_len=1, kv_len=128, head_dim=64)
    lowbit = GemmKey(m=1, n=4096, k=4096, **lowbit_fields("int4-g128"))
    for key in (attn, lowbit):
        shortlist = [tiled(128, 256), tiled(16, 16)]
        assert prune(key, shortlist, roof=H100ISH, baseline_us=1e-3) == (shortlist, [])
