"""``RunSettings``: how ``tuner tune-all`` runs. Apart from ``tuner.offline.tune_all`` (which
imports torch) so that the command line shows these defaults in its help without loading torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from tuner.tuning.options import TuneOptions


@dataclass
class RunSettings:
    """How tune-all runs: the tuning of each problem (``tune``, passed whole to every worker)
    and the run's own limits."""

    tune: TuneOptions = field(default_factory=TuneOptions)
    problem_timeout_s: float = 900.0  # a problem running longer is killed and recorded
    time_limit_s: float | None = None  # no new problem starts after this many seconds
    workers: int | None = None  # default: one per local GPU, one on the CPU
    force: bool = False  # retune problems that already have a current winner
    retries: int = 2  # later runs try a failed or timed-out problem again at most this often
    compile_ahead: bool = True  # one compile pool for the run (tuner.tuning.compile_pool)
    compile_jobs: int | None = None  # problems compiled at once (default: compile_pool's)

    def __post_init__(self) -> None:
        if not self.problem_timeout_s > 0:
            raise ValueError(f"--problem-timeout must be > 0, got {self.problem_timeout_s!r}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"--time-limit must be > 0, got {self.time_limit_s!r}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers!r}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries!r}")
        if self.compile_jobs is not None and self.compile_jobs < 1:
            raise ValueError(f"compile_jobs must be >= 1 or None, got {self.compile_jobs!r}")
