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
# bench gemm --suite lowbit: every format on one small N x K at a decode M and a larger one; N a
# multiple of 16 (torch's CPU int4 packing; FP8's 16), K of 128 (int4-g128's group; FP8's 16)
LOWBIT_QUICK_CPU_SHAPE = (64, 256)  # (N, K)
LOWBIT_QUICK_CPU_M = (1, 64)
# tuner bench sdpa: one sequence's prefill, and decode at batch 1 against these kv lengths
SDPA_QUICK_CPU_PREFILL_SEQ = 256
SDPA_QUICK_CPU_DECODE_KV = (1024, 4096)
