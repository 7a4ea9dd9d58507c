"""Building many variants at once: the thread pool behind ``precompile`` and ``dsv4jit.warmup``.

Each build runs under its own key lock (build.py), so the builds of one batch run in parallel and
cooperate with other processes building the same keys. A build that fails with a `DSV4JITError` is
an outcome of the batch. A setting error (the same for every build) or any other exception (a bug,
Ctrl-C, SIGTERM turned into an exception) cancels the builds not yet started, kills the compilers of
those under way, whose stages are removed and which publish nothing, and propagates.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import DSV4JITError, DSV4JITSettingError
from . import build, compiler, loader
from .loader import Resolution
from .registry import Variant
from .toolchain import Arch


def default_jobs(n: int) -> int:
    """Parallel compiles for `n` variants: DSV4JIT_JOBS, else bounded by CPUs and by available memory
    (DSV4JIT_JOB_MEM_GB per nvcc)."""
    if explicit := env.jobs():
        return explicit
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        by_mem = int(avail_kb / 2**20 // env.job_mem_gb())
    except (OSError, StopIteration):
        by_mem = os.cpu_count() or 1
    return max(1, min(os.cpu_count() or 1, by_mem, n))


def partition(pairs: Iterable[tuple[Variant, Arch]], root: Path | None = None) -> tuple[list[Resolution], list[Resolution]]:
    """The (variant, arch) pairs resolved against the cache (write root `root`, default
    DSV4JIT_CACHE_DIR's), as (cached, to build); with DSV4JIT_FORCE_REBUILD=1 every pair is to build.
    Raises the `DSV4JITToolchainError` of the first pair to build when no compiler is found for it:
    nothing could be built here."""
    cached, to_build = [], []
    for variant, arch in pairs:
        res = loader.resolve(variant, arch, root)
        if res.entry is not None and not env.force_rebuild():
            cached.append(res)
        elif res.toolchain_error is not None:
            raise res.toolchain_error
        else:
            to_build.append(res)
    return cached, to_build


@dataclass(frozen=True)
class Outcome:
    """What became of one build. `status`: "built"; "cached" when another process published the
    entry while this one waited for the key lock (`built.waited` says how long); "failed" (`error`);
    or "cancelled" (not started, after a failure without keep_going)."""

    resolution: Resolution
    status: str
    built: build.Built | None = None
    seconds: float = 0.0  # wall time of this build, lock wait included
    error: DSV4JITError | None = None


@dataclass(frozen=True)
class Batch:
    outcomes: list[Outcome]  # in the order the builds ended
    jobs: int  # parallel builds used
    wall_seconds: float

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def build_all(todo: list[Resolution], reason: str, jobs: int | None = None, *, keep_going: bool = True,
              on_outcome: Callable[[int, Outcome], None] | None = None) -> Batch:
    """Build every resolution of `todo` (each with a toolchain: see `partition`) with `jobs` threads
    (default: `default_jobs`). `reason` is logged with each compile. Without `keep_going`, builds not
    yet started are cancelled after the first failure. `on_outcome(i, outcome)` is called as the
    i-th build ends (1-based), from the calling thread."""
    jobs = jobs or default_jobs(len(todo))
    start = time.monotonic()
    outcomes: list[Outcome] = []
    stop = compiler.Stop()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(_timed_build, res, reason, stop): res for res in todo}
        try:
            for future in as_completed(futures):
                outcome = _outcome(futures[future], future)
                if outcome.status == "failed" and not keep_going:
                    _cancel(futures)
                outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(len(outcomes), outcome)
        except BaseException:  # the pool's exit waits for every build it has: start no more, stop the others
            _cancel(futures)
            stop.set()
            raise
    return Batch(outcomes, jobs, time.monotonic() - start)


def _timed_build(res: Resolution, reason: str, stop: compiler.Stop) -> tuple[build.Built, float]:
    start = time.monotonic()
    return loader.build_resolved(res, reason, stop=stop), time.monotonic() - start


def _outcome(res: Resolution, future: Future) -> Outcome:
    if future.cancelled():
        return Outcome(res, "cancelled")
    try:
        built, seconds = future.result()
    except DSV4JITSettingError:
        raise
    except DSV4JITError as e:
        return Outcome(res, "failed", error=e)
    return Outcome(res, "built" if built.compiled else "cached", built, seconds)


def _cancel(futures: Iterable[Future]) -> None:
    for future in futures:
        future.cancel()  # a no-op for builds already running or done
