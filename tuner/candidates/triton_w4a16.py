"""Triton W4A16 (``triton_kernels.w4a16``) as a candidate source for INT4 weight-only keys.

Runners take torch's packed weight, as the baseline does, and read our layout of it
(``int4_torch.ours``): made once per weight and kept while the weight lives (N * K / 2 bytes),
so a served runner converts at its first call on a weight, not per call; weights packed by
``int4_torch.torch_pack`` (problem inputs, quantized models) carry it from the start.
"""

from __future__ import annotations

import torch

from tuner.candidates.base import Params, Runner, Source, triton_unavailable
from tuner.candidates.triton_kernels import w4a16
from tuner.core.keys import GemmKey
from tuner.quant import int4, int4_torch

CPU_CANDIDATES = 2  # the interpreter is slow: the likeliest configs only


class TritonW4A16(Source):
    builds_kernels = True
    name = "triton_w4a16"
    op = "gemm"

    def unavailable(self, device: str) -> str | None:
        if device == "cpu":
            return triton_unavailable(device)
        cap = torch.cuda.get_device_capability()
        if cap < w4a16.MIN_CAPABILITY:
            return f"compute capability {cap}: INT4 kernels need sm80 or newer"
        return None

    def unsupported(self, key: GemmKey) -> str | None:
        if key.wdtype != "int4":
            return "int4 weights only"
        if key.k % int4.CHUNK:
            return f"k={key.k}: our layout packs K in whole chunks of {int4.CHUNK}"
        return None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        shortlist = w4a16.configs(key.m, key.n, key.k, key.group)
        return shortlist[:CPU_CANDIDATES] if device == "cpu" else shortlist

    def build(self, key: GemmKey, params: Params) -> Runner:
        w4a16.check_config(params, key.k, key.group)
        config, group = dict(params), key.group

        def run(x, packed, scales_and_zeros, out=None):
            weight = int4_torch.ours(packed)
            return w4a16.w4a16_matmul(x, weight, scales_and_zeros, group, config, out=out)

        return run
