"""The one reader of the cache's metadata files: ``manifest.json``, ``toolchain.json``, a stage's
``owner.json``, a lock's ``.owner`` and ``failure.json``.

Any of them may have been written by hand, by a killed or broken writer, by another version, or by
another user of a shared cache, so each is parsed with bounds before anything trusts it: a regular
file of at most `MAX_BYTES`, JSON nested at most `MAX_DEPTH` deep (the decoder recurses once per
level), finite numbers, no NUL in any string (paths are made of them), and each named field of its
type and range. A file of any other form is reported with why, so that its reader treats it as
missing, or its entry as damaged: never a crash, never a permanent block.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

#: A manifest holds a few KB (the key document, the depfile's paths); nothing here comes near.
MAX_BYTES = 1 << 20
#: The deepest form is toolchain.json's (table, record, deps, stamp): 4 levels.
MAX_DEPTH = 16

#: Field kinds beyond JSON types: a process id (pid_t, and > 0) and a count of bytes.
PID = range(1, 2**31)
COUNT = range(0, 2**63)
NUMBER = (int, float)

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


class Malformed(ValueError):
    """A file that parses as JSON text, or would, but not within the bounds."""


def _depth(text: str) -> int:
    """How deep the arrays and objects of JSON `text` nest (strings removed first); it stops
    counting past MAX_DEPTH."""
    depth = deepest = 0
    for bracket in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
    return deepest


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Malformed(f"a number out of range ({text[:20]})")
    return value


def _not_a_number(text: str):
    raise Malformed(f"a number that is not finite ({text})")


def _no_nul(value) -> None:
    if isinstance(value, str):
        if "\0" in value:
            raise Malformed(f"a NUL character in the text {json.dumps(value)[:40]}")
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_nul(key)
            _no_nul(item)
    elif isinstance(value, list):
        for item in value:
            _no_nul(item)


def _read_bounded(path: Path) -> bytes:
    """The bytes of regular file `path` (MAX_BYTES + 1 at most); opened without blocking, so that a
    FIFO put in its place is refused rather than waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Malformed("not a regular file")
        chunks, size = [], 0
        while size <= MAX_BYTES and (chunk := os.read(fd, MAX_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def load(path: Path) -> tuple[dict | None, str | None]:
    """The JSON object in `path` within the bounds above, else None and why not."""
    try:
        data = _read_bounded(path)
        if len(data) > MAX_BYTES:
            raise Malformed(f"larger than {MAX_BYTES} bytes")
        text = data.decode()
        # the scans run only where the cheap counts cannot rule out what they look for
        if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
            raise Malformed(f"nested deeper than {MAX_DEPTH} levels")
        value = json.loads(text, parse_float=_finite, parse_constant=_not_a_number)
        if "\\u0000" in text:  # the only way JSON text holds a NUL (a raw one is invalid)
            _no_nul(value)
    except Malformed as e:
        return None, f"malformed: {e}"
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return None, "missing or unreadable"
    if not isinstance(value, dict):
        return None, f"malformed: not a JSON object ({json.dumps(value)[:40]})"
    return value, None


def _fits(value, kind) -> bool:
    if isinstance(kind, range):
        return type(value) is int and value in kind
    return isinstance(value, kind) and not isinstance(value, bool)


def read(path: Path, fields: dict) -> tuple[dict | None, str | None]:
    """`load`, and each of `fields` present with its kind: a JSON type (or a tuple of them), or a
    `range` of ints (`PID`, `COUNT`); else None and why not (``malformed: its 'pid' is ...``)."""
    value, problem = load(path)
    if value is None:
        return None, problem
    for field, kind in fields.items():
        if not _fits(value.get(field), kind):
            return None, f"malformed: its {field!r} is {json.dumps(value.get(field))[:40]}"
    return value, None
