"""Helpers of the drop-in tests: record the problems a model makes, store winners for them, run a
model forward and backward. The model is the Llama layer of bench/dropin_decoder.py.

On the CPU the tuned kernels are the Triton GEMMs run by Triton's interpreter: their winners are
forced here (the interpreter is far slower than torch, so the engine would rightly keep torch),
with the timings the engine measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from bench_scripts import load_script
from torch import nn

import tuner.torch as tt
from tuner.cache import Store
from tuner.core.keys import GemmKey, Key, parse_key
from tuner.serving.dispatcher import Dispatcher, Resolution
from tuner.tuning.engine import TuneOptions, tune

bench = load_script("dropin_decoder")
TRITON_GEMMS = {"int4": "triton_w4a16", "fp8_e4m3": "triton_fp8", "fp8_e5m2": "triton_fp8"}


def triton_source(key: GemmKey) -> str:
    """The Triton kernel source of a GEMM key's weight format."""
    return TRITON_GEMMS.get(key.wdtype, "triton_gemm")


def recorded_keys(disp: Dispatcher, run: Callable[[], object]) -> list[Key]:
    """The problems ``run`` makes through the drop-in (dispatcher in record mode)."""
    disp.set_mode("record")
    with tt.enabled(dispatcher=disp):
        run()
    disp.set_mode("lookup")
    keys = {r.key for r in disp.resolutions.values() if r.kind != "untunable"}
    return [parse_key(k) for k in sorted(keys)]


def store_winners(
    disp: Dispatcher, keys: list[Key], *, triton: bool, sdpa_source: str | None = None
) -> None:
    """Tune ``keys``; with ``triton``, GEMMs get the Triton candidate of their format as their
    winner (and SDPA problems ``sdpa_source``'s), with the times the engine measured for it and
    for torch."""
    store = Store(disp.store_path)
    for key in keys:
        gemm = isinstance(key, GemmKey)
        source = (triton_source(key) if triton else None) if gemm else sdpa_source
        if source:
            outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=[source]))
            m = next(m for m in outcome.measurements if m.source == source)
            assert m.status in ("ok", "cut"), m.error  # numerics passed: it is a valid kernel
            winner = replace(
                outcome.winner, source=m.source, params=m.params, median_us=m.median_us
            )
        else:
            outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=[]))
            winner = outcome.winner
        store.save_run(outcome.measurements, winner)
    store.close()
    disp.reload()


def backprop(out: torch.Tensor) -> None:
    """Backward with a dense random gradient (``sum()``'s is a stride-0 broadcast, which the
    dispatcher rightly leaves to torch)."""
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))


def forward_backward(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> list[torch.Tensor]:
    """[fn(x), then the gradients of the module's parameters and of x], gradients reset after."""
    out = fn(x)
    backprop(out)
    result = [out.detach(), *(p.grad for p in module.parameters()), x.grad]
    module.zero_grad(set_to_none=True)
    x.grad = None
    return result


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], **tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"tensor {i}: {m}")


def tiny_llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    layer = bench.DecoderLayer(bench.TINY, max_pos=32)
    bench.init_weights(layer, gen)
    return layer.to(dtype)


def prefill(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x, torch.arange(x.shape[1]))


def linear_inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    return torch.randn(m, 16, generator=gen), torch.randn(24, 16, generator=gen)


def served(disp: Dispatcher, m: int) -> Resolution:
    return next(
        r for r in disp.resolutions.values() if r.key.startswith(f"gemm:m={m},") and r.calls
    )
