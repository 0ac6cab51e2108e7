"""The dispatcher: modes, fallbacks, and a new process serving a stored winner."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import tuner.torch
from tests.cache.damaged import damaged_cache
from tests.cache.full_disk import file_size_limit
from tests.cache.read_only import read_only
from tuner.cache import Store
from tuner.core.device import fingerprint
from tuner.core.keys import GemmKey, SdpaKey
from tuner.measure.records import Winner
from tuner.serving.dispatcher import RESOLUTION_KINDS, Dispatcher, Resolution

TRITON_PARAMS = {"bm": 32, "bn": 32, "bk": 32, "group_m": 8, "warps": 4, "stages": 1}


def store_triton_winner(cache_path, key: GemmKey) -> None:
    """A Triton GEMM winner for ``key`` (on the CPU torch wins every tuning: planted)."""
    Store(cache_path).put_winners(
        [Winner(fingerprint().device_class, str(key), "triton_gemm", TRITON_PARAMS, 1.0, 2.0)]
    )


def test_off_mode_never_opens_the_store(tmp_path):
    d = Dispatcher(tmp_path / "never.db", mode="off")
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    torch.testing.assert_close(d.matmul(a, b), a @ b)
    assert tuner.warmup(dispatcher=d, progress=False).winners == 0
    assert not (tmp_path / "never.db").exists()


@pytest.mark.cpu_host
def test_lookup_mode_makes_no_cache_at_a_mistyped_path_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "typo" / "c.db"
    d = Dispatcher(path, mode="lookup")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(2):
        torch.testing.assert_close(d.matmul(a, b), a @ b)
        torch.testing.assert_close(d.matmul(a, b[:, :3]), a @ b[:, :3])
    assert not path.parent.exists()
    said = [r for r in caplog.records if "does not exist: serving baselines only" in r.message]
    assert len(said) == 1
    d.set_mode("record")  # a mode that writes makes the cache as before, and says so
    with caplog.at_level(logging.INFO, logger="tuner.serving.dispatcher"):
        d.matmul(a, b)
    assert path.exists()
    assert f"made a new tuner cache at {path} (TUNER_MODE=record)" in caplog.text


def test_lookup_mode_leaves_an_empty_file_as_it_is(tmp_path, caplog):
    """An empty file (``touch``) holds no cache: lookup mode does not make one in it."""
    path = tmp_path / "empty.db"
    path.touch()
    d = Dispatcher(path, mode="lookup")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(d.matmul(a, b), a @ b)
    assert tuner.warmup(dispatcher=d, progress=False).winners == 0
    assert path.read_bytes() == b""
    assert "is an empty file: serving baselines only" in caplog.text


@pytest.mark.cpu_host
def test_record_mode_records_each_missed_key_once(cache_path):
    d = Dispatcher(cache_path, mode="record")
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    for _ in range(3):
        d.matmul(a, b)
    d.matmul(torch.randn(9, 4), b)
    misses = Store(cache_path).misses()
    assert sorted(m["key"].split(",")[0] for m in misses) == ["gemm:m=8", "gemm:m=9"]
    assert all(m["count"] == 1 for m in misses)


@pytest.mark.cpu_host
def test_a_damaged_cache_is_left_alone_and_the_call_still_served(tmp_path, caplog):
    before = damaged_cache(tmp_path / "c.db")
    d = Dispatcher(tmp_path / "c.db", mode="record")
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    torch.testing.assert_close(d.matmul(a, b), a @ b)  # its miss finds the damage
    c = torch.randn(9, 4)
    torch.testing.assert_close(d.matmul(c, b), c @ b)  # another miss: the cache is left alone
    assert "tuner cache unusable" in caplog.text and "is corrupt" in caplog.text
    assert (tmp_path / "c.db").read_bytes() == before


@pytest.mark.cpu_host
def test_a_cache_whose_winners_are_damaged_is_left_alone_and_the_call_still_served(
    tmp_path, caplog
):
    """The file opens fine; only reading this device's winners meets the damaged pages: the
    call is served by the baseline, as where the file cannot be opened at all."""
    before = damaged_cache(tmp_path / "c.db", winners_of=fingerprint().device_class)
    d = Dispatcher(tmp_path / "c.db", mode="lookup")
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    for _ in range(2):  # the second call does not read the cache again
        torch.testing.assert_close(d.matmul(a, b), a @ b)
    refused = [r for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(refused) == 1 and "tuner cache unusable" in refused[0].getMessage()
    assert (tmp_path / "c.db").read_bytes() == before


@pytest.mark.cpu_host
def test_a_read_only_cache_is_served_without_recording_and_logged_once(tmp_path, caplog):
    path = tmp_path / "c.db"
    Store(path).close()
    with read_only(path) as before:
        d = Dispatcher(path, mode="record")
        b = torch.randn(4, 3)
        for m in (8, 9):  # two misses: the first finds the cache read-only, the second skips it
            a = torch.randn(m, 4)
            torch.testing.assert_close(d.matmul(a, b), a @ b)
        refused = [r for r in caplog.records if f"{path} is read-only" in r.getMessage()]
        assert len(refused) == 1
        assert path.read_bytes() == before


@pytest.mark.cpu_host
def test_a_cache_on_a_full_disk_is_served_without_recording_and_logged_once(tmp_path, caplog):
    """Record mode while the disk fills: the call whose miss cannot be written is served all
    the same (``tuner.matmul`` never fails where ``torch.matmul`` works), the cache is no
    longer written, and the misses recorded before stand."""
    path = tmp_path / "c.db"
    Store(path).close()
    d = Dispatcher(path, mode="record")
    b = torch.randn(4, 3)
    with file_size_limit(48 * 1024):  # the -shm's 32 KiB fit, a few WAL frames more do not
        for m in range(1, 40):
            a = torch.randn(m, 4)
            torch.testing.assert_close(d.matmul(a, b), a @ b)
    refused = [r for r in caplog.records if f"{path} could not be written" in r.getMessage()]
    assert len(refused) == 1
    with Store(path) as store:
        store.verify()
        assert 0 < len(store.misses()) < 39


@pytest.mark.cpu_host
def test_tune_mode_tunes_once_then_serves(cache_path):
    d = Dispatcher(cache_path, mode="tune")
    a, b = torch.randn(16, 32, dtype=torch.float16), torch.randn(32, 8, dtype=torch.float16)
    torch.testing.assert_close(d.matmul(a, b), a @ b)
    key = str(GemmKey.from_tensors(a, b))
    assert Store(cache_path).winner(fingerprint().device_class, key) is not None
    assert key in d.choices


def test_untunable_calls_go_to_torch_including_its_errors(tmp_path):
    d = Dispatcher(tmp_path / "c.db", mode="lookup")
    v = torch.randn(4)
    m = torch.randn(3, 4)
    torch.testing.assert_close(d.matmul(m, v), m @ v)  # 1-D: not a GEMM key, torch handles it
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(
        d.matmul(x, torch.randn(4, 5)).shape, torch.Size([2, 3, 5])
    )  # broadcast
    with pytest.raises(RuntimeError):  # torch's own error for a real mistake
        d.matmul(torch.randn(3, 4), torch.randn(5, 6))


def test_sdpa_matches_torch_for_gqa_and_both_causal_alignments(tmp_path):
    d = Dispatcher(tmp_path / "c.db", mode="lookup")
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(d.sdpa(q, k, v, causal=True, enable_gqa=True), expected)
    from torch.nn.attention.bias import causal_lower_right

    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(5, 9), enable_gqa=True
    )
    torch.testing.assert_close(d.sdpa(q, k, v, causal="bottom_right", enable_gqa=True), expected)
    # outside what the tuner keys (3-D inputs): torch's path, bottom-right still bottom-right
    q3, k3, v3 = q[0, :2], k[0], v[0]
    expected = F.scaled_dot_product_attention(q3, k3, v3, attn_mask=causal_lower_right(5, 9))
    torch.testing.assert_close(d.sdpa(q3, k3, v3, causal="bottom_right"), expected)
    with pytest.raises(ValueError, match="causal must be a bool or one of 'none', 'top_left'"):
        d.sdpa(q, k, v, causal="sideways", enable_gqa=True)
    torch.testing.assert_close(
        d.sdpa(q, k, v, causal="none", enable_gqa=True),
        d.sdpa(q, k, v, causal=False, enable_gqa=True),
    )
    # scale=0.0 is uniform attention, not the default scale a key's 0.0 stands for
    uniform = F.scaled_dot_product_attention(q, k, v, scale=0.0, enable_gqa=True)
    torch.testing.assert_close(d.sdpa(q, k, v, scale=0.0, enable_gqa=True), uniform)
    assert SdpaKey.from_tensors(q, k, v) != SdpaKey.from_tensors(q, k, v, scale=0.5)
    with pytest.raises(ValueError, match=r"^scale=0\.0: uniform attention"):
        SdpaKey.from_tensors(q, k, v, scale=0.0)


@pytest.mark.cpu_host
def test_a_winner_that_no_longer_builds_is_served_by_torch_and_counted_apart_from_misses(
    cache_path, caplog
):
    """Winners stored with params their candidate no longer takes (Triton tiles missing): torch
    serves those calls, stats() counts them as build failures, not as misses (a user would
    retune a miss; retuning would not mend these), and the log names each key once, with why."""
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    q = k = v = torch.randn(1, 2, 16, 16)
    gemm, sdpa = GemmKey.from_tensors(a, b), SdpaKey.from_tensors(q, k, v)
    dc = fingerprint().device_class
    Store(cache_path).put_winners(
        [
            Winner(dc, str(gemm), "triton_gemm", {"bm": 32}, 1.0, 2.0),
            Winner(dc, str(sdpa), "triton_attention", {"bm": 32}, 1.0, 2.0),
        ]
    )
    d = Dispatcher(cache_path, mode="lookup")
    d.set_counting(True)
    untuned = torch.randn(8, 4)
    with caplog.at_level(logging.WARNING, logger="tuner"):
        for _ in range(2):
            torch.testing.assert_close(d.matmul(a, b), a @ b)
            torch.testing.assert_close(d.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v))
            torch.testing.assert_close(d.matmul(a, untuned), a @ untuned)
            d.set_mode("lookup")  # the runners dropped: each resolved again, the failure kept
    stats = tuner.torch.stats(d)
    assert (stats.build_failures, stats.misses, stats.hits) == (4, 2, 0)
    assert stats.to_dict()["build_failures"] == 4
    assert "2 misses, 4 build failures" in stats.table()
    assert d.choices[str(gemm)].startswith("failed: triton_gemm:")  # torch serves, not it
    said = [r.getMessage() for r in caplog.records if "no longer builds" in r.getMessage()]
    assert len(said) == 2
    assert str(gemm) in said[0] and "triton_gemm" in said[0] and "param 'bn'" in said[0]
    assert str(sdpa) in said[1] and "triton_attention" in said[1] and "'bn'" in said[1]


NEW_PROCESS = """
import json, torch, tuner
from tuner.serving.dispatcher import get_dispatcher
torch.manual_seed(0)
a, b = torch.randn({m}, {k}, dtype=torch.float16), torch.randn({k}, {n}, dtype=torch.float16)
c = tuner.matmul(a, b)
err = ((c.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm()).item()
print(json.dumps({{"choices": get_dispatcher().choices, "err": err}}))
"""


def test_the_stats_header_counts_every_call_once_whatever_its_kind():
    rows = tuple(
        Resolution(f"key{i}", kind, "torch", calls=i + 1) for i, kind in enumerate(RESOLUTION_KINDS)
    )
    stats = tuner.torch.Stats(rows)
    counts = stats.to_dict()
    parts = ("hits", "bucketed", "misses", "build_failures", "loading", "passthrough")
    assert sum(counts[p] for p in parts) == stats.calls == sum(range(1, len(rows) + 1))
    head = stats.table().splitlines()[0]
    numbers = [int(n) for n in re.findall(r"(\d+) (?:hits|bucketed|misses|build|while|left)", head)]
    assert sum(numbers) == stats.calls


def dispatch_in_new_process(cache_path, m, n, k) -> dict:
    env = os.environ | {
        "TUNER_CACHE": str(cache_path),
        "TUNER_MODE": "lookup",
        "TRITON_INTERPRET": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", NEW_PROCESS.format(m=m, n=n, k=k)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.cpu_host
def test_whole_path_tune_store_then_new_process_dispatches(cache_path):
    env = os.environ | {"TUNER_CACHE": str(cache_path), "TRITON_INTERPRET": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner",
            "tune",
            "gemm",
            "-m",
            "24",
            "-n",
            "40",
            "-k",
            "32",
            "--dtype",
            "f16",
            "--budget",
            "0.02",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    stored = Store(cache_path).winners()
    assert len(stored) == 1
    got = dispatch_in_new_process(cache_path, 24, 40, 32)
    assert got["choices"] == {stored[0].key: stored[0].candidate}
    assert got["err"] < 5e-3


@pytest.mark.cpu_host
def test_new_process_serves_a_triton_winner_from_the_store(cache_path):
    """A winner imported from elsewhere (here: written directly) is rebuilt and used."""
    key = GemmKey(m=33, n=20, k=48, dtype="f16", out_dtype="f16", align=8)
    store_triton_winner(cache_path, key)
    got = dispatch_in_new_process(cache_path, 33, 20, 48)
    assert list(got["choices"].values()) == [
        'triton_gemm:{"bk":32,"bm":32,"bn":32,"group_m":8,"stages":1,"warps":4}'
    ]
    assert got["err"] < 5e-3


def test_dlpack_arrays_go_through_zero_copy_and_come_back_as_their_type(cache_path):
    """CuPy arrays take this path on the GPU; numpy arrays exercise the same code on the CPU."""
    import numpy as np

    import tuner

    a = np.random.rand(6, 5).astype(np.float32)
    b = np.random.rand(5, 4).astype(np.float32)
    c = tuner.matmul(a, b)
    assert isinstance(c, np.ndarray)
    np.testing.assert_allclose(c, a @ b, rtol=1e-5)
    out = np.full((6, 4), np.nan, dtype=np.float32)
    assert tuner.matmul(a, b, out=out) is out
    np.testing.assert_allclose(out, a @ b, rtol=1e-5)


def test_a_dlpack_array_beside_another_operand_is_refused_naming_both(tmp_path, monkeypatch):
    """``matmul(array, tensor)``, ``matmul(tensor, array)`` and an array beside a list are
    refused alike, naming both types, as ``sdpa`` refuses a mix."""
    import numpy as np

    from tuner.serving import dispatcher as dispatch_module

    monkeypatch.setattr(dispatch_module, "_dispatcher", Dispatcher(tmp_path / "c.db"))
    a, t = np.ones((2, 2), np.float32), torch.ones(2, 2)
    for x, y, got in ((a, t, "a: ndarray, b: Tensor"), (t, a, "a: Tensor, b: ndarray"),
                      (a, [[1.0]], "a: ndarray, b: list")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"^matmul\(\): a and b must be .*, got {got}$"):
            dispatch_module.matmul(x, y)


@pytest.mark.cpu_host
def test_stale_winners_are_served_or_ignored_per_policy(cache_path, monkeypatch):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    key = str(GemmKey.from_tensors(a, b))
    old = Winner(
        fingerprint().device_class,
        key,
        "triton_gemm",
        TRITON_PARAMS,
        1.0,
        2.0,
        versions="torch=1.0",
    )
    Store(cache_path).put_winners([old])
    served = Dispatcher(cache_path, mode="lookup")
    served.matmul(a, b)
    assert served.choices[key].startswith("triton_gemm")
    monkeypatch.setenv("TUNER_STALE", "ignore")
    ignored = Dispatcher(cache_path, mode="record")
    torch.testing.assert_close(ignored.matmul(a, b), a @ b)
    assert ignored.choices[key] == "torch"
    assert [m["key"] for m in Store(cache_path).misses()] == [key]
    monkeypatch.setenv("TUNER_STALE", "maybe")
    with pytest.raises(ValueError, match="TUNER_STALE must be one of"):
        Dispatcher(cache_path)


@pytest.mark.cpu_host
def test_an_out_torch_would_resize_or_refuse_is_torchs_when_a_tuned_kernel_serves(
    cache_path, monkeypatch
):
    """A tuned runner writes ``out`` only when it is the product's shape, dtype and device; any
    other ``out`` gets what ``torch.matmul`` does with it (resized with a warning, or refused)."""
    from tuner.serving import dispatcher as dispatch_module

    key = GemmKey(m=33, n=20, k=48, dtype="f16", out_dtype="f16", align=8)
    store_triton_winner(cache_path, key)
    disp = Dispatcher(cache_path)
    monkeypatch.setattr(dispatch_module, "_dispatcher", disp)
    torch.manual_seed(0)
    a, b = torch.randn(33, 48).half(), torch.randn(48, 20).half()
    want = torch.matmul(a, b)

    out = torch.full((33, 20), float("nan"), dtype=torch.float16)
    assert dispatch_module.matmul(a, b, out=out) is out
    torch.testing.assert_close(out, want, rtol=5e-3, atol=5e-3)
    assert [r.candidate.split(":")[0] for r in disp.resolutions.values()] == ["triton_gemm"]

    with pytest.warns(UserWarning, match="resized"):
        got = dispatch_module.matmul(a, b, out=torch.zeros(40, 40, dtype=torch.float16))
    assert got.shape == (33, 20)
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
    with pytest.raises(RuntimeError, match="dtype"):
        dispatch_module.matmul(a, b, out=torch.empty(33, 20))
    with pytest.warns(UserWarning, match="resized"):
        batched = dispatch_module.matmul(torch.stack([a, a]), b, out=torch.zeros_like(out))
    assert batched.shape == (2, 33, 20)


@pytest.mark.cpu_host
def test_a_call_mixing_dtypes_after_a_tuned_one_gets_torchs_error(cache_path, monkeypatch):
    """The signature a call is looked up by holds each operand's dtype and device: k and v in
    f32 beside an f16 q, once the all-f16 call is served by a tuned kernel, get torch's error
    (not that kernel reading f32 bytes as f16); b on another device gets torch's answer."""
    from tuner.serving import dispatcher as dispatch_module

    sdpa = SdpaKey(1, 4, 2, 8, 8, 16, causal="top_left", dtype="f16", scale=0.25)
    gemm = GemmKey(m=8, n=16, k=32, dtype="f16", out_dtype="f16", align=16)
    tiles = {"bm": 16, "bn": 16, "warps": 4, "stages": 1}
    dc = fingerprint().device_class
    Store(cache_path).put_winners(
        [
            Winner(dc, str(sdpa), "triton_attention", tiles, 1.0, 2.0),
            Winner(dc, str(gemm), "triton_gemm", TRITON_PARAMS, 1.0, 2.0),
        ]
    )
    disp = Dispatcher(cache_path)
    monkeypatch.setattr(dispatch_module, "_dispatcher", disp)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 8, 16).half()
    k, v = torch.randn(1, 2, 8, 16).half(), torch.randn(1, 2, 8, 16).half()
    dispatch_module.sdpa(q, k, v, causal=True, scale=0.25, enable_gqa=True)
    assert [r.candidate.split(":")[0] for r in disp.resolutions.values()] == ["triton_attention"]
    with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same"):
        dispatch_module.sdpa(q, k.float(), v.float(), causal=True, scale=0.25, enable_gqa=True)
    a, b = torch.randn(8, 32).half(), torch.randn(32, 16).half()
    dispatch_module.matmul(a, b)
    _, res = disp.resolve_gemm(a, b.to("meta"))
    assert (res.kind, res.candidate) == ("untunable", "torch")
    assert "device mismatch: a is on cpu and b on meta" in res.key


@pytest.mark.cpu_host
def test_heads_that_differ_are_grouped_query_only_as_torch_takes_them(cache_path, monkeypatch):
    """Without ``enable_gqa`` torch's SDPA refuses q, k and v whose head counts differ (or
    broadcasts a single kv head), and with it refuses kv heads that do not divide q's. Each
    such call, direct or through the drop-in, ends as torch's would (its result or its error),
    though a tuned grouped-query kernel is stored for the same shapes."""
    from tuner.serving import dispatcher as dispatch_module

    key = SdpaKey(1, 4, 2, 8, 8, 16, causal="top_left", dtype="f16", scale=0.25)
    tiles = {"bm": 16, "bn": 16, "warps": 4, "stages": 1}
    winner = Winner(fingerprint().device_class, str(key), "triton_attention", tiles, 1.0, 2.0)
    Store(cache_path).put_winners([winner])
    disp = Dispatcher(cache_path)
    monkeypatch.setattr(dispatch_module, "_dispatcher", disp)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 8, 16).half()
    kv1, kv2, kv3, kv4 = (torch.randn(1, n, 8, 16).half() for n in (1, 2, 3, 4))

    def outcome(sdpa, k, v, gqa):
        try:
            return sdpa(q, k, v, is_causal=True, scale=0.25, enable_gqa=gqa)
        except (RuntimeError, TypeError) as e:
            return type(e), str(e)

    def direct(q, k, v, is_causal, scale, enable_gqa):
        return tuner.sdpa(q, k, v, causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    sdpa = F.scaled_dot_product_attention  # torch's own: bound before any enable()
    cases = [(kv2, kv2, True), (kv2, kv2, False), (kv3, kv3, True), (kv4, kv2, False),
             (kv1, kv1, False), (kv2, kv2, 1)]  # fmt: skip
    for i, (k, v, gqa) in enumerate(cases):
        want = outcome(sdpa, k, v, gqa)
        got = [outcome(direct, k, v, gqa)]
        if isinstance(gqa, bool):  # (the drop-in's memo takes 1 for True, as it does is_causal)
            with tuner.torch.enabled(dispatcher=disp):
                got.append(outcome(F.scaled_dot_product_attention, k, v, gqa))
        for g in got:
            if isinstance(want, tuple):
                assert g == want, f"case {i}"
            else:
                torch.testing.assert_close(g, want, rtol=1e-2, atol=1e-2, msg=f"case {i}")
        assert i != 0 or [r.kind for r in disp.resolutions.values()] == ["hit"]  # the kernel's


def test_a_tensor_scale_is_torchs_and_remembers_nothing(tmp_path, monkeypatch):
    """torch takes a 0-d tensor as SDPA's scale. Such calls go to torch unremembered: a
    signature holding the tensor would be a new one at every call."""
    from tuner.serving import dispatcher as dispatch_module

    disp = Dispatcher(tmp_path / "c.db")
    monkeypatch.setattr(dispatch_module, "_dispatcher", disp)
    q = torch.randn(1, 2, 8, 16)
    for _ in range(5):
        got = dispatch_module.sdpa(q, q, q, scale=torch.tensor(0.25))
    want = F.scaled_dot_product_attention(q, q, q, scale=0.25)
    torch.testing.assert_close(got, want)
    with tuner.torch.enabled():  # the drop-in's memo of calls as made, too
        for _ in range(5):
            got = F.scaled_dot_product_attention(q, q, q, scale=torch.tensor(0.25))
    torch.testing.assert_close(got, want)
    assert not disp._hot and not disp.resolutions and not disp.memo


def test_operands_torch_refuses_or_serves_itself_get_torchs_answer(tmp_path, monkeypatch):
    """Not two arrays: torch's TypeError naming the argument; a sparse operand (no strides or
    storage to key on): torch's product."""
    from tuner.serving import dispatcher as dispatch_module

    monkeypatch.setattr(dispatch_module, "_dispatcher", Dispatcher(tmp_path / "c.db"))
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(
        TypeError, match=r"argument 'input' \(position 1\) must be Tensor, not list"
    ):
        dispatch_module.matmul([[1.0]], b)
    with pytest.raises(
        TypeError, match=r"argument 'other' \(position 2\) must be Tensor, not NoneType"
    ):
        dispatch_module.matmul(a, None)
    for sparse in (a.to_sparse(), a.to_sparse_coo().to_sparse_csr()):
        torch.testing.assert_close(dispatch_module.matmul(sparse, b), a @ b)


def test_sdpa_names_the_argument_it_cannot_take(tmp_path, monkeypatch):
    from tuner.serving import dispatcher as dispatch_module

    monkeypatch.setattr(dispatch_module, "_dispatcher", Dispatcher(tmp_path / "c.db"))
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(
        TypeError, match=r"^sdpa\(\): q, k and v must be torch tensors .*q: NoneType"
    ):
        dispatch_module.sdpa(None, q, q)
    for causal in ([1], 1, None):  # another type: a TypeError, as torch's is_causal gives
        got = re.escape(repr(causal))
        with pytest.raises(TypeError, match=rf"^causal must be a bool or one of .*, got {got}$"):
            dispatch_module.sdpa(q, q, q, causal=causal)
    with pytest.raises(TypeError, match=r"^scale must be a number or None, got \[1\]$"):
        dispatch_module.sdpa(q, q, q, scale=[1])
    mask = torch.ones(4, 4, dtype=torch.bool)  # in torch's SDPA, the fourth argument is a mask
    with pytest.raises(TypeError, match=r"got a tensor of shape \(4, 4\) \(for a mask, call "):
        dispatch_module.sdpa(q, q, q, mask)


def test_a_causal_refused_alone_is_refused_after_the_bool_it_equals(tmp_path):
    """``causal=1`` is refused (torch's ``is_causal`` takes a bool), also after a ``causal=True``
    call of the same shapes: ``1 == True``, so a memo's key could take one for the other."""
    disp = Dispatcher(tmp_path / "c.db")
    q = torch.randn(1, 2, 4, 8)
    for causal, like in ((1, True), (0.0, False)):
        torch.testing.assert_close(
            disp.sdpa(q, q, q, causal=like),
            F.scaled_dot_product_attention(q, q, q, is_causal=like),
        )
        got = re.escape(repr(causal))
        with pytest.raises(TypeError, match=rf"^causal must be a bool or one of .*, got {got}$"):
            disp.sdpa(q, q, q, causal=causal)


@pytest.mark.cpu_host
def test_a_triton_winner_on_the_cpu_serves_calls_from_several_threads(cache_path, monkeypatch):
    """Triton's interpreter keeps a launch's grid in globals: interpreted calls take turns."""
    import threading

    from tuner.serving import dispatcher as dispatch_module

    key = GemmKey(m=33, n=20, k=48, dtype="f16", out_dtype="f16", align=8)
    store_triton_winner(cache_path, key)
    monkeypatch.setattr(dispatch_module, "_dispatcher", Dispatcher(cache_path))
    torch.manual_seed(0)
    a, b = torch.randn(33, 48).half(), torch.randn(48, 20).half()
    want = a.float() @ b.float()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def calls() -> None:
        start.wait()
        try:
            for _ in range(5):
                got = dispatch_module.matmul(a, b)
                torch.testing.assert_close(got.float(), want, rtol=5e-3, atol=5e-2)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=calls) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert next(iter(dispatch_module._dispatcher.choices.values())).startswith("triton_gemm")


@pytest.mark.cpu_host
def test_tune_mode_on_the_cpu_takes_turns_with_calls_served_meanwhile(cache_path):
    """A tuning's Triton candidates run in the interpreter too: while one thread tunes a miss,
    another thread's tuned calls are served, and neither breaks the other's runs (an
    interpreted call outside its turn raised InterpreterError in the served call, and failed the
    candidates' runs, stored as failed measurements)."""
    import threading

    key = GemmKey(m=16, n=24, k=16, dtype="f32", out_dtype="f32")
    store_triton_winner(cache_path, key)
    d = Dispatcher(cache_path, mode="tune")
    a, b = torch.randn(16, 16), torch.randn(16, 24)
    d.matmul(a, b)  # resolved: the Triton winner serves the thread below
    errors: list[BaseException] = []
    done = threading.Event()

    def serve() -> None:
        try:
            while not done.is_set():
                torch.testing.assert_close(d.matmul(a, b), a @ b)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=serve) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for m in (3, 5, 7, 9):
            x, y = torch.randn(m, 16), torch.randn(16, 20)
            torch.testing.assert_close(d.matmul(x, y), x @ y)  # a miss: tuned now
    finally:
        done.set()
        for thread in threads:
            thread.join(120)
    assert errors == []
    failed = [
        m.error for m in Store(cache_path).measurements() if m.source == "triton_gemm"
        and m.status == "failed"
    ]  # fmt: skip
    assert failed == []


@pytest.mark.cpu_host
def test_a_forked_child_serves_though_another_thread_held_the_dispatchers_locks(cache_path):
    """A DataLoader worker forked while another thread of the parent was inside the tuner (a
    call served in Triton's interpreter, a resolution tuning a miss) inherits those locks held
    by a thread it does not have, and would wait for them forever. It serves, and records its
    misses through a connection of its own."""
    import signal
    import threading

    from tuner.serving import dispatcher as dispatch_module

    key = GemmKey(m=16, n=24, k=16, dtype="f32", out_dtype="f32")
    store_triton_winner(cache_path, key)
    d = Dispatcher(cache_path, mode="record")
    a, b, x = torch.randn(16, 16), torch.randn(16, 24), torch.randn(5, 16)
    d.matmul(a, b)  # the parent served before: its cache is open
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with d._lock, dispatch_module._INTERPRETER:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(60)
    pid = os.fork()
    if pid == 0:  # the child: always leaves by os._exit, its status the verdict
        code = 1
        try:
            signal.alarm(30)  # a child that waits forever ends there
            torch.set_num_threads(1)  # as a DataLoader worker (OpenMP does not survive a fork)
            hit, miss = d.matmul(a, b), d.matmul(x, b)
            code = 0 if torch.allclose(hit, a @ b) and torch.allclose(miss, x @ b) else 2
        finally:
            os._exit(code)
    release.set()
    thread.join(60)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    with Store(cache_path) as store:
        assert str(GemmKey.from_tensors(x, b)) in {m["key"] for m in store.misses()}
        assert store.db.conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


@pytest.mark.cpu_host
def test_meta_tensors_are_torchs_though_the_cpu_problem_has_a_triton_winner(cache_path):
    """Meta tensors (a model made on the meta device for shape inference) keyed like the CPU's
    reached the CPU's Triton winner, which cannot read them: torch's meta kernel answers."""
    key = GemmKey(m=16, n=24, k=16, dtype="f32", out_dtype="f32")
    store_triton_winner(cache_path, key)
    d = Dispatcher(cache_path, mode="record")
    a, b = torch.randn(16, 16), torch.randn(16, 24)
    torch.testing.assert_close(d.matmul(a, b), a @ b)  # the Triton winner serves the CPU's
    assert d.choices[str(key)].startswith("triton_gemm")
    got = d.matmul(a.to("meta"), b.to("meta"))
    assert got.is_meta and got.shape == (16, 24)
    q = torch.randn(1, 2, 8, 16, device="meta")
    assert d.sdpa(q, q, q, causal=True).shape == q.shape
    assert str(key) not in {m["key"] for m in Store(cache_path).misses()}  # no CPU miss either


@pytest.mark.cpu_host
def test_a_call_needing_a_gradient_is_torchs_and_said_once_per_op(tmp_path, caplog):
    """Tuned kernels have no backward, so a model run without no_grad gets none of them: a
    warning says so once per op, on resolution, not left to stats(); under no_grad nothing is
    said."""
    d = Dispatcher(tmp_path / "c.db", mode="record")
    a, b = torch.randn(8, 16, requires_grad=True), torch.randn(16, 24)
    with torch.no_grad():
        d.matmul(a, b)
    assert not caplog.records
    for m in (8, 8, 4):
        y = d.matmul(a[:m], b)
        assert y.requires_grad  # torch's op, differentiable
    q = k = v = torch.randn(1, 2, 4, 8, requires_grad=True)
    d.sdpa(q, k, v)
    said = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(" ")[0].split(":")[0] for r in said] == ["gemm", "sdpa"]
    assert "torch.inference_mode() or torch.no_grad()" in said[0].getMessage()
    kinds = sorted(r.kind for r in d.resolutions.values())
    assert kinds == ["default", "default", "default", "miss"]  # (the miss: the no_grad call)
    with Store(tmp_path / "c.db") as store:
        assert len(store.misses()) == 1  # the no_grad call's; a gradient's is not a miss


def test_off_mode_says_nothing_of_gradients(tmp_path, caplog):
    d = Dispatcher(tmp_path / "c.db", mode="off")
    d.matmul(torch.randn(8, 16, requires_grad=True), torch.randn(16, 24))
    assert not caplog.records


def test_two_threads_first_calls_at_once_make_one_process_dispatcher(
    cache_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's dispatcher is made once, though two threads ask for it at once: each making
    its own would leave one orphaned (its resolutions, stats and fleet sync lost)."""
    from tuner.serving import dispatcher as module

    made: list[Dispatcher] = []

    class Counted(Dispatcher):
        def __init__(self) -> None:
            made.append(self)
            super().__init__()

    entered, release = threading.Event(), threading.Event()
    read_config = module.load_config_file

    def slow_config() -> None:  # the first thread is still making it when the second asks
        entered.set()
        release.wait(10)
        read_config()

    monkeypatch.setattr(module, "_dispatcher", None)
    monkeypatch.setattr(module, "Dispatcher", Counted)
    monkeypatch.setattr(module, "load_config_file", slow_config)
    got: list[Dispatcher] = []
    first = threading.Thread(target=lambda: got.append(module.get_dispatcher()))
    second = threading.Thread(target=lambda: got.append(module.get_dispatcher()))
    first.start()
    assert entered.wait(10)
    second.start()
    second.join(0.5)  # it waits for the first (without the lock it would make its own)
    release.set()
    first.join(10)
    second.join(10)
    assert len(made) == 1 and got == [made[0], made[0]]
