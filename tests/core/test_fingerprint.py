"""``fingerprint(device)``: one per device, asked by name, by ``torch.device`` or by default;
each GPU of a host its own (a host may hold GPUs of several models)."""

from __future__ import annotations

import pytest
import torch

from tuner.core.device import fingerprint


def test_the_default_is_the_current_gpu_else_the_cpu():
    here = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    assert fingerprint() is fingerprint(here) is fingerprint(torch.device(here))


def test_the_cpu_is_one_device_however_it_is_named():
    cpu = fingerprint("cpu")
    assert cpu is fingerprint(torch.device("cpu"))
    assert cpu.kind == "cpu" and cpu.device_class.startswith("cpu-")


@pytest.mark.gpu
def test_cuda_means_the_current_gpu():
    index = torch.cuda.current_device()
    fp = fingerprint("cuda")
    assert fp is fingerprint(f"cuda:{index}") is fingerprint(torch.device("cuda", index))
    assert fp.name == torch.cuda.get_device_name(index)


def test_a_name_that_is_no_device_is_refused():
    with pytest.raises(RuntimeError, match="cuda:x"):
        fingerprint("cuda:x")
