"""``dsv4jit bench``: every benchmark module in one process, written as markdown, CSV and plots."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import __version__
from .common import EXIT_OK, JSON_HELP, UsageError, emit


def add_parser(sub) -> None:
    pb = sub.add_parser("bench", help="run the kernel benchmarks (L2-cold); write markdown, CSV and, with "
                        "matplotlib, PNG plots",
                        description="Run the kernel benchmarks on the GPU, every call timed with the L2 flushed "
                                    "before it (warm figures beside), and write bench.md, bench.csv and, with "
                                    "matplotlib, a bar chart per benchmark.")
    pb.add_argument("--out", help="output folder (bench.md, bench.csv, <bench>.png with matplotlib); required "
                    "unless --list")
    pb.add_argument("--bench", action="append",
                    help="run only this benchmark module (repeatable; default: every module)")
    pb.add_argument("--only", default="", help="run the cases whose name contains this text (default: every case)")
    pb.add_argument("--list", action="store_true", help="list the benchmark modules and exit")
    pb.add_argument("--json", action="store_true", help=JSON_HELP)
    pb.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from ..bench import report

    names = report.discover()
    unknown = sorted(set(args.bench or []) - set(names))
    if unknown:
        raise UsageError(f"unknown benchmark {', '.join(unknown)}; known: {', '.join(names)}")
    names = [n for n in names if not args.bench or n in args.bench]
    if args.list:
        emit(args, {"benchmarks": names}, names)
        return EXIT_OK
    if why := report.no_gpu("bench"):
        raise UsageError(why)
    import torch

    if not args.out:
        raise UsageError("bench needs --out DIR (or --list)")
    rows = report.run_benchmarks(names, args.only, on_start=lambda n: print(f"running dsv4jit.bench.{n}",
                                                                            file=sys.stderr, flush=True))
    header = (f"# dsv4jit benchmarks\n\n{torch.cuda.get_device_name()}, dsv4jit {__version__}, "
              f"torch {torch.__version__}.\n")
    paths = report.write_report(rows, Path(args.out), header)
    if not report.can_plot():
        print(report.PLOTS_NEED, file=sys.stderr)
    emit(args, {"files": [str(p) for p in paths], "rows": [vars(r) for r in rows]},
         [report.markdown(rows)] + [f"wrote {p}" for p in paths])
    return EXIT_OK
