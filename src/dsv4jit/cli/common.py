"""What every command shares: exit codes, the usage error, the help formatter and the output helpers."""

from __future__ import annotations

import argparse
import json

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3
JSON_HELP = "machine-readable output on stdout"


class UsageError(Exception):
    """A command-line argument is wrong; raised only in this package, where arguments are parsed and
    validated (a library error is wrapped in it only at the call that validates that argument)."""


class Help(argparse.HelpFormatter):
    """--help shows the default of every option that takes a value: argparse's value, unless the text
    states it (defaults that come from the environment); flags are off unless given."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.nargs != 0 and action.default is not None and "default" not in text:
            text += " (default: %(default)s)"
        return text


def columns(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """`rows` under a header line that labels their columns, each column as wide as its widest cell (a
    cell past the header's columns is left out); the header alone without rows."""
    cells = [header] + [tuple(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]


def emit(args, payload, lines: list[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=1, default=str))
    else:
        for line in lines:
            print(line)
