"""The benchmarks' timing discipline and their combined report (``python -m dsv4jit bench``), without a GPU.

Timing: a simulated device (a clock that the flush, each call and each event record read or advance)
stands in for CUDA, so that the order of flush, events and calls shows in the figures: a flush inside
the timed region would add its 100 ms to a 4 µs call. Report: Row assembly, CSV, markdown, and the
plots, which need the optional matplotlib (skipped with the reason when it is missing).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from dsv4jit.bench import report, timing
from dsv4jit.bench.timing import Row

MiB = 1 << 20
FLUSH_MS, CALL_MS = 100.0, 0.004

ROWS = [
    Row("compress", "prefill c4 hd512 1x8192", 25.7, "graph", 73_400_000, 2856.0, 66.9,
        {"eager": 30.1, "graph": 25.7, "warm": 24.6}, {"pct_same_size_copy": 96.1}),
    Row("compress", "decode c4 B=64, boundary | x", 2.57, "graph", 3_000_000, 1167.0, 27.6,
        {"eager": 7.9, "graph": 2.57}),
    Row("plan", "decode c4 B=256", 2.2, "graph", times={"wall": 20.0, "host": 11.0, "graph": 2.2}),
]


# ------------------------------------------------------------------------------------ flush size

@pytest.mark.parametrize("l2, expect", [(0, 256 * MiB), (50 * MiB, 256 * MiB), (128 * MiB, 256 * MiB),
                                        (129 * MiB, 258 * MiB), (1024 * MiB, 2048 * MiB)])
def test_flush_is_twice_the_l2_and_at_least_256_mib(l2, expect):
    assert timing.flush_bytes(l2) == expect


@pytest.mark.parametrize("bad", [-1, 1.5, "50MB", None])
def test_flush_size_rejects_what_is_no_byte_count(bad):
    with pytest.raises(ValueError, match=rf"l2_bytes must be an int >= 0, got {bad!r}"):
        timing.flush_bytes(bad)


# ------------------------------------------------------------------------- a simulated device

class Device:
    """A device clock in ms and the log of what ran on it, in order."""

    def __init__(self) -> None:
        self.clock, self.log = 0.0, []

    def run(self, what: str, ms: float) -> None:
        self.log.append(what)
        self.clock += ms


class Graph:
    """What ``_capture`` returns: replay runs the captured calls."""

    def __init__(self, device: Device, fn, calls: int) -> None:
        self.device, self.fn, self.calls = device, fn, calls

    def replay(self) -> None:
        self.device.log.append(f"replay of {self.calls}")
        for _ in range(self.calls):
            self.fn()


@pytest.fixture
def device(monkeypatch) -> Device:
    dev = Device()

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self) -> None:
            self.at = dev.clock
            dev.log.append("record")

        def elapsed_time(self, end: "Event") -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "flush_l2", lambda: dev.run("flush", FLUSH_MS))
    monkeypatch.setattr(timing, "_capture", lambda fn, calls, warmup: Graph(dev, fn, calls))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: dev.clock / 1e3)
    return dev


def call(dev: Device):
    return lambda: dev.run("call", CALL_MS)


def test_eager_events_bracket_the_call_after_a_flush(device):
    assert timing.event_us(call(device), warmup=2, reps=5) == pytest.approx(4.0)
    assert device.log == ["call"] * 2 + ["flush", "record", "call", "record"] * 5


def test_graph_replays_one_call_after_a_flush(device):
    assert timing.graph_us(call(device), reps=5) == pytest.approx(4.0)
    assert device.log == (["flush", "record", "replay of 1", "call", "record"]) * 5


def test_warm_replays_calls_back_to_back_without_a_flush(device):
    assert timing.warm_graph_us(call(device), reps=3) == pytest.approx(4.0)
    assert device.log == (["record", f"replay of {timing.WARM_CALLS}"] + ["call"] * timing.WARM_CALLS
                          + ["record"]) * 3


def test_wall_flushes_before_the_clock_starts_and_host_does_not_flush(device):
    assert timing.wall_us(call(device), warmup=1, reps=4) == pytest.approx(4.0)
    assert device.log == ["call"] + ["flush", "call"] * 4
    device.log.clear()
    timing.host_us(call(device), warmup=1, reps=4)
    assert "flush" not in device.log


def test_cold_and_warm_names_every_timing(device):
    assert timing.cold_and_warm(call(device), "two_step_") == pytest.approx(
        {"two_step_eager": 4.0, "two_step_graph": 4.0, "two_step_warm": 4.0})


# --------------------------------------------------------------------------------- Row assembly

def test_row_headline_is_the_fastest_cold_timing_and_bandwidth_follows_it():
    row = Row.best_of("compress", "a", {"eager": 30.0, "graph": 25.0, "warm": 20.0}, nbytes=50_000_000,
                      copy_gbs=4000.0)
    # 50 MB in 25 µs is 2000 GB/s, half of 4000; the warm time is no headline
    assert (row.us, row.timing, row.gbs, row.pct_copy) == (25.0, "graph", 2000.0, 50.0)
    assert row.times == {"eager": 30.0, "graph": 25.0, "warm": 20.0} and row.ratios == {}
    plan = Row.best_of("plan", "b", {"wall": 20.0, "wall_minus_sync": 9.0}, ("graph", "wall_minus_sync"))
    assert (plan.us, plan.timing, plan.bytes, plan.gbs, plan.pct_copy) == (9.0, "wall_minus_sync", None, None, None)
    with pytest.raises(ValueError, match=r"case 'c': none of the headline timings \['eager', 'graph'\]"):
        Row.best_of("x", "c", {"host": 1.0})


def test_bandwidth_rows_carry_the_same_size_copy_share(monkeypatch):
    monkeypatch.setattr(timing, "cold_and_warm", lambda fn: {"eager": 12.0, "graph": 10.0, "warm": 8.0})
    monkeypatch.setattr(timing, "same_size_copy_us", lambda nbytes: 9.0 if nbytes == 30_000_000 else 0.0)
    bandwidth = timing.Bandwidth.__new__(timing.Bandwidth)  # without the GPU baselines of __init__
    bandwidth.bench, bandwidth.copy_gbs, bandwidth.rows = "store", 4000.0, []
    row = bandwidth.measure("case", 30_000_000, lambda: None)
    assert bandwidth.rows == [row]
    assert (row.bench, row.us, row.timing, row.gbs, row.pct_copy) == ("store", 10.0, "graph", 3000.0, 75.0)
    assert row.times == {"eager": 12.0, "graph": 10.0, "warm": 8.0, "same_size_copy": 9.0}
    assert row.ratios == {"pct_same_size_copy": pytest.approx(90.0)}


def test_rows_of_accepts_rows_only():
    assert report.rows_of("plan", iter(ROWS[2:])) == ROWS[2:]
    with pytest.raises(TypeError, match=r"benchmark 'x': run\(\) must return a list of timing.Row, got \['dict'\]"):
        report.rows_of("x", [ROWS[0], {"case": "d"}])


# ------------------------------------------------------------------------------------- writers

def test_csv_has_one_row_per_case_and_every_timing_and_ratio_column(tmp_path):
    path = tmp_path / "bench.csv"
    report.write_csv(ROWS, path)
    with open(path, newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["bench", "case", "timing", "us", "bytes", "gbs", "pct_copy", "eager_us", "graph_us",
                            "warm_us", "wall_us", "host_us", "pct_same_size_copy"]
    assert [r["case"] for r in got] == [r.case for r in ROWS]
    assert got[0]["pct_copy"] == "66.90" and got[0]["bytes"] == "73400000" and got[0]["warm_us"] == "24.600"
    assert got[0]["pct_same_size_copy"] == "96.100" and got[1]["pct_same_size_copy"] == ""
    assert got[2]["bytes"] == "" and got[2]["wall_us"] == "20.000" and got[2]["eager_us"] == ""


def test_markdown_says_how_it_measures_then_one_section_per_benchmark():
    text = report.markdown(ROWS, "# title\n")
    assert text.startswith("# title\n\n" + report.METHOD)
    assert "L2-cold unless labelled warm" in report.METHOD and "outside the timed region" in report.METHOD
    compress = text[text.index("## compress"):text.index("## plan")]
    plan = text[text.index("## plan"):]
    assert "| case | MB | µs | timing | GB/s | % copy | eager µs | graph µs | warm µs | pct_same_size_copy |" in compress
    assert "| prefill c4 hd512 1x8192 | 73.400 | 25.70 | graph | 2856 | 66.9 | 30.10 | 25.70 | 24.60 | 96.10 |" in compress
    assert "boundary / x" in compress, "a '|' in a case name would break the table"
    assert "| case | µs | timing | wall µs | host µs | graph µs |" in plan
    assert "MB" not in plan and "% copy" not in plan


def test_without_matplotlib_the_report_is_markdown_and_csv(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert not report.can_plot()
    paths = report.write_report(ROWS, tmp_path / "out")
    assert [p.name for p in paths] == ["bench.md", "bench.csv"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.csv", "bench.md"]


def test_bar_chart_draws_one_bar_per_value_in_order():
    pytest.importorskip("matplotlib", reason="needs matplotlib (the optional extra: pip install 'dsv4jit[bench]')")
    fig = report.bar_chart("t", ["half", "full", "over"], [50.0, 100.0, 130.0])
    (ax,) = fig.axes
    bars = sorted(ax.patches, key=lambda p: p.get_y())  # the y axis is inverted: the first label on top
    assert [b.get_width() for b in bars] == [50.0, 100.0, 130.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["half", "full", "over"]
    assert ax.get_xlim()[1] >= 130.0 and ax.get_title() == "t"


def test_with_matplotlib_one_png_per_benchmark_that_counts_bytes(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib (the optional extra: pip install 'dsv4jit[bench]')")
    from matplotlib.image import imread

    paths = report.write_report(ROWS, tmp_path / "out")
    assert [p.name for p in paths] == ["bench.md", "bench.csv", "compress.png"]
    image = imread(tmp_path / "out" / "compress.png")
    assert image.ndim == 3 and image.shape[1] > 400


# ---------------------------------------------------------------------------- command lines

def test_a_module_alone_prints_its_rows_as_markdown_or_json(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rows here are made up: no GPU runs them
    asked = []

    def run(only):
        asked.append(only)
        return ROWS[:2]

    report.main("doc", run, ["--only", "c4"])
    assert asked == ["c4"] and capsys.readouterr().out == report.markdown(ROWS[:2]) + "\n"
    report.main("doc", run, ["--json"])
    got = json.loads(capsys.readouterr().out)
    assert [Row(**r) for r in got] == ROWS[:2]


@pytest.mark.parametrize("name", [*report.discover(), "loader"])
def test_a_module_alone_without_a_gpu_says_it_needs_one(name):
    """As `dsv4jit bench` does: one line and exit 2, not a CUDA error's traceback (GPUs hidden)."""
    res = subprocess.run([sys.executable, "-m", f"dsv4jit.bench.{name}"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("DSV4JIT_")}
                         | {"CUDA_VISIBLE_DEVICES": ""})
    needs = "a CUDA GPU or --arch" if name == "loader" else "a CUDA GPU"
    assert (res.returncode, res.stdout) == (2, "")
    assert res.stderr.splitlines()[-1] == f"dsv4jit: python -m dsv4jit.bench.{name} needs {needs}; none is visible"
    assert "Traceback" not in res.stderr


def test_discover_finds_the_benchmark_modules():
    names = report.discover()
    assert {"compress", "fused", "online", "overhead", "plan", "store"} <= set(names)
    assert not set(names) & report.HELPERS and "loader" not in names   # loader has no run(): not a kernel bench
