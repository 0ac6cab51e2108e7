"""Problem keys: what a tuned result is valid for.

A key is a frozen, hashable dataclass with a stable string form, used as the primary key in the
SQLite store and in the HTTP API. The string form is ``op:field=value,...`` with the fields in
declaration order, e.g.::

    gemm:m=128,n=4096,k=4096,batch=1,layout=nn,dtype=bf16,out_dtype=bf16,compute=f32,align=16
    sdpa:batch=1,q_heads=32,kv_heads=8,q_len=2048,kv_len=2048,head_dim=128,head_dim_v=128,causal=none,dtype=bf16,scale=0.08838834764831843

Low-bit GEMMs (INT4 weight-only, FP8 scaled) are GEMM keys with a few more fields; each is written
only when it differs from a plain GEMM's value, so plain keys (and the results stored under them)
read exactly as before::

    gemm:m=16,n=4096,k=4096,batch=1,layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16,wdtype=int4,group=128,zeros=float,scale=group
    gemm:m=16,n=4096,k=4096,batch=1,layout=nt,dtype=fp8_e4m3,out_dtype=bf16,compute=f32,align=16,scale=row,accum=f32

``lowbit_fields`` maps the short format names of model configs and the CLI (``int4-g128``,
``fp8-rowwise``, ...) to those fields; ``lowbit_spec`` gives a key's name back.

``parse_key(str(key)) == key`` always holds. Invalid problems raise ``ValueError`` naming the field.
Keys are plain data and import no torch (the fleet service uses them); the torch dtype tables
``DTYPES`` / ``DTYPE_NAMES`` and the tensor helpers load torch on first use.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import TYPE_CHECKING, Any, ClassVar

from tuner.core.guesses import did_you_mean

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

# dtype name -> bytes per element. The names are the ones stored and sent over HTTP.
ITEMSIZE = {"f16": 2, "bf16": 2, "f32": 4}

# GEMM compute modes: "f32" = fp32 accumulation at full precision (IEEE for f32 inputs);
# "tf32" = f32 inputs through the tensor cores' TF32 path.
COMPUTE_MODES = ("f32", "tf32")
LAYOUTS = ("nn", "nt", "tn", "tt")  # first letter: A, second: B; n = row-major, t = column-major
ALIGNMENTS = (16, 8, 4, 2)  # bytes: the largest that divides every pointer and leading stride
CAUSAL_MODES = ("none", "top_left", "bottom_right")

# Low-bit GEMMs. FP8 operands (activations and weights) are 1 byte; INT4 weights are
# torch's packed format with per-group (scale, zero) pairs: w = (q - 8) * scale + zero, which
# is the zero-point mode "float" (the zero is added in the float domain).
FP8 = ("fp8_e4m3", "fp8_e5m2")
WEIGHT_DTYPES = ("int4", *FP8)
INT4_ACTIVATIONS = ("bf16", "f16")
INT4_GROUPS = (32, 64, 128, 256)  # what torch's int4 GEMM accepts
INT4_N_TILE = 8  # torch's tile-packed weight holds N in tiles of 8 rows
INT4_CPU_N_BLOCK = 16  # and its CPU packing in blocks of 16
ZERO_MODES = ("float",)
FP8_SCALES = ("tensor", "row")
ACCUM_MODES = ("f32", "fast")  # fast: the FP8 tensor cores' partial-precision accumulation
FP8_SPEC_SCALES = {"tensorwise": "tensor", "rowwise": "row"}


MAX_DIM = 2**31 - 1  # past any tensor extent a kernel indexes with 32-bit ints


def _check_positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > MAX_DIM:
        raise ValueError(f"{name} must be at most {MAX_DIM}, got {value}")


def leading_dims(m: int, n: int, k: int, layout: str) -> tuple[int, int]:
    """A's and B's leading dimensions where both are dense (each row or column as long as the
    matrix is wide or tall)."""
    return (k if layout[0] == "n" else m), (n if layout[1] == "n" else k)


def allowed_aligns(dtype: str, *leading_dims: int) -> list[int]:
    """The alignment classes (bytes, largest first) that operands of ``dtype`` with these
    leading dimensions can have: every row stays aligned only if its length in bytes is a
    multiple of the class, and no class is below an element's size."""
    item = 1 if dtype in FP8 else ITEMSIZE[dtype]
    return [a for a in ALIGNMENTS if a >= item and all(ld * item % a == 0 for ld in leading_dims)]


def dense_align(dtype: str, *leading_dims: int) -> int:
    """The largest alignment class (bytes) that every leading dimension allows (the smallest
    class where none does: the key then names the problem)."""
    return next(iter(allowed_aligns(dtype, *leading_dims)), ALIGNMENTS[-1])


def default_align(fields: dict[str, Any]) -> int:
    """The alignment of a GEMM given without one (``tune gemm``, a problem list's entry): the
    largest its dense operands allow, as model configs take it, not a fixed 16 that an odd
    shape cannot have. Fields that are not yet a GEMM's give 16: the key then names them."""
    m, n, k = (fields.get(name) for name in "mnk")
    layout, dtype = fields.get("layout", "nn"), fields.get("dtype", "bf16")
    if all(type(d) is int for d in (m, n, k)) and layout in LAYOUTS and dtype in (*ITEMSIZE, *FP8):
        return dense_align(dtype, *leading_dims(m, n, k, layout))  # type: ignore[arg-type]
    return ALIGNMENTS[0]


def _check_choice(name: str, value: Any, allowed: tuple[Any, ...] | dict) -> None:
    if value == "":  # a field left out of a key string
        raise ValueError(f"{name} is missing: it must be one of {sorted(allowed)}")
    if not isinstance(value, (str, int)) or value not in allowed:  # a YAML list is unhashable
        raise ValueError(
            f"{name} must be one of {sorted(allowed)}, got {value!r}{did_you_mean(value, allowed)}"
        )


@dataclass(frozen=True, slots=True)
class GemmKey:
    """C[batch, m, n] = A[batch, m, k] @ B[batch, k, n].

    Low-bit GEMMs are ``x[m, k] @ W[n, k]^T`` (layout ``nt``, batch 1):
    - INT4 weight-only: ``dtype`` bf16/f16 activations, ``wdtype="int4"``, ``group`` size,
      ``zeros="float"`` and ``scale="group"`` (torch's [k / group, n, 2] scales_and_zeros);
    - FP8: ``dtype`` and ``wdtype`` fp8_e4m3/fp8_e5m2 (``wdtype`` defaults to ``dtype``), float32
      dequantization scales per ``scale`` ("tensor" or "row"), ``out_dtype`` bf16/f16/f32, and
      ``accum`` "f32" or "fast" (``_scaled_mm``'s ``use_fast_accum``: another numerical
      contract, so it is keyed, never chosen by the tuner).
    """

    op: ClassVar[str] = "gemm"
    # written into the string only when they differ from a plain GEMM's value
    LOWBIT: ClassVar[tuple[str, ...]] = ("wdtype", "group", "zeros", "scale", "accum")

    m: int
    n: int
    k: int
    batch: int = 1
    layout: str = "nn"
    dtype: str = "bf16"
    out_dtype: str = ""  # "" means dtype (bf16 for FP8 operands), normalised in __post_init__
    compute: str = "f32"
    align: int = 16
    wdtype: str = ""  # weight (B) dtype; "" means "same as dtype", normalised in __post_init__
    group: int = 0  # INT4 group size along k
    zeros: str = ""  # INT4 zero-point mode
    scale: str = ""  # scale granularity: "tensor", "row" (FP8), "group" (INT4)
    accum: str = ""  # FP8 accumulation: "f32" or "fast"

    def __post_init__(self) -> None:
        for name in ("m", "n", "k", "batch"):
            _check_positive(name, getattr(self, name))
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("dtype", self.dtype, (*ITEMSIZE, *FP8))
        if self.wdtype == "":
            object.__setattr__(self, "wdtype", self.dtype)
        _check_choice("wdtype", self.wdtype, (*ITEMSIZE, *WEIGHT_DTYPES))
        if self.out_dtype == "":
            object.__setattr__(self, "out_dtype", "bf16" if self.dtype in FP8 else self.dtype)
        _check_choice("out_dtype", self.out_dtype, ITEMSIZE)
        _check_choice("compute", self.compute, COMPUTE_MODES)
        _check_choice("align", self.align, ALIGNMENTS)
        if self.lowbit:
            self._check_lowbit()
        else:
            self._check_plain()

    @property
    def lowbit(self) -> bool:
        """An INT4 weight-only or FP8 GEMM (not a plain one)."""
        return self.wdtype in WEIGHT_DTYPES or self.dtype in FP8

    def _check_lowbit(self) -> None:
        if self.wdtype not in WEIGHT_DTYPES:
            raise ValueError(
                f"wdtype={self.wdtype!r} is impossible with dtype={self.dtype!r}: FP8 activations "
                f"take FP8 weights, one of {list(FP8)}"
            )
        if self.layout != "nt":
            raise ValueError(
                f"layout must be 'nt' (x @ W.T) for low-bit GEMMs, got {self.layout!r}"
            )
        if self.batch != 1:
            raise ValueError(f"batch must be 1 for low-bit GEMMs, got {self.batch!r}")
        if self.compute != "f32":
            raise ValueError(f"compute must be 'f32' for low-bit GEMMs, got {self.compute!r}")
        if self.wdtype == "int4":
            self._check_int4()
        else:
            self._check_fp8()
        if (self.k * self.itemsize) % self.align:
            raise ValueError(
                f"align={self.align} is impossible: a's leading dimension {self.k} x "
                f"{self.itemsize} bytes is not a multiple of {self.align}{self._aligns(self.k)}"
            )

    def _check_int4(self) -> None:
        _check_choice("dtype", self.dtype, INT4_ACTIVATIONS)
        if self.out_dtype != self.dtype:
            raise ValueError(
                f"out_dtype must equal dtype ({self.dtype!r}) for int4 weights, got {self.out_dtype!r}"
            )
        if self.group == 0:  # left out of a key string
            raise ValueError(
                f"group is missing or 0: it must be one of {list(INT4_GROUPS)} for int4 weights"
            )
        if self.group not in INT4_GROUPS:
            raise ValueError(
                f"group must be one of {list(INT4_GROUPS)} for int4 weights, got {self.group!r}"
            )
        if self.k % self.group:
            raise ValueError(f"group={self.group} must divide k={self.k}")
        if self.n % INT4_N_TILE:
            raise ValueError(
                f"n={self.n} must be a multiple of {INT4_N_TILE} for int4 weights (torch's tile packing; "
                f"of {INT4_CPU_N_BLOCK} to run on a CPU, whose packing takes blocks of {INT4_CPU_N_BLOCK})"
            )
        _check_choice("zeros", self.zeros, ZERO_MODES)
        if self.scale != "group":
            raise ValueError(f"scale must be 'group' for int4 weights, got {self.scale!r}")
        if self.accum:
            raise ValueError(
                f"accum is for FP8 GEMMs only (leave it out for int4 weights), got {self.accum!r}"
            )

    def _check_fp8(self) -> None:
        if self.dtype not in FP8:
            raise ValueError(
                f"dtype must be one of {list(FP8)} with wdtype={self.wdtype!r} (FP8 GEMMs take FP8 "
                f"activations), got {self.dtype!r}"
            )
        if self.dtype == self.wdtype == "fp8_e5m2":
            raise ValueError(
                "wdtype='fp8_e5m2' needs dtype='fp8_e4m3': two e5m2 operands are not supported"
            )
        _check_choice("scale", self.scale, FP8_SCALES)
        _check_choice("accum", self.accum, ACCUM_MODES)
        for name in ("group", "zeros"):
            if getattr(self, name):
                raise ValueError(
                    f"{name} is for int4 weights only, got {getattr(self, name)!r} with wdtype={self.wdtype!r}"
                )

    def _check_plain(self) -> None:
        for name in self.LOWBIT[1:]:
            if getattr(self, name):
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is for low-bit GEMMs only (wdtype one of "
                    f"{list(WEIGHT_DTYPES)}), got wdtype={self.wdtype!r}"
                )
        if self.wdtype != self.dtype:
            raise ValueError(
                f"wdtype must equal dtype ({self.dtype!r}) for plain GEMMs, got {self.wdtype!r}"
            )
        if self.out_dtype != self.dtype:
            raise ValueError(
                f"out_dtype must equal dtype ({self.dtype!r}) for now, got {self.out_dtype!r}"
            )
        if self.compute == "tf32" and self.dtype != "f32":
            raise ValueError(f"compute='tf32' needs dtype='f32', got dtype={self.dtype!r}")
        item = ITEMSIZE[self.dtype]
        lds = leading_dims(self.m, self.n, self.k, self.layout)
        if self.align < item:  # a pointer to such elements is at least item-aligned
            raise ValueError(
                f"align={self.align} is impossible: {self.dtype} elements are {item} bytes"
                f"{self._aligns(*lds)}"
            )
        for name, ld in zip("ab", lds, strict=True):
            if (ld * item) % self.align:
                raise ValueError(
                    f"align={self.align} is impossible: {name}'s leading dimension {ld} x {item} bytes "
                    f"is not a multiple of {self.align}{self._aligns(*lds)}"
                )

    def _aligns(self, *lds: int) -> str:
        """What an impossible alignment's message adds: the ones this shape allows."""
        return f"; this shape allows align {', '.join(map(str, allowed_aligns(self.dtype, *lds)))}"

    @property
    def itemsize(self) -> int:
        """Bytes per activation (A) element."""
        return 1 if self.dtype in FP8 else ITEMSIZE[self.dtype]

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def weight_bytes(self) -> int:
        """Bytes of B as stored: packed nibbles and their scales for int4, one per element for
        FP8 (plus its scales), the plain element size otherwise."""
        if self.wdtype == "int4":
            return self.n * self.k // 2 + (self.k // self.group) * self.n * 2 * ITEMSIZE[self.dtype]
        if self.wdtype in FP8:
            return self.n * self.k + 4 * (self.n if self.scale == "row" else 1)
        return self.batch * self.k * self.n * ITEMSIZE[self.dtype]

    @property
    def min_bytes(self) -> int:
        """Each input read once, the output written once: the memory floor."""
        a = self.batch * self.m * self.k * self.itemsize
        if self.dtype in FP8:
            a += 4 * (self.m if self.scale == "row" else 1)
        return a + self.weight_bytes + self.batch * self.m * self.n * ITEMSIZE[self.out_dtype]

    @property
    def label(self) -> str:
        """Short human form for tables, e.g. ``128x4096x4096 nt bf16``; not parseable."""
        extras = [f"batch {self.batch}"] * (self.batch > 1) + ["tf32"] * (self.compute == "tf32")
        extras += [f"align {self.align}"] * (self.align != 16)
        if self.lowbit:
            extras = [lowbit_spec(self), *extras]
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
    scale: float = 0.0  # 0, or 1/sqrt(head_dim) written any way, is the default: normalised

    def __post_init__(self) -> None:
        for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
            _check_positive(name, getattr(self, name))
        if self.head_dim_v == 0:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _check_positive("head_dim_v", self.head_dim_v)
        default = 1.0 / math.sqrt(self.head_dim)
        # models write the default scale as head_dim ** -0.5, a float rounding away from
        # 1 / sqrt(head_dim): one problem, so one key (the kernels' results cannot tell them apart)
        if self.scale == 0.0 or (
            isinstance(self.scale, float) and math.isclose(self.scale, default, rel_tol=1e-12)
        ):
            object.__setattr__(self, "scale", default)
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
        """Short human form for tables, e.g. ``attn b1 h32/8 q2048 kv2048 d128 top_left bf16``
        (``dv64`` where V's head dim differs, ``scale 0.5`` where the scale is not the default);
        not parseable."""
        dims = f"d{self.head_dim}" + (
            f" dv{self.head_dim_v}" if self.head_dim_v != self.head_dim else ""
        )
        extras = [self.causal] * (self.causal != "none") + [self.dtype]
        if self.scale != 1.0 / math.sqrt(self.head_dim):
            extras.append(f"scale {self.scale:g}")
        shape = f"attn b{self.batch} h{self.q_heads}/{self.kv_heads} q{self.q_len} kv{self.kv_len}"
        return " ".join([shape, dims, *extras])

    @classmethod
    def from_tensors(
        cls, q: Any, k: Any, v: Any, *, causal: str = "none", scale: float | None = None
    ) -> SdpaKey:
        return cls(**sdpa_fields(q, k, v, causal=causal, scale=scale))

    def __str__(self) -> str:
        return _to_str(self)


Key = GemmKey | SdpaKey
KEY_TYPES: dict[str, type[GemmKey] | type[SdpaKey]] = {"gemm": GemmKey, "sdpa": SdpaKey}


def _written(key: Key, name: str, value: Any) -> bool:
    """Every field but a low-bit GEMM field that holds a plain GEMM's value."""
    if not isinstance(key, GemmKey) or name not in GemmKey.LOWBIT:
        return True
    return value != (key.dtype if name == "wdtype" else "" if isinstance(value, str) else 0)


def _to_str(key: Key) -> str:
    parts = ((f.name, getattr(key, f.name)) for f in fields(key))
    return (
        key.op
        + ":"
        + ",".join(f"{n}={v!r}".replace("'", "") for n, v in parts if _written(key, n, v))
    )


FP8_FORMATS = tuple(f"fp8-{g}{fast}" for fast in ("", "-fast") for g in FP8_SPEC_SCALES)
LOWBIT_FORMATS = (*(f"int4-g{group}" for group in INT4_GROUPS), *FP8_FORMATS)
LOWBIT_FORMAT_NAMES = ", ".join(["int4-g" + "/".join(map(str, INT4_GROUPS)), *FP8_FORMATS])


def lowbit_fields(spec: str) -> dict[str, Any]:
    """The GemmKey fields of a low-bit format name, as model configs, ``tune-all`` and the bench
    suite write it: ``int4-g{32,64,128,256}`` (bf16 activations), ``fp8-tensorwise`` and
    ``fp8-rowwise`` (e4m3 operands, bf16 out, f32 accumulation), ``fp8-...-fast`` (fast
    accumulation). Every low-bit GEMM is ``x @ W.T``, so ``layout`` is part of the answer."""
    if not isinstance(spec, str):
        raise ValueError(f"low-bit format must be one of {LOWBIT_FORMAT_NAMES}, got {spec!r}")
    kind, _, rest = spec.partition("-")
    if kind == "int4" and rest in {f"g{group}" for group in INT4_GROUPS}:  # "g128", as written
        return {"layout": "nt", "dtype": "bf16", "out_dtype": "bf16", "wdtype": "int4",
                "group": int(rest[1:]), "zeros": "float", "scale": "group", "accum": ""}  # fmt: skip
    granularity, _, fast = rest.partition("-")
    if kind == "fp8" and granularity in FP8_SPEC_SCALES and fast in ("", "fast"):
        return {"layout": "nt", "dtype": "fp8_e4m3", "out_dtype": "bf16", "wdtype": "fp8_e4m3",
                "group": 0, "zeros": "", "scale": FP8_SPEC_SCALES[granularity],
                "accum": fast or "f32"}  # fmt: skip
    raise ValueError(
        f"low-bit format must be one of {LOWBIT_FORMAT_NAMES}, got {spec!r}"
        f"{did_you_mean(spec, LOWBIT_FORMATS)}"
    )


FP8_MULTIPLE = 16  # torch._scaled_mm, every FP8 key's baseline, takes K and N multiples of 16


def fp8_shape_error(n: int, k: int) -> str | None:
    """Why an FP8 GEMM of an [N, K] weight cannot run as ``torch._scaled_mm`` runs it, or None.
    Checked where problems are made (model configs, problem lists, ``quantize_linear``), not in
    the key itself, so that a cache holding such a key still reads."""
    if k % FP8_MULTIPLE or n % FP8_MULTIPLE:
        return (f"fp8 needs K and N multiples of {FP8_MULTIPLE}, as torch._scaled_mm takes them "
                f"(N={n}, K={k})")  # fmt: skip
    return None


def fp8_key_error(key: Key) -> str | None:
    """``fp8_shape_error`` of an FP8 GEMM key; None for any other key."""
    if isinstance(key, GemmKey) and key.wdtype.startswith("fp8"):
        return fp8_shape_error(key.n, key.k)
    return None


def lowbit_spec(key: GemmKey) -> str:
    """The format name of a low-bit key (the inverse of ``lowbit_fields`` where one exists;
    other operand dtypes are named in full, e.g. ``int4-g128-f16``, ``fp8-rowwise-e5m2``), or ""
    for a plain GEMM."""
    if not key.lowbit:
        return ""
    if key.wdtype == "int4":
        return f"int4-g{key.group}" + ("" if key.dtype == "bf16" else f"-{key.dtype}")
    granularity = {v: k for k, v in FP8_SPEC_SCALES.items()}[key.scale]
    dtypes = "" if key.dtype == key.wdtype == "fp8_e4m3" else f"-{key.dtype[4:]}x{key.wdtype[4:]}"
    return f"fp8-{granularity}{dtypes}" + ("-fast" if key.accum == "fast" else "")


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
    """Inverse of ``str(key)``. Raises ValueError with the offending part. A GEMM key typed
    without ``align`` takes the largest its shape allows (``default_align``), as ``tune gemm``
    does: ``str(key)`` always names it."""
    op, body = _split(text)
    cls = KEY_TYPES[op]
    types = {f.name: f.type for f in fields(cls)}
    values: dict[str, Any] = {}
    for part in body.split(",") if body else []:
        if not part:
            raise ValueError(f"empty field in {op} key {text!r} (two commas, or one at an end)")
        name, eq, raw = part.partition("=")
        if not eq or name not in types:
            raise ValueError(f"unknown field {name!r} in {op} key; allowed: {sorted(types)}")
        if name in values:
            raise ValueError(f"field {name!r} given twice in {op} key {text!r}")
        values[name] = _convert(name, raw, types[name])
    _check_complete(cls, values, f"{op} key {text!r}")
    if cls is GemmKey and "align" not in values:
        values["align"] = default_align(values)
    return cls(**values)


def spelt_now(text: str) -> str:
    """A stored key as this release spells it (an SDPA key's default scale written another
    way, by an older release, becomes the default's); a key it cannot parse stays as it is."""
    try:
        return str(parse_key(text))
    except ValueError:
        return text


def required_fields(cls: type) -> list[str]:
    """The fields of dataclass ``cls`` that have no default."""
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


def _check_complete(
    cls: type, values: dict[str, Any], what: str, defaulted: Iterable[str] = ()
) -> None:
    """ValueError naming the required fields of ``cls`` that ``values`` lacks (the fields
    ``defaulted`` by the caller are not asked for)."""
    required = [name for name in required_fields(cls) if name not in defaulted]
    missing = [name for name in required if name not in values]
    if missing:
        raise ValueError(f"incomplete {what}: missing {', '.join(missing)} (required: {required})")


def _convert(name: str, raw: str, type_name: str) -> Any:
    try:
        if type_name == "int":
            if not re.fullmatch(r"-?[0-9]+", raw):  # int() takes "4_0", " 4" and other digits
                raise ValueError(raw)
            return int(raw)
        if type_name == "float":
            return float(raw)
    except ValueError:
        kind = "an integer" if type_name == "int" else "a number"
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    return raw


def key_from_dict(op: str, data: dict[str, Any], defaults: dict[str, Any] | None = None) -> Key:
    """Build a key from a JSON object (API bodies, YAML configs), naming bad fields; the fields
    of ``defaults`` may be left out."""
    defaults = defaults or {}
    if not isinstance(op, str) or op not in KEY_TYPES:
        raise ValueError(f"op must be one of {sorted(KEY_TYPES)}, got {op!r}")
    cls = KEY_TYPES[op]
    allowed = {f.name for f in fields(cls)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} for {op}; allowed: {sorted(allowed)}")
    _check_complete(cls, data, f"{op} problem", defaulted=defaults)
    return cls(**(defaults | data))


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
    if a.device != b.device:
        raise ValueError(f"device mismatch: a is on {a.device} and b on {b.device}")
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
        if t.device != q.device:
            raise ValueError(f"device mismatch: q is on {q.device} and {name} on {t.device}")
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
    if scale is not None and scale == 0:  # a key's 0.0 stands for the default 1 / sqrt(head_dim)
        raise ValueError("scale=0.0: uniform attention, outside the keys")
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
