"""What the INT4 kernels' own weight layouts cost: the time to make each from torch's packed
weight (once per weight, at a runner's first call) and the memory it keeps, per projection of the
low-bit suite, beside torch's own packing of the same weight.

    python -m bench.int4_layouts --out $OUT/int4_layouts.json [--shape NAME N K ...] [--reps 3]

Per weight: torch's packing (``_convert_weight_to_int4pack``, what a user pays to get the weight
torch's INT4 op takes), our tile-major layout from torch's packed weight (``int4.from_torch_
int4pack``: Triton W4A16, the CUDA GEMV and dequant_gemm read it), CUTLASS W4A16's A operand from
ours (``cutlass_w4a16.to_cutlass``), that operand reordered as CUTLASS's shortlisted kernels read
it (``cutlass_w4a16.reorder``), and its split scales and zeros. Each is timed ``--reps``
times on fresh inputs (median, synchronized), with the peak of memory allocated while it ran
beyond what was allocated before; each result is checked against the nibbles it was made from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tuner.candidates import cutlass_w4a16
from tuner.core.device import fingerprint
from tuner.quant import int4, int4_torch
from tuner.suites.lowbit import problems

GROUP = 128


def suite_shapes() -> list[tuple[str, int, int]]:
    """(projection, N, K) of the low-bit suite's INT4 weights."""
    seen = {}
    for label, key in problems([f"int4-g{GROUP}"], [1]):
        seen.setdefault(label.split(" M=")[0], (key.n, key.k))
    return [(name, n, k) for name, (n, k) in seen.items()]


def torch_pack(q: torch.Tensor) -> torch.Tensor:
    """torch's packed weight of [N, K] nibbles, through torch's own conversion for the device."""
    tiles = int4_torch.inner_k_tiles(q.shape[1])
    if q.is_cuda:
        pairs = (q[:, 0::2] << 4) | q[:, 1::2]  # torch's input: the even k in the high nibble
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), tiles)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), tiles)


def timed(
    make: Callable[[], Any], reps: int, device: torch.device
) -> tuple[Any, float, int | None]:
    """(the last result, median seconds, peak bytes allocated beyond the start: CUDA only) of
    ``make()``."""
    seconds, peak, out = [], None, None
    for _ in range(reps):
        out = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        out = make()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = max(peak or 0, torch.cuda.max_memory_allocated(device) - before)
        seconds.append(time.perf_counter() - start)
    return out, statistics.median(seconds), peak


def nbytes(t: torch.Tensor | tuple[torch.Tensor, ...]) -> int:
    return sum(p.nbytes for p in (t if isinstance(t, tuple) else (t,)))


def measure(name: str, n: int, k: int, reps: int, device: torch.device) -> dict[str, Any]:
    """One weight's layouts: seconds, bytes kept, transient peak bytes; checked."""
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device=device)
    sz = torch.randn(k // GROUP, n, 2, generator=gen, device=device).to(torch.bfloat16)
    packed, torch_s, torch_peak = timed(lambda: torch_pack(q), reps, device)
    ours, ours_s, ours_peak = timed(lambda: int4.from_torch_int4pack(packed), reps, device)
    nibbles = int4.unpack(ours)
    cut, cut_s, cut_peak = timed(lambda: cutlass_w4a16.to_cutlass(nibbles), reps, device)
    shuf, shuf_s, shuf_peak = timed(lambda: cutlass_w4a16.reorder(cut), reps, device)
    split, split_s, split_peak = timed(lambda: cutlass_w4a16.split_scales(sz), reps, device)
    checked = (
        torch.equal(nibbles, q)
        and torch.equal(cutlass_w4a16.from_cutlass(cut), q)
        and torch.equal(cutlass_w4a16.unreorder(shuf), cut)
        and torch.equal(torch.stack(split, dim=2), sz)
    )
    row = {"name": name, "n": n, "k": k, "bf16_weight_bytes": n * k * 2, "checked": checked}
    for layout, t, s, peak in (
        ("torch_packed", packed, torch_s, torch_peak),
        ("ours", ours, ours_s, ours_peak),
        ("cutlass_a", cut, cut_s, cut_peak),
        ("cutlass_a_reordered", shuf, shuf_s, shuf_peak),
        ("cutlass_scales", split, split_s, split_peak),
    ):
        row[layout] = {"seconds": s, "bytes": nbytes(t), "peak_bytes": peak}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shape", nargs=3, action="append", metavar=("NAME", "N", "K"),
                    help="a weight of its own instead of the suite's (repeatable)")  # fmt: skip
    args = ap.parse_args()
    if args.reps < 1:
        ap.error(f"--reps={args.reps}: allowed 1 or more")
    for name, n, k in args.shape or []:
        if not (n.isdigit() and k.isdigit() and int(n) % 16 == 0 and int(k) % GROUP == 0):
            ap.error(f"--shape {name} {n} {k}: N must be a multiple of 16 (torch's packing) and "
                     f"K of the group size {GROUP}")  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = [(s, int(n), int(k)) for s, n, k in args.shape] if args.shape else suite_shapes()
    fp = fingerprint(device.type)
    result: dict[str, Any] = {"benchmark": "int4_layouts", "device": fp.name,
                              "versions": fp.versions, "group": GROUP, "rows": []}  # fmt: skip
    for name, n, k in shapes:
        row = measure(name, n, k, args.reps, device)
        result["rows"].append(row)
        cells = "  ".join(f"{layout} {row[layout]['seconds'] * 1e3:8.2f} ms "
                          f"{row[layout]['bytes'] / 2**20:6.1f} MiB"
                          for layout in ("torch_packed", "ours", "cutlass_a",
                                         "cutlass_a_reordered", "cutlass_scales"))  # fmt: skip
        print(f"{name:22s} {n:6d} x {k:6d}  {cells}  checked={row['checked']}", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
