"""Readers of the repository's markdown for the docs tests: fenced code blocks, the section under a
heading, and the rows of the tables in a piece of text."""

from __future__ import annotations

import re

HEADING = re.compile(r"^(#+) ", re.M)
CELL_RULE = re.compile(r"^:?-+:?$")


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks tagged `language` ("" for untagged fences)."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.S | re.M)


def section(text: str, heading: str) -> str:
    """The text under the line `heading` (e.g. "## `warmup`"), up to the next heading of its level
    or above (lines inside fenced blocks are not headings)."""
    level = len(heading.split(" ", 1)[0])
    lines, start, fenced = text.splitlines(keepends=True), None, False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if fenced:
            continue
        if start is None and line.rstrip("\n") == heading:
            start = i + 1
        elif start is not None and (m := HEADING.match(line)) and len(m.group(1)) <= level:
            return "".join(lines[start:i])
    assert start is not None, f"no heading {heading!r}"
    return "".join(lines[start:])


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every table in `text` (header and rule left out), as lists of stripped cells;
    an escaped ``\\|`` stays inside its cell."""
    rows = []
    for table in re.findall(r"(?:^\|.*\n?)+", text, re.M):
        lines = [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] for line in table.splitlines()]
        has_header = len(lines) > 1 and all(CELL_RULE.match(c) for c in lines[1])
        rows += lines[2:] if has_header else lines
    return rows
