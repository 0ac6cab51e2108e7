"""What a tuning run produces: one Measurement per candidate, one Winner per problem.

These are plain records shared by the engine (which makes them), the store (which keeps them) and
the fleet service (which merges them). ``to_row``/``from_row`` give their flat, JSON-friendly form.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tuner.core.keys import key_op, required_fields

if TYPE_CHECKING:
    from tuner.core.device import Fingerprint

STATUSES = ("ok", "rejected", "failed", "cut", "timeout", "unsupported")
LAUNCHES = ("eager", "graph")  # eager: each call launched from the host; graph: replayed
DEFAULT_LAUNCH = "eager"  # what a tuning run, and a record that names no launch mode, stands for


def candidate_name(source: str, params: dict[str, Any]) -> str:
    """Stable name of a candidate: the source plus its params in canonical JSON."""
    if not params:
        return source
    return source + ":" + json.dumps(params, sort_keys=True, separators=(",", ":"))


def candidate_params(name: str) -> dict[str, Any]:
    """The params of a ``candidate_name`` (the inverse of its JSON part; {} for none)."""
    return json.loads(name.partition(":")[2] or "{}")


class _Record:
    """What Measurement and Winner share: a key, a candidate, and a flat row form."""

    key: str
    source: str
    params: dict[str, Any]

    @property
    def op(self) -> str:
        return key_op(self.key)

    @property
    def candidate(self) -> str:
        return candidate_name(self.source, self.params)

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        """The keys of ``to_row()``: the fields and what is derived from them."""
        return (*cls.__dataclass_fields__, "op", "candidate")  # type: ignore[attr-defined]

    def to_row(self) -> dict[str, Any]:
        # shallow on purpose: asdict would deep-copy params, which are replaced by JSON below
        row = {f: getattr(self, f) for f in self.__dataclass_fields__}  # type: ignore[attr-defined]
        row.update(
            op=self.op, candidate=self.candidate, params=json.dumps(self.params, sort_keys=True)
        )
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Any:
        """The record of a table row or a JSON object; ValueError naming what it lacks."""
        if not isinstance(row, dict):
            raise ValueError(f"must be an object of fields, got {type(row).__name__}")
        fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
        missing = [k for k in required_fields(cls) if k not in row]
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        data = {k: row[k] for k in fields if k in row}
        if isinstance(data.get("params"), str):
            data["params"] = json.loads(data["params"])
        return cls(**data)


@dataclass
class Measurement(_Record):
    device_class: str
    key: str
    source: str
    params: dict[str, Any]
    status: str
    is_baseline: bool = False
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    reps: int = 0
    host_us: float | None = None
    max_rel_err: float | None = None
    error: str = ""
    versions: str = ""
    host: str = field(default_factory=socket.gethostname)
    run_id: str = ""
    created_at: float = field(default_factory=time.time)
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    launch: str = DEFAULT_LAUNCH  # the launch mode it was measured for: eager or graph

    @property
    def spread(self) -> float:
        """Relative spread (p90 - p10) / median: the noise a challenger must beat."""
        if not self.median_us or self.p10_us is None or self.p90_us is None:
            return 0.0
        return (self.p90_us - self.p10_us) / self.median_us

    def to_row(self) -> dict[str, Any]:
        return super().to_row() | {"is_baseline": int(self.is_baseline)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Measurement:
        m = super().from_row(row)
        m.is_baseline = bool(m.is_baseline)
        return m


@dataclass
class Winner(_Record):
    device_class: str
    key: str
    source: str
    params: dict[str, Any]
    median_us: float
    baseline_us: float
    versions: str = ""
    run_id: str = ""
    updated_at: float = field(default_factory=time.time)
    launch: str = DEFAULT_LAUNCH  # the launch mode it was chosen for: eager or graph

    def measured_under(self, fp: Fingerprint) -> bool:
        """Whether this winner was measured under ``fp``'s versions (else it is stale)."""
        return self.versions == fp.version_tag

    @property
    def launch_mode(self) -> str:
        """The launch mode it was chosen for; an imported row that names none stands for the
        default, as a winner stored before launch modes existed does."""
        return self.launch or DEFAULT_LAUNCH

    @property
    def speedup(self) -> float:
        return self.baseline_us / self.median_us if self.median_us else 1.0

    def to_row(self) -> dict[str, Any]:
        return super().to_row() | {"speedup": self.speedup}

    @classmethod
    def columns(cls) -> tuple[str, ...]:
        return (*super().columns(), "speedup")
