"""Shared fixtures for the JIT loader and CLI tests (CPU only; some tests need nvcc, no GPU).

* Loader and CLI tests (``pytestmark = pytest.mark.usefixtures("jit_env")``) get their own empty kernel cache (``DSV4JIT_CACHE_DIR``), the target ``9.0a``,
  installed prebuilt kernels ignored (``DSV4JIT_PREBUILT=0``) and no other ``DSV4JIT_*`` setting
  except ``DSV4JIT_NVCC``, with the loader's process memos reset.
* ``prebuilt`` compiles ``selftest[dtype=fp32,pdl=1]`` for sm_90a once per session with the real
  toolchain; ``warm_cache`` copies that cache into the test's cache dir, so most tests start warm
  without paying for a compile (about 8 s each).
* ``fake_nvcc`` writes a stand-in nvcc (``<tmp>/fakecuda/bin/nvcc``) that answers ``--dryrun`` and
  ``--version`` like the real one and then execs the real compiler, sleeps, fails, or copies the
  prebuilt module (a fast stand-in for a compile, for tests about the protocol rather than nvcc).
* ``host_planner`` is the CPU planner's entry in the cache the CPU tests share (built there once if
  missing); ``helpers.jit_env.copy_entry(cache_dir, entry)`` copies such an entry into a test's own
  cache, so that a test needing it there does not compile it again.
* Tests marked ``compile`` are skipped, with the reason shown, when no real nvcc exists; tests marked
  ``full`` (the whole serving set, minutes of nvcc; the README's tested versions against the
  environment) run only with ``--full``, as CI runs the suite.
* Skips are summarized one line per reason (``helpers/skip_summary.py``), and what tests measured
  for a person (``record_property("measured", text)``) is printed after the run (``helpers/measured.py``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsv4jit.jit import loader, toolchain
from dsv4jit.jit.toolchain import Arch
from helpers.jit_env import ARCH_TEXT, DEFAULT_VERSION, NO_NVCC_REASON, REAL_NVCC

FULL_REASON = ("in the full suite only (CI's: the serving set compiled for sm_90a and sm_100a, minutes; the tested "
               "versions): add --full")

pytest_plugins = ["pytester", "helpers.skip_summary", "helpers.measured"]


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked full (minutes of nvcc): the suite CI runs")


def pytest_runtest_setup(item):
    # The markers are registered in pyproject.toml: "full" is the CI-only tier, "compile" runs the real nvcc.
    if item.get_closest_marker("full") is not None and not item.config.getoption("full"):
        pytest.skip(FULL_REASON)
    if item.get_closest_marker("compile") is not None and REAL_NVCC is None:
        pytest.skip(NO_NVCC_REASON)


def _hermetic_env(mp: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """Only the settings a test asks for: no stray DSV4JIT_* from the caller's shell."""
    for name in list(os.environ):
        if name.startswith("DSV4JIT_") and name != "DSV4JIT_NVCC":
            mp.delenv(name)
    mp.setenv("DSV4JIT_CACHE_DIR", str(cache_dir))
    mp.setenv("DSV4JIT_CUDA_ARCH", ARCH_TEXT)
    mp.setenv("DSV4JIT_PREBUILT", "0")  # installed prebuilt kernels only where a test asks for them


def _reset_memos() -> None:
    toolchain.reset()
    loader.clear_memo()


@pytest.fixture
def jit_env(tmp_path, monkeypatch) -> Path:
    """A fresh, empty cache dir per test; returns it."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    _hermetic_env(monkeypatch, cache_dir)
    _reset_memos()
    yield cache_dir
    _reset_memos()


@pytest.fixture
def cache_dir(jit_env) -> Path:
    return jit_env


@pytest.fixture
def arch() -> Arch:
    return Arch.parse(ARCH_TEXT)


@pytest.fixture
def selftest():
    """The variant the session cache holds: ``selftest[dtype=fp32,pdl=1]``."""
    return loader.variant("selftest", dtype="fp32", pdl=True)


@dataclass(frozen=True)
class Prebuilt:
    root: Path  # a complete cache root (entry, lock files, toolchain.json)
    entry: Path  # the selftest entry inside ``root``
    key: str

    @property
    def module(self) -> Path:
        return self.entry / "module.so"


@pytest.fixture(scope="session")
def prebuilt(tmp_path_factory) -> Prebuilt:
    """One real compile of the selftest variant for sm_90a, shared (read-only) by the session."""
    if REAL_NVCC is None:
        pytest.skip(NO_NVCC_REASON)
    root = tmp_path_factory.mktemp("prebuilt") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        _hermetic_env(mp, root)
        _reset_memos()
        try:
            variant, arch = loader.variant("selftest", dtype="fp32", pdl=True), Arch.parse(ARCH_TEXT)
            loader.load(variant, arch)
            res = loader.resolve(variant, arch)
        finally:
            _reset_memos()
    assert res.entry is not None and res.entry.is_relative_to(root)
    return Prebuilt(root, res.entry, res.info.key)


@pytest.fixture(scope="session")
def host_planner() -> Path:
    """The CPU planner's entry in the cache the CPU tests share (the caller's), built there if missing."""
    variant, arch = loader.variant("plan_host"), Arch.host()
    loader.load(variant, arch)
    entry = loader.resolve(variant, arch).entry
    assert entry is not None
    return entry


@pytest.fixture
def warm_cache(prebuilt, cache_dir) -> Prebuilt:
    """This test's cache dir seeded with the prebuilt selftest entry (a copy, so tests may change it)."""
    shutil.copytree(prebuilt.root, cache_dir, dirs_exist_ok=True)
    return Prebuilt(cache_dir, cache_dir / prebuilt.entry.relative_to(prebuilt.root), prebuilt.key)


@pytest.fixture
def no_toolchain(tmp_path, monkeypatch):
    """No nvcc anywhere the loader looks; the host compiler stays on PATH."""
    for name in ("DSV4JIT_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(name, raising=False)
    bin_dir = tmp_path / "bin-without-nvcc"
    bin_dir.mkdir()
    if gxx := shutil.which("g++"):
        (bin_dir / "g++").symlink_to(gxx)
    monkeypatch.setenv("PATH", str(bin_dir))
    # The last fallback is a fixed path; hide it if this machine has it.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **kw: False if str(p).startswith("/usr/local/cuda/")
                        else real_access(p, mode, *a, **kw))
    return bin_dir


@pytest.fixture
def fake_nvcc(tmp_path):
    """Factory: ``fake_nvcc(mode=..., ...) -> Path`` of an executable stand-in for nvcc.

    Modes after the optional ``counter`` line, ``started`` marker and ``sleep``:
    ``exec`` runs the real nvcc, ``fail`` prints a compiler-style ``error:`` line and exits 1,
    ``killed`` dies of SIGKILL (as the OOM killer would), ``copy`` copies ``copy_from`` to the
    ``-o`` target. Calling it again with the same ``name``
    rewrites the script in place (same toolkit root, so only what changed enters the key).
    """

    def make(mode: str = "exec", *, version: str = DEFAULT_VERSION, sleep: float = 0,
             counter: Path | None = None, started: Path | None = None, copy_from: Path | None = None,
             error_line: str = "wrapper.cu(3): error: something broke", name: str = "fakecuda") -> Path:
        nvcc = tmp_path / name / "bin" / "nvcc"
        nvcc.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            "#!/bin/sh",
            "# Stand-in for nvcc written by the dsv4jit tests.",
            'for arg in "$@"; do',
            '  case "$arg" in',
            # Real nvcc derives TOP from the path it was started through (symlinks kept).
            '    --dryrun) echo "#\\$ TOP=$(dirname "$0")/.." >&2; exit 0 ;;',
            "    --version) cat <<'DSV4JIT_EOF'",
            version,
            "DSV4JIT_EOF",
            "      exit 0 ;;",
            "  esac",
            "done",
        ]
        if counter is not None:
            lines.append(f"echo $$ >> {shlex.quote(str(counter))}")
        if started is not None:
            lines.append(f"touch {shlex.quote(str(started))}")
        if sleep:
            lines.append(f"sleep {sleep}")
        if mode == "exec":
            if REAL_NVCC is None:
                pytest.skip(NO_NVCC_REASON)
            lines.append(f'exec {shlex.quote(REAL_NVCC)} "$@"')
        elif mode == "fail":
            lines += [f"echo {shlex.quote('compiling wrapper.cu')}",
                      f"echo {shlex.quote(error_line)} >&2", "exit 1"]
        elif mode == "killed":
            lines.append("kill -9 $$")
        elif mode == "copy":
            assert copy_from is not None, "copy mode needs copy_from"
            lines += ['out=""; prev=""',
                      'for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done',
                      f'cp {shlex.quote(str(copy_from))} "$out"']
        else:
            raise ValueError(f"unknown fake nvcc mode {mode!r}")
        nvcc.write_text("\n".join(lines) + "\n")
        nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return nvcc

    return make


@pytest.fixture
def run_cli(capsys):
    """``run_cli(*argv) -> (exit code, stdout, stderr)`` of the in-process CLI."""

    from dsv4jit import cli

    def call(*argv: str):
        capsys.readouterr()
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return call
