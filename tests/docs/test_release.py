"""The release artefacts: the licence, the changelog, one version, the type marker."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import dsv4jit

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_licence_is_the_apache_text_that_pyproject_declares():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License\n" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]


def test_the_version_is_written_once():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dsv4jit.__version__"}
    assert importlib.metadata.version("dsv4jit") == dsv4jit.__version__  # what the installer read


def test_the_changelog_opens_with_this_version():
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert headings and headings[0] == dsv4jit.__version__


def test_the_package_is_marked_typed():
    assert (Path(dsv4jit.__file__).parent / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["dsv4jit"]
