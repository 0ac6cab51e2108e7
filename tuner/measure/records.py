"""What a tuning run produces: one Measurement per candidate, one Winner per problem.

These are plain records shared by the engine (which makes them), the store (which keeps them) and
the fleet service (which merges them). ``to_row``/``from_row`` give their flat, JSON-friendly form.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tuner.core.keys import key_op, required_fields

if TYPE_CHECKING:
    from tuner.core.device import Fingerprint

STATUSES = ("ok", "rejected", "failed", "cut", "timeout", "unsupported")
LAUNCHES = ("eager", "graph")  # eager: each call launched from the host; graph: replayed
DEFAULT_LAUNCH = "eager"  # what a tuning run, and a record that names no launch mode, stands for


def candidate_name(source: str, params: dict[str, Any]) -> str:
    """Stable name of a candidate: the source plus its params in canonical JSON."""
    if not params:
        return source
    return source + ":" + json.dumps(params, sort_keys=True, separators=(",", ":"))


def candidate_params(name: str) -> dict[str, Any]:
    """The params of a ``candidate_name`` (the inverse of its JSON part; {} for none)."""
    return json.loads(name.partition(":")[2] or "{}")


# How ``candidate_label`` words params, most telling first: ``_ORDER``, then the keys it does
# not know (alphabetical, valued ones before flags) as ``key=value``, then ``_LAST``.
_WORDS = ("kernel", "backend", "precision", "scheduler")  # values read alone: "gemv", "cudnn"
_ORDER = (*_WORDS, "tile", "bm", "bn", "bk", "cluster", "id", "algo", "split", "split_k",
          "splits", "reduction", "custom", "swizzle", "inner_shape", "pad_k", "fused")  # fmt: skip
_LAST = ("warps", "stages", "epilogue", "a_layout", "group_m")  # alike across most configs
_PREFIX = {"bm": "bm", "bn": "bn", "bk": "bk", "cluster": "c", "id": "id", "algo": "algo",
           "split_k": "sk", "splits": "splits", "reduction": "red", "custom": "custom",
           "swizzle": "swz", "inner_shape": "inner", "warps": "w", "stages": "s",
           "epilogue": "epi=", "a_layout": "a=", "group_m": "g", "carveout": "carveout"}  # fmt: skip
# Values that mean "nothing special" (no split, no reduction, the library's default algorithm):
# left out, so a label shows what sets a candidate apart. CUTLASS's swizzle 1 is no swizzle.
_PLAIN: dict[str, Any] = {"split_k": 1, "splits": 1, "reduction": 0, "custom": 0, "swizzle": 0,
                          "inner_shape": 0, "algo": -1, "scheduler": "default"}  # fmt: skip
_PLAIN_BY_SOURCE = {
    **{s: {"swizzle": 1} for s in ("cutlass", "cutlass_fp8", "cutlass_w4a16")},
    # stages left for cuBLASLt to pick are no choice to show ("sUNDEFINED" reads as a fault)
    **{s: {"stages": "UNDEFINED"} for s in ("cublaslt", "cublaslt_fp8")},
    "cuda_w4a16": {"teams": 1},  # a row block a CTA
}
ELLIPSIS = "…"
LABEL_WIDTH = 72  # a table's winner column: room for the built-in sources' labels, decode's too


def candidate_label(name: str, width: int | None = None) -> str:
    """A ``candidate_name`` as people read it in tables and lines: the source, then its params
    as short words, most telling first (``triton_gemm gemv 1x8x512 w4``, ``cublaslt 112x128
    c2x1x1 id66 s64xAUTO``): Triton's bm/bn/bk read as one tile, w warps, s stages, sk split-K,
    c cluster, g group_m; a true flag is its name; plain values (a false flag, split-K 1, a
    None: nothing chosen) are left out. Past ``width`` the least telling words are cut, an
    ellipsis in their place. Whatever a program reads (JSON, ``--full-keys``, exports) keeps the
    name itself: only it round-trips."""
    source, _, text = name.partition(":")
    params = _json_object(text) if text else {}
    if params is None:  # not a name candidate_name made: shown as it is
        return clipped(name, width)
    return _fitted([source, *_param_words(source, params)], width)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _param_words(source: str, params: dict[str, Any]) -> list[str]:
    """The label's words for ``params``, most telling first."""
    plain = _PLAIN | _PLAIN_BY_SOURCE.get(source, {})
    shown = {k: v for k, v in params.items()
             if v is not False and v is not None and not _same(plain, k, v)}  # fmt: skip
    if "bm" in shown and "bn" in shown and "tile" not in shown:  # Triton's blocks: one tile
        shown["tile"] = [shown.pop(b) for b in ("bm", "bn", "bk") if b in shown]
    return [_word(k, v) for k, v in sorted(shown.items(), key=_rank)]


def _same(plain: dict[str, Any], key: str, value: Any) -> bool:
    """Whether ``value`` is ``key``'s plain value, of its type too (True is not 1 here)."""
    return key in plain and type(plain[key]) is type(value) and plain[key] == value


def _rank(item: tuple[str, Any]) -> tuple[int, int, str]:
    key, value = item
    if key in _ORDER:
        return 0, _ORDER.index(key), key
    if key in _LAST:
        return 2, _LAST.index(key), key
    return 1, value is True, key


def _word(key: str, value: Any) -> str:
    if value is True:
        return key
    text = _value_text(value)
    return text if key in (*_WORDS, "tile") else _PREFIX.get(key, key + "=") + text


def _value_text(value: Any) -> str:
    """Shapes as ``2x1x1``, strings and numbers as they are, anything else as compact JSON."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return "x".join(map(str, value))
    if isinstance(value, str | int | float):
        return str(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _fitted(words: list[str], width: int | None) -> str:
    """``words`` joined, the last ones (the least telling) cut to fit ``width``."""
    text = " ".join(words)
    if width is None or len(text) <= width:
        return text
    while len(words) > 1 and len(" ".join(words)) + 2 > width:
        words = words[:-1]
    return clipped(" ".join(words) + " " + ELLIPSIS, width)


def clipped(text: str, width: int | None) -> str:
    """``text`` cut to ``width`` characters, an ellipsis where it was cut (a label, an error
    beside it), so a reader knows there is more."""
    if width is None or len(text) <= width:
        return text
    return text[: max(width - 1, 0)] + ELLIPSIS


def quoted(value: object, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` for an error message: the value may be a whole file's
    worth of text, and the message must stay one readable line."""
    return clipped(repr(value), width)


class _Record:
    """What Measurement and Winner share: a key, a candidate, and a flat row form."""

    key: str
    source: str
    params: dict[str, Any]

    @property
    def op(self) -> str:
        return key_op(self.key)

    @property
    def candidate(self) -> str:
        return candidate_name(self.source, self.params)

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        """The keys of ``to_row()``: the fields and what is derived from them."""
        return (*cls.__dataclass_fields__, "op", "candidate")  # type: ignore[attr-defined]

    def to_row(self) -> dict[str, Any]:
        # shallow on purpose: asdict would deep-copy params, which are replaced by JSON below
        row = {f: getattr(self, f) for f in self.__dataclass_fields__}  # type: ignore[attr-defined]
        row.update(
            op=self.op, candidate=self.candidate, params=json.dumps(self.params, sort_keys=True)
        )
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Any:
        """The record of a table row or a JSON object; ValueError naming what it lacks."""
        if not isinstance(row, dict):
            raise ValueError(f"must be an object of fields, got {type(row).__name__}")
        fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
        missing = [k for k in required_fields(cls) if k not in row]
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        data = {k: row[k] for k in fields if k in row}
        if isinstance(data.get("params"), str):
            try:
                data["params"] = json.loads(data["params"])
            except (json.JSONDecodeError, RecursionError) as e:
                why = "nested too deeply" if isinstance(e, RecursionError) else e
                raise ValueError(
                    f"params must be a JSON object, got {quoted(data['params'])}: {why}"
                ) from None
        return cls(**data)


@dataclass
class Measurement(_Record):
    device_class: str
    key: str
    source: str
    params: dict[str, Any]
    status: str
    is_baseline: bool = False
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    reps: int = 0
    host_us: float | None = None
    max_rel_err: float | None = None
    error: str = ""
    versions: str = ""
    host: str = field(default_factory=socket.gethostname)
    run_id: str = ""
    created_at: float = field(default_factory=time.time)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    launch: str = DEFAULT_LAUNCH  # the launch mode it was measured for: eager or graph

    @property
    def spread(self) -> float:
        """Relative spread (p90 - p10) / median: the noise a challenger must beat."""
        if not self.median_us or self.p10_us is None or self.p90_us is None:
            return 0.0
        return (self.p90_us - self.p10_us) / self.median_us

    def to_row(self) -> dict[str, Any]:
        return super().to_row() | {"is_baseline": int(self.is_baseline)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Measurement:
        m = super().from_row(row)
        m.is_baseline = bool(m.is_baseline)
        return m


@dataclass
class Winner(_Record):
    device_class: str
    key: str
    source: str
    params: dict[str, Any]
    median_us: float
    baseline_us: float
    versions: str = ""
    run_id: str = ""
    updated_at: float = field(default_factory=time.time)
    launch: str = DEFAULT_LAUNCH  # the launch mode it was chosen for: eager or graph

    def measured_under(self, fp: Fingerprint) -> bool:
        """Whether this winner was measured under ``fp``'s versions (else it is stale)."""
        return self.versions == fp.version_tag

    @property
    def launch_mode(self) -> str:
        """The launch mode it was chosen for; an imported row that names none stands for the
        default, as a winner stored before launch modes existed does."""
        return self.launch or DEFAULT_LAUNCH

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.median_us if self.median_us else 1.0

    def to_row(self) -> dict[str, Any]:
        return super().to_row() | {"speedup": self.speedup}

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        return (*super().columns(), "speedup")
