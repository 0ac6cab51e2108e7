"""Operands of the library GEMM sources (cuBLAS, cuBLASLt, CUTLASS): arrays in, arrays out, and
the column-major call that computes a row-major result.

BLAS libraries are column-major. The row-major result C (m x n) read column-major is C^T (n x m),
and C^T = B^T A^T. So every layout of the key maps onto one column-major call whose first operand
is our B and whose second is our A; a row-major operand is already its own transpose when read
column-major (op N) and a column-major one needs op T. ``colmajor_call`` gives that call.

Inputs may be torch tensors or any DLPack array (CuPy); the result comes back as the caller's
kind, without copies.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tuner.core.keys import DTYPES, ITEMSIZE, GemmKey

# cudaDataType_t and cublasComputeType_t values (the same enums serve cuBLAS and cuBLASLt).
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUDA_DTYPE = {"f32": CUDA_R_32F, "f16": CUDA_R_16F, "bf16": CUDA_R_16BF}
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
OP_N, OP_T = 0, 1  # cublasOperation_t


def compute_type(key: GemmKey) -> int:
    """fp32 accumulation; TF32 tensor cores only where the key allows them."""
    return CUBLAS_COMPUTE_32F_FAST_TF32 if key.compute == "tf32" else CUBLAS_COMPUTE_32F


def out_alignment(key: GemmKey) -> int:
    """Byte alignment of the rows of a packed row-major result (what C/D can promise)."""
    row = key.n * ITEMSIZE[key.out_dtype]
    return next(a for a in (16, 8, 4, 2, 1) if row % a == 0)


def leading_stride(t: torch.Tensor, layout: str) -> int:
    """The stride between rows ('n', row-major) or columns ('t', column-major) of a matrix."""
    return t.stride(-2) if layout == "n" else t.stride(-1)


def batch_stride(t: torch.Tensor) -> int:
    return t.stride(0) if t.dim() == 3 else 0


@dataclass(frozen=True)
class ColMajorCall:
    """C^T = op(first) op(second) in column-major terms: first is our B, second our A."""

    trans_first: int  # OP_N or OP_T
    trans_second: int
    m: int  # rows of the column-major result (= key.n)
    n: int  # its columns (= key.m)
    k: int
    ld_first: int
    ld_second: int
    ld_out: int
    stride_first: int = 0  # batch strides, elements
    stride_second: int = 0
    stride_out: int = 0


def stored_shapes(key: GemmKey) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(rows, cols) as stored column-major of the first operand (B), the second (A) and C^T."""
    first = (key.n, key.k) if key.layout[1] == "n" else (key.k, key.n)
    second = (key.k, key.m) if key.layout[0] == "n" else (key.m, key.k)
    return first, second, (key.n, key.m)


def _call(key: GemmKey, lds: tuple[int, int, int], strides: tuple[int, int, int]) -> ColMajorCall:
    """The call for ``key`` with these leading dimensions and batch strides (first, second, out)."""
    return ColMajorCall(
        OP_T if key.layout[1] == "t" else OP_N,
        OP_T if key.layout[0] == "t" else OP_N,
        key.n, key.m, key.k, *lds, *strides,
    )  # fmt: skip


def colmajor_call(key: GemmKey, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> ColMajorCall:
    """The column-major call for ``c = a @ b`` with the strides these tensors actually have.

    Leading dimensions are clamped to the stored row count: for a single row or column torch
    strides are arbitrary, and BLAS only requires ``ld >= rows`` there.
    """
    (rows_b, _), (rows_a, _), (rows_c, _) = stored_shapes(key)
    lds = (
        max(leading_stride(b, key.layout[1]), rows_b, 1),
        max(leading_stride(a, key.layout[0]), rows_a, 1),
        max(c.stride(-2), rows_c, 1),
    )
    return _call(key, lds, (batch_stride(b), batch_stride(a), batch_stride(c)))


def packed_call(key: GemmKey) -> ColMajorCall:
    """The call for packed operands of the key's layout (what samples.make_inputs creates)."""
    shapes = stored_shapes(key)
    sizes = tuple(rows * cols if key.batch > 1 else 0 for rows, cols in shapes)
    return _call(key, (shapes[0][0], shapes[1][0], shapes[2][0]), sizes)  # type: ignore[arg-type]


def unavailable_reason(
    device: str,
    library: str,
    missing: Callable[[], str | None],
    load: Callable[[], Any] | None = None,
) -> str | None:
    """Why a GPU library source cannot run here: no GPU, a missing package, or a failing load."""
    if device != "cuda":
        return f"no GPU ({library} runs on CUDA devices only)"
    if reason := missing():
        return reason
    if not torch.cuda.is_available():
        return "no GPU: torch sees no CUDA device"
    if load is not None:
        try:
            load()
        except Exception as e:  # ImportError, or a shared library that is not there
            return f"{library} does not load: {e}"
    return None


def package_missing(module: str, package: str) -> Callable[[], str | None]:
    """A ``missing`` check for ``unavailable_reason``: is ``module`` importable?"""
    return lambda: None if importlib.util.find_spec(module) else f"package missing: {package}"


def _same_kind(like: Any) -> Callable[[torch.Tensor], Any]:
    """A converter from a torch result back to the caller's array type (zero copy, DLPack)."""
    if isinstance(like, torch.Tensor):
        return lambda t: t
    module = importlib.import_module(type(like).__module__.split(".")[0])
    return module.from_dlpack


def as_tensors(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], Any]]:
    """torch views of both operands and the converter back to the caller's kind."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a, b, _same_kind(a)
    ta = a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)
    tb = b if isinstance(b, torch.Tensor) else torch.from_dlpack(b)
    return ta, tb, _same_kind(a)


def output_for(key: GemmKey, a: torch.Tensor, out: Any, align: int) -> tuple[torch.Tensor, Any]:
    """(buffer the library writes, the caller's ``out``): a packed row-major tensor.

    A caller's ``out`` is written in place when it has the key's output dtype and is row-major
    with rows aligned to ``align`` bytes; otherwise the library writes a fresh buffer and the
    runner copies it into ``out``. ValueError if ``out`` has another shape.
    """
    shape = (key.m, key.n) if a.dim() == 2 else (key.batch, key.m, key.n)
    dtype = DTYPES[key.out_dtype]
    if out is not None:
        t = out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)
        if tuple(t.shape) != shape:
            raise ValueError(f"out.shape={tuple(t.shape)}: expected {shape}")
        item = t.element_size()
        if (
            t.dtype == dtype
            and t.stride(-1) == 1
            and t.stride(-2) >= key.n
            and t.data_ptr() % align == 0
            and (t.stride(-2) * item) % align == 0
        ):
            return t, out
    return torch.empty(*shape, dtype=dtype, device=a.device), out  # ints parse faster than a tuple


def finish(c: torch.Tensor, out: Any, convert: Callable[[torch.Tensor], Any]) -> Any:
    """Return the caller's ``out`` (filled) if it gave one, else ``c`` in the caller's kind."""
    if out is None:
        return convert(c)
    target = out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)
    if target.data_ptr() != c.data_ptr():
        target.copy_(c)
    return out


def scale_lengths(key: GemmKey) -> tuple[int, int]:
    """The elements of an FP8 key's scale_a and scale_b: one each tensorwise, M and N rowwise."""
    return (key.m, key.n) if key.scale == "row" else (1, 1)


def scale_pointer(name: str, scale: torch.Tensor, length: int, device: torch.device) -> int:
    """The device pointer of an FP8 GEMM's float32 scale of ``length`` elements (1: tensorwise),
    which a library kernel reads in place; ValueError naming ``name`` unless it is one,
    contiguous (as ``_scaled_mm`` requires of rowwise scales), on ``device`` and, a vector,
    16-byte aligned (kernels load it 16 bytes at a time)."""
    if (
        scale.dtype != torch.float32
        or scale.numel() != length
        or not scale.is_contiguous()
        or scale.device != device
        or (length > 1 and scale.data_ptr() % 16)
    ):
        raise ValueError(
            f"{name}: expected a contiguous torch.float32 tensor of {length} element(s) on "
            f"{device}" + (", 16-byte aligned" if length > 1 else "") + f", got {scale.dtype} of "
            f"shape {tuple(scale.shape)}, strides {scale.stride()} on {scale.device} at "
            f"{scale.data_ptr():#x}"
        )
    return scale.data_ptr()


def stream_getter(device: torch.device) -> Callable[[], int]:
    """A function returning the raw handle of torch's current stream on ``device`` (cheap: no
    Stream object; for runners that ask on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return functools.partial(raw, index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


_bound = threading.local()  # .devices: the device indices this thread has a context current for


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def bind_context(device: torch.device) -> None:
    """Make ``device``'s primary context (torch's) current in this thread, if none is; checked
    once a thread. A library that encodes TMA descriptors through the driver (CUTLASS's host
    code) gets CUDA_ERROR_INVALID_CONTEXT in a thread that has made no CUDA call yet, and its
    kernel then runs on garbage descriptors; torch binds a context lazily, at the first call
    that needs one, which a thread that only reuses cached memory never makes."""
    done = getattr(_bound, "devices", None)
    if done is None:
        done = _bound.devices = set()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in done:
        return
    lib, ctx = _libcuda(), ctypes.c_void_p()
    _driver_ok(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        ordinal = ctypes.c_int()
        _driver_ok(lib.cuDeviceGet(ctypes.byref(ordinal), index), "cuDeviceGet")
        _driver_ok(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), ordinal), "cuDevicePrimaryCtxRetain"
        )
        _driver_ok(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    done.add(index)


def _driver_ok(err: int, call: str) -> None:
    if err:
        raise RuntimeError(f"{call} failed: CUresult {err}")


def current_stream(device: torch.device) -> int:
    """The raw handle of torch's current stream on ``device``."""
    return stream_getter(device)()


class DeviceHandles:
    """One library handle per CUDA device, created lazily on that device by ``create()``."""

    def __init__(self, create: Callable[[], int]) -> None:
        self._create = create
        self._lock = threading.Lock()
        self._handles: dict[int, int] = {}

    def get(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = self._handles.get(index)
        if handle is None:
            with self._lock, torch.cuda.device(index):
                handle = self._handles.get(index) or self._create()
                self._handles[index] = handle
        return handle


# A library GEMM's workspace per stream: what NVIDIA recommends for Hopper, and what torch gives
# each of its cuBLAS handles' streams there.
WORKSPACE_BYTES = 32 * 2**20


class StreamWorkspaces:
    """Scratch memory of a library GEMM runner, one buffer per CUDA stream.

    Calls from two threads on their own streams run at once and must not share a workspace
    (stream-K's flags and partial tiles, split-K sums). A stream's buffer is made on that stream
    (the current one) at its first call. One outgrown by a larger need is kept alive rather than
    freed, and no stream's buffer is ever evicted: a CUDA graph captured with it replays on it.
    Not locked: the runner calls ``get`` under its own lock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.by_stream: dict[int, tuple[int, int, torch.Tensor]] = {}  # stream -> ptr, bytes, buf
        self.outgrown: list[torch.Tensor] = []

    def get(self, stream: int, nbytes: int) -> tuple[int, int]:
        """(pointer, bytes) of ``stream``'s workspace, at least ``nbytes`` (and one) large."""
        held = self.by_stream.get(stream)
        if held is None or held[1] < nbytes:
            if held is not None:
                self.outgrown.append(held[2])
            size = max(nbytes, 1)
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
            held = self.by_stream[stream] = (buf.data_ptr(), size, buf)
        return held[0], held[1]
