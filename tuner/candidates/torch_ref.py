"""torch's own kernels: the baselines on every device, and the whole CPU path.

``torch.matmul`` is cuBLAS's default heuristic on NVIDIA GPUs, i.e. what a user gets without us
(low-bit GEMMs have their own baseline, ``torch_lowbit``).
For SDPA, torch's default dispatch is the baseline and each of its backends is also a candidate;
``torch_sdpa`` is torch's SDPA for a tuner causal mode, the one fallback the dispatcher and the
drop-in use.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tuner.candidates.base import Params, Runner, Source
from tuner.core.keys import GemmKey, SdpaKey


@contextlib.contextmanager
def tf32_mode(enabled: bool):
    """Set torch's TF32 switch for matmuls, restoring it after."""
    flags = torch.backends.cuda.matmul
    before = flags.allow_tf32
    flags.allow_tf32 = enabled
    try:
        yield
    finally:
        flags.allow_tf32 = before


class TorchGemm(Source):
    name = "torch"
    op = "gemm"
    calls_torch = True
    baseline_params: ClassVar[Params] = {}

    def unsupported(self, key: GemmKey) -> str | None:
        return "low-bit GEMMs: the torch_lowbit source" if key.lowbit else None

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        return [{}]

    def build(self, key: GemmKey, params: Params) -> Runner:
        want_tf32 = key.compute == "tf32"

        # the switch read through torch._C, its cheapest read: the baseline times what a call
        # of torch.matmul costs, and a caller's call reads no switch
        def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
            if key.dtype != "f32" or torch._C._get_cublas_allow_tf32() == want_tf32:
                return torch.matmul(a, b, out=out)
            with tf32_mode(want_tf32):
                return torch.matmul(a, b, out=out)

        return run


SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def bottom_right_mask(q_len: int, kv_len: int, device: Any) -> torch.Tensor:
    """Boolean mask where query i sees keys up to i + kv_len - q_len (the last query sees all)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def torch_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: str = "none",
    scale: float | None = None,
    enable_gqa: bool = True,
) -> torch.Tensor:
    """torch's own SDPA for a tuner causal mode (``none``, ``top_left``, ``bottom_right``): what
    the dispatcher serves for calls the tuner does not take (with its caller's ``enable_gqa``:
    torch broadcasts, computes or raises its own errors as for that call) and what the drop-in's
    backward differentiates (its calls are keyed ones, grouped-query included: torch only reads
    ``enable_gqa`` when the head counts differ, and comparing them here would be a symbolic bool
    while tracing). Bottom-right is an explicit boolean mask: torch's ``CausalBias`` has no
    grouped-query path."""
    mask = (
        bottom_right_mask(q.shape[-2], k.shape[-2], q.device) if causal == "bottom_right" else None
    )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal == "top_left", scale=scale, enable_gqa=enable_gqa
    )


def heads_interleaved(q: torch.Tensor) -> bool:
    """Whether ``q`` (B, H, S, D) steps over its heads within a position, as projections make it
    (heads of one position side by side, alone or beside k and v of a fused QKV projection):
    torch's fused SDPA kernels then return a (B, S, H, D) output, and callers count on it
    (``o.transpose(1, 2).view(b, s, -1)`` works on no other). With one head or one position
    both layouts are one."""
    return q.shape[1] > 1 and q.shape[2] > 1 and q.stride(1) < q.stride(2)


def sdpa_output(q: torch.Tensor, head_dim_v: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty SDPA output for ``q`` in the layout torch's fused kernels give it: heads
    interleaved where ``q``'s are (``heads_interleaved``), else contiguous."""
    b, h, s, _ = q.shape
    if heads_interleaved(q):
        return q.new_empty((b, s, h, head_dim_v), dtype=dtype).transpose(1, 2)
    return q.new_empty((b, h, s, head_dim_v), dtype=dtype)


def in_sdpa_layout(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``o``, an SDPA output for ``q``, in ``sdpa_output``'s layout: copied only where it is not
    (torch's own kernels choose theirs by backend)."""
    laid = o.transpose(1, 2) if heads_interleaved(q) else o
    return o if laid.is_contiguous() else sdpa_output(q, o.shape[-1]).copy_(o)


def sdpa_mask(key: SdpaKey, device: Any) -> tuple[Any, bool]:
    """(attn_mask, is_causal) for torch's SDPA: top-left is torch's ``is_causal``.

    Bottom-right uses torch's ``causal_lower_right`` bias (fused kernels) without GQA, and a
    boolean mask with GQA, which that bias does not support on every torch version.
    """
    if key.causal == "top_left" or (key.causal == "bottom_right" and key.q_len == key.kv_len):
        return None, True
    if key.causal == "bottom_right":
        if key.q_heads != key.kv_heads:
            return bottom_right_mask(key.q_len, key.kv_len, device), False
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(key.q_len, key.kv_len), False
    return None, False


# The math backend materialises the score matrix (and, for GQA, K and V expanded to every q
# head); past this size it is seconds slower than any fused kernel and can run out of memory.
MATH_MAX_BYTES = 2**30


def math_bytes(key: SdpaKey) -> int:
    """What torch's math SDPA allocates beyond its inputs, roughly: fp32 scores (and probabilities),
    plus the expanded K/V under GQA."""
    scores = 2 * key.batch * key.q_heads * key.q_len * key.kv_len * 4
    expanded = key.kv_bytes * (key.q_heads // key.kv_heads) if key.q_heads != key.kv_heads else 0
    return scores + expanded


class TorchSdpa(Source):
    """torch's SDPA; params {"backend": "default" | "flash" | "efficient" | "cudnn" | "math"}."""

    name = "torch_sdpa"
    op = "sdpa"
    calls_torch = True
    baseline_params: ClassVar[Params] = {"backend": "default"}

    def times_challengers(self, device: str) -> bool:
        return device == "cuda"  # its other backends

    def candidates(self, key: SdpaKey, device: str) -> list[Params]:
        if device != "cuda":
            return [{"backend": "default"}]
        backends = [b for b in SDPA_BACKENDS if b != "math" or math_bytes(key) <= MATH_MAX_BYTES]
        return [{"backend": "default"}] + [{"backend": b} for b in backends]

    def build(self, key: SdpaKey, params: Params) -> Runner:
        backend = params.get("backend", "default")
        if backend != "default" and backend not in SDPA_BACKENDS:
            raise ValueError(
                f"backend must be one of {['default', *SDPA_BACKENDS]}, got {backend!r}"
            )
        gqa = key.q_heads != key.kv_heads
        scale = key.scale
        masks: dict[Any, tuple[Any, bool]] = {}  # per device: a boolean mask lives on one
        chosen_backend = backend != "default"  # a winner: its output as the fused kernels'
        if not chosen_backend:
            select = contextlib.nullcontext
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            chosen = getattr(SDPBackend, SDPA_BACKENDS[backend])

            def select():
                return sdpa_kernel(chosen)

        def run(q, k, v, out=None):
            mask, is_causal = masks.get(q.device) or masks.setdefault(
                q.device, sdpa_mask(key, q.device)
            )
            with select():
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
                )
            if chosen_backend and heads_interleaved(q):  # math gives contiguous outputs
                o = in_sdpa_layout(o, q)
            if out is not None:
                out.copy_(o)
                return out
            return o

        return run
