"""Config spaces of the Triton GEMM family and the per-shape shortlist.

Params (JSON, stored with a winner) per kernel:

    {"kernel": "tiled",          "bm", "bn", "bk", "group_m", "warps", "stages"}
    {"kernel": "splitk",         "bm", "bn", "bk", "group_m", "warps", "stages", "split_k"}
    {"kernel": "persistent_tma", "bm", "bn", "bk", "group_m", "warps", "stages"}
    {"kernel": "gemv",           "bm", "bn", "bk", "warps"}

plus, for any but gemv, ``"pad_k": true`` (copy A and B into K-padded aligned buffers first: odd
shapes) and, for f32 inputs without TF32, ``"precision": "tf32x3"`` (three TF32 tensor-core
products: fp32-level accuracy, checked like any candidate) instead of the default "ieee".
Params without "kernel" are the original tiled kernel's and still build.

Tiles are given for 2-byte types; 4-byte types halve BK. Pruning: shared memory (stages x the A
and B tiles, plus the C tile for TMA stores) within the per-block limit, no tile taller than the
problem (no 256-row tile for M = 16), register budget of the GEMV accumulator.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from tuner.core.keys import ITEMSIZE, GemmKey

Params = dict[str, Any]
SMEM_LIMIT = 227 * 1024  # Hopper's per-block opt-in limit (232448 bytes)
SM90_SMS = 132

# (bm, bn, bk, warps, stages) for 2-byte types.
TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 64, 128, 4, 4),
    (32, 128, 64, 4, 4),
    (32, 64, 128, 4, 4),
    (32, 256, 64, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3),
    (16, 32, 256, 4, 4),
)
# TMA + wgmma wants at least 64 rows per warpgroup.
PERSISTENT: tuple[tuple[int, int, int, int, int], ...] = (
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 128, 8, 3),
    (64, 256, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
)
SPLITK_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 64, 128, 4, 4),
    (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
)
SPLITS = (2, 4, 8, 16)
# (bn, bk, warps) of the GEMV; bm is the next power of two of M.
GEMV: tuple[tuple[int, int, int], ...] = (
    (8, 512, 4),
    (4, 1024, 4),
    (16, 256, 4),
    (8, 256, 4),
    (4, 512, 4),
    (16, 512, 8),
    (32, 256, 8),
    (8, 1024, 8),
    (2, 1024, 4),
)
GEMV_MAX_M = 8
GEMV_ACC_PER_THREAD = 64  # fp32 accumulator registers per thread


def pow2_at_least(x: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def scale_bk(key: GemmKey, bk: int) -> int:
    return max(16, bk * 2 // ITEMSIZE[key.dtype])


def smem_bytes(
    key: GemmKey, bm: int, bn: int, bk: int, stages: int, *, c_tile: bool = False
) -> int:
    """Shared memory of a pipelined tile loop (an upper bound: Triton keeps stages - 1 buffers
    for mma.sync tiles): ``stages`` copies of the A and B tiles, the C tile that a TMA store
    stages through shared memory, and 15% more for f32 without TF32 (the three-pass TF32
    product keeps split operands beside the tiles, past what the tiles alone need)."""
    item = ITEMSIZE[key.dtype]
    c = bm * bn * ITEMSIZE[key.out_dtype] if c_tile else 0
    tiles = stages * (bm * bk + bk * bn) * item + c
    return int(tiles * 1.15) if (key.dtype == "f32" and key.compute == "f32") else tiles


def tma_ok(key: GemmKey) -> str | None:
    """Why TMA descriptors cannot describe this key's operands, or None."""
    if key.align != 16:
        return f"TMA needs 16-byte aligned rows; this key's alignment class is {key.align} bytes"
    if key.batch != 1:
        return "the persistent TMA kernel is written for batch 1"
    return None


def c_tma_ok(key: GemmKey) -> bool:
    return (key.n * ITEMSIZE[key.out_dtype]) % 16 == 0


def clamp(key: GemmKey, bn: int, bk: int) -> tuple[int, int]:
    """Narrow and shallow problems get narrower/shallower tiles rather than none."""
    return min(bn, pow2_at_least(key.n)), min(bk, pow2_at_least(key.k))


def fits(key: GemmKey, bm: int, bn: int, bk: int) -> bool:
    """No tile taller/wider/deeper than the problem rounded up to a power of two (>= 16)."""
    return bm <= pow2_at_least(key.m) and bn <= pow2_at_least(key.n) and bk <= pow2_at_least(key.k)


def precisions(key: GemmKey) -> list[str | None]:
    """The precision params to try: None means the default of the key. For f32 without TF32,
    Triton's exact-fp32 tl.dot runs on the CUDA cores (slower than cuBLAS's SGEMM, and slow to
    compile per config), so only the three-pass TF32 product is offered: fp32-level accuracy
    (the engine's f32 tolerance, 1e-4, checks it) at tensor-core speed."""
    if key.dtype == "f32" and key.compute == "f32":
        return ["tf32x3"]
    return [None]


def with_precision(p: Params, precision: str | None) -> Params:
    return p if precision is None else {**p, "precision": precision}


def needs_pad(key: GemmKey) -> bool:
    """Rows of A or B are not 16-byte aligned: pointer loads cannot be vectorised, TMA is out."""
    return key.align < 16


def tiled_space(key: GemmKey) -> list[Params]:
    out = []
    for bm, bn, bk, warps, stages in TILES:
        bn, bk = clamp(key, bn, scale_bk(key, bk))
        if not fits(key, bm, bn, bk) or smem_bytes(key, bm, bn, bk, stages) > SMEM_LIMIT:
            continue
        out.append({"kernel": "tiled", "bm": bm, "bn": bn, "bk": bk, "group_m": 8,
                    "warps": warps, "stages": stages})  # fmt: skip
    return out


def persistent_space(key: GemmKey) -> list[Params]:
    if tma_ok(key) is not None:
        return []
    out = []
    for bm, bn, bk, warps, stages in PERSISTENT:
        bn, bk = clamp(key, bn, scale_bk(key, bk))
        if not fits(key, bm, bn, bk):
            continue
        if smem_bytes(key, bm, bn, bk, stages, c_tile=c_tma_ok(key)) > SMEM_LIMIT:
            continue
        out.append({"kernel": "persistent_tma", "bm": bm, "bn": bn, "bk": bk, "group_m": 8,
                    "warps": warps, "stages": stages})  # fmt: skip
    return out


def splitk_space(key: GemmKey, sms: int) -> list[Params]:
    """Split-K only where the output tiles alone leave SMs idle and K is long enough to share."""
    out = []
    for bm, bn, bk, warps, stages in SPLITK_TILES:
        bn, bk = clamp(key, bn, scale_bk(key, bk))
        if not fits(key, bm, bn, bk):
            continue
        tiles = math.ceil(key.m / bm) * math.ceil(key.n / bn) * key.batch
        if tiles >= sms:
            continue
        k_tiles = math.ceil(key.k / bk)
        for split in SPLITS:
            if k_tiles < 4 * split or tiles * split > 8 * sms:
                continue
            out.append({"kernel": "splitk", "bm": bm, "bn": bn, "bk": bk, "group_m": 8,
                        "warps": warps, "stages": stages, "split_k": split})  # fmt: skip
    return out


def gemv_space(key: GemmKey) -> list[Params]:
    if key.m > GEMV_MAX_M:
        return []
    bm = pow2_at_least(key.m, floor=1)
    out = []
    for bn, bk, warps in GEMV:
        if bm * bn * bk > GEMV_ACC_PER_THREAD * 32 * warps or bk > pow2_at_least(key.k):
            continue
        out.append({"kernel": "gemv", "bm": bm, "bn": bn, "bk": bk, "warps": warps})
    return out


def padded_key(key: GemmKey, multiple: int = 64) -> GemmKey:
    """The key the kernels see after ``pad_k``: A (M, KP) row-major, B (N, KP) row-major (nt)."""
    kp = math.ceil(key.k / multiple) * multiple
    return dataclasses.replace(key, k=kp, layout="nt", align=16)


def space(key: GemmKey, sms: int = SM90_SMS) -> list[Params]:
    """Every valid config for ``key`` (what an exhaustive sweep would time)."""
    base = gemv_space(key) + tiled_space(key) + splitk_space(key, sms) + persistent_space(key)
    if needs_pad(key):  # odd shapes: the tensor-core kernels also on K-padded aligned copies
        pk = padded_key(key)
        padded = tiled_space(pk) + splitk_space(pk, sms) + persistent_space(pk)
        base += [{**p, "pad_k": True} for p in padded]
    unique = {json.dumps(p, sort_keys=True): p for p in base}  # clamping can make duplicates
    return [with_precision(p, prec) for prec in precisions(key) for p in unique.values()]


# Rough Hopper figures for the ordering model below (not measurements of this project).
TC_TFLOPS = {"bf16": 700.0, "f16": 700.0, "f32": 350.0}  # tensor-core rate reached by good tiles
BW_GBS = 3000.0  # DRAM bandwidth a full grid of streaming programs reaches
LAUNCH_US = 3.0


def _tile_eff(kind: str, bm: int, bn: int) -> float:
    """Fraction of the tensor-core rate a tile shape reaches: wgmma needs 64+ rows per warpgroup
    (smaller tiles fall back to mma.sync), and big tiles amortise their loads."""
    eff = (0.35 if bm == 16 else 0.45) if bm < 64 else min(1.0, bm * bn / (128 * 256)) ** 0.25
    return eff * (1.0 if kind == "persistent_tma" else 0.85)


def estimate(key: GemmKey, p: Params, sms: int = SM90_SMS) -> float:
    """A rough time in microseconds, used only to order and trim the shortlist: the larger of
    the tensor-core time (padded tiles, wave quantisation) and the DRAM time (unique bytes over
    the bandwidth the grid's programs can pull), plus the extra launches and copies."""
    kind = p.get("kernel", "tiled")
    bm, bn = p["bm"], p["bn"]
    item, split = ITEMSIZE[key.dtype], p.get("split_k", 1)
    grid_m, grid_n = math.ceil(key.m / bm), math.ceil(key.n / bn)
    programs = (grid_n if kind == "gemv" else grid_m * grid_n * split) * key.batch
    if kind == "gemv":
        compute = 2.0 * key.m * key.n * key.k * key.batch / 30e12 * 1e6
    else:
        rate = TC_TFLOPS[key.dtype] * 1e12 * _tile_eff(kind, bm, bn)
        if p.get("precision") == "tf32x3":
            rate /= 3
        if needs_pad(key) and not p.get("pad_k"):
            rate *= 0.3  # unaligned rows: scalar loads, no cp.async pipelining
        per_program = 2.0 * bm * bn * math.ceil(key.k / split) / (rate / sms)
        waves = programs / sms if kind == "persistent_tma" else math.ceil(programs / sms)
        compute = max(waves, 1.0) * per_program * 1e6
    out_item = ITEMSIZE[key.out_dtype]
    unique = (key.m * key.k + key.k * key.n) * item * key.batch + key.m * key.n * out_item
    extra = 2 * split * key.m * key.n * 4 if split > 1 else 0
    pull = min(1.0, programs / sms)
    memory = (unique + extra) / (BW_GBS * 1e9 * pull) * 1e6
    launches = 1 + (split > 1) + 2 * bool(p.get("pad_k"))
    pad = 2 * (key.m + key.n) * key.k * item / (BW_GBS * 1e9) * 1e6 if p.get("pad_k") else 0.0
    return max(compute, memory) + pad + LAUNCH_US * launches


def shortlist(key: GemmKey, sms: int = SM90_SMS, limit: int = 20) -> list[Params]:
    """The configs worth timing for ``key``, best guess first, at most ``limit``: the ranking of
    ``estimate``, with no kernel kind taking more than a third of the slots until every kind
    has had its turn (the model is rough; the timing decides)."""
    ranked = sorted(space(key, sms), key=lambda p: estimate(key, p, sms))
    cap = max(3, limit // 3)
    picked: list[Params] = []
    rest: list[Params] = []
    per_kind: dict[str, int] = {}
    for p in ranked:
        kind = p["kernel"] + ("+pad" if p.get("pad_k") else "")
        if per_kind.get(kind, 0) < cap:
            picked.append(p)
            per_kind[kind] = per_kind.get(kind, 0) + 1
        else:
            rest.append(p)
    picked = picked[:limit]
    picked += rest[: limit - len(picked)]
    return sorted(picked, key=lambda p: estimate(key, p, sms))
