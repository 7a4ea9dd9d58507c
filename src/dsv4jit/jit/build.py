"""Building one variant: the compile command, the per-key lock, staging and atomic publish.

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

import contextlib
import errno
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import filelock

from .. import __version__, env
from ..errors import DSV4JITBuildError, DSV4JITCacheError, DSV4JITLockTimeout
from . import cache, progress
from .registry import Variant
from .toolchain import Arch, Toolchain

log = logging.getLogger("dsv4jit")

WRAPPER = {"cuda": "wrapper.cu", "host": "wrapper.cc"}
FAILURE = "failure.json"  # in failed/<slug>-<key>/: the last failure of that key, for its waiters


@dataclass(frozen=True)
class Command:
    argv: list[str]  # run inside the stage folder
    normalized: list[str]  # install locations replaced by tokens, after the env settings; enters the key
    env: dict[str, str]  # settings the compiler reads from the environment (NVCC_APPEND_FLAGS, ...)

    def shell(self) -> str:
        """The command as one shell line, environment settings first (build.log, reproducers)."""
        settings = [f"{name}={shlex.quote(value)}" for name, value in self.env.items()]
        return " ".join(settings + [shlex.join(self.argv)])


def compile_command(variant: Variant, arch: Arch, tc: Toolchain) -> Command:
    tvm = cache.tvm_ffi_info()
    source = WRAPPER[variant.spec.target]
    includes = [f"-I{cache.CSRC}", f"-I{tvm['include']}"]
    if tvm["dlpack"] != tvm["include"]:
        includes.append(f"-I{tvm['dlpack']}")
    link = [f"-L{tvm['lib']}", "-ltvm_ffi"]
    deps = ["-MD", "-MF", "deps.d"]
    if variant.spec.target == "host":
        opt = ["-O0", "-g"] if env.debug_build() else ["-O2"]
        argv = [str(tc.cxx), "-shared", "-fPIC", "-std=c++20", *opt, "-Wall",
                *deps, *includes, "-o", "module.so", source, *link]
    else:
        opt = ["-O0", "-G", "-g"] if env.debug_build() else ["-O3"]
        extra = ["-lineinfo"] if env.lineinfo() else []
        argv = [str(tc.nvcc), "-ccbin", str(tc.cxx), "-shared", "-Xcompiler", "-fPIC", "-std=c++20", *opt,
                "--expt-relaxed-constexpr", arch.gencode(), f"-DDSV4JIT_CUDA_ARCH={arch.number}",
                "--threads", "1", *extra, *env.extra_cuda_flags(), *deps, *includes,
                "-o", "module.so", source, *link]
    settings = {} if variant.spec.target == "host" else env.nvcc_flag_variables()
    tokens = [(str(cache.CSRC), "<pkg>"), (str(tvm["include"]), "<tvm_ffi>"), (str(tvm["dlpack"]), "<dlpack>"),
              (str(tvm["lib"]), "<tvm_ffi_lib>"), (str(tc.cxx), "<cxx>")]
    if tc.cuda_root is not None:
        tokens.append((str(tc.cuda_root), "<cuda>"))
    tokens.sort(key=lambda t: -len(t[0]))

    def normalize(arg: str) -> str:
        for path, token in tokens:
            arg = arg.replace(path, token)
        return arg

    words = [f"{name}={value}" for name, value in settings.items()] + argv
    return Command(argv, [normalize(a) for a in words], settings)


# --------------------------------------------------------------------------------------------
# Locking


def lock_file(root: Path, entry: Path) -> Path:
    """The per-key lock of `entry` (or of a stage or set-aside folder of its key, `cache.entry_of`):
    next to the entry, or under DSV4JIT_LOCK_DIR with the same relative layout. Its folder is made."""
    entry = cache.entry_of(entry)
    locks = env.lock_dir()
    base = locks / entry.parent.relative_to(root) if locks else entry.parent
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_error(e, base, lock_setting()) from e
    return base / f"{entry.name}.lock"


OWNER_FIELDS = {"pid": int, "host": str}


def _owner(path: Path) -> tuple[int, str] | None:
    """(pid, host) of an owner file (a stage's ``owner.json``, a lock's ``.owner``), or None."""
    owner, _ = cache.read_json(path, OWNER_FIELDS)
    return (owner["pid"], owner["host"]) if owner is not None and owner["pid"] > 0 else None


class KeyLock:
    """flock on a file that is never deleted (waiters share its inode), with progress logs. `what`
    names the holder's work in the owner file and the logs (a variant id, or what clean removes)."""

    def __init__(self, path: Path, what: str, stop: "Stop | None" = None):
        self.path, self.what, self.stop = path, what, stop
        self.owner = path.with_name(path.name + ".owner")
        self.lock = filelock.FileLock(str(path))

    def __enter__(self) -> "KeyLock":
        self.since = time.time()  # a failure recorded after this is one this process waited for
        start = time.monotonic()
        limit = env.lock_timeout()
        logged = 0.0
        while True:
            if self.stop is not None:
                self.stop.check()
            try:  # short slices, so that a stopped batch stops waiting soon
                self.lock.acquire(timeout=min(1.0, max(0.05, limit - (time.monotonic() - start))))
                break
            except filelock.Timeout:
                waited = time.monotonic() - start
                if waited >= limit:
                    raise DSV4JITLockTimeout(
                        f"dsv4jit: gave up after {waited:.0f}s waiting for the build of {self.what} "
                        f"held by {self._holder()} (lock {self.path}; DSV4JIT_LOCK_TIMEOUT)") from None
                if waited - logged >= 10.0:
                    logged = waited
                    log.warning("dsv4jit: waiting for build of %s held by %s for %.0fs", self.what, self._holder(),
                                waited)
            except OSError as e:  # the lock file cannot be opened (checked after Timeout, an OSError too)
                raise _cache_error(e, self.path.parent, lock_setting()) from e
        self.waited = time.monotonic() - start
        try:
            self.owner.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                              "since": time.time(), "variant": self.what}))
        except OSError:
            pass
        return self

    def _holder(self) -> str:
        owner = _owner(self.owner)
        return f"pid {owner[0]} on host {owner[1]}" if owner else "another process"

    def __exit__(self, *exc) -> None:
        self.lock.release()


class BuildStopped(Exception):
    """A build of a batch that was stopped (`Stop`): nothing of it was published."""


class Stop:
    """Stops the builds of a batch at once: `set` kills their running compilers (each one's whole
    process group, see reaper.py), and every build then ends with `BuildStopped` before publishing
    or recording anything. A build that runs in the thread that is interrupted needs none: the
    exception stops it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._set = False
        self._compilers: set[subprocess.Popen] = set()

    def set(self) -> None:
        with self._lock:
            self._set = True
            for proc in self._compilers:
                _kill_group(proc)

    def check(self) -> None:
        if self._set:
            raise BuildStopped()

    @contextlib.contextmanager
    def running(self, proc: subprocess.Popen):
        with self._lock:
            if self._set:
                _kill_group(proc)
            self._compilers.add(proc)
        try:
            yield
        finally:
            with self._lock:
                self._compilers.discard(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the reaper leads its group: it, the compiler and its children
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------------------------
# Build and publish


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
        owner = _owner(stage / "owner.json")
        if owner is None or (owner[1] == host and not _pid_alive(owner[0])):
            shutil.rmtree(stage, ignore_errors=True)


#: Compiler output that means the disk is full: what the build error then says first, rather than the
#: linker's "ld returned 1" that follows it.
_NO_SPACE = ("no space left on device", "disk quota exceeded")


def _first_error(output: str, returncode: int) -> str:
    if returncode in (137, -9):
        return f"compiler killed (exit {returncode}): likely out of memory; lower -j or DSV4JIT_JOBS"
    for line in output.splitlines():
        if any(text in line.lower() for text in _NO_SPACE):
            return (f"out of disk space: {line.strip()} (free some where the compiler writes: the kernel cache, "
                    "DSV4JIT_CACHE_DIR, and the temporary folder, TMPDIR)")
    for line in output.splitlines():
        low = line.lower()
        if " error" in low or low.startswith("error") or "error:" in low or "ptxas fatal" in low:
            return line.strip()
    lines = [ln for ln in output.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else f"compiler exited with {returncode}"


def _depfile_paths(depfile: Path) -> set[str]:
    try:
        text = depfile.read_text().replace("\\\n", " ")
    except OSError:
        return set()
    paths = set()
    for line in text.splitlines():
        _, _, rest = line.partition(": ")
        paths.update(p for p in rest.split() if p)
    return paths


def _check_depfile(variant: Variant, stage: Path, closure: dict[str, str]) -> None:
    if "<tree>" in closure:
        return
    used = set()
    for p in _depfile_paths(stage / "deps.d"):
        path = (stage / p).resolve()
        if cache.CSRC in path.parents:
            used.add(str(path.relative_to(cache.CSRC)))
    missed = used - set(closure)
    if missed:
        log.warning("dsv4jit: header scan of %s missed %s (found by the compiler); please report this",
                    variant.id, sorted(missed))


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


def build_root(variant: Variant, arch: Arch, key: str, root: Path) -> Path:
    """The write root `root`, or a per-process temp root when it is not writable and the fallback allows."""
    problem = cache.unwritable(root)
    if problem is None:
        return root
    if env.cache_fallback() == "tmp":
        try:
            fallback = _tmp_root()
        except OSError as e:
            raise _cache_error(e, Path(tempfile.gettempdir()), "TMPDIR") from e
        log.warning("dsv4jit: cache dir %s is not writable (%s); building into %s (DSV4JIT_CACHE_FALLBACK=tmp)",
                    root, problem, fallback)
        return fallback
    raise DSV4JITCacheError(not_cached(
        variant, arch, key, f"the kernel cache dir {root} is not writable ({problem})",
        "set DSV4JIT_CACHE_DIR to a writable folder, or DSV4JIT_CACHE_FALLBACK=tmp to build into a temporary "
        f"folder, or precompile it into a cache this process searches (DSV4JIT_CACHE_PATH): {fix_command(variant, arch)}",
        root))


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
          load_module, root: Path, distrust: cache.Damaged | None = None, stop: Stop | None = None) -> Built:
    """Build and publish into the write root `root` under the per-key lock. `distrust`: the entry of
    this key, which verified but did not load here; it is moved aside and rebuilt like a damaged one.
    `stop`: the batch's (see `Stop`)."""
    root = build_root(variant, arch, info.key, root)
    folder = cache.kernel_dir(root, arch, variant)
    entry = cache.entry_dir(root, arch, variant, info.key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _cache_error(e, folder) from e
    failed = cache.failed_dir(root) / entry.name
    with KeyLock(lock_file(root, entry), variant.id, stop) as lock:
        failure = _failure_since(failed, variant, arch, lock.since)
        if failure is not None:  # the build this process waited for failed: the same compile would too
            raise failure
        if os.path.isdir(entry) and not env.force_rebuild():
            distrusted = distrust is not None and distrust.entry == entry
            problem = distrust.problem if distrusted else cache.entry_problem(entry, info.key)
            if problem is None:  # published by another process while this one waited
                try:
                    module = load_module(entry / "module.so")
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
            raise _cache_error(e, folder) from e
        log.info("dsv4jit: compiling %s for %s (reason: %s; key %s) ...", variant.id, arch, reason, info.key)
        try:
            with progress.compiling(f"{variant.id} for {arch}"):
                module, seconds = _compile_and_check(variant, arch, info, command, stage, failed, load_module, stop)
            if stop is not None:
                stop.check()  # stopped while loading: publish nothing more
            _publish(stage, entry, info, variant, arch, seconds)
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
        raise _cache_error(e, entry.parent) from e
    log.warning("dsv4jit: cached %s at %s is damaged (%s); moved it to %s and rebuilding", variant.id, entry,
                problem, aside.name)


#: Runs the compiler in a process group that dies with the builder (see reaper.py).
REAPER = Path(__file__).with_name("reaper.py")


def _run_compiler(command: Command, stage: Path, timeout: float, stop: Stop | None) -> tuple[str, int | None]:
    """The compiler's output and exit code (None: it ran past `timeout` seconds), run in the stage
    under reaper.py; build.log gets the command line and the output. If this process dies, this call
    is interrupted or `stop` is set, the compiler and every process it started are killed."""
    log_file = stage / "build.log"
    header = command.shell() + "\n\n"
    with open(log_file, "w") as out:
        out.write(header)
        out.flush()
        proc = subprocess.Popen([sys.executable, "-I", "-S", str(REAPER), *command.argv], cwd=stage,
                                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with stop.running(proc) if stop is not None else contextlib.nullcontext():
                code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            proc.stdin.close()  # end of file: the reaper kills the compiler's group if it still runs
            proc.wait()
        if code is None:
            out.write(f"\n{_timed_out(timeout)}\n")
    return log_file.read_text(errors="replace")[len(header):], code


def _timed_out(timeout: float) -> str:
    return f"timed out after {timeout:.0f}s (DSV4JIT_BUILD_TIMEOUT)"


def _compile_and_check(variant, arch, info, command, stage, failed, load_module, stop):
    start = time.monotonic()
    timeout = env.build_timeout()
    log.debug("dsv4jit: key document for %s: %s", variant.id, json.dumps(info.document, indent=1))
    log.debug("dsv4jit: command: %s", command.shell())
    try:
        output, code = _run_compiler(command, stage, timeout, stop)
    except OSError as e:
        raise _cache_error(e, stage.parent) from e
    seconds = time.monotonic() - start
    if stop is not None:
        stop.check()  # its compiler was killed on purpose: not a failure to record
    if env.verbose_build():
        sys.stderr.write(output)
    if code != 0:
        first_error = _timed_out(timeout) if code is None else _first_error(output, code)
        _fail(variant, arch, stage, failed, command, first_error)
    _check_depfile(variant, stage, info.document["headers"])
    try:
        module = load_module(stage / "module.so")
        missing = [name for name in variant.exports() if not hasattr(module, name)]
        if missing:
            raise RuntimeError(f"exports missing from the built module: {missing}")
    except Exception as e:  # noqa: BLE001 - any load failure is a build failure
        _fail(variant, arch, stage, failed, command, f"built module does not load: {e}")
    return module, seconds


FAILURE_FIELDS = {"first_error": str, "failed_at": (int, float), "log": str, "command": str, **OWNER_FIELDS}


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
            f"{_cache_error(e, failed)}\n"
            f"dsv4jit: building {variant.id} for {arch} failed: {first_error}\n"
            f"  its log could not be kept; it ended with:\n" + "".join(f"    {line}\n" for line in tail) +
            f"  reproduce: {command.shell()}") from error
    raise error


def _failure_since(failed: Path, variant: Variant, arch: Arch, since: float) -> DSV4JITBuildError | None:
    """The failure of this key that `_fail` recorded at or after `since` (when this process began to
    wait for the key lock): the build this process waited for failed, and compiling again would
    fail the same way, or hang as long, once per waiting process. A later process tries again."""
    record, _ = cache.read_json(failed / FAILURE, FAILURE_FIELDS)
    if record is None or record["failed_at"] < since:
        return None
    return DSV4JITBuildError(variant.id, arch.name, f"{record['first_error']} (in the build of pid {record['pid']} "
                             f"on host {record['host']}, which this process waited for; not compiled again)",
                             record["log"], record["command"])


def _publish(stage: Path, entry: Path, info: cache.KeyInfo, variant: Variant, arch: Arch, seconds: float) -> None:
    try:
        manifest = {
            "key": info.key, "source_key": info.source_key, "variant": variant.id, "arch": arch.name,
            "document": info.document, "built_at": time.time(), "build_seconds": round(seconds, 3),
            **cache.module_record(stage / "module.so"), "dsv4jit_version": __version__,
            "depfile": sorted(_depfile_paths(stage / "deps.d")),
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
        raise _cache_error(e, entry.parent) from e


def lock_setting() -> str:
    """The variable that moves the lock files."""
    return "DSV4JIT_LOCK_DIR" if env.lock_dir() else "DSV4JIT_CACHE_DIR"


def _cache_error(e: OSError, where: Path, setting: str = "DSV4JIT_CACHE_DIR") -> DSV4JITCacheError:
    """A failed write into the cache (no permission, a full disk, a read-only or too long path, a
    folder where a file belongs, ...) as the place, the reason and the variable that moves it."""
    path = f" ({e.filename})" if e.filename and Path(e.filename) != where else ""
    fix = "a shorter path" if e.errno == errno.ENAMETOOLONG else "a writable folder with free space"
    return DSV4JITCacheError(f"dsv4jit: cannot write the kernel cache at {where}: {e.strerror or e}{path}; "
                             f"set {setting} to {fix}")
