"""The tuner command line."""
