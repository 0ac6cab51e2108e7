"""tuner.serving.call_memo: repeat calls of nn.Linear and SDPA served from a memo keyed on the
call, rechecked against what the key leaves out."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dropin_support import assert_all_close, forward_backward, recorded_keys, store_winners
from torch import nn

import tuner.torch as tt
from tuner.serving.dispatcher import Dispatcher


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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
def test_linear_memo_rechecks_a_weight_cut_or_reinterpreted_in_place(
    linear_disp: Dispatcher,
) -> None:
    """``w.data = w.data[:16]`` (output features pruned) keeps the weight object, its storage and
    its strides: only the shape says the runner built for N=32 no longer fits, and torch's
    answer is (4, 16). A view of the storage as another dtype keeps them too, and torch refuses
    the call."""
    x = torch.randn(4, 32)
    with torch.no_grad(), tt.enabled(dispatcher=linear_disp):
        lin = nn.Linear(32, 32)
        lin(x)  # memoised, served by the Triton winner
        lin.weight.data, lin.bias.data = lin.weight.data[:16], lin.bias.data[:16]
        tt.reset_stats()
        got = lin(x)
        assert (tt.stats().hits, tt.stats().misses) == (0, 1)  # N=16: resolved, no winner
        want = F.linear(x.double(), lin.weight.double(), lin.bias.double()).float()
        torch.testing.assert_close(got, want)

        w = torch.randn(32, 32)
        F.linear(x, w)
        w.data = w.data.view(torch.int32)  # same bytes, shape and strides
        with pytest.raises(RuntimeError):  # torch's own error, not a product of the bytes
            F.linear(x, w)


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
def test_sdpa_flags_torch_refuses_stay_refused_where_a_tuned_kernel_serves(tmp_path: Path) -> None:
    """torch takes only a bool for ``is_causal`` and ``enable_gqa``; where a tuned kernel serves
    the call, the drop-in refuses ``is_causal=1`` and ``enable_gqa=1`` as torch does, also after
    a call with ``True`` (``1 == True``, so a memo's key could take one for the other)."""
    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 40, 16, generator=gen) for _ in range(2))
    taken = [{"enable_gqa": True}, {"enable_gqa": True, "is_causal": True}]
    run = lambda: [F.scaled_dot_product_attention(q, k, v, **kw) for kw in taken]  # noqa: E731
    store_winners(disp, recorded_keys(disp, run), triton=False, sdpa_source="triton_decode")
    refused = [{"enable_gqa": 1}, {"enable_gqa": True, "is_causal": 1}]
    wants = []
    for kw in refused:
        with pytest.raises(TypeError) as want:
            F.scaled_dot_product_attention(q, k, v, **kw)
        wants.append(str(want.value))
    with tt.enabled(dispatcher=disp):
        run()
        for kw, want in zip(refused, wants, strict=True):
            with pytest.raises(TypeError) as got:
                F.scaled_dot_product_attention(q, k, v, **kw)
            assert str(got.value) == want
        assert tt.stats(disp).hits == 2


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
def test_sdpa_under_a_chosen_torch_backend_is_torchs(tmp_path: Path) -> None:
    """A call made under ``sdpa_kernel(...)`` asks for torch's kernels (a reference run, a
    debugging one): it gets them, eager and compiled (the block around the compiled call or
    inside the compiled code), where a tuned kernel serves the rest, and torch still refuses
    what its chosen backend cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    disp = Dispatcher(tmp_path / "c.db", mode="lookup")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 1, 16, generator=gen)
    k, v = (torch.randn(2, 2, 40, 16, generator=gen) for _ in range(2))
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    store_winners(disp, recorded_keys(disp, call), triton=False, sdpa_source="triton_decode")
    compiled = torch.compile(call, fullgraph=True)

    @torch.compile(fullgraph=True)
    def chosen_inside() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            return call()

    with tt.enabled(dispatcher=disp):
        call(), compiled()  # compiled: traced here, outside any block
        assert tt.stats(disp).hits == 2
        with sdpa_kernel(SDPBackend.MATH):
            torch.testing.assert_close(call(), call(), rtol=0, atol=0)  # the memo's path too
            compiled()  # its tuner::sdpa reads the switches when it runs
        chosen_inside()
        assert tt.stats(disp).hits == 2
        compiled()
        assert tt.stats(disp).hits == 3
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(RuntimeError):
            call()  # no viable backend on the CPU, as without the tuner
    torch._dynamo.reset()


@pytest.mark.cpu_host
def test_a_call_resolved_across_a_mode_change_leaves_no_memo(
    linear_disp: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread resolves a call to the winner while another turns the dispatcher off (which
    clears the memos): the first thread's memo is not kept, so the winner does not go on
    serving that call with the dispatcher off."""
    resolved, turned_off = threading.Event(), threading.Event()
    resolve = linear_disp.resolve_gemm

    def slow_resolve(*args, **kwargs):
        got = resolve(*args, **kwargs)
        resolved.set()
        turned_off.wait(10)
        return got

    monkeypatch.setattr(linear_disp, "resolve_gemm", slow_resolve)
    lin, x = nn.Linear(32, 32), torch.randn(4, 32)
    linear_disp.reload()
    try:
        with torch.no_grad(), tt.enabled(dispatcher=linear_disp):
            caller = threading.Thread(target=lambda: torch.no_grad()(lin)(x))  # per thread
            caller.start()
            assert resolved.wait(10)
            linear_disp.set_mode("off")
            turned_off.set()
            caller.join(10)
            assert not memos(linear_disp, "linear")
    finally:
        linear_disp.set_mode("lookup")
