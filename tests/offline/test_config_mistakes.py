"""A mistake in a model config or a problem list, as ``tuner tune-all`` reports it: through the
real command line (``tuner.cli.main.main``), one ``error:`` line per mistake, exit status 2, and
no cache file made."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from tuner.cli import main
from tuner.core.keys import GemmKey, SdpaKey
from tuner.offline.problem_list import ConfigError, load_problems

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "configs" / "models" / "llama-3-8b.yaml"


@pytest.fixture
def tune_all(tmp_path, monkeypatch, capsys):
    """Run ``tuner tune-all ARGS --cache <tmp>/c.db``: (exit status, stderr lines, cache made)."""
    cache = tmp_path / "c.db"
    monkeypatch.setenv("COLUMNS", "400")  # no wrapped lines

    def run(*args: str) -> tuple[int, list[str], bool]:
        monkeypatch.setattr(sys, "argv", ["tuner", "tune-all", *args, "--cache", str(cache)])
        with pytest.raises(SystemExit) as exit_:
            main.main()
        return exit_.value.code, capsys.readouterr().err.splitlines(), cache.exists()

    return run


def _llama_with(tmp_path: Path, **change: object) -> Path:
    data = yaml.safe_load(LLAMA.read_text())
    for old, new in change.items():
        data[new] = data.pop(old)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_misspelt_model_field_is_one_line_naming_the_field_meant(tmp_path, tune_all):
    path = _llama_with(tmp_path, hidden_size="hiden_size")
    code, err, made = tune_all("--model", str(path))
    assert (code, made) == (2, False)
    assert len(err) == 1, err  # not also "hidden_size: Field required"
    assert err[0].startswith(
        f"error: {path}: hiden_size: unknown field (did you mean 'hidden_size'?); allowed: ["
    )


def test_a_hugging_face_config_json_reads_as_one_line_per_kind_of_mistake(tmp_path, tune_all):
    hf = tmp_path / "config.json"
    hf.write_text(
        '{"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, '
        '"num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256}'
    )
    code, err, made = tune_all("--model", str(hf))
    assert (code, made) == (2, False)
    assert err == [
        f"error: {hf}: missing fields: name, num_heads, head_dim, dtypes, ops",
        f"{hf}: unknown fields: num_attention_heads, num_key_value_heads (did you mean "
        "'num_kv_heads'?), num_hidden_layers, vocab_size; allowed: ['attention', 'dtypes', "
        "'head_dim', 'hidden_size', 'intermediate_size', 'layout', 'm_sizes', 'name', "
        "'num_heads', 'num_kv_heads', 'ops', 'source', 'tp']",
    ]


def test_a_misspelt_problem_field_names_the_field_meant(tmp_path, tune_all):
    listed = tmp_path / "list.yaml"
    listed.write_text(
        "problems:\n  - {op: sdpa, batch: 1, q_heads: 8, kv_head: 2, q_len: 4, kv_len: 4, "
        "head_dim: 16, dtype: f32, casual: top_left}\n"
    )
    code, err, made = tune_all("--config", str(listed))
    assert (code, made) == (2, False)
    assert len(err) == 1
    assert err[0].startswith(
        f"error: {listed}: problems[0]: unknown field(s) kv_head (did you mean 'kv_heads'?), "
        "casual (did you mean 'causal'?) for sdpa; allowed: ["
    )
    listed.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, 1: 2}\n")  # a number as key
    code, err, made = tune_all("--config", str(listed))
    assert (code, made) == (2, False)
    assert err[0].startswith(f"error: {listed}: problems[0]: unknown field(s) 1 for gemm; ")


@pytest.mark.parametrize(
    ("text", "why"),
    [  # an empty list: a run that tunes nothing and says it did all would hide the slip
        (
            "# shapes to come\nproblems: []\n",
            "the 'problems:' list is empty: list at least one problem",
        ),
        (
            "problem:\n  - {op: gemm, m: 4, n: 8, k: 8}\n",
            "expected a top-level 'problems:' list (found 'problem': did you mean 'problems'?)",
        ),
    ],
)
def test_a_list_without_problems_is_refused_naming_why(tmp_path, tune_all, text, why):
    listed = tmp_path / "list.yaml"
    listed.write_text(text)
    code, err, made = tune_all("--config", str(listed))
    assert (code, made) == (2, False)
    assert err == [f"error: {listed}: {why}"]


def test_a_key_entry_with_other_fields_is_refused_not_tuned_as_the_key_alone(tmp_path, tune_all):
    """``{key: ..., m: 3}`` is refused, naming the other fields, rather than tuned as the key
    alone; its own ``op`` may stand beside it."""
    key = "gemm:m=16,n=64,k=64,layout=nt,dtype=f32"
    listed = tmp_path / "list.yaml"
    listed.write_text(f'problems:\n  - {{key: "{key}", op: gemm}}\n')
    assert load_problems(listed) == [
        GemmKey(m=16, n=64, k=64, layout="nt", dtype="f32", out_dtype="f32", align=16)
    ]
    listed.write_text(f'problems:\n  - {{key: "{key}", m: 3, op: sdpa}}\n')
    code, err, made = tune_all("--config", str(listed))
    assert (code, made) == (2, False)
    assert err == [
        f"error: {listed}: problems[0]: a 'key' entry takes no other field, got m=3, "
        "op='sdpa': give the key alone, or the fields without it"
    ]


def test_a_list_with_fields_beside_problems_is_refused_naming_them(tmp_path, tune_all):
    """A second list under a misspelt name and a default no entry takes are refused, naming
    them, rather than dropped while the run tunes the first list alone. A mapping of another
    name stays free: it may hold the anchors its entries merge."""
    listed = tmp_path / "list.yaml"
    listed.write_text("base: &b {op: gemm, n: 8, k: 8}\nproblems:\n  - {<<: *b, m: 4}\n")
    assert load_problems(listed) == [GemmKey(m=4, n=8, k=8, out_dtype="bf16", align=16)]
    listed.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8}\n"
                      "problem:\n  - {op: gemm, m: 8, n: 8, k: 8}\ndtype: f16\n")  # fmt: skip
    code, err, made = tune_all("--config", str(listed))
    assert (code, made) == (2, False)
    assert err == [
        f"error: {listed}: top-level field(s) problem (did you mean 'problems'?), dtype: a problem "
        "list reads only 'problems:', and each entry names its own fields"
    ]


@pytest.mark.parametrize(
    ("flag", "text", "where"),
    [  # YAML kept the last of two: the first list, the first tp, the first m, each dropped
        ("--config", "problems:\n  - {op: gemm, m: 4, n: 8, k: 8}\nproblems:\n  - {op: gemm, "
         "m: 8, n: 8, k: 8}\n", "line 3, column 1: 'problems'"),
        ("--config", "problems:\n  - {op: gemm, m: 4, n: 8, k: 8, m: 16}\n",
         "line 2, column 34: 'm'"),
        ("--model", LLAMA.read_text() + "tp: 2\n", "line 20, column 1: 'tp'"),
    ],
)  # fmt: skip
def test_a_key_given_twice_is_refused_naming_it_and_where(tmp_path, tune_all, flag, text, where):
    path = tmp_path / "given.yaml"
    path.write_text(text)
    code, err, made = tune_all(flag, str(path), "--dry-run")  # (a plan, were it taken)
    assert (code, made) == (2, False)
    assert err == [f"error: {path}: not valid YAML at {where} given twice in one mapping"]


def test_a_listed_tf32_gemm_is_f32_on_the_tf32_path_as_in_model_configs(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: tf32}\n")
    assert load_problems(listed) == [
        GemmKey(m=4, n=8, k=8, layout="nn", dtype="f32", out_dtype="f32", compute="tf32", align=16)
    ]
    listed.write_text("problems:\n  - {op: gemm, m: 4, n: 8, k: 8, dtype: tf32, compute: f32}\n")
    with pytest.raises(ConfigError, match=r"problems\[0\]: compute='f32': dtype tf32 fixes"):
        load_problems(listed)


def test_a_listed_sdpa_problem_names_its_shape_and_may_leave_out_its_batch(tmp_path, tune_all):
    listed = tmp_path / "list.yaml"
    listed.write_text("problems:\n  - {op: sdpa, q_heads: 28, kv_heads: 4, q_len: 1, kv_len: 4096, "
                      "head_dim: 128}\n")  # fmt: skip
    assert load_problems(listed) == [
        SdpaKey(batch=1, q_heads=28, kv_heads=4, q_len=1, kv_len=4096, head_dim=128)
    ]
    listed.write_text("problems:\n  - {op: sdpa, q_len: 1, kv_len: 4096}\n")
    code, err, made = tune_all("--config", str(listed))
    assert (code, made) == (2, False)
    assert err == [
        f"error: {listed}: problems[0]: incomplete sdpa problem: missing q_heads, kv_heads, "
        "head_dim (required: ['q_heads', 'kv_heads', 'q_len', 'kv_len', 'head_dim'])"
    ]


def test_an_op_that_leaves_no_problem_of_the_files_is_refused(tmp_path, tune_all):
    data = yaml.safe_load(LLAMA.read_text())
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({**data, "ops": ["qkv", "o"]}))  # projections only
    code, err, made = tune_all("--model", str(path), "--op", "sdpa")
    assert (code, made) == (2, False)
    assert err == ["error: --op sdpa: the files given hold no sdpa problems, nothing to tune"]


def test_a_model_config_and_a_problem_list_given_to_each_others_flag_are_named(tmp_path, tune_all):
    """The two YAML files look alike from afar: each error says which flag the file wants."""
    code, err, made = tune_all("-c", str(LLAMA))
    assert (code, made) == (2, False)
    assert err == [
        f"error: {LLAMA}: expected a top-level 'problems:' list "
        "(this looks like a model config: give it with --model)"
    ]
    problems = tmp_path / "p.yaml"
    problems.write_text("problems:\n  - {op: gemm, m: 4, n: 32, k: 32, dtype: f32}\n")
    code, err, made = tune_all("--model", str(problems))
    assert (code, made) == (2, False)
    assert err == [
        f"error: {problems}: a problem list ('problems:'), not a model config: "
        "give it with -c/--config"
    ]
