"""Benchmark suites: tune each problem, then time the baseline and the winner side by side."""
