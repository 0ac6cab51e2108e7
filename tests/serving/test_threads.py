"""Serving from several threads at once, as a threaded server drives ``tuner.torch``: eight
threads call routed ``F.linear`` and SDPA on changing shapes while another reloads the
dispatcher, changes its bucket policy and reads its diagnostics."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tuner.torch as tt
from tuner.serving.dispatcher import Dispatcher

SECONDS = 3.0


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond, so that their steps interleave as finely as they can."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_calls_from_many_threads_beside_reloads_are_right_and_raise_nothing(
    tmp_path: Path, fast_switching: None
) -> None:
    disp = Dispatcher(tmp_path / "c.db", mode="record")
    weights = [torch.randn(n, 32) for n in (16, 24, 40)]
    stop = threading.Event()
    errors: list[str] = []
    wrong: list[str] = []
    calls = [0]

    def serve(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        i = 0
        while not stop.is_set():
            i += 1
            x, w = torch.randn(1 + i % 7, 32, generator=gen), weights[i % 3]
            q = torch.randn(1, 2, 1 + i % 5, 16, generator=gen)
            try:
                with torch.no_grad():
                    y = F.linear(x, w)
                    o = F.scaled_dot_product_attention(q, q, q)
            except Exception as e:
                errors.append(f"serve: {type(e).__name__}: {e}")
                continue
            if not torch.allclose(y, torch.ops.aten.mm(x, w.t()), atol=1e-5):
                wrong.append(f"linear {tuple(x.shape)} x {tuple(w.shape)}")
            mm = torch.ops.aten.matmul  # torch's own, not routed
            ref = mm(torch.softmax(mm(q, q.transpose(-1, -2)) / 4.0, dim=-1), q)  # head dim 16
            if not torch.allclose(o, ref, atol=1e-5):
                wrong.append(f"sdpa {tuple(q.shape)}")
            calls[0] += 1

    def administer() -> None:
        while not stop.is_set():
            try:
                disp.reload()
                for _ in range(20):  # read while the serving threads resolve anew
                    assert isinstance(disp.choices, dict)
                tt.stats(disp).table()
                disp.set_buckets("pow2")
                disp.set_buckets("exact")
            except Exception as e:
                errors.append(f"admin: {type(e).__name__}: {e}")

    with tt.enabled(dispatcher=disp):
        threads = [threading.Thread(target=serve, args=(s,)) for s in range(8)]
        threads.append(threading.Thread(target=administer))
        for t in threads:
            t.start()
        time.sleep(SECONDS)
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors[:5]
    assert not wrong, wrong[:5]
    assert calls[0] > 100, "the threads served too few calls to have interleaved"
