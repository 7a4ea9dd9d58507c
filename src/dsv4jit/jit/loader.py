"""Load a kernel variant: memo, then cache lookup (lock-free, no subprocess), then build.

The warm path is: per-process memo hit; or compute the key (toolchain identity and header digests
are memoised; the identity is cached on disk, so no subprocess runs), ``stat`` the manifest in each
root, and ``dlopen`` the module.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import DSV4JITCacheMiss, DSV4JITToolchainError
from . import build, cache
from .kernels import SPECS
from .registry import Variant
from .toolchain import Arch, Toolchain, resolve_arch, toolchain

log = logging.getLogger("dsv4jit")

PLACEHOLDER_TOOLCHAIN = Toolchain(Path("<cuda>/bin/nvcc"), Path("<cuda>"), "", Path("<cxx>"), "")
_MODULES: dict[tuple[str, str], object] = {}
_LOCK = threading.Lock()


def _load_module(path: Path):
    import tvm_ffi

    return tvm_ffi.load_module(str(path))


@dataclass(frozen=True)
class Resolution:
    """Where a variant stands for an arch: its key info (None without a toolchain) and cached entry."""

    variant: Variant
    arch: Arch
    info: cache.KeyInfo | None
    entry: Path | None
    command: build.Command | None
    toolchain_error: DSV4JITToolchainError | None = None


def resolve(variant: Variant, arch: Arch) -> Resolution:
    """Key and cache lookup, without building. Works without a compiler via the source key."""
    try:
        tc = toolchain(need_cuda=not arch.is_host)
    except DSV4JITToolchainError as e:
        tc, error = None, e
    if tc is None:
        # No compiler here (e.g. a serving image with a baked cache): match on everything else.
        # Normalised commands name compilers by token, so a placeholder toolchain gives the same one.
        command = build.compile_command(variant, arch, PLACEHOLDER_TOOLCHAIN)
        info = cache.make_key(variant, arch, command.normalized, None)
        return Resolution(variant, arch, None, cache.find_entry(variant, arch, None, info.source_key), None, error)
    command = build.compile_command(variant, arch, tc)
    info = cache.make_key(variant, arch, command.normalized, tc.identity(host_only=arch.is_host))
    return Resolution(variant, arch, info, cache.find_entry(variant, arch, info), command)


def load(variant: Variant, arch: Arch):
    """The loaded tvm-ffi module of a variant for an arch (compiling it on a cache miss)."""
    memo_key = (variant.id, arch.name)
    module = _MODULES.get(memo_key)
    if module is not None:
        return module
    with _LOCK:
        module = _MODULES.get(memo_key)
        if module is None:
            module = _load_uncached(variant, arch)
            _MODULES[memo_key] = module
    return module


def _load_uncached(variant: Variant, arch: Arch):
    res = resolve(variant, arch)
    reason = "no cache entry"
    if res.entry is not None and not env.force_rebuild():
        try:
            return _load_module(res.entry / "module.so")
        except Exception as e:  # noqa: BLE001 - a broken entry is a miss
            log.warning("dsv4jit: cached %s at %s failed to load (%s); rebuilding", variant.id, res.entry, e)
            reason = f"cached entry failed to load: {e}"
    elif res.entry is not None:
        reason = "forced rebuild (DSV4JIT_FORCE_REBUILD=1)"
    if env.no_compile():
        raise DSV4JITCacheMiss(_miss_message(res))
    if res.toolchain_error is not None:
        raise DSV4JITToolchainError(f"{res.toolchain_error}. {_fix_hint(res)}")
    tc = toolchain(need_cuda=not arch.is_host)
    module, _ = build.build(variant, arch, tc, res.info, res.command, reason, _load_module)
    return module


def _fix_hint(res: Resolution) -> str:
    arch = "" if res.arch.is_host else f" --arch {res.arch.name}"
    command = f"python -m dsv4jit precompile{arch} --set '{res.variant.id}'"
    if res.toolchain_error is not None:  # precompiling here would fail the same way
        return f"Fix: install the compiler, or run {command} where it is and add that cache to DSV4JIT_CACHE_PATH"
    return f"Fix: {command}"


def _miss_message(res: Resolution) -> str:
    key = res.info.key if res.info else "(unknown: no toolchain)"
    searched = ", ".join(str(r) for r in cache.roots())
    return (f"dsv4jit: {res.variant.id} for {res.arch} is not in the kernel cache and DSV4JIT_NO_COMPILE=1 "
            f"(key {key}; searched {searched}). {_fix_hint(res)}")


def variant(kernel: str, **params) -> Variant:
    return SPECS[kernel].variant(**params)


def arch_for(device) -> Arch:
    """Build target for a torch device (``cpu`` gives the host target)."""
    if device is None:
        return resolve_arch()
    if getattr(device, "type", None) == "cpu":
        return Arch.host()
    index = device.index if hasattr(device, "index") else int(device)
    return resolve_arch(index)


def clear_memo() -> None:
    _MODULES.clear()
