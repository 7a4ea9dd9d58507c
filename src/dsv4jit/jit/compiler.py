"""Running the compiler for one variant: its command line (and the normalised form that enters the
key), the compiler process under reaper.py with its timeout and its batch's `Stop`, and what its
output says: the first error, and the headers its depfile names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import env
from . import cache
from .registry import Variant
from .toolchain import Arch, Toolchain

log = logging.getLogger("dsv4jit")

WRAPPER = {"cuda": "wrapper.cu", "host": "wrapper.cc"}


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
        # ptxas names every kernel that spills registers or uses local memory in the build log: the
        # full suite holds the serving set to the spills it allows (tests/jit/test_compile_serving_set.py)
        argv = [str(tc.nvcc), "-ccbin", str(tc.cxx), "-shared", "-Xcompiler", "-fPIC", "-std=c++20", *opt,
                "--expt-relaxed-constexpr", arch.gencode(), f"-DDSV4JIT_CUDA_ARCH={arch.number}",
                "--threads", "1", "-Xptxas=-warn-spills,-warn-lmem-usage", *extra, *env.extra_cuda_flags(), *deps,
                *includes, "-o", "module.so", source, *link]
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


#: Compiler output that means the disk is full: what the build error then says first, rather than the
#: linker's "ld returned 1" that follows it.
_NO_SPACE = ("no space left on device", "disk quota exceeded")


def first_error(output: str, returncode: int) -> str:
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


def depfile_paths(depfile: Path) -> set[str]:
    try:
        text = depfile.read_text().replace("\\\n", " ")
    except OSError:
        return set()
    paths = set()
    for line in text.splitlines():
        _, _, rest = line.partition(": ")
        paths.update(p for p in rest.split() if p)
    return paths


def check_depfile(variant: Variant, stage: Path, closure: dict[str, str]) -> None:
    if "<tree>" in closure:
        return
    used = set()
    for p in depfile_paths(stage / "deps.d"):
        path = (stage / p).resolve()
        if cache.CSRC in path.parents:
            used.add(str(path.relative_to(cache.CSRC)))
    missed = used - set(closure)
    if missed:
        log.warning("dsv4jit: header scan of %s missed %s (found by the compiler); please report this",
                    variant.id, sorted(missed))


#: Runs the compiler in a process group that dies with the builder (see reaper.py).
REAPER = Path(__file__).with_name("reaper.py")


def run_compiler(command: Command, stage: Path, timeout: float, stop: Stop | None) -> tuple[str, int | None]:
    """The compiler's output and exit code (None: it ran past `timeout` seconds), run in the stage
    under reaper.py; build.log gets the command line and the output, which is read back through the
    open file (so that a build.log deleted meanwhile loses nothing). If this process dies, this call
    is interrupted or `stop` is set, the compiler and every process it started are killed."""
    header = (command.shell() + "\n\n").encode()
    with open(stage / "build.log", "w+b") as out:
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
            out.seek(0, os.SEEK_END)  # after what the compiler wrote through its own descriptor
            out.write(f"\n{timed_out(timeout)}\n".encode())
        out.seek(len(header))
        return out.read().decode(errors="replace"), code


def timed_out(timeout: float) -> str:
    return f"timed out after {timeout:.0f}s (DSV4JIT_BUILD_TIMEOUT)"
