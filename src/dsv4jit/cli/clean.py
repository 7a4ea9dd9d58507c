"""``dsv4jit clean``: delete cache entries, only inside the write root."""

from __future__ import annotations

import re

from .common import EXIT_OK, JSON_HELP, UsageError, emit
from .selection import archs, spec


def add_parser(sub) -> None:
    pk = sub.add_parser("clean", help="delete cache entries (only inside the write root)",
                        description="Delete cache entries inside the write root: all of them, or those of an arch, a "
                                    "kernel or an age, superseded keys, leftovers of builds, orphans.")
    pk.add_argument("--all", action="store_true",
                    help="every entry, old schemas, abandoned stages and failed-build logs (live builds are kept)")
    pk.add_argument("--arch", help="entries built for these arches, e.g. 9.0a or 9.0a,10.0a (host entries: "
                                   "--kernel plan_host)")
    pk.add_argument("--kernel", action="append", help="entries of this kernel (repeatable)")
    pk.add_argument("--stale", action="store_true",
                    help="superseded keys, old schemas, abandoned stages, failed-build logs")
    pk.add_argument("--older-than", help="entries built before this age, e.g. 30d, 12h, 90m or 3600s")
    pk.add_argument("--orphans", action="store_true", help="entries of variants the registry no longer has")
    pk.add_argument("--dry-run", action="store_true", help="list what would be removed and the bytes freed; remove "
                                                            "nothing")
    pk.add_argument("--json", action="store_true", help=JSON_HELP)
    pk.set_defaults(func=cmd_clean)


def _parse_age(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if not m:
        raise UsageError(f"--older-than must look like 30d, 12h, 90m or 3600s, got {text!r}")
    return float(m.group(1)) * {"": 86400, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def cmd_clean(args) -> int:
    from ..jit.clean import clean

    if not any((args.all, args.arch, args.kernel, args.stale, args.older_than, args.orphans)):
        raise UsageError("clean needs a selection: --all, --arch, --kernel, --stale, --older-than or --orphans")
    kernels = {spec(kernel).name for kernel in args.kernel or ()}
    max_age = _parse_age(args.older_than) if args.older_than else None
    arch_names = {a.name for a in archs(args.arch)} if args.arch else set()
    done = clean(everything=args.all, archs=arch_names, kernels=kernels, stale=args.stale, older_than=max_age,
                 orphans=args.orphans, dry_run=args.dry_run)
    verb = "would free" if done.dry_run else "freed"
    emit(args, {"removed": [str(p) for p in done.removed], "bytes": done.bytes, "dry_run": done.dry_run},
         [f"{'would remove' if done.dry_run else 'removed'} {p}" for p in done.removed] +
         [f"{verb} {done.bytes} bytes in {len(done.removed)} paths under {done.root}"])
    return EXIT_OK
