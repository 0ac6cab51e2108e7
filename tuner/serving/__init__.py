"""Serving winners in process: the dispatcher behind tuner.matmul / tuner.sdpa, the call memo and the bucket policies."""
