"""Triton flash-attention forward written in this project (FlashAttention-2 style).

One program computes a BLOCK_M tile of query rows of one (batch, q head) against the whole
allowed key range, with the online softmax in fp32 and exp2. What it handles:

- grouped-query attention: q head ``h`` reads kv head ``h // (q_heads // kv_heads)``;
- causal masks exactly as torch: ``top_left`` (``is_causal``: key ``j`` is visible to query ``i``
  iff ``j <= i``) and ``bottom_right`` (``j <= i + kv_len - q_len``, chunked prefill against a KV
  cache). Rows that see no key at all (bottom-right with q_len > kv_len) are written as 0;
- any q/kv length (the last tiles are masked), head dims up to 256 (96 is padded to 128 in
  registers, never in memory), any strides (non-contiguous inputs and outputs);
- fp16, bf16 and fp32 (fp32 with IEEE-exact dots: slow, but correct).

The key loop is split in two: full tiles that need no mask at all, then the (causal diagonal or
ragged last) tiles that do. Causal programs are launched heaviest first.

Params: {"bm", "bn", "warps", "stages"}.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tuner.candidates.base import Params, Runner, Source, triton_unavailable
from tuner.candidates.torch_ref import sdpa_output
from tuner.candidates.triton_kernels.cache_keys import settle
from tuner.candidates.triton_kernels.launch import FakeTensor, WarmJob, precompile
from tuner.core.keys import DTYPES, SdpaKey
from tuner.core.triton_launch import Launcher, interpreting, verify_direct

SMEM_BYTES = 227 * 1024  # Hopper's per-block shared-memory limit
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


@triton.jit
def _tile_update(
    acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, d_ok, kv_len, causal_offset,
    qk_scale, MASKED: tl.constexpr, EVEN_D: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile: scores, online softmax update, P @ V. Returns (acc, m_i, l_i).

    MASKED tiles check key bounds (and the causal diagonal); EVEN_D says the head dim needs no mask.
    """
    cols = start_n + offs_n
    col_ok = cols < kv_len
    if MASKED:
        k = tl.load(k_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
        ok = col_ok[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None] + causal_offset)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _flash_fwd(
    Q, K, V, Out, qk_scale, q_len, kv_len, q_heads, group, causal_offset,
    s_qb, s_qh, s_qm, s_qd, s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd, s_ob, s_oh, s_om, s_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    num_m = tl.cdiv(q_len, BLOCK_M)
    # causal: heaviest tiles first, for a shorter tail
    start_m = num_m - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // q_heads
    h = bh % q_heads
    kvh = h // group

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < q_len

    q_base = Q + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh
    q = tl.load(
        q_base + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_ptrs = (
        K + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh
        + offs_n[:, None] * s_kn + offs_d[None, :] * s_kd
    )  # fmt: skip
    v_ptrs = (
        V + b.to(tl.int64) * s_vb + kvh.to(tl.int64) * s_vh
        + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd
    )  # fmt: skip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # [0, full_end): tiles every row of this block sees whole; [full_end, hi): masked tiles
    if CAUSAL:
        hi = tl.minimum(kv_len, (start_m + 1) * BLOCK_M + causal_offset)
        full_end = tl.minimum(kv_len, start_m * BLOCK_M + causal_offset + 1)
        hi = tl.maximum(hi, 0)
        full_end = tl.maximum(full_end, 0)
    else:
        hi = kv_len
        full_end = kv_len
    full_end = (full_end // BLOCK_N) * BLOCK_N

    for start_n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _tile_update(
            acc, m_i, l_i, q, k_ptrs + start_n * s_kn, v_ptrs + start_n * s_vn, start_n,
            offs_m, offs_n, d_ok, kv_len, causal_offset, qk_scale, False, HEAD_DIM == BLOCK_D, CAUSAL, PRECISION,
        )  # fmt: skip
    for start_n in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _tile_update(
            acc, m_i, l_i, q, k_ptrs + start_n * s_kn, v_ptrs + start_n * s_vn, start_n,
            offs_m, offs_n, d_ok, kv_len, causal_offset, qk_scale, True, HEAD_DIM == BLOCK_D, CAUSAL, PRECISION,
        )  # fmt: skip

    # False only for rows that may see no key (bottom-right, q_len > kv_len): written as 0; a
    # NaN sum (a NaN or inf among the scores) is seen, so the row is NaN, as torch's is
    seen = l_i != 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    out = tl.where(seen[:, None], out, 0.0)
    o_ptrs = (
        Out + b.to(tl.int64) * s_ob + h.to(tl.int64) * s_oh
        + offs_m[:, None] * s_om + offs_d[None, :] * s_od
    )  # fmt: skip
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# --- host side ---------------------------------------------------------------------------------


class Launch:
    """``kernel[grid](*args, **consts)`` with little host work on repeat calls (``Launcher``).

    ``args`` start with the kernel's tensors; the first call of each specialization (strides and
    16-byte alignment of the pointers) goes through Triton's JIT, later ones launch the compiled
    kernel directly with the tensors' integer pointers once the runner has checked that a direct
    launch reproduces the JIT's bits (``verify_direct``). Decode steps are short on the GPU, so the
    launch cost is part of what the caller waits for.
    Every constexpr must follow the runtime arguments in the kernel's signature.
    """

    def __init__(self, kernel: Any, grid: tuple[int, ...], consts: dict[str, Any]) -> None:
        consts = dict(consts)
        warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
        self.launcher = Launcher(kernel, grid, consts, num_warps=warps, num_stages=stages)

    def __call__(self, tensors: tuple[torch.Tensor, ...], scalars: tuple, strides: tuple) -> None:
        """The kernel's arguments are ``(*tensors, *scalars)``; ``strides`` are those among the
        scalars that change from call to call (Triton specializes on them)."""
        ptrs = tuple(t.data_ptr() for t in tensors)
        guard = (strides, tuple(p & 15 for p in ptrs))
        direct = self.launcher.ready(guard)
        if direct and not direct.scratch_bytes:
            direct((*ptrs, *scalars))
        else:
            self.launcher((*tensors, *scalars), guard)


def checked_runner(run: Runner, launches: list[Launch], what: str) -> Runner:
    """``run`` that, after its first call, verifies the direct launch path once (``verify_direct``)."""
    launchers = [x.launcher for x in launches]
    pending = [True]

    def checked(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        o = run(q, k, v, out)
        if pending[0]:
            pending[0] = not verify_direct(launchers, o, lambda again: run(q, k, v, again), what)
        return o

    return checked


def dot_precision(key: SdpaKey) -> str:
    """fp32 inputs get IEEE-exact dots (the f32 tolerance is 1e-4); 16-bit types ignore it."""
    return "ieee" if key.dtype == "f32" else "tf32"


def padded_head_dim(key: SdpaKey) -> int:
    return max(16, triton.next_power_of_2(key.head_dim))


def causal_offset(key: SdpaKey) -> int:
    """Query ``i`` sees key ``j`` iff ``j <= i + offset`` (when causal)."""
    return key.kv_len - key.q_len if key.causal == "bottom_right" else 0


def head_dim_problem(key: SdpaKey, limit: int = MAX_HEAD_DIM) -> str | None:
    """Why a Triton attention kernel cannot take this key's head dims, or None."""
    if key.head_dim_v != key.head_dim:
        return f"head_dim_v ({key.head_dim_v}) != head_dim ({key.head_dim}) is not supported"
    if key.head_dim > limit:
        return f"head_dim {key.head_dim} > {limit} is not supported"
    return None


def interpreter_problem(key: SdpaKey) -> str | None:
    if interpreting() and key.dtype == "bf16":
        return "Triton's interpreter computes bf16 tl.dot wrongly (triton 3.9); bf16 runs on the GPU only"
    return None


def contiguous_strides(*shape: int) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def qkvo_strides(key: SdpaKey) -> tuple[int, ...]:
    """The strides of contiguous q, k, v and o, as the runners pass them."""
    q = contiguous_strides(key.batch, key.q_heads, key.q_len, key.head_dim)
    k = contiguous_strides(key.batch, key.kv_heads, key.kv_len, key.head_dim)
    v = contiguous_strides(key.batch, key.kv_heads, key.kv_len, key.head_dim_v)
    o = contiguous_strides(key.batch, key.q_heads, key.q_len, key.head_dim_v)
    return (*q, *k, *v, *o)


def output_for(key: SdpaKey, q: torch.Tensor) -> torch.Tensor:
    """The output in the layout torch's fused kernels give (``torch_ref.sdpa_output``)."""
    return sdpa_output(q, key.head_dim_v, DTYPES[key.dtype])


def smem_bytes(key: SdpaKey, bm: int, bn: int, stages: int) -> int:
    """Q tile once, K and V tiles per pipeline stage."""
    item = 4 if key.dtype == "f32" else 2
    d = padded_head_dim(key)
    return (bm * d + 2 * bn * d * max(stages, 1)) * item


def _check_params(key: SdpaKey, bm: int, bn: int, warps: int, stages: int) -> None:
    for name, value in (("bm", bm), ("bn", bn)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {warps}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    need = smem_bytes(key, bm, bn, stages)
    if need > SMEM_BYTES and not interpreting():
        raise ValueError(
            f"bm={bm}, bn={bn}, stages={stages} needs {need} bytes of shared memory > {SMEM_BYTES}"
        )


# Hopper shortlist per padded head dim: (bm, bn, warps, stages). 128-row tiles with 8 warps are
# what wgmma likes; 64-row tiles give causal and short sequences more programs.
CONFIGS: dict[int, list[tuple[int, int, int, int]]] = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
    256: [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
}
SHORT_Q_CONFIG = (16, 64, 4, 3)  # q_len <= 16: decode-like shapes (triton_decode does better)


class TritonAttention(Source):
    builds_kernels = True
    name = "triton_attention"
    op = "sdpa"

    def unavailable(self, device: str) -> str | None:
        return triton_unavailable(device)

    def unsupported(self, key: SdpaKey) -> str | None:
        return head_dim_problem(key) or interpreter_problem(key)

    def candidates(self, key: SdpaKey, device: str) -> list[Params]:
        if device == "cpu":  # interpreter: one small config keeps CI fast
            return [{"bm": 16, "bn": 16, "warps": 4, "stages": 1}]
        if key.q_len <= 16:
            shortlist = [SHORT_Q_CONFIG]
        else:
            d = padded_head_dim(key)
            shortlist = CONFIGS.get(d, CONFIGS[128] if d < 128 else CONFIGS[256])
        out = []
        for bm, bn, warps, stages in shortlist:
            if bm > 64 and key.q_len <= 64:
                bm, warps = 64, 4
            if smem_bytes(key, bm, bn, stages) > SMEM_BYTES:
                continue
            p = {"bm": bm, "bn": bn, "warps": warps, "stages": stages}
            if p not in out:
                out.append(p)
        return out

    def jobs(self, key: SdpaKey, params: Params) -> list[WarmJob]:
        """The kernel this candidate compiles, for contiguous 16-byte aligned inputs."""
        _, consts, scalars = self._plan(key, params)
        fakes = tuple(FakeTensor(DTYPES[key.dtype]) for _ in "qkvo")
        return [WarmJob(_flash_fwd, (*fakes, *scalars, *qkvo_strides(key)), consts)]

    def precompile(self, key: SdpaKey, shortlist: list[Params]) -> None:
        precompile(shortlist, lambda p: self.jobs(key, p))

    def _plan(self, key: SdpaKey, params: Params) -> tuple[tuple[int, int], dict[str, Any], tuple]:
        if reason := self.unsupported(key):
            raise ValueError(reason)
        bm, bn = int(params["bm"]), int(params["bn"])
        warps, stages = int(params["warps"]), int(params["stages"])
        _check_params(key, bm, bn, warps, stages)
        grid = (triton.cdiv(key.q_len, bm), key.batch * key.q_heads)
        consts: dict[str, Any] = {
            "HEAD_DIM": key.head_dim, "BLOCK_D": padded_head_dim(key), "BLOCK_M": bm,
            "BLOCK_N": bn, "CAUSAL": key.causal != "none", "PRECISION": dot_precision(key),
            "num_warps": warps, "num_stages": stages,
        }  # fmt: skip
        scalars = (
            key.scale * LOG2E, key.q_len, key.kv_len, key.q_heads,
            key.q_heads // key.kv_heads, causal_offset(key),
        )  # fmt: skip
        return grid, consts, scalars

    def build(self, key: SdpaKey, params: Params) -> Runner:
        grid, consts, scalars = self._plan(key, params)
        launch = Launch(_flash_fwd, grid, consts)

        def run(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
        ) -> torch.Tensor:
            o = output_for(key, q) if out is None else out
            strides = (*q.stride(), *k.stride(), *v.stride(), *o.stride())
            launch((q, k, v, o), (*scalars, *strides), strides)
            return o

        return checked_runner(run, [launch], f"triton_attention {key}")


settle(globals())  # last: every JIT function above is defined
