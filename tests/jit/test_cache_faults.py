"""Faults of the kernel cache: one test per row of the table in docs/jit.md ("What the cache
guarantees under faults").

No GPU is needed. The session compiles the selftest variant once (``prebuilt``); builds here run
a stand-in nvcc that copies that module (``fake_nvcc("copy")``) and records each run in a counter
file, so every test can assert how many compiles a fault cost.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import filelock
import pytest

from dsv4jit import cli
from dsv4jit.errors import DSV4JITBuildError, DSV4JITCacheError, DSV4JITCacheMiss, DSV4JITLockTimeout
from dsv4jit.jit import cache, loader, toolchain
from dsv4jit.jit.toolchain import Arch
from helpers.child_process import CHILD_PRELUDE, PYTHON, children, counted, kill_all, running, wait_for
from helpers.jit_env import SELFTEST_ID, copy_entry, entries_on_disk, stages_on_disk

pytestmark = pytest.mark.usefixtures("jit_env")

FOREIGN_MODULE = Path(cache.tvm_ffi_info()["lib"]) / "libtvm_ffi_testing.so"  # a tvm-ffi module that loads fine


@pytest.fixture
def published(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir, selftest, arch):
    """An entry published by a (stand-in) compile; returns (entry, counter of compiler runs)."""
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, counter=counter)))
    loader.load(selftest, arch)
    loader.clear_memo()
    [entry] = entries_on_disk(cache_dir)
    assert counted(counter) == 1
    return entry, counter


def _rewrite_manifest(entry: Path, **changes) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    (entry / "manifest.json").write_text(json.dumps(manifest | changes))


def _replace(module: Path, data: bytes) -> None:
    """New contents for a module file, as a new file (an atomic replace, as a careful writer does;
    writers in place are `IN_PLACE`'s)."""
    fresh = module.with_name(module.name + ".new")
    fresh.write_bytes(data)
    os.replace(fresh, module)


def _flip_last_byte(module: Path) -> None:
    data = bytearray(module.read_bytes())
    data[-1] ^= 0xFF  # in the section headers, which dlopen does not need
    _replace(module, bytes(data))


# name -> (damage done to the entry, the problem the WARNING must state). Loaded unchecked, the
# truncated module killed the process with SIGBUS, the changed ones loaded (and crashed it at exit).
DAMAGE = {
    "empty module": (lambda e: _replace(e / "module.so", b""), r"module\.so has 0 bytes, the manifest records \d+"),
    "truncated module": (lambda e: _replace(e / "module.so", (e / "module.so").read_bytes()[:64 * 1024]),
                         r"module\.so has 65536 bytes, the manifest records \d+"),
    "random bytes": (lambda e: _replace(e / "module.so", os.urandom((e / "module.so").stat().st_size)),
                     r"module\.so does not match the sha256 in manifest\.json"),
    "another module": (lambda e: _replace(e / "module.so", FOREIGN_MODULE.read_bytes()),
                       rf"module\.so has {FOREIGN_MODULE.stat().st_size} bytes, the manifest records \d+"),
    "one byte changed": (lambda e: _flip_last_byte(e / "module.so"),
                         r"module\.so does not match the sha256 in manifest\.json"),
    "no manifest": (lambda e: (e / "manifest.json").unlink(), r"manifest\.json is missing or unreadable"),
    "unreadable manifest": (lambda e: (e / "manifest.json").write_text("{"), r"manifest\.json is missing or unreadable"),
    "manifest of another key": (lambda e: _rewrite_manifest(e, key="0" * cache.KEY_CHARS),
                                r"manifest\.json is for key 0{20}, not [0-9a-f]{20}"),
}

LOAD_IN_CHILD = CHILD_PRELUDE + """
import logging
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
print(type(loader.load(VARIANT, ARCH).affine).__name__)
"""


def _load_in_child() -> tuple[str, list[str]]:
    """loader.load in a fresh process, so that a module that crashes dlopen fails the test instead of
    killing the test run; returns (the type of the module's export, the WARNING lines)."""
    run = subprocess.run([PYTHON, "-c", LOAD_IN_CHILD], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr}"
    return run.stdout.split()[-1], [line for line in run.stderr.splitlines() if line.startswith("WARNING ")]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_entry_is_moved_aside_and_rebuilt_once(damage, published, selftest, arch):
    entry, counter = published
    key = loader.resolve(selftest, arch).info.key
    harm, problem = DAMAGE[damage]
    harm(entry)
    damaged_files = {p.name: p.read_bytes() for p in entry.iterdir()}
    export, warnings = _load_in_child()
    assert export == "Function"  # the selftest module, not whatever was there
    [warning] = warnings
    assert re.search(problem, warning) and str(entry) in warning and "moved it to .bad-" in warning
    assert counted(counter) == 2  # the first build and one rebuild
    assert cache.verified_module(entry, key)[1] is None
    [aside] = entry.parent.glob(f".bad-{entry.name}-*")  # kept for inspection, as it was
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == damaged_files
    loader.load(selftest, arch)
    assert counted(counter) == 2  # the rebuilt entry is a hit


def test_verified_entry_that_does_not_load_here_is_rebuilt_once(published, monkeypatch, caplog, selftest, arch):
    """A module that matches its manifest yet fails to load in this process (an environment problem,
    such as a library missing on this host) is rebuilt once; if the rebuild does not load either,
    that is a build error, not a loop."""
    entry, counter = published
    real_load = loader._load_module
    stages_too = []

    def load(path: Path, image: bytes):
        if path.parent == entry or (stages_too and path.parent.name.startswith(".stage-")):
            raise RuntimeError("libexample.so.1: cannot open shared object file")
        return real_load(path, image)

    monkeypatch.setattr(loader, "_load_module", load)
    with caplog.at_level(logging.INFO, logger="dsv4jit"):
        assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    [warning] = _warnings(caplog)
    assert "is damaged (it does not load: libexample.so.1: cannot open shared object file)" in warning
    assert counted(counter) == 2

    loader.clear_memo()
    stages_too.append(True)  # the rebuild does not load either
    with pytest.raises(DSV4JITBuildError, match="built module does not load: libexample.so.1"):
        loader.load(selftest, arch)
    assert counted(counter) == 3


def test_damaged_entry_of_a_read_only_root_is_reported_and_left(published, tmp_path, monkeypatch, caplog, cache_dir,
                                                                  selftest, arch):
    entry, counter = published
    baked = tmp_path / "baked"
    shutil.move(cache_dir, baked)  # the cache becomes a read-only search root
    monkeypatch.setenv("DSV4JIT_CACHE_PATH", str(baked))
    monkeypatch.setenv("DSV4JIT_CACHE_DIR", str(tmp_path / "write-root"))
    baked_entry = baked / entry.relative_to(cache_dir)
    _replace(baked_entry / "module.so", b"")

    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    with pytest.raises(DSV4JITCacheMiss) as err:
        loader.load(selftest, arch)
    assert f"the entry at {baked_entry} is damaged: module.so has 0 bytes" in str(err.value)

    monkeypatch.delenv("DSV4JIT_NO_COMPILE")
    with caplog.at_level(logging.INFO, logger="dsv4jit"):
        assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    [warning] = _warnings(caplog)
    assert f"at {baked_entry} is damaged" in warning and "building into the write root" in warning
    assert counted(counter) == 2
    assert (baked_entry / "module.so").read_bytes() == b""  # never modified
    assert len(entries_on_disk(tmp_path / "write-root")) == 1


def test_list_and_precompile_see_a_damaged_entry(published, capsys):
    entry, counter = published
    _replace(entry / "module.so", b"")
    capsys.readouterr()
    assert cli.main(["list", "--kernel", "selftest", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["variants"]
    assert row["status"] == "missing" and row["entry"] is None
    assert row["damaged"] == [{"entry": str(entry), "problem": row["damaged"][0]["problem"]}]
    assert row["damaged"][0]["problem"].startswith("module.so has 0 bytes")
    assert cli.main(["precompile", "--kernel", "selftest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"] == {"built": 1, "cached": 0, "failed": 0, "cancelled": 0}
    assert counted(counter) == 2


# --------------------------------------------------------------------------------------------
# Paths the lookup cannot read, or that vanish under it


def _deny(monkeypatch, denied, calls=("stat", "lstat", "scandir", "listdir", "open")) -> None:
    """Make `calls` (names of os functions; "open" also stands for io.open and open) fail with EACCES
    for the paths where `denied(path)` holds, as for another user's files. Root ignores permission
    bits, so the calls the cache makes are patched instead."""
    def guard(call):
        def guarded(path, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and denied(Path(os.fsdecode(path))):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))
            return call(path, *args, **kwargs)
        return guarded

    targets = [(os, name) for name in calls] + ([(io, "open"), (builtins, "open")] if "open" in calls else [])
    for module, name in targets:
        monkeypatch.setattr(module, name, guard(getattr(module, name)))


def test_an_unreadable_write_root_is_a_miss_and_the_search_roots_serve(published, tmp_path, monkeypatch, capsys,
                                                                       cache_dir, selftest, arch):
    """The production set-up: a baked cache in DSV4JIT_CACHE_PATH, no compiling, and the default write
    root in a home folder this process cannot enter."""
    entry, counter = published
    baked = tmp_path / "baked"
    shutil.copytree(cache_dir, baked)
    home = tmp_path / "home"
    (home / ".cache" / "dsv4jit").mkdir(parents=True)
    monkeypatch.setenv("DSV4JIT_CACHE_DIR", str(home / ".cache" / "dsv4jit"))
    monkeypatch.setenv("DSV4JIT_CACHE_PATH", str(baked))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    _deny(monkeypatch, lambda path: path.is_relative_to(home))
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    capsys.readouterr()
    assert cli.main(["list", "--kernel", "selftest", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["variants"]
    assert row["status"] == "cached" and row["entry"] == str(baked / entry.relative_to(cache_dir))
    assert counted(counter) == 1


def test_clean_of_an_unreadable_root_says_so(published, monkeypatch, capsys, cache_dir):
    """It used to print "freed 0 bytes" and nothing else."""
    _deny(monkeypatch, lambda path: path.is_relative_to(cache_dir))
    capsys.readouterr()
    assert cli.main(["clean", "--all"]) == 1
    assert capsys.readouterr().err == (f"dsv4jit: cannot read the kernel cache at {cache_dir}: Permission denied; "
                                       "nothing was removed (clean needs to read and write DSV4JIT_CACHE_DIR)\n")
    monkeypatch.undo()
    assert cli.main(["clean", "--all", "--dry-run"]) == 0 and published[0].is_dir()


def test_an_unreadable_module_is_a_damaged_entry_not_a_crash(published, monkeypatch, caplog, selftest, arch):
    entry, counter = published
    real_stat, inode = os.stat, (entry / "module.so").stat().st_ino

    def unreadable(path: Path) -> bool:  # that file (chmod 000, another user's), wherever it is moved
        try:
            return path.name == "module.so" and real_stat(path).st_ino == inode
        except OSError:
            return False

    _deny(monkeypatch, unreadable, calls=("open",))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    with pytest.raises(DSV4JITCacheMiss, match=rf"the entry at {re.escape(str(entry))} is damaged: module\.so cannot "
                                               r"be read \(Permission denied\)"):
        loader.load(selftest, arch)
    monkeypatch.delenv("DSV4JIT_NO_COMPILE")
    with caplog.at_level(logging.INFO, logger="dsv4jit"):
        assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    [warning] = _warnings(caplog)
    assert "(module.so cannot be read (Permission denied)); moved it to .bad-" in warning
    assert counted(counter) == 2


def test_an_entry_removed_during_its_lookup_is_a_miss(published, monkeypatch, selftest, arch):
    """A `clean` removes the entry between the lookup's stat of module.so and its read."""
    entry, counter = published
    read = cache._read_module

    def cleaned_first(path: Path) -> bytes:
        if path == entry / "module.so":
            shutil.rmtree(entry)
        return read(path)

    monkeypatch.setattr(cache, "_read_module", cleaned_first)
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    assert counted(counter) == 2 and (entry / "manifest.json").is_file()  # rebuilt


# --------------------------------------------------------------------------------------------
# Files of the wrong form


def _without(entry: Path, field: str) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    del manifest[field]
    (entry / "manifest.json").write_text(json.dumps(manifest))


# Well-formed JSON, not of the manifest's form: each used to crash every process that met it.
MALFORMED = {
    "a list": lambda e: (e / "manifest.json").write_text("[]"),
    "a string": lambda e: (e / "manifest.json").write_text('"module.so"'),
    "variant a list": lambda e: _rewrite_manifest(e, variant=["selftest"]),
    "built_at a string": lambda e: _rewrite_manifest(e, built_at="yesterday"),
    "size a string": lambda e: _rewrite_manifest(e, size="1070264"),
    "key a number": lambda e: _rewrite_manifest(e, key=7),
    "no sha256": lambda e: _without(e, "sha256"),
}


@pytest.mark.parametrize("form", MALFORMED)
def test_a_manifest_of_the_wrong_form_is_set_aside_and_rebuilt(form, published, caplog, capsys, selftest, arch):
    entry, counter = published
    MALFORMED[form](entry)
    capsys.readouterr()
    for argv in (["list", "--entries"], ["list", "--kernel", "selftest"], ["clean", "--orphans", "--dry-run"],
                 ["clean", "--older-than", "1d", "--stale", "--dry-run"]):
        assert cli.main(argv) == 0, (argv, capsys.readouterr().err)
    with caplog.at_level(logging.INFO, logger="dsv4jit"):
        assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    [warning] = _warnings(caplog)
    assert "(manifest.json is malformed: " in warning and "moved it to .bad-" in warning
    assert counted(counter) == 2


TOOLCHAIN_FORMS = {
    "a list": lambda table: [],
    "a string": lambda table: "nvcc",
    "records not objects": lambda table: {name: [1, 2] for name in table},
    "values of another type": lambda table: {name: record | {"value": ["x"]} for name, record in table.items()},
    "deps not an object": lambda table: {name: record | {"deps": [1]} for name, record in table.items()},
}


@pytest.mark.parametrize("form", TOOLCHAIN_FORMS)
def test_a_toolchain_file_of_the_wrong_form_is_recomputed(form, published, cache_dir, selftest, arch):
    entry, counter = published
    file = cache_dir / "toolchain.json"
    table = json.loads(file.read_text())
    file.write_text(json.dumps(TOOLCHAIN_FORMS[form](table)))
    toolchain.reset()
    assert loader.resolve(selftest, arch).entry == entry
    assert json.loads(file.read_text()) == table


#: A pid past pid_t's range, on this host: checking whether that process lives used to raise OverflowError.
BIG_PID = json.dumps({"pid": 2**32, "host": socket.gethostname()})


@pytest.mark.parametrize("owner", ["[1, 2]", '"pid 1"', '{"pid": "1", "host": "h"}', '{"pid": -1, "host": "h"}',
                                   BIG_PID, '{"pid": NaN, "host": "h"}', '{"pid": 1, "host": "h\\u0000"}',
                                   "[" * 100_000])
def test_an_owner_file_of_the_wrong_form_is_one_that_cannot_be_read(owner, published, monkeypatch, selftest, arch):
    """Hostile forms included: each of the last four used to crash the waiter or every builder of the key."""
    entry, counter = published
    shutil.rmtree(entry)
    lock = entry.with_name(entry.name + ".lock")
    lock.with_name(lock.name + ".owner").write_text(owner)  # a waiter names the holder from it
    holder = filelock.FileLock(str(lock))
    holder.acquire()
    monkeypatch.setenv("DSV4JIT_LOCK_TIMEOUT", "0.3")
    try:
        with pytest.raises(DSV4JITLockTimeout, match=r"waiting for the build of \S+ held by another process"):
            loader.load(selftest, arch)
    finally:
        holder.release()
    stage = cache.stage_dir(entry)  # removed by the next builder, as the stage of a dead one
    stage.mkdir()
    (stage / "owner.json").write_text(owner)
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    assert not stage.exists() and counted(counter) == 2


def test_a_lock_path_that_is_a_folder_is_a_cache_error(published, selftest, arch):
    entry, counter = published
    shutil.rmtree(entry)
    lock = entry.with_name(entry.name + ".lock")
    lock.unlink()
    lock.mkdir()
    with pytest.raises(DSV4JITCacheError, match=rf"^dsv4jit: cannot write the kernel cache at "
                                                rf"{re.escape(str(entry.parent))}: Is a directory "
                                                rf"\({re.escape(str(lock))}\); set DSV4JIT_CACHE_DIR"):
        loader.load(selftest, arch)
    assert counted(counter) == 1


# --------------------------------------------------------------------------------------------
# A loaded module whose file is overwritten in place


# name -> what is done to `module` (the entry's module.so, loaded in the child) from within that child,
# as from another process: each keeps the file's inode, which the loaded code used to map.
IN_PLACE = {
    "truncated": "os.truncate(module, 0)",
    "cut short": "os.truncate(module, module.stat().st_size // 2)",
    "overwritten by cp": f"shutil.copyfile({str(FOREIGN_MODULE)!r}, module)",  # cp opens it O_TRUNC, then writes
}

PLAN_THEN_HARM = """
import os, shutil, torch
from dsv4jit.jit import loader
from dsv4jit.jit.toolchain import Arch
from dsv4jit.plan import CompressorDecodePlan

def plan():
    tables = (torch.arange(2 * 64, dtype=torch.int32).view(2, 64), torch.arange(1024))
    return CompressorDecodePlan.generate(4, torch.tensor([0, 1]), *tables, torch.tensor([5, 9]), 256, 8).plan_d

first = plan()
module = loader.resolve(loader.variant("plan_host"), Arch.host()).entry / "module.so"
HARM
assert plan().equal(first)
print("survived")
"""

BUILD_THEN_HARM = CHILD_PRELUDE + """
import shutil
loaded = loader.load(VARIANT, ARCH)  # built in this process
module = loader.resolve(VARIANT, ARCH).entry / "module.so"
HARM
print(type(loaded.affine).__name__)  # looked up in the loaded library's symbol table
print("survived")
"""


def _run_child(script: str, harm: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", script.replace("HARM", IN_PLACE[harm])], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("harm", IN_PLACE)
def test_a_module_overwritten_in_place_under_a_live_process_does_not_kill_it(harm, host_planner, cache_dir):
    """Load the CPU planner, plan, change its module.so in place, plan again: the second plan used
    to die of SIGBUS (exit 135 in a shell)."""
    copy_entry(cache_dir, host_planner)
    run = _run_child(PLAN_THEN_HARM, harm)
    assert run.returncode == 0 and run.stdout.split()[-1] == "survived", (run.returncode, run.stderr[-2000:])
    assert loader.resolve(loader.variant("plan_host"), Arch.host()).entry is None  # damaged now: rebuilt if loaded


@pytest.mark.parametrize("harm", IN_PLACE)
def test_a_module_built_in_this_process_and_overwritten_in_place_does_not_kill_it(harm, fake_nvcc, prebuilt,
                                                                                   monkeypatch):
    """The builder loads the module it built, which then becomes the entry's: the same rule."""
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    run = _run_child(BUILD_THEN_HARM, harm)
    assert run.returncode == 0 and run.stdout.split()[-2:] == ["Function", "survived"], \
        (run.returncode, run.stderr[-2000:])


# --------------------------------------------------------------------------------------------
# Hostile metadata: files that parse, or nearly, but not within the bounds (jit/metadata.py)


def _nested(path: Path) -> None:
    path.write_text("[" * 100_000)  # json's decoder recursed once per level: RecursionError


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # opened for reading, it used to block until a writer came


# name -> (harm done to the entry, the problem the WARNING states after "manifest.json is malformed: ").
HOSTILE_MANIFESTS = {
    "nested 100000 deep": (lambda e: _nested(e / "manifest.json"), "nested deeper than 16 levels"),
    "a NUL in a string": (lambda e: _rewrite_manifest(e, variant="selftest\0"), "a NUL character in the text"),
    "built_at NaN": (lambda e: _rewrite_manifest(e, built_at=float("nan")), "a number that is not finite (NaN)"),
    "size Infinity": (lambda e: _rewrite_manifest(e, size=float("inf")), "a number that is not finite (Infinity)"),
    "build_seconds 1e999": (lambda e: (e / "manifest.json").write_text(
        (e / "manifest.json").read_text().replace('"build_seconds": ', '"build_seconds": 1e999, "was": ')),
        "a number out of range (1e999)"),
    "size negative": (lambda e: _rewrite_manifest(e, size=-1), "its 'size' is -1"),
    "over 1 MiB": (lambda e: _rewrite_manifest(e, depfile=["x" * (1 << 20)]), "larger than 1048576 bytes"),
    "a FIFO": (lambda e: _fifo(e / "manifest.json"), "not a regular file"),
}


@pytest.mark.parametrize("form", HOSTILE_MANIFESTS)
def test_a_hostile_manifest_is_a_damaged_entry_for_every_reader(form, published, caplog, capsys, selftest, arch):
    """Every command that reads the cache runs (the nested one ended each in "internal error (exit
    3)"), and precompile moves the entry aside and rebuilds it once."""
    entry, counter = published
    harm, problem = HOSTILE_MANIFESTS[form]
    harm(entry)
    capsys.readouterr()
    for argv in (["list", "--entries"], ["list", "--kernel", "selftest"], ["info", SELFTEST_ID],
                 ["clean", "--all", "--dry-run"], ["clean", "--stale", "--orphans", "--older-than", "1d", "--dry-run"]):
        assert cli.main(argv) == 0, (argv, capsys.readouterr().err)
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="dsv4jit"):
        assert cli.main(["precompile", "--kernel", "selftest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["built"] == 1
    [warning] = _warnings(caplog)
    assert f"(manifest.json is malformed: {problem}" in warning and "moved it to .bad-" in warning
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    assert counted(counter) == 2  # the first build and one rebuild; the load is a hit


def test_a_hostile_manifest_where_nothing_can_be_built_is_a_cache_error_naming_it(published, monkeypatch, capsys,
                                                                                  selftest, arch):
    entry, counter = published
    _nested(entry / "manifest.json")
    monkeypatch.setattr(cache, "unwritable", lambda root: "write access denied")  # root ignores permission bits
    with pytest.raises(DSV4JITCacheError, match=rf"the entry at {re.escape(str(entry))} is damaged: manifest\.json is "
                                                r"malformed: nested deeper than 16 levels\) and the kernel cache dir "
                                                r".* is not writable"):
        loader.load(selftest, arch)
    capsys.readouterr()
    assert cli.main(["precompile", "--kernel", "selftest"]) == 1  # a failed build, not an internal error
    assert counted(counter) == 1


# name -> the text of toolchain.json, from the table it held.
HOSTILE_TOOLCHAINS = {
    "nested 100000 deep": lambda table: "[" * 100_000,
    "a NUL in a dependency path": lambda table: json.dumps(
        {name: record | {"deps": {"/usr/bin/nvcc\0": None}} for name, record in table.items()}),
    "a NaN in a stamp": lambda table: json.dumps(
        {name: record | {"stamp": [record["stamp"][0], float("nan"), 0]} for name, record in table.items()}),
}


@pytest.mark.parametrize("form", HOSTILE_TOOLCHAINS)
def test_a_hostile_toolchain_file_is_recomputed(form, published, capsys, cache_dir, selftest, arch):
    """The NUL made every load raise "ValueError: embedded null byte", and list and info exit 3."""
    entry, counter = published
    file = cache_dir / "toolchain.json"
    table = json.loads(file.read_text())
    file.write_text(HOSTILE_TOOLCHAINS[form](table))
    toolchain.reset()
    capsys.readouterr()
    assert cli.main(["list", "--kernel", "selftest", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)["variants"]
    assert row["status"] == "cached" and row["entry"] == str(entry)
    assert json.loads(file.read_text()) == table  # replaced by the recomputed identity
    file.write_text(HOSTILE_TOOLCHAINS[form](table))
    toolchain.reset()
    assert cli.main(["info"]) == 0
    assert loader.resolve(selftest, arch).entry == entry


def _failure(failed_at) -> str:
    return json.dumps({"first_error": "an old failure", "failed_at": failed_at, "log": "build.log",
                       "command": "nvcc", "pid": 1, "host": socket.gethostname()})


FAILURE_RECORDS = {
    "failed_at NaN": lambda: _failure(float("nan")),
    "failed_at Infinity": lambda: _failure(float("inf")),
    "failed_at in an hour": lambda: _failure(time.time() + 3600),  # another host's clock, on a shared cache
    "nested 100000 deep": lambda: "[" * 100_000,
}


@pytest.mark.parametrize("form", FAILURE_RECORDS)
def test_a_failure_record_not_of_a_finite_past_time_expires(form, published, capsys, cache_dir, selftest, arch):
    """Each used to block the key for good (every load and precompile reported the old failure and
    never compiled again), or crashed the builder."""
    entry, counter = published
    shutil.rmtree(entry)
    failed = cache.failed_dir(cache_dir) / entry.name
    failed.mkdir(parents=True)
    (failed / "failure.json").write_text(FAILURE_RECORDS[form]())
    capsys.readouterr()
    assert cli.main(["precompile", "--kernel", "selftest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["built"] == 1
    assert counted(counter) == 2 and cache.verified_module(entry)[1] is None


# --------------------------------------------------------------------------------------------
# Settings that change what nvcc builds


@pytest.mark.parametrize("name", ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"])
def test_nvcc_flag_variables_are_part_of_the_key(name, published, monkeypatch, cache_dir, selftest, arch):
    entry, counter = published
    host = loader.variant("plan_host")
    plain, plain_host = loader.resolve(selftest, arch), loader.resolve(host, Arch.host())
    monkeypatch.setenv(name, "-G -lineinfo")  # nvcc reads these itself: a debug build
    flagged = loader.resolve(selftest, arch)
    assert flagged.info.key != plain.info.key and flagged.entry is None
    assert flagged.info.document["command"][0] == f"{name}=-G -lineinfo"
    assert loader.resolve(host, Arch.host()).info.key == plain_host.info.key  # the host compiler ignores them
    loader.load(selftest, arch)
    assert counted(counter) == 2
    [debug] = [e for e in entries_on_disk(cache_dir) if e != entry]
    assert (debug / "build.log").read_text().startswith(f"{name}='-G -lineinfo' ")
    monkeypatch.delenv(name)
    assert loader.resolve(selftest, arch).entry == entry  # a process without the setting keeps its own build


# --------------------------------------------------------------------------------------------
# A builder that dies or is interrupted takes its compiler down


def _start_slow_build(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir):
    """A builder child whose stand-in nvcc (a shell running `sleep`) is under way; returns
    (builder, compiler pids: the shell and its sleep)."""
    pids = tmp_path / "nvcc-pids"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, sleep=120, counter=pids)))
    builder = subprocess.Popen([PYTHON, "-c", CHILD_PRELUDE + "loader.load(VARIANT, ARCH)"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: counted(pids) == 1, 120, "the compile to start", builder)
    shell = int(pids.read_text().split()[0])
    wait_for(lambda: children(shell), 10, "the compiler's child (sleep)", builder)
    assert stages_on_disk(cache_dir)
    return builder, [shell, *children(shell)]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_dead_or_interrupted_builder_takes_its_compiler_down(how, fake_nvcc, prebuilt, tmp_path, monkeypatch,
                                                             cache_dir):
    """Only the builder gets the signal (not its process group), as from the OOM killer or `kill`."""
    builder, compiler = _start_slow_build(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir)
    try:
        builder.send_signal(getattr(signal, how))
        _, err = builder.communicate(timeout=60)
        wait_for(lambda: not any(running(pid) for pid in compiler), 10, "the compiler processes to be killed")
    finally:
        kill_all([builder.pid, *compiler])
    assert builder.returncode != 0
    if how == "SIGINT":  # interrupted: the builder cleaned up after itself and re-raised
        assert "KeyboardInterrupt" in err
        assert stages_on_disk(cache_dir) == []
    assert entries_on_disk(cache_dir) == []


def test_a_build_log_deleted_during_the_compile_is_not_a_cache_error(fake_nvcc, prebuilt, tmp_path, monkeypatch,
                                                                     cache_dir, selftest, arch):
    """It was reported as an unwritable cache; the compile's output is read back through the open file."""
    started = tmp_path / "started"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, started=started, sleep=2)))
    loaded = []
    builder = threading.Thread(target=lambda: loaded.append(loader.load(selftest, arch)))
    builder.start()
    wait_for(started.exists, 60, "the compile to start")
    [stage] = stages_on_disk(cache_dir)
    (stage / "build.log").unlink()
    builder.join(60)
    assert [type(m.affine).__name__ for m in loaded] == ["Function"]
    assert len(entries_on_disk(cache_dir)) == 1


def test_compiler_past_the_build_timeout_is_killed_with_its_children(fake_nvcc, prebuilt, tmp_path, monkeypatch,
                                                                     cache_dir, selftest, arch):
    pids = tmp_path / "nvcc-pids"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, sleep=60, counter=pids)))
    monkeypatch.setenv("DSV4JIT_BUILD_TIMEOUT", "2")
    failed = []

    def load() -> None:
        with pytest.raises(DSV4JITBuildError, match=r"timed out after 2s \(DSV4JIT_BUILD_TIMEOUT\)") as err:
            loader.load(selftest, arch)
        failed.append(err.value)

    builder = threading.Thread(target=load)
    builder.start()
    wait_for(lambda: counted(pids) == 1 and children(int(pids.read_text().split()[0])), 60, "the compile to start")
    shell = int(pids.read_text().split()[0])
    spawned = [shell, *children(shell)]
    try:
        builder.join(60)
        wait_for(lambda: not any(running(pid) for pid in spawned), 10, "the compiler processes to be killed")
    finally:
        kill_all(spawned)
    [err] = failed
    assert "timed out after 2s" in Path(err.log_path).read_text()
    assert entries_on_disk(cache_dir) == [] and stages_on_disk(cache_dir) == []


def test_a_waiter_does_not_repeat_a_build_that_timed_out(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir,
                                                          selftest, arch):
    """It reports the failure of the build it waited for; a later attempt compiles again."""
    monkeypatch.setenv("DSV4JIT_BUILD_TIMEOUT", "3")
    builder, compiler = _start_slow_build(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir)
    try:
        with pytest.raises(DSV4JITBuildError, match=rf"timed out after 3s \(DSV4JIT_BUILD_TIMEOUT\) \(in the build of "
                                                    rf"pid {builder.pid} on host \S+, which this process waited for; "
                                                    r"not compiled again\)"):
            loader.load(selftest, arch)
        builder.communicate(timeout=60)
    finally:
        kill_all([builder.pid, *compiler])
    pids = tmp_path / "nvcc-pids"
    assert counted(pids) == 1
    fake_nvcc("copy", copy_from=prebuilt.module, counter=pids)  # it no longer hangs
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    assert counted(pids) == 2


@pytest.mark.parametrize("how, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_precompile_stopped_by_a_signal_kills_its_compiles_at_once(how, code, fake_nvcc, prebuilt, tmp_path,
                                                                   monkeypatch, cache_dir):
    """Ctrl-C or SIGTERM on `precompile -j 2`: both compilers die at once, nothing is published or
    recorded as failed, the stages are removed, and one line says so."""
    pids = tmp_path / "nvcc-pids"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, sleep=120, counter=pids)))
    command = subprocess.Popen([PYTHON, "-m", "dsv4jit", "precompile", "--kernel", "selftest", "--set", "all",
                                "-j", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    compilers: list[int] = []
    try:
        wait_for(lambda: counted(pids) == 2 and all(children(int(p)) for p in pids.read_text().split()), 120,
                 "two compiles to start", command)
        compilers = [pid for shell in map(int, pids.read_text().split()) for pid in (shell, *children(shell))]
        sent = time.monotonic()
        command.send_signal(getattr(signal, how))
        _, err = command.communicate(timeout=60)
        took = time.monotonic() - sent
        wait_for(lambda: not any(running(pid) for pid in compilers), 10, "the compiler processes to be killed")
    finally:
        kill_all([command.pid, *compilers])
    assert command.returncode == code and took < 10, (command.returncode, took, err)
    assert "Traceback" not in err and err.count("stopped by") == 1
    assert err.splitlines()[-1] == (f"dsv4jit: precompile stopped by {how}; compiles under way were killed and "
                                    "published nothing")
    assert entries_on_disk(cache_dir) == [] and stages_on_disk(cache_dir) == []
    assert not cache.failed_dir(cache_dir).exists()


# --------------------------------------------------------------------------------------------
# Unwritable places


def _deny_writes(folder: Path, monkeypatch) -> None:
    """Make creating files in `folder` fail with EACCES. Root ignores permission bits, so for root the
    lock library's open is made to fail as it then would."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return
    acquire = filelock.FileLock.acquire

    def denied(self, *args, **kwargs):
        if Path(self.lock_file).parent == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), self.lock_file)
        return acquire(self, *args, **kwargs)

    monkeypatch.setattr(filelock.FileLock, "acquire", denied)


@pytest.mark.parametrize("lock_dir", [False, True], ids=["kernel folder", "DSV4JIT_LOCK_DIR"])
def test_unwritable_lock_folder_raises_the_cache_error(lock_dir, fake_nvcc, prebuilt, tmp_path, monkeypatch, capsys,
                                                       cache_dir, selftest, arch):
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, counter=counter)))
    base = tmp_path / "locks" if lock_dir else cache_dir
    if lock_dir:
        monkeypatch.setenv("DSV4JIT_LOCK_DIR", str(base))
    folder = cache.kernel_dir(base, arch, selftest)
    folder.mkdir(parents=True)
    _deny_writes(folder, monkeypatch)
    try:
        with pytest.raises(DSV4JITCacheError) as err:
            loader.load(selftest, arch)
        setting = "DSV4JIT_LOCK_DIR" if lock_dir else "DSV4JIT_CACHE_DIR"
        lock = folder / f"{selftest.slug}-{loader.resolve(selftest, arch).info.key}.lock"
        assert str(err.value) == (f"dsv4jit: cannot write the kernel cache at {folder}: Permission denied ({lock}); "
                                  f"set {setting} to a writable folder with free space")
        capsys.readouterr()
        assert cli.main(["precompile", "--kernel", "selftest", "--json"]) == 1  # a failed build, no traceback
        [result] = json.loads(capsys.readouterr().out)["results"]
        assert result["status"] == "failed" and result["error"] == str(err.value)
    finally:
        folder.chmod(0o755)
    assert counted(counter) == 0


def test_a_full_disk_while_keeping_the_log_of_a_failed_build_keeps_the_compile_error(fake_nvcc, monkeypatch,
                                                                                    cache_dir, selftest, arch):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail")))
    failed = cache.failed_dir(cache_dir) / f"{selftest.slug}-{loader.resolve(selftest, arch).info.key}"
    copy2 = shutil.copy2

    def disk_full(source, target, *args, **kwargs):
        if Path(target).parent == failed:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
        return copy2(source, target, *args, **kwargs)

    monkeypatch.setattr(shutil, "copy2", disk_full)
    with pytest.raises(DSV4JITCacheError) as err:
        loader.load(selftest, arch)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"dsv4jit: cannot write the kernel cache at {failed}: No space left on device")
    assert lines[1] == f"dsv4jit: building {SELFTEST_ID} for sm_90a failed: wrapper.cu(3): error: something broke"
    assert "    wrapper.cu(3): error: something broke" in lines  # the end of the log, which is not kept
    assert isinstance(err.value.__cause__, DSV4JITBuildError)
    assert stages_on_disk(cache_dir) == []


def test_no_space_in_the_compiler_output_is_the_error_it_reports(fake_nvcc, monkeypatch, selftest, arch):
    """Not the linker's "ld returned 1" that follows it."""
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", error_line="/usr/bin/ld: final link failed: No space "
                                                     "left on device\ncollect2: error: ld returned 1 exit status")))
    with pytest.raises(DSV4JITBuildError) as err:
        loader.load(selftest, arch)
    assert err.value.first_error.startswith("out of disk space: /usr/bin/ld: final link failed: No space left on "
                                            "device (free some where the compiler writes")


def test_a_cache_root_over_the_name_limit_is_a_cache_error(fake_nvcc, prebuilt, tmp_path, monkeypatch, capsys,
                                                            selftest, arch):
    root = tmp_path / ("x" * 300) / "cache"
    monkeypatch.setenv("DSV4JIT_CACHE_DIR", str(root))
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    with pytest.raises(DSV4JITCacheError, match=rf"the kernel cache dir {re.escape(str(root))} is not writable "
                                                r"\(File name too long\).* set DSV4JIT_CACHE_DIR to"):
        loader.load(selftest, arch)
    capsys.readouterr()
    for argv in (["list", "--kernel", "selftest"], ["list", "--entries"], ["clean", "--all"], ["info"]):
        assert cli.main(argv) == 0, (argv, capsys.readouterr().err)
    assert cli.main(["precompile", "--kernel", "selftest", "--set", SELFTEST_ID]) == 1
    assert "(File name too long)" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# Concurrency


def test_clean_and_list_leave_the_stage_of_a_live_build_alone(published, capsys):
    """A builder writes its manifest into its stage just before the rename that publishes it."""
    entry, counter = published
    stage = cache.stage_dir(entry)  # of this process, which is alive
    shutil.copytree(entry, stage)
    (stage / "owner.json").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    capsys.readouterr()
    assert cli.main(["list", "--entries", "--json"]) == 0
    assert [row["entry"] for row in json.loads(capsys.readouterr().out)["entries"]] == [str(entry)]
    assert cli.main(["clean", "--all", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == [str(entry)]
    assert cli.main(["clean", "--all"]) == 0
    assert stage.is_dir() and not entry.exists()


def test_clean_takes_the_key_lock_before_removing_a_stage_or_a_set_aside_entry(published, monkeypatch, capsys):
    entry, counter = published
    bad = cache.aside_dir(entry, cache.BAD)
    shutil.copytree(entry, bad)
    stage = cache.stage_dir(entry)
    stage.mkdir()
    past = time.time() - 3600  # older than the build timeout: a leftover, once its key's lock is free
    os.utime(stage, (past, past))
    holder = filelock.FileLock(str(entry.with_name(entry.name + ".lock")))  # a builder of that key
    holder.acquire()
    monkeypatch.setenv("DSV4JIT_LOCK_TIMEOUT", "0.5")
    try:
        capsys.readouterr()
        assert cli.main(["clean", "--stale"]) == 1
        err = capsys.readouterr().err
    finally:
        holder.release()
    assert re.match(rf"dsv4jit: gave up after \d+s waiting for the build of {entry.name} held by pid ", err)
    assert bad.is_dir() and stage.is_dir()
    assert cli.main(["clean", "--stale"]) == 0
    assert not bad.exists() and not stage.exists() and entry.is_dir()


def test_eight_precompiles_over_a_damaged_entry_rebuild_it_once(published, fake_nvcc, prebuilt, tmp_path):
    """One process moves the entry aside (the one WARNING) and rebuilds it; the seven others wait for
    its lock and say that another process built it."""
    entry, counter = published
    _replace(entry / "module.so", b"")
    fake_nvcc("copy", copy_from=prebuilt.module, counter=counter, sleep=2)  # slow enough for all to queue
    go = tmp_path / "go"
    script = """
import sys, time
from pathlib import Path
from dsv4jit import cli
Path(sys.argv[1] + ".ready").touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.005)
sys.exit(cli.main(["precompile", "--kernel", "selftest", "--json"]))
"""
    procs = [subprocess.Popen([PYTHON, "-c", script, str(tmp_path / f"child{i}"), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    try:
        for i, p in enumerate(procs):
            wait_for(lambda: (tmp_path / f"child{i}.ready").exists(), 120, f"child {i} to start", p)
        go.touch()
        results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    finally:
        kill_all(p.pid for p in procs if p.poll() is None)
    statuses = []
    for out, err, code in results:
        assert code == 0, err
        [result] = json.loads(out)["results"]
        statuses.append(result["status"])
    assert sorted(statuses) == ["built"] + ["cached"] * 7
    assert counted(counter) == 2
    logs = "".join(err for _, err, _ in results)
    [warning] = re.findall(r".* is damaged .*", logs)
    assert "(module.so has 0 bytes" in warning
    assert entries_on_disk(entry.parents[3]) == [entry]


def test_precompile_that_waited_says_another_process_built_it(published, fake_nvcc, prebuilt, tmp_path, monkeypatch,
                                                              capsys, cache_dir):
    entry, counter = published
    shutil.rmtree(entry)
    fake_nvcc("copy", copy_from=prebuilt.module, counter=counter, sleep=3)
    other = subprocess.Popen([PYTHON, "-c", CHILD_PRELUDE + "loader.load(VARIANT, ARCH)"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: counted(counter) == 2, 120, "the other process's compile to start", other)
        capsys.readouterr()
        assert cli.main(["precompile", "--kernel", "selftest"]) == 0
        out = capsys.readouterr().out
        other.communicate(timeout=60)
    finally:
        kill_all([other.pid])
    assert re.search(rf"\[1/1\] {re.escape(SELFTEST_ID)} sm_90a built by another process \(waited \d+\.\ds\)", out)
    assert "built 0, cached 1, failed 0" in out
    assert counted(counter) == 2
