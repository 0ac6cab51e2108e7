"""``tuner.warmup``: every stored winner of this device class loaded into the dispatcher, with
what could not be loaded reported, over a real store (Triton winners run by its interpreter)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tuner.cache import Store
from tuner.candidates import registry
from tuner.candidates.base import Source
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.measure.records import Winner
from tuner.serving.dispatcher import Dispatcher
from tuner.serving.warmup import warmup

TRITON = {"bm": 32, "bn": 32, "bk": 32, "group_m": 8, "warps": 4, "stages": 1}


class Broken(Source):
    name = "broken_build"
    op = "gemm"

    def candidates(self, key, device):
        return [{}]

    def build(self, key, params):
        raise RuntimeError("kernel image is for sm_100, this GPU is sm_90")


def store_winners(cache_path: Path) -> dict[str, GemmKey]:
    dc = fingerprint().device_class
    keys = {
        "triton": GemmKey(m=33, n=20, k=48, dtype="f16", out_dtype="f16", align=8),
        "broken": GemmKey(m=16, n=16, k=16),
        "torch": GemmKey(m=8, n=8, k=8),
        "gone": GemmKey(m=24, n=8, k=8),
    }
    Store(cache_path).put_winners(
        [
            Winner(dc, str(keys["triton"]), "triton_gemm", TRITON, 1.0, 2.0),
            Winner(dc, str(keys["broken"]), "broken_build", {}, 1.0, 2.0),
            Winner(
                dc, str(keys["torch"]), "torch", registry.baseline("gemm").baseline_params, 1.0, 1.0
            ),
            Winner(dc, str(keys["gone"]), "no_such_source", {}, 1.0, 2.0),
            Winner("other-device", str(keys["triton"]), "broken_build", {}, 1.0, 2.0),
        ]
    )
    return keys


@pytest.mark.cpu_host
def test_warmup_loads_every_winner_and_reports_what_it_could_not(cache_path: Path) -> None:
    keys = store_winners(cache_path)
    registry.register(Broken())
    try:
        d = Dispatcher(cache_path, mode="lookup")
        report = warmup(progress=False, dispatcher=d, fetch=False)
    finally:
        registry.unregister("broken_build")
    assert report.device_class == fingerprint().device_class
    assert (report.winners, report.loaded, report.ready) == (4, 1, 1)
    assert not report.ok
    why = {f.key: f.error for f in report.failures}
    assert set(why) == {str(keys["broken"]), str(keys["gone"])}
    assert "sm_100" in why[str(keys["broken"])]
    assert "no_such_source" in why[str(keys["gone"])]

    (job,) = d.loaded
    assert job.startswith(str(keys["triton"]))
    a = torch.randn(33, 48, dtype=torch.float16)
    b = torch.randn(48, 20, dtype=torch.float16)
    got = d.matmul(a, b)  # served by the loaded runner: a hit, built by warmup
    torch.testing.assert_close(got, a @ b, atol=2e-2, rtol=2e-2)
    (hit,) = [r for r in d.resolutions.values() if r.kind == "hit"]
    assert hit.candidate.startswith("triton_gemm") and not hit.by_torch

    again = warmup(progress=False, dispatcher=d, fetch=False)
    assert (again.loaded, again.ready) == (0, 2)  # loaded already: nothing built twice


def test_warmup_of_an_empty_store_is_ok(cache_path: Path) -> None:
    report = warmup(progress=False, dispatcher=Dispatcher(cache_path), fetch=False)
    assert report.ok and (report.winners, report.loaded) == (0, 0)


@pytest.mark.parametrize(
    ("device", "said"),
    [
        ("tpu0", "device='tpu0' is not a device"),
        (1.5, "device=1.5 is not a device"),
        ("meta", "device='meta': this host has"),
        (64, "device=64: this host has"),
        ("cuda:64", "device='cuda:64': this host has"),
    ],
)
def test_warmup_names_a_device_that_is_not_here(cache_path: Path, device, said) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        warmup(progress=False, dispatcher=Dispatcher(cache_path), fetch=False, device=device)


@pytest.mark.cpu_host
def test_warmup_of_the_cpu_by_name_is_the_default(cache_path: Path) -> None:
    store_winners(cache_path)
    d = Dispatcher(cache_path, mode="lookup")
    report = warmup(progress=False, dispatcher=d, fetch=False, device="cpu")
    assert report.device_class == fingerprint("cpu").device_class and report.loaded == 1
