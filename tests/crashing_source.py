"""A test-only candidate source whose candidates take their process down in known ways.

Used by tests/tuning/test_isolation.py through ``registry.register``; the worker process imports
it by module name, so it lives in its own module (the tests directory is on sys.path under
pytest).
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

from tuner.candidates.base import Source


class CrashingGemm(Source):
    name = "crash_test"
    op = "gemm"

    def candidates(self, key, device):
        return [
            {"mode": "pid", "tag": 1},
            {"mode": "exit"},
            {"mode": "pid", "tag": 2},
            {"mode": "segv"},
            {"mode": "pid", "tag": 3},
            {"mode": "cuda_error"},
            {"mode": "pid", "tag": 4},
            {"mode": "hang"},
            {"mode": "ok"},
        ]

    def build(self, key, params):
        mode = params["mode"]
        if mode == "pid":  # a build error that tells which process ran it
            raise RuntimeError(f"worker pid={os.getpid()}")

        def run(a, b, out=None):
            if mode == "exit":
                os._exit(7)
            if mode == "segv":
                ctypes.string_at(0)  # reads address 0: SIGSEGV
            if mode == "cuda_error":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if mode == "hang":
                time.sleep(3600)
            return torch.matmul(a, b, out=out)

        return run
