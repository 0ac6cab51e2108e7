"""Problem lists in YAML: what ``tuner tune-all --config`` reads.

    problems:
      - {op: gemm, m: 128, n: 4096, k: 4096, dtype: bf16}
      - {op: gemm, m: 1, n: 4096, k: 4096, dtype: f32, compute: tf32}
      - {op: sdpa, batch: 1, q_heads: 32, kv_heads: 8, q_len: 2048, kv_len: 2048, head_dim: 128, causal: top_left}
      - {op: gemm, m: 16, n: 4096, k: 4096, dtype: int4-g128}
      - key: "gemm:m=64,n=64,k=64,batch=1,layout=nn,dtype=f16,out_dtype=f16,compute=f32,align=16"

For GEMMs ``out_dtype`` defaults to ``dtype``, ``align`` to the largest the shape allows, and
``dtype`` may name what model configs name: ``tf32`` (f32 on the TF32 path, as ``dtype: f32,
compute: tf32``) or a low-bit format (``int4-g128``, ``fp8-rowwise``, ...: its fields, layout
``nt``). An SDPA entry names its shape (heads, lengths, head_dim: a model's, so one left out is
a slip, not a wish); ``batch`` defaults to 1, as a GEMM's does, ``causal`` to none and ``dtype``
to bf16. A ``key:`` entry is the key alone; beside ``problems:``, a field an entry takes or
one misspelling it is refused (other names may hold YAML anchors). Errors name every bad
entry and its field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from tuner.core.guesses import close_match, did_you_mean, with_guess
from tuner.core.keys import (
    ACCUM_MODES,
    FP8,
    FP8_SCALES,
    ITEMSIZE,
    KEY_TYPES,
    LOWBIT_FORMAT_NAMES,
    Key,
    default_align,
    fp8_key_error,
    fp8_shape_error,
    key_from_dict,
    lowbit_fields,
    parse_key,
)

MAX_NAMED = 20  # bad entries named in one error
SDPA_ENTRY_DEFAULTS = {"batch": 1}  # what an SDPA entry may leave out beyond the key's defaults


class ConfigError(ValueError):
    """A config file that cannot be used; the message names file, entry and field."""


def _check_known(op: str, fields: dict[str, Any]) -> None:
    """ValueError naming the fields an ``op`` entry does not take, each with the field it likely
    misspells, and the allowed ones (an unknown ``op`` is named by ``key_from_dict``)."""
    if not isinstance(op, str) or op not in KEY_TYPES:
        return
    allowed = [f.name for f in dataclasses.fields(KEY_TYPES[op])]
    unknown = [  # a YAML key may be a number (``1: 2``): named as written
        with_guess(str(name), close_match(str(name), allowed))
        for name in fields
        if name not in allowed
    ]
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(unknown)} for {op}; allowed: {sorted(allowed)}"
        )


def parse_problem(entry: Any, where: str) -> Key:
    if not isinstance(entry, dict):
        raise ConfigError(
            f"{where}: expected a mapping like {{op: gemm, m: ..., n: ..., k: ...}}, got {entry!r}"
        )
    try:
        key = _key_of_key(entry) if "key" in entry else _key_of_fields(dict(entry))
        if error := fp8_key_error(key):
            raise ValueError(error)
        return key
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def _key_of_key(entry: dict[str, Any]) -> Key:
    """A ``key:`` entry's key. It takes no other field but its own ``op``: one beside it
    (``m: 3``, a ``dtype``) would be dropped silently, and the key tuned in place of what the
    entry seems to ask."""
    key = parse_key(str(entry["key"]))
    others = [f"{name}={value!r}" for name, value in entry.items()
              if name != "key" and (name, value) != ("op", key.op)]  # fmt: skip
    if others:
        raise ValueError(f"a 'key' entry takes no other field, got {', '.join(sorted(others))}: "
                         "give the key alone, or the fields without it")  # fmt: skip
    return key


def _key_of_fields(fields: dict[str, Any]) -> Key:
    op = fields.pop("op", None)
    if op is None:
        raise ValueError("missing field 'op' (gemm or sdpa)")
    _check_known(op, fields)
    if op == "gemm" and fields.get("dtype") == "tf32":
        fields = _tf32_fields(fields)
    if op == "gemm" and "dtype" in fields:
        if _names_lowbit(fields["dtype"]):
            fields = with_lowbit_fields(fields)
        elif fields["dtype"] in FP8:
            _check_fp8_fields(fields)
        elif fields["dtype"] not in ITEMSIZE:
            raise ValueError(_unknown_dtype(fields["dtype"]))
        fields.setdefault("out_dtype", fields["dtype"])
    if op == "gemm" and "align" not in fields:
        fields["align"] = default_align(fields)
    return key_from_dict(op, fields, SDPA_ENTRY_DEFAULTS if op == "sdpa" else None)


def _tf32_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``dtype: tf32`` read as model configs read it: f32 operands on the TF32 path."""
    if fields.get("compute", "tf32") != "tf32":
        raise ValueError(f"compute={fields['compute']!r}: dtype tf32 fixes compute='tf32' "
                         "(leave compute out, or give dtype f32)")  # fmt: skip
    return {**fields, "dtype": "f32", "compute": "tf32"}


def _names_lowbit(dtype: Any) -> bool:
    """Whether ``dtype`` means a low-bit format, spelt right or not (``int4``, ``fp8_rowwise``):
    its error then lists the formats. A key's own FP8 operand dtypes are not formats."""
    return str(dtype).startswith(("int4", "fp8")) and dtype not in FP8


def _check_fp8_fields(fields: dict[str, Any]) -> None:
    """An FP8 GEMM spelt out field by field (``dtype: fp8_e4m3``) has no defaults for what a
    format would fix: ValueError naming every such field left out at once, and the formats."""
    needed = {"out_dtype": sorted(ITEMSIZE), "layout": ["nt"], "scale": list(FP8_SCALES),
              "accum": list(ACCUM_MODES)}  # fmt: skip
    missing = [
        f"{name} (one of {allowed})" for name, allowed in needed.items() if name not in fields
    ]
    if missing:
        raise ValueError(f"dtype {fields['dtype']} spelt out needs {', '.join(missing)}; or name "
                         f"a low-bit format as dtype instead ({LOWBIT_FORMAT_NAMES})")  # fmt: skip


def _unknown_dtype(spec: Any) -> str:
    named = sorted((*ITEMSIZE, *FP8, "tf32"))
    return (f"dtype must be one of {named} or a low-bit format ({LOWBIT_FORMAT_NAMES}), got "
            f"{spec!r}{did_you_mean(spec, named)}")  # fmt: skip


def with_lowbit_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """A low-bit GEMM entry's fields with its format's (``lowbit_fields``); ValueError naming
    the ``dtype`` that names no format, or a field the entry also gives with another value (the
    format fixes it), rather than one of the two taken silently."""
    spec = fields["dtype"]
    try:
        fixed = lowbit_fields(spec)
    except ValueError:
        raise ValueError(_unknown_dtype(spec)) from None
    n, k = fields.get("n"), fields.get("k")
    shape = fixed["wdtype"] != "int4" and type(n) is int and type(k) is int
    if shape and (error := fp8_shape_error(n, k)):  # named before the alignment it breaks
        raise ValueError(error)
    for name, value in fields.items():
        if name != "dtype" and name in fixed and str(value) != str(fixed[name]):
            raise ValueError(f"{name}={value!r}: dtype {spec} fixes {name}={fixed[name]!r} "
                             f"(leave {name} out)")  # fmt: skip
    return {**fields, **fixed}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML does not allow it):
    PyYAML keeps the last one silently, so a second ``problems:`` list would drop the first, and
    a model's second ``tp:`` would override the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: its keys may repeat
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # (the mapping's construction names that one)
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> Any:
    """A YAML file's data; ConfigError names the file when it cannot be read or parsed, or holds
    nothing (YAML reads an empty file as null: "got NoneType" would not say what is wrong)."""
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected YAML)") from None
    except yaml.YAMLError as e:  # one line: the problem and where, not the multi-line snippet
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(
            f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}"
        ) from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty")
    return data


def _check_top_level(path: Path, data: dict[Any, Any]) -> None:
    """ConfigError naming a top-level field that reads as a mistake: a misspelt second list
    (``problem:``) or a default meant for every entry (``dtype: f16``), each dropped without a
    word. Other names stay free: a mapping there may hold YAML anchors the entries merge."""
    entry_fields = {"op", "key"} | {
        f.name for t in KEY_TYPES.values() for f in dataclasses.fields(t)
    }
    names = [str(name) for name in data if name != "problems"]
    wrong = [n for n in names if n in entry_fields or close_match(n, ["problems"])]
    if wrong:
        named = ", ".join(with_guess(name, close_match(name, ["problems"])) for name in wrong)
        raise ConfigError(f"{path}: top-level field(s) {named}: a problem list reads only "
                          "'problems:', and each entry names its own fields")  # fmt: skip


def load_problems(path: str | Path) -> list[Key]:
    """The de-duplicated problems of a YAML file, in file order."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, dict) or not isinstance(data.get("problems"), list):
        model = isinstance(data, dict) and "hidden_size" in data and "problems" not in data
        hint = " (this looks like a model config: give it with --model)" if model else ""
        if isinstance(data, dict) and "problems" not in data and not model:
            near = close_match("problems", [str(name) for name in data])
            hint = f" (found {near!r}: did you mean 'problems'?)" if near else ""
        raise ConfigError(f"{path}: expected a top-level 'problems:' list{hint}")
    if not data["problems"]:  # a run that tunes nothing and says it did all would hide the slip
        raise ConfigError(f"{path}: the 'problems:' list is empty: list at least one problem")
    _check_top_level(path, data)
    keys, errors = [], []
    for i, entry in enumerate(data["problems"]):
        try:
            keys.append(parse_problem(entry, f"{path}: problems[{i}]"))
        except ConfigError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:  # every bad entry at once: a list is mended in one pass, not one run per entry
        shown = errors[:MAX_NAMED]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        listed = "".join(f"\n  {e}" for e in shown)
        raise ConfigError(f"{path}: {len(errors)} bad entries:{listed}{more}")
    return list(dict.fromkeys(keys))
