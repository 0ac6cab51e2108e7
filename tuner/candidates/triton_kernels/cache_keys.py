"""Triton cache keys that do not depend on what a process compiled first.

Triton memoizes a JIT function's cache key the first time something asks for it, and in some
releases the key of a function depends on whether its callees already had theirs: a kernel
whose helper another kernel hashed first (``_weight_tile``, shared by the W4A16 GEMM and the
dequantization pass) gets another key than in a fresh process. The compile workers are fresh
processes; the process that times the candidates is not. When their keys differ, it finds
nothing the workers compiled and compiles every kernel again on its first call.

``settle(globals())`` at the end of a kernel module hashes that module's JIT functions in
definition order, while it is imported: every function is then hashed with its callees from
other modules already hashed, in every process alike."""

from __future__ import annotations

from typing import Any

from triton.runtime.jit import JITFunction


def settle(namespace: dict[str, Any]) -> None:
    """Compute the cache key of each JIT function defined in the module ``namespace`` belongs
    to (not the ones it imports), in definition order. A no-op in the interpreter, whose
    functions have no cache key."""
    module = namespace["__name__"]
    for value in list(namespace.values()):
        if isinstance(value, JITFunction) and value.module == module:
            value.cache_key  # noqa: B018 (memoized by Triton: the point is when it is computed)
