"""INT4 weight-only GEMMs past decode as a dequantization pass plus a dense 16-bit GEMM.

The mixed-input kernels (``triton_w4a16``, ``cutlass_w4a16``) dequantize inside their mainloop,
which at large M is compute-bound: the dequantization competes with the tensor cores. Here a
Triton pass (``triton_kernels.dequant``) writes the weight in the activation dtype to a scratch
buffer and torch's own GEMM (cuBLAS, the bf16 baseline's kernel) multiplies by it. The weight is
taken in ``chunks`` runs of rows through one scratch buffer of ``rows x K x 2`` bytes (rows =
N / chunks rounded up to the layout's 64-row blocks); each chunk's GEMM writes its column slice
of the output in place (``torch.mm(out=)`` on a slice with row stride N: cuBLAS's ldc, no copy).
A chunk small enough to stay in L2 is read back by its GEMM from L2, and the next chunk
overwrites its lines there, so less of the 16-bit weight travels to and from memory.

Offered for M >= ``MIN_M``: the pass costs about N * K * 2 bytes written and read whatever M
is, which the GEMM's compute hides only once it is compute-bound; below that the GEMM streams
its weight and a kernel reading the 4-bit bytes once is faster by construction.

Numerics: each weight is rounded once to the activation dtype (the W4A16 kernel's tile loader,
``(q - 8) * scale + zero`` as one fused multiply-add), then an fp32-accumulated GEMM: the INT4
gate's bound (``samples._lowbit_reference``: up to two roundings of each weight) holds as for the
fused kernels.

Memory and streams: the scratch is a fresh ``torch.empty`` per call from torch's caching
allocator on the current stream, so two streams never share one (the allocator hands a block
back to its own stream only), and a CUDA graph's capture takes it from the graph's pool. Our
layout of the weight (``int4_torch.ours``) is made once per weight, as for ``triton_w4a16``.
"""

from __future__ import annotations

import functools

import torch
import triton

from tuner.candidates import triton_w4a16
from tuner.candidates.base import Params, Runner, Source
from tuner.candidates.triton_kernels import dequant
from tuner.candidates.triton_kernels.launch import WarmReport, precompile
from tuner.core.keys import DTYPES, GemmKey
from tuner.core.triton_launch import current_gpu
from tuner.measure.timing import cache_bytes
from tuner.quant import int4_torch

MIN_M = 64
# Chunk counts tried besides the whole weight: two halves, and the fewest chunks whose scratch
# fits this share of the L2.
HALVES, L2_SHARE = 2, 2
ROW_STEP = 256  # chunk heights in whole 256-column tiles of the GEMM's output (and 64-row blocks)
GEMM_TILE = (128, 256)  # the output tile of a large bf16 cuBLAS GEMM on Hopper (rows, columns)
DEFAULT_BN = 64
CPU_SMS = 1  # the interpreter: one config, the whole weight


def chunk_rows(n: int, chunks: int) -> int:
    """Rows per chunk: N / chunks rounded up to whole ``ROW_STEP``s (the whole N at most)."""
    return min(n, triton.cdiv(triton.cdiv(n, chunks), ROW_STEP) * ROW_STEP)


def scratch_bytes(n: int, k: int, chunks: int) -> int:
    """The scratch buffer of one call: ``chunk_rows x K`` 16-bit values."""
    return chunk_rows(n, chunks) * k * 2


def check_params(params: Params, n: int) -> tuple[int, int]:
    """(chunks, bn), or a ValueError naming the param that cannot run an N x K weight."""
    unknown = sorted(set(params) - {"chunks", "bn"})
    if unknown:
        raise ValueError(f"dequant_gemm param {unknown[0]!r}: unknown; allowed 'chunks', 'bn'")
    chunks, bn = params.get("chunks", 1), params.get("bn", DEFAULT_BN)
    most = triton.cdiv(n, ROW_STEP)
    if type(chunks) is not int or not 1 <= chunks <= most:
        raise ValueError(f"dequant_gemm param 'chunks'={chunks!r}: allowed an int in 1..{most} "
                         f"(N={n} in chunks of whole {ROW_STEP}-row steps)")  # fmt: skip
    rows = chunk_rows(n, chunks)
    if triton.cdiv(n, rows) != chunks:
        raise ValueError(f"dequant_gemm param 'chunks'={chunks}: N={n} in {ROW_STEP}-row steps "
                         f"splits into {triton.cdiv(n, rows)} chunks of {rows} rows, not "
                         f"{chunks}")  # fmt: skip
    try:
        dequant.check_block(bn)
    except ValueError as e:
        raise ValueError(f"dequant_gemm param 'bn': {e}") from None
    return chunks, bn


def shortlist(m: int, n: int, k: int, l2_bytes: int, sms: int) -> list[Params]:
    """The whole weight at once, then two halves and the fewest chunks whose scratch fits
    1 / ``L2_SHARE`` of the L2, where a chunk's GEMM keeps at least half a wave of output tiles
    (fewer leave most SMs idle in every chunk)."""
    most = triton.cdiv(n, ROW_STEP)
    fits = next((c for c in range(1, most + 1) if scratch_bytes(n, k, c) * L2_SHARE <= l2_bytes),
                most)  # fmt: skip
    counts = [1]
    for chunks in (HALVES, fits):
        rows = chunk_rows(n, chunks)
        tiles = triton.cdiv(m, GEMM_TILE[0]) * triton.cdiv(rows, GEMM_TILE[1])
        if rows < n and 2 * tiles >= sms:
            counts.append(triton.cdiv(n, rows))  # the count that gives chunks of that height
    return [{"chunks": c, "bn": DEFAULT_BN} for c in dict.fromkeys(counts)]


def dequantizer(n: int, k: int, group: int, chunks: int, bn: int) -> dequant.Dequantizer:
    """One per weight shape, params and GPU, kept across runners (its kernel and direct
    launch belong to the GPU that loaded them)."""
    return _dequantizer(n, k, group, chunks, bn, current_gpu())


@functools.lru_cache(maxsize=1024)
def _dequantizer(
    n: int, k: int, group: int, chunks: int, bn: int, gpu: int | None
) -> dequant.Dequantizer:
    return dequant.Dequantizer(n, k, group, chunk_rows(n, chunks), bn)


class DequantGemm(Source):
    builds_kernels = True
    name = "dequant_gemm"
    op = "gemm"
    calls_torch = True
    last_warm: WarmReport | None = None

    def unavailable(self, device: str) -> str | None:
        return triton_w4a16.unavailable(device)

    def unsupported(self, key: GemmKey) -> str | None:
        reason = triton_w4a16.unsupported(key)
        if reason:
            return reason
        if key.m < MIN_M:
            return (f"m={key.m}: below {MIN_M} rows the GEMM streams its weight, and a 16-bit "
                    f"copy of it costs more than reading the 4-bit bytes once")  # fmt: skip
        return None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        if device == "cpu":
            return shortlist(key.m, key.n, key.k, cache_bytes(device), CPU_SMS)[:1]
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        return shortlist(key.m, key.n, key.k, cache_bytes(device), sms)

    def precompile(self, key: GemmKey, shortlist: list[Params]) -> None:
        dtype = DTYPES[key.dtype]

        def jobs(params: Params) -> list:
            chunks, bn = check_params(params, key.n)
            return dequantizer(key.n, key.k, key.group, chunks, bn).jobs(dtype)

        self.last_warm = precompile(shortlist, jobs)

    def build(self, key: GemmKey, params: Params) -> Runner:
        chunks, bn = check_params(params, key.n)
        n, k, group = key.n, key.k, key.group
        fill = dequantizer(n, k, group, chunks, bn)
        rows = fill.rows
        checked = triton_w4a16.checked_once(key)

        def run(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
            weight = int4_torch.ours(packed)
            checked(x, weight, scales_and_zeros, out)
            scratch = torch.empty(rows, k, dtype=x.dtype, device=x.device)
            if chunks == 1:  # out=None: torch allocates the result, with less host time
                fill.fill(weight, scales_and_zeros, scratch, 0, n)
                return torch.mm(x, scratch.T, out=out)
            if out is None:
                out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
            for start in range(0, n, rows):
                end = min(start + rows, n)
                part = scratch[: end - start]
                fill.fill(weight, scales_and_zeros, part, start, end)
                torch.mm(x, part.T, out=out[:, start:end])
            return out

        return run
