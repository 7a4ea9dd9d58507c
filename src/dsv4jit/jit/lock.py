"""The per-key file lock that builds (and ``clean``) take, and the owner files that name its holder.

The lock file is never deleted, so every waiter locks the same inode; it lives beside the entry, or
under DSV4JIT_LOCK_DIR with the same relative layout. A waiter logs who holds it and gives up after
DSV4JIT_LOCK_TIMEOUT.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import filelock

from .. import env
from ..errors import DSV4JITLockTimeout
from . import cache, metadata
from .compiler import Stop

log = logging.getLogger("dsv4jit")


def lock_file(root: Path, entry: Path) -> Path:
    """The per-key lock of `entry` (or of a stage or set-aside folder of its key, `cache.entry_of`):
    next to the entry, or under DSV4JIT_LOCK_DIR with the same relative layout. Its folder is made."""
    entry = cache.entry_of(entry)
    locks = env.lock_dir()
    base = locks / entry.parent.relative_to(root) if locks else entry.parent
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cache.write_error(e, base, lock_setting()) from e
    return base / f"{entry.name}.lock"


#: What an owner file must hold (`metadata.read`); "since" and "variant" are for people.
OWNER_FIELDS = {"pid": metadata.PID, "host": str}


def read_owner(path: Path) -> tuple[int, str] | None:
    """(pid, host) of an owner file (a stage's ``owner.json``, a lock's ``.owner``), or None."""
    owner, _ = metadata.read(path, OWNER_FIELDS)
    return (owner["pid"], owner["host"]) if owner is not None else None


class KeyLock:
    """flock on a file that is never deleted (waiters share its inode), with progress logs. `what`
    names the holder's work in the owner file and the logs (a variant id, or what clean removes)."""

    def __init__(self, path: Path, what: str, stop: Stop | None = None):
        self.path, self.what, self.stop = path, what, stop
        self.owner = path.with_name(path.name + ".owner")
        self.lock = filelock.FileLock(str(path))

    def __enter__(self) -> "KeyLock":
        self.since = time.time()  # a failure recorded after this is one this process waited for
        start = time.monotonic()
        limit = env.lock_timeout()
        logged = 0.0
        while True:
            if self.stop is not None:
                self.stop.check()
            try:  # short slices, so that a stopped batch stops waiting soon
                self.lock.acquire(timeout=min(1.0, max(0.05, limit - (time.monotonic() - start))))
                break
            except filelock.Timeout:
                waited = time.monotonic() - start
                if waited >= limit:
                    raise DSV4JITLockTimeout(
                        f"dsv4jit: gave up after {waited:.0f}s waiting for the build of {self.what} "
                        f"held by {self._holder()} (lock {self.path}; DSV4JIT_LOCK_TIMEOUT)") from None
                if waited - logged >= 10.0:
                    logged = waited
                    log.warning("dsv4jit: waiting for build of %s held by %s for %.0fs", self.what, self._holder(),
                                waited)
            except OSError as e:  # the lock file cannot be opened (checked after Timeout, an OSError too)
                raise cache.write_error(e, self.path.parent, lock_setting()) from e
        self.waited = time.monotonic() - start
        try:
            self.owner.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                              "since": time.time(), "variant": self.what}))
        except OSError:
            pass
        return self

    def _holder(self) -> str:
        owner = read_owner(self.owner)
        return f"pid {owner[0]} on host {owner[1]}" if owner else "another process"

    def __exit__(self, *exc) -> None:
        self.lock.release()


def lock_setting() -> str:
    """The variable that moves the lock files."""
    return "DSV4JIT_LOCK_DIR" if env.lock_dir() else "DSV4JIT_CACHE_DIR"
