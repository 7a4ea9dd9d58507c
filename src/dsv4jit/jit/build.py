"""Building one variant: staging, the compile (compiler.py) under the per-key lock (lock.py), the
failure record, and atomic publish.

Protocol (never builds in place): take the per-key file lock, look again (another process may
have published meanwhile, or failed while this one waited; a damaged entry is moved aside), compile
into ``.stage-*`` next to the entry, check the depfile against the scanned header closure,
smoke-load the module, write the manifest (with the module's size and sha256) last, then ``rename``
the stage into place. A builder killed at any point leaves only a stage folder, which the next
builder of that key removes, and no compiler process (reaper.py); readers never see a partial entry
because they look for the manifest and verify the module against it. A failed build records its
error in ``failed/``, so that the processes that waited for it report it instead of compiling again.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .. import __version__, env
from ..errors import DSV4JITBuildError, DSV4JITCacheError
from . import cache, metadata, progress
from .compiler import WRAPPER, Command, Stop, check_depfile, depfile_paths, first_error, run_compiler, timed_out
from .lock import OWNER_FIELDS, KeyLock, lock_file, read_owner
from .registry import Variant
from .toolchain import Arch, Toolchain

log = logging.getLogger("dsv4jit")

FAILURE = "failure.json"  # in failed/<slug>-<key>/: the last failure of that key, for its waiters


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_stages(entry: Path) -> None:
    """Stages of this key left by builders that died. We hold the key's lock, so a stage of this
    key is live only if its builder runs on another host (flock can be node-local on NFS)."""
    host = socket.gethostname()
    for stage in cache.folders(entry.parent, f"{cache.STAGE}{entry.name}-*"):
        owner = read_owner(stage / "owner.json")
        if owner is None or (owner[1] == host and not _pid_alive(owner[0])):
            shutil.rmtree(stage, ignore_errors=True)


def fix_command(variant: Variant, arch: Arch) -> str:
    """The precompile line that builds this variant (the fix named by every "not in the cache" error)."""
    target = "" if arch.is_host else f" --arch {arch.name}"
    return f"python -m dsv4jit precompile{target} --set '{variant.id}'"


def not_cached(variant: Variant, arch: Arch, key: str | None, why: str, fix: str, root: Path,
               damaged: Iterable[cache.Damaged] = ()) -> str:
    """Why a variant cannot be had here: what was searched (write root `root`, then the search
    roots), what was found damaged, and the fix."""
    found = "".join(f" (the entry at {d.entry} is damaged: {d.problem})" for d in damaged)
    searched = ", ".join(str(r) for r in cache.roots(root))
    return (f"dsv4jit: {variant.id} for {arch} is not in the kernel cache{found} and {why} "
            f"(key {key or '(unknown: no toolchain)'}; searched {searched}). Fix: {fix}")


def build_root(variant: Variant, arch: Arch, key: str, root: Path, damaged: Iterable[cache.Damaged] = ()) -> Path:
    """The write root `root`, or a per-process temp root when it is not writable and the fallback allows
    (else the cache error names the `damaged` entries the lookup met, which nothing can replace)."""
    problem = cache.unwritable(root)
    if problem is None:
        return root
    if env.cache_fallback() == "tmp":
        try:
            fallback = _tmp_root()
        except OSError as e:
            raise cache.write_error(e, Path(tempfile.gettempdir()), "TMPDIR") from e
        log.warning("dsv4jit: cache dir %s is not writable (%s); building into %s (DSV4JIT_CACHE_FALLBACK=tmp)",
                    root, problem, fallback)
        return fallback
    raise DSV4JITCacheError(not_cached(
        variant, arch, key, f"the kernel cache dir {root} is not writable ({problem})",
        "set DSV4JIT_CACHE_DIR to a writable folder, or DSV4JIT_CACHE_FALLBACK=tmp to build into a temporary "
        f"folder, or precompile it into a cache this process searches (DSV4JIT_CACHE_PATH): {fix_command(variant, arch)}",
        root, damaged))


_TMP_ROOT: list[Path] = []


def _tmp_root() -> Path:
    if not _TMP_ROOT:
        _TMP_ROOT.append(Path(tempfile.mkdtemp(prefix="dsv4jit-cache-")))
    return _TMP_ROOT[0]


@dataclass(frozen=True)
class Built:
    """What `build` did. `compiled` is False when another process published the entry while this one
    waited for the key lock; `module` is then that entry's."""

    module: object
    entry: Path
    compiled: bool
    waited: float  # seconds spent waiting for the key lock


def build(variant: Variant, arch: Arch, tc: Toolchain, info: cache.KeyInfo, command: Command, reason: str,
          load_module, root: Path, distrust: cache.Damaged | None = None, stop: Stop | None = None,
          damaged: Iterable[cache.Damaged] = ()) -> Built:
    """Build and publish into the write root `root` under the per-key lock; `load_module(path, image)`
    loads a module from its bytes (`image`, read from `path`). `distrust`: the entry of
    this key, which verified but did not load here; it is moved aside and rebuilt like a damaged one.
    `stop`: the batch's (see `Stop`). `damaged`: what the lookup found damaged (for the error where
    nothing can be built)."""
    root = build_root(variant, arch, info.key, root, damaged)
    folder = cache.kernel_dir(root, arch, variant)
    entry = cache.entry_dir(root, arch, variant, info.key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise cache.write_error(e, folder) from e
    failed = cache.failed_dir(root) / entry.name
    with KeyLock(lock_file(root, entry), variant.id, stop) as lock:
        failure = _failure_since(failed, variant, arch, lock.since)
        if failure is not None:  # the build this process waited for failed: the same compile would too
            raise failure
        if os.path.isdir(entry) and not env.force_rebuild():
            distrusted = distrust is not None and distrust.entry == entry
            image, problem = (None, distrust.problem) if distrusted else cache.verified_module(entry, info.key)
            if image is not None:  # published by another process while this one waited
                try:
                    module = load_module(entry / "module.so", image)
                except Exception as e:  # noqa: BLE001 - an entry that does not load is rebuilt once
                    problem = f"it does not load: {e}"
                else:
                    log.info("dsv4jit: %s for %s was built by another process (waited %.1fs)", variant.id, arch,
                             lock.waited)
                    return Built(module, entry, False, lock.waited)
            _set_aside(entry, variant, problem)
        _remove_dead_stages(entry)
        stage = cache.stage_dir(entry)
        try:
            stage.mkdir()
            (stage / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
            (stage / WRAPPER[variant.spec.target]).write_text(variant.wrapper_source())
        except OSError as e:
            shutil.rmtree(stage, ignore_errors=True)
            raise cache.write_error(e, folder) from e
        log.info("dsv4jit: compiling %s for %s (reason: %s; key %s) ...", variant.id, arch, reason, info.key)
        try:
            with progress.compiling(f"{variant.id} for {arch}"):
                module, image, seconds = _compile_and_check(variant, arch, info, command, stage, failed, load_module,
                                                            stop)
            if stop is not None:
                stop.check()  # stopped while loading: publish nothing more
            _publish(stage, entry, info, variant, arch, image, seconds)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        log.info("dsv4jit: ... %s done in %.1fs -> %s", variant.id, seconds, entry)
        return Built(module, entry, True, lock.waited)


def _set_aside(entry: Path, variant: Variant, problem: str) -> None:
    """Move a damaged entry out of the way (kept for inspection; `clean --stale` removes it)."""
    aside = cache.aside_dir(entry, cache.BAD)
    try:
        os.rename(entry, aside)
    except OSError as e:
        raise cache.write_error(e, entry.parent) from e
    log.warning("dsv4jit: cached %s at %s is damaged (%s); moved it to %s and rebuilding", variant.id, entry,
                problem, aside.name)


def _compile_and_check(variant, arch, info, command, stage, failed, load_module, stop):
    start = time.monotonic()
    timeout, verbose = env.build_timeout(), env.verbose_build()  # a setting error costs no compile
    log.debug("dsv4jit: key document for %s: %s", variant.id, json.dumps(info.document, indent=1))
    log.debug("dsv4jit: command: %s", command.shell())
    try:
        output, code = run_compiler(command, stage, timeout, stop)
    except OSError as e:
        raise cache.write_error(e, stage.parent) from e
    seconds = time.monotonic() - start
    if stop is not None:
        stop.check()  # its compiler was killed on purpose: not a failure to record
    if verbose:
        sys.stderr.write(output)
    if code != 0:
        _fail(variant, arch, stage, failed, command, timed_out(timeout) if code is None else first_error(output, code))
    check_depfile(variant, stage, info.document["headers"])
    try:
        image = (stage / "module.so").read_bytes()  # what the manifest records is what was loaded
        module = load_module(stage / "module.so", image)
        missing = [name for name in variant.exports() if not hasattr(module, name)]
        if missing:
            raise RuntimeError(f"exports missing from the built module: {missing}")
    except Exception as e:  # noqa: BLE001 - any load failure is a build failure
        _fail(variant, arch, stage, failed, command, f"built module does not load: {e}")
    return module, image, seconds


FAILURE_FIELDS = {"first_error": str, "failed_at": metadata.NUMBER, "log": str, "command": str, **OWNER_FIELDS}


def _fail(variant, arch, stage, failed, command, first_error) -> None:
    """Raise the build error, after keeping the log and the wrapper source in `failed` (this key's
    folder in ``failed/``) and recording the failure there for the processes waiting for this key
    (`_failure_since`). If it cannot be written (a full disk), the cache error says so and carries the
    compile error and the end of the log, which would otherwise be lost with the stage."""
    repro = f"cd {shlex.quote(str(failed))} && {command.shell()}"
    error = DSV4JITBuildError(variant.id, arch.name, first_error, str(failed / "build.log"), repro)
    try:
        shutil.rmtree(failed, ignore_errors=True)
        failed.mkdir(parents=True, exist_ok=True)
        for name in ("build.log", WRAPPER[variant.spec.target]):
            if (stage / name).exists():
                shutil.copy2(stage / name, failed / name)
        (failed / FAILURE).write_text(json.dumps({
            "first_error": first_error, "failed_at": time.time(), "log": error.log_path, "command": repro,
            "pid": os.getpid(), "host": socket.gethostname()}))
    except OSError as e:
        try:
            tail = (stage / "build.log").read_text(errors="replace").splitlines()[-20:]
        except OSError:
            tail = ["(unreadable)"]
        raise DSV4JITCacheError(
            f"{cache.write_error(e, failed)}\n"
            f"dsv4jit: building {variant.id} for {arch} failed: {first_error}\n"
            f"  its log could not be kept; it ended with:\n" + "".join(f"    {line}\n" for line in tail) +
            f"  reproduce: {command.shell()}") from error
    raise error


def _failure_since(failed: Path, variant: Variant, arch: Arch, since: float) -> DSV4JITBuildError | None:
    """The failure of this key that `_fail` recorded at or after `since` (when this process began to
    wait for the key lock): the build this process waited for failed, and compiling again would
    fail the same way, or hang as long, once per waiting process. A later process tries again, and
    so does any process where the record's time is still to come (another host's clock, or a file
    written by hand), which would otherwise block the key for good."""
    record, _ = metadata.read(failed / FAILURE, FAILURE_FIELDS)
    if record is None or not since <= record["failed_at"] <= time.time():
        return None
    return DSV4JITBuildError(variant.id, arch.name, f"{record['first_error']} (in the build of pid {record['pid']} "
                             f"on host {record['host']}, which this process waited for; not compiled again)",
                             record["log"], record["command"])


def _publish(stage: Path, entry: Path, info: cache.KeyInfo, variant: Variant, arch: Arch, image: bytes,
             seconds: float) -> None:
    try:
        manifest = {
            "key": info.key, "source_key": info.source_key, "variant": variant.id, "arch": arch.name,
            "document": info.document, "built_at": time.time(), "build_seconds": round(seconds, 3),
            **cache.module_record(image), "dsv4jit_version": __version__,
            "depfile": sorted(depfile_paths(stage / "deps.d")),
        }
        for name in ("owner.json", "deps.d"):
            (stage / name).unlink(missing_ok=True)
        (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
        if entry.exists():  # forced rebuild: move the old entry aside, then swap
            trash = cache.aside_dir(entry, cache.OLD)
            os.rename(entry, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(stage, entry)
    except OSError as e:
        if entry.is_dir() and (entry / "manifest.json").is_file():
            return  # another writer published the same key first; theirs is equivalent
        raise cache.write_error(e, entry.parent) from e
