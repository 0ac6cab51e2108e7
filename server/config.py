"""Service settings (``tuner serve`` flags). Per-request size limits are in ``server.models``."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field


class Settings(BaseModel):
    db: Path
    open_reads: bool = False  # True: winners, queue and misses can be read without a token
    confirm_margin: float = Field(0.25, ge=0)  # a larger winner change needs confirmation
    min_noise: float = Field(0.01, ge=0)  # a challenger must beat the baseline by at least this
    max_attempts: int = Field(3, ge=1)  # leases that end without a winner before a key fails
    max_body_bytes: int = Field(32 * 2**20, gt=0)  # larger requests get 413 before parsing
    max_artifact_bytes: int = Field(512 * 2**20, gt=0)  # one uploaded artifact (streamed)
    artifacts_dir: Path | None = None  # artifact blobs; default: ``<db>.artifacts/`` beside it
    # how long a request waits for a lock another process holds on the database (a backup, an
    # operator's sqlite3 shell) before it is answered 503, nothing stored
    lock_wait_s: float = Field(30.0, gt=0)
