"""``dsv4jit precompile``: build variants into the cache ahead of time, in parallel."""

from __future__ import annotations

from pathlib import Path

from .common import EXIT_FAILED, EXIT_OK, emit
from .selection import add_selection, targets


def add_parser(sub) -> None:
    pc = sub.add_parser("precompile", help="build variants into the cache",
                        description="Compile kernel variants into the cache ahead of time, in parallel (by default "
                                    "the serving set, for the arches of the visible GPUs); cached ones are skipped.")
    add_selection(pc)
    add_build_options(pc)
    pc.add_argument("--keep-going", action="store_true", help="continue after a failed build")
    pc.add_argument("--dry-run", action="store_true", help="show what would be built")
    pc.set_defaults(func=cmd_precompile)


def add_build_options(sp) -> None:
    """-j and --cache-dir, for the commands that build."""
    sp.add_argument("-j", "--jobs", type=int,
                    help="parallel builds (default: DSV4JIT_JOBS, else as many as the CPUs and the free memory "
                         "allow, DSV4JIT_JOB_MEM_GB each)")
    sp.add_argument("--cache-dir",
                    help="write root (default: DSV4JIT_CACHE_DIR, else $XDG_CACHE_HOME/dsv4jit or ~/.cache/dsv4jit)")


def cmd_precompile(args) -> int:
    from ..jit import batch

    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    cached, todo = batch.partition(targets(args), root)
    results = [cached_row(r) for r in cached]
    if args.dry_run:
        results += [{"variant": r.variant.id, "arch": r.arch.name, "status": "would build", "key": r.info.key}
                    for r in todo]
        emit(args, {"results": results}, [f"{r['status']:>11}  {r['variant']}  {r['arch']}" for r in results])
        return EXIT_OK
    done = build_reporting(args, todo, "precompile", results, keep_going=args.keep_going)
    emit(args, report(results, done), [summary(results, done)])
    return EXIT_FAILED if done.failures else EXIT_OK


def cached_row(res) -> dict:
    """The ``--json`` row of a variant found in the cache."""
    return {"variant": res.variant.id, "arch": res.arch.name, "status": "cached", "entry": str(res.entry)}


def build_reporting(args, todo: list, reason: str, results: list[dict], keep_going: bool):
    """Build `todo` in parallel (``-j``), a line per build on stdout unless ``--json``, each build's
    row appended to `results`; returns the `batch.Batch`."""
    from ..jit import batch

    def progress(i: int, outcome) -> None:
        results.append(_outcome_row(outcome))
        if args.json or outcome.status == "cancelled":
            return
        if outcome.status == "built":
            done = f"{outcome.seconds:.1f}s"
        elif outcome.status == "cached":
            done = f"built by another process (waited {outcome.built.waited:.1f}s)"
        else:
            done = f"FAILED\n{outcome.error}"
        print(f"[{i}/{len(todo)}] {outcome.resolution.variant.id} {outcome.resolution.arch} {done}", flush=True)

    return batch.build_all(todo, reason, args.jobs, keep_going=keep_going, on_outcome=progress)


def _counts(results: list[dict]) -> dict:
    return {s: sum(r["status"] == s for r in results) for s in ("built", "cached", "failed", "cancelled")}


def summary(results: list[dict], done) -> str:
    counts = _counts(results)
    cancelled = f", cancelled {counts['cancelled']}" if counts["cancelled"] else ""
    return (f"built {counts['built']}, cached {counts['cached']}, failed {counts['failed']}{cancelled}, "
            f"{done.wall_seconds:.1f}s wall (-j {done.jobs})")


def report(results: list[dict], done) -> dict:
    """The ``--json`` object of a batch: every row, the counts and the wall time."""
    return {"results": results, "summary": _counts(results), "wall_seconds": round(done.wall_seconds, 2)}


def _outcome_row(outcome) -> dict:
    """A build's line of ``precompile --json``."""
    res = outcome.resolution
    row = {"variant": res.variant.id, "arch": res.arch.name, "status": outcome.status}
    if outcome.status == "built":
        row["seconds"] = round(outcome.seconds, 2)
    elif outcome.status == "cached":  # another process built it while this one waited for the key lock
        row.update(entry=str(outcome.built.entry), waited=round(outcome.built.waited, 2))
    elif outcome.status == "failed":
        row["error"] = str(outcome.error)
    return row
