"""bench/w4a16_sass.py: the K loop found in a listing and its opcodes counted (CPU), and the
kernel's libraries counted where nvcc and cuobjdump are installed."""

from __future__ import annotations

import shutil

import pytest

from tests.bench_scripts import load_script

sass = load_script("w4a16_sass")

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x0 */
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;                    /* 0x0 */
        /*0020*/              @!P0 BRA 0x10 ;                                 /* 0x0 */
        /*0030*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64], !P1 ;  /* 0x0 */
        /*0040*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;     /* 0x0 */
        /*0050*/              @!P2 LDGSTS.E [R5+0x800], desc[UR4][R6.64] ;   /* 0x0 */
        /*0060*/                   LOP3.LUT R9, R10, 0xf000f, R11, 0xea, !PT ; /* 0x0 */
        /*0070*/               @P3 BRA 0x30 ;                                 /* 0x0 */
        /*0080*/                   EXIT ;                                     /* 0x0 */
"""


AROUND_IT = """
        /*0090*/             @!UP0 BRA 0x0 ;                                  /* 0x0 */
"""
WAITING_LOOP = """
        /*00a0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3 ;  /* 0x0 */
        /*00b0*/                   HMMA.16816.F32.BF16 R8, R12, R16, R8 ;     /* 0x0 */
        /*00c0*/               @P1 BRA 0xa0 ;                                 /* 0x0 */
"""


def test_the_k_loop_is_the_innermost_loop_that_copies_and_multiplies() -> None:
    for listing in (LISTING, LISTING + AROUND_IT):  # a loop around the K loop holds it whole
        body = sass.k_loop(listing)
        assert [sass.opcode(t) for t in body] == ["LDGSTS", "HMMA", "LDGSTS", "LOP3", "BRA"]
    # where another warp fills the stages, the K loop waits on their barrier instead of copying
    assert [sass.opcode(t) for t in sass.k_loop(WAITING_LOOP)] == ["SYNCS", "HMMA", "BRA"]


@pytest.mark.parametrize(
    ("text", "op"),
    [
        ("LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64], !P1", "LDGSTS"),
        ("@!P0 BRA 0x10", "BRA"),
        ("@P3 LOP3.LUT R9, R10, 0xf000f, R11, 0xea, !PT", "LOP3"),
        ("@!UP0 UBLKCP.S.G [UR8], [UR4], UR10", "UBLKCP"),
        ("@PT LDS RZ, [RZ]", "LDS"),
    ],
)
def test_an_opcode_is_read_past_its_predicate_and_modifiers(text: str, op: str) -> None:
    assert sass.opcode(text) == op


def test_a_listing_without_a_k_loop_is_refused() -> None:
    with pytest.raises(ValueError, match="no loop with HMMA and LDGSTS or SYNCS"):
        sass.k_loop(LISTING.replace("HMMA", "FFMA"))


CUOBJDUMP = shutil.which(sass.default_cuobjdump())


@pytest.mark.skipif(
    shutil.which("nvcc") is None or CUOBJDUMP is None, reason="needs nvcc and cuobjdump"
)
def test_wider_warps_spend_fewer_instructions_a_weight_byte() -> None:
    """64-row warps share x's fragments over four slices: fewer instructions a weight KB than
    32-row warps, and two n8 tiles cost more than one."""
    narrow, wide = (
        sass.count(config, [], CUOBJDUMP, groups=1) for config in (("k", 2, 4), ("k", 4, 2))
    )
    assert [r["tiles"] for r in narrow] == [1, 2]
    assert wide[0]["per_weight_kb"] < narrow[0]["per_weight_kb"]
    assert narrow[1]["instructions"] > narrow[0]["instructions"]
    assert all(r["opcodes"]["HMMA"] > 0 and 0 < r["registers"] <= 255 for r in narrow + wide)
