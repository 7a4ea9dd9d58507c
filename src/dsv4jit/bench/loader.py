"""Warm load of a cached kernel module in a fresh process (imports excluded), median of N processes.

    python -m dsv4jit.bench.loader [--kernel selftest|plan_host] [--arch 9.0a] [--processes 10]

The selftest module is a CUDA one (about 1 MB); plan_host, the CPU planner (about 250 KB), is loaded for
the host. Neither needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from .. import env
from . import report

_CHILD = r"""
import json, sys, time
import torch, tvm_ffi
from dsv4jit.jit import loader
from dsv4jit.jit.toolchain import Arch, resolve_arch
if sys.argv[2] == "plan_host":
    variant, arch, export = loader.variant("plan_host"), Arch.host(), "decode"
else:
    variant, export = loader.variant("selftest", dtype="fp32", pdl=True), "affine"
    arch = Arch.parse(sys.argv[1]) if sys.argv[1] else resolve_arch()
t0 = time.perf_counter()
module = loader.load(variant, arch)
t1 = time.perf_counter()
print(json.dumps({"warm_load_ms": 1e3 * (t1 - t0), "has_export": hasattr(module, export)}))
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernel", choices=("selftest", "plan_host"), default="selftest")
    p.add_argument("--arch", default="", help="the selftest module's (default: the GPU's, or DSV4JIT_CUDA_ARCH)")
    p.add_argument("--processes", type=int, default=10)
    args = p.parse_args(argv)
    if not args.arch and not env.cuda_arch():  # the target comes from a GPU then
        report.exit_without_gpu("python -m dsv4jit.bench.loader", "--arch")
    # The first child may compile (cold); the rest measure warm loads.
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD, args.arch, args.kernel], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
            for _ in range(args.processes + 1)]
    warm = [r["warm_load_ms"] for r in runs[1:]]
    print(f"warm load of the cached {args.kernel} module in a fresh process: median {statistics.median(warm):.2f} ms, "
          f"max {max(warm):.2f} ms over {len(warm)} processes (first/cold: {runs[0]['warm_load_ms']:.0f} ms)")


if __name__ == "__main__":
    main()
