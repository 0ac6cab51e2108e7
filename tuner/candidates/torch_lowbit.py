"""torch's own low-bit GEMMs: the baselines of INT4 weight-only and FP8 keys, on every device.

INT4: ``aten._weight_int4pack_mm`` on CUDA, ``aten._weight_int4pack_mm_for_cpu`` on the CPU,
each on its device's packed weight (``tuner.quant.int4_torch``). FP8: ``torch._scaled_mm`` with
``use_fast_accum`` as the key says (CPU included). Unsupported devices and bad operands get
torch's own errors.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import DTYPES, GemmKey
from tuner.quant import int4_torch


def _into(res: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return res
    out.copy_(res)
    return out


def int4_runner(group_size: int) -> Runner:
    """``aten._weight_int4pack_mm`` (or its CPU twin, by the weight's device) as a runner
    ``(x, packed, scales_and_zeros, out=None)``: the baseline of INT4 keys, and the dispatcher's
    fallback for INT4 calls outside the keys."""

    def run(x, packed, scales_and_zeros, out=None):
        return _into(int4_torch.int4_mm(x, packed, group_size, scales_and_zeros), out)

    return run


def scaled_mm_runner(out_dtype: torch.dtype | None, fast: bool) -> Runner:
    """``torch._scaled_mm`` as a runner ``(a, b, scale_a, scale_b, out=None)``: the baseline of
    FP8 keys, and the dispatcher's fallback for FP8 calls outside the keys."""

    def run(a, b, scale_a, scale_b, out=None):
        res = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast)
        return _into(res, out)

    return run


class TorchLowbit(Source):
    name = "torch_lowbit"
    op = "gemm"
    calls_torch = True
    baseline_params: ClassVar[Params] = {}

    def unsupported(self, key: GemmKey) -> str | None:
        return None if key.lowbit else "low-bit GEMMs only (plain GEMMs: the torch source)"

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return [{}]

    def build(self, key: GemmKey, params: Params) -> Runner:
        if key.wdtype == "int4":
            return int4_runner(key.group)
        return scaled_mm_runner(DTYPES[key.out_dtype], key.accum == "fast")
