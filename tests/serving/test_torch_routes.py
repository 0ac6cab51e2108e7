"""tuner.torch: the drop-in for unmodified PyTorch models.

On the CPU the tuned kernels are the Triton GEMMs run by Triton's interpreter: their winners are
forced here (the interpreter is far slower than torch, so the engine would rightly keep torch),
with the timings the engine measured. Everything else goes through the real dispatcher and store.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

import tuner.torch as tt
from tuner.cache import Store
from tuner.candidates import registry
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, Key, parse_key
from tuner.serving.buckets import BucketIndex, next_pow2
from tuner.serving.dispatcher import Dispatcher, Resolution
from tuner.tuning.engine import TuneOptions, tune

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = torch.cuda.is_available()


def load_bench() -> object:
    """bench/dropin_decoder.py (not a package): its Llama layer is the model under test."""
    name = "dropin_decoder"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "dropin_decoder.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


bench = load_bench()


# --- helpers ----------------------------------------------------------------------------------


def recorded_keys(disp: Dispatcher, run: Callable[[], object]) -> list[Key]:
    """The problems ``run`` makes through the drop-in (dispatcher in record mode)."""
    disp.set_mode("record")
    with tt.enabled(dispatcher=disp):
        run()
    disp.set_mode("lookup")
    keys = {r.key for r in disp.resolutions.values() if r.kind != "untunable"}
    return [parse_key(k) for k in sorted(keys)]


def store_winners(
    disp: Dispatcher, keys: list[Key], *, triton: bool, sdpa_source: str | None = None
) -> None:
    """Tune ``keys``; with ``triton``, GEMMs get the Triton candidate as their winner (and SDPA
    problems ``sdpa_source``'s), with the times the engine measured for it and for torch."""
    store = Store(disp.store_path)
    for key in keys:
        source = ("triton_gemm" if triton else None) if isinstance(key, GemmKey) else sdpa_source
        if source:
            outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=[source]))
            m = next(m for m in outcome.measurements if m.source == source)
            assert m.status in ("ok", "cut"), m.error  # numerics passed: it is a valid kernel
            winner = replace(
                outcome.winner, source=m.source, params=m.params, median_us=m.median_us
            )
        else:
            outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=[]))
            winner = outcome.winner
        store.save_run(outcome.measurements, winner)
    store.close()
    disp.reload()


def backprop(out: torch.Tensor) -> None:
    """Backward with a dense random gradient (``sum()``'s is a stride-0 broadcast, which the
    dispatcher rightly leaves to torch)."""
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))


def forward_backward(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> list[torch.Tensor]:
    """[fn(x), then the gradients of the module's parameters and of x], gradients reset after."""
    out = fn(x)
    backprop(out)
    result = [out.detach(), *(p.grad for p in module.parameters()), x.grad]
    module.zero_grad(set_to_none=True)
    x.grad = None
    return result


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], **tol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"tensor {i}: {m}")


def tiny_llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    layer = bench.DecoderLayer(bench.TINY, max_pos=32)
    bench.init_weights(layer, gen)
    return layer.to(dtype)


def prefill(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x, torch.arange(x.shape[1]))


@pytest.fixture(autouse=True)
def _always_disabled() -> Iterator[None]:
    yield
    while tt.is_enabled():  # a failing test must not leave torch patched for the next one
        tt.disable()


@pytest.fixture(scope="module")
def llama_disp(tmp_path_factory: pytest.TempPathFactory) -> Dispatcher:
    """A store where every GEMM of the tiny Llama layer (forward and backward, f32 prefill and
    f16 decode) has a Triton winner, and its attention a tuned winner."""
    disp = Dispatcher(tmp_path_factory.mktemp("llama") / "c.db", mode="lookup")
    layer = tiny_llama()
    x = torch.randn(2, 8, bench.TINY.hidden, requires_grad=True)
    keys = recorded_keys(disp, lambda: forward_backward(layer, lambda t: prefill(layer, t), x))
    half = tiny_llama(torch.float16)
    step = bench.make_step(half, bench.Phase("decode", 2, 1), 16, torch.Generator().manual_seed(1))
    with torch.no_grad():
        keys += recorded_keys(disp, step)
    store_winners(disp, keys, triton=True)
    return disp


# --- the model tests --------------------------------------------------------------------------


def test_llama_block_outputs_and_grads_match_with_tuned_gemms(llama_disp: Dispatcher) -> None:
    layer = tiny_llama()
    x = torch.randn(2, 8, bench.TINY.hidden, requires_grad=True)
    want = forward_backward(layer, lambda t: prefill(layer, t), x)
    tt.reset_stats(llama_disp)
    with tt.enabled(dispatcher=llama_disp):
        got = forward_backward(layer, lambda t: prefill(layer, t), x)
    stats = tt.stats(llama_disp)

    assert_all_close(got, want, rtol=1e-4, atol=1e-5)
    # 4 projections forward, 2 GEMMs each backward: all 12 served by the Triton winners
    assert stats.hits == 12
    assert stats.passthrough == 1  # attention with a gradient: torch's SDPA by policy
    served = {r.candidate.partition(":")[0] for r in stats.rows if r.calls and "gemm" in r.key}
    assert served == {"triton_gemm"}
    assert stats.misses == 0 and stats.bucketed == 0


def test_f16_decode_step_with_kv_cache(llama_disp: Dispatcher) -> None:
    layer = tiny_llama(torch.float16)
    gen = torch.Generator().manual_seed(1)
    step = bench.make_step(layer, bench.Phase("decode", 2, 1), 16, gen)
    with torch.no_grad():
        ref = step()  # the cache slot it writes is overwritten identically below
        tt.reset_stats(llama_disp)
        with tt.enabled(dispatcher=llama_disp):
            out = step()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-3)
    stats = tt.stats(llama_disp)
    assert stats.hits == 5  # qkv, o, gate_up, down and the GQA attention against the cache
    assert any(r.calls and r.key.startswith("sdpa:") and "kv_len=16" in r.key for r in stats.rows)


def test_transformer_encoder_layer_same_outputs_and_grads(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    x = torch.randn(2, 6, 32, requires_grad=True)
    want = forward_backward(layer, layer, x)

    disp = Dispatcher(tmp_path / "c.db")
    keys = recorded_keys(disp, lambda: forward_backward(layer, layer, x))
    store_winners(disp, keys, triton=False)  # the engine's own choice (torch on the CPU)
    tt.reset_stats(disp)
    with tt.enabled(dispatcher=disp):
        got = forward_backward(layer, layer, x)
    assert_all_close(got, want)
    stats = tt.stats(disp)
    # nn.MultiheadAttention's in/out projections (its Python code calls F.linear) and the FFN:
    # 4 GEMMs forward, 8 backward
    assert stats.calls_of("hit") >= 12
    assert any(r.calls and "n=96" in r.key for r in stats.rows)  # the packed QKV projection


def test_eval_mode_routes_attention_too(llama_disp: Dispatcher) -> None:
    layer = tiny_llama().eval()
    x = torch.randn(1, 8, bench.TINY.hidden)
    with torch.no_grad():
        ref = prefill(layer, x)
        with tt.enabled(dispatcher=llama_disp):
            out = prefill(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    rows = [r for r in tt.stats(llama_disp).rows if r.calls and r.key.startswith("sdpa:")]
    assert any("causal=top_left" in r.key for r in rows)


# --- torch.compile ------------------------------------------------------------------------------


def test_compile_fullgraph_aot_eager(llama_disp: Dispatcher) -> None:
    torch._dynamo.reset()
    layer = tiny_llama()
    x = torch.randn(2, 8, bench.TINY.hidden, requires_grad=True)
    want = forward_backward(layer, lambda t: prefill(layer, t), x)
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(
            gm, example_inputs
        )

    tt.reset_stats(llama_disp)
    with tt.enabled(dispatcher=llama_disp):
        compiled = torch.compile(lambda t: prefill(layer, t), backend=backend, fullgraph=True)
        got = forward_backward(layer, compiled, x)
    assert_all_close(got, want, rtol=1e-4, atol=1e-5)
    assert seen.count("tuner.mm") == 4  # one opaque op per projection, in one graph
    stats = tt.stats(llama_disp)
    assert stats.hits >= 12  # forward and backward GEMMs ran through the dispatcher
    torch._dynamo.reset()


def test_compile_inductor_forward(llama_disp: Dispatcher) -> None:
    torch._dynamo.reset()
    w = torch.randn(128, bench.TINY.hidden)

    def block(t: torch.Tensor) -> torch.Tensor:
        return F.gelu(F.linear(t, w)).sum(-1)

    x = torch.randn(16, bench.TINY.hidden)
    with torch.no_grad():
        ref = block(x)
        tt.reset_stats(llama_disp)
        with tt.enabled(dispatcher=llama_disp):
            out = torch.compile(block, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert tt.stats(llama_disp).calls == 1
    torch._dynamo.reset()


def test_custom_ops_pass_opcheck(tmp_path: Path) -> None:
    tt.enable(dispatcher=Dispatcher(tmp_path / "c.db"))  # the dispatcher the ops' kernels use
    a = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(16, 4).t().contiguous().t().requires_grad_()  # column-major B
    torch.library.opcheck(torch.ops.tuner.mm, (a, b))
    bat = torch.randn(3, 8, 16, requires_grad=True), torch.randn(3, 16, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.tuner.mm, bat)
    for kv_heads, causal in ((2, "none"), (2, "top_left"), (4, "bottom_right")):
        # (torch's own bottom-right mask has no grouped-query path, so neither has the baseline)
        q = torch.randn(1, 4, 5, 16, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, 7, 16, requires_grad=True) for _ in range(2))
        torch.library.opcheck(torch.ops.tuner.sdpa, (q, k, v, causal, None))


def test_sdpa_op_backward_matches_torch(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db")
    for kv_heads, causal in ((2, "none"), (2, "top_left"), (4, "bottom_right")):
        q = torch.randn(1, 4, 5, 16, requires_grad=True)
        k, v = (torch.randn(1, kv_heads, 7, 16, requires_grad=True) for _ in range(2))
        with tt.enabled(dispatcher=disp):
            out = torch.ops.tuner.sdpa(q, k, v, causal, 0.3)
            got = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref = tt.torch_sdpa(q, k, v, causal, 0.3)
        want = torch.autograd.grad(ref.square().sum(), (q, k, v))
        torch.testing.assert_close(out, ref)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


# --- routing and leaving alone ------------------------------------------------------------------


def test_entry_points_route_and_restore(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db")
    originals = {(o, n): getattr(o, n) for o, n, _ in tt.ENTRY_POINTS}
    a, b, c = torch.randn(6, 5), torch.randn(5, 4), torch.randn(4)
    x3, y3 = torch.randn(2, 6, 5), torch.randn(2, 5, 4)
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    calls = {
        "torch.matmul": lambda: torch.matmul(a, b),
        "@": lambda: a @ b,
        "Tensor.matmul": lambda: a.matmul(b),
        "fold 3-D @ 2-D": lambda: x3 @ b,
        "4-D same batch": lambda: x3[None] @ y3[None],
        "torch.mm": lambda: torch.mm(a, b),
        "Tensor.mm": lambda: a.mm(b),
        "torch.bmm": lambda: torch.bmm(x3, y3),
        "Tensor.bmm": lambda: x3.bmm(y3),
        "torch.addmm": lambda: torch.addmm(c, a, b),
        "Tensor.addmm": lambda: c.expand(6, 4).addmm(a, b),
        "F.linear": lambda: F.linear(x3, b.t(), c),
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        "F.sdpa lower-right": lambda: F.scaled_dot_product_attention(
            q, kv, kv, attn_mask=causal_lower_right(3, 5)
        ),
    }
    want = {name: fn() for name, fn in calls.items()}
    with tt.enabled(dispatcher=disp):
        for name, fn in calls.items():
            before = tt.stats(disp).calls
            torch.testing.assert_close(fn(), want[name], msg=name)
            assert tt.stats(disp).calls == before + 1, f"{name} was not routed"
    assert all(getattr(o, n) is f for (o, n), f in originals.items())
    assert "matmul" not in vars(torch.Tensor)  # inherited methods are not left overridden


def test_calls_outside_the_tuner_are_left_to_torch(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db")
    ints = torch.randint(0, 5, (4, 4))
    a = torch.randn(4, 4)
    q = torch.randn(1, 2, 3, 8)
    mask = torch.randn(3, 3)
    b3 = torch.randn(3, 4, 4)
    calls = {
        "int matmul": lambda: ints @ ints,
        "mixed dtypes": lambda: a @ a.double(),
        "broadcast batch": lambda: b3 @ a[None],
        "vector": lambda: a @ a[0],
        "out=": lambda: torch.mm(a, a, out=torch.empty(4, 4)),
        "alpha": lambda: torch.addmm(a, a, a, alpha=2.0),
        "float mask": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
    }
    for name, fn in calls.items():
        try:
            want: object = fn()
        except RuntimeError as e:
            want = type(e)
        with tt.enabled(dispatcher=disp):
            before = tt.stats(disp).hits + tt.stats(disp).misses
            try:
                got: object = fn()
            except RuntimeError as e:
                got = type(e)
            assert tt.stats(disp).hits + tt.stats(disp).misses == before, name
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, msg=name)
        else:
            assert got is want, name


def test_nesting_and_errors(tmp_path: Path) -> None:
    outer, inner = Dispatcher(tmp_path / "a.db"), Dispatcher(tmp_path / "b.db")
    a = torch.randn(4, 4)
    with tt.enabled(dispatcher=outer):
        with tt.enabled(dispatcher=inner):
            assert tt.active_dispatcher() is inner
            a @ a
        assert tt.active_dispatcher() is outer
        a @ a
    assert not tt.is_enabled()
    assert tt.stats(inner).calls == 1 and tt.stats(outer).calls == 1
    with pytest.raises(RuntimeError, match="without a matching enable"):
        tt.disable()
    with pytest.raises(ValueError, match="TUNER_BUCKETS must be one of"):
        tt.enable(dispatcher=outer, buckets="nearest")
    assert not tt.is_enabled()


def test_tuner_kernels_calling_torch_do_not_recurse(tmp_path: Path) -> None:
    """The torch baseline's runner calls torch.matmul: one lookup per call, not two."""
    disp = Dispatcher(tmp_path / "c.db")
    a = torch.randn(4, 4, requires_grad=True)
    with tt.enabled(dispatcher=disp):
        (a @ a).sum().backward()  # forward and backward GEMMs call the (patched) torch.matmul
    assert tt.stats(disp).calls == 3


# --- buckets ------------------------------------------------------------------------------------


def test_bucket_index_policies() -> None:
    keys = [GemmKey(m=m, n=64, k=32, layout="nt", dtype="f32", out_dtype="f32") for m in (1, 8, 64)]
    index = BucketIndex.from_key_strings([str(k) for k in keys] + ["sdpa:nonsense", "gemm:bad"])
    probe = GemmKey(m=5, n=64, k=32, layout="nt", dtype="f32", out_dtype="f32")
    assert index.neighbour(probe, "exact") is None
    assert index.neighbour(probe, "next_tuned_above") == replace(probe, m=8)
    assert index.neighbour(probe, "pow2") == replace(probe, m=8)
    assert index.neighbour(replace(probe, m=9), "pow2") is None  # 16 was never tuned
    assert index.neighbour(replace(probe, m=9), "next_tuned_above").m == 64
    assert index.neighbour(replace(probe, m=65), "next_tuned_above") is None
    assert index.neighbour(replace(probe, m=8), "next_tuned_above") is None  # exact: not a bucket
    assert index.neighbour(replace(probe, n=32), "next_tuned_above") is None  # other family
    assert index.neighbour(replace(probe, layout="nn"), "next_tuned_above") is None
    assert [next_pow2(m) for m in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert index.tuned_ms(probe) == [1, 8, 64]


@pytest.fixture(scope="module")
def bucket_disp(tmp_path_factory: pytest.TempPathFactory) -> Dispatcher:
    """A Triton winner for M=8 of x @ W^T (N=24, K=16), and nothing else."""
    disp = Dispatcher(tmp_path_factory.mktemp("buckets") / "c.db")
    key = GemmKey(m=8, n=24, k=16, layout="nt", dtype="f32", out_dtype="f32")
    store_winners(disp, [key], triton=True)
    return disp


def linear_inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    return torch.randn(m, 16, generator=gen), torch.randn(24, 16, generator=gen)


def served(disp: Dispatcher, m: int) -> Resolution:
    return next(
        r for r in disp.resolutions.values() if r.key.startswith(f"gemm:m={m},") and r.calls
    )


def test_bucketed_call_uses_neighbour_params_built_for_its_own_m(bucket_disp: Dispatcher) -> None:
    x, w = linear_inputs(5)
    bucket_disp.set_mode("record")
    tt.reset_stats(bucket_disp)
    with tt.enabled(dispatcher=bucket_disp, buckets="next_tuned_above"):
        out = F.linear(x, w)
    torch.testing.assert_close(out, F.linear(x, w))
    res = served(bucket_disp, 5)
    assert res.kind == "bucketed" and res.via.startswith("gemm:m=8,")
    assert res.candidate.startswith("triton_gemm")
    stats = tt.stats(bucket_disp)
    assert stats.bucketed == 1
    assert stats.saved_us == pytest.approx(res.winner.baseline_us - res.winner.median_us)
    store = Store(bucket_disp.store_path)  # the exact miss is recorded for offline tuning
    misses = {row["key"] for row in store.misses(fingerprint("cpu").device_class)}
    assert any(k.startswith("gemm:m=5,") for k in misses)


@pytest.mark.parametrize(
    ("policy", "m", "kind"),
    [("exact", 5, "miss"), ("pow2", 5, "bucketed"), ("pow2", 3, "miss"), ("pow2", 9, "miss")],
)
def test_bucket_policy_choices(bucket_disp: Dispatcher, policy: str, m: int, kind: str) -> None:
    x, w = linear_inputs(m)
    want = F.linear(x, w)
    bucket_disp.set_mode("lookup")
    tt.reset_stats(bucket_disp)
    with tt.enabled(dispatcher=bucket_disp, buckets=policy):
        got = F.linear(x, w)
    torch.testing.assert_close(got, want)
    assert served(bucket_disp, m).kind == kind


def test_tuner_buckets_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TUNER_BUCKETS", "pow2")
    assert Dispatcher(tmp_path / "c.db").buckets == "pow2"
    monkeypatch.setenv("TUNER_BUCKETS", "closest")
    with pytest.raises(ValueError, match="TUNER_BUCKETS must be one of"):
        Dispatcher(tmp_path / "c.db")


def test_source_can_refuse_params_for_another_m(
    bucket_disp: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = registry.get("triton_gemm")
    monkeypatch.setattr(
        src, "valid_for", lambda key, params: "tile plan fixed to M=8", raising=False
    )
    x, w = linear_inputs(6)
    want = F.linear(x, w)
    tt.reset_stats(bucket_disp)
    with tt.enabled(dispatcher=bucket_disp, buckets="next_tuned_above"):
        got = F.linear(x, w)
    torch.testing.assert_close(got, want)
    assert served(bucket_disp, 6).kind == "miss"


# --- CUDA-graph capture (simulated on the CPU) --------------------------------------------------


def test_capture_uses_default_and_caches_nothing(
    bucket_disp: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tuner.serving.dispatcher as dispatch
    import tuner.tuning.engine

    def no_tuning(*args: object, **kwargs: object) -> None:
        raise AssertionError("tuned during capture")

    monkeypatch.setattr(tuner.tuning.engine, "tune", no_tuning)
    x, w = linear_inputs(8)  # M=8 has a Triton winner
    y, v = linear_inputs(7)  # M=7 has none
    want_x, want_y = F.linear(x, w), F.linear(y, v)
    bucket_disp.set_mode("tune")
    tt.reset_stats(bucket_disp)
    with tt.enabled(dispatcher=bucket_disp, buckets="exact"):
        monkeypatch.setattr(dispatch, "_capturing", lambda device: True)
        for _ in range(2):
            torch.testing.assert_close(F.linear(x, w), want_x)
            torch.testing.assert_close(F.linear(y, v), want_y)
        kinds = {
            r.key.split(",")[0]: (r.kind, r.candidate, r.calls) for r in tt.stats().rows if r.calls
        }
        assert kinds == {"gemm:m=8": ("capture", "torch", 2), "gemm:m=7": ("capture", "torch", 2)}
        monkeypatch.setattr(dispatch, "_capturing", lambda device: False)
        tt.reset_stats()
        F.linear(x, w)  # after the capture: resolved again, now the winner serves
    bucket_disp.set_mode("lookup")
    assert served(bucket_disp, 8).kind == "hit"
    store = Store(bucket_disp.store_path)
    assert any(
        r["key"].startswith("gemm:m=7,") for r in store.misses(fingerprint("cpu").device_class)
    )


# --- stats --------------------------------------------------------------------------------------


def test_stats_table_and_reset(llama_disp: Dispatcher) -> None:
    layer = tiny_llama().eval()
    x = torch.randn(2, 8, bench.TINY.hidden)
    with torch.no_grad(), tt.enabled(dispatcher=llama_disp):
        tt.reset_stats()
        prefill(layer, x)
        prefill(layer, x)
        stats = tt.stats()
    assert stats.hits == 10 and stats.calls == 10
    expected = sum(
        r.calls * (r.winner.baseline_us - r.winner.median_us) for r in stats.rows if r.calls
    )
    assert stats.saved_us == pytest.approx(expected)
    text = str(stats)
    assert text.startswith("tuner.torch: 10 calls: 10 hits, 0 bucketed, 0 misses")
    assert "triton_gemm" in text and "gemm:m=16,n=128,k=64" in text
    assert stats.to_dict()["hits"] == 10
    tt.reset_stats(llama_disp)
    assert tt.stats(llama_disp).calls == 0


# --- the call memo (tuner.serving.call_memo) ----------------------------------------------------------


@pytest.fixture(scope="module")
def linear_disp(tmp_path_factory: pytest.TempPathFactory) -> Dispatcher:
    """A store where ``nn.Linear(32, 32)`` on (4, 32) f32 inputs has a Triton winner."""
    disp = Dispatcher(tmp_path_factory.mktemp("linear") / "c.db", mode="lookup")
    lin, x = nn.Linear(32, 32), torch.randn(4, 32)
    with torch.no_grad():
        store_winners(disp, recorded_keys(disp, lambda: lin(x)), triton=True)
    return disp


def memos(disp: Dispatcher, op: str) -> list:
    return [m for key, m in disp.memo.items() if key[0] == op]


def test_linear_memo_serves_repeat_calls_with_the_winner(linear_disp: Dispatcher) -> None:
    lin, x = nn.Linear(32, 32), torch.randn(4, 32)
    with torch.no_grad():
        want = lin(x)
        with tt.enabled(dispatcher=linear_disp):
            tt.reset_stats()
            for _ in range(3):
                torch.testing.assert_close(lin(x), want)
            assert tt.stats().hits == 3
            (memo,) = memos(linear_disp, "linear")
            assert memo.res.candidate.startswith("triton_gemm") and memo.weight() is lin.weight
    linear_disp.reload()  # the dispatcher forgets its runners: the memo goes with them
    assert not linear_disp.memo


def test_linear_memo_serves_batched_inputs_with_bias_as_two_dimensional(
    linear_disp: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(1, 4, 32) @ W.T + b is the stored (4, 32) problem: the memo flattens x, adds the bias in
    place and gives the result x's leading dimensions back."""
    from tuner.serving.call_memo import LinearMemo

    served = []
    serve = LinearMemo.serve
    monkeypatch.setattr(LinearMemo, "serve", lambda self, *a: served.append(1) or serve(self, *a))
    lin, x = nn.Linear(32, 32), torch.randn(1, 4, 32)
    with torch.no_grad():
        want = F.linear(x.double(), lin.weight.double(), lin.bias.double()).float()
        with tt.enabled(dispatcher=linear_disp):
            tt.reset_stats()
            for _ in range(3):
                got = lin(x)
                assert got.shape == (1, 4, 32)
                torch.testing.assert_close(got, want)
            assert tt.stats().hits == 3
            (memo,) = [m for m in memos(linear_disp, "linear") if m.weight() is lin.weight]
            assert not memo.res.by_torch and memo.flat == (-1, 32)
    assert len(served) == 2  # the first call resolved and memoised; the repeats took the memo


def test_linear_memo_rechecks_what_its_key_leaves_out(linear_disp: Dispatcher) -> None:
    """The memo's key is (weight, x's shape, strides, dtype); a tuned runner is used only after
    checking the rest of the dispatcher's signature. Each change below makes a problem the store
    has no winner for, so the call must be resolved again (a miss), and still be right."""
    lin = nn.Linear(32, 32)
    x = torch.randn(4, 32)

    def misaligned() -> torch.Tensor:  # x's data 4 bytes past a 16-byte boundary
        return torch.randn(4 * 32 + 1)[1:].view(4, 32)

    def transposed_weight() -> torch.Tensor:
        lin.weight.data = lin.weight.data.t()  # same object and storage, another layout
        return x

    changes = {"misaligned x": misaligned, "weight transposed in place": transposed_weight}
    with torch.no_grad(), tt.enabled(dispatcher=linear_disp):
        for name, change in changes.items():
            lin(x)  # memoised, served by the Triton winner
            tt.reset_stats()
            x_now = change()
            got = lin(x_now)
            assert (tt.stats().hits, tt.stats().misses) == (0, 1), name
            want = F.linear(x_now.double(), lin.weight.double(), lin.bias.double())  # not routed
            torch.testing.assert_close(got, want.float(), msg=name)


def test_linear_memo_leaves_gradients_and_tf32_to_the_full_path(linear_disp: Dispatcher) -> None:
    lin, x = nn.Linear(32, 32), torch.randn(4, 32, requires_grad=True)
    want = forward_backward(lin, lin, x)
    with tt.enabled(dispatcher=linear_disp):
        with torch.no_grad():
            lin(x)  # memoised without a gradient
        assert_all_close(forward_backward(lin, lin, x), want)  # through _TunedMM: autograd
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = not tf32
        try:
            with torch.no_grad():
                tt.reset_stats()
                lin(x)
                assert tt.stats().misses == 1  # another compute mode: another problem
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32


def test_linear_memo_is_not_inherited_by_a_new_weight_at_a_dead_ones_id(
    linear_disp: Dispatcher,
) -> None:
    """Weights made per call (``w.t()``) die at once and their ``id``\\ s come back for other
    tensors: a memo checks it still holds *its* weight (weak reference). Here a dead weight of
    another shape left a torch-served memo under the very id of a weight that has a Triton winner.
    """
    x = torch.randn(4, 32)
    with torch.no_grad(), tt.enabled(dispatcher=linear_disp):
        dead = torch.randn(48, 32)
        F.linear(x, dead)  # no winner for N=48: memoised as torch's
        dead_id = id(dead)
        del dead
        for _ in range(1000):  # CPython hands a freed object's address to the next one
            w = torch.randn(32, 32)
            if id(w) == dead_id:
                break
        else:
            pytest.skip("no tensor object reused the freed id")
        tt.reset_stats()
        torch.testing.assert_close(F.linear(x, w), x.double().mm(w.double().t()).float())
        assert tt.stats().hits == 1  # resolved for this weight: its Triton winner


def test_sdpa_memo_keys_on_keywords_and_skips_masks(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db")
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    keywords = [{"enable_gqa": True}, {"enable_gqa": True, "is_causal": True},
                {"enable_gqa": True, "scale": 0.5}]  # fmt: skip
    want = [F.scaled_dot_product_attention(q, k, v, **kw) for kw in keywords]
    mask = torch.randn(3, 5)
    with tt.enabled(dispatcher=disp):
        for _ in range(2):
            for kw, w in zip(keywords, want, strict=True):
                torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, **kw), w)
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert tt.stats(disp).calls == 6  # the masked calls are torch's, not counted
    assert len(memos(disp, "sdpa")) == 3


def test_sdpa_memo_serves_a_tuned_decode_kernel(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 40, 16, generator=gen) for _ in range(2))
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    want = call()
    store_winners(disp, recorded_keys(disp, call), triton=False, sdpa_source="triton_decode")
    with tt.enabled(dispatcher=disp):
        for _ in range(3):
            torch.testing.assert_close(call(), want, atol=2e-5, rtol=1e-4)
        assert tt.stats(disp).hits == 3
    (memo,) = memos(disp, "sdpa")
    assert memo.res.candidate.startswith("triton_decode")


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_cuda_graph_replays_tuned_layer(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db", mode="record")
    layer = bench.DecoderLayer(bench.TINY, max_pos=64).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    step = bench.make_step(layer, bench.Phase("decode", 4, 1), 64, gen)
    with torch.no_grad():
        keys = recorded_keys(disp, step)
        store = Store(disp.store_path)
        for key in keys:
            outcome = tune(key, options=TuneOptions(budget_s=0.02, max_candidates=4))
            store.save_run(outcome.measurements, outcome.winner)
        disp.reload()
        ref = step().clone()
        with tt.enabled(dispatcher=disp):
            bench.capture(step)  # warm-up on a side stream: every signature resolved eagerly
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            tt.reset_stats(disp)
            out.zero_()
            graph.replay()
            assert tt.stats(disp).calls == 0  # a replay makes no Python calls
        torch.cuda.synchronize()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    kinds = {r.kind for r in disp.resolutions.values()}
    assert "capture" not in kinds and "hit" in kinds


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_signature_first_seen_in_capture_gets_default(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db", mode="tune")
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(w, w.t())  # cuBLAS initialised before the capture, as torch asks
    with torch.no_grad(), tt.enabled(dispatcher=disp):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = F.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(y, F.linear(x, w))
    kinds = {r.kind for r in disp.resolutions.values() if r.key.startswith("gemm:")}
    assert kinds == {"capture"}
    store = Store(disp.store_path)
    assert store.misses(fingerprint("cuda").device_class)  # recorded, not tuned
    assert not store.winners(fingerprint("cuda").device_class)


# --- the GPU benchmark's own logic, on the CPU ----------------------------------------------------


def test_dropin_benchmark_smoke_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/dropin_decoder.py end to end with tiny dimensions: record, tune, measure, JSON, PNG."""
    monkeypatch.setenv("TUNER_CACHE", str(tmp_path / "c.db"))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = ["--smoke", "--out", str(out), "--plot", str(png), "--source", "torch"]
    args += ["--decode-batches", "1,4", "--extra-batches", "3", "--prefill-seq", "8"]
    args += ["--kv-len", "16", "--rounds", "2", "--iters", "2", "--overhead-calls", "50"]
    args += ["--overhead-rounds", "3"]
    result = bench.main(args)
    assert result["complete"] and png.stat().st_size > 0
    assert json.loads(out.read_text())["targets"] == result["targets"]
    assert {row["status"] for row in result["tuning"]} == {"tuned"}
    rows = {row["label"]: row for row in result["phases"]}
    assert set(rows) == {"decode b=1", "decode b=4", "prefill b=1 s=8", "decode b=3 (untuned M)"}
    for row in rows.values():
        assert row["rel_err_on_vs_off"] < 1e-6
        assert row["eager_on"]["median_us"] > 0 and row["eager_ratio"] > 0
    assert rows["decode b=4"]["stats"]["hits"] == rows["decode b=4"]["stats"]["calls"] > 0
    untuned = rows["decode b=3 (untuned M)"]
    assert untuned["stats"]["bucketed"] > 0  # its GEMMs borrow M=4's winners
    assert {s["via"].split(",")[0] for s in untuned["served"] if s["kind"] == "bucketed"} == {
        "gemm:m=4"
    }
    assert result["overhead"]["per_call_us"]["tuner_linear_on"] > 0


def test_speedup_bound_is_amdahl_over_the_routed_kernels() -> None:
    """The decode bound of the benchmark: routed kernels replaced by reads at a bandwidth."""
    layer = bench.DecoderLayer(bench.TINY, max_pos=16)
    phase = bench.Phase("decode", 2, 1)
    c = bench.TINY
    weights = c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.hidden
    weights += 3 * c.hidden * c.intermediate
    kv = 2 * 2 * c.kv_heads * 16 * c.head_dim
    assert bench.routed_bytes(layer, phase, 16) == 4 * (weights + kv)  # f32
    row = {"graph_off": {"median_us": 200.0}, "breakdown": {"routed_us": 150.0}}
    bound = bench.speedup_bound(row, 100_000_000, {"peak": 1000.0})  # 100 MB at 1 TB/s: 100 us
    assert bound["floor_us_at_peak"] == pytest.approx(100.0)
    assert bound["max_ratio_at_peak"] == pytest.approx(200.0 / 150.0)
    row["breakdown"]["routed_us"] = 210.0  # profiled eagerly, a little over the graph step
    assert bench.speedup_bound(row, 100_000_000, {"peak": 1000.0})["max_ratio_at_peak"] == 2.0


def test_replot_redraws_both_plots_from_a_saved_run(tmp_path: Path) -> None:
    bound = {"max_ratio_at_copy": 1.1, "max_ratio_at_peak": 1.2}
    rows = [{"label": "decode b=1", "phase": "decode", "graph_ratio": 1.01, "bound": bound}]
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"smoke": False, "phases": rows}))
    png = tmp_path / "run.png"
    bench.main(["--replot", str(saved), "--plot", str(png)])
    assert png.stat().st_size > 0 and bench.bound_plot_path(png).stat().st_size > 0
    with pytest.raises(SystemExit):  # nothing to write the results to
        bench.parse_args(["--smoke"])
