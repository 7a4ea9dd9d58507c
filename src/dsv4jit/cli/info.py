"""``dsv4jit info``: the installation, a variant's key document, and the toolchain check."""

from __future__ import annotations

import json

from .common import EXIT_FAILED, EXIT_OK, JSON_HELP, emit
from .selection import ARCH_DEFAULT, archs, variant_id, warn_of_arch_setting


def add_parser(sub) -> None:
    pi = sub.add_parser("info", help="toolchain, GPUs, cache roots, env; --check compiles a test kernel",
                        description="Show the installation: dsv4jit and Python, the CUDA and host compilers, tvm-ffi, "
                                    "torch, the GPUs and their arches, the cache roots and the DSV4JIT_* settings; "
                                    "--check compiles and loads (on a GPU also runs) a test kernel.")
    pi.add_argument("variant", nargs="?", help="show the key document of this variant id, e.g. 'plan[pdl=1]'")
    pi.add_argument("--arch", help=f"targets of the variant's key and of --check, e.g. 9.0a; 'auto': the visible GPUs "
                                   f"{ARCH_DEFAULT}")
    pi.add_argument("--check", action="store_true", help="compile, load (and run on a GPU) a trivial kernel")
    pi.add_argument("--json", action="store_true", help=JSON_HELP)
    pi.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from .. import runtime
    from ..jit import inventory

    info = inventory.installation()
    gpus = info["gpus"]
    status = EXIT_OK
    v = variant_id(args.variant) if args.variant else None
    targets = archs(args.arch) if args.check or (v is not None and v.spec.target != "host") else []
    if not targets:
        warn_of_arch_setting()
    if v is not None:
        info["variant"] = inventory.variant_keys(v, targets)
    if args.check:
        check = runtime.self_check(targets[0])
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
    if (kernels := info["prebuilt"]) is not None:
        uses = [f"{arch} {'used' if why is None else f'not used: {why}'}"
                for arch, why in kernels.get("refused", {}).items()]
        lines.append(f"prebuilt kernels: {kernels['package']}: {'; '.join(uses) or kernels['problem']}")
    lines += [f"env: {k}={v}" for k, v in info["env"].items()]
    for item in info.get("variant", []):
        lines.append(f"variant {args.variant} {item['arch']}: key {item['key']} entry {item['entry']}")
        lines.append(json.dumps(item["document"], indent=1))
    if "check" in info:
        c = info["check"]
        lines.append(f"check: {'ok' if c['ok'] else 'FAILED'} - {c['detail']}")
    emit(args, info, lines)
    return status
