"""``python -m dsv4jit bench --out DIR``: every benchmark module in one run, written as a markdown
table, a CSV and one bar chart per benchmark (% of the copy bandwidth per case).

Benchmarks are discovered: each module of this package with a ``run(only)`` function is one (its
result is a ``timing.BandwidthReport``, a list of ``timing.Row``, or a ``{"rows": [dict, ...]}``
report whose dict rows name their timings ``*_us`` and their bandwidth share ``*pct_copy``).
"""

from __future__ import annotations

import csv
import importlib
import math
import pkgutil
from collections.abc import Callable
from pathlib import Path

from . import png
from .timing import BandwidthReport, Row

#: Modules of this package that are helpers, not benchmarks.
HELPERS = {"timing", "report", "png"}
#: Preferred order of the headline timing when a dict row offers several.
_HEADLINE = ("graph", "eager", "wall_minus_sync", "wall", "host")


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


def _row_from_dict(bench: str, d: dict) -> Row:
    times = {k[:-3]: float(v) for k, v in d.items() if k.endswith("_us") and isinstance(v, (int, float))}
    pct_key = next((k for k in d if k.endswith("pct_copy")), None)
    prefix = pct_key[:-len("pct_copy")] if pct_key else ""
    gbs_key = next((k for k in d if k.endswith("gbs")), None)
    # the timing the bandwidth share refers to: the faster of <prefix>graph / <prefix>eager, else a preference order
    candidates = {k: times[k] for k in (prefix + "graph", prefix + "eager") if k in times}
    if candidates:
        timing = min(candidates, key=candidates.get)
    else:
        timing = next((k for k in _HEADLINE if k in times), next(iter(times), ""))
    return Row(bench, str(d.get("case", "?")), times.get(timing, math.nan), timing, d.get("bytes"),
               d.get(gbs_key) if gbs_key else None, d.get(pct_key) if pct_key else None, times)


def rows_of(bench: str, result) -> list[Row]:
    """Normalise what a benchmark's ``run`` returned to rows."""
    if isinstance(result, BandwidthReport):
        return result.to_rows(bench)
    if isinstance(result, dict):
        return [_row_from_dict(bench, d) for d in result.get("rows", [])]
    rows = list(result)
    if not all(isinstance(r, Row) for r in rows):
        raise TypeError(f"benchmark {bench!r}: run() returned rows that are not timing.Row")
    return rows


def run_benchmarks(names: list[str], only: str = "",
                   on_start: Callable[[str], None] | None = None) -> list[Row]:
    rows = []
    for name in names:
        if on_start is not None:
            on_start(name)
        rows += rows_of(name, importlib.import_module(f"dsv4jit.bench.{name}").run(only))
    return rows


# ------------------------------------------------------------------------------------- writers

def _time_kinds(rows: list[Row]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r.times))


def _fmt(value, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def write_csv(rows: list[Row], path: Path) -> None:
    kinds = _time_kinds(rows)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["bench", "case", "timing", "us", "bytes", "gbs", "pct_copy"] + [f"{k}_us" for k in kinds])
        for r in rows:
            out.writerow([r.bench, r.case, r.timing, _fmt(r.us, 3), _fmt(r.bytes), _fmt(r.gbs, 1),
                          _fmt(r.pct_copy, 2)] + [_fmt(r.times.get(k), 3) for k in kinds])


def markdown(rows: list[Row], header: str = "") -> str:
    """One section per benchmark; columns that no row of it fills are left out."""
    out = [header] if header else []
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
        for kind in _time_kinds(mine):
            cols.append((f"{kind} µs", lambda r, k=kind: _fmt(r.times.get(k)), "---:"))
        out += [f"## {bench}", "", "| " + " | ".join(c[0] for c in cols) + " |",
                "| " + " | ".join(c[2] for c in cols) + " |"]
        out += ["| " + " | ".join(c[1](r) for c in cols) + " |" for r in mine]
        out.append("")
    return "\n".join(out)


def write_plots(rows: list[Row], out_dir: Path) -> list[Path]:
    """One PNG per benchmark that reports a share of the copy bandwidth."""
    paths = []
    for bench in dict.fromkeys(r.bench for r in rows):
        mine = [r for r in rows if r.bench == bench and r.pct_copy is not None]
        if mine:
            path = out_dir / f"{bench}.png"
            png.bar_chart(path, f"{bench}: % of copy bandwidth", [r.case for r in mine],
                          [float(r.pct_copy) for r in mine])
            paths.append(path)
    return paths


def write_report(rows: list[Row], out_dir: Path, header: str = "") -> list[Path]:
    """bench.md, bench.csv and <bench>.png files under ``out_dir`` (created); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, table = out_dir / "bench.md", out_dir / "bench.csv"
    md.write_text(markdown(rows, header))
    write_csv(rows, table)
    return [md, table] + write_plots(rows, out_dir)
