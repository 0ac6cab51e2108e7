"""The CUTLASS launchers on the GPU: the FP8 one keeps built kernel params per pointer set (a, b,
out, scale_a, scale_b), so every call on a kept set, on a new one, on one evicted from a full
store, with new values at kept pointers, with padded strides or replayed from a CUDA graph must
give its own inputs' result; the INT4 one into its own and a caller's output. Kernels whose
specs the FP8 and INT4 prefill benches already built (a seeded cache loads them)."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from tuner.candidates import cutlass_fp8, cutlass_gemm, registry
from tuner.candidates import cutlass_w4a16 as w4
from tuner.core.keys import GemmKey, lowbit_fields
from tuner.measure import samples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

LARGE = GemmKey(m=384, n=768, k=512, **lowbit_fields("fp8-rowwise"))  # 128x192 / 128x128 CTAs
SMALL = GemmKey(m=5, n=256, k=512, **lowbit_fields("fp8-rowwise"))  # stream-K, workspace zeroed
CASES = [(LARGE, 0), (LARGE, 2), (SMALL, 0)]
NAN = float("nan")


def runner(name: str, key: GemmKey, params: dict):
    src = registry.get(name)
    reason = src.unavailable("cuda") or src.unsupported(key)
    if reason:
        pytest.skip(f"{name}: {reason}")
    return src.build(key, params)


def fp8_runner(key: GemmKey, index: int):
    return runner("cutlass_fp8", key, cutlass_fp8.shortlist(key)[index])


def assert_right(run, key: GemmKey, inputs: tuple[torch.Tensor, ...], out=None) -> None:
    """One call on ``inputs`` (into ``out``, NaN first, if given) within the format's bound."""
    if out is not None:
        out.fill_(NAN)  # an element the kernel leaves unwritten fails
        assert run(*inputs, out=out) is out
    else:
        out = run(*inputs)
    assert samples.relative_error(out, samples.reference(key, inputs)) <= 1


def assert_right_from_two_threads(run, key: GemmKey, seed: int) -> None:
    """Two threads, each on a stream of its own with four input sets of its own, call ``run``
    in turn; every call within the format's bound."""
    gen = torch.Generator("cuda").manual_seed(seed)
    sets = [[samples.make_inputs(key, "cuda", gen) for _ in range(4)] for _ in range(2)]
    torch.cuda.synchronize()  # the inputs, made on the default stream, are read on others
    errors: list[BaseException] = []

    def calls(mine: list[tuple[torch.Tensor, ...]]) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(25):
                    for inputs in mine:
                        assert_right(run, key, inputs)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(mine,)) for mine in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize(("key", "index"), CASES, ids=["128x192", "128x192-streamk", "streamk"])
def test_kept_evicted_and_new_pointer_sets_each_give_their_own_result(
    key: GemmKey, index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cutlass_gemm, "PARAM_SETS", 2)
    run = fp8_runner(key, index)
    gen = torch.Generator("cuda").manual_seed(0)
    sets = [samples.make_inputs(key, "cuda", gen) for _ in range(3)]
    outs = [samples.output_like(key, s) for s in sets]
    for i in (0, 0, 1, 0, 2, 1, 2, 0):  # three sets through two kept: hits and evictions
        assert_right(run, key, sets[i], outs[i])
    assert len(run.params) == 2
    for slot in range(4):  # one operand's pointer differs from a kept set's
        mixed = tuple(sets[1][j] if j == slot else sets[0][j] for j in range(4))
        assert_right(run, key, mixed, outs[0])
    assert_right(run, key, sets[0], samples.output_like(key, sets[0]))  # another out
    assert_right(run, key, sets[0])  # an out the launcher allocates
    sets[0][0].view(torch.uint8).copy_(sets[2][0].view(torch.uint8))  # new values at kept
    sets[0][2].copy_(sets[2][2])  # pointers: read by the next launch, not kept with the params
    assert_right(run, key, sets[0], outs[0])


def test_padded_rows_and_packed_ones_in_turn() -> None:
    """A padded leading dimension rewrites the strides and drops the kept params; packed
    operands again after it rewrite them back."""
    key = LARGE
    run = fp8_runner(key, 0)
    gen = torch.Generator("cuda").manual_seed(1)
    a, b, scale_a, scale_b = samples.make_inputs(key, "cuda", gen)
    wide = torch.zeros(key.m, key.k + 64, dtype=torch.uint8, device="cuda")
    wide[:, : key.k].copy_(a.view(torch.uint8))
    padded = wide.view(a.dtype)[:, : key.k]
    assert padded.stride() == (key.k + 64, 1)
    out = samples.output_like(key, (a, b, scale_a, scale_b))
    for operand in (a, padded, a, padded):
        assert_right(run, key, (operand, b, scale_a, scale_b), out)


def test_a_captured_call_replays_its_own_params_after_they_are_evicted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cutlass_gemm, "PARAM_SETS", 1)
    key = SMALL
    run = fp8_runner(key, 0)
    gen = torch.Generator("cuda").manual_seed(2)
    sets = [samples.make_inputs(key, "cuda", gen) for _ in range(2)]
    out = samples.output_like(key, sets[0])
    run(*sets[0], out=out)  # warm-up on the capturing stream's inputs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(*sets[0], out=out)
    assert_right(run, key, sets[1])  # evicts the captured call's params
    out.fill_(NAN)
    graph.replay()
    assert samples.relative_error(out, samples.reference(key, sets[0])) <= 1


def test_w4a16_into_its_own_and_a_callers_output() -> None:
    key = GemmKey(m=16, n=384, k=1024, **lowbit_fields("int4-g128"))
    run = runner("cutlass_w4a16", key, w4.shortlist(key)[0])
    gen = torch.Generator("cuda").manual_seed(3)
    for inputs in [samples.make_inputs(key, "cuda", gen) for _ in range(2)]:
        assert_right(run, key, inputs)
        assert_right(run, key, inputs, samples.output_like(key, inputs))


@pytest.mark.parametrize(("key", "index"), [CASES[0], CASES[2]], ids=["128x192", "streamk"])
def test_one_runner_called_from_two_threads_gives_each_its_own_result(
    key: GemmKey, index: int
) -> None:
    """The dispatcher hands one runner to every caller: threads on their own streams must not
    build one another's params, launch on one another's stream or share stream-K's workspace."""
    assert_right_from_two_threads(fp8_runner(key, index), key, seed=2)


def test_w4a16_stream_k_runner_called_from_two_threads() -> None:
    key = GemmKey(m=16, n=384, k=1024, **lowbit_fields("int4-g128"))
    stream_k = next(p for p in w4.SMALL if p["scheduler"] == "streamk")
    assert_right_from_two_threads(runner("cutlass_w4a16", key, stream_k), key, seed=4)


def test_a_thread_whose_first_cuda_call_is_the_runner_gets_its_result() -> None:
    """A new thread has no CUDA context current, and a call on a new pointer set builds its
    params there: CUTLASS's host code encodes their TMA descriptors through the driver, which
    needs one (the launcher makes torch's current first)."""
    key = SMALL
    run = fp8_runner(key, 0)
    inputs = samples.make_inputs(key, "cuda", torch.Generator("cuda").manual_seed(5))
    outs = [samples.output_like(key, inputs) for _ in range(2)]
    assert_right(run, key, inputs, outs[0])  # the default stream's workspace, made here
    torch.cuda.synchronize()
    seen: dict[str, object] = {}

    def first_cuda_call() -> None:
        context = ctypes.c_void_p()
        ctypes.CDLL("libcuda.so.1").cuCtxGetCurrent(ctypes.byref(context))
        seen["context"] = context.value
        try:
            run(*inputs, out=outs[1])  # another out: params built in this thread
            torch.cuda.synchronize()
        except BaseException as e:  # reported by the main thread
            seen["error"] = e

    thread = threading.Thread(target=first_cuda_call)
    thread.start()
    thread.join()
    assert seen["context"] is None and "error" not in seen, seen
    assert samples.relative_error(outs[1], samples.reference(key, inputs)) <= 1
