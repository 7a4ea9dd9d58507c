"""While compiles run, a line on the ``dsv4jit`` logger every ``INTERVAL`` seconds with their elapsed
times, so that a build of a minute or more shows it is alive (one line for all of a process's parallel
builds, not one per build)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("dsv4jit")

INTERVAL = 10.0  # seconds between lines; the first comes when a build has run this long
SHOWN = 3  # builds named per line; the others are counted

_lock = threading.Lock()
_running: dict[int, tuple[str, float]] = {}  # token -> (what, start)
_ticker: list[threading.Thread] = []  # the running ticker thread, if any


@contextmanager
def compiling(what: str) -> Iterator[None]:
    """Count `what` (e.g. ``plan[pdl=1] for sm_90a``) as compiling for the duration of the block."""
    token = object()
    with _lock:
        _running[id(token)] = (what, time.monotonic())
        if not _ticker:
            _ticker.append(threading.Thread(target=_tick, name="dsv4jit-compile-progress", daemon=True))
            _ticker[0].start()
    try:
        yield
    finally:
        with _lock:
            del _running[id(token)]


def _tick() -> None:
    last = 0.0  # when the last line was written
    while True:
        time.sleep(min(INTERVAL, 1.0))  # short naps, so a changed INTERVAL applies soon
        with _lock:
            if not _running:  # the next compile starts a new ticker
                _ticker.clear()
                return
            now = time.monotonic()
            builds = sorted(_running.values(), key=lambda item: item[1])
        if now - builds[0][1] < INTERVAL or now - last < INTERVAL:
            continue
        last = now
        named = ", ".join(f"{what} ({now - start:.0f}s)" for what, start in builds[:SHOWN])
        more = f" and {len(builds) - SHOWN} more" if len(builds) > SHOWN else ""
        log.info("dsv4jit: ... still compiling %s%s", named, more)
