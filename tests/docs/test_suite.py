"""The test suite's own promises: two documented commands (the default one a person runs first, and
the full one CI runs), the full tier left out of the default, skips counted per reason, and what
tests measured printed after the run, not among the progress dots."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_command(tier: str) -> str:
    """The bash block after ``<!-- test-command: <tier> -->`` in the README (what .ci/run extracts)."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(rf"<!-- test-command: {tier} -->\n```bash\n(.*?)\n```", text, re.S)
    assert len(blocks) == 1, f"the README needs one {tier} test command"
    return blocks[0]


def test_readme_has_a_default_and_a_full_test_command_and_ci_runs_the_full_one():
    default, full = readme_command("default"), readme_command("full")
    assert "pytest" in default and "--full" not in default
    assert "pytest" in full and "--full" in full.split()
    assert "readme_block full" in (REPO / ".ci" / "run").read_text()


def test_the_default_run_leaves_the_full_tier_out():
    # Run in a child, as a person would; if the tier ran, this would compile for minutes and time out.
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/jit/test_compile_serving_set.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"^\s+2  in the full suite only \(.*\): add --full$", res.stdout, re.M), res.stdout
    assert "2 skipped" in res.stdout.splitlines()[-1]


def test_skips_are_counted_per_reason_on_one_line_each(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.skipif(True, reason="needs a thing")
        def test_a(): pass

        @pytest.mark.skipif(True, reason="needs a thing")
        @pytest.mark.parametrize("i", range(3))
        def test_b(i): pass

        def test_c(): pytest.skip("another reason")

        def test_d(): pass
    """)
    result = pytester.runpytest("-p", "helpers.skip_summary", "-q")
    result.assert_outcomes(passed=1, skipped=5)
    lines = result.outlines
    start = next(i for i, line in enumerate(lines) if "skipped, by reason" in line)
    assert lines[start + 1:start + 3] == ["    4  needs a thing", "    1  another reason"]
    assert "5 skipped" in lines[start + 3]


def test_what_tests_measure_is_printed_after_the_run(pytester):
    pytester.makepyfile("""
        def test_a(record_property): record_property("measured", "import: 12.5 ms")

        def test_b(record_property): record_property("measured", "warm load: 8.0 ms")

        def test_c(): pass
    """)
    result = pytester.runpytest("-p", "helpers.measured", "-q")
    result.assert_outcomes(passed=3)
    lines = result.outlines
    assert lines[0].split() == ["...", "[100%]"]  # the dots alone
    start = next(i for i, line in enumerate(lines) if "measured by the tests" in line)
    assert lines[start + 1:start + 3] == ["  import: 12.5 ms", "  warm load: 8.0 ms"]
