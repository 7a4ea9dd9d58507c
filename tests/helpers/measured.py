"""A pytest plugin: figures a test measured for a person to read (``record_property("measured", text)``),
printed at the end of the run, one line each, rather than among pytest's progress dots. Loaded by
conftest.py."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:
    lines = [value for report in terminalreporter.stats.get("passed", [])
             for name, value in report.user_properties if name == "measured"]
    if lines:
        terminalreporter.write_sep("-", "measured by the tests")
        for line in lines:
            terminalreporter.write_line(f"  {line}")
