"""Offline work: tune-all over model configs, problem lists and TunableOp files, and its report."""
