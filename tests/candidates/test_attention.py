"""Attention kernels (triton_attention, triton_decode) against the fp64 reference, the SDPA bench's
problem lists and a smoke run of its whole path, and the dispatcher's autograd rule.

On the CPU the Triton kernels run in Triton's interpreter (f16 and f32 only: the interpreter
computes bf16 dots wrongly); GPU tests add bf16 and the real configs.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tuner.candidates import registry
from tuner.candidates.torch_ref import TorchSdpa
from tuner.candidates.triton_attention import TritonAttention
from tuner.candidates.triton_decode import TritonDecode, pdl_problem, plan, split_choices
from tuner.core.keys import DTYPES, SdpaKey
from tuner.measure import samples
from tuner.suites import sdpa
from tuner.tuning.engine import TuneOptions, tune

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")

ATTN = TritonAttention()
DECODE = TritonDecode()
SMALL_PREFILL = {"bm": 16, "bn": 16, "warps": 4, "stages": 1}


def make(key: SdpaKey, layout: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v for ``key`` in a layout: 'bhsd' (contiguous), 'bshd' (heads interleaved, as
    projections produce them) or 'strided_d' (every other element of a wider last dim)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    dt = DTYPES[key.dtype]

    def one(heads: int, seq: int, dim: int) -> torch.Tensor:
        if layout == "bshd":
            t = torch.randn(key.batch, seq, heads, dim, generator=gen, device=DEVICE)
            return t.to(dt).transpose(1, 2)
        if layout == "strided_d":
            t = torch.randn(key.batch, heads, seq, 2 * dim, generator=gen, device=DEVICE)
            return t.to(dt)[..., ::2]
        return torch.randn(key.batch, heads, seq, dim, generator=gen, device=DEVICE).to(dt)

    return (
        one(key.q_heads, key.q_len, key.head_dim),
        one(key.kv_heads, key.kv_len, key.head_dim),
        one(key.kv_heads, key.kv_len, key.head_dim_v),
    )


def check(runner, key: SdpaKey, inputs: tuple[torch.Tensor, ...], out=None) -> float:
    """Relative error of the runner's result (into a NaN-poisoned buffer) against fp64/fp32."""
    poisoned = samples.output_like(key, inputs) if out is None else out.fill_(float("nan"))
    res = runner(*inputs, out=poisoned)
    assert res is poisoned
    err = samples.relative_error(res, samples.reference(key, inputs))
    assert err <= samples.tolerance(key), f"{key}: relative error {err:.3g}"
    return err


def sdpa_key(**kw) -> SdpaKey:
    base = dict(batch=1, q_heads=4, kv_heads=2, q_len=37, kv_len=53, head_dim=64, dtype="f16")
    return SdpaKey(**(base | kw))


# --- prefill kernel: masks, GQA, ragged lengths, head dims, layouts ------------------------------


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize(
    ("q_len", "kv_len"), [(37, 53), (53, 37), (16, 16), (1, 29), (33, 1)], ids=str
)
def test_prefill_masks_and_lengths(causal: str, q_len: int, kv_len: int) -> None:
    key = sdpa_key(q_len=q_len, kv_len=kv_len, causal=causal)
    check(ATTN.build(key, SMALL_PREFILL), key, make(key, "bhsd"))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["f16", "f32"])
def test_prefill_head_dims(head_dim: int, dtype: str) -> None:
    key = sdpa_key(head_dim=head_dim, dtype=dtype, causal="top_left", q_len=19, kv_len=35)
    check(ATTN.build(key, SMALL_PREFILL), key, make(key, "bhsd", seed=head_dim))


@pytest.mark.parametrize("layout", ["bshd", "strided_d"])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (4, 1), (6, 2)])
def test_prefill_layouts_and_groups(layout: str, q_heads: int, kv_heads: int) -> None:
    key = sdpa_key(q_heads=q_heads, kv_heads=kv_heads, causal="bottom_right", batch=2)
    inputs = make(key, layout)
    assert not inputs[0].is_contiguous()
    # a non-contiguous output too: (b, s, h, d) storage seen as (b, h, s, d)
    out = torch.empty(
        key.batch, key.q_len, key.q_heads, key.head_dim, dtype=inputs[0].dtype, device=DEVICE
    ).transpose(1, 2)
    check(ATTN.build(key, SMALL_PREFILL), key, inputs, out=out)


def test_prefill_matches_torch_causal_convention() -> None:
    """top_left is torch's is_causal when q_len != kv_len (the reference is not trusted alone)."""
    key = sdpa_key(q_len=20, kv_len=44, causal="top_left", dtype="f32")
    q, k, v = make(key, "bhsd")
    ours = ATTN.build(key, SMALL_PREFILL)(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_fully_masked_rows_are_zero() -> None:
    """bottom-right with q_len > kv_len: the first q_len - kv_len queries see no key."""
    key = sdpa_key(q_len=40, kv_len=17, causal="bottom_right", dtype="f32")
    q, k, v = make(key, "bhsd")
    for runner in (ATTN.build(key, SMALL_PREFILL),):
        o = runner(q, k, v)
        assert torch.all(o[:, :, : 40 - 17] == 0)
        assert torch.isfinite(o).all()


PREFILL_AND_DECODE = [
    (ATTN, {"q_len": 24, "kv_len": 40}, SMALL_PREFILL),
    (DECODE, {"q_len": 4, "kv_len": 61}, {"bn": 16, "splits": 1, "warps": 4, "stages": 1}),
    (DECODE, {"q_len": 4, "kv_len": 61}, {"bn": 16, "splits": 3, "warps": 4, "stages": 1}),
    (
        DECODE,
        {"q_len": 1, "kv_len": 61},
        {"bn": 16, "splits": 2, "warps": 4, "stages": 1, "fused": True},
    ),
]


@pytest.mark.parametrize(("source", "shape", "params"), PREFILL_AND_DECODE)
def test_a_nan_among_the_keys_gives_nan_rows_as_torchs(source, shape, params) -> None:
    """A NaN in K (activations that overflowed upstream) makes NaN every row that sees that
    key, as torch's does: not zeros, which a NaN check downstream would not catch."""
    key = sdpa_key(dtype="f32", **shape)
    q, k, v = make(key, "bhsd")
    k[0, 1, 3, 0] = float("nan")  # batch 0, kv head 1: q heads 2 and 3
    ours = source.build(key, params)(q, k, v)
    theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    nan_rows = theirs.isnan().any(-1)
    assert nan_rows[0, 2:].all() and not nan_rows[0, :2].any()
    assert torch.equal(ours.isnan().any(-1), nan_rows)
    torch.testing.assert_close(ours[~nan_rows], theirs[~nan_rows], rtol=1e-4, atol=1e-5)


def q_of_fused_qkv(key: SdpaKey) -> torch.Tensor:
    """q split from one projection's output (B, S, (H + 2 KV) D), as GPT-2, NeoX and Falcon
    make it: heads interleaved, the memory not dense."""
    width = (key.q_heads + 2 * key.kv_heads) * key.head_dim
    qkv = torch.randn(key.batch, key.q_len, width, device=DEVICE).to(DTYPES[key.dtype])
    q = qkv[..., : key.q_heads * key.head_dim]
    return q.view(key.batch, key.q_len, key.q_heads, key.head_dim).transpose(1, 2)


@pytest.mark.parametrize(("source", "shape", "params"), PREFILL_AND_DECODE[:3])  # q_len > 1
def test_the_output_takes_qs_layout_as_torchs_does(source, shape, params) -> None:
    """Heads interleaved in q (one position's heads side by side): a (B, S, H, D) output, as
    torch's fused kernels give it (its math path, which GQA takes on a GPU, gives contiguous
    outputs), so that a model's ``o.transpose(1, 2).view(b, s, h * d)`` runs as on torch's."""
    key = sdpa_key(dtype="f32", **shape)
    runner = source.build(key, params)
    projected, k, v = make(key, "bshd")
    for q in (projected, q_of_fused_qkv(key)):
        ours, theirs = runner(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert ours.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
        ours.transpose(1, 2).view(key.batch, key.q_len, -1)  # raises where the layout differs
    assert runner(*make(key, "bhsd")).is_contiguous()


def test_torchs_math_backend_as_a_winner_keeps_qs_layout_too() -> None:
    """torch's math SDPA gives contiguous outputs whatever q's layout; served as a winner (the
    baseline, torch's default, is left as torch gives it) its output is laid as the fused
    kernels' are, so a model's transpose-view runs whichever torch backend won."""
    key = sdpa_key(dtype="f32", kv_heads=4)
    q, k, v = make(key, "bshd")
    winner = TorchSdpa().build(key, {"backend": "math"})(q, k, v)
    assert winner.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(
        winner, F.scaled_dot_product_attention(q, k, v), rtol=1e-4, atol=1e-5
    )


def test_prefill_rejects_what_it_cannot_do() -> None:
    assert "head_dim_v" in ATTN.unsupported(sdpa_key(head_dim=64, head_dim_v=128))
    assert "head_dim 512" in ATTN.unsupported(sdpa_key(head_dim=512))
    with pytest.raises(ValueError, match="power of two"):
        ATTN.build(sdpa_key(), {"bm": 24, "bn": 16, "warps": 4, "stages": 1})


# --- decode kernel: split-KV, grouped rows, masks ------------------------------------------------


@pytest.mark.parametrize(("splits", "fused"), [(1, False), (2, False), (2, True), (4, True)])
@pytest.mark.parametrize(
    ("q_len", "causal"), [(1, "none"), (4, "bottom_right"), (3, "top_left"), (16, "none")]
)
def test_decode_splits_and_masks(splits: int, fused: bool, q_len: int, causal: str) -> None:
    key = sdpa_key(q_heads=8, kv_heads=2, q_len=q_len, kv_len=61, causal=causal, batch=2)
    params = {"bn": 16, "splits": splits, "warps": 4, "stages": 1, "fused": fused}
    assert plan(key, params).splits == splits
    runner = DECODE.build(key, params)
    check(runner, key, make(key, "bhsd", seed=splits))
    if fused:  # the merging program reset its counter: a second call merges again
        check(runner, key, make(key, "bhsd", seed=splits + 1))


@pytest.mark.parametrize(("splits", "fused"), [(1, False), (2, False), (4, True)])
@pytest.mark.parametrize(("q_len", "causal"), [(1, "none"), (4, "bottom_right")])
def test_decode_even_splits_load_unmasked(
    splits: int, fused: bool, q_len: int, causal: str
) -> None:
    """kv_len a multiple of splits x bn and a power-of-two head dim: the unmasked (EVEN) path."""
    key = sdpa_key(q_heads=8, kv_heads=2, q_len=q_len, kv_len=64, causal=causal, batch=2)
    params = {"bn": 16, "splits": splits, "warps": 4, "stages": 1, "fused": fused}
    assert plan(key, params).consts["EVEN"]
    runner = DECODE.build(key, params)
    for layout in ("bhsd", "bshd"):
        check(runner, key, make(key, layout, seed=splits))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "strided_d"])
def test_decode_head_dims_and_layouts(head_dim: int, layout: str) -> None:
    key = sdpa_key(head_dim=head_dim, q_len=2, kv_len=75, causal="bottom_right", dtype="f32")
    check(
        DECODE.build(key, {"bn": 16, "splits": 3, "warps": 4, "stages": 1}), key, make(key, layout)
    )


@pytest.mark.parametrize("fused", [False, True])
def test_decode_one_row_per_tile(fused: bool) -> None:
    """Multi-head attention at q_len 1: one query row per (batch, head) tile."""
    key = sdpa_key(q_heads=3, kv_heads=3, q_len=1, kv_len=90)
    params = {"bn": 16, "splits": 3, "warps": 4, "stages": 1, "fused": fused}
    check(DECODE.build(key, params), key, make(key, "bshd"))


def test_decode_short_cache_masks_whole_rows() -> None:
    """q_len > kv_len, bottom-right: rows without keys are 0 in the split and merged paths."""
    key = sdpa_key(q_len=5, kv_len=3, causal="bottom_right", dtype="f32")
    for splits, fused in ((1, False), (2, False), (2, True)):
        params = {"bn": 16, "splits": splits, "warps": 4, "stages": 1, "fused": fused}
        o = DECODE.build(key, params)(*make(key, "bhsd"))
        assert torch.all(o[:, :, :2] == 0) and torch.isfinite(o).all()


def test_decode_scope_and_split_choices() -> None:
    assert "q_len 17" in DECODE.unsupported(sdpa_key(q_len=17))
    assert "rows per tile" in DECODE.unsupported(sdpa_key(q_heads=32, kv_heads=1, q_len=8))
    key = SdpaKey(batch=1, q_heads=32, kv_heads=8, q_len=1, kv_len=8192, head_dim=128)
    # batch 1, 8 kv heads: about 1, 2, 4 and 8 programs per SM on a 132-SM GPU
    assert split_choices(key, 64, 132) == [16, 32, 64, 128]  # whole 64-key tiles: no empty split
    wide = SdpaKey(batch=64, q_heads=32, kv_heads=8, q_len=1, kv_len=1024, head_dim=128)
    assert split_choices(wide, 64, 132) == [1, 2, 3]  # 512 (batch, kv head) pairs fill the GPU


# --- through the engine, and the dispatcher's autograd rule --------------------------------------


def test_engine_accepts_both_triton_sources() -> None:
    key = sdpa_key(q_len=4, kv_len=70, causal="bottom_right")
    outcome = tune(
        key, options=TuneOptions(budget_s=0.01, sources=["triton_attention", "triton_decode"])
    )
    status = {m.source: m.status for m in outcome.measurements}
    errors = {m.source: m.error for m in outcome.measurements}
    for name in ("triton_attention", "triton_decode"):
        assert status[name] in ("ok", "cut"), errors[name]  # numerics passed; maybe slower


def test_requires_grad_uses_torch_path(cache_path: Path) -> None:
    """Our kernels have no backward: with autograd on, the dispatcher serves torch's SDPA even
    when a Triton winner is stored, and gradients are torch's."""
    from tuner.cache import Store
    from tuner.core.device import fingerprint
    from tuner.measure.records import Winner
    from tuner.serving.dispatcher import Dispatcher

    key = sdpa_key(q_len=8, kv_len=8, kv_heads=4, dtype="f32", causal="top_left")
    fp = fingerprint(DEVICE)
    Store(cache_path).put_winners(
        [Winner(device_class=fp.device_class, key=str(key), source="triton_attention",
                params=SMALL_PREFILL, median_us=1.0, baseline_us=2.0, versions=fp.version_tag)]
    )  # fmt: skip
    d = Dispatcher(cache_path, mode="lookup")
    q, k, v = (t.requires_grad_() for t in make(key, "bhsd"))
    o = d.sdpa(q, k, v, causal=True)
    assert o.grad_fn is not None
    o.sum().backward()
    ref_q = q.detach().clone().requires_grad_()
    F.scaled_dot_product_attention(ref_q, k.detach(), v.detach(), is_causal=True).sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad)
    # without autograd the stored Triton winner serves the call
    with torch.no_grad():
        torch.testing.assert_close(d.sdpa(q, k, v, causal=True), o.detach(), rtol=1e-4, atol=1e-5)


def test_sources_registered() -> None:
    names = {s.name for s in registry.sources("sdpa")}
    assert {"torch_sdpa", "triton_attention", "triton_decode"} <= names


# --- the benchmark command -----------------------------------------------------------------------


def test_bench_problem_lists_follow_the_brief() -> None:
    pre = sdpa.prefill_problems()
    assert len(pre) == 32 and all(k.batch * k.q_len == 16384 for _, k in pre)
    assert {k.head_dim for _, k in pre} == {64, 128} and {k.kv_heads for _, k in pre} == {8, 32}
    assert {k.causal for _, k in pre} == {"none", "top_left"}
    dec = sdpa.decode_problems()
    assert all(k.kv_bytes <= sdpa.MAX_KV_BYTES for _, k in dec)
    assert {k.q_len for _, k in dec} == {1, 4} and len(dec) == 24
    assert all(k.causal == ("none" if k.q_len == 1 else "bottom_right") for _, k in dec)


def test_copy_targets_count_gpu_time_where_there_is_one() -> None:
    small = {"kv_bytes": 4 * 2**20, "pct_copy": 5.0}  # below 32 MB: not a target row
    host_bound = {"kv_bytes": 32 * 2**20, "pct_copy": 30.0, "winner_graph_pct_copy": 85.0}
    slow_anyway = {"kv_bytes": 32 * 2**20, "pct_copy": 25.0, "winner_graph_pct_copy": 55.0}
    big = {"kv_bytes": 2**31, "pct_copy": 104.0}  # no graph time: the eager figure counts
    got = sdpa.copy_targets([small, host_bound, slow_anyway, big])
    assert got["n_kv_ge_32MB"] == 3
    assert (got["n_kv_ge_32MB_at_80pct"], got["min_pct_copy_kv_ge_32MB"]) == (1, 25.0)
    assert (got["n_kv_ge_32MB_at_80pct_gpu"], got["min_pct_copy_kv_ge_32MB_gpu"]) == (2, 55.0)
    assert got["n_kv_ge_32MB_gpu_from_eager"] == 1


def test_bench_smoke(tmp_path: Path) -> None:
    """The whole path on tiny shapes: tune, side by side, annotate, JSON and PNG written."""
    suites = {
        "decode": [("tiny", sdpa_key(q_len=1, kv_len=40, causal="none"))],
    }
    res = sdpa.run(suites, tmp_path, TuneOptions(budget_s=0.005))
    data = json.loads((tmp_path / "sdpa_decode.json").read_text())
    assert (tmp_path / "sdpa_decode.png").stat().st_size > 0
    row = data["rows"][0]
    assert row["kv_gbs"] > 0 and row["pct_copy"] > 0 and "triton_us" in row
    summary = res["decode"]["summary"]
    assert summary["n"] == 1 and summary["n_kv_ge_32MB"] == 0  # a 40-token cache is small
    assert (
        summary["n_kv_ge_32MB_at_80pct_gpu"] == 0 and summary["min_pct_copy_kv_ge_32MB_gpu"] is None
    )
    key = sdpa_key(q_len=2, kv_len=40, causal="bottom_right")
    params = {"bn": 16, "splits": 2, "warps": 4, "stages": 1}
    assert sdpa.recheck(key, "triton_decode", params, DEVICE) <= samples.tolerance(key)


# --- GPU: bf16, the real shortlists, repeated (direct) launches ----------------------------------


def gpu_key(
    b: int, hq: int, hkv: int, q: int, kv: int, d: int, causal: str = "none", dt: str = "bf16"
):
    return SdpaKey(batch=b, q_heads=hq, kv_heads=hkv, q_len=q, kv_len=kv, head_dim=d,
                   causal=causal, dtype=dt)  # fmt: skip


GPU_CASES = [
    (ATTN, gpu_key(2, 32, 8, 1000, 1000, 128, "top_left")),
    (ATTN, gpu_key(1, 16, 16, 777, 1500, 64, "bottom_right")),
    (ATTN, gpu_key(1, 8, 2, 300, 300, 96, dt="f16")),
    (ATTN, gpu_key(1, 8, 8, 257, 513, 256, "top_left")),
    (DECODE, gpu_key(1, 32, 8, 1, 8192, 128)),
    (DECODE, gpu_key(8, 32, 8, 4, 5000, 128, "bottom_right")),
    (DECODE, gpu_key(3, 16, 16, 2, 3001, 64, dt="f16")),
    (DECODE, gpu_key(2, 8, 1, 1, 4097, 256)),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("src", "key"), GPU_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_gpu_shortlist(src, key: SdpaKey) -> None:
    """Every candidate of the real shortlist, contiguous and (b, s, h, d) inputs. Calls after the
    first take the direct-launch path, and the fused decode merge hands partials between
    programs: 20 repeats must agree bit for bit."""
    for layout in ("bhsd", "bshd"):
        inputs = make(key, layout)
        for params in src.candidates(key, "cuda"):
            runner = src.build(key, params)
            check(runner, key, inputs)
            again = runner(*inputs)
            for _ in range(20):
                torch.testing.assert_close(runner(*inputs), again, rtol=0, atol=0)
            check(runner, key, inputs)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("splits", "fused"), [(1, False), (16, False), (16, True), (128, False)])
def test_gpu_decode_with_programmatic_dependent_launch(splits: int, fused: bool) -> None:
    """pdl: each grid waits for the previous kernel's writes before reading. Back to back, eagerly
    and replayed in a CUDA graph, every call must see its own inputs and equal the eager result."""
    key = gpu_key(1, 32, 8, 1, 8192, 128)
    params = {"bn": 64, "splits": splits, "warps": 4, "stages": 2, "fused": fused, "pdl": True}
    runner = DECODE.build(key, params)
    sets = [make(key, "bhsd", seed=s) for s in range(3)]
    for inputs in sets:
        check(runner, key, inputs)
    eager = [runner(*inputs) for inputs in sets]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        runner(*sets[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        outs = [runner(*inputs) for inputs in sets]
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, eager, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(pdl_problem() is None, reason="PDL can run here")
def test_decode_pdl_is_refused_where_it_cannot_run() -> None:
    key = sdpa_key(q_len=1, kv_len=64)
    params = {"bn": 16, "splits": 2, "warps": 4, "stages": 1, "pdl": True}
    with pytest.raises(ValueError, match="pdl: "):
        DECODE.build(key, params)


@pytest.mark.gpu
@gpu
def test_gpu_precompile_then_run() -> None:
    """precompile() compiles what build() later launches (the engine's parallel compile)."""
    key = SdpaKey(
        batch=1, q_heads=32, kv_heads=8, q_len=4, kv_len=2048, head_dim=128, causal="bottom_right"
    )
    for src in (ATTN, DECODE):
        params = src.candidates(key, "cuda")[0]
        src.precompile(key, [params])
        check(src.build(key, params), key, make(key, "bhsd"))


LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


@pytest.mark.parametrize(
    ("source", "params", "kernels"),
    [
        (ATTN, SMALL_PREFILL, 1),
        (DECODE, {"bn": 16, "splits": 2, "warps": 4, "stages": 1}, 2),  # split, then merge
        (DECODE, {"bn": 16, "splits": 2, "warps": 4, "stages": 1, "fused": True}, 1),
        (DECODE, {"bn": 16, "splits": 1, "warps": 4, "stages": 1}, 1),
    ],
)
def test_precompile_jobs_bind_to_the_kernels(source, params, kernels: int) -> None:
    """What precompile hands to the compiler matches each kernel's signature, argument for
    argument (a job that does not bind would compile nothing the runner launches)."""
    key = sdpa_key(q_len=2, kv_len=40, causal="bottom_right")
    jobs = source.jobs(key, params)
    assert len(jobs) == kernels
    for job in jobs:
        consts = {k: v for k, v in job.kwargs.items() if k not in LAUNCH_OPTIONS}
        inspect.signature(job.fn.fn).bind(*job.args, **consts)


def test_precompile_is_harmless_in_the_interpreter() -> None:
    """The engine precompiles every shortlist; in the interpreter that compiles nothing, skips
    configs that do not build, and the candidates still run correctly afterwards."""
    key = sdpa_key(q_len=2, kv_len=40, causal="bottom_right")
    for src in (ATTN, DECODE):
        shortlist = src.candidates(key, DEVICE)
        assert src.precompile(key, [*shortlist, {"bn": 15, "bm": 15, "splits": 1, "warps": 3,
                                                 "stages": 1}]) is None  # fmt: skip
        for params in shortlist:
            assert check(src.build(key, params), key, make(key, "bhsd")) <= samples.tolerance(key)


@pytest.mark.parametrize(("direct", "kept"), [(0.0, True), (2.0, False)])
def test_attention_runners_check_the_direct_launch_once(
    direct: float, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first call's result stands; a direct launch that differs turns the direct path off."""
    from tuner.candidates.triton_attention import checked_runner

    monkeypatch.setattr("tuner.core.triton_launch.interpreting", lambda: False)

    class FakeLauncher:
        compiled, verified, disabled = True, False, False

        def __init__(self) -> None:
            self.trials: set[int] = set()

        def disable(self) -> None:
            self.disabled, self.verified = True, False

        @property
        def direct(self) -> bool:  # as ``Launcher.ready``: verified, or this thread's trial
            return self.verified or bool(self.trials)

    class FakeLaunch:
        launcher = FakeLauncher()

    launch = FakeLaunch()
    calls = []

    def run(q, k, v, out=None):
        calls.append(launch.launcher.direct)
        o = torch.empty_like(q) if out is None else out
        return o.copy_(q + (direct if launch.launcher.direct else 0.0))

    checked = checked_runner(run, [launch], "test")
    q = torch.ones(1, 2, 3, 4)
    assert torch.equal(checked(q, q, q), q)
    assert launch.launcher.verified is kept and launch.launcher.disabled is not kept
    checked(q, q, q)
    assert calls == [False, True, kept]  # JIT, the one check, then the path the check chose
