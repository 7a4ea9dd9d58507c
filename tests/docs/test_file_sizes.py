"""Files a maintainer can hold in mind: every Python module of the package at most PY_LINES lines and
every CUDA header at most HEADER_LINES. A file that outgrows its bound has outgrown one concern: split
it by concern rather than raise the bound. docs/performance.md is a reference of current tables, at
most PERFORMANCE_LINES lines: runs replace its tables, they do not add to them."""

from __future__ import annotations

from pathlib import Path

import dsv4jit

ROOT = Path(dsv4jit.__file__).parent
DOCS = Path(__file__).resolve().parents[2] / "docs"
PY_LINES = 480
HEADER_LINES = 450
PERFORMANCE_LINES = 300


def _too_long(pattern: str, limit: int) -> list[str]:
    files = sorted(ROOT.rglob(pattern))
    assert files, f"no {pattern} under {ROOT}"
    lengths = {f.relative_to(ROOT).as_posix(): len(f.read_text(encoding="utf-8").splitlines()) for f in files}
    return [f"{name}: {n} lines" for name, n in lengths.items() if n > limit]


def test_python_modules_stay_small():
    too_long = _too_long("*.py", PY_LINES)
    assert not too_long, f"over {PY_LINES} lines: {too_long}"


def test_cuda_headers_stay_small():
    too_long = _too_long("*.cuh", HEADER_LINES) + _too_long("*.h", HEADER_LINES)
    assert not too_long, f"over {HEADER_LINES} lines: {too_long}"


def test_the_performance_reference_stays_short():
    lines = len((DOCS / "performance.md").read_text(encoding="utf-8").splitlines())
    assert lines <= PERFORMANCE_LINES, f"docs/performance.md: {lines} lines, over {PERFORMANCE_LINES}"
