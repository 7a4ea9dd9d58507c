"""A pytest plugin: skipped tests counted per reason, one line each, at the end of the run.

``-rs`` prints one line per test location, which on a machine without a GPU is a page of the same
"needs a CUDA GPU"; this says the same in a few lines. Loaded by conftest.py.
"""

from __future__ import annotations

from collections import Counter


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)  # (path, line, "Skipped: why")
    return text.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter) -> None:
    reasons = Counter(_reason(r) for r in terminalreporter.stats.get("skipped", []))
    if reasons:
        terminalreporter.write_sep("-", "skipped, by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")
