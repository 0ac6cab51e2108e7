"""Triton FP8 GEMM (``triton_kernels.fp8``) as a candidate source for FP8 keys.

Runners take ``_scaled_mm``'s operands (b column-major [K, N]) and pass the kernel b's [N, K]
row-major view; each checks its operands once per guard (``operand_guard``) and calls its
config's plan (``fp8.checked_plan``: launches derived once, then launched directly). Keys with
``accum="f32"`` run the kernels in precise mode (partial sums promoted to fp32 along K, as
``_scaled_mm`` does without ``use_fast_accum``); ``accum="fast"`` keys let the tensor cores
accumulate in their partial precision.

Compilation: ``precompile`` compiles a shortlist's kernels in parallel worker processes into
Triton's on-disk cache (``triton_kernels/launch.py``), so that a runner's first call loads its
kernels instead of compiling them on the timing path.
"""

from __future__ import annotations

import torch

from tuner.candidates import fp8_operands, operand_guard
from tuner.candidates.base import Params, Runner, Source, triton_unavailable
from tuner.candidates.triton_kernels import fp8
from tuner.candidates.triton_kernels.launch import WarmJob, WarmReport, precompile
from tuner.core.keys import DTYPES, GemmKey
from tuner.quant.fp8 import fp8_dtype

CPU_CANDIDATES = 2  # the interpreter is slow: the likeliest configs only


def precise(key: GemmKey) -> bool:
    """Whether the kernels promote their partial sums to fp32 (not fast accumulation)."""
    return key.accum == "f32"


class TritonFp8(Source):
    builds_kernels = True
    name = "triton_fp8"
    op = "gemm"
    last_warm: WarmReport | None = None  # the last precompile (kernels compiled, seconds)

    def unavailable(self, device: str) -> str | None:
        return triton_unavailable(device, fp8.MIN_CAPABILITY, "FP8")

    def unsupported(self, key: GemmKey) -> str | None:
        if not key.lowbit or key.wdtype == "int4":
            return "fp8 operands only"
        return None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        out_bytes = DTYPES[key.out_dtype].itemsize
        shortlist = fp8.configs(key.m, key.n, key.k, out_bytes=out_bytes)
        return shortlist[:CPU_CANDIDATES] if device == "cpu" else shortlist

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        a_dtype, b_dtype = (fp8_dtype(d.removeprefix("fp8_")) for d in (key.dtype, key.wdtype))

        def jobs(params: Params) -> list[WarmJob]:
            return fp8.jobs(key.m, key.n, key.k, dict(params), rowwise=key.scale == "row",
                            precise=precise(key), out_dtype=DTYPES[key.out_dtype],
                            a_dtype=a_dtype, b_dtype=b_dtype, align=key.align)  # fmt: skip

        self.last_warm = precompile(shortlist, jobs)

    def build(self, key: GemmKey, params: Params) -> Runner:
        m, n, k, out_dtype = key.m, key.n, key.k, DTYPES[key.out_dtype]
        plan = fp8.checked_plan(m, n, k, key.scale == "row", precise(key), dict(params))

        def check(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out: torch.Tensor | None) -> None:  # fmt: skip
            found = fp8.check_inputs(a, b, scale_a, scale_b)
            fp8_operands.check_shape(found, key, a, b, scale_a, scale_b)
            if out is not None and (out.shape != (m, n) or out.dtype != out_dtype
                                    or out.stride(1) != 1 or out.device != a.device):  # fmt: skip
                raise ValueError(f"out: expected {out_dtype} [{m}, {n}] with unit column stride "
                                 f"on {a.device}, got {out.dtype} {list(out.shape)} strides "
                                 f"{out.stride()} on {out.device}")  # fmt: skip

        checked = operand_guard.CheckedOnce(check)

        def run(a, b, scale_a, scale_b, out=None):
            b = b.T  # _scaled_mm's column-major [K, N]: the kernel's [N, K] row-major
            checked(a, b, scale_a, scale_b, out)
            if out is None:
                out = torch.empty(m, n, dtype=out_dtype, device=a.device)
            plan(a, b, scale_a, scale_b, out)
            return out

        return run
