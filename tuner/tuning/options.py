"""``TuneOptions``: how one problem is tuned. Apart from ``tuner.tuning.engine`` (which imports
torch) so that the command line shows these defaults in its help without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from tuner.measure.records import DEFAULT_LAUNCH, LAUNCHES


@dataclass
class TuneOptions:
    """How one problem is tuned; the same object for ``tuner tune``, ``tune-all`` and ``bench``."""

    budget_s: float = 0.15  # timing budget per candidate
    cut_factor: float = 1.5  # probe slower than this x best so far -> cut
    steady_cut: float = 1.1  # ... where the best is steady (timing.STEADY_US): probes vary little
    late_cut: float = 1.1  # after timing.LATE_REPS timed calls slower than this x best -> cut
    min_noise: float = 0.02  # a challenger must win by at least this share ...
    confirm_rounds: int = 3  # ... and again when re-timed alternately with the baseline
    # contenders (then, on the GPU, ties) confirmed in turn, fastest first, until one keeps its
    # win: eager times of small problems are host-bound and rank configs that are slow on the
    # GPU beside fast ones
    confirm_tries: int = 3
    sustained_s: float = 0.15  # on the GPU, a duel of calls of timing.STEADY_US or more times
    # each runner over this long a stretch a round, after as long a one untimed: compute-bound
    # kernels are compared at the clock the power limit leaves them (0: as short ones)
    seed: int = 0
    # "eager": host launch time counts; "graph": GPU time only (candidates timed in CUDA graphs,
    # on the GPU)
    launch: str = DEFAULT_LAUNCH
    host_slack_us: float = 1.0  # eager: a winner may cost at most max(this, host_slack x the
    host_slack: float = 0.1  # baseline's) more host time per call than the baseline
    sources: list[str] | None = None  # restrict to these source names
    max_candidates: int | None = None  # per source
    isolate: bool = False  # candidates in a replaceable worker process (tuner.tuning.tune)
    prune: bool = True  # leave out, uncompiled, what cannot beat the baseline (tuning.pruning)

    def __post_init__(self) -> None:
        if self.launch not in LAUNCHES:
            raise ValueError(f"launch must be one of {list(LAUNCHES)}, got {self.launch!r}")
        for name in ("budget_s", "min_noise", "host_slack_us", "host_slack", "sustained_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("cut_factor", "steady_cut", "late_cut"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("confirm_rounds", "confirm_tries"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
