"""Build, publish and load: concurrency, crashes, read-only roots, no-compile mode, errors, warm path.

Most tests start from the session's prebuilt selftest entry. Tests about the build protocol use a
stand-in nvcc that copies that prebuilt module instead of compiling (the protocol is the same; a
real compile costs about 8 s, and the session compiles nothing twice).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

from dsv4jit import cli
from dsv4jit.errors import DSV4JITBuildError, DSV4JITCacheError, DSV4JITCacheMiss, DSV4JITError, \
    DSV4JITToolchainError
from dsv4jit.jit import batch, build, cache, loader, toolchain
from helpers.child_process import CHILD_PRELUDE, PYTHON, counted, wait_for
from helpers.jit_env import SELFTEST_ID, entries_on_disk, stages_on_disk

pytestmark = pytest.mark.usefixtures("jit_env")

# --------------------------------------------------------------------------------------------
# (1) concurrency


def test_eight_processes_cold_loading_compile_once(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir):
    counter = tmp_path / "nvcc-runs"
    # A compile of a few seconds, so that the other seven find the build in progress.
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, sleep=3, counter=counter)))
    go = tmp_path / "go"
    script = CHILD_PRELUDE + """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
Path(sys.argv[1] + ".ready").touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.005)
module = loader.load(VARIANT, ARCH)
print(json.dumps({"pid": os.getpid(), "affine": type(module.affine).__name__}))
"""
    procs = [subprocess.Popen([PYTHON, "-c", script, str(tmp_path / f"child{i}"), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(8)]
    try:
        for i, p in enumerate(procs):
            wait_for(lambda: (tmp_path / f"child{i}.ready").exists(), 120, f"child {i} to start", p)
        go.touch()  # all eight look the variant up at once
        results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for out, err, code in results:
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["affine"] == "Function"
    assert counted(counter) == 1
    logs = "".join(err for _, err, _ in results)
    assert len(re.findall(r"dsv4jit: compiling selftest\[dtype=fp32,pdl=1\]", logs)) == 1
    assert len(entries_on_disk(cache_dir)) == 1
    assert stages_on_disk(cache_dir) == []


# --------------------------------------------------------------------------------------------
# (2) a builder killed mid-compile


def test_killed_builder_leaves_no_entry_and_its_stage_is_cleaned(fake_nvcc, prebuilt, tmp_path, monkeypatch,
                                                                  cache_dir, selftest, arch):
    started = tmp_path / "nvcc-started"
    nvcc = fake_nvcc("copy", copy_from=prebuilt.module, sleep=120, started=started)
    monkeypatch.setenv("DSV4JIT_NVCC", str(nvcc))
    # Own session, so the SIGKILL reaches the stand-in compiler as well as the Python builder.
    builder = subprocess.Popen([PYTHON, "-c", CHILD_PRELUDE + "loader.load(VARIANT, ARCH)"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: started.exists() and stages_on_disk(cache_dir), 120, "the compile to start", builder)
    finally:
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait()  # reaped, so its pid is really gone
    assert builder.returncode == -signal.SIGKILL

    [stage] = stages_on_disk(cache_dir)
    assert json.loads((stage / "owner.json").read_text())["pid"] == builder.pid
    assert entries_on_disk(cache_dir) == []
    assert not list(cache_dir.rglob("manifest.json"))

    fake_nvcc("copy", copy_from=prebuilt.module)  # same toolkit, no longer slow
    module = loader.load(selftest, arch)  # the lock died with the builder; no wait
    assert type(module.affine).__name__ == "Function"
    assert not stage.exists()
    assert stages_on_disk(cache_dir) == []
    assert len(entries_on_disk(cache_dir)) == 1


# --------------------------------------------------------------------------------------------
# (3) read-only cache dir


@pytest.fixture
def read_only_cache(cache_dir, monkeypatch):
    """Make the write root unwritable; root ignores permission bits, so then fake the check."""
    if os.geteuid() == 0:
        monkeypatch.setattr(cache, "unwritable", lambda root: "write access denied")
    else:
        cache_dir.chmod(0o555)
    yield cache_dir
    cache_dir.chmod(0o755)


def test_read_only_cache_dir_raises_naming_the_dir_the_variant_and_the_fix(fake_nvcc, prebuilt, monkeypatch, read_only_cache, selftest, arch):
    counter = read_only_cache.parent / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, counter=counter)))
    with pytest.raises(DSV4JITCacheError) as err:
        loader.load(selftest, arch)
    assert str(read_only_cache) in str(err.value)
    assert "DSV4JIT_CACHE_DIR" in str(err.value) and "DSV4JIT_CACHE_FALLBACK=tmp" in str(err.value)
    # what is missing, and the command that builds it (as in the no-compile mode's message)
    assert f"{SELFTEST_ID} for sm_90a is not in the kernel cache" in str(err.value)
    assert f"python -m dsv4jit precompile --arch sm_90a --set '{SELFTEST_ID}'" in str(err.value)
    assert counted(counter) == 0
    assert not (read_only_cache / f"v{cache.SCHEMA}").exists()


def test_read_only_cache_dir_with_tmp_fallback_builds_elsewhere(fake_nvcc, prebuilt, tmp_path, monkeypatch, caplog,
                                                                 read_only_cache, selftest, arch):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    monkeypatch.setenv("DSV4JIT_CACHE_FALLBACK", "tmp")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(build, "_TMP_ROOT", [])  # the per-process temp root, fresh for this test
    with caplog.at_level(logging.WARNING, logger="dsv4jit"):
        module = loader.load(selftest, arch)
    assert type(module.affine).__name__ == "Function"
    [fallback_root] = build._TMP_ROOT
    assert fallback_root.parent == scratch
    assert len(entries_on_disk(fallback_root)) == 1
    assert not (read_only_cache / f"v{cache.SCHEMA}").exists()
    assert "not writable" in caplog.text and str(read_only_cache) in caplog.text


# --------------------------------------------------------------------------------------------
# (4) no-compile mode


def test_no_compile_miss_names_the_variant_and_the_fix(fake_nvcc, prebuilt, tmp_path, monkeypatch, capsys,
                                                       cache_dir, selftest, arch):
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, counter=counter)))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    with pytest.raises(DSV4JITCacheMiss) as err:
        loader.load(selftest, arch)
    message = str(err.value)
    key = loader.resolve(selftest, arch).info.key
    assert SELFTEST_ID in message and "sm_90a" in message and key in message and str(cache_dir) in message
    assert counted(counter) == 0 and entries_on_disk(cache_dir) == []

    # The suggested command is a real one: it selects exactly this variant, arch and key.
    fix = shlex.split(re.search(r"Fix: (.*)$", message).group(1))
    assert fix[:4] == ["python", "-m", "dsv4jit", "precompile"]
    capsys.readouterr()
    assert cli.main(fix[3:] + ["--dry-run", "--json"]) == 0
    [planned] = json.loads(capsys.readouterr().out)["results"]
    assert planned == {"variant": SELFTEST_ID, "arch": "sm_90a", "status": "would build", "key": key}


def test_no_compile_still_loads_cached_entries(warm_cache, monkeypatch, selftest, arch):
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"


def test_read_only_search_root_serves_hits_without_writing(prebuilt, cache_dir, monkeypatch, selftest, arch):
    monkeypatch.setenv("DSV4JIT_CACHE_PATH", str(prebuilt.root))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    res = loader.resolve(selftest, arch)
    assert res.entry == prebuilt.entry
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    assert not (cache_dir / f"v{cache.SCHEMA}").exists()


# --------------------------------------------------------------------------------------------
# (5) no nvcc


def test_missing_nvcc_error_says_where_it_looked(no_toolchain):
    with pytest.raises(DSV4JITToolchainError) as err:
        toolchain.toolchain(need_cuda=True)
    for place in ("DSV4JIT_NVCC", "CUDA_HOME", "CUDA_PATH", "PATH", "/usr/local/cuda"):
        assert place in str(err.value)


def test_cold_load_without_nvcc_names_the_variant_and_the_fix(no_toolchain, cache_dir, selftest, arch):
    with pytest.raises(DSV4JITError) as err:
        loader.load(selftest, arch)
    assert SELFTEST_ID in str(err.value)
    assert f"python -m dsv4jit precompile --arch sm_90a --set '{SELFTEST_ID}'" in str(err.value)
    assert entries_on_disk(cache_dir) == []


def test_cold_load_without_a_host_compiler_says_what_to_install(monkeypatch, cache_dir):
    monkeypatch.setenv("DSV4JIT_CXX", "/nonexistent/g++")
    with pytest.raises(DSV4JITToolchainError) as err:
        loader.load(loader.variant("plan_host"), toolchain.Arch.host())
    message = str(err.value)
    assert "no host C++ compiler found (looked for ['/nonexistent/g++'])" in message
    assert "install a C++20 compiler" in message and "DSV4JIT_CXX" in message
    # Precompiling here would fail the same way: the fix says where it can work.
    assert ("Fix: install the compiler, or run python -m dsv4jit precompile --set 'plan_host' where it is and add "
            "that cache to DSV4JIT_CACHE_PATH") in message
    assert entries_on_disk(cache_dir) == []


@pytest.mark.parametrize("variable", ["DSV4JIT_CXX", "CXX"])
def test_a_host_compiler_setting_that_does_not_run_names_the_variable(variable, monkeypatch, cache_dir):
    """It used to say only "/usr/bin/false --version exited with 1: ." """
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv(variable, "/bin/false")
    with pytest.raises(DSV4JITToolchainError, match=rf"^{variable}='/bin/false' names a compiler that does not run "
                                                    r"\(\S*/false --version exited with 1, with no error message\); set it "
                                                    r"to a C\+\+20 compiler \(g\+\+ or clang\+\+\), or unset it\. Fix: "):
        loader.load(loader.variant("plan_host"), toolchain.Arch.host())
    assert entries_on_disk(cache_dir) == []


def test_cold_load_without_nvcc_raises_toolchain_error(no_toolchain, selftest, arch):
    with pytest.raises(DSV4JITToolchainError, match=r"looked at DSV4JIT_NVCC, CUDA_HOME"):
        loader.load(selftest, arch)


def test_cached_variant_loads_without_any_toolchain(warm_cache, no_toolchain, monkeypatch, selftest, arch):
    monkeypatch.setenv("PATH", str(no_toolchain.parent / "empty-bin"))  # no host compiler either
    res = loader.resolve(selftest, arch)
    assert res.info is None  # no toolchain identity: found by the source key
    assert res.entry == warm_cache.entry
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"


# --------------------------------------------------------------------------------------------
# (6) compile errors


def test_compile_error_reports_first_error_log_and_reproducer(fake_nvcc, monkeypatch, cache_dir, selftest, arch):
    nvcc = fake_nvcc("fail")
    monkeypatch.setenv("DSV4JIT_NVCC", str(nvcc))
    with pytest.raises(DSV4JITBuildError) as err:
        loader.load(selftest, arch)
    e = err.value
    assert (e.variant, e.arch) == (SELFTEST_ID, "sm_90a")
    assert e.first_error == "wrapper.cu(3): error: something broke"
    log = Path(e.log_path)
    assert log.is_file() and "wrapper.cu(3): error: something broke" in log.read_text()
    assert str(nvcc) in log.read_text().splitlines()[0]  # the log starts with the command
    for part in (SELFTEST_ID, e.first_error, e.log_path, e.command):
        assert part in str(e)
    assert entries_on_disk(cache_dir) == [] and stages_on_disk(cache_dir) == []

    # The reproducer runs on its own (the wrapper source is kept next to the log).
    assert (log.parent / "wrapper.cu").is_file()
    rerun = subprocess.run(e.command, shell=True, capture_output=True, text=True)
    assert rerun.returncode == 1 and "error: something broke" in rerun.stderr


def test_killed_compiler_is_reported_as_likely_out_of_memory(fake_nvcc, monkeypatch, selftest, arch):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("killed")))
    with pytest.raises(DSV4JITBuildError, match="likely out of memory"):
        loader.load(selftest, arch)


# --------------------------------------------------------------------------------------------
# (7) the warm path


def test_warm_load_runs_no_subprocess(warm_cache, monkeypatch, selftest, arch):
    assert type(loader.load(selftest, arch).affine).__name__ == "Function"
    loader.clear_memo()
    toolchain.reset()  # the toolchain identity must now come from the on-disk cache
    cache._closure_memo.cache_clear()

    def forbidden(*args, **kwargs):
        raise AssertionError(f"warm load started a subprocess: {args[:2]}")

    monkeypatch.setattr(subprocess, "run", forbidden)
    monkeypatch.setattr(subprocess.Popen, "__init__", forbidden)
    module = loader.load(selftest, arch)
    assert type(module.affine).__name__ == "Function"
    assert loader.resolve(selftest, arch).entry == warm_cache.entry


def test_warm_load_in_a_fresh_process_spawns_nothing(warm_cache, record_property):
    script = CHILD_PRELUDE + """
def forbidden(*args, **kwargs):
    raise AssertionError("warm load started a subprocess")
import subprocess
subprocess.Popen.__init__ = forbidden
t = time.perf_counter()
module = loader.load(VARIANT, ARCH)
ms = (time.perf_counter() - t) * 1e3
t = time.perf_counter()
loader.load(VARIANT, ARCH)
print(json.dumps({"first_ms": ms, "memo_us": (time.perf_counter() - t) * 1e6, "affine": type(module.affine).__name__}))
"""
    run = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    record_property("measured", f"warm load in a fresh process: loader.load {result['first_ms']:.1f} ms; "
                                f"memoised {result['memo_us']:.1f} us")
    # no time limit: the time is printed for a person, measured by python -m dsv4jit.bench.loader
    assert result["affine"] == "Function"


# --------------------------------------------------------------------------------------------
# (8) forced rebuild, (9) the manifest


def test_force_rebuild_replaces_the_entry(fake_nvcc, prebuilt, tmp_path, monkeypatch, caplog, cache_dir,
                                          selftest, arch):
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, counter=counter)))
    loader.load(selftest, arch)
    [entry] = entries_on_disk(cache_dir)
    first = cache.read_manifest(entry)
    first_inode = (entry / "module.so").stat().st_ino

    loader.clear_memo()
    loader.load(selftest, arch)
    assert counted(counter) == 1  # a plain second load is a hit

    loader.clear_memo()
    monkeypatch.setenv("DSV4JIT_FORCE_REBUILD", "1")
    with caplog.at_level(logging.INFO, logger="dsv4jit"):
        module = loader.load(selftest, arch)
    assert counted(counter) == 2
    assert "forced rebuild" in caplog.text
    assert entries_on_disk(cache_dir) == [entry]
    second = cache.read_manifest(entry)
    assert second["key"] == first["key"] and second["built_at"] > first["built_at"]
    assert (entry / "module.so").stat().st_ino != first_inode
    assert type(module.affine).__name__ == "Function"
    leftovers = [p.name for p in entry.parent.iterdir() if p.name.startswith((".stage-", ".old-"))]
    assert leftovers == []


def test_manifest_describes_the_entry(warm_cache, selftest, arch):
    entry = warm_cache.entry
    manifest = json.loads((entry / "manifest.json").read_text())
    assert {"key", "source_key", "variant", "arch", "document", "build_seconds", "size"} <= set(manifest)
    res = loader.resolve(selftest, arch)
    assert manifest["key"] == res.info.key == warm_cache.key
    assert entry.name == f"{selftest.slug}-{manifest['key']}"
    assert (manifest["variant"], manifest["arch"]) == (SELFTEST_ID, "sm_90a")
    # The document is what was hashed: the key, and without the toolchain the source key.
    assert cache._hash(manifest["document"]) == manifest["key"]
    assert cache._hash({k: v for k, v in manifest["document"].items() if k != "toolchain"}) == manifest["source_key"]
    assert manifest["size"] == (entry / "module.so").stat().st_size > 0
    assert manifest["sha256"] == hashlib.sha256((entry / "module.so").read_bytes()).hexdigest()
    assert manifest["build_seconds"] > 0
    log = (entry / "build.log").read_text()
    assert "-gencode=arch=compute_90a,code=sm_90a" in log.splitlines()[0]
    assert not (entry / "owner.json").exists() and not (entry / "deps.d").exists()


def test_lock_file_survives_the_build(warm_cache, prebuilt, fake_nvcc, monkeypatch, selftest, arch):
    """Waiters must share one inode: the lock file is never deleted (ESTALE on shared filesystems)."""
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    monkeypatch.setenv("DSV4JIT_FORCE_REBUILD", "1")
    loader.load(selftest, arch)
    locks = list(warm_cache.entry.parent.glob("*.lock"))
    assert locks and all((lock.parent / lock.name[: -len(".lock")] / "manifest.json").is_file() for lock in locks)


# --------------------------------------------------------------------------------------------
# (10) many builds at once: the builder of precompile and warmup, and an explicit write root


def test_partition_splits_the_cached_from_what_to_build(warm_cache, monkeypatch, selftest, arch):
    other = loader.variant("selftest", dtype="bf16", pdl=False)
    cached, to_build = batch.partition([(selftest, arch), (other, arch)])
    assert [r.entry for r in cached] == [warm_cache.entry] and [r.variant for r in to_build] == [other]
    monkeypatch.setenv("DSV4JIT_FORCE_REBUILD", "1")
    cached, to_build = batch.partition([(selftest, arch), (other, arch)])
    assert cached == [] and [r.variant for r in to_build] == [selftest, other]


def test_partition_without_a_compiler_raises_only_when_something_needs_building(warm_cache, no_toolchain, selftest,
                                                                                arch):
    [cached], [] = batch.partition([(selftest, arch)])
    assert cached.entry == warm_cache.entry
    with pytest.raises(DSV4JITToolchainError, match="nvcc not found"):
        batch.partition([(selftest, arch), (loader.variant("selftest", dtype="bf16", pdl=False), arch)])


def test_resolve_and_build_into_an_explicit_root(fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir, selftest, arch):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    other = tmp_path / "other-root"
    res = loader.resolve(selftest, arch, other)
    assert res.root == other and res.entry is None
    built = loader.build_resolved(res, "test")
    assert built.compiled and built.entry.is_relative_to(other) and (other / "toolchain.json").is_file()
    assert loader.resolve(selftest, arch, other).entry == built.entry
    assert loader.resolve(selftest, arch).entry is None and entries_on_disk(cache_dir) == []


SELFTESTS = [loader.variant("selftest", dtype=d, pdl=p) for d in ("fp32", "bf16") for p in (True, False)]


def test_batch_with_keep_going_collects_every_failure(fake_nvcc, tmp_path, monkeypatch, arch):
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", counter=counter)))
    todo = [loader.resolve(v, arch) for v in SELFTESTS]
    seen = []
    done = batch.build_all(todo, "test", 2, on_outcome=lambda i, o: seen.append((i, o)))
    assert [o.status for o in done.outcomes] == ["failed"] * 4 and done.failures == done.outcomes
    assert sorted(o.resolution.variant.id for o in done.outcomes) == sorted(v.id for v in SELFTESTS)
    assert all(isinstance(o.error, DSV4JITBuildError) and "something broke" in str(o.error) for o in done.outcomes)
    assert [i for i, _ in seen] == [1, 2, 3, 4] and [o for _, o in seen] == done.outcomes and done.jobs == 2
    assert counted(counter) == 4


@pytest.fixture
def gated_builds(monkeypatch):
    """loader.build_resolved replaced: the first build raises the exception set in ``gate["first"]``;
    the others wait until the batch cancels (so none starts after the cancel), then succeed.
    ``gate["started"]`` lists the variants whose build started."""
    gate = {"first": None, "started": []}
    cancelled = threading.Event()
    cancel = batch._cancel

    def cancel_and_tell(futures):
        cancel(futures)
        cancelled.set()

    def build_resolved(res, reason, stop):
        gate["started"].append(res.variant)
        if len(gate["started"]) == 1:
            raise gate["first"]
        cancelled.wait(60)
        return build.Built(None, res.root, True, 0.0)

    monkeypatch.setattr(batch, "_cancel", cancel_and_tell)
    monkeypatch.setattr(loader, "build_resolved", build_resolved)
    return gate


def test_batch_without_keep_going_cancels_what_has_not_started_after_a_failure(gated_builds, warm_cache, arch):
    gated_builds["first"] = DSV4JITBuildError(SELFTESTS[0].id, "sm_90a", "error: broke", "build.log", "nvcc")
    done = batch.build_all([loader.resolve(v, arch) for v in SELFTESTS], "test", 1, keep_going=False)
    statuses = [o.status for o in done.outcomes]
    # with one thread the second build may have started before the cancel; the last two cannot have
    assert statuses[0] == "failed" and statuses[1] in ("built", "cancelled") and statuses[2:] == ["cancelled"] * 2
    assert done.failures[0].error is gated_builds["first"] and done.failures[0].resolution.variant == SELFTESTS[0]
    assert SELFTESTS[2] not in gated_builds["started"] and SELFTESTS[3] not in gated_builds["started"]


def test_a_bug_in_a_build_cancels_the_builds_not_started_and_propagates(gated_builds, warm_cache, arch):
    gated_builds["first"] = ValueError("a bug")
    with pytest.raises(ValueError, match="a bug"):
        batch.build_all([loader.resolve(v, arch) for v in SELFTESTS[:3]], "test", 1)
    assert gated_builds["started"][0] == SELFTESTS[0] and SELFTESTS[2] not in gated_builds["started"]


def test_warmup_builds_through_the_batch_and_raises_its_first_failure(fake_nvcc, tmp_path, monkeypatch, cache_dir):
    import dsv4jit

    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", counter=counter)))
    with pytest.raises(DSV4JITBuildError) as err:
        dsv4jit.warmup(arch="9.0a", head_dims={4: (512, 128)}, ops=("compress",), jobs=1)
    assert err.value.variant.startswith("compress_c4[head_dim=")
    assert counted(counter) == 2  # both were tried: a failure does not stop the other builds
    assert entries_on_disk(cache_dir) == []
