"""PyTorch TunableOp CSV files: read their GEMMs as problem keys, write winners back in their format.

TunableOp (``torch.cuda.tunable``, aten/src/ATen/cuda/tunable) writes two kinds of file:

- results (``PYTORCH_TUNABLEOP_FILENAME``, default ``tunableop_results<device>.csv``)::

      Validator,PT_VERSION,2.11.0
      GemmTunableOp_BFloat16_TN,tn_4096_1_4096_ld_4096_4096_4096,Default,0.0123

  ``Validator,<name>,<value>`` lines, then ``<op>,<params>,<solution>,<time in ms>`` lines;
- untuned shapes (``PYTORCH_TUNABLEOP_RECORD_UNTUNED=1``, ``tunableop_untuned<device>.csv``):
  ``<op>,<params>`` lines only, optionally followed by ``,BLAS_PARAMS: {...}``
  (``PYTORCH_TUNABLEOP_BLAS_LOG=1``).

``<op>`` is ``GemmTunableOp_<type>_<AB>``, ``GemmStridedBatchedTunableOp_<type>_<AB>`` or
``GemmAndBiasTunableOp_<type>_<AB>`` (type float, Half, BFloat16; A and B each N or T).
``<params>`` is ``<ab>_<m>_<n>_<k>`` (PyTorch <= 2.5), then ``_ld_<lda>_<ldb>_<ldc>``
(2.6 and later); batched ones put ``_B_<batch>`` after k.

TunableOp speaks BLAS, which is column-major. PyTorch computes a row-major ``C = A @ B``
(C is M x N) as the column-major ``C^T = B^T A^T``, so in a TunableOp line:

    BLAS m = our N,   BLAS n = our M,   BLAS k = our K
    BLAS A = our B:   transa N <=> B row-major (our 'n'),  lda = N if row-major else K
    BLAS B = our A:   transb N <=> A row-major (our 'n'),  ldb = K if row-major else M
    ldc = N (the row-major output)

So ``F.linear(x, W)`` with x (M, K) and W (N, K), our layout ``nt``, is
``GemmTunableOp_<type>_TN,tn_<N>_<M>_<K>_ld_<K>_<K>_<N>`` (e.g. x 100 x 20, W 200 x 20 gives
``tn_200_100_20``). Leading dimensions larger than the extents (a padded or sliced matrix)
lower the key's alignment class accordingly; the key has no room for the padding itself.

TunableOp's line does not say whether a float GEMM ran with TF32: ``float`` maps to
``compute=f32`` unless its BLAS_PARAMS say ``compute_type: xf32_r``. GemmAndBias lines become
plain GEMM keys (the bias epilogue is not part of a key). fp8 (ScaledGemmTunableOp), double,
complex and dynamic-shape wildcard (``*``) lines are skipped with the reason.

Export writes a results file of the winners TunableOp can run itself: the baseline (torch's
``cuBLAS`` default, TunableOp's ``Default``) and cuBLASLt algorithms given by their full config
(``Gemm_Cublaslt_id_<id>_tile_..._cluster_<c>``, the names PyTorch's CUDA TunableOp rebuilds
an algorithm from). Triton and CUTLASS winners have no TunableOp counterpart and are listed as
skipped. ``Validator,PT_VERSION`` must equal the consuming PyTorch's version or TunableOp
ignores the whole file.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tuner.core.keys import GemmKey, dense_align, lowbit_spec, parse_key
from tuner.measure.records import Winner
from tuner.offline.model_config import gemm_key
from tuner.offline.problem_list import ConfigError

TYPES = {"float": "f32", "Half": "f16", "BFloat16": "bf16"}
TYPE_NAMES = {v: k for k, v in TYPES.items()}
OPS = ("GemmTunableOp", "GemmStridedBatchedTunableOp", "GemmAndBiasTunableOp")
_OP_RE = re.compile(r"^(?P<op>[A-Za-z]+TunableOp)_(?P<type>.+)_(?P<ta>[NT])(?P<tb>[NT])$")
_PARAMS_RE = re.compile(
    r"^(?P<ab>[nt]{2})_(?P<m>\d+)_(?P<n>\d+)_(?P<k>\d+)"
    r"(?:_B_(?P<batch>\d+))?(?:_ld_(?P<lda>\d+)_(?P<ldb>\d+)_(?P<ldc>\d+))?$"
)
# cublasLtMatmulAlgo config attributes in the order of PyTorch's cuBLASLt solution names, with
# the value an unset attribute has (split-K 1: no split)
CUBLASLT_NAME_ATTRS = {
    "ID": 0, "TILE_ID": 0, "STAGES_ID": 0, "SPLITK_NUM": 1, "REDUCTION_SCHEME": 0,
    "CTA_SWIZZLING": 0, "CUSTOM_OPTION": 0, "INNER_SHAPE_ID": 0, "CLUSTER_SHAPE_ID": 0,
}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One GEMM line of a TunableOp file."""

    line: int
    op: str  # e.g. GemmTunableOp_BFloat16_TN
    params: str  # e.g. tn_4096_1_4096_ld_4096_4096_4096
    solution: str | None = None  # None in untuned files
    time_ms: float | None = None
    blas: str = ""  # the BLAS_PARAMS text, when logged


@dataclass
class TunableOpFile:
    path: Path
    validators: dict[str, str] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if not self.entries and not self.validators:
            return "empty"
        return "results" if any(e.solution is not None for e in self.entries) else "untuned"


def read(path: str | Path) -> TunableOpFile:
    """Parse a results or untuned file the way TunableOp's own reader splits it (on commas)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (expected a TunableOp CSV)") from None
    out = TunableOpFile(path)
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        blas = ""
        if ",BLAS_PARAMS:" in line:
            line, _, blas = line.partition(",BLAS_PARAMS:")
        parts = line.split(",")
        if parts[0] == "Validator" and len(parts) >= 3:
            out.validators[parts[1]] = parts[2]
        elif len(parts) >= 2 and "TunableOp_" in parts[0]:
            time_ms = _float(parts[3]) if len(parts) >= 4 else None
            if len(parts) >= 4 and time_ms is None:
                raise ConfigError(
                    f"{path}:{no}: time {parts[3]!r} is not a number of milliseconds: {raw[:120]!r}"
                )
            solution = parts[2] if len(parts) >= 3 else None
            out.entries.append(Entry(no, parts[0], parts[1], solution, time_ms, blas.strip()))
        else:
            raise ConfigError(
                f"{path}:{no}: not a TunableOp line (expected 'Validator,<name>,<value>' or "
                f"'<Op>TunableOp_<type>_<AB>,<params>[,<solution>,<ms>]'): {raw[:120]!r}"
            )
    return out


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def entry_key(entry: Entry) -> GemmKey:
    """The problem key of a TunableOp line; ValueError says why a line has none."""
    op = _OP_RE.match(entry.op)
    if op is None and re.match(r"^[A-Za-z]+TunableOp_.+_[^_]+$", entry.op):
        transpose = entry.op.rsplit("_", 1)[1]
        raise ValueError(f"transpose {transpose!r} of {entry.op!r}: must be NN, NT, TN or TT")
    if op is None or op["op"] not in OPS:
        raise ValueError(f"unsupported TunableOp operator {entry.op!r}; supported: {list(OPS)}")
    if op["type"] not in TYPES:
        raise ValueError(f"unsupported data type {op['type']!r}; supported: {sorted(TYPES)}")
    if "*" in entry.params:
        raise ValueError("dynamic-shape wildcard entry (no concrete shape to tune)")
    p = _PARAMS_RE.match(entry.params)
    if p is None:
        raise ValueError(
            f"params {entry.params!r} are not '<ab>_<m>_<n>_<k>[_B_<batch>][_ld_<lda>_<ldb>_<ldc>]'"
        )
    if p["ab"].upper() != op["ta"] + op["tb"]:
        raise ValueError(f"params {entry.params!r} disagree with operator {entry.op!r}")
    if (p["batch"] is not None) != (op["op"] == "GemmStridedBatchedTunableOp"):
        raise ValueError(f"params {entry.params!r} and operator {entry.op!r} disagree on batching")
    bm, bn, k = int(p["m"]), int(p["n"]), int(p["k"])
    # BLAS A is our B and BLAS B is our A (see the module docstring)
    layout = ("n" if p["ab"][1] == "n" else "t") + ("n" if p["ab"][0] == "n" else "t")
    dtype = TYPES[op["type"]]
    if dtype == "f32" and "xf32_r" in entry.blas:
        dtype = "tf32"
    key = gemm_key(bn, bm, k, layout=layout, dtype=dtype, batch=int(p["batch"] or 1))
    if p["lda"] is not None:
        lds = (int(p["lda"]), int(p["ldb"]))
        dense = _leading_dims(key)
        if any(ld < d for ld, d in zip(lds, dense, strict=True)):
            raise ValueError(f"leading dimensions {lds} smaller than the matrix extents {dense}")
        align = min(key.align, dense_align(key.dtype, *lds))
        if align != key.align:
            key = dataclasses.replace(key, align=align)
    return key


def _leading_dims(key: GemmKey) -> tuple[int, int]:
    """(lda, ldb) in BLAS terms for a dense key: BLAS A is our B, BLAS B is our A."""
    lda = key.n if key.layout[1] == "n" else key.k
    ldb = key.k if key.layout[0] == "n" else key.m
    return lda, ldb


@dataclass
class Imported:
    found: dict[GemmKey, tuple[Path, Entry]]  # key -> the first line that names it
    skipped: list[tuple[Path, Entry, str]]  # (file, line, reason)
    files: list[TunableOpFile]

    @property
    def keys(self) -> list[GemmKey]:
        return list(self.found)


def import_files(paths: Iterable[str | Path]) -> Imported:
    """The de-duplicated GEMM keys of TunableOp files, and the lines that gave none."""
    out = Imported({}, [], [])
    for path in paths:
        f = read(path)
        out.files.append(f)
        for e in f.entries:
            try:
                out.found.setdefault(entry_key(e), (f.path, e))
            except ValueError as err:
                out.skipped.append((f.path, e, str(err)))
    return out


# --- export ------------------------------------------------------------------------------------


def signature(key: GemmKey) -> tuple[str, str]:
    """(operator, params) of a key as PyTorch >= 2.6 writes them; ValueError if inexpressible."""
    if key.lowbit:  # its dtype is the activations': a GemmTunableOp line would name a bf16 GEMM
        raise ValueError(f"low-bit weights ({lowbit_spec(key)}) have no GemmTunableOp line")
    if key.dtype not in TYPE_NAMES:
        raise ValueError(f"dtype {key.dtype!r} has no TunableOp type")
    if key.compute == "tf32":
        raise ValueError(
            "TunableOp's line has no TF32 marker (its float GEMMs follow the process's TF32 switch)"
        )
    ta = "n" if key.layout[1] == "n" else "t"  # BLAS A = our B
    tb = "n" if key.layout[0] == "n" else "t"  # BLAS B = our A
    lda, ldb = _leading_dims(key)
    op = "GemmTunableOp" if key.batch == 1 else "GemmStridedBatchedTunableOp"
    batch = "" if key.batch == 1 else f"_B_{key.batch}"
    params = f"{ta}{tb}_{key.n}_{key.m}_{key.k}{batch}_ld_{lda}_{ldb}_{key.n}"
    return f"{op}_{TYPE_NAMES[key.dtype]}_{(ta + tb).upper()}", params


def cublaslt_solution(config: dict[str, int]) -> str:
    """PyTorch's name of a cuBLASLt algorithm (GemmCublasLt: CublasltAlgoConfigName), from its
    config attribute values; PyTorch's CUDA TunableOp rebuilds the algorithm from this name."""
    v = [int(config.get(attr, default)) for attr, default in CUBLASLT_NAME_ATTRS.items()]
    return (
        "Gemm_Cublaslt_id_{}_tile_{}_stages_{}_splitk_{}_red_{}_swizzle_{}_custom_{}"
        "_inner_{}_cluster_{}".format(*v)
    )


def _cublaslt_config(params: dict) -> dict[str, int]:
    """Config attribute values of a stored cuBLASLt winner (the cublaslt source's own mapping)."""
    try:
        from tuner.candidates.cublaslt import NAMED_ATTRS, _enums, to_config
    except ImportError as e:
        raise ValueError(f"the cublaslt source cannot be loaded here ({e})") from None
    named = any(isinstance(params.get(p), str) for p in NAMED_ATTRS)
    try:
        enums = _enums() if named else {}
    except ImportError:
        raise ValueError(
            "its tile/stages/cluster names need nvmath-python to become numbers: "
            "export on a host with the cu12/cu13 extra"
        ) from None
    return to_config(params, enums)


def solution_name(winner: Winner) -> str:
    """TunableOp's name for the winning kernel; ValueError if it has none."""
    if winner.source == "torch":
        return "Default"
    if winner.source == "cublaslt":
        return cublaslt_solution(_cublaslt_config(winner.params))
    raise ValueError(f"source {winner.source!r} has no TunableOp counterpart")


@dataclass
class Export:
    lines: list[str]
    written: int
    skipped: list[tuple[str, str]]  # (key, reason)


def export(winners: Iterable[Winner], pt_version: str) -> Export:
    """A TunableOp results file (as lines) of the winners it can express."""
    lines = [f"Validator,PT_VERSION,{pt_version}"]
    skipped: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    # TunableOp has no alignment class: where several keys share a line, the aligned one wins
    for w in sorted(winners, key=lambda w: -getattr(parse_key(w.key), "align", 16)):
        try:
            key = parse_key(w.key)
            if not isinstance(key, GemmKey):
                raise ValueError("TunableOp tunes GEMMs only")
            sig = signature(key)
            name = solution_name(w)
        except ValueError as e:
            skipped.append((w.key, str(e)))
            continue
        if sig in seen:  # same TunableOp line from another alignment class: keep the first
            skipped.append((w.key, f"duplicate of {sig[0]},{sig[1]}"))
            continue
        seen.add(sig)
        lines.append(f"{sig[0]},{sig[1]},{name},{w.median_us / 1000:.6g}")
    return Export(lines, len(lines) - 1, skipped)


# a PT_VERSION validator's value: a release, as torch_version_tag makes it (a comma or a line
# break would break the CSV)
PT_VERSION = re.compile(r"\d+(\.\d+)+([a-z]+\d*)?")


def torch_version_tag(version: str) -> str:
    """PyTorch's TORCH_VERSION as TunableOp validates it: the release without a local suffix."""
    return version.split("+", 1)[0]
