"""Memos of resolved calls, keyed on the call as made: the fast path of ``tuner.torch``.

In an eager decode step the host sets the pace, and every microsecond spent routing a call is
paid per layer and per projection. A dispatcher signature (shapes, strides, dtypes, device,
alignment, TF32, autograd) costs more Python per call than the call itself should; a memo key
is the cheaper part of it that differs from call to call:

- ``F.linear(x, w)``: ``(id(w), x.shape, x.stride(), x.dtype)``: a model's weights live long,
  so their ``id`` names them. A weak reference checks that the weight is still the same object (a
  weight made afresh per call, say ``w.t()``, misses every time and is served as if there were no
  memo); a tuned runner also checks its storage, layout, shape and dtype (``data_ptr``,
  ``stride``, ``shape``, ``dtype``): ``w.data = w.data[:n]`` keeps the object, its storage and its
  strides, and only the shape tells the cut weight from the one the runner was built for.
- ``F.scaled_dot_product_attention(q, k, v, **kw)``: shapes and strides of q, k and v, dtype,
  device and the keyword arguments with their types (no tensor mask): ``is_causal=1`` equals
  ``True`` but torch refuses it, so it must not find ``True``'s memo.

A memo whose call torch serves sends the call straight back to torch: that is correct whatever
the rest of the signature (alignment, TF32, autograd), because torch decides those itself. A memo
of a tuned runner is used only after ``fits`` checks the rest. Memos live in
``Dispatcher.memo``, which is cleared whenever the dispatcher forgets its runners.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tuner.serving.dispatcher import Resolution

PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def needs_grad(*ts: torch.Tensor | None) -> bool:
    if not torch.is_grad_enabled():  # first: inference runs under no_grad, and this is cheap
        return False
    return any(t is not None and t.requires_grad for t in ts)


def linear_key(x: torch.Tensor, w: torch.Tensor) -> tuple:
    return ("linear", id(w), x.shape, x.stride(), x.dtype)


def sdpa_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any]) -> tuple:
    return ("sdpa", q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype,
            q.get_device(), *kwargs.items(), *map(type, kwargs.values()))  # fmt: skip


class LinearMemo:
    """How ``F.linear(x, w)`` with this parameter ``w`` and x's shape, strides and dtype was
    served, and the rest of the dispatcher signature a tuned runner relies on."""

    __slots__ = (
        "align", "device", "dtype", "flat", "out_shape", "ptr", "res", "runner", "shape", "stride",
        "tf32", "weight",
    )  # fmt: skip

    def __init__(self, x: torch.Tensor, w: torch.Tensor, runner: Any, res: Resolution) -> None:
        self.weight = weakref.ref(w)
        self.ptr, self.stride, self.shape, self.dtype = w.data_ptr(), w.stride(), w.shape, w.dtype
        self.runner, self.res = runner, res
        self.align = x.data_ptr() % 16
        self.tf32 = torch._C._get_cublas_allow_tf32()
        self.device = x.get_device()  # an int (-1: the CPU), cheaper than a torch.device
        # x's shape is in the key: an x of more than 2 dims is served as 2-D, reshaped back
        batched = x.dim() > 2
        self.flat = (-1, x.shape[-1]) if batched else None
        self.out_shape = (*x.shape[:-1], w.shape[0]) if batched else None

    def serve(self, x: torch.Tensor, w: torch.Tensor, bias: Any) -> torch.Tensor:
        """``F.linear(x, w, bias)`` by the tuned runner (on x as 2-D and ``w.t()``)."""
        y = self.runner(x if self.flat is None else x.reshape(self.flat), w.t())
        if bias is not None:
            y = y.add_(bias)
        return y if self.out_shape is None else y.view(self.out_shape)

    def fits(self, x: torch.Tensor, w: torch.Tensor, bias: Any) -> bool:
        """The tuned runner may serve this call (the key matched and ``w`` is the memo's
        object; its storage, layout, shape and dtype, and the rest of the call, are checked
        here: ``.data`` may have been given another tensor of that storage, say rows cut off)."""
        return (
            self.ptr == w.data_ptr()
            and self.stride == w.stride()
            and self.shape == w.shape
            and self.dtype == w.dtype
            and type(x) in PLAIN
            and x.data_ptr() % 16 == self.align
            and x.get_device() == self.device
            and (x.dtype != torch.float32 or torch._C._get_cublas_allow_tf32() == self.tf32)
            and (
                bias is None or (type(bias) in PLAIN and bias.dtype == x.dtype and bias.dim() == 1)
            )
            and not needs_grad(x, w, bias)
        )


class SdpaMemo:
    """How an SDPA call with these shapes, strides, dtype, device and keywords was served."""

    __slots__ = ("res", "runner")

    def __init__(self, runner: Any, res: Resolution) -> None:
        self.runner, self.res = runner, res

    @staticmethod
    def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        return (
            type(q) in PLAIN
            and type(k) in PLAIN
            and type(v) in PLAIN
            and k.dtype == q.dtype
            and v.dtype == q.dtype
            and k.get_device() == q.get_device()
            and v.get_device() == q.get_device()
            and not q.is_meta  # a meta tensor's get_device() is the CPU's -1: torch's
            and not needs_grad(q, k, v)
        )
