"""A test-only GEMM source whose precompile writes what it was asked to compile to a file
(``$TUNER_TEST_COMPILE_LOG``): the compile pool runs it in processes of its own."""

from __future__ import annotations

import json
import os
import time

import torch

from tuner.candidates.base import Source

TILES = [[16, 64], [64, 64], [128, 256]]  # on M=1 the last one wastes more than 4x the first


class CompileLog(Source):
    name = "compile_log"
    op = "gemm"

    def candidates(self, key, device):
        return [{"tile": tile} for tile in TILES]

    def precompile(self, key, shortlist):
        line = json.dumps({"key": str(key), "tiles": [p["tile"] for p in shortlist]})
        with open(os.environ["TUNER_TEST_COMPILE_LOG"], "a") as f:
            f.write(line + "\n")

    def build(self, key, params):
        def run(a, b, out=None):
            return torch.matmul(a, b, out=out)

        return run


class SharedLog(CompileLog):
    """Like ``CompileLog``, but its kernels serve every shape: the pool's shared job gets the
    whole run at once; it marks the problems ready last to first."""

    name = "shared_log"
    shares_kernels = True

    def precompile_run(self, shortlists, ready):
        line = json.dumps({"run": [[str(k), [p["tile"] for p in sl]] for k, sl in shortlists]})
        with open(os.environ["TUNER_TEST_COMPILE_LOG"], "a") as f:
            f.write(line + "\n")
        for i in reversed(range(len(shortlists))):
            ready(i)


class TritonPoolLog(CompileLog):
    """Like ``CompileLog``, but compiles through Triton's pool of compile workers (as every
    Triton source does), which makes queues, so semaphores, in the compile job's process; a
    problem with M=1 then keeps its job running."""

    name = "triton_pool_log"

    def precompile(self, key, shortlist):
        from tuner.candidates.triton_kernels import launch

        launch._get_pool().submit(os.getpid).result()
        super().precompile(key, shortlist)
        if key.m == 1:
            time.sleep(600)
