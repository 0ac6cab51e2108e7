"""The versions a GPU's fingerprint records, read without CuPy: the driver's from libcuda, cuBLAS's
from the library the ``cublas`` source calls. They must read as CuPy read them before, or every
stored result would turn stale on upgrade."""

from __future__ import annotations

import re

import pytest
import torch

from tuner.core import device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


def test_a_gpus_fingerprint_names_its_driver_and_cublas():
    versions = device.fingerprint("cuda").versions
    assert re.fullmatch(r"\d{5}", versions["driver"])  # 13000: CUDA 13.0
    assert re.fullmatch(r"\d{5,6}", versions["cublas"])  # 130100: cuBLAS 13.1.0
    assert versions["cuda"] == torch.version.cuda


def test_cublas_and_driver_versions_read_as_cupy_reads_them():
    cupy = pytest.importorskip("cupy")
    from cupy_backends.cuda.libs import cublas

    assert device.driver_version() == cupy.cuda.runtime.driverGetVersion()
    assert device.cublas_version() == cublas.getVersion(cupy.cuda.Device().cublas_handle)
