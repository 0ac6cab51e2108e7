"""A real cache with pages damaged inside it: its header and schema read fine, so only
SQLite's page checks can tell (what a disk or a copy cut short leaves behind)."""

from __future__ import annotations

from pathlib import Path

from tuner.cache import Store
from tuner.measure.records import Measurement, Winner

PAGE = 4096


def damaged_cache(path: Path, winners_of: str | None = None) -> bytes:
    """Writes the cache at ``path`` (many measurements, so many pages; or, with ``winners_of``,
    many winners of that device class), scribbles over four pages in its middle and returns
    the file's bytes."""
    row = dict(device_class="cpu-test", source="torch", params={}, status="rejected",
               is_baseline=False, median_us=None, error="x" * 200)  # fmt: skip
    built = path.with_name(f"{path.name}.built")  # written elsewhere, as a copy would arrive
    with Store(built) as store:
        if winners_of is None:
            store.save_run(
                [Measurement(key=f"gemm:m={m},n=8,k=8", **row) for m in range(1, 400)], None
            )
        else:
            store.put_winners(
                Winner(winners_of, f"gemm:m={m},n=8,k=8", "torch", {"pad": "x" * 200}, 1.0, 1.0)
                for m in range(1, 400)
            )
    data = bytearray(built.read_bytes())
    built.unlink()
    middle = len(data) // PAGE // 2 * PAGE
    data[middle : middle + 4 * PAGE] = b"\xa5" * 4 * PAGE
    path.write_bytes(bytes(data))
    return bytes(data)
