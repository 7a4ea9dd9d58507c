"""Benchmarks (run on a GPU): ``python -m dsv4jit.bench.<name>``; shared helpers in ``timing``."""
