"""tuner: autotuned GEMM and attention kernels with a shared results cache.

import tuner
c = tuner.matmul(a, b)          # the fastest known kernel for this problem on this GPU
o = tuner.sdpa(q, k, v, causal=True)

``import tuner`` is cheap: it loads neither torch nor the dispatcher and leaves the environment
alone. ``matmul``, ``sdpa`` and ``set_mode`` are looked up on first use (PEP 562), and the config
file is read when the process dispatcher is made, so tools that only need the cache or the fleet
service (``server/``) never pay for torch.
"""

from typing import Any

from tuner.version import __version__

_LAZY = ("matmul", "sdpa", "set_mode")
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from tuner.serving import dispatcher

        return getattr(dispatcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
