"""``dsv4jit package``: variants precompiled into an installable wheel of prebuilt kernels."""

from __future__ import annotations

from pathlib import Path

from .common import EXIT_FAILED, EXIT_OK, emit
from .precompile import add_build_options, build_reporting, cached_row, report, summary
from .selection import add_selection, targets

#: The arches of a package unless --arch says otherwise: every data-centre GPU the kernels support.
DEFAULT_ARCHES = "9.0a,10.0a"


def add_parser(sub) -> None:
    pp = sub.add_parser("package", help="build a wheel of prebuilt kernels, for images without a compiler",
                        description="Compile kernel variants (by default the serving set, for sm_90a and sm_100a) "
                                    "and write them as an installable wheel of prebuilt kernels, tagged with the CUDA "
                                    "toolkit and tvm-ffi it was built with; once it is installed, dsv4jit loads "
                                    "them beneath its own cache, with no compiler.")
    add_selection(pp, arch_default=DEFAULT_ARCHES)
    add_build_options(pp)
    pp.add_argument("--out", default="dist", help="folder the wheel is written to")
    pp.set_defaults(func=cmd_package)


def cmd_package(args) -> int:
    from ..jit import batch, cache, loader, prebuilt, wheel
    from ..jit.toolchain import toolchain

    root = Path(args.cache_dir).expanduser() if args.cache_dir else None
    tc = toolchain(need_cuda=True, root=cache.write_root(root))  # the toolkit the package is tagged with
    pairs = targets(args)
    cached, todo = batch.partition(pairs, root)
    # An entry found by another key (another toolkit's, from an installed package) is not this build's.
    foreign = [r for r in cached if cache.read_manifest(r.entry)["key"] != r.info.key]
    results = [cached_row(r) for r in cached if r not in foreign]
    done = build_reporting(args, todo + foreign, "package", results, keep_going=False)
    if done.failures:
        emit(args, report(results, done), [summary(results, done)])
        return EXIT_FAILED
    entries = [loader.resolve(v, a, root).entry for v, a in pairs]
    tags = prebuilt.build_tags(tc, list(dict.fromkeys(a for _, a in pairs)))
    path = wheel.write_wheel(entries, tags, Path(args.out))
    size = path.stat().st_size
    emit(args, report(results, done) | {"wheel": str(path), "bytes": size, "tags": tags},
         [summary(results, done),
          f"wrote {path}: {len(entries)} modules for {', '.join(tags['arches'])}, {size / 2**20:.1f} MiB"])
    return EXIT_OK
