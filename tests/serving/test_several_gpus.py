"""A host of several GPUs, one process: operands on a GPU other than the current one (a model
spread over GPUs, as ``device_map="auto"`` places it) are tuned, keyed and served on their own GPU.
Triton's, CuPy's and CUTLASS's kernels launch on the current GPU; the dispatcher makes the
operands' GPU current around them. Needs two GPUs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import tuner.torch as tt
from tuner.cache import Store
from tuner.candidates import registry
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, Key, SdpaKey, parse_key
from tuner.measure import samples
from tuner.measure.records import Winner
from tuner.serving.dispatcher import Dispatcher, Resolution
from tuner.serving.warmup import warmup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

SECOND = torch.device("cuda", 1)
INT4 = "layout=nt,dtype=bf16,out_dtype=bf16,compute=f32,align=16,wdtype=int4,group=128,zeros=float,scale=group"
KEYS = [
    parse_key("gemm:m=128,n=256,k=512,batch=1,layout=nn,dtype=bf16,out_dtype=bf16,compute=f32,align=16"),
    parse_key(f"gemm:m=4,n=1024,k=1024,batch=1,{INT4}"),
    parse_key(f"gemm:m=256,n=1024,k=1024,batch=1,{INT4}"),
    parse_key("gemm:m=64,n=256,k=512,batch=1,layout=nt,dtype=fp8_e4m3,out_dtype=bf16,compute=f32,align=16,scale=row,accum=f32"),
    parse_key("sdpa:batch=1,q_heads=8,kv_heads=8,q_len=128,kv_len=128,head_dim=64,head_dim_v=64,causal=none,dtype=bf16,scale=0.125"),
    parse_key("sdpa:batch=1,q_heads=8,kv_heads=8,q_len=1,kv_len=1024,head_dim=64,head_dim_v=64,causal=none,dtype=bf16,scale=0.125"),
]  # fmt: skip
TUNED_SOURCES = [s.name for s in registry.sources() if s.baseline_params is None]


def resolve(disp: Dispatcher, key: Key, inputs: tuple) -> tuple[Callable, Resolution]:
    """The runner a front end would call for ``inputs``, and how it was chosen."""
    if isinstance(key, SdpaKey):
        return disp.resolve_sdpa(*inputs, False, None)
    if key.wdtype == "int4":
        return disp.resolve_int4(*inputs, key.group)
    if key.lowbit:
        return disp.resolve_scaled_mm(*inputs, torch.bfloat16)
    return disp.resolve_gemm(*inputs)


def a_key_it_serves(source: str) -> tuple[Key, dict]:
    """The first of ``KEYS`` that ``source`` serves on the second GPU, and its first candidate."""
    src = registry.get(source)
    with torch.cuda.device(SECOND):
        if why := src.unavailable("cuda"):
            pytest.skip(f"{source}: {why}")
        for key in KEYS:
            supported = key.op == src.op and src.unsupported(key) is None
            if supported and (candidates := src.candidates(key, "cuda")):
                return key, candidates[0]
    pytest.fail(f"{source} serves none of {[str(k) for k in KEYS]}")


def test_each_gpu_has_its_own_fingerprint() -> None:
    with torch.cuda.device(SECOND):
        assert fingerprint("cuda") is fingerprint("cuda:1") is fingerprint(SECOND)
    assert fingerprint("cuda") is fingerprint("cuda:0") is not fingerprint("cuda:1")
    for index in range(torch.cuda.device_count()):
        assert fingerprint(f"cuda:{index}").name == torch.cuda.get_device_name(index)


@pytest.mark.parametrize("source", TUNED_SOURCES)
def test_a_winner_serves_operands_on_each_gpu_from_there(tmp_path: Path, source) -> None:
    """Each kernel family's winner, warmed up for both GPUs (the first loading its kernel
    first) and called with operands on each while the first GPU is current: right answers,
    on the operands' GPU."""
    key, params = a_key_it_serves(source)
    classes = {fingerprint(f"cuda:{index}").device_class for index in (0, 1)}
    Store(tmp_path / "c.db").put_winners(
        [Winner(dc, str(key), source, params, 1.0, 2.0) for dc in classes]
    )
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    for index in (0, 1):
        report = warmup(progress=False, dispatcher=disp, fetch=False, device=index)
        assert report.ok and report.loaded == 1, report.failures

    for gpu in (torch.device("cuda", 0), SECOND):
        with torch.cuda.device(gpu):
            inputs = samples.make_inputs(key, str(gpu), torch.Generator(gpu).manual_seed(0))
            reference = samples.reference(key, inputs)
        torch.cuda.set_device(0)
        runner, res = resolve(disp, key, inputs)
        assert (res.key, res.kind, res.candidate.partition(":")[0]) == (str(key), "hit", source)
        out = runner(*inputs)
        torch.cuda.synchronize(gpu)
        assert out.device == gpu and torch.cuda.current_device() == 0
        assert samples.relative_error(out, reference) <= samples.tolerance(key), gpu


def test_a_call_on_the_second_gpu_is_tuned_there(cache_path: Path) -> None:
    """Tune mode: the operands' GPU measures the candidates (the first GPU's memory is not
    touched) and the winner is stored for that GPU's class."""
    torch.cuda.set_device(0)
    a = torch.randn(96, 384, device=SECOND, dtype=torch.bfloat16)
    b = torch.randn(384, 160, device=SECOND, dtype=torch.bfloat16)
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    first_gpu_peak = torch.cuda.max_memory_allocated(0)
    disp = Dispatcher(cache_path, mode="tune")
    out = disp.matmul(a, b)
    assert torch.cuda.max_memory_allocated(0) == first_gpu_peak
    assert out.device == SECOND
    torch.testing.assert_close(out, a @ b, atol=2e-2, rtol=2e-2)
    key = str(GemmKey.from_tensors(a, b))
    assert Store(cache_path).winner(fingerprint(SECOND).device_class, key) is not None


def test_an_int4_model_spread_over_two_gpus_is_served_on_each(cache_path: Path) -> None:
    """The three lines of README's quantized model, with the model's halves on two GPUs (as
    ``device_map="auto"`` places a model): Triton winners serve each half on its own GPU."""
    torch.manual_seed(0)
    first = tt.quantize_linear(
        nn.Linear(512, 1024, bias=False, dtype=torch.bfloat16, device="cuda:0"), "int4"
    )  # a bare layer: the quantized one is returned
    second = tt.quantize_linear(
        nn.Linear(1024, 256, bias=False, dtype=torch.bfloat16, device=SECOND), "int4"
    )
    x = torch.randn(4, 512, dtype=torch.bfloat16, device="cuda:0")
    with tt.enabled(mode="off"):
        expected = second(first(x).to(SECOND))

    source = "triton_w4a16"
    disp = Dispatcher(cache_path, mode="lookup")
    for layer, device in ((first, "cuda:0"), (second, "cuda:1")):
        key = GemmKey(m=4, n=layer.out_features, k=layer.in_features, layout="nt",
                      dtype="bf16", out_dtype="bf16", wdtype="int4", group=128, zeros="float",
                      scale="group")  # fmt: skip
        params = registry.get(source).candidates(key, "cuda")[0]
        Store(cache_path).put_winners(
            [Winner(fingerprint(device).device_class, str(key), source, params, 1.0, 2.0)]
        )
    disp.reload()
    for index in (0, 1):
        assert warmup(progress=False, dispatcher=disp, fetch=False, device=index).ok

    torch.cuda.set_device(0)
    with tt.enabled(dispatcher=disp):
        got = second(first(x).to(SECOND))
    torch.cuda.synchronize(SECOND)
    served = {r.candidate.partition(":")[0] for r in disp.resolutions.values() if r.kind == "hit"}
    assert served == {source}
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
