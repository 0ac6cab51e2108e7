"""Drop-in for PyTorch models: tuned GEMMs and attention inside unmodified code.

    import tuner.torch

    with tuner.torch.enabled():            # or tuner.torch.enable() ... tuner.torch.disable()
        y = model(x)                       # nn.Linear, @, torch.matmul, F.sdpa, ... go through the tuner
    print(tuner.torch.stats())             # hits, misses, build failures, time saved, ...

**What is routed.** ``torch.matmul`` (also ``a @ b`` and ``Tensor.matmul``), ``torch.mm``, ``torch.bmm``,
``torch.addmm`` (``beta = alpha = 1``), ``F.linear`` and ``F.scaled_dot_product_attention`` (no
dropout; no mask, ``is_causal`` or a ``CausalBias``), for plain f16/bf16/f32 tensors whose operands
share a dtype; ``torch._scaled_mm`` (FP8, without bias or ``scale_result``) and torch's int4 GEMM
(``aten._weight_int4pack_mm`` on CUDA, ``aten._weight_int4pack_mm_for_cpu``, as ``torch.ops.aten``
and ``torch`` name them) through ``tuner.scaled_mm`` / ``tuner.int4_linear``, whose checks name
a bad operand by its argument in aten's schema (``self``, ``mat2``, ``scale_a``, ``scale_b``;
``qGroupSize``, ``qScaleAndZeros``) with an error that is both a ``ValueError`` and the
``RuntimeError`` torch would raise (a float16 ``self`` for CUDA's int4 op, scales on another
device). Leading batch dims are folded like torch does (``x.reshape(-1, K)``; a copy only where
torch copies too). Everything else (broadcast batches, ``out=``, mixed dtypes, subclasses, masks,
dropout, attention under ``sdpa_kernel``) is left to torch untouched, and the dispatcher itself
falls back to torch for layouts the tuner does not key (odd strides). Results are always those
of a checked kernel or of torch.

**How.** ``enable()`` replaces those entry points (module attributes of ``torch``,
``torch.nn.functional`` and ``torch.ops.aten``, methods of ``torch.Tensor``, ``@`` included) with
small wrappers (an aten op keeps its overloads, ``.default`` and the like, unrouted), and
``disable()`` puts the originals back. Calls made inside ``nn.Module`` forwards and inside torch's
own Python code (``nn.MultiheadAttention`` calls ``F.linear`` and SDPA) are seen; every other torch
op costs nothing extra (a ``TorchFunctionMode`` would tax every op, views and shape queries
included). The switch is process-wide and nests (the innermost dispatcher serves; an
``enabled()`` block undoes its own ``enable()``, whatever other threads' blocks did meanwhile);
a thread-local guard keeps the tuner's own kernels (which call torch) from coming back to it. Code that bound a function before
``enable()`` (``from torch.nn.functional import linear``) keeps the original. ``F.linear`` and
SDPA calls seen before take a memo keyed on the call as made (``tuner.serving.call_memo``; its
cost over torch's own call: ``bench/memo_overhead.py``).

**Autograd.** GEMMs that need a gradient go through ``_TunedMM`` (an ``autograd.Function``) whose
backward calls the dispatcher for dA = dC @ B^T and dB = A^T @ dC, each computed in its input's
layout (``F.linear``'s weight gradient comes out row-major, as torch's does). Attention with a
gradient is served by torch's own SDPA (the tuned attention kernels have no backward).

**torch.compile.** While Dynamo traces, the handlers emit the custom ops ``tuner::mm`` and
``tuner::sdpa`` (``torch.library.custom_op`` with ``register_fake`` and ``register_autograd``): opaque
kernels in the graph, no graph breaks, ``fullgraph=True`` works. The GEMM op's backward is made of
``tuner::mm`` calls too; the SDPA op's backward recomputes the forward with torch's SDPA. Dynamo
itself handles ``a @ b`` and tensor methods, and keeps ``F.multi_head_attention_forward`` as one
call that AOTAutograd decomposes: in compiled code those stay torch's, as do the low-bit ops. Attention that needs a
gradient is left to torch there too (its fused backward beats a recompute).

**CUDA graphs.** A hit allocates nothing beyond its output and never synchronizes. A signature
first seen during capture is served by its winner where that winner's kernel is loaded, else by
torch's kernel, and resolved again after the capture (no tuning, no kernel loading during capture;
the miss is recorded in record/tune modes); warm up (``tuner.warmup()``, or eager calls) before
capturing, and the capture holds the tuned kernels.

**Quantized models.** ``quantize_linear(model, "int4" | "fp8")`` replaces a model's
``nn.Linear`` layers by quantized ones served by the tuner (``tuner.serving.quantize``): by the
innermost ``enable()``'s dispatcher while one is on, as the routed ops are.

**Dynamic shapes.** ``enable(buckets=...)`` / ``TUNER_BUCKETS``: see ``tuner.serving.buckets``.

**Stats** count the calls made through Python (a CUDA-graph replay is not a call); counts are
not locked, so threads racing on one problem may lose a few.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from tuner.candidates import registry
from tuner.candidates.torch_ref import in_sdpa_layout, sdpa_output, torch_sdpa
from tuner.core.console import counted
from tuner.core.device import fingerprint
from tuner.core.fork_safe import ForkSafeLock
from tuner.measure.records import candidate_label
from tuner.serving.call_memo import (
    PLAIN,
    LinearMemo,
    SdpaMemo,
    linear_key,
    needs_grad,
    sdpa_key,
)
from tuner.serving.dispatcher import (
    Dispatcher,
    Resolution,
    active_dispatcher,
    get_dispatcher,
    inside,
    route_through,
    torch_decides_heads,
)
from tuner.serving.lowbit import Int4Names, ScaledMMNames
from tuner.serving.quantize import quantize_linear

_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})
_CAUSAL_BIAS = {CausalVariant.UPPER_LEFT: "top_left", CausalVariant.LOWER_RIGHT: "bottom_right"}

# --- which router is on, and the guard against routing the tuner's own calls ---------------------

_lock = ForkSafeLock()
_routers: list[Router] = []  # enable() pushes, disable() pops; the last one routes
_active: Router | None = None


# this thread is inside the tuner (its torch calls go to torch): shared with the dispatcher,
# whose own entry points (tuner.matmul, a quantized layer's int4_linear, ...) set it too
_guard = inside


@contextlib.contextmanager
def _inside_tuner() -> Iterator[None]:
    """Mark this thread as inside the tuner (backward passes and custom ops enter from outside)."""
    was = _guard.busy
    _guard.busy = True
    try:
        yield
    finally:
        _guard.busy = was


# --- gradients --------------------------------------------------------------------------------


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) != 1


def mm_grads(
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    grad: torch.Tensor,
    need_a: bool,
    need_b: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dA = grad @ B^T and dB = A^T @ grad through ``mm``, each in its input's layout: for a
    column-major operand the transposed product is computed row-major and returned transposed."""
    da = db = None
    if need_a:
        da = mm(b, grad.mT).mT if _column_major(a) else mm(grad, b.mT)
    if need_b:
        db = mm(grad.mT, a).mT if _column_major(b) else mm(a.mT, grad)
    return da, db


class _TunedMM(torch.autograd.Function):
    """Eager ``a @ b`` with autograd; forward and backward GEMMs through the dispatcher."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, disp: Dispatcher) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.disp = disp
        return disp.matmul(a, b)  # grad mode is off here: the tuned kernel serves

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        with _inside_tuner():
            da, db = mm_grads(ctx.disp.matmul, a, b, grad, *ctx.needs_input_grad[:2])
        return da, db, None


# --- custom ops (what torch.compile sees) -------------------------------------------------------


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``tuner::mm``'s fake kernel promises a contiguous output; runners almost always give it."""
    return t if t.is_contiguous() else t.contiguous()


@torch.library.custom_op("tuner::mm", mutates_args=())
def tuned_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D, or 3-D with equal batch) through the tuner's dispatcher."""
    with _inside_tuner():
        return _contiguous(active_dispatcher().matmul(a, b))


@tuned_mm.register_fake
def _tuned_mm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _mm_setup(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a, b = ctx.saved_tensors
    return mm_grads(torch.ops.tuner.mm, a, b, grad, *ctx.needs_input_grad)


tuned_mm.register_autograd(_mm_backward, setup_context=_mm_setup)


@torch.library.custom_op("tuner::sdpa", mutates_args=())
def tuned_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str, scale: float | None
) -> torch.Tensor:
    """Scaled dot-product attention (``causal``: none, top_left or bottom_right) through the
    tuner; grouped-query where the head counts differ (the router emits it only for such calls
    that enable it)."""
    if _sdpa_backends_chosen():
        return in_sdpa_layout(torch_sdpa(q, k, v, causal, scale), q)
    with _inside_tuner():
        disp = active_dispatcher()
        return in_sdpa_layout(disp.sdpa(q, k, v, causal=causal, scale=scale, enable_gqa=True), q)


@tuned_sdpa.register_fake
def _tuned_sdpa_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str, scale: float | None
) -> torch.Tensor:
    return sdpa_output(q, v.shape[-1])


def _sdpa_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.causal, ctx.scale = causal, scale


def _sdpa_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Recompute the forward with torch's SDPA and differentiate that."""
    q, k, v = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    with torch.enable_grad(), _inside_tuner():
        leaves = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), need, strict=True)]
        out = torch_sdpa(*leaves, ctx.causal, ctx.scale)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad))
    return (*(next(got) if n else None for n in need), None, None)


tuned_sdpa.register_autograd(_sdpa_backward, setup_context=_sdpa_setup)


# --- argument binding (the signatures of the torch functions we take over) ----------------------


def _matmul_args(input: Any, other: Any, *, out: Any = None) -> tuple[Any, Any, Any]:
    return input, other, out


def _mm_args(
    input: Any, mat2: Any, *, out: Any = None, out_dtype: Any = None
) -> tuple[Any, Any, Any]:
    """mm / bmm's; an ``out_dtype`` goes to torch as ``out`` does (``out`` is then that flag)."""
    return input, mat2, out if out_dtype is None else out_dtype


def _addmm_args(
    input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1, out: Any = None,
    out_dtype: Any = None,
) -> tuple[Any, ...]:  # fmt: skip
    return input, mat1, mat2, beta, alpha, out if out_dtype is None else out_dtype


def _linear_args(input: Any, weight: Any, bias: Any = None) -> tuple[Any, Any, Any]:
    return input, weight, bias


def _sdpa_args(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _scaled_mm_args(
    self: Any, mat2: Any, scale_a: Any, scale_b: Any, bias: Any = None, scale_result: Any = None,
    out_dtype: Any = None, use_fast_accum: bool = False, out: Any = None,
) -> tuple[Any, ...]:  # fmt: skip
    return self, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, out


def _int4_args(self: Any, mat2: Any, qGroupSize: int, qScaleAndZeros: Any) -> tuple[Any, ...]:
    return self, mat2, qGroupSize, qScaleAndZeros


# what the two signatures above call the operands the low-bit checks name: a routed call's error
# names the argument the caller wrote, as torch's would
_SCALED_MM_NAMES = ScaledMMNames(a="self", b="mat2")
_INT4_NAMES = Int4Names(
    x="self", packed_w="mat2", scales_and_zeros="qScaleAndZeros", group_size="qGroupSize"
)


def _plain(t: Any) -> bool:
    return type(t) in PLAIN


def _gemm_pair(a: Any, b: Any) -> bool:
    return _plain(a) and _plain(b) and a.dtype == b.dtype and a.dtype in _FLOATS


def _causal_mode(mask: Any, is_causal: bool, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """The SdpaKey causal mode of a call, or None if its mask is beyond what the tuner keys."""
    if mask is None:
        return "top_left" if is_causal else "none"
    if (
        isinstance(mask, CausalBias)
        and not is_causal
        and (mask.seq_len_q, mask.seq_len_kv) == (q.shape[-2], k.shape[-2])
    ):
        return _CAUSAL_BIAS.get(mask.variant)
    return None


# --- the router ---------------------------------------------------------------------------------


class Router:
    """Serves the GEMM and SDPA entry points of torch through ``dispatcher``; see the module doc.

    A handler takes the call's ``(args, kwargs)`` and whether Dynamo is tracing, and returns
    ``NotImplemented`` to leave the call to torch as it was made.
    """

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self.memo = dispatcher.memo  # tuner.serving.call_memo: call as made -> how it was served

    @staticmethod
    def _torch_serves(res: Resolution) -> bool:
        """Torch's own kernel serves this call: hand it back to torch's entry point as made
        (no views, no wrappers: in an eager decode step every microsecond of host time shows).
        Counted here: ``enable()`` turns counting on, and tuned runners count their own calls."""
        if res.by_torch:
            res.calls += 1
        return res.by_torch

    # --- GEMMs ---------------------------------------------------------------------------------

    def _gemm(self, a: torch.Tensor, b: torch.Tensor, compiling: bool) -> torch.Tensor | None:
        """``a @ b`` for 2-D operands or 3-D ones of equal batch; None: torch's kernel serves."""
        if compiling:
            return torch.ops.tuner.mm(a, b)
        if needs_grad(a, b):
            return _TunedMM.apply(a, b, self.dispatcher)
        runner, res = self.dispatcher.resolve_gemm(a, b)
        return None if self._torch_serves(res) else runner(a, b)

    def _matmul(self, args: tuple, kwargs: dict, compiling: bool) -> Any:
        a, b, out = _matmul_args(*args, **kwargs)
        if out is not None or not _gemm_pair(a, b):
            return NotImplemented
        da, db = a.dim(), b.dim()
        if da == 2 and db == 2:
            return _or_torch(self._gemm(a, b, compiling))
        if da < 2 or db < 2:
            return NotImplemented  # vectors: torch
        if db == 2:  # (..., M, K) @ (K, N): fold the leading dims into M, as torch does
            if a.shape[-1] == 0:  # K = 0: no -1 to fold into (torch's zeros)
                return NotImplemented
            y = self._gemm(a.reshape(-1, a.shape[-1]), b, compiling)
            return NotImplemented if y is None else y.view(*a.shape[:-1], b.shape[-1])
        if da == db and a.shape[:-2] == b.shape[:-2]:  # same batch dims: one bmm
            if da == 3:
                return _or_torch(self._gemm(a, b, compiling))
            if a.numel() == 0 or b.numel() == 0:  # no -1 to fold the batches into
                return NotImplemented
            y = self._gemm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), compiling)
            return NotImplemented if y is None else y.view(*a.shape[:-1], b.shape[-1])
        return NotImplemented  # broadcast batches: torch

    def _mm(self, args: tuple, kwargs: dict, compiling: bool) -> Any:
        a, b, out = _mm_args(*args, **kwargs)
        if out is not None or not _gemm_pair(a, b) or a.dim() != 2 or b.dim() != 2:
            return NotImplemented
        return _or_torch(self._gemm(a, b, compiling))

    def _bmm(self, args: tuple, kwargs: dict, compiling: bool) -> Any:
        a, b, out = _mm_args(*args, **kwargs)
        if out is not None or not _gemm_pair(a, b) or a.dim() != 3 or b.dim() != 3:
            return NotImplemented
        return (
            _or_torch(self._gemm(a, b, compiling)) if a.shape[0] == b.shape[0] else NotImplemented
        )

    def _addmm(self, args: tuple, kwargs: dict, compiling: bool) -> Any:
        c, a, b, beta, alpha, out = _addmm_args(*args, **kwargs)
        if (
            out is not None
            or beta != 1
            or alpha != 1
            or not _gemm_pair(a, b)
            or a.dim() != 2
            or b.dim() != 2
            or not _plain(c)
            or c.dtype != a.dtype
            or c.dim() > 2
        ):
            return NotImplemented
        y = self._gemm(a, b, compiling)
        return NotImplemented if y is None else y.add_(c)  # in place: no second allocation

    def _linear(self, args: tuple, kwargs: dict, compiling: bool, memo_key: tuple = ()) -> Any:
        x, w, bias = _linear_args(*args, **kwargs)
        if not _gemm_pair(x, w) or w.dim() != 2:
            return NotImplemented
        if bias is not None and not (_plain(bias) and bias.dtype == x.dtype and bias.dim() == 1):
            return NotImplemented
        nd = x.dim()
        if nd < 2 or (nd > 2 and x.shape[-1] == 0):  # K = 0 folds no leading dims: torch's
            return NotImplemented
        x2, wt = x if nd == 2 else x.reshape(-1, x.shape[-1]), w.t()
        if compiling or needs_grad(x, w, bias):
            return self._linear_out(self._gemm(x2, wt, compiling), x, w, bias)
        seen = self.dispatcher.memo_clears
        runner, res = self.dispatcher.resolve_gemm(x2, wt)
        if memo_key and res.kind != "capture" and _plain(w) and x.layout is torch.strided:
            self.dispatcher.remember(seen, memo_key, LinearMemo(x, w, runner, res))
        if self._torch_serves(res):
            return NotImplemented
        return self._linear_out(runner(x2, wt), x, w, bias)

    @staticmethod
    def _linear_out(y: torch.Tensor | None, x: torch.Tensor, w: torch.Tensor, bias: Any) -> Any:
        if y is None:
            return NotImplemented
        if bias is not None:
            y = y.add_(bias)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])

    # --- low-bit GEMMs (eager only: traced code keeps torch's ops) --------------------------------

    def _scaled_mm(self, args: tuple, kwargs: dict, compiling: bool) -> Any:
        a, b, sa, sb, bias, scale_result, out_dtype, fast, out = _scaled_mm_args(*args, **kwargs)
        if compiling or bias is not None or scale_result is not None or out is not None:
            return NotImplemented
        if not isinstance(fast, bool):  # torch's own TypeError
            return NotImplemented
        if not all(_plain(t) for t in (a, b, sa, sb)):
            return NotImplemented
        runner, res = self.dispatcher.resolve_scaled_mm(
            a, b, sa, sb, out_dtype, fast, names=_SCALED_MM_NAMES
        )
        return NotImplemented if self._torch_serves(res) else runner(a, b, sa, sb)

    def _int4_mm(self, args: tuple, kwargs: dict, compiling: bool, op_device: str = "cuda") -> Any:
        """``aten._weight_int4pack_mm`` (``op_device``: the device type torch has it for; the
        CPU's twin is ``_int4_mm_for_cpu``): a call on another device's tensors is torch's, to
        refuse as it does, not served by the dispatcher (which picks the op by device). A group
        size held in a tensor is torch's too: its op takes even a float one."""
        x, w, group_size, scales_and_zeros = _int4_args(*args, **kwargs)
        if compiling or not all(_plain(t) for t in (x, w, scales_and_zeros)) or x.dim() != 2:
            return NotImplemented
        if x.device.type != op_device or isinstance(group_size, torch.Tensor):
            return NotImplemented
        runner, res = self.dispatcher.resolve_int4(
            x, w, scales_and_zeros, group_size, names=_INT4_NAMES
        )
        return NotImplemented if self._torch_serves(res) else runner(x, w, scales_and_zeros)

    def _int4_mm_for_cpu(self, args: tuple, kwargs: dict, compiling: bool) -> Any:
        return self._int4_mm(args, kwargs, compiling, "cpu")

    # --- attention -----------------------------------------------------------------------------

    def _sdpa(self, args: tuple, kwargs: dict, compiling: bool, memo_key: tuple = ()) -> Any:
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
        if dropout_p or not (_plain(q) and _plain(k) and _plain(v)):
            return NotImplemented
        if type(gqa) is not bool or type(is_causal) is not bool:
            return NotImplemented  # torch refuses either flag if it is not a bool
        if not (q.dim() == k.dim() == v.dim() == 4) or q.dtype not in _FLOATS:
            return NotImplemented
        if k.dtype != q.dtype or v.dtype != q.dtype or torch_decides_heads(q, k, v, gqa):
            return NotImplemented
        causal = _causal_mode(mask, is_causal, q, k)
        if causal is None or isinstance(scale, torch.Tensor):  # (see Dispatcher.resolve_sdpa)
            return NotImplemented
        if compiling:
            if needs_grad(q, k, v):  # torch's fused backward beats recomputing ours
                return NotImplemented
            return torch.ops.tuner.sdpa(q, k, v, causal, scale)
        # with a gradient the dispatcher serves torch's own (differentiable) SDPA
        seen = self.dispatcher.memo_clears
        runner, res = self.dispatcher.resolve_sdpa(
            q, k, v, causal=causal, scale=scale, enable_gqa=gqa
        )
        if memo_key and res.kind != "capture" and not needs_grad(q, k, v):
            self.dispatcher.remember(seen, memo_key, SdpaMemo(runner, res))
        return NotImplemented if self._torch_serves(res) else runner(q, k, v)


def _or_torch(y: torch.Tensor | None) -> Any:
    """A handler's result: ``NotImplemented`` sends the call to torch's own entry point."""
    return NotImplemented if y is None else y


# --- switching on and off -----------------------------------------------------------------------


# (owner, attribute, handler name): the entry points that are replaced while enabled
ENTRY_POINTS = (
    (torch, "matmul", "_matmul"),
    (torch.Tensor, "matmul", "_matmul"),
    (torch.Tensor, "__matmul__", "_matmul"),
    (torch, "mm", "_mm"),
    (torch.Tensor, "mm", "_mm"),
    (torch, "bmm", "_bmm"),
    (torch.Tensor, "bmm", "_bmm"),
    (torch, "addmm", "_addmm"),
    (torch.Tensor, "addmm", "_addmm"),
    (torch.nn.functional, "linear", "_linear"),
    (torch.nn.functional, "scaled_dot_product_attention", "_sdpa"),
    (torch, "_scaled_mm", "_scaled_mm"),
    (torch.ops.aten, "_weight_int4pack_mm", "_int4_mm"),
    (torch.ops.aten, "_weight_int4pack_mm_for_cpu", "_int4_mm_for_cpu"),
    (torch, "_weight_int4pack_mm", "_int4_mm"),  # torch's own names of the two aten ops
    (torch, "_weight_int4pack_mm_for_cpu", "_int4_mm_for_cpu"),
)
# the signature each handler reads its call by
_BINDINGS: dict[str, Callable[..., tuple]] = {
    "_matmul": _matmul_args, "_mm": _mm_args, "_bmm": _mm_args, "_addmm": _addmm_args,
    "_linear": _linear_args, "_sdpa": _sdpa_args, "_scaled_mm": _scaled_mm_args,
    "_int4_mm": _int4_args, "_int4_mm_for_cpu": _int4_args,
}  # fmt: skip
_saved: list[tuple[Any, str, Any, bool]] = []  # (owner, name, original, owned its attribute)


def _route(
    router: Router,
    handler: str,
    original: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    memo_key: tuple = (),
) -> Any:
    """Serve one call through ``router``'s handler, or through torch where it declines."""
    if _guard.busy:
        return original(*args, **kwargs)
    try:
        if torch.compiler.is_compiling():  # traced: the handler emits tuner:: custom ops
            out = getattr(router, handler)(args, kwargs, True)
        else:
            _guard.busy = True
            try:
                serve = getattr(router, handler)
                out = (
                    serve(args, kwargs, False, memo_key) if memo_key else serve(args, kwargs, False)
                )
            finally:
                _guard.busy = False
    except TypeError:
        if _binds(handler, args, kwargs):  # the handler's own error
            raise
        out = NotImplemented  # a call torch's signature refuses: torch's own TypeError, below
    return original(*args, **kwargs) if out is NotImplemented else out


def _binds(handler: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call binds to the signature the handler reads it by: where it does not, the
    handler's ``TypeError`` names our binding helper (``_scaled_mm_args() got an unexpected
    keyword argument``), so torch's entry point is left to raise its own. Checked only once a
    handler has raised, so routed calls pay nothing for it."""
    try:
        inspect.signature(_BINDINGS[handler]).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _serve_tuned(runner: Callable[..., Any], *args: Any) -> Any:
    _guard.busy = True
    try:
        return runner(*args)
    finally:
        _guard.busy = False


def _transformed() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) runs this call,
    eagerly or inside ``torch.compile``: its tensors are wrappers the tuner's kernels cannot take
    (no storage, no data pointer) and whose autograd neither ``_TunedMM`` nor the custom ops
    speak, so torch serves it. (``torch._C._are_functorch_transforms_active`` is what
    ``autograd.Function`` asks too, and Dynamo reads it right while tracing.)"""
    return torch._C._are_functorch_transforms_active()


# what torch.backends.cuda.{flash,mem_efficient,math}_sdp_enabled read, called directly: a few
# times cheaper, and every SDPA call asks
_FLASH_ON = torch._C._get_flash_sdp_enabled
_MEM_EFFICIENT_ON = torch._C._get_mem_efficient_sdp_enabled
_MATH_ON = torch._C._get_math_sdp_enabled


def _sdpa_backends_chosen() -> bool:
    """Whether the caller picked torch's SDPA backends (``torch.nn.attention.sdpa_kernel``, or
    one of flash, memory-efficient and math switched off): such a call asks for torch's kernels,
    a reference or a debugging run, and gets them. (cuDNN's alone off is a common workaround,
    not a choice.) Read at run time by ``tuner::sdpa`` too: a compiled graph traced outside
    ``sdpa_kernel`` may run inside one."""
    return not (_FLASH_ON() and _MEM_EFFICIENT_ON() and _MATH_ON())


@torch.compiler.assume_constant_result
def _sdpa_backends_chosen_when_traced() -> bool:
    """``_sdpa_backends_chosen`` read while Dynamo traces (which cannot trace the switches
    themselves): an ``sdpa_kernel`` block inside the compiled code leaves its calls to torch."""
    return _sdpa_backends_chosen()


def _named_like(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _entry(original: Callable[..., Any], handler: str) -> Callable[..., Any]:
    """The wrapper that replaces one torch entry point."""

    def routed(*args: Any, **kwargs: Any) -> Any:
        router = _active
        if router is None or _transformed():
            return original(*args, **kwargs)
        return _route(router, handler, original, args, kwargs)

    return _named_like(routed, original)


def _linear_entry(original: Callable[..., Any]) -> Callable[..., Any]:
    """``F.linear``'s wrapper: ``_entry``'s, with a memo for calls seen before (every
    ``nn.Linear`` call of a model after its first): ``tuner.serving.call_memo``."""

    def linear(*args: Any, **kwargs: Any) -> Any:
        router = _active
        if router is None or _transformed():
            return original(*args, **kwargs)
        if kwargs or not 2 <= len(args) <= 3 or torch.compiler.is_compiling():
            return _route(router, "_linear", original, args, kwargs)
        x, w = args[0], args[1]
        try:
            key = linear_key(x, w)
        except (AttributeError, RuntimeError):  # not a strided tensor: the handler declines
            return _route(router, "_linear", original, args, kwargs)
        memo = router.memo.get(key)
        if memo is None or memo.weight() is not w:
            return _route(router, "_linear", original, args, kwargs, key)
        res = memo.res
        if res.by_torch:
            res.calls += 1
            return original(*args)
        bias = args[2] if len(args) == 3 else None
        if _guard.busy or not memo.fits(x, w, bias):
            return _route(router, "_linear", original, args, kwargs)
        return _serve_tuned(memo.serve, x, w, bias)

    return _named_like(linear, original)


def _sdpa_entry(original: Callable[..., Any]) -> Callable[..., Any]:
    """SDPA's wrapper: ``_entry``'s, with a memo for calls seen before (``tuner.serving.call_memo``).
    Memoised calls have no mask, so they go to torch's SDPA without ``_causal_bias_aware``."""
    call = _causal_bias_aware(original)

    def sdpa(*args: Any, **kwargs: Any) -> Any:
        router = _active
        compiling = torch.compiler.is_compiling()
        chosen = _sdpa_backends_chosen_when_traced if compiling else _sdpa_backends_chosen
        if router is None or _transformed() or chosen():
            return call(*args, **kwargs)
        if len(args) != 3 or kwargs.get("attn_mask") is not None or compiling:
            return _route(router, "_sdpa", call, args, kwargs)
        q, k, v = args
        try:
            key = sdpa_key(q, k, v, kwargs)
            memo = router.memo.get(key)
        except (AttributeError, RuntimeError, TypeError):  # not tensors, or odd keywords
            return _route(router, "_sdpa", call, args, kwargs)
        if memo is None:
            return _route(router, "_sdpa", call, args, kwargs, key)
        res = memo.res
        if res.by_torch:
            res.calls += 1
            return original(*args, **kwargs)
        if _guard.busy or not memo.fits(q, k, v):
            return _route(router, "_sdpa", call, args, kwargs)
        return _serve_tuned(memo.runner, q, k, v)

    return _named_like(sdpa, original)


def _causal_bias_aware(sdpa: Callable[..., Any]) -> Callable[..., Any]:
    """torch's SDPA as torch would run it while our wrapper is installed.

    ``CausalBias`` masks recognise an SDPA call by identity with
    ``F.scaled_dot_product_attention``, which is our wrapper while enabled; such calls are handed
    to the mask the way ``handle_torch_function`` would hand them.
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if isinstance(mask, CausalBias):
            public = torch.nn.functional.scaled_dot_product_attention
            return CausalBias.__torch_function__(public, (CausalBias,), args, kwargs)
        return sdpa(*args, **kwargs)

    return call


class _RoutedOp:
    """An aten op packet's stand-in: calls are routed, its overloads (``.default``, ...) and
    everything else stay torch's."""

    def __init__(self, routed: Callable[..., Any], packet: Any) -> None:
        self._routed, self._packet = routed, packet

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._routed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._packet, name)


def _bias_knows(sdpa: Callable[..., Any]) -> classmethod:
    """``CausalBias.__torch_function__`` that also takes ``sdpa`` (torch's SDPA, which our
    wrapper replaces) for torch's SDPA: a copy of it bound before ``enable()`` then keeps
    working with such masks, as it does without the tuner."""
    torch_function = vars(CausalBias)["__torch_function__"].__func__

    def handle(cls: type, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is sdpa:
            return cls._dispatch(*args, **(kwargs or {}))
        return torch_function(cls, func, types, args, kwargs)

    return classmethod(handle)


def _patch() -> None:
    """Replace every entry point this torch has (an op of a later torch is left out); where
    anything fails, none stays replaced."""
    try:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        bias = vars(CausalBias)["__torch_function__"]
        CausalBias.__torch_function__ = _bias_knows(sdpa)  # type: ignore[method-assign,assignment]
        _saved.append((CausalBias, "__torch_function__", bias, True))
        for owner, name, handler in ENTRY_POINTS:
            original = getattr(owner, name, None)
            if original is None:
                continue
            owned = name in vars(owner)
            wrapper: Any
            if handler == "_sdpa":
                wrapper = _sdpa_entry(original)
            elif handler == "_linear":
                wrapper = _linear_entry(original)
            else:
                wrapper = _entry(original, handler)
            if owner is torch.ops.aten:
                wrapper = _RoutedOp(wrapper, original)
            setattr(owner, name, wrapper)
            _saved.append((owner, name, original, owned))  # once replaced: what to put back
    except BaseException:
        _unpatch()
        raise


def _unpatch() -> None:
    while _saved:
        owner, name, original, owned = _saved.pop()
        if owned:
            setattr(owner, name, original)
        else:  # inherited (torch.Tensor's methods come from TensorBase): drop the override
            delattr(owner, name)


def _prepare() -> None:
    """Do now what a first resolution would otherwise do inside a CUDA-graph capture: load the
    kernel sources (imports of nvmath, CUTLASS, ...) and fingerprint the GPU (which asks CuPy for a
    cuBLAS handle). Both are cached for the process."""
    registry.all_sources()
    if torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing():
        fingerprint("cuda")


def enable(
    *,
    dispatcher: Dispatcher | None = None,
    buckets: str | None = None,
    mode: str | None = None,
) -> Dispatcher:
    """Route torch's GEMM/SDPA calls through the tuner until ``disable()`` (process-wide).

    ``dispatcher``: default the process-wide one (``TUNER_CACHE``, ``TUNER_MODE``).
    ``buckets``: bucket policy for unseen M (``exact``, ``next_tuned_above``, ``pow2``); default
    ``TUNER_BUCKETS`` or ``exact``. ``mode``: the dispatcher's miss policy (``off``, ``lookup``,
    ``record``, ``tune``). Both are set on the dispatcher and stay set after ``disable()`` (an
    ``enabled()`` block sets them for the block only). Calls nest (the innermost dispatcher
    serves); returns the dispatcher.
    """
    return _push(dispatcher or get_dispatcher(), buckets, mode).dispatcher


def _push(disp: Dispatcher, buckets: str | None, mode: str | None) -> Router:
    """A router for ``disp``, innermost from now on (patching torch for the first)."""
    _prepare()
    _configure(disp, buckets, mode)
    router = Router(disp)
    with _lock:
        if not _routers:
            _patch()
        disp.set_counting(True)  # once torch is patched: a failed enable() counts nothing
        _routers.append(router)
        _activate(router)
    return router


def _activate(router: Router | None) -> None:
    """``router`` serves from now on (None: torch's own), and its dispatcher the quantized
    layers (``serving.dispatcher.active_dispatcher``); the lock held."""
    global _active
    _active = router
    route_through(router.dispatcher if router is not None else None)


def _configure(disp: Dispatcher, buckets: str | None, mode: str | None) -> None:
    """Set what is given, both or neither: a bad one leaves the dispatcher as it was."""
    before = disp.buckets, disp.mode
    try:
        if buckets is not None:
            disp.set_buckets(buckets)
        if mode is not None:
            disp.set_mode(mode)
    except ValueError:
        _configure(disp, *before)
        raise


def disable() -> None:
    """Undo the innermost ``enable()``; the last one puts torch's functions back."""
    with _lock:
        if not _routers:
            raise RuntimeError("tuner.torch.disable() without a matching enable()")
        _remove(len(_routers) - 1)


def _pop(router: Router) -> None:
    """Undo the ``enable()`` that made ``router``, wherever it now is: blocks of other threads
    may have opened and closed since (nothing, if a ``disable()`` undid it already)."""
    with _lock:
        at = next((i for i, r in enumerate(_routers) if r is router), None)
        if at is not None:
            _remove(at)


def _remove(at: int) -> None:
    """Drop ``_routers[at]`` (the lock held); the last one puts torch's functions back."""
    del _routers[at]
    _activate(_routers[-1] if _routers else None)
    if not _routers:
        _unpatch()


def is_enabled() -> bool:
    return _active is not None


@contextlib.contextmanager
def enabled(
    *,
    dispatcher: Dispatcher | None = None,
    buckets: str | None = None,
    mode: str | None = None,
) -> Iterator[Dispatcher]:
    """``with tuner.torch.enabled(): model(x)``: ``enable()`` for the block, undone at its end
    (this block's, though another thread's block opened inside it); a ``buckets`` or ``mode``
    given holds for the block only (an enclosing block's comes back)."""
    disp = dispatcher or get_dispatcher()
    token = object()
    with _lock:
        before = disp.buckets, disp.mode
        _configure(disp, buckets, mode)
        _block_settings.setdefault(disp, (before, []))[1].append((token, buckets, mode))
    try:
        router = _push(disp, None, None)
    except BaseException:
        _drop_settings(disp, token)
        raise
    try:
        yield disp
    finally:
        _pop(router)
        _drop_settings(disp, token)


# per dispatcher: (its buckets and mode before any block set one, the open blocks' settings in
# the order they opened); a block's end drops its own and applies what the others still set, so
# blocks of several threads that overlap leave the dispatcher as it was once all have ended
_block_settings: weakref.WeakKeyDictionary[
    Dispatcher, tuple[tuple[str, str], list[tuple[object, str | None, str | None]]]
] = weakref.WeakKeyDictionary()


def _drop_settings(disp: Dispatcher, token: object) -> None:
    with _lock:
        (buckets, mode), open_blocks = _block_settings[disp]
        open_blocks[:] = [b for b in open_blocks if b[0] is not token]
        for _, block_buckets, block_mode in open_blocks:
            buckets, mode = block_buckets or buckets, block_mode or mode
        if not open_blocks:
            del _block_settings[disp]
        # set only what changes: setting either drops the dispatcher's runners and memos
        _configure(disp, buckets if buckets != disp.buckets else None,
                   mode if mode != disp.mode else None)  # fmt: skip


# --- diagnostics ---------------------------------------------------------------------------------

PASSTHROUGH = ("default", "untunable")


@dataclass(frozen=True)
class Stats:
    """Calls per resolved problem. Kinds (``tuner.serving.dispatcher.RESOLUTION_KINDS``): ``hit`` (the key's
    winner), ``bucketed`` (a neighbour's winner rebuilt for the key), ``miss`` and ``capture``
    (torch's default for want of a winner), ``default``/``untunable`` (torch by policy or scope),
    ``loading`` (torch while the winner's kernel is fetched or built in the background) and
    ``failed`` (torch: the winner was tuned but failed to build or cannot serve here, see the
    dispatcher's loader and log; counted as ``build_failures``, not as misses).

    ``saved_us``: calls x (winner's baseline_us - median_us), the estimate measured at tuning time;
    for bucketed calls it is the neighbour's figure, an estimate of an estimate.
    """

    rows: tuple[Resolution, ...]

    def calls_of(self, *kinds: str) -> int:
        return sum(r.calls for r in self.rows if r.kind in kinds)

    @property
    def calls(self) -> int:
        return sum(r.calls for r in self.rows)

    @property
    def hits(self) -> int:
        return self.calls_of("hit")

    @property
    def bucketed(self) -> int:
        return self.calls_of("bucketed")

    @property
    def misses(self) -> int:
        return self.calls_of("miss", "capture")

    @property
    def build_failures(self) -> int:
        """Calls of tuned problems that torch served because the winner failed to build or cannot
        serve here: unlike a miss, tuning again will not help; the log says why."""
        return self.calls_of("failed")

    @property
    def loading(self) -> int:
        """Calls torch served while the winner's kernel was fetched or built in the background."""
        return self.calls_of("loading")

    @property
    def passthrough(self) -> int:
        return self.calls_of(*PASSTHROUGH)

    @property
    def saved_us(self) -> float:
        return sum(r.calls * r.saved_us for r in self.rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "hits": self.hits,
            "bucketed": self.bucketed,
            "misses": self.misses,
            "build_failures": self.build_failures,
            "loading": self.loading,
            "passthrough": self.passthrough,
            "saved_us": self.saved_us,
            "rows": [
                {
                    "key": r.key,
                    "kind": r.kind,
                    "candidate": r.candidate,
                    "via": r.via,
                    "calls": r.calls,
                    "saved_us_per_call": r.saved_us,
                }
                for r in self.rows
            ],
        }

    def table(self) -> str:
        """The counts, then a line for each signature called in the snapshot (one resolved
        before and not called since is only counted, so the lines add up to the calls)."""
        head = (
            f"tuner.torch: {counted(self.calls, 'call')}: {self.hits} hits, {self.bucketed} "
            f"bucketed, {self.misses} misses, {self.build_failures} build failures, "
            f"{self.loading} while loading, {self.passthrough} left to torch; "
            f"estimated time saved {self.saved_us / 1e3:.3f} ms"
        )
        lines = [head, f"{'kind':<10} {'calls':>8} {'saved us/call':>14}  candidate  <-  key"]
        called = [r for r in self.rows if r.calls]
        for r in sorted(called, key=lambda r: (-r.calls, r.key)):
            via = f" (via {r.via})" if r.via else ""
            winner = candidate_label(r.candidate)
            lines.append(
                f"{r.kind:<10} {r.calls:>8} {r.saved_us:>14.2f}  {winner}  <-  {r.key}{via}"
            )
        if idle := len(self.rows) - len(called):
            lines.append(f"({counted(idle, 'signature')} resolved earlier, not called since)")
        return "\n".join(lines)

    __str__ = table


def stats(dispatcher: Dispatcher | None = None) -> Stats:
    """A snapshot of the calls counted since the dispatcher's first ``enable()`` (counting
    then stays on, across blocks) or the last ``reset_stats()``."""
    disp = dispatcher or active_dispatcher()
    return Stats(tuple(replace(r) for r in list(disp.resolutions.values())))


def reset_stats(dispatcher: Dispatcher | None = None) -> None:
    for r in list((dispatcher or active_dispatcher()).resolutions.values()):
        r.calls = 0


__all__ = [
    "ENTRY_POINTS",
    "Router",
    "Stats",
    "active_dispatcher",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "mm_grads",
    "quantize_linear",
    "reset_stats",
    "stats",
    "tuned_mm",
    "tuned_sdpa",
]
