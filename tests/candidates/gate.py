"""A key tuned with nothing cut: every shortlisted candidate of the sources timed and checked by
the engine's numerics gate, as the candidate tests need it."""

from __future__ import annotations

from tuner.core.keys import GemmKey
from tuner.tuning.engine import TuneOptions, TuneOutcome, tune


def tune_uncut(
    key: GemmKey, device: str, sources: list[str] | None = None, budget_s: float = 0.01
) -> TuneOutcome:
    options = TuneOptions(sources=sources, budget_s=budget_s, confirm_rounds=0, cut_factor=1e9,
                          late_cut=1e9, steady_cut=1e9)  # fmt: skip
    return tune(key, options=options, device=device)


def assert_every_config_passes(key: GemmKey, source: str, configs: int) -> None:
    """``source``'s ``configs`` candidates for ``key`` all ran and all passed the gate."""
    outcome = tune_uncut(key, "cuda", [source])
    ours = [m for m in outcome.measurements if m.source == source]
    assert len(ours) == configs
    assert all(m.status == "ok" and m.max_rel_err <= 1 for m in ours), ours
