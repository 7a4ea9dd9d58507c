"""Timing on the GPU, L2-cold by default; ``Row``, the one result type of every benchmark.

Every device-timed call runs after a write that evicts the L2 (``flush_l2``), queued before the
start event, so the flush is outside the timed region and the call finds none of its data in L2, as
in serving, where other layers run between two calls of a kernel. "warm" figures, where the
benchmarks report them, replay calls back to back on the same inputs without a flush (part of the
data stays L2-resident): they are labelled so.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

#: The smallest flush, whatever the device reports: 256 MiB is five times the H200's 50 MB L2.
MIN_FLUSH_BYTES = 256 << 20
#: Calls per graph of the warm figure.
WARM_CALLS = 20


@dataclass
class Row:
    """One measured case: the headline time and the timing it is (``times`` key), bytes and bandwidth
    when the benchmark counts bytes, every timing taken (µs by kind: eager, graph, warm, host, wall,
    ...) and dimensionless figures derived from them (``ratios``: speedups, % of a reference)."""

    bench: str
    case: str
    us: float
    timing: str
    bytes: int | None = None
    gbs: float | None = None
    pct_copy: float | None = None
    times: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)

    @classmethod
    def best_of(cls, bench: str, case: str, times: dict[str, float], kinds: tuple[str, ...] = ("eager", "graph"),
                nbytes: int | None = None, copy_gbs: float | None = None) -> "Row":
        """The headline is the fastest of ``kinds`` in ``times``; GB/s from ``nbytes`` and % of
        ``copy_gbs`` from that, when given."""
        present = [k for k in kinds if k in times]
        if not present:
            raise ValueError(f"case {case!r}: none of the headline timings {list(kinds)} in {sorted(times)}")
        timing = min(present, key=times.__getitem__)
        us = times[timing]
        gbs = None if nbytes is None else nbytes / (us * 1e3)  # bytes per µs is MB/s
        pct = None if gbs is None or copy_gbs is None else 100 * gbs / copy_gbs
        return cls(bench, case, us, timing, nbytes, gbs, pct, dict(times))


# ---------------------------------------------------------------------------------------- flush

def flush_bytes(l2_bytes: int) -> int:
    """Scratch bytes whose write evicts an L2 of ``l2_bytes``: twice it, so that no line of the data
    before survives whatever the replacement policy keeps, and never less than MIN_FLUSH_BYTES
    (should a device report its L2 as 0)."""
    if not isinstance(l2_bytes, int) or l2_bytes < 0:
        raise ValueError(f"l2_bytes must be an int >= 0, got {l2_bytes!r}")
    return max(2 * l2_bytes, MIN_FLUSH_BYTES)


@functools.cache
def _scratch(device_index: int) -> torch.Tensor:
    l2 = torch.cuda.get_device_properties(device_index).L2_cache_size
    return torch.empty(flush_bytes(l2) // 4, dtype=torch.int32, device=torch.device("cuda", device_index))


def flush_l2() -> None:
    """Evict the current device's L2 by writing a scratch buffer of ``flush_bytes(L2 size)`` (the flush
    triton.testing.do_bench uses, so that the figures compare with those kernel libraries report).
    Queued on the current stream: its ~0.1 ms on the GPU also lets the host enqueue the timed call
    before the GPU reaches it, so that launch latency stays outside the events."""
    _scratch(torch.cuda.current_device()).zero_()


# ------------------------------------------------------------------------------------ timings

def _median_us(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    torch.cuda.synchronize()
    return 1e3 * statistics.median(s.elapsed_time(e) for s, e in pairs)


def event_us(fn: Callable[[], object], warmup: int = 20, reps: int = 200) -> float:
    """Median device time of one eager call, L2-cold: CUDA events around the call alone, the L2
    flushed before each, in µs."""
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in pairs:
        flush_l2()
        s.record()
        fn()
        e.record()
    return _median_us(pairs)


def _capture(fn: Callable[[], object], calls: int, warmup: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, after eager warm-up calls on a side stream (as capture
    requires) and warm-up replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(warmup):
        graph.replay()
    return graph


def graph_us(fn: Callable[[], object], warmup: int = 3, reps: int = 50) -> float:
    """Median device time of one call replayed from a CUDA graph that holds it alone, L2-cold.

    The flush runs eagerly before each replay, outside the graph and the events: one call per replay
    keeps the events around that call alone without event nodes inside a graph, and holds for any
    benchmark, where rotating through copies of the inputs would need to know each one's inputs."""
    graph = _capture(fn, 1, warmup)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in pairs:
        flush_l2()
        s.record()
        graph.replay()
        e.record()
    return _median_us(pairs)


def warm_graph_us(fn: Callable[[], object], warmup: int = 3, reps: int = 50, calls: int = WARM_CALLS) -> float:
    """Median time per call of ``calls`` calls captured in one CUDA graph and replayed with no flush:
    the same inputs stay partly L2-resident from call to call (a warm figure)."""
    graph = _capture(fn, calls, warmup)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in pairs:
        s.record()
        graph.replay()
        e.record()
    return _median_us(pairs) / calls


def cold_and_warm(fn: Callable[[], object], prefix: str = "") -> dict[str, float]:
    """``{prefix}eager`` and ``{prefix}graph`` (L2-cold) and ``{prefix}warm`` µs of ``fn``."""
    return {f"{prefix}eager": event_us(fn), f"{prefix}graph": graph_us(fn), f"{prefix}warm": warm_graph_us(fn)}


def wall_us(fn: Callable[[], object], warmup: int = 20, reps: int = 200) -> float:
    """Median host+device latency from the call until its GPU work is done (synchronize), in µs; the
    L2 flushed and the device idle before each call, outside the timed region."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush_l2()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def host_us(fn: Callable[[], object], warmup: int = 20, reps: int = 256) -> float:
    """Median host time of one call (what a serving loop pays on the CPU; the GPU runs behind). No
    flush: the time is the CPU's, which the device's L2 does not enter."""
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


# ------------------------------------------------------------------------------------ baselines

def same_size_copy_us(nbytes: int) -> float:
    """Device time of a copy that moves ``nbytes`` (half read, half written), L2-cold: the faster of
    eager and graph. fp32 elements, as in the copy row of ``Bandwidth`` (torch copies them with
    16-byte vectors)."""
    src = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    return min(event_us(lambda: dst.copy_(src)), graph_us(lambda: dst.copy_(src)))


def empty_kernel() -> Callable[[], object]:
    """A one-element kernel launch of ours: the floor for tiny launches."""
    from .. import runtime

    x = torch.randn(1, device="cuda")
    out = torch.empty_like(x)
    fn = runtime.function("selftest", "affine", x.device, dtype="fp32")
    return lambda: fn(x, out, 1.0, 0.0)


def _copy_row(bench: str, nbytes: int) -> Row:
    """A device copy of ``nbytes`` of fp32 values; its bytes are those read plus written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    times = {"eager": event_us(lambda: dst.copy_(src), warmup=5, reps=20)}
    return Row.best_of(bench, f"device copy {nbytes >> 30} GiB", times, nbytes=2 * nbytes)


class Bandwidth:
    """The rows of a benchmark that counts bytes: first its two baselines, a device copy of 2 GiB (the
    bandwidth "% copy" is against) and an empty kernel of ours (the floor of a tiny launch), then one
    row per case."""

    def __init__(self, bench: str) -> None:
        self.bench = bench
        copy = _copy_row(bench, 2 << 30)
        self.copy_gbs = copy.gbs
        copy.pct_copy = 100.0
        self.rows = [copy, Row.best_of(bench, "empty kernel", cold_and_warm(empty_kernel()))]

    def add(self, case: str, nbytes: int, times: dict[str, float]) -> Row:
        row = Row.best_of(self.bench, case, times, nbytes=nbytes, copy_gbs=self.copy_gbs)
        self.rows.append(row)
        return row

    def measure(self, case: str, nbytes: int, fn: Callable[[], object],
                others: dict[str, Callable[[], object]] | None = None) -> Row:
        """A case's cold and warm timings, and a same-size copy: "pct_same_size_copy" is that copy's
        time over ours, where a kernel stands against what the GPU's own copy reaches at that size.
        `others`: the same call through other implementations (by name), timed cold right after ours;
        "NAME / dsv4jit" is the better of its eager and graph times over our headline."""
        copy_us = same_size_copy_us(nbytes)
        times = {**cold_and_warm(fn), "same_size_copy": copy_us}
        for name, other in (others or {}).items():
            times[f"eager {name}"], times[f"graph {name}"] = event_us(other), graph_us(other)
        row = self.add(case, nbytes, times)
        row.ratios["pct_same_size_copy"] = 100 * copy_us / row.us
        for name in others or {}:
            row.ratios[f"{name} / dsv4jit"] = min(times[f"eager {name}"], times[f"graph {name}"]) / row.us
        return row
