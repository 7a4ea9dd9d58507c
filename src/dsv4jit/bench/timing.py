"""Timing on the GPU: CUDA events or graph replay after warm-up, medians; copy bandwidth."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def event_us(fn: Callable[[], object], warmup: int = 20, reps: int = 200) -> float:
    """Median device time of one call (CUDA events around each call), in µs."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graph_us(fn: Callable[[], object], warmup: int = 3, reps: int = 50, calls_per_graph: int = 20) -> float:
    """Median time per call when `calls_per_graph` calls are captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return 1e3 * statistics.median(times) / calls_per_graph


def wall_us(fn: Callable[[], object], warmup: int = 20, reps: int = 200) -> float:
    """Median host+device latency: from the call until its GPU work is done (synchronize), in µs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def host_us(fn: Callable[[], object], warmup: int = 20, reps: int = 256) -> float:
    """Median host time of one call (what a serving loop pays on the CPU; the GPU runs behind)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        if i % 32 == 0:
            torch.cuda.synchronize()  # keep the launch queue short, outside the timed region
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def sync_overhead_us(reps: int = 200) -> float:
    """Median cost of an idle torch.cuda.synchronize (subtract it from wall_us for latency)."""
    return wall_us(lambda: None, reps=reps)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = event_us(lambda: dst.copy_(src), warmup=5, reps=20)
    return 2 * nbytes / (us * 1e-6) / 1e9


def empty_kernel() -> Callable[[], object]:
    """A one-element kernel launch of ours: the floor for tiny launches."""
    from .. import runtime

    x = torch.randn(1, device="cuda")
    out = torch.empty_like(x)
    fn = runtime.function("selftest", "affine", x.device, dtype="fp32")
    return lambda: fn(x, out, 1.0, 0.0)
