"""Triton GEMM kernels written in this project (the ``triton_gemm`` source).

Four kernels (tuner/candidates/triton_kernels/), chosen per shape by the params' "kernel":

- ``tiled``: one output tile per program, grouped tile ordering (any layout, batch, masked edges);
- ``splitk``: the tiled kernel with K split over a grid axis, fp32 partials summed in a fixed
  order by a second kernel (deterministic), for small M x N with long K;
- ``gemv``: M <= 8 decode shapes, streaming the weight with wide loads and CUDA-core FMAs;
- ``persistent_tma``: Hopper (sm90+), one program per SM, TMA tensor descriptors made on the device.

``pad_k`` runs a kernel on K-padded, 16-byte aligned copies of A and B (odd shapes such as
4097 x 4099 x 4101, where unaligned rows rule out wide loads and TMA). Params and the config
spaces are described in ``triton_kernels/configs.py``.

Compilation: ``precompile`` compiles a shortlist in parallel worker processes before the engine
times it (``triton_kernels/launch.py``); compiled binaries live in Triton's on-disk cache and are
shared by every shape with the same constexprs and specialization. Launching: a runner's first
call goes through Triton's JIT; later calls launch the compiled kernels directly (less host time),
once a direct launch has reproduced the first call bit for bit (``check_direct``). On the CPU the
kernels run through Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI tests them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import triton

from tuner.candidates.base import Params, Runner, Source, triton_unavailable
from tuner.candidates.triton_kernels import configs
from tuner.candidates.triton_kernels.gemv import gemv
from tuner.candidates.triton_kernels.launch import FakeTensor, WarmJob, WarmReport, precompile
from tuner.candidates.triton_kernels.pad import pad_pair
from tuner.candidates.triton_kernels.persistent import HAS_DEVICE_TMA, persistent_tma_gemm
from tuner.candidates.triton_kernels.tiled import splitk_reduce, tiled_gemm
from tuner.core.keys import DTYPES, ITEMSIZE, GemmKey
from tuner.core.triton_launch import Launcher, interpreting, verify_direct

log = logging.getLogger(__name__)
KERNELS = ("tiled", "splitk", "persistent_tma", "gemv")
INT32_MAX = 2**31 - 1
REDUCE_BLOCK = 1024
PAD_BR, PAD_BK = 8, 512  # the fastest padding tile of those tried


def precision(key: GemmKey, params: Params | None = None) -> str:
    """tl.dot input precision: the key's TF32 switch, else the params' choice ("ieee" default)."""
    if key.compute == "tf32":
        return "tf32"
    chosen = (params or {}).get("precision", "ieee")
    if chosen not in ("ieee", "tf32x3"):
        raise ValueError(f"precision must be 'ieee' or 'tf32x3' for compute=f32, got {chosen!r}")
    return chosen


def as_batched(t: Any) -> tuple[int, int, int]:
    """(batch stride, row stride, col stride) of a 2-D or 3-D tensor."""
    s = t.stride()
    return (0, s[0], s[1]) if len(s) == 2 else (s[0], s[1], s[2])


def output_for(key: GemmKey, a: torch.Tensor) -> torch.Tensor:
    shape = (key.m, key.n) if a.dim() == 2 else (key.batch, key.m, key.n)
    return torch.empty(shape, dtype=DTYPES[key.out_dtype], device=a.device)


def canonical_strides(rows: int, cols: int, layout: str, batch: int) -> tuple[int, int, int]:
    """as_batched() of the dense operand samples.make_inputs builds for a key."""
    row, col = (cols, 1) if layout == "n" else (1, rows)
    return (rows * cols if batch > 1 else 0, row, col)


def device_info() -> tuple[int, int]:
    """(multiprocessor count, compute capability major) of the current GPU."""
    return _device_info(torch.cuda.current_device())


@functools.cache
def _device_info(index: int) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major


# --- validation --------------------------------------------------------------------------------


def _int(params: Params, name: str, allowed: tuple[int, ...] | range) -> int:
    value = params.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
        shown = f"{allowed.start}..{allowed.stop - 1}" if isinstance(allowed, range) else allowed
        raise ValueError(f"triton_gemm param {name!r} must be one of {shown}, got {value!r}")
    return value


POW2 = tuple(2**i for i in range(11))
DOT_TILE = tuple(2**i for i in range(4, 9))  # 16..256: tl.dot needs 16 or more


def _check_size(key: GemmKey) -> None:
    b = key.batch
    for what, n in (("A", key.m * key.k), ("B", key.k * key.n), ("C", key.m * key.n)):
        if n * b > INT32_MAX:
            raise ValueError(f"{what} has {n * b} elements; the Triton kernels index with int32")


def kernel_of(params: Params) -> str:
    kind = params.get("kernel", "tiled")
    if kind not in KERNELS:
        raise ValueError(f"triton_gemm param 'kernel' must be one of {KERNELS}, got {kind!r}")
    return kind


# --- runners -----------------------------------------------------------------------------------


class GemmRunner:
    """``runner(a, b, out=None) -> c``; ``jobs()`` lists what its first call compiles."""

    def __init__(self, key: GemmKey) -> None:
        self.key = key
        self._shapes = {2: (key.m, key.n), 3: (key.batch, key.m, key.n)}
        self._dtype = DTYPES[key.out_dtype]
        self._checked = False

    def __call__(self, a: Any, b: Any, out: Any = None) -> Any:
        if out is None:
            out = torch.empty(self._shapes[a.dim()], dtype=self._dtype, device=a.device)
        self.launch(a, b, out)
        if not self._checked:
            self.check_direct(a, b, out)
        return out

    def launch(self, a: Any, b: Any, c: Any) -> None:
        raise NotImplementedError

    def launchers(self) -> list[Launcher]:
        raise NotImplementedError

    def check_direct(self, a: Any, b: Any, out: Any) -> None:
        """See ``verify_direct``: one extra run and a synchronisation per runner."""
        relaunch = functools.partial(self.launch, a, b)
        self._checked = verify_direct(self.launchers(), out, relaunch, f"triton_gemm {self.key}")

    def jobs(self) -> list[WarmJob]:
        return []

    def fakes(self) -> tuple[FakeTensor, FakeTensor, FakeTensor]:
        dt = DTYPES[self.key.dtype]
        return (FakeTensor(dt, self.key.align), FakeTensor(dt, self.key.align),
                FakeTensor(DTYPES[self.key.out_dtype]))  # fmt: skip

    def canonical(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        k = self.key
        return (canonical_strides(k.m, k.k, k.layout[0], k.batch),
                canonical_strides(k.k, k.n, k.layout[1], k.batch),
                canonical_strides(k.m, k.n, "n", k.batch))  # fmt: skip


class TiledRunner(GemmRunner):
    """The tiled kernel; with ``split_k > 1`` the split-K variant plus its reduction."""

    def __init__(self, key: GemmKey, params: Params, split: int) -> None:
        super().__init__(key)
        bm, bn, bk = (_int(params, x, DOT_TILE) for x in ("bm", "bn", "bk"))
        warps = _int(params, "warps", (1, 2, 4, 8, 16))
        stages = _int(params, "stages", range(1, 9))
        group_m = _int(params, "group_m", range(1, 65))
        self.split = split
        tiles = triton.cdiv(key.m, bm) * triton.cdiv(key.n, bn)
        meta = dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m, SPLIT_K=split,
                    EVEN_K=key.k % bk == 0, PRECISION=precision(key, params))  # fmt: skip
        self.main = Launcher(tiled_gemm, (tiles, key.batch, split), meta,
                             num_warps=warps, num_stages=stages)  # fmt: skip
        self.total = key.batch * key.m * key.n
        if split > 1:
            self.reduce = Launcher(splitk_reduce, (triton.cdiv(self.total, REDUCE_BLOCK),),
                                   dict(SPLIT_K=split, BLOCK=REDUCE_BLOCK), num_warps=4, num_stages=1)  # fmt: skip

    def launchers(self) -> list[Launcher]:
        return [self.main, self.reduce] if self.split > 1 else [self.main]

    def _args(self, a: Any, b: Any, c: Any, ws: Any, strides: tuple[tuple[int, ...], ...]) -> tuple:
        k = self.key
        return (a, b, c, ws, k.m, k.n, k.k, *strides[0], *strides[1], *strides[2])

    def launch(self, a: Any, b: Any, c: Any) -> None:
        k = self.key
        sa, sb, sc = as_batched(a), as_batched(b), as_batched(c)
        pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
        ws, pw = c, pc  # split 1: the kernel ignores ws
        if self.split > 1:
            ws = torch.empty((self.split, self.total), dtype=torch.float32, device=c.device)
            pw = ws.data_ptr()
        guard = (sa, sb, sc, pa % 16, pb % 16, pc % 16)
        if direct := self.main.ready(guard):
            direct(self._args(pa, pb, pc, pw, (sa, sb, sc)))
        else:
            self.main(self._args(a, b, c, ws, (sa, sb, sc)), guard)
        if self.split > 1:
            rguard = (sc, pc % 16)
            if reduce := self.reduce.ready(rguard):
                reduce((pw, pc, k.m, k.n, self.total, *sc))
            else:
                self.reduce((ws, c, k.m, k.n, self.total, *sc), rguard)

    def jobs(self) -> list[WarmJob]:
        a, b, c = self.fakes()
        ws = FakeTensor(torch.float32) if self.split > 1 else c
        out = [WarmJob(tiled_gemm, self._args(a, b, c, ws, self.canonical()), self.main.kwargs)]
        if self.split > 1:
            k = self.key
            rargs = (ws, c, k.m, k.n, self.total, *self.canonical()[2])
            out.append(WarmJob(splitk_reduce, rargs, self.reduce.kwargs))
        return out


class GemvRunner(GemmRunner):
    def __init__(self, key: GemmKey, params: Params) -> None:
        super().__init__(key)
        bm = _int(params, "bm", POW2[:5])
        bn, bk = _int(params, "bn", POW2), _int(params, "bk", POW2)
        warps = _int(params, "warps", (1, 2, 4, 8, 16))
        if key.m > bm:
            raise ValueError(f"gemv covers M <= bm; got M={key.m} with bm={bm}")
        if bm * bn * bk > 128 * 32 * warps:
            raise ValueError(
                f"gemv accumulator bm*bn*bk={bm * bn * bk} exceeds 128 registers per thread "
                f"at {warps} warps"
            )
        meta = dict(BM=bm, BN=bn, BK=bk, EVEN_K=key.k % bk == 0)
        self.main = Launcher(gemv, (triton.cdiv(key.n, bn), key.batch), meta,
                             num_warps=warps, num_stages=1)  # fmt: skip

    def launchers(self) -> list[Launcher]:
        return [self.main]

    def _args(self, a: Any, b: Any, c: Any, strides: tuple[tuple[int, ...], ...]) -> tuple:
        k = self.key
        return (a, b, c, k.m, k.n, k.k, *strides[0], *strides[1], *strides[2])

    def launch(self, a: Any, b: Any, c: Any) -> None:
        sa, sb, sc = as_batched(a), as_batched(b), as_batched(c)
        pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
        guard = (sa, sb, sc, pa % 16, pb % 16, pc % 16)
        if direct := self.main.ready(guard):
            direct(self._args(pa, pb, pc, (sa, sb, sc)))
        else:
            self.main(self._args(a, b, c, (sa, sb, sc)), guard)

    def jobs(self) -> list[WarmJob]:
        return [WarmJob(gemv, self._args(*self.fakes(), self.canonical()), self.main.kwargs)]


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the TMA descriptors a kernel makes on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


class PersistentRunner(GemmRunner):
    def __init__(self, key: GemmKey, params: Params) -> None:
        super().__init__(key)
        why = configs.tma_ok(key)
        if why:
            raise ValueError(f"persistent_tma: {why}")
        if not HAS_DEVICE_TMA:
            raise ValueError("persistent_tma needs tl.make_tensor_descriptor (triton >= 3.4)")
        sms = configs.SM90_SMS
        if not interpreting():
            sms, major = device_info()
            if major < 9:
                raise ValueError(
                    f"persistent_tma needs sm90 or newer (TMA), this GPU is sm{major}x"
                )
        bm, bn, bk = (_int(params, x, DOT_TILE) for x in ("bm", "bn", "bk"))
        warps = _int(params, "warps", (4, 8, 16))
        stages = _int(params, "stages", range(1, 9))
        group_m = _int(params, "group_m", range(1, 65))
        tiles = triton.cdiv(key.m, bm) * triton.cdiv(key.n, bn)
        programs = min(sms, tiles)
        self.c_desc = configs.c_tma_ok(key)
        self.programs = programs
        meta = dict(BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
                    A_ROW=key.layout[0] == "n", B_ROW=key.layout[1] == "n", C_DESC=self.c_desc,
                    PRECISION=precision(key, params))  # fmt: skip
        self.main = Launcher(persistent_tma_gemm, (programs,), meta,
                             num_warps=warps, num_stages=stages)  # fmt: skip

    def launchers(self) -> list[Launcher]:
        return [self.main]

    def _args(self, a: Any, b: Any, c: Any, lds: tuple[int, int, int]) -> tuple:
        k = self.key
        return (a, b, c, k.m, k.n, k.k, *lds, self.programs)

    def _lds(
        self, sa: tuple[int, ...], sb: tuple[int, ...], sc: tuple[int, ...]
    ) -> tuple[int, int, int]:
        la, lb = self.key.layout
        return (sa[1] if la == "n" else sa[2], sb[1] if lb == "n" else sb[2], sc[1])

    def launch(self, a: Any, b: Any, c: Any) -> None:
        sa, sb, sc = as_batched(a), as_batched(b), as_batched(c)
        item = ITEMSIZE[self.key.out_dtype]
        if sc[2] != 1 or (self.c_desc and ((sc[1] * item) % 16 or c.data_ptr() % 16)):
            tmp = output_for(self.key, a)  # C must be row-major (and aligned for the TMA store)
            self.launch(a, b, tmp)
            c.copy_(tmp)
            return
        lds = self._lds(sa, sb, sc)
        pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
        guard = (lds, pa % 16, pb % 16, pc % 16)
        if direct := self.main.ready(guard):
            n = direct.scratch_bytes
            scratch = torch.empty(n, dtype=torch.int8, device=c.device) if n else None
            direct(self._args(pa, pb, pc, lds), None if scratch is None else scratch.data_ptr())
        else:
            triton.set_allocator(_scratch)
            self.main(self._args(a, b, c, lds), guard)

    def jobs(self) -> list[WarmJob]:
        return [WarmJob(persistent_tma_gemm, self._args(*self.fakes(), self._lds(*self.canonical())),
                        self.main.kwargs)]  # fmt: skip


class PadRunner(GemmRunner):
    """Copy A to (M, KP) and B to (N, KP) row-major with a zero K tail, then run ``inner``."""

    def __init__(self, key: GemmKey, params: Params) -> None:
        super().__init__(key)
        inner = {k: v for k, v in params.items() if k != "pad_k"}
        kind = kernel_of(inner)
        if kind == "gemv":
            raise ValueError("pad_k applies to the tensor-core kernels, not gemv")
        # K to a multiple of 64: whole K tiles (no masks) and 128-byte aligned rows. Padding to 8
        # only (enough for TMA) is slower: rows that straddle 128-byte lines cost extra sectors
        self.padded = configs.padded_key(key)
        self.inner = make_runner(self.padded, inner)
        programs = triton.cdiv(key.m, PAD_BR) + triton.cdiv(key.n, PAD_BR)
        self.pad = Launcher(pad_pair, (programs, triton.cdiv(self.padded.k, PAD_BK), key.batch),
                            dict(BR=PAD_BR, BK=PAD_BK), num_warps=4, num_stages=1)  # fmt: skip

    def launchers(self) -> list[Launcher]:
        return [self.pad, *self.inner.launchers()]

    def _pad_args(self, a: Any, ap: Any, b: Any, bp: Any, sa: tuple, sb: tuple) -> tuple:
        """B's rows are N: its (col, k) strides, so that it lands as (N, KP) row-major."""
        k = self.key
        return (
            a,
            ap,
            b,
            bp,
            k.m,
            k.n,
            k.k,
            self.padded.k,
            sa[0],
            sa[1],
            sa[2],
            sb[0],
            sb[2],
            sb[1],
        )

    def launch(self, a: Any, b: Any, c: Any) -> None:
        k, kp = self.key, self.padded.k
        lead = (k.batch,) if a.dim() == 3 else ()
        ap = torch.empty((*lead, k.m, kp), dtype=a.dtype, device=a.device)
        bp = torch.empty((*lead, k.n, kp), dtype=b.dtype, device=b.device)
        sa, sb = as_batched(a), as_batched(b)
        pa, pb = a.data_ptr(), b.data_ptr()
        guard = (sa, sb, pa % 16, pb % 16)
        if pad := self.pad.ready(guard):
            pad(self._pad_args(pa, ap.data_ptr(), pb, bp.data_ptr(), sa, sb))
        else:
            self.pad(self._pad_args(a, ap, b, bp, sa, sb), guard)
        self.inner.launch(ap, bp.transpose(-1, -2), c)

    def jobs(self) -> list[WarmJob]:
        a, b, _ = self.fakes()
        dt = DTYPES[self.key.dtype]
        sa, sb, _ = self.canonical()
        args = self._pad_args(a, FakeTensor(dt), b, FakeTensor(dt), sa, sb)
        return [WarmJob(pad_pair, args, self.pad.kwargs), *self.inner.jobs()]


def make_runner(key: GemmKey, params: Params) -> GemmRunner:
    _check_size(key)
    if params.get("pad_k"):
        return PadRunner(key, params)
    kind = kernel_of(params)
    if kind == "gemv":
        return GemvRunner(key, params)
    if kind == "persistent_tma":
        return PersistentRunner(key, params)
    split = 1 if kind == "tiled" else _int(params, "split_k", range(2, 65))
    return TiledRunner(key, params, split)


# --- the source --------------------------------------------------------------------------------

CPU_PARAMS: Params = {"kernel": "tiled", "bm": 32, "bn": 32, "bk": 32, "group_m": 8, "warps": 4, "stages": 1}  # fmt: skip


class TritonGemm(Source):
    builds_kernels = True
    name = "triton_gemm"
    op = "gemm"
    shortlist_limit = 20
    last_warm: WarmReport | None = None  # the last precompile (kernels compiled, seconds)

    def unavailable(self, device: str) -> str | None:
        return triton_unavailable(device)

    def unsupported(self, key: GemmKey) -> str | None:
        if key.lowbit:
            return "plain GEMMs only (low-bit keys: triton_w4a16, triton_fp8)"
        if interpreting() and key.dtype == "bf16":
            return "Triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); bf16 runs on the GPU only"
        return None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        if device == "cpu":  # interpreter: one small config keeps CI fast
            return [dict(CPU_PARAMS)]
        sms, major = device_info()
        shortlist = configs.shortlist(key, sms, self.shortlist_limit)
        if major < 9 or not HAS_DEVICE_TMA:
            shortlist = [p for p in shortlist if p["kernel"] != "persistent_tma"]
        return shortlist

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        self.last_warm = precompile(shortlist, lambda p: make_runner(key, p).jobs())

    def build(self, key: GemmKey, params: Params) -> Runner:
        return make_runner(key, params)
