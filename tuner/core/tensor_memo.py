"""A value made once per tensor and kept while the tensor lives unchanged.

Used where a runner converts an operand on its first call (a weight layout, split scales) and
must not pay for it again on the next call, nor serve it for a tensor changed in place.

Tensors made under ``torch.inference_mode()`` (a model loaded or quantized there) have no version
counter: torch refuses to write them in place outside inference mode, and inside it their writes
cannot be seen, so their values are kept while they live. Code that writes such a tensor in place
(``Int4Linear`` loading a state dict, or a user, as ``tuner.forget``) calls ``forget`` for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

_MEMOS: weakref.WeakSet[TensorMemo[object]] = weakref.WeakSet()  # every memo, for ``forget``
_forgets = [0]  # ``forget`` calls so far: a value made across one is not kept


def _version(t: torch.Tensor) -> int:
    """``t._version``; -1 for an inference tensor, which has none (torch raises for it, and a
    raise costs far more than the check)."""
    return -1 if t.is_inference() else t._version


def forget(t: torch.Tensor) -> None:
    """Drop what every memo made of ``t`` (a kernel's layout of a weight, split scales): call it
    after writing ``t`` in place where its version cannot say so (a tensor made under
    ``torch.inference_mode()``); the next call makes them anew from its values."""
    _forgets[0] += 1
    for memo in list(_MEMOS):
        memo._table.pop(id(t), None)


class TensorMemo(Generic[T]):
    """``make(t)`` per tensor, kept while ``t`` lives and is not changed in place (its
    ``_version``). Looked up in a dict by ``id`` through a weak reference: a few times cheaper
    per lookup than a WeakIdKeyDictionary (which builds a reference object per lookup), and a
    launcher looks up on every call."""

    def __init__(self, make: Callable[[torch.Tensor], T]) -> None:
        self._make = make
        self._table: dict[int, tuple[weakref.ref[torch.Tensor], int, T]] = {}
        _MEMOS.add(self)

    def __len__(self) -> int:
        return len(self._table)

    def __call__(self, t: torch.Tensor) -> T:
        known = self._table.get(id(t))
        if known is not None and known[0]() is t and (known[1] < 0 or known[1] == t._version):
            return known[2]  # a kept version of -1: an inference tensor, kept while it lives
        # read before making: a write while another thread makes the value (a hot reload)
        # moves ``t``'s version past the one kept, or is a ``forget`` meanwhile, so the value
        # made from the old contents is not served again
        version, forgets = _version(t), _forgets[0]
        value = self._make(t)
        if forgets != _forgets[0]:
            return value
        return self._keep(t, version, value)

    def put(self, t: torch.Tensor, value: T) -> T:
        """Keep ``value`` as what ``t`` makes (its maker knew it already)."""
        return self._keep(t, _version(t), value)

    def _keep(self, t: torch.Tensor, version: int, value: T) -> T:
        key = id(t)

        def drop(ref: weakref.ref[torch.Tensor]) -> None:  # t died: its id may be reused
            if self._table.get(key, (None,))[0] is ref:
                del self._table[key]

        self._table[key] = (weakref.ref(t, drop), version, value)
        return value
