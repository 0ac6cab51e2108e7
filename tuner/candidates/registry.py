"""Which candidate sources exist: the built-in ones plus those of installed plugins.

A third-party package adds a source through an entry point in the group ``tuner.sources``::

    [project.entry-points."tuner.sources"]
    my_gemm = "my_pkg.kernels:MyGemmSource"
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging

from tuner.candidates.base import Source
from tuner.core.guesses import did_you_mean
from tuner.core.keys import Key

log = logging.getLogger(__name__)

# module:class of every built-in source; imported lazily so that a missing optional package
# (nvmath, cutlass) only disables its own source.
BUILTIN = {
    "torch": "tuner.candidates.torch_ref:TorchGemm",
    "torch_sdpa": "tuner.candidates.torch_ref:TorchSdpa",
    "triton_gemm": "tuner.candidates.triton_gemm:TritonGemm",
    "triton_attention": "tuner.candidates.triton_attention:TritonAttention",
    "triton_decode": "tuner.candidates.triton_decode:TritonDecode",
    "cublas": "tuner.candidates.cublas:CublasGemm",
    "cublaslt": "tuner.candidates.cublaslt:CublasLtGemm",
    "cutlass": "tuner.candidates.cutlass_gemm:CutlassGemm",
    "torch_lowbit": "tuner.candidates.torch_lowbit:TorchLowbit",
    "triton_w4a16": "tuner.candidates.triton_w4a16:TritonW4A16",
    "triton_fp8": "tuner.candidates.triton_fp8:TritonFp8",
    "cublaslt_fp8": "tuner.candidates.cublaslt_fp8:CublasLtFp8",
    "cutlass_fp8": "tuner.candidates.cutlass_fp8:CutlassFp8",
    "cutlass_w4a16": "tuner.candidates.cutlass_w4a16:CutlassW4A16",
    "cuda_w4a16": "tuner.candidates.cuda_w4a16:CudaW4A16",
    "cuda_fp8": "tuner.candidates.cuda_fp8:CudaFp8",
    "dequant_gemm": "tuner.candidates.dequant_gemm:DequantGemm",
}


def load_target(target: str) -> type[Source]:
    """The Source class a ``module:Class`` target names (entry points, worker registration)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def all_sources() -> dict[str, Source | str]:
    """name -> Source instance, or the reason it could not be loaded (shown by ``tuner info``)."""
    found: dict[str, Source | str] = {}
    targets = dict(BUILTIN)
    for ep in importlib.metadata.entry_points(group="tuner.sources"):
        targets.setdefault(ep.name, ep.value)
    for name, target in targets.items():
        try:
            found[name] = load_target(target)()
        except ImportError as e:
            found[name] = f"package missing: {e.name or e}"
        except Exception as e:  # a broken plugin must not take the tuner down
            log.warning("candidate source %s (%s) failed to load: %r", name, target, e)
            found[name] = f"failed to load: {e!r}"
    return found


def register(source: Source) -> None:
    """Add (or replace) a source at run time, e.g. a kernel family defined in a notebook."""
    all_sources()[source.name] = source


def unregister(name: str) -> None:
    all_sources().pop(name, None)


def sources(op: str | None = None) -> list[Source]:
    """Loaded sources, optionally of one op; the baseline first."""
    loaded = [s for s in all_sources().values() if isinstance(s, Source) and op in (None, s.op)]
    return sorted(loaded, key=lambda s: s.baseline_params is None)


def check_names(names: list[str] | None) -> None:
    """ValueError for a source name that does not exist: a typo would silently tune nothing."""
    unknown = [n for n in names or () if n not in all_sources()]
    if unknown:
        known = sorted(all_sources())
        raise ValueError(
            f"unknown candidate source {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
            f"known: {', '.join(known)}"
        )


def get(name: str) -> Source:
    src = all_sources().get(name)
    if not isinstance(src, Source):
        raise KeyError(f"candidate source {name!r} is not available: {src or 'unknown name'}")
    return src


def baseline(op: str, key: Key | None = None) -> Source:
    """The baseline source of ``op``; with ``key``, the one that takes that key (torch's
    low-bit ops for low-bit GEMM keys)."""
    for s in sources(op):
        if s.baseline_params is not None and (key is None or s.unsupported(key) is None):
            return s
    raise LookupError(f"no baseline source for op {op!r}" + (f" and key {key}" if key else ""))
