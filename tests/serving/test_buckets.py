"""tuner.serving.buckets: an untuned M borrows a tuned neighbour's winner, per policy, through the
drop-in; its own miss is still recorded for offline tuning."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dropin_support import linear_inputs, served

import tuner.torch as tt
from tuner.cache import Store
from tuner.candidates import registry
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey
from tuner.serving.buckets import BucketIndex, next_pow2
from tuner.serving.dispatcher import Dispatcher


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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


@pytest.mark.cpu_host
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


def test_a_low_bit_key_is_never_a_dense_keys_neighbour() -> None:
    from tuner.core.keys import lowbit_fields
    from tuner.serving.buckets import family

    dense = GemmKey(m=16, n=4096, k=4096, layout="nt")
    int4 = GemmKey(m=16, n=4096, k=4096, **lowbit_fields("int4-g128"))
    assert family(dense) != family(int4)
    assert family(int4) == family(replace(int4, m=64))  # only M may differ
