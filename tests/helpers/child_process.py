"""Child Python processes of the loader tests: the shared prelude, waiting on them, and what a
stand-in compiler recorded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

PYTHON = sys.executable

# Imports paid up front so that the timed or synchronised part of a child is only the load.
CHILD_PRELUDE = """
import json, os, sys, time
from pathlib import Path
import torch, tvm_ffi
import dsv4jit
from dsv4jit.jit import loader
from dsv4jit.jit.toolchain import Arch
VARIANT, ARCH = loader.variant("selftest", dtype="fp32", pdl=True), Arch.parse("9.0a")
"""


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"child exited ({proc.returncode}) before {what}:\n{out}\n{err}")
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def counted(path: Path) -> int:
    """Compiler runs recorded by a stand-in nvcc (one line each)."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def running(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Running processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def kill_all(pids) -> None:
    """Cleanup of processes a test started, by pid."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
