"""What ``dsv4jit list`` and ``dsv4jit info`` report, as plain data: the cache's entries, the status
of chosen variants, and the installation (toolchain, tvm-ffi, torch, GPUs, cache roots, settings)."""

from __future__ import annotations

import sys

from .. import __version__, env
from ..errors import DSV4JITToolchainError
from . import cache, loader, prebuilt
from .clean import is_orphan
from .registry import Variant
from .toolchain import Arch, device_arch, toolchain


def entries() -> list[dict]:
    """Every entry under every cache root and in the installed prebuilt kernels, with its manifest's
    facts and whether it is an orphan."""
    package = prebuilt.installed()
    roots = cache.roots() + ([package.root] if package else [])
    return [{"root": str(root), "entry": str(entry), "variant": m.get("variant"), "arch": m.get("arch"),
             "key": m.get("key"), "size": m.get("size"), "build_seconds": m.get("build_seconds"),
             "orphan": is_orphan(m)}
            for root in roots for entry, m in cache.iter_entries(root)]


def variant_status(pairs: list[tuple[Variant, Arch]]) -> list[dict]:
    """For each (variant, arch): cached or missing, its key and entry, and any damaged entry met."""
    rows = []
    for v, a in pairs:
        res = loader.resolve(v, a)
        m = cache.read_manifest(res.entry) if res.entry else None
        rows.append({"variant": v.id, "arch": a.name, "status": "cached" if res.entry else "missing",
                     "key": res.info.key if res.info else None, "entry": str(res.entry) if res.entry else None,
                     "size": m.get("size") if m else None, "build_seconds": m.get("build_seconds") if m else None,
                     "damaged": [{"entry": str(d.entry), "problem": d.problem} for d in res.damaged]})
    return rows


def variant_keys(variant: Variant, archs: list[Arch]) -> list[dict]:
    """The cache key of `variant` for each arch (the host target alone for a host kernel), with the
    document it hashes and the entry that holds it, if any."""
    rows = []
    for a in [Arch.host()] if variant.spec.target == "host" else archs:
        res = loader.resolve(variant, a)
        rows.append({"arch": a.name, "key": res.info.key if res.info else None,
                     "entry": str(res.entry) if res.entry else None,
                     "document": res.info.document if res.info else None})
    return rows


def installation() -> dict:
    """dsv4jit and Python versions, the toolchain (or why there is none), tvm-ffi, torch, the visible
    GPUs and their arches, the cache roots and the DSV4JIT_* settings."""
    import torch

    info: dict = {"dsv4jit": __version__, "python": sys.version.split()[0]}
    try:
        tc = toolchain(need_cuda=True)
        info["nvcc"] = {"path": str(tc.nvcc), "cuda_root": str(tc.cuda_root),
                        "version": tc.nvcc_version.splitlines()[-1] if tc.nvcc_version else ""}
        info["cxx"] = {"path": str(tc.cxx), "version": tc.cxx_version.splitlines()[0]}
    except DSV4JITToolchainError as e:
        info["nvcc"] = {"error": str(e)}
    tvm = cache.tvm_ffi_info()
    info["tvm_ffi"] = {"version": tvm["version"], "include": str(tvm["include"])}
    info["torch"] = {"version": torch.__version__,
                     "dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")}
    info["gpus"] = [{"index": i, "name": torch.cuda.get_device_name(i), "arch": device_arch(i).name}
                    for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    info["cache_roots"] = [{"path": str(r), "writable": i == 0 and cache.unwritable(r) is None,
                            "read_only_search_root": i > 0, "bytes": cache.dir_size(r)}
                           for i, r in enumerate(cache.roots())]
    info["prebuilt"] = _prebuilt_facts()
    info["env"] = env.all_settings()
    return info


def _prebuilt_facts() -> dict | None:
    """The installed prebuilt kernels: where, their tags, and for each arch they hold whether this
    process uses them (None) or why not."""
    package = prebuilt.installed()
    if package is None:
        return None
    facts = {"package": str(package), "root": str(package.root), "tags": package.tags, "problem": package.problem}
    if package.tags is not None:
        facts["refused"] = {name: prebuilt.refusal(package, Arch(name)) for name in package.tags["arches"]}
    return facts
