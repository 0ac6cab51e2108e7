"""tuner.torch's drop-in: its routes and stats, with winners forced as dropin_support.py says."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dropin_support import (
    assert_all_close,
    bench,
    forward_backward,
    linear_inputs,
    prefill,
    recorded_keys,
    served,
    store_winners,
    tiny_llama,
)
from torch import nn
from torch.nn.attention.bias import CausalBias, causal_lower_right, causal_upper_left

import tuner
import tuner.torch as tt
from tuner.cache import Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.serving import dispatcher
from tuner.serving.dispatcher import Dispatcher
from tuner.serving.warmup import warmup
from tuner.tuning.engine import TuneOptions, tune

HAS_GPU = torch.cuda.is_available()


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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


def test_sdpa_keeps_the_layout_torch_gives_heads_interleaved(tmp_path: Path) -> None:
    """q, k and v as projections make them (one position's heads side by side: apart, or split
    from one fused QKV output): the output keeps that layout, eager and compiled, as torch's
    does, so a model's ``o.transpose(1, 2).view(b, s, -1)`` runs, and traces when compiled
    (``tuner::sdpa`` promises that layout, not a contiguous one)."""
    b, s, h, d = 2, 5, 4, 16
    apart = tuple(torch.randn(b, s, h, d).transpose(1, 2) for _ in range(3))
    fused = torch.randn(b, s, 3 * h * d).split(h * d, -1)
    fused = tuple(t.view(b, s, h, d).transpose(1, 2) for t in fused)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).view(b, s, h * d)

    for q, k, v in (apart, fused):
        want = attend(q, k, v)
        with tt.enabled(dispatcher=Dispatcher(tmp_path / "c.db")):
            torch.testing.assert_close(attend(q, k, v), want)
            torch.testing.assert_close(torch.compile(attend, fullgraph=True)(q, k, v), want)
            torch.library.opcheck(torch.ops.tuner.sdpa, (q, k, v, "none", None))
        torch._dynamo.reset()


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


def test_compiled_sdpa_of_heads_torch_refuses_is_left_to_torch(tmp_path: Path) -> None:
    """Traced, q and k of equal heads beside a v of fewer, without ``enable_gqa``, are no
    grouped-query attention: the drop-in leaves the call to torch, which refuses it as it does
    without the tuner, rather than ``tuner::sdpa`` computing where torch raises."""
    q = k = torch.randn(1, 4, 8, 16)
    v = torch.randn(1, 2, 8, 16)

    def attend() -> torch.Tensor:
        return torch.compile(F.scaled_dot_product_attention, backend="eager", fullgraph=True)(
            q, k, v
        )

    with pytest.raises(RuntimeError) as want:  # Dynamo's, naming torch's error
        attend()
    disp = Dispatcher(tmp_path / "c.db", mode="off")
    with tt.enabled(dispatcher=disp), pytest.raises(type(want.value)) as got:
        attend()
    assert str(got.value).splitlines()[:2] == str(want.value).splitlines()[:2]


def test_compiled_sdpa_with_an_enable_gqa_torch_refuses_is_left_to_torch(tmp_path: Path) -> None:
    """torch takes only a bool for ``enable_gqa``; traced, the drop-in leaves ``enable_gqa=1``
    (q, k and v of equal heads) to torch, which raises, rather than ``tuner::sdpa``."""
    q = k = v = torch.randn(1, 4, 8, 16)

    def attend() -> torch.Tensor:
        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=1)

        return torch.compile(call, backend="eager", fullgraph=True)(q, k, v)

    with pytest.raises(Exception) as want:  # Dynamo's, over torch's TypeError
        attend()
    torch._dynamo.reset()
    disp = Dispatcher(tmp_path / "c.db", mode="off")
    with tt.enabled(dispatcher=disp), pytest.raises(type(want.value)) as got:
        attend()
    assert str(got.value).splitlines()[:1] == str(want.value).splitlines()[:1]


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


def test_a_torch_without_one_of_the_ops_routes_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch before 2.6 has no CPU int4 op: ``enable()`` routes the rest, and ``disable()``
    leaves torch as it found it (the op still absent, every other entry point torch's)."""
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    originals = {(o, n): getattr(o, n, None) for o, n, _ in tt.ENTRY_POINTS}
    disp = Dispatcher(tmp_path / "c.db")
    a = torch.randn(4, 4)
    with tt.enabled(dispatcher=disp):
        assert tt.is_enabled() and not hasattr(torch, "_weight_int4pack_mm_for_cpu")
        torch.testing.assert_close(a @ a, a.matmul(a))
        assert tt.stats(disp).calls == 2
    assert {k: getattr(*k, None) for k in originals} == originals and not tt.is_enabled()


def test_an_enable_that_fails_leaves_torch_and_the_dispatcher_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry point that cannot be replaced (here a built-in type's attribute) fails
    ``enable()`` after the others were: they are put back, and nothing counts calls."""
    originals = {(o, n): getattr(o, n) for o, n, _ in tt.ENTRY_POINTS}
    monkeypatch.setattr(tt, "ENTRY_POINTS", (*tt.ENTRY_POINTS, (int, "real", "_matmul")))
    disp = Dispatcher(tmp_path / "c.db")
    with pytest.raises(TypeError):
        tt.enable(dispatcher=disp)
    assert {k: getattr(*k) for k in originals} == originals and not tt.is_enabled()
    assert not disp.counting and "matmul" not in vars(torch.Tensor)


def test_sdpa_bound_before_enable_keeps_torchs_causal_bias_masks(tmp_path: Path) -> None:
    """Code that took torch's SDPA before ``enable()`` keeps calling torch's; a ``CausalBias``
    mask recognises such a call as SDPA as it does without the tuner (not run on its empty
    storage as a tensor)."""
    sdpa = F.scaled_dot_product_attention
    torch_function = vars(CausalBias)["__torch_function__"]
    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 10, 16)
    for mask in (causal_upper_left(8, 10), causal_lower_right(8, 10)):
        want = sdpa(q, kv, kv, attn_mask=mask, enable_gqa=True)
        with tt.enabled(dispatcher=Dispatcher(tmp_path / "c.db")):
            assert F.scaled_dot_product_attention is not sdpa
            torch.testing.assert_close(sdpa(q, kv, kv, attn_mask=mask, enable_gqa=True), want)
            routed = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
            torch.testing.assert_close(routed, want)
    assert vars(CausalBias)["__torch_function__"] is torch_function


def test_calls_outside_the_tuner_are_left_to_torch(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db")
    ints = torch.randint(0, 5, (4, 4))
    a = torch.randn(4, 4)
    q = torch.randn(1, 2, 3, 8)
    mask = torch.randn(3, 3)
    b3 = torch.randn(3, 4, 4)
    bias = torch.randn(5)
    calls = {
        "int matmul": lambda: ints @ ints,
        "mixed dtypes": lambda: a @ a.double(),
        "broadcast batch": lambda: b3 @ a[None],
        "vector": lambda: a @ a[0],
        "out=": lambda: torch.mm(a, a, out=torch.empty(4, 4)),
        "alpha": lambda: torch.addmm(a, a, a, alpha=2.0),
        "float mask": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
        "K = 0 linear": lambda: F.linear(torch.randn(2, 3, 0), torch.randn(5, 0), bias),
        "K = 0 matmul": lambda: torch.randn(2, 3, 0) @ torch.randn(0, 5),
        "empty 4-D batch": lambda: torch.randn(2, 0, 3, 4) @ torch.randn(2, 0, 4, 5),
        "sparse mm": lambda: torch.mm(a.to_sparse(), a),
        "sparse matmul": lambda: a.to_sparse() @ a,
        "sparse addmm": lambda: torch.addmm(a, a.to_sparse(), a),
        "sparse linear": lambda: F.linear(a.to_sparse(), a),
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


def test_calls_torchs_signature_refuses_raise_torchs_own_type_error(tmp_path: Path) -> None:
    """A call that does not bind (a misspelt keyword, a missing operand) raises torch's own
    TypeError under the drop-in, naming torch's function, not the tuner's argument reader."""
    disp = Dispatcher(tmp_path / "c.db")
    a, q = torch.randn(4, 4), torch.randn(1, 2, 3, 8)
    calls = {
        "matmul": lambda: torch.matmul(a, othr=a),
        "mm": lambda: torch.mm(a),
        "addmm": lambda: torch.addmm(a, a, a, gamma=1),
        "linear": lambda: F.linear(a, weigth=a),
        "sdpa": lambda: F.scaled_dot_product_attention(q, q, q, causal=True),
        "matmul's other as mat2": lambda: torch.matmul(a, mat2=a),
        "mm's mat2 as other": lambda: torch.mm(a, other=a),
        "sdpa's keyword-only scale": lambda: F.scaled_dot_product_attention(
            q, q, q, None, 0.0, False, 0.5
        ),
    }
    for name, fn in calls.items():
        with pytest.raises(TypeError) as want:
            fn()
        with tt.enabled(dispatcher=disp), pytest.raises(TypeError) as got:
            fn()
        assert str(got.value) == str(want.value), name
    assert tt.stats(disp).calls == 0


def test_mm_and_bmm_take_their_second_operand_by_name(tmp_path: Path) -> None:
    """torch names it ``mat2``: routed like a positional one, in eager and compiled code."""
    disp = Dispatcher(tmp_path / "c.db", mode="record")
    a, b3 = torch.randn(4, 8), torch.randn(2, 4, 8)
    calls = {
        "mm": lambda: torch.mm(a, mat2=a.t()),
        "Tensor.mm": lambda: a.mm(mat2=a.t()),
        "bmm": lambda: torch.bmm(b3, mat2=b3.transpose(1, 2)),
    }
    for name, fn in calls.items():
        want = fn()
        with tt.enabled(dispatcher=disp):
            before = tt.stats(disp).calls
            torch.testing.assert_close(fn(), want, rtol=0, atol=0, msg=name)
            assert tt.stats(disp).calls == before + 1, name
            compiled = torch.compile(fn, backend="eager", fullgraph=True)
            torch.testing.assert_close(compiled(), want, msg=name)


def test_a_blocks_mode_and_buckets_hold_for_the_block_only(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    with tt.enabled(dispatcher=disp, mode="record"):
        with tt.enabled(dispatcher=disp, mode="off", buckets="pow2"):
            assert (disp.mode, disp.buckets) == ("off", "pow2")
        assert (disp.mode, disp.buckets) == ("record", "exact")
    assert disp.mode == "lookup"
    with pytest.raises(ValueError, match="must be one of"):
        tt.enable(dispatcher=disp, buckets="pow2", mode="fast")
    assert (disp.mode, disp.buckets, tt.is_enabled()) == ("lookup", "exact", False)


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
    with pytest.raises(ValueError, match=r"^buckets must be one of .*, got 'nearest'$"):
        tt.enable(dispatcher=outer, buckets="nearest")
    with pytest.raises(ValueError, match=r"^mode must be one of .*, got 'recrd'$"):
        tt.enable(dispatcher=outer, mode="recrd")
    assert not tt.is_enabled()


def test_a_block_undoes_its_own_enable_when_threads_interleave(tmp_path: Path) -> None:
    """Thread A opens a block, thread B opens one, A's ends first: B's stays on."""
    first, second = Dispatcher(tmp_path / "a.db"), Dispatcher(tmp_path / "b.db")
    b_open, a_closed, b_close = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_b() -> None:
        with tt.enabled(dispatcher=second):
            b_open.set()
            a_closed.wait(10)
            seen["after A's block"] = tt.active_dispatcher()
            b_close.wait(10)

    with tt.enabled(dispatcher=first):
        b = threading.Thread(target=thread_b)
        b.start()
        assert b_open.wait(10)
    a_closed.set()
    try:
        assert tt.is_enabled()
    finally:
        b_close.set()
        b.join(10)
    assert seen["after A's block"] is second
    assert not tt.is_enabled()


def test_blocks_of_two_threads_that_overlap_leave_the_mode_and_buckets_as_they_were(
    tmp_path: Path,
) -> None:
    """Thread A's block (record) opens, B's (off, pow2) opens inside it, A's ends first: B's
    settings hold until B's block ends, then the dispatcher's own come back."""
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    a_open, a_closed, b_open = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_a() -> None:
        with tt.enabled(dispatcher=disp, mode="record"):
            a_open.set()
            assert b_open.wait(10)
        a_closed.set()

    a = threading.Thread(target=thread_a)
    a.start()
    assert a_open.wait(10)
    with tt.enabled(dispatcher=disp, mode="off", buckets="pow2"):
        b_open.set()
        assert a_closed.wait(10)
        seen["after A's block"] = (disp.mode, disp.buckets)
    a.join(10)
    assert seen["after A's block"] == ("off", "pow2")
    assert (disp.mode, disp.buckets, tt.is_enabled()) == ("lookup", "exact", False)


def test_a_block_after_a_stray_disable_leaves_the_enclosing_block_on(tmp_path: Path) -> None:
    outer, inner = Dispatcher(tmp_path / "a.db"), Dispatcher(tmp_path / "b.db")
    with tt.enabled(dispatcher=outer):
        with tt.enabled(dispatcher=inner):
            tt.disable()  # undoes the inner block's enable() already
            assert tt.active_dispatcher() is outer
        assert tt.active_dispatcher() is outer
    assert not tt.is_enabled()


def test_tuner_kernels_calling_torch_do_not_recurse(tmp_path: Path) -> None:
    """The torch baseline's runner calls torch.matmul: one lookup per call, not two."""
    disp = Dispatcher(tmp_path / "c.db")
    a = torch.randn(4, 4, requires_grad=True)
    with tt.enabled(dispatcher=disp):
        (a @ a).sum().backward()  # forward and backward GEMMs call the (patched) torch.matmul
    assert tt.stats(disp).calls == 3


@pytest.mark.cpu_host  # CPU tensors, tuned and served as on a host without a GPU
def test_the_tuners_own_entry_points_inside_a_block_resolve_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tuner.matmul`` and a quantized layer call the dispatcher themselves: their baseline's
    torch call is not routed back to it, counted twice, or (tune mode) timed with the router."""
    disp = Dispatcher(tmp_path / "c.db", mode="tune")
    monkeypatch.setattr(dispatcher, "_dispatcher", disp)  # the one quantized layers call
    layer = tt.quantize_linear(nn.Linear(128, 32), "fp8")
    with tt.enabled(dispatcher=disp), torch.no_grad():
        tuner.matmul(torch.randn(8, 16), torch.randn(16, 8))  # tuned now: torch's calls timed
        layer(torch.randn(2, 128))
        disp.set_mode("lookup")
        tuner.sdpa(*[torch.randn(1, 2, 4, 16)] * 3)
    assert [r.calls for r in tt.stats(disp).rows if r.calls] == [1, 1, 1]


@pytest.mark.cpu_host  # CPU tensors, tuned and served as on a host without a GPU
def test_a_winner_calling_torch_itself_is_resolved_once_inside_a_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch SDPA backend as the winner calls F.scaled_dot_product_attention itself: served
    by ``tuner.sdpa`` inside an ``enabled()`` block, that call is torch's, not routed back,
    resolved and counted again."""
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    monkeypatch.setattr(dispatcher, "_dispatcher", disp)  # the one tuner.sdpa calls
    q = torch.randn(1, 2, 4, 16)
    [key] = recorded_keys(disp, lambda: F.scaled_dot_product_attention(q, q, q))
    outcome = tune(key, options=TuneOptions(budget_s=0.01, sources=[]))
    store = Store(disp.store_path)
    store.save_run(outcome.measurements, replace(outcome.winner, params={"backend": "math"}))
    store.close()
    disp.reload()
    tt.reset_stats(disp)
    with tt.enabled(dispatcher=disp):
        tuner.sdpa(q, q, q)
    served = [(r.candidate, r.calls) for r in tt.stats(disp).rows if r.calls]
    assert served == [('torch_sdpa:{"backend":"math"}', 1)]


# --- CUDA-graph capture (simulated on the CPU) --------------------------------------------------


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
def test_capture_serves_a_winner_loaded_before_it_and_warns_for_one_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A capture builds nothing: a winner whose runner is loaded (``tuner.warmup()``) serves its
    first call inside the capture; one not loaded leaves the default in the graph, said once."""
    import tuner.serving.dispatcher as dispatch

    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    key = GemmKey(m=8, n=24, k=16, layout="nt", dtype="f32", out_dtype="f32")
    store_winners(disp, [key], triton=True)
    disp.reload()
    x, w = linear_inputs(8)
    monkeypatch.setattr(dispatch, "_capturing", lambda device: True)
    with tt.enabled(dispatcher=disp, buckets="exact"), caplog.at_level(logging.WARNING):
        F.linear(x, w)
        F.linear(x, w)
        assert served(disp, 8).kind == "capture"
        said = [r.getMessage() for r in caplog.records if "CUDA-graph capture" in r.getMessage()]
        assert len(said) == 1 and "call tuner.warmup() before" in said[0] and str(key) in said[0]
        warmup(progress=False, dispatcher=disp, fetch=False)  # loads the winner's runner
        disp.resolutions.clear()
        F.linear(x, w)  # a capture's resolution is not kept: resolved again, now loaded
    assert {r.kind for r in disp.resolutions.values() if r.key == str(key)} == {"hit"}


@pytest.mark.cpu_host
def test_capture_of_a_shape_borrowing_a_winner_says_to_call_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket neighbour's winner is built for each shape at its first call, which warmup
    cannot make: a capture meeting the shape first gets the default and says to call it first."""
    import tuner.serving.dispatcher as dispatch

    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    store_winners(disp, [GemmKey(m=8, n=24, k=16, layout="nt", dtype="f32", out_dtype="f32")],
                  triton=True)  # fmt: skip
    disp.reload()
    warmup(progress=False, dispatcher=disp, fetch=False)  # M = 8's runner, not M = 6's
    x, w = linear_inputs(6)
    with tt.enabled(dispatcher=disp, buckets="next_tuned_above"), caplog.at_level(logging.WARNING):
        monkeypatch.setattr(dispatch, "_capturing", lambda device: True)
        F.linear(x, w)
        assert served(disp, 6).kind == "capture"
        [said] = [r.getMessage() for r in caplog.records if "CUDA-graph capture" in r.getMessage()]
        assert "gemm:m=6," in said and "call it once before capturing" in said


# --- stats --------------------------------------------------------------------------------------


@pytest.mark.cpu_host
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
    idle = tt.stats(llama_disp)
    assert idle.calls == 0
    assert str(idle).startswith("tuner.torch: 0 calls: 0 hits")
    lines = str(idle).splitlines()  # the counts, the header, no signature line: none was called
    assert len(lines) == 3
    assert lines[-1] == f"({len(idle.rows)} signatures resolved earlier, not called since)"


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
        warmup(progress=False, dispatcher=disp, fetch=False)  # load before capturing, as users must
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
def test_a_warmed_up_winner_serves_a_call_first_seen_inside_a_capture(tmp_path: Path) -> None:
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    key = GemmKey(m=8, n=32, k=64, layout="nt", dtype="bf16", out_dtype="bf16")
    store_winners(disp, [key], triton=True)
    disp.reload()
    warmup(progress=False, dispatcher=disp, fetch=False)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x, w)
    with torch.no_grad(), tt.enabled(dispatcher=disp, buckets="exact"):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = F.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    [res] = [r for r in disp.resolutions.values() if r.key == str(key)]
    assert res.kind == "hit" and res.candidate.startswith("triton_gemm")


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


@pytest.mark.cpu_host
def test_torch_func_transforms_are_left_to_torch(tmp_path: Path) -> None:
    """``grad``, ``vmap`` and ``jacrev`` hand the entry points wrapped tensors (no storage, their
    own autograd): torch serves them, with torch's results, also for shapes whose tuned winner
    serves the same call made eagerly."""
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    x, w = linear_inputs(4)
    xs = torch.stack([x, 2 * x])

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, w) @ w).square().sum()

    transforms = {
        "grad": lambda: torch.func.grad(loss)(w, x),
        "vmap": lambda: torch.func.vmap(lambda t: F.linear(t, w))(xs),
        "vmap of grad": lambda: torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs),
        "jacrev": lambda: torch.func.jacrev(lambda t: F.linear(t, w))(x[:1]),
    }
    want = {name: fn() for name, fn in transforms.items()}
    store_winners(disp, recorded_keys(disp, lambda: loss(w, x)), triton=True)
    tt.reset_stats(disp)
    with tt.enabled(dispatcher=disp):
        F.linear(x, w)  # eager: the tuned winner serves, and the call is memoised
        assert served(disp, 4).kind == "hit" and not served(disp, 4).by_torch
        calls = tt.stats(disp).calls
        for name, fn in transforms.items():
            torch.testing.assert_close(fn(), want[name], msg=name)
        assert tt.stats(disp).calls == calls


@pytest.mark.cpu_host
def test_torch_func_transforms_inside_compile_are_left_to_torch(tmp_path: Path) -> None:
    """Dynamo traces a transform's function too: the calls it makes there are torch's (the
    tuner's custom ops have no functorch rules), while plain compiled calls keep the custom op."""
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    x, w = linear_inputs(4)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, w) @ w).square().sum()

    want_grad, want_vmap = (
        torch.func.grad(loss)(w, x),
        torch.func.vmap(loss, (None, 0))(w, x[:, None]),
    )
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    with tt.enabled(dispatcher=disp):
        grad = torch.compile(torch.func.grad(loss), backend=backend, fullgraph=True)
        torch.testing.assert_close(grad(w, x), want_grad)
        vmap = torch.compile(torch.func.vmap(loss, (None, 0)), backend="eager", fullgraph=True)
        torch.testing.assert_close(vmap(w, x[:, None]), want_vmap)
        assert "tuner.mm" not in seen
        torch.compile(lambda t: F.linear(t, w), backend=backend, fullgraph=True)(x)
    assert "tuner.mm" in seen
    torch._dynamo.reset()


@pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch has no CPU int4 mm"
)
def test_the_tuners_own_weight_conversion_is_not_routed(tmp_path: Path) -> None:
    """Decoding torch's int4 packing (a quantized layer moved, or loaded from another device's
    state dict) runs torch's int4 GEMM on identity rows: the tuner's own work, never a miss."""
    from tuner.quant import int4

    disp = Dispatcher(tmp_path / "c.db", mode="record")
    q = torch.randint(0, 16, (32, 256), dtype=torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
    with tt.enabled(dispatcher=disp):
        assert torch.equal(int4.from_torch_int4pack(packed), int4.pack(q))
    assert tt.stats(disp).calls == 0 and disp.resolutions == {}
