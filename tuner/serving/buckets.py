"""Bucket policies: which tuned GEMM serves an M that was never tuned.

Decode batch sizes change from call to call, so a model meets GEMMs whose M was never tuned. A
bucket policy maps such an M to a tuned neighbour of the same *family* (N, K, batch, layout,
dtypes, compute mode and alignment class: everything in the key but M):

- ``exact``: only the exact key; an unseen M gets the default (torch);
- ``next_tuned_above``: the smallest tuned M' >= M of the family;
- ``pow2``: M' = the next power of two >= M, if that M' was tuned.

A neighbour lends its winner's *params*, never its runner: the dispatcher rebuilds the source's
runner for the actual key (``source.build(actual_key, params)``), so grids and edge masks are
those of the real problem. A source whose params are not valid for every M may say so with an
optional ``valid_for(key, params) -> str | None`` method (the reason they are not, or None);
``unsupported(key)`` is asked as well. The exact miss is still recorded for offline tuning by the
dispatcher's record/tune modes. The policy is ``TUNER_BUCKETS`` or ``Dispatcher.set_buckets``.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import Any

from tuner.core.keys import GemmKey, parse_key
from tuner.core.settings import CHOICES

POLICIES = CHOICES["buckets"]
DEFAULT_POLICY = "exact"

Family = tuple[object, ...]


def check_policy(policy: str, name: str = "TUNER_BUCKETS") -> str:
    """``policy``, or a ValueError naming where it came from (``name``)."""
    if policy not in POLICIES:
        raise ValueError(f"{name} must be one of {list(POLICIES)}, got {policy!r}")
    return policy


def family(key: GemmKey) -> Family:
    """Everything that must match for a neighbour's params to be considered: every field but M
    (the low-bit fields included, so an int4 key never borrows a bf16 neighbour's kernel)."""
    return tuple(getattr(key, f.name) for f in dataclasses.fields(key) if f.name != "m")


def next_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


class BucketIndex:
    """The tuned M values of each GEMM family, sorted; built from winner key strings."""

    def __init__(self, keys: Iterable[GemmKey] = ()) -> None:
        ms: dict[Family, set[int]] = {}
        for key in keys:
            ms.setdefault(family(key), set()).add(key.m)
        self._ms = {fam: sorted(values) for fam, values in ms.items()}

    @classmethod
    def from_key_strings(cls, keys: Iterable[str]) -> BucketIndex:
        """Index the GEMM keys among ``keys``; other ops and unparsable strings are skipped."""
        parsed = []
        for text in keys:
            if not text.startswith("gemm:"):
                continue
            try:
                parsed.append(parse_key(text))
            except ValueError:
                continue
        return cls(k for k in parsed if isinstance(k, GemmKey))

    def neighbour(self, key: GemmKey, policy: str) -> GemmKey | None:
        """The tuned key that should serve ``key`` under ``policy``, or None.

        Never ``key`` itself: an exact winner is the dispatcher's business before buckets.
        """
        ms = self._ms.get(family(key))
        if not ms or policy == "exact":
            return None
        if policy == "next_tuned_above":
            i = bisect.bisect_left(ms, key.m)
            m = ms[i] if i < len(ms) else None
        elif policy == "pow2":
            p = next_pow2(key.m)
            m = p if p in ms else None
        else:
            check_policy(policy)
            return None
        if m is None or m == key.m:
            return None
        return dataclasses.replace(key, m=m)


def transfer_problem(source: Any, key: GemmKey, params: dict[str, Any]) -> str | None:
    """Why ``params`` (tuned for another M) cannot serve ``key`` on ``source``, or None."""
    reason = source.unsupported(key)
    if reason:
        return reason
    check = getattr(source, "valid_for", None)
    return check(key, params) if check is not None else None


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "BucketIndex",
    "check_policy",
    "family",
    "next_pow2",
    "transfer_problem",
]
