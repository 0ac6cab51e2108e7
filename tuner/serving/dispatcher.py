"""In-process dispatcher: ``tuner.matmul`` and ``tuner.sdpa``.

The hit path is one dict lookup on a signature of the call (shapes, strides, dtypes, device,
pointer alignment, TF32 switch) and a call of the cached runner: no key object, no SQL.
The first call of a signature resolves it: key -> winner (from the store, loaded once per
device class) -> built runner. What happens without a winner is the *mode*
(``TUNER_MODE`` or ``set_mode``):

- ``off``: the baseline only (torch), the store is never opened;
- ``lookup`` (default): the winner if known, else the baseline;
- ``record``: like lookup, and the missed key is recorded in the store for offline tuning;
- ``tune``: tune the problem now, store the result, then use the winner.

A dispatch never fails where the baseline would succeed: any problem outside what the tuner
handles (broadcasting, mixed dtypes, odd strides, autograd) goes straight to torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tuner.cache import ReadOnlyError, Store, StoreError, cache_file, default_path
from tuner.candidates import registry, torch_lowbit
from tuner.candidates.base import Runner
from tuner.candidates.torch_ref import torch_sdpa
from tuner.core.device import fingerprint
from tuner.core.fork_safe import ForkSafeLock
from tuner.core.keys import GemmKey, Key, SdpaKey
from tuner.core.settings import CHOICES, load_config_file
from tuner.core.triton_launch import interpreting
from tuner.measure.records import Winner
from tuner.serving import lowbit
from tuner.serving.background import BackgroundLoader, load_runner, may_compile
from tuner.serving.buckets import DEFAULT_POLICY, BucketIndex, check_policy, transfer_problem

log = logging.getLogger(__name__)

MODES = CHOICES["mode"]
STALE_POLICIES = CHOICES["stale"]  # winners measured under other versions: serve, or misses
MEMO_MAX = 1 << 16  # front ends' memos kept before starting over (prefill lengths take any value)
CAUSAL = {
    False: "none",
    True: "top_left",
    "none": "none",
    "top_left": "top_left",
    "bottom_right": "bottom_right",
}


def _gemm_sig(a: Any, b: Any) -> tuple:
    """What decides a GEMM's runner: shapes, strides, dtypes, devices, 16-byte alignment, the
    TF32 switch, autograd. Each operand's own dtype and device: a call that mixes them after a
    tuned one must reach torch's error, not the tuned kernel."""
    return (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device,
            a.data_ptr() % 16, b.data_ptr() % 16, torch._C._get_cublas_allow_tf32(),
            (a.requires_grad or b.requires_grad) and torch.is_grad_enabled())  # fmt: skip


def _sdpa_sig(
    q: Any, k: Any, v: Any, causal: bool | str, scale: float | None, enable_gqa: bool
) -> tuple:
    """What decides an SDPA's runner, as ``_gemm_sig`` for a GEMM; the types of ``causal`` and
    ``enable_gqa`` too, as ``lowbit.scaled_mm_sig`` keys ``use_fast_accum``'s: ``1 == True``, and
    a ``causal=1`` that the first call refuses must not be served after a ``causal=True``."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, type(causal), causal, scale, type(enable_gqa),
            enable_gqa,
            (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled())  # fmt: skip


def torch_decides_heads(q: Any, k: Any, v: Any, enable_gqa: bool) -> bool:
    """Whether torch's SDPA, as called, must serve a call whose q, k and v differ in their
    leading (batch, heads) dims without ``enable_gqa``: torch broadcasts them or raises its own
    error, where a key would take them for grouped-query attention."""
    return not enable_gqa and not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]


def _check_gqa(enable_gqa: Any) -> None:
    """torch's TypeError for an ``enable_gqa`` that is not a bool."""
    if not isinstance(enable_gqa, bool):
        raise TypeError(
            "scaled_dot_product_attention(): argument 'enable_gqa' must be bool, not "
            f"{_type_name(enable_gqa)}"
        )


def _causal_mode(causal: Any) -> str:
    """The SdpaKey causal mode ``causal`` asks for; an error naming what is allowed: a
    TypeError for another type (as torch's ``is_causal`` refuses one), else a ValueError."""
    mode = CAUSAL.get(causal) if isinstance(causal, (bool, str)) else None
    if mode is None:
        words = ", ".join(repr(w) for w in CAUSAL if isinstance(w, str))
        error = ValueError if isinstance(causal, str) else TypeError
        got = repr(causal)
        if isinstance(causal, torch.Tensor):  # a mask passed where torch's SDPA takes one
            got = (f"a tensor of shape {tuple(causal.shape)} (for a mask, call torch's "
                   "F.scaled_dot_product_attention)")  # fmt: skip
        raise error(f"causal must be a bool or one of {words}, got {got}")
    return mode


def _torch_matmul(a: Any, b: Any, out: Any = None) -> Any:
    return torch.matmul(a, b, out=out)


def _out_fits(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` is what ``torch.matmul(a, b)`` returns in shape, dtype and device: a tuned
    runner writes only such an ``out``; torch resizes any other or refuses it."""
    if a.dim() < 2 or b.dim() < 2 or not isinstance(out, torch.Tensor):
        return False
    shape = (*torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    return out.shape == shape and out.dtype == a.dtype and out.device == a.device


def _torch_sdpa(causal: str, scale: float | None, enable_gqa: bool) -> Runner:
    """torch's SDPA (``torch_ref.torch_sdpa``) for calls the tuner does not handle."""

    def run(q: Any, k: Any, v: Any, out: Any = None) -> Any:
        return torch_sdpa(q, k, v, causal, scale, enable_gqa)

    return run


def _scaled_mm_fallback(out_dtype: Any, fast: bool) -> Runner:
    """torch's ``_scaled_mm`` for calls outside the keys, except an empty K on the CPU, where
    torch's op returns uninitialized memory: the product is zeros."""
    scaled_mm = torch_lowbit.scaled_mm_runner(out_dtype, fast)

    def run(a: Any, b: Any, scale_a: Any, scale_b: Any, out: Any = None) -> Any:
        if a.shape[1] == 0 and a.device.type == "cpu":
            zeros = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)
            return zeros if out is None else out.copy_(zeros)
        return scaled_mm(a, b, scale_a, scale_b, out)

    return run


def _check_mode(mode: str, name: str = "TUNER_MODE") -> str:
    """``mode``, or a ValueError naming where it came from (``name``)."""
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {list(MODES)}, got {mode!r}")
    return mode


RESOLUTION_KINDS = {
    "hit": "the key's own winner",
    "bucketed": "a tuned neighbour's winner (same problem but M), rebuilt for this key",
    "miss": "no winner: torch's default",
    "capture": "first seen during CUDA-graph capture: torch's default, not cached",
    "default": "torch's default by policy: mode off, autograd, or not the tuned device",
    "untunable": "outside what the tuner keys (broadcasting, odd strides, ...): torch",
    "loading": "the winner's kernel is built in the background: torch's default until it is",
    "failed": "the winner's kernel failed to build or cannot serve here (Dispatcher.loader.failures): torch's default",
}


@dataclass
class Resolution:
    """How the dispatcher serves one problem (``RESOLUTION_KINDS``); ``calls`` counts while
    ``Dispatcher.counting`` is on. ``via``: the neighbour key a bucketed call borrows params from."""

    key: str
    kind: str
    candidate: str
    winner: Winner | None = None
    via: str | None = None
    calls: int = 0
    by_torch: bool = True  # torch's own kernel serves (the default, or a baseline winner)

    @property
    def saved_us(self) -> float:
        """Estimated time saved per call: the winner's baseline_us - median_us, as tuned."""
        return self.winner.baseline_us - self.winner.median_us if self.winner else 0.0


_INTERPRETER = ForkSafeLock()


def _taking_turns(runner: Runner, device: Any) -> Runner:
    """A tuned runner as served on ``device``: on the CPU its Triton kernels run through
    Triton's interpreter, which keeps a launch's grid in globals, so calls from several threads
    take turns there."""
    if device.type != "cpu" or not interpreting():
        return runner

    def run(*args: Any, **kwargs: Any) -> Any:
        with _INTERPRETER:
            return runner(*args, **kwargs)

    return run


class _Inside(threading.local):
    busy = False  # this thread is inside the tuner: its torch calls go to torch


# read by tuner.torch's wrappers: a torch entry point called from inside the tuner (a baseline
# runner calls torch.matmul, torch._scaled_mm, ...; a tuning times torch's own) is torch's, not
# routed back to a dispatcher to be resolved, counted and timed with the router's cost again
inside = _Inside()


def _inside(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` with this thread marked as inside the tuner: a resolution (a tuning's timed
    calls of torch's baseline included), or a runner that is torch's own."""

    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        was = inside.busy
        inside.busy = True
        try:
            return call(*args, **kwargs)
        finally:
            inside.busy = was

    return run


def _counted(runner: Runner, res: Resolution) -> Runner:
    def run(*args: Any, **kwargs: Any) -> Any:
        res.calls += 1
        return runner(*args, **kwargs)

    return run


def _type_name(value: Any) -> str:
    """A value's type as torch's argument errors name it: ``int``, ``numpy.bool``."""
    kind = type(value)
    return (
        kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    )


def stale_policy() -> str:
    """``TUNER_STALE``: whether winners measured under other versions serve ("use", the
    default) or are taken for misses ("ignore")."""
    policy = os.environ.get("TUNER_STALE") or "use"
    if policy not in STALE_POLICIES:
        raise ValueError(f"TUNER_STALE must be one of {list(STALE_POLICIES)}, got {policy!r}")
    return policy


class Dispatcher:
    """Maps call signatures to runners. One per process is the norm (see ``get_dispatcher``)."""

    def __init__(self, store_path: str | Path | None = None, mode: str | None = None) -> None:
        self.mode = (
            _check_mode(mode, "mode")
            if mode
            else _check_mode(os.environ.get("TUNER_MODE") or "lookup")
        )
        self.stale = stale_policy()
        self.store_path = cache_file(store_path) if store_path else default_path()
        self._hot: dict[tuple, tuple[Runner, Resolution]] = {}  # signature -> runner, its record
        # front ends' own caches of resolved calls (tuner.torch keys them on the call as made):
        # cleared with the resolved runners, so nothing outlives a reload
        self.memo: dict[tuple, Any] = {}
        self.memo_clears = 0  # times ``memo`` was cleared: what ``remember`` compares
        self._winners: dict[str, dict[str, Winner]] = {}  # device class -> key -> winner
        self._recorded: set[tuple[str, str]] = set()
        self.fleet_sync: Any = None  # tuner.fleet.background's sync, when TUNER_SERVER is set
        self.buckets = check_policy(os.environ.get("TUNER_BUCKETS") or DEFAULT_POLICY)
        self._bucket_index: dict[str, BucketIndex] = {}  # device class -> tuned Ms per family
        self.resolutions: dict[tuple, Resolution] = {}  # (key, kind, candidate, via) -> record
        self.counting = False  # count calls per resolution (set_counting)
        self._lock = threading.RLock()
        self._store: Store | None = None
        self._store_failed = False
        self._missing_said = False  # lookup mode found no cache at store_path, and said so
        self._read_only = False  # the cache refused a write: still read, never written again
        self._grad_said: set[str] = set()  # ops (low-bit GEMMs apart) whose autograd call was said
        self._capture_said: set[str] = set()  # runners a capture left to the default (said once)
        # winners' runners whose build may compile: built off the hot path (serving.background),
        # kept across reloads; "<key> <- <candidate> on <device>" -> runner
        self.loader = BackgroundLoader()
        self.loaded: dict[str, Runner] = {}
        self._loading: dict[str, list[tuple]] = {}  # job -> signatures served the baseline
        self.switches = 0  # signatures switched from the baseline to a runner built meanwhile
        _DISPATCHERS.add(self)  # made fit to serve again in a forked child (``_after_fork``)

    @property
    def choices(self) -> dict[str, str]:
        """key -> the candidate serving it (the latest resolution), for diagnostics; where torch
        stands in for a winner still loading or one that failed, the kind names it so:
        ``failed: triton_gemm:{...}`` (that winner is not what serves)."""
        with self._lock:  # other threads' resolutions reorder the dict meanwhile
            held = list(self.resolutions.values())
        return {
            r.key: f"{r.kind}: {r.candidate}" if r.kind in STAND_INS else r.candidate
            for r in held
            if r.kind != "untunable"
        }

    # --- hot path ------------------------------------------------------------------------------

    def matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        runner, res = self.resolve_gemm(a, b)
        if out is not None and not res.by_torch and not _out_fits(a, b, out):
            return torch.matmul(a, b, out=out)  # torch resizes or refuses it, as it does
        return runner(a, b, out=out)

    def gemm_runner(self, a: Any, b: Any) -> Runner:
        """The runner that ``matmul(a, b)`` calls: hoist it out of a loop to skip even the lookup."""
        return self.resolve_gemm(a, b)[0]

    def sdpa(
        self, q: Any, k: Any, v: Any, causal: bool | str = False, scale: float | None = None,
        *, enable_gqa: bool = False,
    ) -> Any:  # fmt: skip
        return self.resolve_sdpa(q, k, v, causal, scale, enable_gqa=enable_gqa)[0](q, k, v)

    def scaled_mm(
        self, a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None,
        scale_result: Any = None, out_dtype: Any = None, use_fast_accum: bool = False,
        out: Any = None,
    ) -> Any:  # fmt: skip
        """``torch._scaled_mm``, tuned; a bias, ``scale_result`` (epilogues outside the key) or
        ``out`` goes to torch as called."""
        if bias is not None or scale_result is not None or out is not None:
            return torch._scaled_mm(
                a, b, scale_a, scale_b, bias=bias, scale_result=scale_result,
                out_dtype=out_dtype, use_fast_accum=use_fast_accum, out=out,
            )  # fmt: skip
        runner = self.resolve_scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum)[0]
        return runner(a, b, scale_a, scale_b)

    def resolve_scaled_mm(
        self, a: Any, b: Any, scale_a: Any, scale_b: Any, out_dtype: Any = None,
        use_fast_accum: bool = False, *, names: lowbit.ScaledMMNames = lowbit.SCALED_MM_NAMES,
    ) -> tuple[Runner, Resolution]:  # fmt: skip
        """``scaled_mm``'s runner, and how it was chosen; bad operands are named in the error
        as ``names`` has them (``tuner.torch`` passes aten's)."""
        try:
            sig = lowbit.scaled_mm_sig(a, b, scale_a, scale_b, out_dtype, use_fast_accum)
        except AttributeError:
            lowbit.check_operands(a=a, b=b, scale_a=scale_a, scale_b=scale_b)
            raise
        hot = self._hot.get(sig)
        if hot is None:
            if not isinstance(use_fast_accum, bool):  # as torch._scaled_mm refuses it
                raise TypeError(
                    f"_scaled_mm(): argument 'use_fast_accum' must be bool, not "
                    f"{_type_name(use_fast_accum)}"
                )
            hot = self._resolve(
                sig, lambda: lowbit.scaled_mm_key(a, b, scale_a, scale_b, out_dtype,
                                                  use_fast_accum, names),
                a.device, _scaled_mm_fallback(out_dtype, use_fast_accum), grad=sig[-1],
            )  # fmt: skip
        return hot

    def int4_linear(self, x: Any, packed: Any, scales_and_zeros: Any, group_size: int) -> Any:
        """``x [..., K] @ W.T`` with W int4 in torch's packed format: out [..., N]."""
        try:  # a 2-D x as it is: a reshape is a good part of the hit path
            x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if not x2.is_contiguous():  # torch's op reads rows as stored: copied, as reshape does
                x2 = x2.contiguous()
        except (AttributeError, IndexError):
            lowbit.check_operands(x=x)
            raise
        runner = self.resolve_int4(x2, packed, scales_and_zeros, group_size)[0]
        y = runner(x2, packed, scales_and_zeros)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

    def resolve_int4(
        self, x: Any, packed: Any, scales_and_zeros: Any, group_size: int, *,
        names: lowbit.Int4Names = lowbit.INT4_LINEAR_NAMES,
    ) -> tuple[Runner, Resolution]:  # fmt: skip
        """``int4_linear``'s runner for a 2-D ``x``, and how it was chosen; ``names`` as in
        ``resolve_scaled_mm``. A group size of another type (a NumPy int, a 0-d tensor) is
        taken as the int it holds, so that its calls share one signature."""
        if type(group_size) is not int:
            group_size = lowbit.group_int(group_size, names)
        try:
            sig = lowbit.int4_sig(x, packed, scales_and_zeros, group_size)
        except AttributeError:
            lowbit.check_operands(x=x, packed_w=packed, scales_and_zeros=scales_and_zeros)
            raise
        hot = self._hot.get(sig)
        if hot is None:
            hot = self._resolve(
                sig, lambda: lowbit.int4_key(x, packed, scales_and_zeros, group_size, names),
                x.device, torch_lowbit.int4_runner(group_size), grad=sig[-1],
            )  # fmt: skip
        return hot

    def resolve_gemm(self, a: Any, b: Any) -> tuple[Runner, Resolution]:
        """``gemm_runner`` and how it was chosen (``tuner.torch`` hands torch-served calls back
        to torch's own entry point, untouched)."""
        try:
            sig = _gemm_sig(a, b)
        except RuntimeError as e:  # an operand without strides or storage (sparse): torch's
            return _torch_matmul, Resolution(f"untunable: {e}", "untunable", "torch")
        return self._hot.get(sig) or self._resolve_gemm(sig, a, b)

    def resolve_sdpa(
        self, q: Any, k: Any, v: Any, causal: bool | str = False, scale: float | None = None,
        *, enable_gqa: bool = False,
    ) -> tuple[Runner, Resolution]:  # fmt: skip
        sig = _sdpa_sig(q, k, v, causal, scale, enable_gqa)
        try:
            hot = self._hot.get(sig)
        except TypeError:  # an unhashable argument: named, else torch's own error
            _causal_mode(causal)
            _check_gqa(enable_gqa)
            raise TypeError(f"scale must be a number or None, got {scale!r}") from None
        return hot or self._resolve_sdpa(sig, q, k, v, causal, scale, enable_gqa)

    # --- resolution (first call of a signature) -------------------------------------------------

    def _resolve_gemm(self, sig: tuple, a: Any, b: Any) -> tuple[Runner, Resolution]:
        return self._resolve(
            sig, lambda: GemmKey.from_tensors(a, b), a.device, _torch_matmul, grad=sig[-1]
        )

    def _resolve_sdpa(
        self, sig: tuple, q: Any, k: Any, v: Any, causal: bool | str, scale: float | None,
        enable_gqa: bool,
    ) -> tuple[Runner, Resolution]:  # fmt: skip
        mode = _causal_mode(causal)
        _check_gqa(enable_gqa)
        fallback = _torch_sdpa(mode, scale, enable_gqa)
        if isinstance(scale, torch.Tensor):  # torch takes a 0-d tensor; signatures holding one
            # would be told apart by identity, one more per call: torch serves it, unremembered
            return fallback, Resolution("untunable: scale is a tensor", "untunable", "torch")

        def key() -> SdpaKey:
            if torch_decides_heads(q, k, v, enable_gqa):
                raise ValueError("q, k and v differ in (batch, heads) without enable_gqa")
            return SdpaKey.from_tensors(q, k, v, causal=mode, scale=scale)

        return self._resolve(sig, key, q.device, fallback, grad=sig[-1])

    @_inside
    def _resolve(
        self, sig: tuple, make_key: Callable[[], Key], device: Any, fallback: Runner, *,
        grad: bool,
    ) -> tuple[Runner, Resolution]:  # fmt: skip
        """``fallback`` serves calls outside the keys; operands that disagree
        (``lowbit.OperandError``) raise to the caller instead."""
        with self._lock:
            hot = self._hot.get(sig)
            if hot is not None:
                return hot
            try:
                key = make_key()
            except lowbit.OperandError:  # bad input: an error, not torch's guess
                raise
            except (
                ValueError
            ) as e:  # outside what the tuner handles: torch decides (and errs) itself
                log.debug("not tunable, using torch: %s", e)
                runner, res = fallback, Resolution(f"untunable: {e}", "untunable", "torch")
            else:
                runner, res = self._build(key, self._choose(key, device, grad=grad), device)
            slot = (res.key, res.kind, res.candidate, res.via)
            res = self.resolutions[slot] = self.resolutions.pop(slot, res)  # latest last
            if res.by_torch or _calls_torch(res):  # the others' hit path pays nothing for it
                runner = _inside(runner)
            if not res.by_torch and device.type == "cuda":
                runner = _on_its_gpu(runner, device)
            if self.counting:
                runner = _counted(runner, res)
            if res.kind != "capture":  # resolved again after the capture, with tuning allowed
                self._hot[sig] = (runner, res)
            if res.kind == "loading":
                self._loading.setdefault(_job(res.key, res.candidate, device), []).append(sig)
            return runner, res

    def _choose(self, key: Key, device: Any, *, grad: bool) -> Resolution:
        """What serves ``key`` on ``device``: its winner, a bucket neighbour's winner, or torch's
        default.

        During CUDA-graph capture nothing is tuned and no kernel is built (loading a kernel
        module would invalidate the capture): a winner serves only if its runner is loaded
        already (``tuner.warmup()``, or an earlier call's background build), else the default,
        and the capture says so once per runner; a miss is still recorded.
        """
        base = registry.baseline(key.op, key)
        # the tuned device is the GPU where there is one, else the CPU: another device's tensors
        # (meta tensors of a model made for shape inference) are torch's, which runs them
        tuned = "cuda" if torch.cuda.is_available() else "cpu"
        if self.mode == "off" or device.type != tuned:
            return Resolution(str(key), "default", base.name)
        if grad:
            self._say_grad(key)
            return Resolution(str(key), "default", base.name)
        dc = fingerprint(device).device_class
        capturing = _capturing(device.type)
        winner, kind, via = self._known(dc).get(str(key)), "hit", None
        if winner is None:
            if self.mode == "tune" and not capturing:
                winner = self._tune(key, device)
            elif self.mode in ("record", "tune"):
                self._record_miss(dc, key)
        if winner is None and isinstance(key, GemmKey):
            with _current(device):  # sources asked read the operands' GPU
                winner = self._bucketed(dc, key)
            kind, via = "bucketed", winner.key if winner else None
        if winner is None:
            return Resolution(str(key), "capture" if capturing else "miss", base.name)
        if base.chose_itself(winner.source, winner.params):
            return Resolution(str(key), kind, base.name, winner, via)
        job = _job(str(key), winner.candidate, device)
        if capturing and job not in self.loaded:
            self._say_capture(job, device, borrowed=kind == "bucketed")
            return Resolution(str(key), "capture", base.name)
        return Resolution(str(key), kind, winner.candidate, winner, via, by_torch=False)

    def _say_capture(self, job: str, device: Any, *, borrowed: bool) -> None:
        """Log, once per runner (``job``: key, winner, device), that a CUDA graph captured
        torch's default where a winner exists: the graph replays it for good, and nothing else
        would show it. A borrowed winner (a bucket neighbour's) is built for each shape at its
        first call, which warmup cannot make for it."""
        if job in self._capture_said:
            return
        self._capture_said.add(job)
        gpu = f"device={str(device)!r}" if device.type == "cuda" else ""
        fix = (
            f"call it once before capturing, then tuner.warmup({gpu}) (which waits for the build)"
            if borrowed
            else f"call tuner.warmup({gpu}) before capturing (it loads every winner)"
        )
        log.warning("CUDA-graph capture: %s runs torch's default, as its winner's runner is not "
                    "loaded yet; %s", job, fix)  # fmt: skip

    def _say_grad(self, key: Key) -> None:
        """Log, once per op, that a call needing a gradient is torch's: tuned kernels have no
        backward, so a model run without ``no_grad`` loses every tuned kernel, and
        ``stats()`` alone would show it. Resolutions only: the hot path pays nothing."""
        lowbit = isinstance(key, GemmKey) and key.lowbit
        kind = f"low-bit {key.op}" if lowbit else key.op
        if kind in self._grad_said:
            return
        self._grad_said.add(kind)
        why = (  # torch's int4 and FP8 ops have no backward either: nothing is gained
            "neither it nor a tuned kernel has a backward"
            if lowbit
            else "a tuned kernel has no backward"
        )
        log.warning(
            "%s needs a gradient (an operand requires grad, grad mode on): torch's own op serves "
            "it and every such %s call (%s); for inference run the model under "
            "torch.inference_mode() or torch.no_grad()",
            key, kind, why,
        )  # fmt: skip

    def _build(self, key: Key, res: Resolution, device: Any) -> tuple[Runner, Resolution]:
        """The runner of a resolution, built for ``key`` itself (also for a bucketed winner).

        A winner whose build may compile (``background.may_compile``) and that is not loaded yet
        is built by ``self.loader`` while the baseline serves (kind ``loading``); once built, the
        signatures it served are resolved again, now to the loaded runner. A winner that cannot
        serve here or no longer builds is kind ``failed``, not ``miss``: it was tuned."""
        base = registry.baseline(key.op, key)
        w = res.winner
        if w is None or res.candidate == base.name:
            return base.build(key, base.baseline_params), res
        job = _job(str(key), w.candidate, device)
        if (runner := self.loaded.get(job)) is not None:
            return _taking_turns(runner, device), res
        if job in self.loader.failures:
            return base.build(key, base.baseline_params), _by_torch(res, "failed")
        if self.loader.in_flight(job):  # another signature of the key asked: asked once per build
            return base.build(key, base.baseline_params), _by_torch(res, "loading")
        try:
            source = registry.get(w.source)
            why = cannot_serve_here(source, key, device)
            if why is None and not may_compile(source):
                runner = _on_device(device, lambda: source.build(key, w.params))
                return _taking_turns(runner, device), res
        except Exception as e:  # stored params the candidate no longer takes: tuned, not a miss
            self.loader.refuse(job, f"{type(e).__name__}: {e}", "no longer builds")
            return base.build(key, base.baseline_params), _by_torch(res, "failed")
        if why is not None:  # a winner pulled from a host that can run it
            self.loader.refuse(job, why, "cannot serve here")
            return base.build(key, base.baseline_params), _by_torch(res, "failed")
        self.loader.submit(
            job, lambda: _on_device(device, lambda: load_runner(source, key, w.params)),
            lambda runner: self._loaded(job, runner), lambda error: self._loaded(job, None),
        )  # fmt: skip
        return base.build(key, base.baseline_params), _by_torch(res, "loading")

    def winners(self, device_class: str) -> list[Winner]:
        """The winners this dispatcher serves on ``device_class`` (stale policy applied)."""
        with self._lock:
            return list(self._known(device_class).values())

    def load(self, key: Key, winner: Winner, device: Any) -> bool:
        """Build ``winner``'s runner for ``key`` now, its kernels compiled or installed first
        (``tuner.warmup``); raises what the build raises, and retries one that failed before.
        False if it was loaded already. Calls of ``key`` then find it loaded."""
        job = _job(str(key), winner.candidate, device)
        if job in self.loaded:
            return False
        source = registry.get(winner.source)
        if (why := cannot_serve_here(source, key, device)) is not None:
            raise RuntimeError(f"{winner.candidate} cannot serve here: {why}")
        self._loaded(job, _on_device(device, lambda: load_runner(source, key, winner.params)))
        self.loader.failures.pop(job, None)
        return True

    def _loaded(self, job: str, runner: Runner | None) -> None:
        """A background build finished (``runner``) or failed (None): the signatures it left
        to the baseline resolve again on their next call, exactly once."""
        with self._lock:
            if runner is not None:
                self.loaded[job] = runner
            for sig in self._loading.pop(job, []):
                if self._hot.pop(sig, None) is not None and runner is not None:
                    self.switches += 1
            self._clear_memo()  # front ends' memos of those calls go with them

    def _bucketed(self, device_class: str, key: GemmKey) -> Winner | None:
        """The winner of a tuned neighbour that may serve ``key`` under the bucket policy."""
        if self.buckets == "exact":
            return None
        known = self._known(device_class)
        index = self._bucket_index.get(device_class)
        if index is None:
            index = self._bucket_index[device_class] = BucketIndex.from_key_strings(known)
        near = index.neighbour(key, self.buckets)
        winner = known.get(str(near)) if near is not None else None
        if winner is None:
            return None
        try:
            problem = transfer_problem(registry.get(winner.source), key, winner.params)
        except KeyError as e:
            problem = str(e)
        if problem:
            log.debug("bucket neighbour %s cannot serve %s: %s", near, key, problem)
            return None
        return winner

    def _open_store(self) -> Store | None:
        """The cache, opened on first use; None in ``off`` mode (it is never opened), and in
        ``lookup`` mode where there is no cache yet (it reads one, it does not make one)."""
        if self._store is not None or self._store_failed or self.mode == "off":
            return self._store
        path = Path(self.store_path)
        fresh = not path.exists() or path.stat().st_size == 0  # (an empty file is no cache yet)
        if fresh and self.mode == "lookup":
            if not self._missing_said:  # a mistyped path: said once, nothing made there
                log.warning(
                    "tuner cache %s %s: serving baselines only (lookup mode reads a cache, it "
                    "does not make one; tune into it first, or fix TUNER_CACHE)",
                    path, "is an empty file" if path.exists() else "does not exist",
                )  # fmt: skip
                self._missing_said = True
            return None
        try:
            self._store = Store(self.store_path)
        except StoreError as e:
            log.error("tuner cache unusable, dispatching baselines only: %s", e)
            self._store_failed = True
        else:
            if fresh:
                log.info("made a new tuner cache at %s (TUNER_MODE=%s)", path, self.mode)
        return self._store

    def _store_to_write(self) -> Store | None:
        """The cache, unless it refused a write for being read-only: its winners are still
        served, but no later call tries (and fails) to write to it again."""
        return None if self._read_only else self._open_store()

    @contextlib.contextmanager
    def _unless_unusable(self) -> Iterator[None]:
        """A read or write the cache refuses is logged once and the call it came from still
        served: a read-only cache is read but no longer written, a damaged one (a page found
        damaged by a query, after the file opened fine) is left alone."""
        try:
            yield
        except ReadOnlyError as e:
            log.error("tuner cache not writable, serving without recording from now on: %s", e)
            self._read_only = True
        except StoreError as e:
            log.error("tuner cache unusable, dispatching without it from now on: %s", e)
            if self._store is not None:
                self._store.close()
            self._store, self._store_failed = None, True

    def _known(self, device_class: str) -> dict[str, Winner]:
        if device_class not in self._winners:
            winners: list[Winner] = []
            if store := self._open_store():
                with self._unless_unusable():
                    winners = store.winners(device_class)
            current = fingerprint(device_class.partition("-")[0])
            stale = [w for w in winners if not w.measured_under(current)]
            if stale:
                log.warning(
                    "%d of %d winners for %s were measured under other versions (%s them: "
                    "TUNER_STALE=%s)",
                    len(stale),
                    len(winners),
                    device_class,
                    "serving" if self.stale == "use" else "ignoring",
                    self.stale,
                )
            if self.stale == "ignore":  # stale keys become misses: recorded or retuned
                winners = [w for w in winners if w.measured_under(current)]
            self._winners[device_class] = {w.key: w for w in winners}
        return self._winners[device_class]

    def _record_miss(self, device_class: str, key: Key) -> None:
        if (device_class, str(key)) in self._recorded:
            return
        self._recorded.add((device_class, str(key)))
        if store := self._store_to_write():
            with self._unless_unusable():
                store.record_misses(device_class, [str(key)])

    def _tune(self, key: Key, device: Any) -> Winner | None:
        """Tune ``key`` on ``device``, the GPU of the call's operands (made current: a model may
        sit on several GPUs, of several models)."""
        from tuner.tuning.engine import tune

        # on the CPU the tuning runs its Triton candidates through the interpreter too: it takes
        # its turn there, as served calls do (``_taking_turns``), or another thread's call and
        # the candidates' runs break each other ("InterpreterError: ... outside of JIT")
        interpreted = device.type == "cpu" and interpreting()
        turn = _INTERPRETER if interpreted else contextlib.nullcontext()
        with turn, _current(device):
            outcome = tune(key, device=device.type)
        if store := self._store_to_write():
            with self._unless_unusable():
                store.save_run(outcome.measurements, outcome.winner)
        self._winners.setdefault(outcome.winner.device_class, {})[outcome.winner.key] = (
            outcome.winner
        )
        self._bucket_index.pop(outcome.winner.device_class, None)
        return outcome.winner

    def set_mode(self, mode: str) -> None:
        with self._lock:
            self.mode = _check_mode(mode, "mode")
            self._forget()

    def set_buckets(self, policy: str) -> None:
        """Bucket policy for GEMMs with an untuned M: ``tuner.serving.buckets.POLICIES``."""
        with self._lock:
            self.buckets = check_policy(policy, "buckets")
            self._forget()

    def set_counting(self, on: bool) -> None:
        """Count calls per resolution (``self.resolutions``); one increment per call while on."""
        with self._lock:
            if on != self.counting:
                self.counting = on
                self._forget()

    def _forget(self) -> None:
        """Drop every resolved runner (callers hold the lock); loaded ones stay for reuse."""
        self._hot.clear()
        self._clear_memo()
        self._loading.clear()

    def _clear_memo(self) -> None:
        self.memo.clear()
        self.memo_clears += 1

    def remember(self, seen: int, key: tuple, entry: Any) -> None:
        """Keep a front end's memo of a call it resolved when ``memo_clears`` was ``seen``;
        not where the memo was cleared since (a reload, a mode change, a build finished while
        it resolved in another thread), or the cleared runner would outlive the clear."""
        with self._lock:
            if self.memo_clears != seen:
                return
            if len(self.memo) >= MEMO_MAX:
                self.memo.clear()
            self.memo[key] = entry

    def _after_fork(self) -> None:
        """This dispatcher, in a child forked from the process that made it (a DataLoader
        worker): only the forking thread lives on, so a lock another thread held at the fork
        would be held for good, and the loader's threads are gone. Fresh locks and loader (its
        failures kept); the inherited cache connection is left unused, and open (SQLite's
        connections must not be carried across a fork, and closing it here could act on the
        parent's file): the child opens its own at its next need."""
        self._lock = threading.RLock()
        self.loader = self.loader.after_fork()
        self._forget()  # signatures left to the baseline while a build was in flight among them
        if self._store is not None:
            _FORKED_AWAY.append(self._store)
            self._store = None

    def reload(self) -> None:
        """Forget resolved runners and winners, and the winners refused as unable to serve here,
        e.g. after a sync brought new winners or kernels."""
        with self._lock:
            self._forget()
            self._winners.clear()
            self._bucket_index.clear()
            self.loader.forget_refusals()
            self._capture_said.clear()


def cannot_serve_here(source: Any, key: Key, device: Any) -> str | None:
    """Why ``source`` cannot serve ``key`` on ``device`` of this host (None: it can). A winner
    synced from the fleet was tuned where it could run; this host may lack the GPU, Triton's
    interpreter, or what the kernel needs for the key (say, bf16 dots under the interpreter).
    Asked with ``device`` current: sources read the current GPU's capability."""
    with _current(device):
        return source.unavailable(device.type) or source.unsupported(key)


def _calls_torch(res: Resolution) -> bool:
    """Whether the winner serving ``res`` calls torch's own entry points (``calls_torch``)."""
    return res.winner is not None and registry.get(res.winner.source).calls_torch


# kinds where torch's default serves in place of the winner a resolution names
STAND_INS = ("loading", "failed")


def _by_torch(res: Resolution, kind: str) -> Resolution:
    """``res`` served by torch's default meanwhile (``loading``) or for good (``failed``): its
    candidate names the winner's kernel; no time saved."""
    return replace(res, kind=kind, winner=None, by_torch=True)


def _job(key: str, candidate: str, device: Any) -> str:
    """A background build's name: one per runner, whatever signatures it serves."""
    return f"{key} <- {candidate} on {device}"


def _current(device: Any) -> contextlib.AbstractContextManager[Any]:
    """``device`` made the current GPU for the block (nothing to do for a CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _on_device(device: Any, build: Callable[[], Runner]) -> Runner:
    """``build()`` with ``device`` current (a worker thread starts on the default device)."""
    with _current(device):
        return build()


def _on_its_gpu(runner: Runner, device: Any) -> Runner:
    """A tuned runner of ``device``'s operands that launches its kernels there. Triton's, CuPy's
    and CUTLASS's kernels launch on the current GPU, which a model spread over several GPUs does
    not switch as its layers run (torch's own ops guard themselves); a host of one GPU pays
    nothing."""
    if torch.cuda.device_count() < 2:
        return runner
    index = device.index
    current = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device

    def run(*args: Any, **kwargs: Any) -> Any:
        if current() == index:
            return runner(*args, **kwargs)
        with torch.cuda.device(index):
            return runner(*args, **kwargs)

    return run


def _capturing(device: str) -> bool:
    return device == "cuda" and torch.cuda.is_current_stream_capturing()


_DISPATCHERS: weakref.WeakSet[Dispatcher] = weakref.WeakSet()
_FORKED_AWAY: list[Store] = []  # connections a forked child inherited: kept open, never used


def _after_fork_in_child() -> None:
    """A forked child starts with the forking thread alone: each dispatcher's lock (a
    resolution tuning a miss may have held it) and build loader are made anew
    (``_INTERPRETER`` is a ``ForkSafeLock``)."""
    for disp in list(_DISPATCHERS):
        disp._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)

_dispatcher: Dispatcher | None = None
_making = ForkSafeLock()  # held while the process's dispatcher is made


def get_dispatcher() -> Dispatcher:
    """The process's dispatcher, made at the first call: two threads' first calls at once get
    one dispatcher (and one fleet sync), not one each."""
    global _dispatcher
    if _dispatcher is not None:
        return _dispatcher
    with _making:
        if _dispatcher is None:
            load_config_file()  # defaults from the config file; the environment wins
            made = Dispatcher()
            if os.environ.get("TUNER_SERVER") and made.mode != "off":
                from tuner.fleet.background import attach  # a daemon thread, off the hot path

                made.fleet_sync = attach(made)
            _dispatcher = made
    return _dispatcher


# the dispatcher of the innermost open ``tuner.torch.enable()``, which records it here (None:
# none is open); front ends that call the dispatcher themselves (the quantized layers) serve
# through it, as the torch ops routed meanwhile are
_routed: Dispatcher | None = None


def route_through(disp: Dispatcher | None) -> None:
    """Record the innermost ``tuner.torch.enable()``'s dispatcher (None: the last one ended)."""
    global _routed
    _routed = disp


def active_dispatcher() -> Dispatcher:
    """The dispatcher of the innermost ``tuner.torch.enable()``, else the process-wide one."""
    routed = _routed
    return routed if routed is not None else get_dispatcher()


def set_mode(mode: str) -> None:
    get_dispatcher().set_mode(mode)


def _via_dlpack(fn: Callable[..., Any], *arrays: Any, **kwargs: Any) -> Any:
    """Call ``fn`` on torch views of CuPy (or any DLPack) arrays, zero copy, and hand the result
    back as the caller's array type."""
    import importlib

    module = importlib.import_module(type(arrays[0]).__module__.split(".")[0])
    out = kwargs.get("out")
    if out is not None:
        kwargs["out"] = torch.from_dlpack(out)
    result = fn(*(torch.from_dlpack(x) for x in arrays), **kwargs)
    return out if out is not None else module.from_dlpack(result)


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` through the fastest known kernel for this problem on this device.

    Takes two torch tensors, or two CuPy arrays (any DLPack arrays), returned as the same type;
    a DLPack array beside anything else is refused, as ``sdpa`` refuses one.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return get_dispatcher().matmul(a, b, out=out)
    arrays = [not isinstance(x, torch.Tensor) and hasattr(x, "__dlpack__") for x in (a, b)]
    if all(arrays):
        return _via_dlpack(get_dispatcher().matmul, a, b, out=out)
    if any(arrays):  # torch would say that the array must be a Tensor, which we take it for
        raise TypeError(
            "matmul(): a and b must be torch tensors (or both DLPack arrays), got "
            f"a: {type(a).__name__}, b: {type(b).__name__}"
        )
    return torch.matmul(a, b, out=out)  # no arrays: torch names what it refuses


def scaled_mm(
    a: Any, b: Any, scale_a: Any, scale_b: Any, bias: Any = None, scale_result: Any = None,
    out_dtype: Any = None, use_fast_accum: bool = False, out: Any = None,
) -> Any:  # fmt: skip
    """``torch._scaled_mm(...)`` (same arguments) through the fastest known kernel for this FP8
    problem: tensorwise or rowwise scales, ``use_fast_accum`` keyed, never chosen silently; a
    call with ``bias``, ``scale_result`` or ``out`` is torch's own."""
    return get_dispatcher().scaled_mm(
        a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
        use_fast_accum=use_fast_accum, out=out,
    )  # fmt: skip


def int4_linear(x: Any, packed_w: Any, scales_and_zeros: Any, group_size: int) -> Any:
    """``x [..., K] @ W.T`` -> [..., N] with W int4 in torch's packed format for x's device
    (``aten._convert_weight_to_int4pack`` on CUDA, ``_convert_weight_to_int4pack_for_cpu`` on
    the CPU) and torch's ``scales_and_zeros`` [K / group_size, N, 2]. A kernel's layout of the
    weight is made on the first call and kept: after writing an inference-mode weight or its
    scales in place, call ``tuner.forget`` on it."""
    return get_dispatcher().int4_linear(x, packed_w, scales_and_zeros, group_size)


def sdpa(
    q: Any, k: Any, v: Any, causal: bool | str = False, scale: float | None = None, *,
    enable_gqa: bool = False,
) -> Any:  # fmt: skip
    """``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
    enable_gqa=enable_gqa)``, tuned.

    ``causal``: False, True (torch's top-left alignment) or ``"bottom_right"`` (chunked prefill
    against a KV cache: the last query attends to every key). ``enable_gqa``: grouped-query
    attention (kv heads dividing q heads), as torch takes it; without it, head counts that
    differ are torch's to broadcast or refuse, with its own error.
    """
    qkv = (q, k, v)
    if all(isinstance(t, torch.Tensor) for t in qkv):
        return get_dispatcher().sdpa(q, k, v, causal=causal, scale=scale, enable_gqa=enable_gqa)
    if not any(isinstance(t, torch.Tensor) or not hasattr(t, "__dlpack__") for t in qkv):
        return _via_dlpack(
            get_dispatcher().sdpa, q, k, v, causal=causal, scale=scale, enable_gqa=enable_gqa
        )
    got = ", ".join(f"{name}: {type(t).__name__}" for name, t in zip("qkv", qkv, strict=True))
    raise TypeError(f"sdpa(): q, k and v must be torch tensors (or all DLPack arrays), got {got}")


__all__ = [
    "MODES",
    "RESOLUTION_KINDS",
    "Dispatcher",
    "Resolution",
    "active_dispatcher",
    "get_dispatcher",
    "int4_linear",
    "matmul",
    "scaled_mm",
    "sdpa",
    "set_mode",
]
