"""Triton GEMM kernels of the ``triton_gemm`` source, one module per family.

- ``tiled``: one output tile per program, grouped tile ordering, optional split-K over a grid axis
  (fp32 partials reduced by a second, deterministic kernel);
- ``gemv``: decode shapes (M <= 8): streams B with wide loads and FMAs, no tensor cores;
- ``persistent``: Hopper TMA tensor descriptors made on the device, one program per SM;
- ``pad``: copies an operand into a K-padded, 16-byte aligned buffer (for odd shapes).

Every kernel takes the strides of its operands, so one source serves every layout of the key.
"""
