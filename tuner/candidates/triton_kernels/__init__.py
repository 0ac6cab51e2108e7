"""Triton kernels written in this project, one module per family, for the ``triton_gemm``,
``triton_w4a16`` and ``triton_fp8`` sources.

- ``tiled``: one output tile per program, grouped tile ordering, optional split-K over a grid axis
  (fp32 partials reduced by a second, deterministic kernel);
- ``gemv``: decode shapes (M <= 8): streams B with wide loads and FMAs, no tensor cores;
- ``persistent``: Hopper TMA tensor descriptors made on the device, one program per SM;
- ``pad``: copies an operand into a K-padded, 16-byte aligned buffer (for odd shapes);
- ``w4a16`` and ``fp8``: the low-bit GEMMs (INT4 weight-only, FP8 with scales), tiled and
  split-K;
- ``splitk_arrival``: split-K partials summed in the kernel by each tile's last program;
- ``stream_read``: the bare streaming read that benchmarks put beside a kernel as its floor;
- ``configs``: the plain GEMM family's config spaces and shortlist; ``launch``: launching and
  precompiling every kernel here.

Every GEMM kernel takes the strides of its operands, so one source serves every layout of the key.
"""
