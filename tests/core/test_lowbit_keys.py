"""Low-bit GEMM keys: plain keys read and print as before, low-bit keys round-trip through their
strings and format names, and every impossible combination names its field."""

import math
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from tuner.core.keys import GemmKey, key_from_dict, lowbit_fields, lowbit_spec, parse_key

COMPAT = Path(__file__).parents[1] / "data" / "compat" / "cache-v2.db"
OLD_KEYS = [
    "gemm:m=128,n=4096,k=4096,batch=1,layout=nn,dtype=bf16,out_dtype=bf16,compute=f32,align=16",
    "gemm:m=64,n=48,k=32,batch=3,layout=nt,dtype=f32,out_dtype=f32,compute=tf32,align=4",
    "gemm:m=5,n=3,k=7,batch=1,layout=tn,dtype=f16,out_dtype=f16,compute=f32,align=2",
    "sdpa:batch=2,q_heads=32,kv_heads=8,q_len=1,kv_len=4096,head_dim=128,head_dim_v=128,"
    "causal=bottom_right,dtype=bf16,scale=0.08838834764831845",
]
SPECS = [
    "int4-g32",
    "int4-g64",
    "int4-g128",
    "int4-g256",
    "fp8-tensorwise",
    "fp8-rowwise",
    "fp8-tensorwise-fast",
    "fp8-rowwise-fast",
]


def release_keys() -> list[str]:
    conn = sqlite3.connect(COMPAT)
    try:
        rows = conn.execute(
            "select key from measurements union select key from winners union select key from misses"
        ).fetchall()
    finally:
        conn.close()
    return [r[0] for r in rows]


@pytest.mark.parametrize("text", OLD_KEYS + release_keys())
def test_plain_keys_parse_and_print_unchanged(text):
    key = parse_key(text)
    # but an SDPA scale of 1 / sqrt(head_dim) written as head_dim ** -0.5: the default's key
    written_scale = text.rpartition("scale=")[2]
    if text.startswith("sdpa:") and float(written_scale) == key.head_dim**-0.5:
        text = text.replace(f"scale={written_scale}", f"scale={1 / math.sqrt(key.head_dim)!r}")
    assert str(key) == text
    assert not getattr(key, "lowbit", False)
    if isinstance(key, GemmKey):
        assert (key.wdtype, key.group, key.zeros, key.scale, key.accum) == (
            key.dtype,
            0,
            "",
            "",
            "",
        )


@pytest.mark.parametrize("spec", SPECS)
def test_format_names_make_keys_that_round_trip(spec):
    key = GemmKey(m=16, n=4096, k=4096, **lowbit_fields(spec))
    assert key.lowbit
    assert parse_key(str(key)) == key and hash(parse_key(str(key))) == hash(key)
    assert lowbit_spec(key) == spec
    assert spec in key.label
    assert key_from_dict("gemm", {"m": 16, "n": 4096, "k": 4096, **lowbit_fields(spec)}) == key


def test_lowbit_strings_carry_only_what_differs_from_a_plain_gemm():
    int4 = GemmKey(m=16, n=4096, k=4096, **lowbit_fields("int4-g128"))
    assert str(int4) == (
        "gemm:m=16,n=4096,k=4096,batch=1,layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16,"
        "wdtype=int4,group=128,zeros=float,scale=group"
    )
    fp8 = GemmKey(m=16, n=4096, k=4096, **lowbit_fields("fp8-rowwise"))
    assert str(fp8) == (
        "gemm:m=16,n=4096,k=4096,batch=1,layout=nt,dtype=fp8_e4m3,out_dtype=bf16,compute=f32,"
        "align=16,scale=row,accum=f32"
    )
    # the weight dtype defaults to the activation dtype: both spellings are one key
    assert replace(fp8, wdtype="") == fp8 and fp8.wdtype == "fp8_e4m3"
    mixed = replace(fp8, wdtype="fp8_e5m2", out_dtype="f32")
    assert "wdtype=fp8_e5m2" in str(mixed) and parse_key(str(mixed)) == mixed
    assert lowbit_spec(mixed) == "fp8-rowwise-e4m3xe5m2"
    f16 = replace(int4, dtype="f16", out_dtype="f16")
    assert lowbit_spec(f16) == "int4-g128-f16" and parse_key(str(f16)) == f16


def test_lowbit_bytes_count_the_packed_weight_and_scales():
    int4 = GemmKey(m=1, n=64, k=256, **lowbit_fields("int4-g128"))
    assert int4.weight_bytes == 64 * 128 + 2 * 64 * 2 * 2
    assert int4.min_bytes == 256 * 2 + int4.weight_bytes + 64 * 2
    fp8 = GemmKey(m=4, n=64, k=256, **lowbit_fields("fp8-rowwise"))
    assert fp8.min_bytes == (4 * 256 + 4 * 4) + (64 * 256 + 64 * 4) + 4 * 64 * 2
    tensorwise = GemmKey(m=4, n=64, k=256, **lowbit_fields("fp8-tensorwise"))
    assert tensorwise.min_bytes == (4 * 256 + 4) + (64 * 256 + 4) + 4 * 64 * 2


INT4 = {"m": 4, "n": 64, "k": 256, **lowbit_fields("int4-g128")}
FP8 = {"m": 4, "n": 64, "k": 256, **lowbit_fields("fp8-rowwise")}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({**INT4, "group": 0}, r"group is missing or 0: it must be one of \[32, 64, 128, 256\]"),
        ({**INT4, "group": 96}, r"group must be one of \[32, 64, 128, 256\]"),
        ({**INT4, "k": 320}, "group=128 must divide k=320"),
        ({**INT4, "n": 60}, r"n=60 must be a multiple of 8 .*; of 16 to run on a CPU"),
        ({**INT4, "zeros": ""}, "zeros is missing: it must be one of"),
        ({**INT4, "scale": "row"}, "scale must be 'group'"),
        ({**INT4, "accum": "f32"}, "accum is for FP8 GEMMs only"),
        ({**INT4, "dtype": "f32", "out_dtype": "f32"}, "dtype must be one of"),
        ({**INT4, "out_dtype": "f16"}, "out_dtype must equal dtype"),
        ({**INT4, "layout": "nn"}, "layout must be 'nt'"),
        ({**INT4, "batch": 2}, "batch must be 1"),
        ({**INT4, "wdtype": "int3"}, "wdtype must be one of"),
        (
            {**FP8, "dtype": "bf16", "wdtype": "fp8_e4m3"},
            r"dtype must be one of .* \(FP8 GEMMs take FP8",
        ),
        ({**FP8, "wdtype": "bf16"}, "wdtype='bf16' is impossible with dtype='fp8_e4m3'"),
        ({**FP8, "dtype": "fp8_e5m2", "wdtype": "fp8_e5m2"}, "two e5m2 operands"),
        ({**FP8, "scale": "group"}, "scale must be one of"),
        ({**FP8, "accum": ""}, "accum is missing: it must be one of"),
        ({**FP8, "accum": "bf16"}, "accum must be one of"),
        ({**FP8, "group": 128}, "group is for int4 weights only"),
        ({**FP8, "zeros": "float"}, "zeros is for int4 weights only"),
        ({**FP8, "out_dtype": "fp8_e4m3"}, "out_dtype must be one of"),
        ({**FP8, "k": 250, "align": 16}, "align=16 is impossible"),
        ({"m": 4, "n": 4, "k": 4, "accum": "f32"}, "accum='f32' is for low-bit GEMMs only"),
        ({"m": 4, "n": 4, "k": 4, "group": 32}, "group=32 is for low-bit GEMMs only"),
        ({"m": 4, "n": 4, "k": 4, "scale": "row"}, "scale='row' is for low-bit GEMMs only"),
        ({"m": 4, "n": 4, "k": 8, "wdtype": "f16"}, "wdtype must equal dtype"),
    ],
)
def test_impossible_lowbit_combinations_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GemmKey(**fields)


def test_parsed_lowbit_errors_name_the_field():
    good = str(GemmKey(**INT4))
    with pytest.raises(ValueError, match="group must be an integer"):
        parse_key(good.replace("group=128", "group=g128"))
    with pytest.raises(ValueError, match="group=128 must divide k=192"):
        parse_key(good.replace("k=256", "k=192"))


@pytest.mark.parametrize(
    "spec",
    [
        "int4",
        "int4-g100",
        "int4-g0128",
        "int4-g\u0661\u0662\u0668",  # 128 in Arabic-Indic digits
        "int4-128",
        "fp8",
        "fp8-colwise",
        "fp8-rowwise-slow",
        "bf16",
        ["int4-g128"],
    ],
)
def test_unknown_format_names_are_refused_with_the_allowed_list(spec):
    with pytest.raises(ValueError, match="low-bit format must be one of int4-g32/64/128/256"):
        lowbit_fields(spec)
