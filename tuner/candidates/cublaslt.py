"""cuBLASLt algorithms through nvmath-python's bindings (``nvmath.bindings.cublasLt``).

Candidates are the heuristic's top algorithms for the problem (``HEURISTIC_LIMIT`` asked for).
Each is serialised by its config attributes, which is what makes a cublasLtMatmulAlgo_t::

    {"id": 28, "tile": "128x256", "stages": "64x4", "cluster": "2x1x1", "split_k": 1,
     "reduction": 0, "swizzle": 0, "custom": 0, "inner_shape": 0}

``build`` rebuilds the algorithm exactly (cublasLtMatmulAlgoInit + ConfigSetAttribute for each
attribute) and re-checks it against this problem (cublasLtMatmulAlgoCheck): a stored winner that
the installed cuBLASLt no longer supports raises, so the dispatcher drops it. Should the rebuilt
struct fail the check although the heuristic still offers the same configuration, the heuristic's
own struct is used. The hot path calls ``cublasLtMatmul`` directly with descriptors prepared once
per stride signature (no planning per call), on torch's current stream; a call on strides seen
before works out no column-major call and calls no cuBLASLt function but the matmul (and, for
FP8, the attribute of a scale pointer that moved).
"""

from __future__ import annotations

import enum
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import GemmKey

HEURISTIC_LIMIT = 16
SUCCESS = 0  # cublasStatus_t of a usable heuristic result

# param name -> (MatmulAlgoConfigAttribute member, enum class name, enum member prefix).
# Named params are stored as the enum's member name without its prefix ("128x256"), so that
# stored winners are readable; the rest are plain integers.
NAMED_ATTRS = {
    "tile": ("TILE_ID", "MatmulTile", "TILE_"),
    "stages": ("STAGES_ID", "MatmulStages", "STAGES_"),
    "cluster": ("CLUSTER_SHAPE_ID", "ClusterShape", "SHAPE_"),
}
PLAIN_ATTRS = {
    "id": "ID",
    "split_k": "SPLITK_NUM",
    "reduction": "REDUCTION_SCHEME",
    "swizzle": "CTA_SWIZZLING",
    "custom": "CUSTOM_OPTION",
    "inner_shape": "INNER_SHAPE_ID",
}
PARAM_NAMES = ("id", *NAMED_ATTRS, *(p for p in PLAIN_ATTRS if p != "id"))


# --- params <-> config attributes (pure Python, tested on the CPU) ------------------------------


def to_params(config: Mapping[str, int], enums: Mapping[str, type[enum.IntEnum]]) -> Params:
    """Params from config attribute values ({"TILE_ID": 7, ...}) of an algorithm."""
    params: Params = {p: int(config[attr]) for p, attr in PLAIN_ATTRS.items() if attr in config}
    for p, (attr, enum_name, prefix) in NAMED_ATTRS.items():
        if attr not in config:
            continue
        value = int(config[attr])
        try:
            params[p] = enums[enum_name](value).name.removeprefix(prefix)
        except ValueError:  # a value this nvmath does not name: keep the integer
            params[p] = value
    return {p: params[p] for p in PARAM_NAMES if p in params}


def to_config(params: Params, enums: Mapping[str, type[enum.IntEnum]]) -> dict[str, int]:
    """Config attribute values from params; ValueError names a bad or unknown entry."""
    unknown = set(params) - set(PARAM_NAMES)
    if unknown:
        raise ValueError(f"unknown cublaslt params {sorted(unknown)}; allowed: {list(PARAM_NAMES)}")
    if "id" not in params:
        raise ValueError("cublaslt params need the algorithm 'id'")
    config: dict[str, int] = {}
    for p, attr in PLAIN_ATTRS.items():
        if p in params:
            v = params[p]
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"cublaslt param {p!r} must be an integer, got {v!r}")
            config[attr] = v
    for p, (attr, enum_name, prefix) in NAMED_ATTRS.items():
        if p not in params:
            continue
        v = params[p]
        if isinstance(v, int) and not isinstance(v, bool):
            config[attr] = v
            continue
        try:
            config[attr] = int(enums[enum_name][prefix + str(v)])
        except KeyError:
            raise ValueError(f"cublaslt param {p!r}: unknown {enum_name} {v!r}") from None
    return config


# --- the library -----------------------------------------------------------------------------


@functools.cache
def _lt() -> Any:
    from nvmath.bindings import cublasLt

    return cublasLt


def _enums() -> dict[str, type[enum.IntEnum]]:
    lt = _lt()
    return {name: getattr(lt, name) for _, name, _ in NAMED_ATTRS.values()}


def _set(setter: Any, dtype_of: Any, handle: int, attr: Any, value: int) -> None:
    buf = np.array([value], dtype=dtype_of(attr))
    setter(handle, attr, buf.ctypes.data, buf.itemsize)


def _get(getter: Any, dtype_of: Any, handle: int, attr: Any) -> int:
    buf = np.zeros(1, dtype=dtype_of(attr))
    written = np.zeros(1, dtype=np.uint64)
    getter(handle, attr, buf.ctypes.data, buf.itemsize, written.ctypes.data)
    return int(buf[0])


def read_config(algo: np.ndarray) -> dict[str, int]:
    """Config attribute values of a cublasLtMatmulAlgo_t held in a numpy array."""
    lt = _lt()
    attrs = [attr for attr, _, _ in NAMED_ATTRS.values()] + list(PLAIN_ATTRS.values())
    return {
        a: _get(
            lt.matmul_algo_config_get_attribute,
            lt.get_matmul_algo_config_attribute_dtype,
            algo.ctypes.data,
            lt.MatmulAlgoConfigAttribute[a],
        )
        for a in attrs
    }


_HANDLES = ops.DeviceHandles(lambda: _lt().create())


@dataclass(frozen=True)
class MatmulTypes:
    """What a cuBLASLt matmul is besides its shape, which the heuristic, the algorithm check and
    every call must agree on: compute and data types, and further matmul descriptor attributes
    (``MatmulDescAttribute`` name, value) such as FP8 scale modes."""

    compute: int  # cublasComputeType_t
    first: int  # cudaDataType_t of the column-major call's first operand (our B)
    second: int  # of its second operand (our A)
    out: int  # of C and D
    attrs: tuple[tuple[str, int], ...] = ()

    @classmethod
    def dense(cls, key: GemmKey) -> MatmulTypes:
        dt = ops.CUDA_DTYPE[key.dtype]
        return cls(ops.compute_type(key), dt, dt, ops.CUDA_DTYPE[key.out_dtype])


@dataclass
class _Pointer:
    """A pointer attribute of a matmul descriptor: its value buffer (address taken once) and
    the value last set (None: never)."""

    attr: int
    buffer: np.ndarray
    address: int
    value: int | None = None

    @classmethod
    def of(cls, name: str) -> _Pointer:
        lt = _lt()
        attr = lt.MatmulDescAttribute[name]
        buffer = np.zeros(1, dtype=lt.get_matmul_desc_attribute_dtype(attr))
        return cls(int(attr), buffer, buffer.ctypes.data)


@dataclass(frozen=True)
class _Alignments:
    a: int
    b: int
    c: int

    @classmethod
    def of(cls, key: GemmKey) -> _Alignments:
        return cls(key.align, key.align, ops.out_alignment(key))


class _Descriptors:
    """Matmul and matrix-layout descriptors of one column-major call, destroyed with the object."""

    def __init__(
        self, key: GemmKey, call: ops.ColMajorCall, types: MatmulTypes | None = None
    ) -> None:
        lt = _lt()
        types = types or MatmulTypes.dense(key)
        self.desc = lt.matmul_desc_create(types.compute, ops.CUDA_R_32F)
        weakref.finalize(self, lt.matmul_desc_destroy, self.desc)
        self._pointers: dict[str, _Pointer] = {}
        attrs = (("TRANSA", call.trans_first), ("TRANSB", call.trans_second), *types.attrs)
        for name, value in attrs:
            self.set(name, value)
        (rb, cb), (ra, ca), (rc, cc) = ops.stored_shapes(key)
        self.first = self._layout(key, types.first, rb, cb, call.ld_first, call.stride_first)
        self.second = self._layout(key, types.second, ra, ca, call.ld_second, call.stride_second)
        self.out = self._layout(key, types.out, rc, cc, call.ld_out, call.stride_out)

    def set(self, name: str, value: int) -> None:
        """Set the matmul descriptor's attribute ``name`` (a ``MatmulDescAttribute`` member)."""
        lt = _lt()
        _set(
            lt.matmul_desc_set_attribute,
            lt.get_matmul_desc_attribute_dtype,
            self.desc,
            lt.MatmulDescAttribute[name],
            value,
        )

    def point(self, name: str, pointer: int) -> None:
        """Set the pointer attribute ``name`` (FP8 scales), skipped while it does not move: one
        write into a buffer bound once and one attribute call when it does."""
        held = self._pointers.get(name)
        if held is None:
            held = self._pointers[name] = _Pointer.of(name)
        if held.value != pointer:
            held.buffer[0] = pointer
            _lt().matmul_desc_set_attribute(
                self.desc, held.attr, held.address, held.buffer.itemsize
            )
            held.value = pointer

    def _layout(self, key: GemmKey, dtype: int, rows: int, cols: int, ld: int, stride: int) -> int:
        lt = _lt()
        layout = lt.matrix_layout_create(dtype, rows, cols, ld)
        weakref.finalize(self, lt.matrix_layout_destroy, layout)
        if key.batch > 1:
            attr, dtype_of = lt.MatrixLayoutAttribute, lt.get_matrix_layout_attribute_dtype
            _set(lt.matrix_layout_set_attribute, dtype_of, layout, attr.BATCH_COUNT, key.batch)
            _set(
                lt.matrix_layout_set_attribute,
                dtype_of,
                layout,
                attr.STRIDED_BATCH_OFFSET,
                stride,
            )
        return layout

    def heuristic(self, handle: int, align: _Alignments, limit: int) -> np.ndarray:
        """The heuristic's results (a numpy array of cublasLtMatmulHeuristicResult_t)."""
        lt = _lt()
        pref = lt.matmul_preference_create()
        try:
            attr, dtype_of = lt.MatmulPreferenceAttribute, lt.get_matmul_preference_attribute_dtype
            for a, v in (
                (attr.MAX_WORKSPACE_BYTES, ops.WORKSPACE_BYTES),
                (attr.MIN_ALIGNMENT_A_BYTES, align.a),
                (attr.MIN_ALIGNMENT_B_BYTES, align.b),
                (attr.MIN_ALIGNMENT_C_BYTES, align.c),
                (attr.MIN_ALIGNMENT_D_BYTES, align.c),
            ):
                _set(lt.matmul_preference_set_attribute, dtype_of, pref, a, v)
            results = np.zeros(limit, dtype=lt.matmul_heuristic_result_dtype)
            count = np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(
                handle, self.desc, self.first, self.second, self.out, self.out, pref, limit,
                results.ctypes.data, count.ctypes.data,
            )  # fmt: skip
        finally:
            lt.matmul_preference_destroy(pref)
        found = results[: int(count[0])]
        return found[found["state"] == SUCCESS]

    def check(self, handle: int, algo: np.ndarray) -> int:
        """Workspace bytes ``algo`` needs here; raises if it does not support this problem."""
        lt = _lt()
        result = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        lt.matmul_algo_check(
            handle, self.desc, self.first, self.second, self.out, self.out,
            algo.ctypes.data, result.ctypes.data,
        )  # fmt: skip
        if int(result["state"][0]) != SUCCESS:
            raise ValueError(f"cublasLtMatmulAlgoCheck state {int(result['state'][0])}")
        return int(result["workspace_size"][0])


def init_algo(
    key: GemmKey, handle: int, config: Mapping[str, int], types: MatmulTypes | None = None
) -> np.ndarray:
    """A cublasLtMatmulAlgo_t built from its config attributes (AlgoInit + ConfigSetAttribute)."""
    lt = _lt()
    t = types or MatmulTypes.dense(key)
    algo = np.zeros(1, dtype=lt.matmul_algo_dtype)
    lt.matmul_algo_init(
        handle, t.compute, ops.CUDA_R_32F, t.first, t.second, t.out, t.out, config["ID"],
        algo.ctypes.data,
    )  # fmt: skip
    attr, dtype_of = lt.MatmulAlgoConfigAttribute, lt.get_matmul_algo_config_attribute_dtype
    for name, value in config.items():
        if name != "ID":
            _set(lt.matmul_algo_config_set_attribute, dtype_of, algo.ctypes.data, attr[name], value)
    return algo


def heuristic_params(
    key: GemmKey,
    device: torch.device,
    limit: int = HEURISTIC_LIMIT,
    types: MatmulTypes | None = None,
) -> list[Params]:
    """The heuristic's algorithms for packed operands of ``key``, best first, as params."""
    handle = _HANDLES.get(device)
    desc = _Descriptors(key, ops.packed_call(key), types)
    enums = _enums()
    out: list[Params] = []
    found = desc.heuristic(handle, _Alignments.of(key), limit)
    for i in range(len(found)):
        params = to_params(read_config(found["algo"][i : i + 1]), enums)
        if params not in out:
            out.append(params)
    return out


class _Call(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor  # what cuBLASLt writes
    user_out: Any  # the caller's out (filled from c if it is not c)
    convert: Callable[[torch.Tensor], Any]
    desc: _Descriptors


Strides = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # a, b and c's


class _LtRunner:
    """Runs one algorithm: descriptors per stride signature, prepared on first sight and found
    again by the tensors' strides (the column-major call is worked out for new strides only).
    A lock guards what calls share (descriptors' pointer attributes, the plans, the workspaces)
    from the attribute writes to the enqueue, so that a runner called from several threads runs
    each call with its own pointers; each stream has its own workspace, made on it, so that
    two threads' calls on their streams never share one."""

    def __init__(
        self, key: GemmKey, params: Params, device: torch.device, types: MatmulTypes | None = None
    ) -> None:
        self.key, self.params, self.device = key, params, device
        self.types = types or MatmulTypes.dense(key)
        self.config = to_config(params, _enums())
        self.handle = _HANDLES.get(device)
        self.align = _Alignments.of(key)
        packed = ops.packed_call(key)
        desc = _Descriptors(key, packed, self.types)
        self.algo, self.rebuilt = self._rebuild(desc)
        self.algo_ptr = self.algo.ctypes.data
        self.plans: dict[ops.ColMajorCall, _Descriptors] = {}
        self.by_strides: dict[Strides, _Descriptors] = {}
        self.need = 0  # workspace bytes the adopted plans need at most
        self.workspaces = ops.StreamWorkspaces(device)
        self.lock = threading.Lock()
        self._adopt(packed, desc)
        self.scalars = np.array([1.0, 0.0], dtype=np.float32)
        self.alpha = self.scalars.ctypes.data
        self.beta = self.alpha + 4
        self.stream = ops.stream_getter(device)
        self.matmul = _lt().matmul

    def _rebuild(self, desc: _Descriptors) -> tuple[np.ndarray, bool]:
        """(algo, True) from init + config attributes, else the heuristic's identical algo."""
        try:
            algo = init_algo(self.key, self.handle, self.config, self.types)
            desc.check(self.handle, algo)
            return algo, True
        except Exception as init_error:
            found = desc.heuristic(self.handle, self.align, 4 * HEURISTIC_LIMIT)
            for i in range(len(found)):
                algo = found["algo"][i : i + 1].copy()
                have = read_config(algo)
                if all(have.get(attr) == v for attr, v in self.config.items()):
                    return algo, False
            raise LookupError(
                f"cuBLASLt algorithm {self.params} is not valid for {self.key} with this "
                f"cuBLASLt: {init_error}"
            ) from None

    def _adopt(self, call: ops.ColMajorCall, desc: _Descriptors) -> _Descriptors:
        self.need = max(self.need, desc.check(self.handle, self.algo))
        self.plans[call] = desc
        return desc

    def _describe(
        self, ta: torch.Tensor, tb: torch.Tensor, c: torch.Tensor, strides: Strides
    ) -> _Descriptors:
        """The descriptors of tensors whose strides were not seen before: their call's (strides
        that make the same call share them), made and checked if the call is new."""
        call = ops.colmajor_call(self.key, ta, tb, c)
        with self.lock:
            desc = self.plans.get(call) or self._adopt(
                call, _Descriptors(self.key, call, self.types)
            )
            self.by_strides[strides] = desc
        return desc

    def _prepare(self, a: Any, b: Any, out: Any) -> _Call:
        """The operands as tensors, the buffer to write and the descriptors of their strides."""
        ta, tb, convert = ops.as_tensors(a, b)
        if ta.device != self.device:
            raise ValueError(f"this cublaslt runner was built on {self.device}, got {ta.device}")
        c, user_out = ops.output_for(self.key, ta, out, self.align.c)
        strides = (ta.stride(), tb.stride(), c.stride())
        desc = self.by_strides.get(strides) or self._describe(ta, tb, c, strides)
        return _Call(ta, tb, c, user_out, convert, desc)

    def _run(self, call: _Call, points: tuple[tuple[str, int], ...] = ()) -> Any:
        """``cublasLtMatmul`` on the current stream, after setting the pointer attributes
        ``points`` ((name, pointer) pairs) of the call's matmul descriptor."""
        desc, c = call.desc, call.c
        a, b, out = call.a.data_ptr(), call.b.data_ptr(), c.data_ptr()
        stream = self.stream()
        with self.lock:
            for name, pointer in points:
                desc.point(name, pointer)
            ws, size = self.workspaces.get(stream, self.need)
            self.matmul(
                self.handle, desc.desc, self.alpha, b, desc.first, a, desc.second, self.beta,
                out, desc.out, out, desc.out, self.algo_ptr, ws, size, stream,
            )  # fmt: skip
        return ops.finish(c, call.user_out, call.convert)

    def __call__(self, a: Any, b: Any, out: Any = None) -> Any:
        return self._run(self._prepare(a, b, out))


class CublasLtGemm(Source):
    name = "cublaslt"
    op = "gemm"

    def unavailable(self, device: str) -> str | None:
        nvmath = ops.package_missing("nvmath", "nvmath-python")
        return ops.unavailable_reason(device, "cuBLASLt", nvmath, _lt)

    def unsupported(self, key: GemmKey) -> str | None:
        return "plain GEMMs only (FP8 keys: cublaslt_fp8)" if key.lowbit else None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return heuristic_params(key, torch.device("cuda", torch.cuda.current_device()))

    def build(self, key: GemmKey, params: Params) -> Runner:
        return _LtRunner(key, params, torch.device("cuda", torch.cuda.current_device()))
