"""Timing on the GPU: CUDA events or graph replay after warm-up, medians; copy bandwidth; ``Row``,
the record a benchmark's ``run(only)`` result becomes in the combined report (bench/report.py)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    """One measured case: the headline time and how it was taken, bytes and bandwidth when the
    benchmark counts bytes, and every timing it took (µs by kind: eager, graph, host, wall, ...)."""

    bench: str
    case: str
    us: float
    timing: str
    bytes: int | None = None
    gbs: float | None = None
    pct_copy: float | None = None
    times: dict[str, float] = field(default_factory=dict)


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


def same_size_copy_us(nbytes: int) -> float:
    """Device time of a copy that moves `nbytes` (half read, half written): faster of eager and graph.
    fp32 elements, as in copy_bandwidth_gbs (torch copies them with 16-byte vectors)."""
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


class BandwidthReport:
    """Rows of (case, bytes moved, eager and graph-replay µs, GB/s, % of the copy bandwidth, and the
    time of a device copy moving the same bytes: the floor a size reaches, launch and ramp included)."""

    def __init__(self) -> None:
        self.copy_gbs = copy_bandwidth_gbs()
        self.empty_us = graph_us(empty_kernel())
        self.rows: list[dict] = []

    def measure(self, name: str, nbytes: int, fn: Callable[[], object]) -> None:
        eager, graph = event_us(fn), graph_us(fn)
        gbs = nbytes / (min(eager, graph) * 1e-6) / 1e9
        copy_us = same_size_copy_us(nbytes)
        self.rows.append({"case": name, "bytes": nbytes, "eager_us": eager, "graph_us": graph,
                          "over_empty_us": graph - self.empty_us, "gbs": gbs, "pct_copy": 100 * gbs / self.copy_gbs,
                          "same_size_copy_us": copy_us, "pct_same_size_copy": 100 * copy_us / min(eager, graph)})

    def as_dict(self) -> dict:
        return {"copy_gbs": self.copy_gbs, "empty_kernel_graph_us": self.empty_us, "rows": self.rows}

    def to_rows(self, bench: str) -> list[Row]:
        """Headline time: the faster of eager and graph replay (what the GB/s figure uses)."""
        out = []
        for r in self.rows:
            graph = r["graph_us"] <= r["eager_us"]
            out.append(Row(bench, r["case"], min(r["graph_us"], r["eager_us"]), "graph" if graph else "eager",
                           r["bytes"], r["gbs"], r["pct_copy"],
                           {k[:-3]: v for k, v in r.items() if k.endswith("_us")}))
        return out

    def print(self) -> None:
        print(f"device copy bandwidth {self.copy_gbs:.0f} GB/s; empty kernel (graph replay) {self.empty_us:.2f} µs; "
              "copy µs: a device copy of the same bytes (half read, half written), % of it: copy µs / ours")
        width = max([len(r["case"]) for r in self.rows] + [4])
        print(f"{'case':{width}s} {'MB':>8s} {'eager µs':>9s} {'graph µs':>9s} {'-empty':>7s} {'GB/s':>7s} "
              f"{'% copy':>7s} {'copy µs':>8s} {'% of it':>8s}")
        for r in self.rows:
            print(f"{r['case']:{width}s} {r['bytes'] / 1e6:8.3f} {r['eager_us']:9.2f} {r['graph_us']:9.2f} "
                  f"{r['over_empty_us']:7.2f} {r['gbs']:7.0f} {r['pct_copy']:6.1f}% {r['same_size_copy_us']:8.2f} "
                  f"{r['pct_same_size_copy']:7.1f}%")


def bench_args(description: str, argv=None, *, json_flag: bool = True) -> argparse.Namespace:
    """The command line every benchmark module takes: ``[--json] [--only TEXT]``."""
    p = argparse.ArgumentParser(description=description)
    if json_flag:
        p.add_argument("--json", action="store_true")
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    return p.parse_args(argv)


def bandwidth_main(description: str, run: Callable[[str], BandwidthReport], argv=None) -> None:
    """Command line of a bandwidth benchmark: ``[--json] [--only TEXT]``."""
    args = bench_args(description, argv)
    report = run(args.only)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        report.print()
