"""Tuning one problem: candidates -> build -> check -> time -> winner, optionally in a replaceable worker process."""
