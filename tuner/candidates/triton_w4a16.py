"""Triton W4A16 (``triton_kernels.w4a16``) as a candidate source for INT4 weight-only keys.

Runners take torch's packed weight, as the baseline does, and read our layout of it
(``int4_torch.ours``): made once per weight and kept while the weight lives (N * K / 2 bytes),
so a served runner converts at its first call on a weight, not per call; weights packed by
``int4_torch.torch_pack`` (problem inputs, quantized models) carry it from the start.

Compilation: ``precompile`` compiles a shortlist's kernels in parallel worker processes into
Triton's on-disk cache (``triton_kernels/launch.py``), so that a runner's first call loads its
kernel instead of compiling it on the timing path.
"""

from __future__ import annotations

import torch

from tuner.candidates import int4_operands, operand_guard
from tuner.candidates.base import Params, Runner, Source, triton_unavailable
from tuner.candidates.triton_kernels import w4a16
from tuner.candidates.triton_kernels.launch import WarmReport, precompile
from tuner.core.keys import DTYPES, GemmKey
from tuner.quant import int4, int4_torch

CPU_CANDIDATES = 2  # the interpreter is slow: the likeliest configs only


def unavailable(device: str) -> str | None:
    """Why a Triton kernel on our INT4 layout cannot run on ``device`` (None: it can)."""
    return triton_unavailable(device, w4a16.MIN_CAPABILITY, "INT4")


def unsupported(key: GemmKey) -> str | None:
    """Why a Triton kernel on our INT4 layout cannot take ``key`` (None: it can)."""
    if key.wdtype != "int4":
        return "int4 weights only"
    if key.k % int4.CHUNK:
        return f"k={key.k}: our layout packs K in whole chunks of {int4.CHUNK}"
    return None


def checked_once(key: GemmKey) -> operand_guard.CheckedOnce:
    """The operand check of a runner on our INT4 layout built for ``key``: what the Triton
    kernels take (``w4a16.check_inputs``), of ``key``'s shape, and an ``out`` it may write."""

    def check(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor,
              out: torch.Tensor | None) -> None:  # fmt: skip
        mnk = w4a16.check_inputs(x, weight, scales_and_zeros, key.group)
        int4_operands.check_shape(mnk, key, x, weight)
        if out is not None:
            int4_operands.check_out(out, key.m, key.n, x)

    return operand_guard.CheckedOnce(check)


class TritonW4A16(Source):
    builds_kernels = True
    name = "triton_w4a16"
    op = "gemm"
    last_warm: WarmReport | None = None  # the last precompile (kernels compiled, seconds)

    def unavailable(self, device: str) -> str | None:
        return unavailable(device)

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported(key)

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        shortlist = w4a16.configs(key.m, key.n, key.k, key.group)
        return shortlist[:CPU_CANDIDATES] if device == "cpu" else shortlist

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        dtype = DTYPES[key.dtype]
        self.last_warm = precompile(
            shortlist,
            lambda p: w4a16.checked_plan(key.m, key.n, key.k, key.group, p).jobs(dtype, key.align),
        )

    def build(self, key: GemmKey, params: Params) -> Runner:
        m, n, k, group = key.m, key.n, key.k, key.group
        plan = w4a16.checked_plan(m, n, k, group, params)
        checked = checked_once(key)

        def run(x, packed, scales_and_zeros, out=None):
            weight = int4_torch.ours(packed)
            checked(x, weight, scales_and_zeros, out)
            if out is None:
                out = torch.empty(m, n, dtype=x.dtype, device=x.device)
            plan(x, weight, scales_and_zeros, out)
            return out

        return run
