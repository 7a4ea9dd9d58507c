"""Benchmarks (run on a GPU): ``python -m dsv4jit.bench.<name>``; shared helpers in ``timing`` (L2-cold
timings, ``Row``) and ``report`` (the combined report, each module's command line)."""
