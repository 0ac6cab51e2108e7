"""Problem keys: what a tuned result is valid for.

A key is a frozen, hashable dataclass with a stable string form, used as the primary key in the
SQLite store and in the HTTP API. The string form is ``op:field=value,...`` with the fields in
declaration order, e.g.::

    gemm:m=128,n=4096,k=4096,batch=1,layout=nn,dtype=bf16,out_dtype=bf16,compute=f32,align=16
    sdpa:batch=1,q_heads=32,kv_heads=8,q_len=2048,kv_len=2048,head_dim=128,head_dim_v=128,causal=none,dtype=bf16,scale=0.08838834764831845

``parse_key(str(key)) == key`` always holds. Invalid problems raise ``ValueError`` naming the field.
Keys are plain data and import no torch (the fleet service uses them); the torch dtype tables
``DTYPES`` / ``DTYPE_NAMES`` and the tensor helpers load torch on first use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

# dtype name -> bytes per element. The names are the ones stored and sent over HTTP.
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4}

# GEMM compute modes: "f32" = fp32 accumulation at full precision (IEEE for f32 inputs);
# "tf32" = f32 inputs through the tensor cores' TF32 path.
COMPUTE_MODES = ("f32", "tf32")
LAYOUTS = ("nn", "nt", "tn", "tt")  # first letter: A, second: B; n = row-major, t = column-major
ALIGNMENTS = (16, 8, 4, 2)  # bytes: the largest that divides every pointer and leading stride
CAUSAL_MODES = ("none", "top_left", "bottom_right")


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple[Any, ...] | dict) -> None:
    if not isinstance(value, (str, int)) or value not in allowed:  # a YAML list is unhashable
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")


@dataclass(frozen=True, slots=True)
class GemmKey:
    """C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]."""

    op: ClassVar[str] = "gemm"

    m: int
    n: int
    k: int
    batch: int = 1
    layout: str = "nn"
    dtype: str = "bf16"
    out_dtype: str = "bf16"
    compute: str = "f32"
    align: int = 16

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            _check_positive(name, getattr(self, name))
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("dtype", self.dtype, ITEMSIZE)
        _check_choice("out_dtype", self.out_dtype, ITEMSIZE)
        _check_choice("compute", self.compute, COMPUTE_MODES)
        _check_choice("align", self.align, ALIGNMENTS)
        if self.out_dtype != self.dtype:
            raise ValueError(
                f"out_dtype must equal dtype ({self.dtype!r}) for now, got {self.out_dtype!r}"
            )
        if self.compute == "tf32" and self.dtype != "f32":
            raise ValueError(f"compute='tf32' needs dtype='f32', got dtype={self.dtype!r}")
        item = ITEMSIZE[self.dtype]
        if self.align < item:  # a pointer to such elements is at least item-aligned
            raise ValueError(
                f"align={self.align} is impossible: {self.dtype} elements are {item} bytes"
            )
        lda = self.k if self.layout[0] == "n" else self.m
        ldb = self.n if self.layout[1] == "n" else self.k
        for name, ld in (("a", lda), ("b", ldb)):
            if (ld * item) % self.align:
                raise ValueError(
                    f"align={self.align} is impossible: {name}'s leading dimension {ld} x {item} bytes "
                    f"is not a multiple of {self.align}"
                )

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Each input read once, the output written once: the memory floor."""
        e = ITEMSIZE[self.dtype]
        return (
            self.batch * (self.m * self.k + self.k * self.n) * e
            + self.batch * self.m * self.n * ITEMSIZE[self.out_dtype]
        )

    @property
    def label(self) -> str:
        """Short human form for tables, e.g. ``128x4096x4096 nt bf16``; not parseable."""
        extras = [f"batch {self.batch}"] * (self.batch > 1) + ["tf32"] * (self.compute == "tf32")
        extras += [f"align {self.align}"] * (self.align != 16)
        return " ".join([f"{self.m}x{self.n}x{self.k}", self.layout, self.dtype, *extras])

    @classmethod
    def from_tensors(cls, a: Any, b: Any, *, tf32: bool | None = None) -> GemmKey:
        """The key of ``a @ b`` for 2-D or 3-D (batched) torch tensors."""
        return cls(**gemm_fields(a, b, tf32=tf32))

    def __str__(self) -> str:
        return _to_str(self)


@dataclass(frozen=True, slots=True)
class SdpaKey:
    """softmax(Q K^T * scale + mask) V with Q (batch, q_heads, q_len, head_dim)."""

    op: ClassVar[str] = "sdpa"

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    head_dim_v: int = 0  # 0 means "same as head_dim"; normalised in __post_init__
    causal: str = "none"
    dtype: str = "bf16"
    scale: float = 0.0  # 0 means "1/sqrt(head_dim)"; normalised in __post_init__

    def __post_init__(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
            _check_positive(name, getattr(self, name))
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _check_positive("head_dim_v", self.head_dim_v)
        if self.scale == 0.0:
            object.__setattr__(self, "scale", 1.0 / math.sqrt(self.head_dim))
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"kv_heads ({self.kv_heads}) must divide q_heads ({self.q_heads}) for grouped-query attention"
            )
        _check_choice("causal", self.causal, CAUSAL_MODES)
        _check_choice("dtype", self.dtype, ITEMSIZE)
        if (
            not isinstance(self.scale, (int, float))
            or isinstance(self.scale, bool)
            or not math.isfinite(self.scale)
            or self.scale <= 0
        ):
            raise ValueError(f"scale must be a positive finite number, got {self.scale!r}")
        object.__setattr__(self, "scale", float(self.scale))

    @property
    def flops(self) -> float:
        """Matmul FLOPs, halved for causal masks (the usual convention)."""
        f = (
            2.0
            * self.batch
            * self.q_heads
            * self.q_len
            * self.kv_len
            * (self.head_dim + self.head_dim_v)
        )
        return f / 2 if self.causal != "none" else f

    @property
    def kv_bytes(self) -> int:
        return (
            self.batch
            * self.kv_heads
            * self.kv_len
            * (self.head_dim + self.head_dim_v)
            * ITEMSIZE[self.dtype]
        )

    @property
    def label(self) -> str:
        """Short human form for tables, e.g. ``attn b1 h32/8 q2048 kv2048 d128 top_left bf16``."""
        causal = "" if self.causal == "none" else f" {self.causal}"
        return f"attn b{self.batch} h{self.q_heads}/{self.kv_heads} q{self.q_len} kv{self.kv_len} d{self.head_dim}{causal} {self.dtype}"

    @classmethod
    def from_tensors(
        cls, q: Any, k: Any, v: Any, *, causal: str = "none", scale: float | None = None
    ) -> SdpaKey:
        return cls(**sdpa_fields(q, k, v, causal=causal, scale=scale))

    def __str__(self) -> str:
        return _to_str(self)


Key = GemmKey | SdpaKey
KEY_TYPES: dict[str, type[GemmKey] | type[SdpaKey]] = {"gemm": GemmKey, "sdpa": SdpaKey}


def _to_str(key: Key) -> str:
    return (
        key.op
        + ":"
        + ",".join(f"{f.name}={getattr(key, f.name)!r}".replace("'", "") for f in fields(key))
    )


def _split(text: str) -> tuple[str, str]:
    op, sep, body = text.partition(":")
    if not sep or op not in KEY_TYPES:
        raise ValueError(
            f"key must start with one of {sorted(KEY_TYPES)} followed by ':', got {text!r}"
        )
    return op, body


def key_op(text: str) -> str:
    """The op (``gemm``, ``sdpa``) of a stored key string, without building the key."""
    return _split(text)[0]


def parse_key(text: str) -> Key:
    """Inverse of ``str(key)``. Raises ValueError with the offending part."""
    op, body = _split(text)
    cls = KEY_TYPES[op]
    types = {f.name: f.type for f in fields(cls)}
    values: dict[str, Any] = {}
    for part in filter(None, body.split(",")):
        name, eq, raw = part.partition("=")
        if not eq or name not in types:
            raise ValueError(f"unknown field {name!r} in {op} key; allowed: {sorted(types)}")
        if name in values:
            raise ValueError(f"field {name!r} given twice in {op} key {text!r}")
        values[name] = _convert(name, raw, types[name])
    try:
        return cls(**values)
    except TypeError as e:  # missing required field
        raise ValueError(f"incomplete {op} key {text!r}: {e}") from None


def _convert(name: str, raw: str, type_name: str) -> Any:
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
    except ValueError:
        kind = "an integer" if type_name == "int" else "a number"
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    return raw


def key_from_dict(op: str, data: dict[str, Any]) -> Key:
    """Build a key from a JSON object (API bodies, YAML configs), naming bad fields."""
    if not isinstance(op, str) or op not in KEY_TYPES:
        raise ValueError(f"op must be one of {sorted(KEY_TYPES)}, got {op!r}")
    cls = KEY_TYPES[op]
    allowed = {f.name for f in fields(cls)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} for {op}; allowed: {sorted(allowed)}")
    try:
        return cls(**data)
    except TypeError as e:
        raise ValueError(f"incomplete {op} problem: {e}") from None


# --- torch dtypes and extraction from tensors ---------------------------------------------


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


@cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {v: k for k, v in _torch_dtypes().items()}


def __getattr__(name: str) -> Any:
    """``DTYPES`` (name -> torch dtype) and ``DTYPE_NAMES`` (its inverse), built on first use."""
    if name == "DTYPES":
        return _torch_dtypes()
    if name == "DTYPE_NAMES":
        return _dtype_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def matrix_layout(t: Any) -> str | None:
    """'n' for row-major (last dim contiguous), 't' for column-major, None for anything else."""
    s = t.stride()
    rows, cols = t.shape[-2], t.shape[-1]
    if s[-1] == 1 and (s[-2] >= max(cols, 1) or rows == 1):
        return "n"
    if s[-2] == 1 and (s[-1] >= max(rows, 1) or cols == 1):
        return "t"
    return None


def alignment(t: Any, layout: str) -> int:
    """Largest of 16/8/4/2 bytes dividing the data pointer and the leading-dimension stride."""
    item = t.element_size()
    ld = t.stride()[-2] if layout == "n" else t.stride()[-1]
    if t.dim() == 3 and t.shape[0] > 1:
        ld = math.gcd(ld, t.stride()[0])
    ptr = t.data_ptr()
    for a in ALIGNMENTS:
        if ptr % a == 0 and (ld * item) % a == 0:
            return a
    return 2


def gemm_fields(a: Any, b: Any, *, tf32: bool | None = None) -> dict[str, Any]:
    if a.dim() != b.dim() or a.dim() not in (2, 3):
        raise ValueError(
            f"a and b must both be 2-D or both 3-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"k mismatch: a is {tuple(a.shape)} and b is {tuple(b.shape)} (a.shape[-1] must equal b.shape[-2])"
        )
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"batch mismatch: a has {a.shape[0]} and b has {b.shape[0]}")
    if a.dtype != b.dtype:
        raise ValueError(
            f"dtype mismatch: a is {a.dtype} and b is {b.dtype}; mixed-dtype GEMMs are not supported"
        )
    names = _dtype_names()
    if a.dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(ITEMSIZE)}, got {a.dtype}")
    la, lb = matrix_layout(a), matrix_layout(b)
    if la is None or lb is None:
        raise ValueError(
            "layout: a and b must each be row-major or column-major in their last two dims"
        )
    dtype = names[a.dtype]
    if tf32 is None:
        import torch

        tf32 = torch.backends.cuda.matmul.allow_tf32
    return {
        "m": a.shape[-2],
        "n": b.shape[-1],
        "k": a.shape[-1],
        "batch": a.shape[0] if a.dim() == 3 else 1,
        "layout": la + lb,
        "dtype": dtype,
        "out_dtype": dtype,
        "compute": "tf32" if (tf32 and dtype == "f32") else "f32",
        "align": min(alignment(a, la), alignment(b, lb)),
    }


def sdpa_fields(
    q: Any, k: Any, v: Any, *, causal: str = "none", scale: float | None = None
) -> dict[str, Any]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}"
            )
        if t.dtype != q.dtype:
            raise ValueError(f"dtype mismatch: q is {q.dtype} and {name} is {t.dtype}")
    names = _dtype_names()
    if q.dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(ITEMSIZE)}, got {q.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree in (batch, heads, seq), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q has {q.shape[0]} and k has {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[-1]} and k has {k.shape[-1]}")
    return {
        "batch": q.shape[0],
        "q_heads": q.shape[1],
        "kv_heads": k.shape[1],
        "q_len": q.shape[2],
        "kv_len": k.shape[2],
        "head_dim": q.shape[3],
        "head_dim_v": v.shape[3],
        "causal": causal,
        "dtype": names[q.dtype],
        "scale": scale if scale is not None else 0.0,
    }
