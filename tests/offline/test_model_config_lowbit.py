"""Model configs with low-bit dtype specs: projections keyed as low-bit GEMMs, attention left
out, unknown specs reported with the file, the field and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tuner.core.keys import GemmKey, lowbit_fields
from tuner.offline.model_config import ConfigError, expand, load_model, parse_model

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def test_lowbit_specs_expand_to_lowbit_projection_keys() -> None:
    base = load_model(MODELS / "llama-3-8b.yaml").model_dump()
    model = parse_model(
        {**base, "dtypes": ["bf16", "int4-g128", "fp8-rowwise"], "m_sizes": [1, 16]}
    )
    problems = expand(model)
    gemms = [p for p in problems if isinstance(p.key, GemmKey)]
    assert len(gemms) == 3 * 4 * 2
    int4 = [p.key for p in gemms if p.key.wdtype == "int4"]
    assert len(int4) == 8 and all(k.group == 128 and k.dtype == "bf16" for k in int4)
    assert all(k.layout == "nt" for k in int4)
    fp8 = [p.key for p in gemms if p.label.endswith("fp8-rowwise")]
    assert len(fp8) == 8
    for key in fp8:
        assert {f: getattr(key, f) for f in lowbit_fields("fp8-rowwise")} == lowbit_fields(
            "fp8-rowwise"
        )
    assert {(k.n, k.k) for k in int4} == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    attn_dtypes = {p.key.dtype for p in problems if not isinstance(p.key, GemmKey)}
    assert attn_dtypes == {"bf16"}  # attention stays in the dense dtypes


def test_shipped_qwen_config_lists_lowbit_dtypes() -> None:
    qwen = load_model(MODELS / "qwen2.5-7b.yaml")
    assert {"int4-g128", "fp8-rowwise"} <= set(qwen.dtypes)
    assert any(isinstance(p.key, GemmKey) and p.key.wdtype == "int4" for p in expand(qwen))


def test_unknown_spec_names_file_field_and_allowed_values() -> None:
    base = load_model(MODELS / "llama-3-8b.yaml").model_dump()
    with pytest.raises(ConfigError) as err:
        parse_model({**base, "dtypes": ["bf16", "int4-g100"]}, "m.yaml")
    text = str(err.value)
    assert text.startswith("m.yaml: dtypes[1]: ")
    assert text.count("'int4-g100'") == 1 and "fp8-rowwise" in text and "'bf16'" in text


def projections_refused(hidden_size: int, dtype: str) -> str:
    """The error of Llama-3-8B's projections at another hidden size, in one low-bit dtype; it
    names the file, the op and the dtype."""
    base = load_model(MODELS / "llama-3-8b.yaml").model_dump()
    with pytest.raises(ConfigError) as err:
        parse_model({**base, "hidden_size": hidden_size, "dtypes": [dtype],
                     "ops": ["qkv", "o", "gate_up", "down"]}, "m.yaml")  # fmt: skip
    text = str(err.value)
    assert text.startswith("m.yaml: ops: ") and f"with dtypes: {dtype}: " in text
    return text


def test_a_group_that_does_not_divide_a_projection_names_file_op_and_dtype() -> None:
    assert "group=128 must divide k=4000" in projections_refused(4000, "int4-g128")


def test_a_problem_list_names_low_bit_gemms_by_format_as_model_configs_do(tmp_path: Path) -> None:
    from tuner.offline.problem_list import load_problems

    path = tmp_path / "p.yaml"
    path.write_text(
        "problems:\n"
        "  - {op: gemm, m: 16, n: 4096, k: 4096, dtype: int4-g128}\n"
        "  - {op: gemm, m: 16, n: 4096, k: 4096, dtype: fp8-rowwise}\n"
        "  - {op: gemm, m: 16, n: 4096, k: 4096, dtype: int4-g100}\n"
    )
    with pytest.raises(ConfigError, match=r"problems\[2\]: dtype must be one of \['bf16', 'f16', "
                       r"'f32', 'fp8_e4m3', 'fp8_e5m2', 'tf32'\] or a low-bit format \(int4-g32/64/128/256, "
                       r"fp8-tensorwise, .*\), got 'int4-g100'$"):  # fmt: skip
        load_problems(path)
    path.write_text("\n".join(path.read_text().splitlines()[:3]) + "\n")
    int4, fp8 = load_problems(path)
    assert int4 == GemmKey(m=16, n=4096, k=4096, align=16, **lowbit_fields("int4-g128"))
    assert fp8 == GemmKey(m=16, n=4096, k=4096, align=16, **lowbit_fields("fp8-rowwise"))


@pytest.mark.parametrize("dtype", ["fp8-rowwize", "int4", "fp8", "int4_g128", "fp8_rowwise", "f33"])
def test_a_problem_lists_misspelt_format_is_named_as_its_dtype_with_the_formats(
    tmp_path: Path, dtype: str
) -> None:
    """A slip in a format's name is a ``dtype`` to correct, shown with the formats it may name
    (not only the plain dtypes, nor as a "low-bit format" the entry never wrote)."""
    from tuner.offline.problem_list import load_problems

    path = tmp_path / "p.yaml"
    path.write_text(f"problems:\n  - {{op: gemm, m: 16, n: 256, k: 512, dtype: {dtype}}}\n")
    with pytest.raises(ConfigError, match=rf"problems\[0\]: dtype must be one of \[.*\] or a "
                       rf"low-bit format \(int4-g32/64/128/256, .*\), got '{dtype}'$"):  # fmt: skip
        load_problems(path)


def test_an_fp8_gemm_spelt_field_by_field_names_every_field_it_lacks_at_once(
    tmp_path: Path,
) -> None:
    """``dtype: fp8_e4m3`` is a key's operand dtype, not a format: what a format would fix has
    no default, and the entry hears of all of it in one error, with the formats to use instead."""
    from tuner.offline.problem_list import load_problems

    path = tmp_path / "p.yaml"
    path.write_text(
        "problems:\n  - {op: gemm, m: 4, n: 256, k: 512, dtype: fp8_e4m3, layout: nt}\n"
    )
    with pytest.raises(ConfigError, match=r"problems\[0\]: dtype fp8_e4m3 spelt out needs "
                       r"out_dtype \(one of \['bf16', 'f16', 'f32'\]\), scale \(one of "
                       r"\['tensor', 'row'\]\), accum \(one of \['f32', 'fast'\]\); or name a "
                       r"low-bit format as dtype instead \(int4-g32/64/128/256, fp8-tensorwise"):  # fmt: skip
        load_problems(path)
    path.write_text("problems:\n  - {op: gemm, m: 4, n: 256, k: 512, dtype: fp8_e4m3, "
                    "out_dtype: bf16, layout: nt, scale: row, accum: f32}\n"
                    "  - {op: gemm, m: 4, n: 256, k: 512, dtype: fp8-rowwise}\n")  # fmt: skip
    assert len(load_problems(path)) == 1  # one key, field by field or by its format's name


@pytest.mark.parametrize(("extra", "named"), [("layout: nn", "layout='nn'"),
                                              ("out_dtype: f16", "out_dtype='f16'"),
                                              ("group: 64", "group=64")])  # fmt: skip
def test_a_problem_list_refuses_fields_its_low_bit_format_fixes(
    tmp_path: Path, extra, named
) -> None:
    """The format fixes the layout, output dtype and group: another value in the entry is a
    mistake to name, not a field to drop silently (two entries would collapse into one)."""
    from tuner.offline.problem_list import load_problems

    path = tmp_path / "p.yaml"
    path.write_text(
        f"problems:\n  - {{op: gemm, m: 16, n: 256, k: 512, dtype: int4-g128, {extra}}}\n"
    )
    with pytest.raises(ConfigError, match=rf"problems\[0\]: {named}: dtype int4-g128 fixes"):
        load_problems(path)
    path.write_text(
        "problems:\n  - {op: gemm, m: 16, n: 256, k: 512, dtype: int4-g128, layout: nt}\n"
    )
    assert load_problems(path)[0].layout == "nt"  # the same value is no conflict


def test_attention_with_only_gemm_dtypes_is_named(tmp_path: Path) -> None:
    """Low-bit formats (and tf32) key the projections only: attention ops listed with no dtype
    that makes attention problems would be dropped without a word, so the config is refused."""
    data = yaml.safe_load((MODELS / "qwen2.5-7b.yaml").read_text())
    data["dtypes"] = ["int4-g128", "fp8-rowwise"]
    data["ops"] = ["qkv", "attn_decode"]
    with pytest.raises(ConfigError, match=r"ops lists attention but no dtype in \['int4-g128', "):
        parse_model(data, tmp_path / "m.yaml")
    data["dtypes"].append("bf16")
    assert any(p.key.op == "sdpa" for p in expand(parse_model(data, tmp_path / "m.yaml")))


def test_only_gemm_takes_a_lowbit_config_that_lists_attention(tmp_path: Path) -> None:
    """``tune-all --op gemm`` asks for the projections alone, so the attention ops of a shipped
    config with only low-bit dtypes are no mistake there: its GEMMs come out, nothing else."""
    data = yaml.safe_load((MODELS / "llama-3-8b.yaml").read_text())
    data["dtypes"] = ["int4-g128", "fp8-rowwise"]
    del data["attention"]  # what only attention needs is not asked for either
    model = parse_model(data, tmp_path / "m.yaml", only="gemm")
    problems = expand(model, only="gemm")
    assert problems and all(p.key.op == "gemm" for p in problems)
    assert {p.key.wdtype for p in problems} == {"int4", "fp8_e4m3"}
    with pytest.raises(ConfigError, match=r"attention\.prefill is required"):
        parse_model(data, tmp_path / "m.yaml", only="sdpa")


def test_fp8_shapes_torchs_op_cannot_take_are_named_in_configs_and_problem_lists(
    tmp_path: Path,
) -> None:
    """FP8 GEMMs need K and N multiples of 16 (torch._scaled_mm, every FP8 key's baseline), as
    quantize_linear says: a model config or a problem list with another shape names it, rather
    than keying a problem whose baseline cannot run on a GPU."""
    from tuner.offline.problem_list import load_problems

    text = projections_refused(4104, "fp8-rowwise")
    assert "fp8 needs K and N multiples of 16" in text and "K=4104" in text
    path = tmp_path / "p.yaml"
    fp8_key = str(GemmKey(m=4, n=256, k=200, align=8, **lowbit_fields("fp8-tensorwise-fast")))
    for entry in ("{op: gemm, m: 4, n: 256, k: 200, dtype: fp8-rowwise}", f'{{key: "{fp8_key}"}}'):
        path.write_text(f"problems:\n  - {entry}\n")
        with pytest.raises(ConfigError, match=r"problems\[0\]: fp8 needs K and N multiples of 16"):
            load_problems(path)
    path.write_text("problems:\n  - {op: gemm, m: 4, n: true, k: 256, dtype: fp8-rowwise}\n")
    with pytest.raises(ConfigError, match=r"problems\[0\]: n must be"):
        load_problems(path)
