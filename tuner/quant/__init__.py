"""Low-precision weight formats for the low-bit GEMM kernels.

- ``int4``: 4-bit weights with per-group scales and zeros (torch's ``scales_and_zeros`` layout),
  packing to this project's kernel layout and to and from torch's tile-packed format;
- ``fp8``: e4m3 / e5m2 quantization with tensorwise and rowwise scales as ``torch._scaled_mm``
  takes them;
- ``tolerance``: how far a low-precision GEMM may be from its float32 reference, from the formats.
"""
