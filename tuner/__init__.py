"""tuner: autotuned GEMM and attention kernels with a shared results cache.

import tuner
c = tuner.matmul(a, b)          # the fastest known kernel for this problem on this GPU
o = tuner.sdpa(q, k, v, causal=True)
"""

__version__ = "0.1.0"

from tuner.core.settings import load_config_file

load_config_file()  # defaults from ~/.config/tuner/config.toml; the environment wins

from tuner.serving.dispatcher import matmul, sdpa, set_mode  # noqa: E402

__all__ = ["__version__", "matmul", "sdpa", "set_mode"]
