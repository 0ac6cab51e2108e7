"""Keys: canonical string form, extraction from tensors, and clear errors for invalid problems."""

import math
import re

import pytest
import torch

from tuner.core.keys import GemmKey, SdpaKey, key_from_dict, parse_key


def test_gemm_key_string_is_stable_and_round_trips():
    key = GemmKey(m=128, n=4096, k=4096, dtype="bf16", out_dtype="bf16")
    assert (
        str(key)
        == "gemm:m=128,n=4096,k=4096,batch=1,layout=nn,dtype=bf16,out_dtype=bf16,compute=f32,align=16"
    )
    assert parse_key(str(key)) == key
    assert hash(parse_key(str(key))) == hash(key)


def test_out_dtype_defaults_to_the_operands_dtype():
    """A key written without out_dtype means a plain GEMM's output, as `tune gemm` makes it
    (not bf16 whatever the operands, which an f32 or f16 GEMM then refused)."""
    for dtype in ("f32", "f16", "bf16"):
        assert parse_key(f"gemm:m=8,n=8,k=8,dtype={dtype}").out_dtype == dtype
    assert parse_key("gemm:m=8,n=8,k=8").out_dtype == "bf16"
    fp8 = "gemm:m=16,n=64,k=64,layout=nt,dtype=fp8_e4m3,scale=row,accum=f32"
    assert parse_key(fp8).out_dtype == "bf16"
    assert str(GemmKey(m=8, n=8, k=8, dtype="f32")).count("out_dtype=f32") == 1


def test_sdpa_key_defaults_are_normalised():
    key = SdpaKey(batch=2, q_heads=32, kv_heads=8, q_len=1, kv_len=4096, head_dim=128)
    assert key.head_dim_v == 128
    assert key.scale == pytest.approx(1 / math.sqrt(128))
    assert parse_key(str(key)) == key
    # models pass the default as head_dim ** -0.5, a rounding away: the same problem, one key
    for d in (32, 96, 128):
        spelt = SdpaKey(1, 8, 8, 1, 64, d, scale=d**-0.5)
        assert spelt == SdpaKey(1, 8, 8, 1, 64, d) and str(spelt) == str(SdpaKey(1, 8, 8, 1, 64, d))
    assert SdpaKey(1, 8, 8, 1, 64, 128, scale=0.09).scale == 0.09


def test_gemm_key_from_tensors_sees_layout_alignment_and_tf32():
    a = torch.randn(64, 32)
    b = torch.randn(48, 32).T  # column-major B, as F.linear's weight
    key = GemmKey.from_tensors(a, b, tf32=True)
    assert (key.m, key.n, key.k, key.layout, key.dtype, key.compute) == (
        64,
        48,
        32,
        "nt",
        "f32",
        "tf32",
    )
    odd = torch.randn(5, 7, dtype=torch.float16)
    assert GemmKey.from_tensors(odd, torch.randn(7, 3, dtype=torch.float16)).align == 2
    batched = GemmKey.from_tensors(torch.randn(3, 8, 16), torch.randn(3, 16, 4))
    assert batched.batch == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"m": 0, "n": 1, "k": 1}, "m must be a positive integer"),
        ({"m": 1, "n": -4, "k": 1}, "n must be a positive integer"),
        ({"m": 2**31, "n": 1, "k": 1}, "m must be at most 2147483647, got 2147483648"),
        ({"m": 1, "n": 1, "k": 1, "dtype": "f8", "out_dtype": "f8"}, "dtype must be one of"),
        (
            {"m": 1, "n": 1, "k": 1, "dtype": "f16", "out_dtype": "f32"},
            "out_dtype must equal dtype",
        ),
        (
            {"m": 1, "n": 1, "k": 1, "dtype": "bf16", "compute": "tf32"},
            "compute='tf32' needs dtype='f32'",
        ),
        ({"m": 1, "n": 1, "k": 1, "layout": "xx"}, "layout must be one of"),
        ({"m": 8, "n": 8, "k": 5, "dtype": "bf16", "align": 16}, "align=16 is impossible"),
        (
            {"m": 8, "n": 8, "k": 5, "dtype": "f32", "out_dtype": "f32", "align": 2},
            "align=2 is impossible: f32 elements are 4 bytes",
        ),
    ],
)
def test_invalid_gemm_problems_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        GemmKey(**fields)


def test_mismatched_tensors_are_rejected_clearly():
    with pytest.raises(ValueError, match="k mismatch"):
        GemmKey.from_tensors(torch.randn(4, 5), torch.randn(6, 7))
    with pytest.raises(ValueError, match="dtype mismatch"):
        GemmKey.from_tensors(torch.randn(4, 5), torch.randn(5, 7, dtype=torch.float16))
    with pytest.raises(ValueError, match="dtype must be one of"):
        GemmKey.from_tensors(
            torch.ones(4, 5, dtype=torch.int32), torch.ones(5, 7, dtype=torch.int32)
        )


def test_kv_heads_must_divide_q_heads():
    with pytest.raises(ValueError, match=r"kv_heads \(5\) must divide q_heads \(32\)"):
        SdpaKey(batch=1, q_heads=32, kv_heads=5, q_len=1, kv_len=1, head_dim=64)
    with pytest.raises(ValueError, match="head_dim must be a positive integer"):
        SdpaKey(batch=1, q_heads=4, kv_heads=4, q_len=1, kv_len=1, head_dim=0)
    with pytest.raises(ValueError, match="causal must be one of"):
        SdpaKey(batch=1, q_heads=4, kv_heads=4, q_len=1, kv_len=1, head_dim=64, causal="yes")


def test_a_gemm_key_typed_without_align_takes_the_largest_its_shape_allows():
    """As ``tune gemm`` does: ``gemm:m=1,n=2,k=3`` names a real problem (bf16, K of 3
    elements: 2-byte rows), not one refused for the 16 bytes no such shape has."""
    assert parse_key("gemm:m=1,n=2,k=3").align == 2
    assert parse_key("gemm:m=16,n=4096,k=4096").align == 16
    assert parse_key("gemm:m=1,n=2,k=3,align=2") == parse_key("gemm:m=1,n=2,k=3")


def test_parse_and_dict_errors_name_the_problem():
    with pytest.raises(ValueError, match="key must start with one of"):
        parse_key("conv:m=1")
    with pytest.raises(ValueError, match="unknown field 'q'"):
        parse_key("gemm:m=1,n=1,k=1,q=3")
    with pytest.raises(ValueError, match="m must be an integer"):
        parse_key("gemm:m=one,n=1,k=1")
    for spelled in ("4_0", " 4", "\u0663", "+4"):  # int() reads each; a key says digits alone
        with pytest.raises(ValueError, match=re.escape(f"m must be an integer, got {spelled!r}")):
            parse_key(f"gemm:m={spelled},n=1,k=1")
    with pytest.raises(ValueError, match=r"incomplete gemm key 'gemm:m=1': missing n, k \(req"):
        parse_key("gemm:m=1")
    with pytest.raises(ValueError, match="incomplete gemm problem: missing k"):
        key_from_dict("gemm", {"m": 1, "n": 8})
    with pytest.raises(ValueError, match="empty field in gemm key"):
        parse_key("gemm:m=1,,n=1,k=1")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['heads'\]"):
        key_from_dict("sdpa", {"heads": 3})
    with pytest.raises(ValueError, match="field 'm' given twice"):
        parse_key("gemm:m=1,n=1,k=1,m=2")
    # YAML lists where a name belongs: named, not 'unhashable type' or a TypeError
    with pytest.raises(ValueError, match=r"dtype must be one of .* got \['f32'\]"):
        key_from_dict("gemm", {"m": 1, "n": 1, "k": 1, "dtype": ["f32"]})
    with pytest.raises(ValueError, match=r"op must be one of .* got \['gemm'\]"):
        key_from_dict(["gemm"], {})


def test_a_misspelt_choice_names_the_value_meant_and_a_far_one_only_the_choices():
    with pytest.raises(ValueError, match=r"got 'bf61' \(did you mean 'bf16'\?\)"):
        parse_key("gemm:m=4,n=4,k=4,dtype=bf61")
    with pytest.raises(ValueError, match=r"got 'int8'$"):
        parse_key("gemm:m=4,n=4,k=4,dtype=int8")


def test_sdpa_labels_tell_apart_every_problem_a_table_shows():
    """``show`` and the reports name problems by label: one of another V head dim or scale
    reads apart from the default one."""
    base = dict(batch=1, q_heads=4, kv_heads=2, q_len=3, kv_len=9, head_dim=16, dtype="f32")
    keys = [
        SdpaKey(**base),
        SdpaKey(**base, scale=16**-0.5),  # the default, written as models write it: one key
        SdpaKey(**base, scale=0.7),
        SdpaKey(**base, head_dim_v=8),
        SdpaKey(**base, causal="top_left"),
    ]
    labels = [k.label for k in keys]
    assert labels[0] == labels[1] == "attn b1 h4/2 q3 kv9 d16 f32"
    assert labels[2:] == [
        "attn b1 h4/2 q3 kv9 d16 f32 scale 0.7",
        "attn b1 h4/2 q3 kv9 d16 dv8 f32",
        "attn b1 h4/2 q3 kv9 d16 top_left f32",
    ]
