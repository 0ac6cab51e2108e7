"""The suites' parts and row choices, importable without torch or Triton: the CLI's help shows
them, and the suites themselves (which import both) are loaded only when one runs."""

from __future__ import annotations

MODEL_OPS = ("qkv", "o", "gate_up", "down")  # the projections a model config names
GEMM_PARTS = ("bf16-8b", "bf16-70b", "odd", "fp16", "fp32")
GEMM_WARM_SAMPLE = 8  # rows re-tuned with every kernel already compiled
LOWBIT_FORMATS = ("int4-g128", "fp8-rowwise", "fp8-tensorwise")
LOWBIT_M_SIZES = (1, 2, 4, 8, 16, 64, 256, 2048)
# --quick: every format on both models, on the projections whose weights are large enough for
# the decode targets (bf16 >= 64 MB, FP8 >= 32 MB), at one M of each regime the targets name
LOWBIT_QUICK_M = (1, 16, 256, 2048)
LOWBIT_QUICK_OPS = ("gate_up", "down")
# --quick on a CPU: a few small rows instead of a suite's GPU rows, which take minutes each there
# (the models' projections through Triton's interpreter; 16k-token prefills, GBs of K/V).
# bench gemm, both suites: one small N x K at a decode M and a larger one (llama: in each part's
# dtypes; lowbit: every format); N a multiple of 16 (torch's CPU int4 packing; FP8's 16), K of
# 128 (int4-g128's group; FP8's 16)
GEMM_QUICK_CPU_SHAPE = (64, 256)  # (N, K)
GEMM_QUICK_CPU_M = (1, 64)
# --suite llama's odd part: each of N and K one past the small shape's (no multiple of 8 or 16)
GEMM_QUICK_CPU_ODD_SHAPE = (GEMM_QUICK_CPU_SHAPE[0] + 1, GEMM_QUICK_CPU_SHAPE[1] + 1)
QUICK_CPU_LABEL = "small "  # how every small CPU row's label starts (quick_cpu_label)
# tuner bench sdpa: one sequence's prefill, and decode at batch 1 against these kv lengths
SDPA_QUICK_CPU_PREFILL_SEQ = 256
SDPA_QUICK_CPU_DECODE_KV = (1024, 4096)


def quick_cpu_label(label: str) -> str:
    """A small CPU row's label: the rows tell themselves apart from a suite's GPU rows by it
    (``is_quick_cpu``)."""
    return f"{QUICK_CPU_LABEL}{label}"


def quick_cpu_name(n: int, k: int) -> str:
    """A small CPU GEMM row's shape as its label says it (``quick_cpu_label``)."""
    return quick_cpu_label(f"N={n} K={k}")


def is_quick_cpu(label: str) -> bool:
    """Whether a row is one of ``--quick``'s small CPU rows (``quick_cpu_label``)."""
    return label.startswith(QUICK_CPU_LABEL)
