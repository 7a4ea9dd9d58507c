"""Load a kernel variant: memo, then cache lookup (lock-free, no subprocess), then build.

The warm path is: per-process memo hit; or compute the key (toolchain identity and header digests
are memoised; the identity is cached on disk, so no subprocess runs), read the manifest in each
root, read the module and check its size and sha256 against it, and ``dlopen`` a private copy of
the bytes checked (`_load_module`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import ArgumentError, ArgumentTypeError, DSV4JITCacheMiss, DSV4JITToolchainError
from . import build, cache, compiler, prebuilt
from .kernels import SPECS
from .registry import Variant
from .toolchain import Arch, Toolchain, resolve_arch, toolchain

log = logging.getLogger("dsv4jit")

PLACEHOLDER_TOOLCHAIN = Toolchain(Path("<cuda>/bin/nvcc"), Path("<cuda>"), "", Path("<cxx>"), "")
_MODULES: dict[tuple[str, str], object] = {}
_LOCK = threading.Lock()


#: Descriptors of the private copies of the loaded modules, open for the life of the process: the
#: dynamic loader knows a library by its path, and a closed descriptor's number (so its path) would
#: come back for the next copy.
_COPIES: list[int] = []


def _register_argument_errors(tvm_ffi) -> None:
    """The error kinds the kernels' argument checks throw (common/tensor_check.h), registered so that
    they reach Python as dsv4jit's classes rather than a plain RuntimeError."""
    tvm_ffi.register_error("DSV4JITArgumentError", ArgumentError)
    tvm_ffi.register_error("DSV4JITArgumentTypeError", ArgumentTypeError)


def _load_module(path: Path, image: bytes):
    """The tvm-ffi module of `image`, the verified bytes of ``module.so`` at `path`, loaded from a
    private in-memory copy (a memfd): the loaded code never maps the cache's file, so that nothing
    done to that file afterwards reaches this process. ``cp`` over a live cache truncates and
    rewrites a module in place, and a mapped file cut short kills every process that maps it
    (SIGBUS); a hard link would share the file, so only a copy keeps the bytes. The copy costs the
    module's size in memory per process (about 1 MB each) and a write of it."""
    import tvm_ffi

    _register_argument_errors(tvm_ffi)
    fd = os.memfd_create(f"dsv4jit:{path.parent.name}"[:240])  # the name shows in /proc/<pid>/maps
    try:
        with open(fd, "wb", closefd=False) as copy:
            copy.write(image)
        # tvm_ffi.load_module picks a loader by the file's extension, which /proc/self/fd/<n> lacks: call
        # the shared-library loader it would pick
        module = tvm_ffi.get_global_func("ffi.Module.load_from_file.so")(f"/proc/self/fd/{fd}", "so")
    except BaseException:
        os.close(fd)  # not loaded: its path names nothing
        raise
    _COPIES.append(fd)
    tvm_ffi.get_global_func("ffi.ModuleGlobalsAdd")(module)  # kept alive, as tvm_ffi.load_module does
    return module


@dataclass(frozen=True)
class Resolution:
    """Where a variant stands for an arch: its key info (None without a toolchain) and cached entry,
    looked up in the write root `root` and then the search roots."""

    variant: Variant
    arch: Arch
    root: Path  # the write root, where a build of it goes
    info: cache.KeyInfo | None
    entry: Path | None  # verified against its manifest
    command: compiler.Command | None
    toolchain_error: DSV4JITToolchainError | None = None
    damaged: tuple[cache.Damaged, ...] = ()  # entries of this variant found on the way that failed the check
    image: bytes | None = None  # the bytes of entry's module.so, as verified: what a load maps


def resolve(variant: Variant, arch: Arch, root: Path | None = None) -> Resolution:
    """Key and cache lookup, without building. Works without a compiler via the source key. A miss
    in the roots is looked up in the installed prebuilt kernels (jit/prebuilt.py).
    `root`: the write root (default: DSV4JIT_CACHE_DIR's)."""
    root = cache.write_root(root)
    try:
        tc = toolchain(need_cuda=not arch.is_host, root=root)
    except DSV4JITToolchainError as e:
        tc, error = None, e
    if tc is None:
        # No compiler here (e.g. a serving image with a baked cache): match on everything else.
        # Normalised commands name compilers by token, so a placeholder toolchain gives the same one.
        command = compiler.compile_command(variant, arch, PLACEHOLDER_TOOLCHAIN)
        info = cache.make_key(variant, arch, command.normalized, None)
        entry, image, damaged = _or_prebuilt(cache.find_entry(variant, arch, None, info.source_key, root), variant,
                                             arch, command, root)
        return Resolution(variant, arch, root, None, entry, None, error, tuple(damaged), image)
    command = compiler.compile_command(variant, arch, tc)
    info = cache.make_key(variant, arch, command.normalized, tc.identity(host_only=arch.is_host))
    entry, image, damaged = _or_prebuilt(cache.find_entry(variant, arch, info, root=root), variant, arch, command,
                                         root)
    return Resolution(variant, arch, root, info, entry, command, None, tuple(damaged), image)


def _or_prebuilt(found: tuple[Path | None, bytes | None, list[cache.Damaged]], variant: Variant, arch: Arch,
                 command: compiler.Command, root: Path) -> tuple[Path | None, bytes | None, list[cache.Damaged]]:
    """`found` (entry, its module's bytes, damaged) of the roots; on a miss, the installed prebuilt
    kernels' entry."""
    entry, image, damaged = found
    if entry is not None:
        return found
    entry, image, more = prebuilt.find_entry(variant, arch, command.normalized, root)
    return entry, image, damaged + more


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
    distrust = None
    if res.entry is not None and not env.force_rebuild():
        for d in res.damaged:  # shadowed by the verified entry of a later root
            log.warning("dsv4jit: cached %s at %s is damaged (%s); loading %s instead", variant.id, d.entry,
                        d.problem, res.entry)
        try:
            return _load_module(res.entry / "module.so", res.image)
        except Exception as e:  # noqa: BLE001 - verified, yet it does not load here: rebuilt once
            distrust = cache.Damaged(res.entry, f"it does not load: {e}")
    if env.no_compile():
        raise DSV4JITCacheMiss(build.not_cached(variant, arch, res.info.key if res.info else None,
                                                f"DSV4JIT_NO_COMPILE=1{prebuilt.note(arch, res.root)}",
                                                build.fix_command(variant, arch), res.root,
                                                res.damaged + ((distrust,) if distrust else ())))
    if res.toolchain_error is not None:
        # Precompiling here would fail the same way: the fix is a compiler, or a cache built elsewhere.
        raise DSV4JITToolchainError(f"{res.toolchain_error}{prebuilt.note(arch, res.root)}. Fix: install the "
                                    f"compiler, or run {build.fix_command(variant, arch)} where it is and add that "
                                    "cache to DSV4JIT_CACHE_PATH")
    prebuilt.warn_refused(arch, res.root)
    return build_resolved(res, _reason(res, distrust), distrust).module


def _reason(res: Resolution, distrust: cache.Damaged | None) -> str:
    if distrust is not None:
        return f"cached entry failed to load: {distrust.problem}"
    if res.entry is not None:
        return "forced rebuild (DSV4JIT_FORCE_REBUILD=1)"
    if res.damaged:
        return f"damaged cache entry: {res.damaged[0].problem}"
    return "no cache entry"


def build_resolved(res: Resolution, reason: str, distrust: cache.Damaged | None = None,
                   stop: compiler.Stop | None = None) -> build.Built:
    """Build a resolved variant (`res.info` set: a toolchain was found) into its write root. Damaged
    entries outside the write root, which dsv4jit never modifies, are reported and left; the builder
    moves the write root's aside. `stop`: that of the batch this build is part of (`compiler.Stop`)."""
    own = cache.entry_dir(res.root, res.arch, res.variant, res.info.key)
    for d in res.damaged:
        if d.entry != own:
            log.warning("dsv4jit: cached %s at %s is damaged (%s); building into the write root", res.variant.id,
                        d.entry, d.problem)
    tc = toolchain(need_cuda=not res.arch.is_host, root=res.root)
    return build.build(res.variant, res.arch, tc, res.info, res.command, reason, _load_module, res.root, distrust,
                       stop, res.damaged)


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
