"""``dsv4jit list``: the selected variants per arch as cached or missing, or what the cache roots hold."""

from __future__ import annotations

import sys

from .common import EXIT_FAILED, EXIT_OK, columns, emit
from .selection import add_selection, targets


def add_parser(sub) -> None:
    pl = sub.add_parser("list", help="variants and their cache status",
                        description="Show the selected variants per arch as cached or missing (the same selection "
                                    "as precompile), or with --entries what the cache roots hold.")
    add_selection(pl)
    pl.add_argument("--status", choices=("all", "cached", "missing"), default="all",
                    help="show only the variants with this cache status; 'missing' exits 1 when any is")
    pl.add_argument("--entries", action="store_true", help="list what is on disk instead, incl. orphans")
    pl.set_defaults(func=cmd_list)


def cmd_list(args) -> int:
    from ..jit import inventory

    if args.entries:
        rows = inventory.entries()
        notes = ["orphan" if r["orphan"] else "" for r in rows]
        emit(args, {"entries": rows}, columns(
            ("variant", "arch", "key", "bytes", "entry") + (("note",) if any(notes) else ()),
            [(r["variant"], r["arch"], r["key"], r["size"], r["entry"], note) for r, note in zip(rows, notes)]))
        return EXIT_OK
    selected = inventory.variant_status(targets(args))
    rows = [r for r in selected if args.status in ("all", r["status"])]
    notes = ["; ".join(f"damaged: {d['entry']}: {d['problem']}" for d in r["damaged"]) for r in rows]
    emit(args, {"variants": rows}, columns(
        ("status", "variant", "arch", "bytes", "build s") + (("note",) if any(notes) else ()),
        [(r["status"], r["variant"], r["arch"], r["size"] or "-", r["build_seconds"] if r["size"] else "-", note)
         for r, note in zip(rows, notes)]))
    if args.status == "missing" and rows:  # the check of an image: its exit status says whether it is complete
        print(f"dsv4jit: {len(rows)} of {len(selected)} selected variants are missing", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
