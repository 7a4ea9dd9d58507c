"""``python -m dsv4jit bench --out DIR``: every benchmark module in one run, written as a markdown
table and a CSV, and, where matplotlib is installed (``pip install 'dsv4jit[bench]'``), one bar chart
per benchmark (% of the copy bandwidth per case).

Benchmarks are discovered: each module of this package with a ``run(only)`` function is one; it
returns a list of ``timing.Row``. ``main`` is the command line of each module run alone.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import json
import math
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path

from .timing import MIN_FLUSH_BYTES, WARM_CALLS, Row

#: Modules of this package that are helpers, not benchmarks.
HELPERS = {"timing", "report"}
#: How the figures are taken; heads every report.
METHOD = (f"Medians in µs, L2-cold unless labelled warm: before every timed call a write of twice the L2 size "
          f"(at least {MIN_FLUSH_BYTES >> 20} MiB) evicts the L2, outside the timed region. eager: CUDA events "
          f"around one call; graph: events around the replay of a CUDA graph holding one call; warm: per call of "
          f"{WARM_CALLS} calls replayed in one graph on the same inputs, no flush (data partly L2-resident); "
          "wall: the call until its GPU work is done; host: the CPU's time of a call (no flush: the L2 does not "
          "enter it). µs is the headline timing named in the timing column (the faster of cold eager and graph "
          "where both are taken). \"% copy\" is its GB/s against the measured device copy bandwidth (the "
          "\"device copy\" row).\n")
PLOTS_NEED = "no plots: they need matplotlib (pip install 'dsv4jit[bench]')"


def discover() -> list[str]:
    """Names of the benchmark modules (those defining ``run``), sorted."""
    import dsv4jit.bench as package

    names = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name in HELPERS or info.name.startswith("_"):
            continue
        if callable(getattr(importlib.import_module(f"dsv4jit.bench.{info.name}"), "run", None)):
            names.append(info.name)
    return sorted(names)


def rows_of(bench: str, result) -> list[Row]:
    """What a benchmark's ``run`` returned, checked to be rows."""
    rows = list(result)
    wrong = [type(r).__name__ for r in rows if not isinstance(r, Row)]
    if wrong:
        raise TypeError(f"benchmark {bench!r}: run() must return a list of timing.Row, got {sorted(set(wrong))}")
    return rows


def run_benchmarks(names: list[str], only: str = "",
                   on_start: Callable[[str], None] | None = None) -> list[Row]:
    rows = []
    for name in names:
        if on_start is not None:
            on_start(name)
        rows += rows_of(name, importlib.import_module(f"dsv4jit.bench.{name}").run(only))
    return rows


def no_gpu(what: str, alternative: str = "") -> str | None:
    """Why `what` cannot run here (``... needs a CUDA GPU; none is visible``), or None where a GPU is
    visible; `alternative`: what else would do instead of one."""
    import torch

    if torch.cuda.is_available():
        return None
    return f"{what} needs a CUDA GPU{f' or {alternative}' if alternative else ''}; none is visible"


def exit_without_gpu(what: str, alternative: str = "") -> None:
    """A module run alone exits as ``dsv4jit bench`` does without a GPU: one line, exit status 2."""
    if why := no_gpu(what, alternative):
        print(f"dsv4jit: {why}", file=sys.stderr)
        raise SystemExit(2)


def main(description: str, run: Callable[..., list[Row]], argv=None, against: bool = False) -> None:
    """The command line of a benchmark module run alone: ``[--json] [--only TEXT]`` (and ``[--against
    MODULE]`` where `against`: then ``run(only, against)``); prints its rows as the combined report
    does (markdown), or as JSON. Needs a GPU, as every benchmark does."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--only", default="", help="run the cases whose name contains this text (default: every case)")
    if against:
        p.add_argument("--against", metavar="MODULE", help="also run this implementation of the same API, side by "
                       "side on identical inputs (an importable module name)")
    args = p.parse_args(argv)
    module = sys.modules[run.__module__]  # run alone, "__main__": its import name is its spec's
    exit_without_gpu(f"python -m {module.__spec__.name if module.__spec__ else run.__module__}")
    rows = run(args.only, args.against) if against else run(args.only)
    print(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) if args.json else markdown(rows))


# ------------------------------------------------------------------------------------- writers

def _kinds(rows: list[Row], attr: str) -> list[str]:
    """The keys of ``times`` or ``ratios`` over the rows, in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in getattr(r, attr)))


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def write_csv(rows: list[Row], path: Path) -> None:
    kinds, ratios = _kinds(rows, "times"), _kinds(rows, "ratios")
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["bench", "case", "timing", "us", "bytes", "gbs", "pct_copy"] + [f"{k}_us" for k in kinds]
                     + ratios)
        for r in rows:
            out.writerow([r.bench, r.case, r.timing, _fmt(r.us, 3), _fmt(r.bytes), _fmt(r.gbs, 1),
                          _fmt(r.pct_copy, 2)] + [_fmt(r.times.get(k), 3) for k in kinds]
                         + [_fmt(r.ratios.get(k), 3) for k in ratios])


def markdown(rows: list[Row], header: str = "") -> str:
    """The header, how the figures are taken (METHOD), then one section per benchmark; columns that
    no row of it fills are left out."""
    out = ([header] if header else []) + [METHOD]
    for bench in dict.fromkeys(r.bench for r in rows):
        mine = [r for r in rows if r.bench == bench]
        cols = [("case", lambda r: r.case.replace("|", "/"), "---")]
        if any(r.bytes is not None for r in mine):
            cols.append(("MB", lambda r: _fmt(r.bytes / 1e6 if r.bytes is not None else None, 3), "---:"))
        cols.append(("µs", lambda r: _fmt(r.us), "---:"))
        cols.append(("timing", lambda r: r.timing, "---"))
        if any(r.gbs is not None for r in mine):
            cols.append(("GB/s", lambda r: _fmt(r.gbs, 0), "---:"))
        if any(r.pct_copy is not None for r in mine):
            cols.append(("% copy", lambda r: _fmt(r.pct_copy, 1), "---:"))
        for kind in _kinds(mine, "times"):
            cols.append((f"{kind} µs", lambda r, k=kind: _fmt(r.times.get(k)), "---:"))
        for kind in _kinds(mine, "ratios"):
            cols.append((kind, lambda r, k=kind: _fmt(r.ratios.get(k)), "---:"))
        out += [f"## {bench}", "", "| " + " | ".join(c[0] for c in cols) + " |",
                "| " + " | ".join(c[2] for c in cols) + " |"]
        out += ["| " + " | ".join(c[1](r) for c in cols) + " |" for r in mine]
        out.append("")
    return "\n".join(out)


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401  (the optional extra dsv4jit[bench])
    except ImportError:
        return False
    return True


def bar_chart(title: str, labels: list[str], values: list[float]):
    """A matplotlib Figure (no pyplot, so no global backend state): one horizontal bar per value (%),
    labelled with it, in the order given from the top; the axis from 0 to at least 100, with room for
    the labels."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 1.2 + 0.3 * len(labels)), layout="constrained")
    ax = fig.subplots()
    ax.bar_label(ax.barh(range(len(values)), values, color="#3465a4"), fmt="%.1f%%", padding=3, fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max([100.0] + [v for v in values if not math.isnan(v)]) * 1.12)
    ax.grid(axis="x", color="#d7d7d7")
    ax.set_axisbelow(True)
    ax.set_title(title)
    return fig


def write_plots(rows: list[Row], out_dir: Path) -> list[Path]:
    """One PNG per benchmark that reports a share of the copy bandwidth; none without matplotlib."""
    if not can_plot():
        return []
    paths = []
    for bench in dict.fromkeys(r.bench for r in rows):
        mine = [r for r in rows if r.bench == bench and r.pct_copy is not None]
        if mine:
            path = out_dir / f"{bench}.png"
            bar_chart(f"{bench}: % of copy bandwidth (L2-cold)", [r.case for r in mine],
                      [float(r.pct_copy) for r in mine]).savefig(path, dpi=100)
            paths.append(path)
    return paths


def write_report(rows: list[Row], out_dir: Path, header: str = "") -> list[Path]:
    """bench.md, bench.csv and, with matplotlib, <bench>.png files under ``out_dir`` (created);
    returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, table = out_dir / "bench.md", out_dir / "bench.csv"
    md.write_text(markdown(rows, header))
    write_csv(rows, table)
    return [md, table] + write_plots(rows, out_dir)
