"""Triton split-KV attention for decoding (flash-decoding), written in this project.

For q_len <= 16 against a long KV cache the work is reading K and V once; everything else is
small. Pass 1 splits each (batch, kv head)'s keys into ``splits`` chunks; one program takes one
chunk and *all* q heads of that kv head's group (``group * q_len`` query rows in one tile), so
K and V are read once per group, not once per q head: that is what makes grouped-query decode
bandwidth-efficient. It writes an unnormalised partial output with its row max and row sum
(fp32). Pass 2 merges the partials of each query row. With ``splits == 1`` pass 1 writes the final
output itself and pass 2 is skipped.

Masks as in triton_attention (torch's conventions): causal ``top_left`` (key ``j`` visible to
query ``i`` iff ``j <= i``) and ``bottom_right`` (``j <= i + kv_len - q_len``); rows that see no key
are written as 0. Any kv length, head dims up to 256, any strides, fp16/bf16/fp32.

Params: {"bn", "splits", "warps", "stages", "fused", "pdl"}. ``fused``: the last program of each
(batch, kv head) merges, one launch instead of two. ``pdl``: launched with programmatic dependent
launch (Hopper+), so each grid's launch overlaps the end of the kernel before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.base import Params, Runner, Source, triton_unavailable
from tuner.candidates.triton_attention import (
    LOG2E,
    Launch,
    causal_offset,
    checked_runner,
    dot_precision,
    head_dim_problem,
    interpreter_problem,
    output_for,
    padded_head_dim,
    qkvo_strides,
)
from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.candidates.triton_kernels.launch import FakeTensor, WarmJob, precompile
from tuner.core.keys import DTYPES, SdpaKey
from tuner.core.triton_launch import interpreting

MAX_Q_LEN = 16
MAX_ROWS = 128  # group * q_len rows share one tile
MERGE_PROGRAMS = 128  # pass-2 programs wanted: head-dim slices of rows until there are as many
MERGE_D = 32  # narrowest head-dim slice of one pass-2 program
MERGE_ELEMS_2 = 2048  # fp32 partial elements per load of one pass-2 program (64 splits x 32 d)
MERGE_ELEMS = 8192  # fp32 partial elements per step of the fused merge (registers)


@triton.jit
def _merge_splits(
    PO, PML, Out, bkv, b, kvh, num_splits, s_ob, s_oh, s_om, s_od,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS_P2: tl.constexpr, MERGE_S: tl.constexpr,
):  # fmt: skip
    """Merge the partials of all query rows of one (batch, kv head), MERGE_S splits per step
    (one [MERGE_S, rows, d] load in flight), and write the output rows. Loads bypass L1: the
    partials were written by other programs of the same launch."""
    rows_n: tl.constexpr = GROUP * Q_LEN
    r = tl.arange(0, ROWS_P2)
    r_ok = r < rows_n
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    offs_s = tl.arange(0, MERGE_S)
    first = bkv.to(tl.int64) * num_splits
    m_run = tl.full([ROWS_P2], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([ROWS_P2], dtype=tl.float32)
    acc = tl.zeros([ROWS_P2, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, MERGE_S):
        sp = s0 + offs_s
        part = first + sp
        ml_mask = (sp < num_splits)[:, None] & r_ok[None, :]
        ml_ptr = PML + part[:, None] * (2 * rows_n) + r[None, :]
        m_s = tl.load(ml_ptr, mask=ml_mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ptr + rows_n, mask=ml_mask, other=0.0, cache_modifier=".cg")
        o_ptr = (
            PO + part[:, None, None] * (rows_n * HEAD_DIM) + r[None, :, None] * HEAD_DIM
            + d[None, None, :]
        )  # fmt: skip
        o_s = tl.load(
            o_ptr, mask=ml_mask[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg"
        )
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_safe)
        w = tl.math.exp2(m_s - m_safe[None, :])
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_s, 0)
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        m_run = m_new
    seen = l_run != 0.0  # NaN stays NaN (``triton_attention``)
    out = tl.where(seen[:, None], acc / tl.where(seen, l_run, 1.0)[:, None], 0.0)
    head = kvh * GROUP + r // Q_LEN
    pos = r % Q_LEN
    o_ptrs = (
        Out + b.to(tl.int64) * s_ob + head[:, None].to(tl.int64) * s_oh + pos[:, None] * s_om
        + d[None, :] * s_od
    )  # fmt: skip
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split(
    Q, K, V, Out, PO, Counter, ml_offset, qk_scale, kv_len, kv_heads, chunk, causal_offset,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om, s_od,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SINGLE: tl.constexpr,
    FUSED: tl.constexpr, ROWS_P2: tl.constexpr, MERGE_S: tl.constexpr, PRECISION: tl.constexpr,
    EVEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """EVEN: every split holds ``chunk`` keys, a multiple of BLOCK_N, and HEAD_DIM == BLOCK_D, so
    K and V tiles load unmasked (whole 16-byte vectors, nothing to predicate).
    PDL (programmatic dependent launch): this grid may start while the previous kernel on the
    stream finishes; it waits for that kernel's writes before its first load, then lets the next
    kernel (the merge, or whatever follows) launch and wait in turn."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0)
    bkv = tl.program_id(1)
    num_splits = tl.num_programs(0)
    PML = PO + ml_offset
    b = bkv // kv_heads
    kvh = bkv % kv_heads

    rows = tl.arange(0, BLOCK_H)  # row r: q head kvh * GROUP + r // Q_LEN, query position r % Q_LEN
    row_ok = rows < GROUP * Q_LEN
    head = kvh * GROUP + rows // Q_LEN
    pos = rows % Q_LEN
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q + b.to(tl.int64) * s_qb + head[:, None].to(tl.int64) * s_qh + pos[:, None] * s_qm
        + offs_d[None, :] * s_qd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    k_base = K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh + offs_d[None, :] * s_kd
    v_base = V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh + offs_d[None, :] * s_vd

    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    if CAUSAL:  # nothing past the last row's diagonal
        hi = tl.minimum(hi, Q_LEN + causal_offset)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if EVEN:
            k = tl.load(k_base + cols[:, None] * s_kn)
            v = tl.load(v_base + cols[:, None] * s_vn)
        else:
            kv_mask = (cols < hi)[:, None] & d_ok[None, :]
            k = tl.load(k_base + cols[:, None] * s_kn, mask=kv_mask, other=0.0)
            v = tl.load(v_base + cols[:, None] * s_vn, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL:
            s = tl.where((cols < hi)[None, :] & (cols[None, :] <= pos[:, None] + causal_offset),
                         s, float("-inf"))  # fmt: skip
        elif not EVEN:
            s = tl.where((cols < hi)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if SINGLE:
        seen = l_i != 0.0  # NaN stays NaN (``triton_attention``)
        out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        o_ptrs = (
            Out + b.to(tl.int64) * s_ob + head[:, None].to(tl.int64) * s_oh + pos[:, None] * s_om
            + offs_d[None, :] * s_od
        )  # fmt: skip
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # one fp32 scratch: PO[bkv, split, row, d], then at ml_offset PML[bkv, split, 0|1, row]
        part = bkv.to(tl.int64) * num_splits + split
        rows_n: tl.constexpr = GROUP * Q_LEN
        po = PO + part * (rows_n * HEAD_DIM) + rows[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(po, acc, mask=row_ok[:, None] & d_ok[None, :])
        pml = PML + part * (2 * rows_n) + rows
        tl.store(pml, m_i, mask=row_ok)
        tl.store(pml + rows_n, l_i, mask=row_ok)
        if FUSED:
            # the last program of this (batch, kv head) to finish merges: no second launch.
            # Barrier, then one release/acquire ticket at GPU scope (the cooperative-groups grid
            # barrier's pattern); the winner resets the counter for the next launch.
            tl.debug_barrier()
            ticket = tl.atomic_add(Counter + bkv, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if ticket == num_splits - 1:
                _merge_splits(
                    PO, PML, Out, bkv, b, kvh, num_splits, s_ob, s_oh, s_om, s_od,
                    Q_LEN, GROUP, HEAD_DIM, BLOCK_D, ROWS_P2, MERGE_S,
                )  # fmt: skip
                tl.store(Counter + bkv, 0)


@triton.jit
def _decode_merge(
    PO, Out, ml_offset, num_splits, kv_heads, s_ob, s_oh, s_om, s_od,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DM: tl.constexpr,
    D_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (query row, BLOCK_DM slice of the head dim, batch x kv head), BLOCK_S
    partials per load: few rows get many narrow programs, so the merge is not one program's
    serial loop over the head dim."""
    if PDL:  # launched early, beside pass 1: wait until its partials are written
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0) // D_CHUNKS
    d0 = (tl.program_id(0) % D_CHUNKS) * BLOCK_DM
    bkv = tl.program_id(1)
    PML = PO + ml_offset
    b = bkv // kv_heads
    head = (bkv % kv_heads) * GROUP + row // Q_LEN
    pos = row % Q_LEN
    rows_n: tl.constexpr = GROUP * Q_LEN
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = d0 + tl.arange(0, BLOCK_DM)
    d_ok = offs_d < HEAD_DIM

    m_run = tl.full([1], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_DM], dtype=tl.float32)
    first = bkv.to(tl.int64) * num_splits
    for s0 in range(0, num_splits, BLOCK_S):
        sp = s0 + offs_s
        s_ok = sp < num_splits
        pml = PML + (first + sp) * (2 * rows_n) + row
        m_s = tl.load(pml, mask=s_ok, other=float("-inf"))
        l_s = tl.load(pml + rows_n, mask=s_ok, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_safe)
        w = tl.math.exp2(m_s - m_safe)
        o_s = tl.load(
            PO + (first + sp)[:, None] * (rows_n * HEAD_DIM) + row * HEAD_DIM + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        acc = acc * alpha + tl.sum(w[:, None] * o_s, 0)
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        m_run = m_new
    seen = l_run != 0.0  # NaN stays NaN (``triton_attention``)
    out = tl.where(seen, acc / tl.where(seen, l_run, 1.0), 0.0)
    o_ptrs = Out + b.to(tl.int64) * s_ob + head.to(tl.int64) * s_oh + pos * s_om + offs_d * s_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=d_ok)


# --- host side ---------------------------------------------------------------------------------


def rows_per_tile(key: SdpaKey) -> int:
    return (key.q_heads // key.kv_heads) * key.q_len


def block_rows(key: SdpaKey) -> int:
    return max(16, triton.next_power_of_2(rows_per_tile(key)))


def chunk_for(key: SdpaKey, bn: int, splits: int) -> int:
    """Keys per split, a multiple of the tile width."""
    per = triton.cdiv(key.kv_len, max(1, splits))
    return triton.cdiv(per, bn) * bn


def split_choices(key: SdpaKey, bn: int, sm_count: int) -> list[int]:
    """Splits giving about 1, 2, 4 and 8 programs per SM in total (1 when batch x kv heads fills
    it). Pass 1's grid is all that changes with the split count (pass 2 loads up to 64 partials
    at once: its kernel follows the count up to there)."""
    tiles = triton.cdiv(key.kv_len, bn)
    out = []
    for waves in (1, 2, 4, 8):
        want = triton.cdiv(waves * sm_count, key.batch * key.kv_heads)
        splits = max(1, min(want, tiles))
        splits = triton.cdiv(key.kv_len, chunk_for(key, bn, splits))  # no empty splits
        if splits not in out:
            out.append(splits)
    return out


class TritonDecode(Source):
    builds_kernels = True
    name = "triton_decode"
    op = "sdpa"

    def unavailable(self, device: str) -> str | None:
        return triton_unavailable(device)

    def unsupported(self, key: SdpaKey) -> str | None:
        if key.q_len > MAX_Q_LEN:
            return f"q_len {key.q_len} > {MAX_Q_LEN}: a prefill shape (triton_attention takes it)"
        if rows_per_tile(key) > MAX_ROWS:
            return f"(q_heads / kv_heads) x q_len = {rows_per_tile(key)} > {MAX_ROWS} rows per tile"
        return head_dim_problem(key) or interpreter_problem(key)

    def candidates(self, key: SdpaKey, device: str) -> list[Params]:
        if device == "cpu":  # interpreter: small tiles, and at least two splits when possible
            splits = min(3, triton.cdiv(key.kv_len, 16))
            return [{"bn": 16, "splits": splits, "warps": 4, "stages": 1, "fused": True}]
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        warps = 8 if block_rows(key) >= 128 else 4
        pdl = pdl_problem() is None
        big_d = padded_head_dim(key) > 128
        out = []
        for bn in (32, 64) if big_d else (64, 128):
            for splits in split_choices(key, bn, sms):
                plain = {"bn": bn, "splits": splits, "warps": warps, "stages": 3, "fused": False}
                out.append({**plain, "pdl": pdl})
                if bn == (32 if big_d else 64) and block_rows(key) <= 16:
                    # one warp per program: no cross-warp reductions inside a program, several
                    # programs per SM
                    out.append({**plain, "warps": 1, "pdl": pdl})
                if splits > 1 and rows_per_tile(key) <= 8:  # one launch: cheaper eagerly
                    out.append({**plain, "fused": True})
        return out

    def jobs(self, key: SdpaKey, params: Params) -> list[WarmJob]:
        """The kernels this candidate compiles, for contiguous 16-byte aligned inputs."""
        p = plan(key, params)
        dt = DTYPES[key.dtype]
        q, k, v, o = (FakeTensor(dt) for _ in "qkvo")
        part, counter = FakeTensor(torch.float32), FakeTensor(torch.int32)
        strides = qkvo_strides(key)
        split_args = (q, k, v, o, part, counter, p.ml_offset, *p.scalars, *strides)
        jobs = [WarmJob(_decode_split, split_args, p.consts)]
        if p.two_pass:
            merge_args = (part, o, p.ml_offset, p.splits, key.kv_heads, *strides[12:])
            jobs.append(WarmJob(_decode_merge, merge_args, p.merge_consts))
        return jobs

    def precompile(self, key: SdpaKey, shortlist: list[Params]) -> None:
        precompile(shortlist, lambda p: self.jobs(key, p))

    def build(self, key: SdpaKey, params: Params) -> Runner:
        kernels = DecodeKernels(key, params)

        def run(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            o = output_for(key, q) if out is None else out
            part, counter = kernels.work.get(q.device)  # unused when splits == 1
            kernels.split(q, k, v, o, part, counter)
            if kernels.plan.two_pass:
                kernels.merge(o, part)
            return o

        return checked_runner(run, kernels.launches, f"triton_decode {key}")


class DecodeKernels:
    """The launches of one plan, callable one at a time: ``split`` (pass 1; the whole op when
    ``splits == 1`` or fused) then ``merge`` (pass 2), on scratch from ``work``. A benchmark can
    time each alone."""

    def __init__(self, key: SdpaKey, params: Params) -> None:
        self.key, self.plan = key, plan(key, params)
        p = self.plan
        self.split_launch = Launch(_decode_split, p.grid, p.consts)
        self.merge_launch = Launch(_decode_merge, p.merge_grid, p.merge_consts)
        self.launches = (
            [self.split_launch, self.merge_launch] if p.two_pass else [self.split_launch]
        )
        self.work = Workspace(p.scratch, p.grid[1])

    def split(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
        part: torch.Tensor, counter: torch.Tensor,
    ) -> None:  # fmt: skip
        p = self.plan
        strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
        self.split_launch((q, k, v, o, part, counter), (p.ml_offset, *p.scalars, *strides), strides)

    def merge(self, o: torch.Tensor, part: torch.Tensor) -> None:
        so = o.stride()
        self.merge_launch(
            (part, o), (self.plan.ml_offset, self.plan.splits, self.key.kv_heads, *so), so
        )


class Workspace:
    """Per-(device, stream) scratch of one runner: fp32 partials and the fused merge's int32
    counters (zero between launches: the merging program resets its counter).

    Kernels on one stream run in order, so reusing one buffer per stream is safe, and it saves an
    allocation per decode step; different streams get different buffers. A CUDA graph captured on
    a stream keeps that stream's buffers: replaying two such graphs at once on different streams
    would race, as with any graph whose scratch is static.
    """

    def __init__(self, scratch: int, counters: int) -> None:
        self.scratch, self.counters = scratch, counters
        self.buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        stream = current_stream(device)
        found = self.buffers.get((device, stream))
        if found is None:
            found = (
                torch.empty(self.scratch, dtype=torch.float32, device=device),
                torch.zeros(self.counters, dtype=torch.int32, device=device),
            )
            self.buffers[(device, stream)] = found
        return found


def pdl_problem() -> str | None:
    """Why kernels cannot use programmatic dependent launch here, or None."""
    if interpreting():
        return "not in Triton's interpreter"
    if torch.version.hip:
        return "CUDA only (griddepcontrol)"
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return f"needs tl.extra.cuda.gdc_wait (triton {triton.__version__} lacks it)"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return "needs a Hopper or newer GPU (compute capability >= 9)"
    return None


def current_stream(device: torch.device) -> int:
    """The current stream's handle on ``device`` (0 on the CPU), cheaply."""
    if device.type != "cuda":
        return 0
    return torch._C._cuda_getCurrentRawStream(device.index or 0)


@dataclass(frozen=True)
class Plan:
    """Everything a decode launch needs besides the tensors."""

    splits: int
    grid: tuple[int, int]
    merge_grid: tuple[int, int]
    consts: dict[str, Any]
    merge_consts: dict[str, Any]
    scalars: tuple
    ml_offset: int  # where the (max, sum) partials start in the fp32 scratch
    scratch: int  # fp32 elements of scratch (partial outputs, then maxima and sums)
    fused: bool  # the last program per (batch, kv head) merges: one launch instead of two

    @property
    def two_pass(self) -> bool:
        return self.splits > 1 and not self.fused


def plan(key: SdpaKey, params: Params) -> Plan:
    if reason := TritonDecode().unsupported(key):
        raise ValueError(reason)
    bn, warps, stages = int(params["bn"]), int(params["warps"]), int(params["stages"])
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"bn must be a power of two >= 16, got {bn}")
    splits_wanted = int(params["splits"])
    if splits_wanted < 1:
        raise ValueError(f"splits must be >= 1, got {splits_wanted}")
    chunk = chunk_for(key, bn, splits_wanted)
    splits = triton.cdiv(key.kv_len, chunk)
    fused = bool(params.get("fused", False)) and splits > 1
    pdl = bool(params.get("pdl", False))
    if pdl and (problem := pdl_problem()):
        raise ValueError(f"pdl: {problem}")
    rows = rows_per_tile(key)
    rows_p2 = max(2, triton.next_power_of_2(rows))
    group = key.q_heads // key.kv_heads
    n_kv = key.batch * key.kv_heads
    d = padded_head_dim(key)
    consts: dict[str, Any] = {
        "Q_LEN": key.q_len, "GROUP": group, "BLOCK_H": block_rows(key), "HEAD_DIM": key.head_dim,
        "BLOCK_D": d, "BLOCK_N": bn, "CAUSAL": key.causal != "none", "SINGLE": splits == 1,
        "FUSED": fused, "ROWS_P2": rows_p2, "MERGE_S": max(1, min(32, MERGE_ELEMS // (rows_p2 * d))),
        "PRECISION": dot_precision(key), "num_warps": warps, "num_stages": stages,
        "EVEN": key.kv_len % chunk == 0 and key.head_dim == d, "PDL": pdl,
    }  # fmt: skip
    # pass 2: about MERGE_PROGRAMS programs (head-dim slices when rows x pairs are few: a
    # sliver of a grid merges serially; thousands of slivers cost more launching than merging)
    slices = min(
        d // min(MERGE_D, d), triton.next_power_of_2(triton.cdiv(MERGE_PROGRAMS, rows * n_kv))
    )
    block_dm = d // slices
    d_chunks = triton.cdiv(key.head_dim, block_dm)  # the slices holding real columns (96 of 128)
    merge_consts: dict[str, Any] = {
        "Q_LEN": key.q_len, "GROUP": group, "HEAD_DIM": key.head_dim, "BLOCK_DM": block_dm,
        "D_CHUNKS": d_chunks, "PDL": pdl, "num_warps": 2, "num_stages": 1,
        "BLOCK_S": max(1, min(triton.next_power_of_2(splits), MERGE_ELEMS_2 // block_dm)),
    }  # fmt: skip
    if pdl:  # a launch option, not a kernel argument
        consts["launch_pdl"] = merge_consts["launch_pdl"] = True
    ml_offset = n_kv * splits * rows * key.head_dim
    return Plan(
        splits=splits, grid=(splits, n_kv), merge_grid=(rows * d_chunks, n_kv), consts=consts,
        merge_consts=merge_consts,
        scalars=(key.scale * LOG2E, key.kv_len, key.kv_heads, chunk, causal_offset(key)),
        ml_offset=ml_offset, scratch=ml_offset + n_kv * splits * 2 * rows, fused=fused,
    )  # fmt: skip


settle(globals())  # last: every JIT function above is defined
