"""Model configs in YAML: a transformer's dimensions expanded into the problems it runs.

    name: Llama-3-8B
    hidden_size: 4096
    intermediate_size: 14336
    num_heads: 32
    num_kv_heads: 8
    head_dim: 128
    tp: 1                       # tensor-parallel degree: shapes are per GPU (rank)
    dtypes: [bf16]              # f16, bf16, f32, tf32 (tf32: f32 GEMMs on the TF32 path), and
                                # low-bit specs: int4-g128, fp8-rowwise, fp8-tensorwise, ...
    m_sizes: [1, 16, 128]       # GEMM rows M = tokens in one forward pass
    ops: [qkv, o, gate_up, down, attn_prefill, attn_decode]
    attention:                  # needed when an attention op is listed
      prefill: {batch_sizes: [1], seq_lens: [2048]}
      decode: {batch_sizes: [1, 16], kv_lens: [4096]}

Projections are ``y = F.linear(x, W)``: x is (M, K) row-major and W is stored (N, K) row-major as
``nn.Linear`` keeps it, so the GEMM is ``x @ W.T`` with B = W.T column-major: layout ``nt``
(``layout: nn`` for weights stored pre-transposed). Per rank with TP degree t:

    qkv      N = (heads + 2 kv_heads) head_dim / t   K = hidden          (fused Q, K, V)
    o        N = hidden                              K = heads head_dim / t
    gate_up  N = 2 intermediate / t                  K = hidden          (fused gate and up)
    down     N = hidden                              K = intermediate / t

KV heads are split over ranks when there are at least t of them, else replicated (one per rank).
A low-bit dtype spec (``tuner.core.keys.lowbit_fields``: int4 weights with bf16 activations, FP8
operands with tensorwise or rowwise scales) keys the projections only, always ``nt``: the packed
weight has no transposed form.
Attention prefill is causal with q_len = kv_len (top-left and bottom-right masks coincide);
decode is one query row against the whole cache, so no mask (``causal: none``). tf32 only
applies to GEMMs; attention problems are made for the other dtypes.

``load_model(path, only=None)`` raises ``ConfigError`` naming the file, the field and the allowed
values; ``only`` ("gemm" or "sdpa", as ``tune-all --op``) reads the config for that kind of op.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from tuner.core.guesses import close_match, did_you_mean, with_guess
from tuner.core.keys import (
    LOWBIT_FORMAT_NAMES,
    GemmKey,
    Key,
    SdpaKey,
    dense_align,
    fp8_key_error,
    leading_dims,
    lowbit_fields,
)
from tuner.offline.problem_list import ConfigError, read_yaml

GEMM_OPS = ("qkv", "o", "gate_up", "down")
Op = Literal["qkv", "o", "gate_up", "down", "attn_prefill", "attn_decode"]
DENSE_DTYPES = ("f16", "bf16", "f32", "tf32")
ATTENTION_DTYPES = frozenset(DENSE_DTYPES[:3])  # tf32 and low-bit formats key GEMMs only


def check_dtype(spec: str) -> str:
    """A dense dtype name or a low-bit spec; ValueError naming the allowed values otherwise."""
    if spec in DENSE_DTYPES:
        return spec
    try:
        lowbit_fields(spec)
    except ValueError:
        dense = ", ".join(map(repr, DENSE_DTYPES[:-1])) + f" or {DENSE_DTYPES[-1]!r}"
        raise ValueError(f"Input should be {dense}, or a low-bit format: one of "
                         f"{LOWBIT_FORMAT_NAMES}{did_you_mean(spec, DENSE_DTYPES)}") from None  # fmt: skip
    return spec


DType = Annotated[str, AfterValidator(check_dtype)]
Size = Annotated[int, Field(strict=True, gt=0)]
Sizes = Annotated[list[Size], Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Prefill(_Strict):
    batch_sizes: Sizes
    seq_lens: Sizes


class Decode(_Strict):
    batch_sizes: Sizes
    kv_lens: Sizes


class Attention(_Strict):
    prefill: Prefill | None = None
    decode: Decode | None = None


class ModelConfig(_Strict):
    name: Annotated[str, Field(min_length=1)]
    source: str = ""  # where the dimensions come from (the model's config.json)
    hidden_size: Size
    intermediate_size: Size
    num_heads: Size
    num_kv_heads: Size
    head_dim: Size
    tp: Size = 1
    dtypes: Annotated[list[DType], Field(min_length=1)]
    ops: Annotated[list[Op], Field(min_length=1)]
    m_sizes: list[Size] = []
    layout: Literal["nt", "nn"] = "nt"
    attention: Attention | None = None

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> ModelConfig:
        only = (info.context or {}).get("op")  # "gemm" / "sdpa": the other kind's ops are not made
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        for name in ("num_heads", "intermediate_size"):
            if getattr(self, name) % self.tp:
                raise ValueError(f"tp ({self.tp}) must divide {name} ({getattr(self, name)})")
        kv, tp = self.num_kv_heads, self.tp
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            raise ValueError(
                f"tp ({tp}) and num_kv_heads ({kv}) must divide one another "
                "(KV heads are split across ranks, or replicated when there are fewer than tp)"
            )
        if only != "sdpa" and set(self.ops) & set(GEMM_OPS) and not self.m_sizes:
            raise ValueError("m_sizes is required (and non-empty) when a projection op is listed")
        if only == "gemm":
            return self
        for op, part in (("attn_prefill", "prefill"), ("attn_decode", "decode")):
            if op in self.ops and getattr(self.attention, part, None) is None:
                raise ValueError(f"attention.{part} is required when ops lists {op!r}")
        attention_dtypes = ATTENTION_DTYPES & set(self.dtypes)
        if set(self.ops) & {"attn_prefill", "attn_decode"} and not attention_dtypes:
            raise ValueError(f"ops lists attention but no dtype in {list(self.dtypes)} makes an "
                             f"attention problem: add one of {sorted(ATTENTION_DTYPES)}, or tune the projections "
                             "alone (tune-all --op gemm): tf32 and low-bit formats key GEMMs only")  # fmt: skip
        return self

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp)

    def gemm_shape(self, op: str) -> tuple[int, int]:
        """(N, K) of a projection on one rank."""
        d, t = self.head_dim, self.tp
        return {
            "qkv": ((self.heads_per_rank + 2 * self.kv_heads_per_rank) * d, self.hidden_size),
            "o": (self.hidden_size, self.heads_per_rank * d),
            "gate_up": (2 * self.intermediate_size // t, self.hidden_size),
            "down": (self.hidden_size, self.intermediate_size // t),
        }[op]


@dataclass(frozen=True)
class Problem:
    """One problem of a model, with a short label saying where it comes from."""

    key: Key
    label: str


def gemm_key(m: int, n: int, k: int, *, layout: str, dtype: str, batch: int = 1) -> GemmKey:
    """The key of a dense GEMM (leading dimensions equal to the matrix extents), or of a low-bit
    one for a low-bit spec (``x [M, K] @ W[N, K].T``, layout ``nt`` whatever ``layout`` says)."""
    if dtype not in DENSE_DTYPES:
        fields = lowbit_fields(dtype)
        key = GemmKey(**{
            **fields, "m": m, "n": n, "k": k, "batch": batch, "layout": "nt",
            "align": dense_align(fields["dtype"], k),
        })  # fmt: skip
        if error := fp8_key_error(key):
            raise ValueError(error)
        return key
    base, compute = ("f32", "tf32") if dtype == "tf32" else (dtype, "f32")
    return GemmKey(
        m=m, n=n, k=k, batch=batch, layout=layout, dtype=base, out_dtype=base,
        compute=compute, align=dense_align(base, *leading_dims(m, n, k, layout)),
    )  # fmt: skip


def expand(model: ModelConfig, only: str | None = None) -> list[Problem]:
    """Every problem of the model, in config order (dtype, op, size), without duplicates; with
    ``only`` ("gemm" or "sdpa") those of that kind alone."""
    ops = [op for op in model.ops if only is None or (op in GEMM_OPS) == (only == "gemm")]
    out: dict[Key, Problem] = {}
    for dtype in model.dtypes:
        for op in ops:
            try:
                keys = _op_keys(model, op, dtype)
            except ValueError as e:  # e.g. a group size that does not divide the op's K
                raise ValueError(f"ops: {op} with dtypes: {dtype}: {e}") from None
            for key, size in keys:
                out.setdefault(key, Problem(key, f"{model.name} {op} {size} {dtype}"))
    return list(out.values())


def _op_keys(model: ModelConfig, op: str, dtype: str) -> list[tuple[Key, str]]:
    if op in GEMM_OPS:
        n, k = model.gemm_shape(op)
        return [
            (gemm_key(m, n, k, layout=model.layout, dtype=dtype), f"M={m}") for m in model.m_sizes
        ]
    if dtype not in ATTENTION_DTYPES:  # tf32 and low-bit formats: GEMMs only
        return []
    att = model.attention
    assert att is not None  # checked by the validator
    common = dict(
        q_heads=model.heads_per_rank, kv_heads=model.kv_heads_per_rank,
        head_dim=model.head_dim, dtype=dtype,
    )  # fmt: skip
    if op == "attn_prefill":
        assert att.prefill is not None
        return [
            (SdpaKey(batch=b, q_len=s, kv_len=s, causal="top_left", **common), f"b={b} s={s}")
            for b in att.prefill.batch_sizes
            for s in att.prefill.seq_lens
        ]
    assert att.decode is not None
    return [
        (SdpaKey(batch=b, q_len=1, kv_len=s, causal="none", **common), f"b={b} kv={s}")
        for b in att.decode.batch_sizes
        for s in att.decode.kv_lens
    ]


# where an unknown field can stand -> the fields allowed there
_PLACES: dict[tuple[str, ...], type[BaseModel]] = {
    (): ModelConfig,
    ("attention",): Attention,
    ("attention", "prefill"): Prefill,
    ("attention", "decode"): Decode,
}


def _misspelt(errors: list[Any]) -> dict[tuple[Any, ...], str]:
    """Each unknown field's likely intended name (``close_match`` among the fields allowed at its
    place), by the unknown field's location."""
    guesses = {}
    for e in errors:
        place = _PLACES.get(tuple(map(str, e["loc"][:-1])))
        if e["type"] == "extra_forbidden" and place is not None:
            guess = close_match(str(e["loc"][-1]), list(place.model_fields))
            if guess is not None:
                guesses[tuple(e["loc"])] = guess
    return guesses


def _dotted(loc: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _field_group(kind: str, place: tuple[Any, ...], names: list[tuple[str, str | None]]) -> str:
    """One line for every field of one kind (missing, unknown) at one place: a file of another
    format (a Hugging Face config.json) reads as two lines, not one per field."""
    allowed = _PLACES.get(tuple(map(str, place)))
    tail = f"; allowed: {sorted(allowed.model_fields)}" if kind == "unknown" and allowed else ""
    if len(names) == 1:
        ((name, guess),) = names
        what = "Field required" if kind == "missing" else "unknown field"
        return f"{_dotted((*place, name))}: {with_guess(what, guess)}{tail}"
    at = f"{_dotted(place)}: " if place else ""
    return f"{at}{kind} fields: {', '.join(with_guess(*n) for n in names)}{tail}"


def format_errors(path: Path | str, err: ValidationError) -> str:
    """The errors of a model config, a line each, but every missing field at one place on one
    line and every unknown one on another; an unknown field close to an allowed one says which
    (a misspelt required field is one mistake: not also reported missing)."""
    errors = err.errors()
    guesses = _misspelt(errors)
    meant = {(*loc[:-1], guess) for loc, guess in guesses.items()}
    groups: dict[tuple[str, tuple[Any, ...]], list[tuple[str, str | None]]] = {}
    lines = []
    for e in errors:
        loc = tuple(e["loc"])
        if e["type"] in ("missing", "extra_forbidden") and loc not in meant:
            kind = "missing" if e["type"] == "missing" else "unknown"
            groups.setdefault((kind, loc[:-1]), []).append((str(loc[-1]), guesses.get(loc)))
        elif e["type"] != "missing":
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{_dotted(loc)}: {msg} (got {e['input']!r})" if loc else msg)
    lines += [_field_group(kind, place, names) for (kind, place), names in groups.items()]
    return "\n".join(f"{path}: {line}" for line in lines)


def parse_model(data: Any, path: Path | str = "<model>", only: str | None = None) -> ModelConfig:
    """The model config in ``data``; ``ConfigError`` naming the file and the field unless it is
    valid and every problem it names can be made (``expand``). With ``only`` ("gemm" or "sdpa",
    as ``tune-all --op``) what only the other kind of op needs is not asked for: a config of
    low-bit dtypes that also lists attention ops is fine for ``only="gemm"``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of model fields, got {type(data).__name__}")
    if "problems" in data and "hidden_size" not in data:
        raise ConfigError(
            f"{path}: a problem list ('problems:'), not a model config: give it with -c/--config"
        )
    try:
        model = ModelConfig.model_validate(data, context={"op": only})
    except ValidationError as e:
        raise ConfigError(format_errors(path, e)) from None
    try:
        expand(model, only)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    return model


def load_model(path: str | Path, only: str | None = None) -> ModelConfig:
    path = Path(path)
    return parse_model(read_yaml(path), path, only)
