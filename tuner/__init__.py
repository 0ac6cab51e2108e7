"""tuner: autotuned GEMM and attention kernels with a shared results cache.

import tuner
c = tuner.matmul(a, b)          # the fastest known kernel for this problem on this GPU
o = tuner.sdpa(q, k, v, causal=True)
y = tuner.scaled_mm(a8, b8, scale_a, scale_b, out_dtype=torch.bfloat16)  # torch._scaled_mm's
y = tuner.int4_linear(x, packed_w, scales_and_zeros, 128)  # int4 weights packed as torch packs
tuner.warmup()                  # every stored winner loaded before a model starts
tuner.forget(packed_w)          # after writing an inference-mode weight in place (below)

``import tuner`` is cheap: it loads neither torch nor the dispatcher and leaves the environment
alone. ``matmul``, ``sdpa``, ``scaled_mm``, ``int4_linear``, ``set_mode`` and ``warmup`` are looked
up on first use (PEP 562), and the config file is read when the process dispatcher is made, so tools
that only need the cache or the fleet service (``server/``) never pay for torch.

A kernel's own layout of a weight (or its split scales) is made on its first call and kept while
the tensor lives unchanged. A tensor made under ``torch.inference_mode()`` has no version counter,
so a write into it in place (``packed_w.copy_(...)`` inside inference mode) cannot be seen: call
``tuner.forget(t)`` after it, or the next call is served the old values.
"""

from typing import Any

from tuner.version import __version__

_LAZY = ("matmul", "sdpa", "scaled_mm", "int4_linear", "set_mode", "warmup", "forget")
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name == "warmup":  # load every stored winner before a model starts (tuner.serving.warmup)
        from tuner.serving.warmup import warmup

        return warmup
    if name == "forget":  # drop what the kernels made of a tensor written in place
        from tuner.core.tensor_memo import forget

        return forget
    if name in _LAZY:
        from tuner.serving import dispatcher

        return getattr(dispatcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
