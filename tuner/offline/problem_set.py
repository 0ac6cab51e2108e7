"""``ProblemSet``: the problems a tune-all run is asked for, gathered from model configs, problem
lists, PyTorch TunableOp files and recorded misses, each with the labels of what asked for it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuner.core.keys import Key, parse_key
from tuner.offline.model_config import ModelConfig, expand
from tuner.offline.problem_list import load_problems
from tuner.offline.tunableop import Imported


@dataclass
class ProblemSet:
    """Keys in first-seen order, each with the labels of every source that asked for it."""

    labels: dict[Key, list[str]] = field(default_factory=dict)

    def add(self, key: Key, label: str) -> None:
        self.labels.setdefault(key, []).append(label)

    def __iter__(self) -> Iterator[Key]:
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    def label(self, key: Key) -> str:
        names = self.labels.get(key, [])
        return names[0] + (f" (+{len(names) - 1})" if len(names) > 1 else "") if names else ""

    def add_model(self, model: ModelConfig, only: str | None = None) -> int:
        problems = expand(model, only)
        for p in problems:
            self.add(p.key, p.label)
        return len(problems)

    def add_problem_list(self, path: Path) -> int:
        keys = load_problems(path)
        for i, key in enumerate(keys):
            self.add(key, f"{path.name}[{i}]")
        return len(keys)

    def add_tunableop(self, imported: Imported) -> int:
        for key, (path, entry) in imported.found.items():
            self.add(key, f"{path.name}:{entry.line}")
        return len(imported.found)

    def add_misses(self, rows: Iterable[dict[str, Any]]) -> list[str]:
        """Recorded misses (``Store.misses``); returns the rows whose key does not parse."""
        bad = []
        for row in rows:
            try:
                self.add(parse_key(row["key"]), f"missed x{row['count']}")
            except ValueError as e:
                bad.append(f"{row['key']}: {e}")
        return bad

    def only(self, op: str | None) -> ProblemSet:
        if op is None:
            return self
        return ProblemSet({k: v for k, v in self.labels.items() if k.op == op})
