"""``python -m dsv4jit`` / ``dsv4jit``: demo, bench, precompile, list, clean, info.

This module parses arguments and prints; what the commands do lives in the library (jit/ for the
cache). Exit codes:

* 0: success;
* 1: the command ran and something it checked failed: a build, ``info --check``, a demo comparison,
  or another `DSV4JITError` (its message, no traceback);
* 2: the command cannot run as asked, and the message says what to change: an argument (argparse's
  own errors, and a `UsageError` raised here while parsing or validating one), a ``DSV4JIT_*``
  setting (`DSV4JITSettingError`), or a missing compiler (`DSV4JITToolchainError`);
* 3: a bug in dsv4jit: any other exception, a ValueError from inside the library included, with
  its traceback;
* 130, 143: interrupted by Ctrl-C (SIGINT) or stopped by SIGTERM (128 + the signal, the shell's
  convention): compiles under way are killed and publish nothing, and one line says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import signal
import sys
import threading
import traceback
from pathlib import Path

from . import __version__, env
from .errors import DSV4JITError, DSV4JITSettingError, DSV4JITToolchainError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3


class UsageError(Exception):
    """A command-line argument is wrong; raised only here, where arguments are parsed and validated
    (a library error is wrapped in it only at the call that validates that argument)."""


# --------------------------------------------------------------------------------------------
# Selection helpers


#: The target of every subcommand when no GPU is visible and neither --arch nor DSV4JIT_CUDA_ARCH is
#: given: the kernels are written for Hopper.
NO_GPU_ARCH = "9.0a"
ARCH_DEFAULT = f"(default: DSV4JIT_CUDA_ARCH, else auto; with no GPU visible: {NO_GPU_ARCH}, said on stderr)"


def _archs(text: str | None) -> list:
    from .jit.toolchain import Arch, device_target, forced_arch

    if text in (None, ""):
        if forced := forced_arch():
            return [forced]
        text = "auto"
    if text == "auto":
        import torch

        if not torch.cuda.is_available():
            arch = Arch.parse(NO_GPU_ARCH)
            print(f"dsv4jit: no GPU visible: targeting {arch} (pass --arch or set DSV4JIT_CUDA_ARCH for another)",
                  file=sys.stderr)
            return [arch]
        return sorted({device_target(i) for i in range(torch.cuda.device_count())}, key=str)
    try:
        return [Arch.parse(a) for a in text.split(",") if a.strip()]
    except ValueError as e:
        raise UsageError(str(e)) from None


def _spec(kernel: str):
    """The spec of a kernel named on the command line (by --kernel or in a variant id)."""
    from .jit.kernels import SPECS

    if kernel not in SPECS:
        raise UsageError(f"unknown kernel {kernel!r}; known: {', '.join(sorted(SPECS))}")
    return SPECS[kernel]


def _variant_id(text: str):
    """Parse a variant id; errors show ids of that kernel to copy."""
    from .jit.kernels import SPECS
    from .jit.registry import parse_variant_id

    spec = _spec(text.partition("[")[0])
    try:
        return parse_variant_id(text, SPECS)
    except ValueError as e:
        from .runtime import serving_variants

        examples = list(dict.fromkeys(v.id for v in serving_variants(spec) + spec.all_variants()))[:2]
        raise UsageError(f"{e}; variant ids look like {' or '.join(examples)} "
                         f"(all of them: python -m dsv4jit list --kernel {spec.name} --set all)") from None


def _variants(kernels: list[str] | None, sets: list[str] | None, filters: list[str] | None = None) -> list:
    from .jit.kernels import SPECS
    from .jit.registry import unique
    from .runtime import serving_variants

    specs = [_spec(k) for k in kernels] if kernels else list(SPECS.values())
    out = []
    for s in sets or ["default"]:
        if s == "default":
            out += [v for spec in specs for v in serving_variants(spec)]
        elif s == "all":
            out += [v for spec in specs for v in spec.all_variants()]
        else:
            out.append(_variant_id(s))
    for f in filters or []:  # --param name=value keeps variants whose spec has no such param or matches it
        name, eq, value = f.partition("=")
        if not eq:
            raise UsageError(f"--param must look like name=value, got {f!r}")
        def keep(v, name=name, value=value) -> bool:
            param = v.spec.param(name)
            return param is None or v.params[name] == param.canonical(value)

        try:
            out = [v for v in out if keep(v)]
        except ValueError as e:
            raise UsageError(str(e)) from None
    return unique(out)


def _targets(args) -> list[tuple]:
    """(variant, arch) pairs; host-only kernels build once for the host target."""
    from .jit.toolchain import Arch

    variants = _variants(args.kernel, args.set, args.param)
    needs_gpu_arch = any(v.spec.target == "cuda" for v in variants)
    archs = _archs(args.arch) if needs_gpu_arch else []
    pairs = []
    for v in variants:
        for a in ([Arch.host()] if v.spec.target == "host" else archs):
            pairs.append((v, a))
    return pairs


def _columns(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """`rows` under a header line that labels their columns, each column as wide as its widest cell (a
    cell past the header's columns is left out); nothing at all without rows (so that ``list --status
    missing`` prints nothing for a complete image)."""
    if not rows:
        return []
    cells = [header] + [tuple(map(str, row)) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]


def _emit(args, payload, lines: list[str]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, indent=1, default=str))
    else:
        for line in lines:
            print(line)


# --------------------------------------------------------------------------------------------
# Subcommands


def cmd_precompile(args) -> int:
    from .jit import batch

    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    cached, todo = batch.partition(_targets(args), root)
    results = [{"variant": r.variant.id, "arch": r.arch.name, "status": "cached", "entry": str(r.entry)}
               for r in cached]
    if args.dry_run:
        results += [{"variant": r.variant.id, "arch": r.arch.name, "status": "would build", "key": r.info.key}
                    for r in todo]
        _emit(args, {"results": results}, [f"{r['status']:>11}  {r['variant']}  {r['arch']}" for r in results])
        return EXIT_OK

    def progress(i: int, outcome) -> None:
        row = _outcome_row(outcome)
        results.append(row)
        if args.json or outcome.status == "cancelled":
            return
        if outcome.status == "built":
            done = f"{outcome.seconds:.1f}s"
        elif outcome.status == "cached":
            done = f"built by another process (waited {outcome.built.waited:.1f}s)"
        else:
            done = f"FAILED\n{outcome.error}"
        print(f"[{i}/{len(todo)}] {outcome.resolution.variant.id} {outcome.resolution.arch} {done}", flush=True)

    done = batch.build_all(todo, "precompile", args.jobs, keep_going=args.keep_going, on_outcome=progress)
    counts = {s: sum(r["status"] == s for r in results) for s in ("built", "cached", "failed", "cancelled")}
    cancelled = f", cancelled {counts['cancelled']}" if counts["cancelled"] else ""
    summary = (f"built {counts['built']}, cached {counts['cached']}, failed {counts['failed']}{cancelled}, "
               f"{done.wall_seconds:.1f}s wall (-j {done.jobs})")
    _emit(args, {"results": results, "summary": counts, "wall_seconds": round(done.wall_seconds, 2)}, [summary])
    return EXIT_FAILED if done.failures else EXIT_OK


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


def cmd_list(args) -> int:
    from .jit import inventory

    if args.entries:
        rows = inventory.entries()
        notes = ["orphan" if r["orphan"] else "" for r in rows]
        _emit(args, {"entries": rows}, _columns(
            ("variant", "arch", "key", "bytes", "entry") + (("note",) if any(notes) else ()),
            [(r["variant"], r["arch"], r["key"], r["size"], r["entry"], note) for r, note in zip(rows, notes)]))
        return EXIT_OK
    rows = [r for r in inventory.variant_status(_targets(args)) if args.status in ("all", r["status"])]
    notes = ["; ".join(f"damaged: {d['entry']}: {d['problem']}" for d in r["damaged"]) for r in rows]
    _emit(args, {"variants": rows}, _columns(
        ("status", "variant", "arch", "bytes", "build s") + (("note",) if any(notes) else ()),
        [(r["status"], r["variant"], r["arch"], r["size"] or "-", r["build_seconds"] if r["size"] else "-", note)
         for r, note in zip(rows, notes)]))
    return EXIT_OK


def _parse_age(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if not m:
        raise UsageError(f"--older-than must look like 30d, 12h, 90m or 3600s, got {text!r}")
    return float(m.group(1)) * {"": 86400, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def cmd_clean(args) -> int:
    from .jit.clean import clean

    if not any((args.all, args.arch, args.kernel, args.stale, args.older_than, args.orphans)):
        raise UsageError("clean needs a selection: --all, --arch, --kernel, --stale, --older-than or --orphans")
    kernels = {_spec(kernel).name for kernel in args.kernel or ()}
    max_age = _parse_age(args.older_than) if args.older_than else None
    archs = {a.name for a in _archs(args.arch)} if args.arch else set()
    done = clean(everything=args.all, archs=archs, kernels=kernels, stale=args.stale, older_than=max_age,
                 orphans=args.orphans, dry_run=args.dry_run)
    verb = "would free" if done.dry_run else "freed"
    _emit(args, {"removed": [str(p) for p in done.removed], "bytes": done.bytes, "dry_run": done.dry_run},
          [f"{'would remove' if done.dry_run else 'removed'} {p}" for p in done.removed] +
          [f"{verb} {done.bytes} bytes in {len(done.removed)} paths under {done.root}"])
    return EXIT_OK


def cmd_info(args) -> int:
    from . import runtime
    from .jit import inventory

    info = inventory.installation()
    gpus = info["gpus"]
    status = EXIT_OK
    v = _variant_id(args.variant) if args.variant else None
    archs = _archs(args.arch) if args.check or (v is not None and v.spec.target != "host") else []
    if v is not None:
        info["variant"] = inventory.variant_keys(v, archs)
    if args.check:
        check = runtime.self_check(archs[0])
        info["check"] = {"ok": check.ok, "detail": check.detail}
        status = EXIT_OK if check.ok else EXIT_FAILED
    lines = [f"dsv4jit {info['dsv4jit']} (python {info['python']})"]
    nv = info["nvcc"]
    lines.append(f"nvcc: {nv.get('path', '-')} ({nv.get('version', nv.get('error'))})")
    if "cxx" in info:
        lines.append(f"host compiler: {info['cxx']['path']} ({info['cxx']['version']})")
    lines.append(f"tvm-ffi: {info['tvm_ffi']['version']} ({info['tvm_ffi']['include']})")
    lines.append(f"torch: {info['torch']['version']} (dlpack exchange api: {info['torch']['dlpack_c_exchange_api']})")
    lines += [f"gpu {g['index']}: {g['name']} -> {g['arch']}" for g in gpus] or ["gpus: none visible"]
    lines += [f"cache root: {r['path']} ({'writable' if r['writable'] else 'read-only'}, {r['bytes']} B)"
              for r in info["cache_roots"]]
    lines += [f"env: {k}={v}" for k, v in info["env"].items()]
    for item in info.get("variant", []):
        lines.append(f"variant {args.variant} {item['arch']}: key {item['key']} entry {item['entry']}")
        lines.append(json.dumps(item["document"], indent=1))
    if "check" in info:
        c = info["check"]
        lines.append(f"check: {'ok' if c['ok'] else 'FAILED'} - {c['detail']}")
    _emit(args, info, lines)
    return status


def cmd_demo(args) -> int:
    from .demo import run

    if args.speculative:
        return _speculative_demo(args)
    try:  # the calls that validate the options: their ValueErrors name the option
        device = run.resolve_device(args.device)
        config = run.config_for(device, requests=args.requests, min_prompt=args.min_prompt,
                                max_prompt=args.max_prompt, chunk=args.chunk, decode_steps=args.decode_steps,
                                layers=args.layers, seed=args.seed, indexer_fp8=args.indexer_fp8 or None,
                                graph=False if args.eager else None, decode_plans=args.decode_plans,
                                check=False if args.no_check else None, fused=False if args.two_step else None)
        config.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    progress = not args.no_progress and sys.stderr.isatty()
    result = run.run_demo(config, str(device), progress=progress)
    _emit(args, result.as_dict(), run.format_result(result))
    return EXIT_OK if result.ok else EXIT_FAILED


def _speculative_demo(args) -> int:
    """demo --speculative: online c128 layers decoded by verify steps (demo/speculative.py)."""
    from dataclasses import replace

    from .demo import run, speculative

    try:
        device = run.resolve_device(args.device)
        base = speculative.GPU_SPECULATIVE if device.type == "cuda" else speculative.CPU_SPECULATIVE
        options = dict(requests=args.requests, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                       layers=args.layers, seed=args.seed, verify_tokens=args.verify_tokens,
                       rounds=args.decode_steps, check=False if args.no_check else None)
        config = replace(base, **{k: v for k, v in options.items() if v is not None})
        config.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    result = speculative.run_speculative(config, device)
    _emit(args, result.as_dict(), speculative.format_speculative(result))
    return EXIT_OK if result.ok else EXIT_FAILED


def cmd_bench(args) -> int:
    from .bench import report

    names = report.discover()
    unknown = sorted(set(args.bench or []) - set(names))
    if unknown:
        raise UsageError(f"unknown benchmark {', '.join(unknown)}; known: {', '.join(names)}")
    names = [n for n in names if not args.bench or n in args.bench]
    if args.list:
        _emit(args, {"benchmarks": names}, names)
        return EXIT_OK
    import torch

    if not torch.cuda.is_available():
        raise UsageError("bench needs a CUDA GPU; none is visible")
    if not args.out:
        raise UsageError("bench needs --out DIR (or --list)")
    rows = report.run_benchmarks(names, args.only, on_start=lambda n: print(f"running dsv4jit.bench.{n}",
                                                                            file=sys.stderr, flush=True))
    header = (f"# dsv4jit benchmarks\n\n{torch.cuda.get_device_name()}, dsv4jit {__version__}, "
              f"torch {torch.__version__}.\n")
    paths = report.write_report(rows, Path(args.out), header)
    if not report.can_plot():
        print(report.PLOTS_NEED, file=sys.stderr)
    _emit(args, {"files": [str(p) for p in paths], "rows": [vars(r) for r in rows]},
          [report.markdown(rows)] + [f"wrote {p}" for p in paths])
    return EXIT_OK


# --------------------------------------------------------------------------------------------


class _Help(argparse.HelpFormatter):
    """--help shows the default of every option that takes a value: argparse's value, unless the text
    states it (defaults that come from the environment); flags are off unless given."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.nargs != 0 and action.default is not None and "default" not in text:
            text += " (default: %(default)s)"
        return text


class _DemoHelp(_Help):
    """The demo's sizes depend on the device: their defaults come from its GPU and CPU configurations."""

    def _get_help_string(self, action):
        from .demo.run import CPU_DEFAULTS, GPU_DEFAULTS

        if action.default is None and action.dest in GPU_DEFAULTS.__dataclass_fields__:
            gpu, cpu = getattr(GPU_DEFAULTS, action.dest), getattr(CPU_DEFAULTS, action.dest)
            return f"{action.help} (default: {gpu if gpu == cpu else f'{gpu} on a GPU, {cpu} on the CPU'})"
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4jit", description="dsv4jit kernel cache and tools", formatter_class=_Help)
    p.add_argument("--version", action="version", version=f"dsv4jit {__version__}")
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_Help))
    json_help = "machine-readable output on stdout"

    def selection(sp, with_status=False):
        sp.add_argument("--arch", help=f"targets, e.g. 9.0a or 9.0a,10.0a; 'auto': the visible GPUs {ARCH_DEFAULT}")
        sp.add_argument("--kernel", action="append", help="restrict to this kernel (repeatable; default: every kernel)")
        sp.add_argument("--set", action="append",
                        help="'default' (the serving sets), 'all' (every combination), or a variant id such as "
                             "'plan[pdl=1]' (repeatable; default: default)")
        sp.add_argument("--param", action="append", metavar="NAME=VALUE",
                        help="keep the variants with this parameter value, e.g. head_dim=512 (repeatable; "
                             "default: no filter)")
        sp.add_argument("--json", action="store_true", help=json_help)

    pd = sub.add_parser("demo", help="run the compressors as a serving stack does and check the caches",
                        description="Run the compressors of DeepSeek-V4 layers as a serving stack does (paged pool, "
                                    "chunked prefill, decode steps in a CUDA graph), time the steps and check the final "
                                    "states and caches against the reference backend. Without a GPU it runs the "
                                    "reference backend at a small size.",
                        formatter_class=_DemoHelp)
    pd.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if visible, else cpu at a small size)")
    pd.add_argument("--requests", type=int, help="number of requests")
    pd.add_argument("--min-prompt", type=int, help="shortest prompt (tokens)")
    pd.add_argument("--max-prompt", type=int, help="longest prompt (tokens)")
    pd.add_argument("--chunk", type=int, help="prefill token budget per step (chunked prefill)")
    pd.add_argument("--decode-steps", type=int, help="decode steps after the prefill")
    pd.add_argument("--layers", type=int, help="layers, alternating compress ratio 4 and 128")
    pd.add_argument("--seed", type=int, help="random seed")
    pd.add_argument("--indexer-fp8", action="store_true", help="indexer cache in fp8 instead of fp4")
    pd.add_argument("--eager", action="store_true", help="decode without a CUDA graph")
    pd.add_argument("--two-step", action="store_true",
                    help="run each compressor through compress_forward + compress_norm_rope_store instead of one op "
                    "per layer (compress_and_store_c4_layer, compress_and_store)")
    pd.add_argument("--decode-plans", choices=("in-graph", "copy"),
                    help="build decode plans inside the graph, or outside it and copy_ them in")
    pd.add_argument("--speculative", action="store_true",
                    help="online c128 layers decoded by verify steps of draft tokens (speculative decoding); "
                    "--decode-steps counts the verify steps, --layers the online c128 layers")
    pd.add_argument("--verify-tokens", type=int, help="with --speculative: draft tokens per request and verify "
                    "step, 1-8 (default: 4)")
    pd.add_argument("--no-check", action="store_true", help="skip the reference run and the comparison")
    pd.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    pd.add_argument("--json", action="store_true", help="machine-readable result")
    pd.set_defaults(func=cmd_demo)

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
    pb.add_argument("--json", action="store_true", help=json_help)
    pb.set_defaults(func=cmd_bench)

    pc = sub.add_parser("precompile", help="build variants into the cache",
                        description="Compile kernel variants into the cache ahead of time, in parallel (by default "
                                    "the serving set, for the arches of the visible GPUs); cached ones are skipped.")
    selection(pc)
    pc.add_argument("-j", "--jobs", type=int,
                    help="parallel builds (default: DSV4JIT_JOBS, else as many as the CPUs and the free memory "
                         "allow, DSV4JIT_JOB_MEM_GB each)")
    pc.add_argument("--cache-dir",
                    help="write root (default: DSV4JIT_CACHE_DIR, else $XDG_CACHE_HOME/dsv4jit or ~/.cache/dsv4jit)")
    pc.add_argument("--keep-going", action="store_true", help="continue after a failed build")
    pc.add_argument("--dry-run", action="store_true", help="show what would be built")
    pc.set_defaults(func=cmd_precompile)

    pl = sub.add_parser("list", help="variants and their cache status",
                        description="Show the selected variants per arch as cached or missing (the same selection "
                                    "as precompile), or with --entries what the cache roots hold.")
    selection(pl)
    pl.add_argument("--status", choices=("all", "cached", "missing"), default="all",
                    help="show only the variants with this cache status")
    pl.add_argument("--entries", action="store_true", help="list what is on disk instead, incl. orphans")
    pl.set_defaults(func=cmd_list)

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
    pk.add_argument("--json", action="store_true", help=json_help)
    pk.set_defaults(func=cmd_clean)

    pi = sub.add_parser("info", help="toolchain, GPUs, cache roots, env; --check compiles a test kernel",
                        description="Show the installation: dsv4jit and Python, the CUDA and host compilers, tvm-ffi, "
                                    "torch, the GPUs and their arches, the cache roots and the DSV4JIT_* settings; "
                                    "--check compiles and loads (on a GPU also runs) a test kernel.")
    pi.add_argument("variant", nargs="?", help="show the key document of this variant id, e.g. 'plan[pdl=1]'")
    pi.add_argument("--arch", help=f"targets of the variant's key and of --check, e.g. 9.0a; 'auto': the visible GPUs "
                                   f"{ARCH_DEFAULT}")
    pi.add_argument("--check", action="store_true", help="compile, load (and run on a GPU) a trivial kernel")
    pi.add_argument("--json", action="store_true", help=json_help)
    pi.set_defaults(func=cmd_info)
    return p


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that builds under way
    are stopped and cleaned up (jit/batch.py) instead of the process vanishing without a word."""


def _terminated(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main_thread else None
    try:
        logging.basicConfig(level=env.log_level(), format="%(message)s", stream=sys.stderr)
        return args.func(args)
    except (UsageError, DSV4JITSettingError, DSV4JITToolchainError) as e:
        print(f"dsv4jit: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DSV4JITError as e:
        print(str(e), file=sys.stderr)
        return EXIT_FAILED
    except (KeyboardInterrupt, Terminated) as e:
        signum = signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM
        print(f"dsv4jit: {args.command} stopped by {signum.name}; compiles under way were killed and published "
              "nothing", file=sys.stderr)
        return 128 + signum
    except Exception:  # noqa: BLE001 - a bug: the traceback says where
        traceback.print_exc()
        print(f"dsv4jit: internal error (exit {EXIT_BUG}): a bug in dsv4jit {__version__}; please report it "
              "with the traceback above", file=sys.stderr)
        return EXIT_BUG
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
