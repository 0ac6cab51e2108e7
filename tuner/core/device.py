"""Device fingerprint: which GPU class a result belongs to, and which versions made it.

The *device class* decides who may share a result: same GPU name, compute capability, SM count and
memory size (rounded to GiB). The *versions* (driver, CUDA, cuBLAS, Triton, CUTLASS, torch, tuner)
are stored beside every result as ``version_tag``; a result made under other versions is stale
(``Winner.measured_under``). The dataclass is plain data: torch loads only inside
``fingerprint()``, so the fleet service can build and compare fingerprints without it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from tuner.version import __version__


@dataclass(frozen=True)
class Fingerprint:
    kind: str  # "cuda" or "cpu"
    name: str
    compute_capability: str  # "9.0"; "" on CPU
    sm_count: int  # multiprocessors; CPU cores on CPU
    memory_gib: int
    l2_bytes: int = 0
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def device_class(self) -> str:
        """Stable id, e.g. ``cuda-nvidia-h200-sm90-132sm-140gib`` or ``cpu-x86-64-2c``."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        if self.kind == "cpu":
            return f"cpu-{slug}-{self.sm_count}c"
        cc = self.compute_capability.replace(".", "")
        return f"cuda-{slug}-sm{cc}-{self.sm_count}sm-{self.memory_gib}gib"

    @property
    def version_tag(self) -> str:
        """The versions that decide a result's validity, as one comparable string."""
        return ";".join(f"{k}={v}" for k, v in sorted(self.versions.items()))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device_class": self.device_class}


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _cuda_versions() -> dict[str, str]:
    """The CUDA, driver and cuBLAS versions (torch exposes only the first). A version that cannot
    be read is left out, never fatal."""
    import torch

    versions = {"cuda": torch.version.cuda or ""}
    with contextlib.suppress(OSError, AttributeError):
        versions["driver"] = str(driver_version())
    with contextlib.suppress(Exception):  # nvmath-python missing, or its cuBLAS will not load
        versions["cublas"] = str(cublas_version())
    return versions


def driver_version() -> int:
    """The driver's CUDA version (13000 for 13.0), from libcuda itself: no package needed."""
    version = ctypes.c_int()
    status = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
    if status != 0:
        raise OSError(f"cuDriverGetVersion returned {status}")
    return version.value


def cublas_version() -> int:
    """The version of the cuBLAS the ``cublas`` source calls (through nvmath-python's bindings),
    spelled as ``cublasGetVersion`` does: major * 10000 + minor * 100 + patch."""
    from nvmath.bindings import cublas

    major, minor, patch = (cublas.get_property(p) for p in range(3))  # libraryPropertyType
    return major * 10000 + minor * 100 + patch


def fingerprint(device: Any = None) -> Fingerprint:
    """Fingerprint of a CUDA device or of the CPU.

    ``device``: ``"cuda"`` (the current GPU), ``"cuda:1"`` or a ``torch.device`` (that GPU: a
    host may hold GPUs of several models), ``"cpu"``; by default the current GPU where there is
    one, else the CPU.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return _fingerprint(None)
    return _fingerprint(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _fingerprint(gpu: int | None) -> Fingerprint:
    """The fingerprint of GPU ``gpu``, or of the CPU (None)."""
    import torch

    versions = {
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "tuner": __version__,
    }
    cutlass = _package_version("nvidia-cutlass")
    if cutlass:
        versions["cutlass"] = cutlass
    if gpu is not None:
        p = torch.cuda.get_device_properties(gpu)
        versions.update(_cuda_versions())
        return Fingerprint(
            kind="cuda",
            name=p.name,
            compute_capability=f"{p.major}.{p.minor}",
            sm_count=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30),
            l2_bytes=getattr(p, "L2_cache_size", 0),
            versions=versions,
        )
    return Fingerprint(
        kind="cpu",
        name=platform.machine() or "cpu",
        compute_capability="",
        sm_count=os.cpu_count() or 1,
        memory_gib=0,
        versions=versions,
    )


def host_fingerprints() -> list[Fingerprint]:
    """One fingerprint per GPU class of this host (a host may hold GPUs of several models), or
    the CPU's where there is no GPU (each visible GPU's properties read)."""
    import torch

    if not torch.cuda.is_available():
        return [fingerprint("cpu")]
    gpus = (fingerprint(f"cuda:{index}") for index in range(torch.cuda.device_count()))
    return list({fp.device_class: fp for fp in gpus}.values())


def memory_bytes() -> int:
    """The memory a problem's operands are made in: the current GPU's, else the host's RAM."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def too_big_here(needed: int) -> str | None:
    """Why operands of ``needed`` bytes cannot be made here, or None. Asked before anything is
    allocated: a problem past the memory then fails in one line, not in the allocator (or in
    the out-of-memory killer, for host memory promised but not there)."""
    import torch

    memory = memory_bytes()
    if needed <= memory:
        return None
    where = "GPU" if torch.cuda.is_available() else "host"
    return (f"its operands take {needed / 2**30:.1f} GiB, more than this {where}'s "
            f"{memory / 2**30:.1f} GiB")  # fmt: skip
