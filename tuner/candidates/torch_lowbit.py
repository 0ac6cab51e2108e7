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


class TorchLowbit(Source):
    name = "torch_lowbit"
    op = "gemm"
    baseline_params: ClassVar[Params] = {}

    def unsupported(self, key: GemmKey) -> str | None:
        return None if key.lowbit else "low-bit GEMMs only (plain GEMMs: the torch source)"

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return [{}]

    def build(self, key: GemmKey, params: Params) -> Runner:
        if key.wdtype == "int4":
            group = key.group

            def run_int4(x, packed, scales_and_zeros, out=None):
                return _into(int4_torch.int4_mm(x, packed, group, scales_and_zeros), out)

            return run_int4
        out_dtype, fast = DTYPES[key.out_dtype], key.accum == "fast"

        def run_fp8(a, b, scale_a, scale_b, out=None):
            res = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast)
            return _into(res, out)

        return run_fp8
