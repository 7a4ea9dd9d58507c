"""The ``dsv4jit`` command line: precompile, list, clean, info; output modes and exit codes.

Commands run in-process through ``cli.main`` (stdout/stderr via capsys); the entry points are
also started once as real processes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4jit import __version__, cli
from dsv4jit.jit import cache, loader
from dsv4jit.jit.kernels import SELFTEST
from helpers.jit_env import SELFTEST_ID, entries_on_disk

pytestmark = pytest.mark.usefixtures("jit_env")

SELECT = ["--arch", "9.0a", "--kernel", "selftest", "--set", SELFTEST_ID]


def run_json(run_cli, *argv: str):
    code, out, err = run_cli(*argv, "--json")
    return code, json.loads(out)


# --------------------------------------------------------------------------------------------
# entry points


@pytest.mark.parametrize("argv", [[sys.executable, "-m", "dsv4jit"], [str(Path(sys.executable).with_name("dsv4jit"))]],
                         ids=["python -m dsv4jit", "console script"])
def test_entry_points_print_the_version(argv):
    if not Path(argv[0]).exists():
        pytest.skip(f"{argv[0]} is not installed")
    res = subprocess.run(argv + ["--version"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"dsv4jit {__version__}"


def test_a_default_install_prints_no_third_party_warning(cache_dir):
    # torch's CPU wheels lack numpy, and without it torch warns whenever dsv4jit registers its ops.
    res = subprocess.run([sys.executable, "-m", "dsv4jit", "info"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr, res.stderr


def test_no_subcommand_is_a_usage_error(run_cli):
    with pytest.raises(SystemExit) as exit_:
        run_cli()
    assert exit_.value.code == 2


# --------------------------------------------------------------------------------------------
# precompile


def test_precompile_cached_variant(run_cli, warm_cache):
    code, out, err = run_cli("precompile", *SELECT)
    assert code == 0, err
    assert "cached 1" in out and "built 0" in out and "failed 0" in out


def test_precompile_json(run_cli, warm_cache):
    code, payload = run_json(run_cli, "precompile", *SELECT)
    assert code == 0
    assert payload["results"] == [{"variant": SELFTEST_ID, "arch": "sm_90a", "status": "cached",
                                   "entry": str(warm_cache.entry)}]
    assert payload["summary"] == {"built": 0, "cached": 1, "failed": 0, "cancelled": 0}
    assert isinstance(payload["wall_seconds"], (int, float))


def test_precompile_dry_run_builds_nothing(run_cli, fake_nvcc, tmp_path, monkeypatch, cache_dir):
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", counter=counter)))
    code, out, err = run_cli("precompile", *SELECT, "--dry-run")
    assert code == 0, err
    assert out.split() == ["would", "build", SELFTEST_ID, "sm_90a"]
    code, payload = run_json(run_cli, "precompile", *SELECT, "--dry-run")
    [row] = payload["results"]
    assert row["status"] == "would build" and row["key"] == loader.resolve(
        loader.variant("selftest", dtype="fp32", pdl=True), loader.Arch.parse("9.0a")).info.key
    assert not counter.exists() and entries_on_disk(cache_dir) == []


def test_precompile_dry_run_on_a_warm_cache_reports_cached(run_cli, warm_cache):
    code, out, err = run_cli("precompile", *SELECT, "--dry-run")
    assert code == 0 and out.split() == ["cached", SELFTEST_ID, "sm_90a"]


def test_precompile_builds_into_cache_dir_option(run_cli, fake_nvcc, prebuilt, tmp_path, monkeypatch, cache_dir):
    # --cache-dir overrides DSV4JIT_CACHE_DIR, for this command only; the stand-in nvcc "compiles" by copying.
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    target = tmp_path / "image-cache"
    code, payload = run_json(run_cli, "precompile", *SELECT, "--cache-dir", str(target))
    assert code == 0
    [row] = payload["results"]
    assert row["status"] == "built" and row["variant"] == SELFTEST_ID
    assert len(entries_on_disk(target)) == 1 and (target / "toolchain.json").is_file()
    assert os.environ["DSV4JIT_CACHE_DIR"] == str(cache_dir)  # the process's own setting is left alone
    assert entries_on_disk(cache_dir) == [] and not (cache_dir / "toolchain.json").exists()
    code, payload = run_json(run_cli, "precompile", *SELECT, "--cache-dir", str(target))  # looked up there too
    assert [r["status"] for r in payload["results"]] == ["cached"]
    code, payload = run_json(run_cli, "precompile", *SELECT, "--dry-run")
    assert [r["status"] for r in payload["results"]] == ["would build"]


def test_precompile_failing_build_exits_1(run_cli, fake_nvcc, monkeypatch, cache_dir):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail")))
    code, out, err = run_cli("precompile", *SELECT)
    assert code == 1
    assert "FAILED" in out and "wrapper.cu(3): error: something broke" in out
    assert "failed 1" in out
    code, payload = run_json(run_cli, "precompile", *SELECT)
    assert code == 1
    [row] = payload["results"]
    assert row["status"] == "failed" and "something broke" in row["error"]
    assert entries_on_disk(cache_dir) == []


@pytest.mark.parametrize("argv, message", [
    (["--arch", "hopper", "--kernel", "selftest"], "invalid CUDA arch 'hopper'"),
    (["--arch", "9.0a", "--kernel", "nosuchkernel"], "unknown kernel 'nosuchkernel'"),
    (["--arch", "9.0a", "--set", "selftest[dtype=fp64,pdl=1]"], "fp64"),
])
def test_precompile_usage_errors_exit_2(run_cli, argv, message):
    code, out, err = run_cli("precompile", *argv)
    assert code == 2
    assert message in err


def test_precompile_without_nvcc_exits_2(run_cli, no_toolchain, cache_dir):
    code, out, err = run_cli("precompile", *SELECT)
    assert code == 2
    assert "nvcc not found (looked at" in err
    assert entries_on_disk(cache_dir) == []


@pytest.mark.parametrize("command", [["list"], ["info"], ["precompile", *SELECT]])
def test_without_tvm_ffi_commands_exit_2_naming_the_package(run_cli, monkeypatch, cache_dir, command):
    monkeypatch.setitem(sys.modules, "tvm_ffi", None)  # import tvm_ffi raises ImportError
    monkeypatch.setitem(sys.modules, "tvm_ffi.libinfo", None)
    cache.tvm_ffi_info.cache_clear()
    try:
        code, out, err = run_cli(*command)
    finally:
        cache.tvm_ffi_info.cache_clear()
    assert code == 2, err
    assert "apache-tvm-ffi is not importable" in err and "pip install apache-tvm-ffi" in err
    assert "internal error" not in err


def test_precompile_without_nvcc_accepts_cached_variants(run_cli, no_toolchain, warm_cache):
    code, out, err = run_cli("precompile", *SELECT)
    assert code == 0, err
    assert "cached 1" in out


# --------------------------------------------------------------------------------------------
# list


def test_list_shows_status(run_cli, warm_cache):
    code, out, err = run_cli("list", "--arch", "9.0a", "--kernel", "selftest", "--set", "all")
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["status", "variant", "arch", "bytes", "build", "s"]
    lines = {tuple(line.split()) for line in rows}
    size = (warm_cache.entry / "module.so").stat().st_size
    assert ("cached", SELFTEST_ID, "sm_90a", str(size)) in {line[:4] for line in lines}
    assert ("missing", "selftest[dtype=bf16,pdl=0]", "sm_90a", "-", "-") in lines
    assert len(lines) == len(SELFTEST.all_variants())  # every selftest variant, once
    assert all(row.index("sm_90a") == header.index("arch") for row in rows)  # columns under their labels


def test_list_status_missing_fails_when_something_is_missing_and_always_has_its_header(run_cli, warm_cache):
    """What serving.md offers to verify an image: its exit status says whether the image is complete."""
    code, out, err = run_cli("list", "--arch", "9.0a", "--kernel", "selftest", "--set", SELFTEST_ID,
                             "--status", "missing")
    assert (code, out.split()) == (0, ["status", "variant", "arch", "bytes", "build", "s"])  # nothing missing
    code, out, err = run_cli("list", "--arch", "9.0a", "--kernel", "selftest", "--set", "all", "--status", "missing")
    header, *rows = out.splitlines()
    assert code == 1 and header.split()[:3] == ["status", "variant", "arch"]
    assert len(rows) == len(SELFTEST.all_variants()) - 1 and all(r.startswith("missing ") for r in rows)
    assert f"{len(rows)} of {len(rows) + 1} selected variants are missing" in err
    code, payload = run_json(run_cli, "list", "--arch", "9.0a", "--kernel", "selftest", "--set", "all",
                             "--status", "missing")
    assert code == 1 and len(payload["variants"]) == len(rows)


def test_list_json_and_status_filter(run_cli, warm_cache):
    code, payload = run_json(run_cli, "list", "--arch", "9.0a", "--kernel", "selftest", "--set", "all")
    assert code == 0
    rows = {r["variant"]: r for r in payload["variants"]}
    assert len(rows) == len(SELFTEST.all_variants())
    hit = rows[SELFTEST_ID]
    assert hit["status"] == "cached" and hit["key"] == warm_cache.key and hit["entry"] == str(warm_cache.entry)
    assert hit["size"] == (warm_cache.entry / "module.so").stat().st_size
    assert all(r["status"] == "missing" and r["entry"] is None for v, r in rows.items() if v != SELFTEST_ID)

    code, payload = run_json(run_cli, "list", "--arch", "9.0a", "--kernel", "selftest", "--set", "all",
                             "--status", "missing")
    assert sorted(r["variant"] for r in payload["variants"]) == sorted(set(rows) - {SELFTEST_ID})
    code, payload = run_json(run_cli, "list", "--arch", "9.0a", "--kernel", "selftest", "--set", "all",
                             "--status", "cached")
    assert [r["variant"] for r in payload["variants"]] == [SELFTEST_ID]


def write_orphan(root: Path) -> Path:
    """An entry whose manifest names a kernel the registry no longer has."""
    entry = root / f"v{cache.SCHEMA}" / "sm_90a" / "retired" / "retired__1-0123456789abcdef0123"
    entry.mkdir(parents=True)
    (entry / "module.so").write_bytes(b"\0" * 100)
    (entry / "manifest.json").write_text(json.dumps({
        "key": "0123456789abcdef0123", "source_key": "0123456789abcdef0123", "variant": "retired[x=1]",
        "arch": "sm_90a", "document": {}, "size": 100, "sha256": "0" * 64, "build_seconds": 1.0,
        "built_at": time.time(), "dsv4jit_version": "0.0.1", "depfile": []}))
    return entry


def test_list_entries_flags_orphans(run_cli, warm_cache):
    orphan = write_orphan(warm_cache.root)
    code, payload = run_json(run_cli, "list", "--entries")
    assert code == 0
    rows = {r["entry"]: r for r in payload["entries"]}
    assert set(rows) == {str(warm_cache.entry), str(orphan)}
    assert rows[str(orphan)]["orphan"] is True and rows[str(orphan)]["variant"] == "retired[x=1]"
    assert rows[str(warm_cache.entry)]["orphan"] is False
    assert rows[str(warm_cache.entry)]["key"] == warm_cache.key

    code, out, err = run_cli("list", "--entries")
    header, *rows = out.splitlines()
    assert header.split() == ["variant", "arch", "key", "bytes", "entry", "note"]
    [orphan_line] = [line for line in rows if line.endswith("  orphan")]
    assert orphan_line.startswith("retired[x=1]") and str(orphan) in orphan_line


# --------------------------------------------------------------------------------------------
# clean


def test_clean_dry_run_keeps_files_and_reports_bytes(run_cli, warm_cache):
    size = cache.dir_size(warm_cache.entry)
    code, payload = run_json(run_cli, "clean", "--kernel", "selftest", "--dry-run")
    assert code == 0
    assert payload == {"removed": [str(warm_cache.entry)], "bytes": size, "dry_run": True}
    code, out, err = run_cli("clean", "--kernel", "selftest", "--dry-run")
    assert f"would free {size} bytes" in out
    assert (warm_cache.entry / "manifest.json").is_file()


def test_clean_kernel_removes_its_entries(run_cli, warm_cache):
    orphan = write_orphan(warm_cache.root)
    size = cache.dir_size(warm_cache.entry)
    code, out, err = run_cli("clean", "--kernel", "selftest")
    assert code == 0, err
    assert f"freed {size} bytes in 1 paths" in out
    assert not warm_cache.entry.exists()
    assert orphan.exists()  # another kernel's entry is untouched
    loader.clear_memo()
    variant, arch = loader.variant("selftest", dtype="fp32", pdl=True), loader.Arch.parse("9.0a")
    assert loader.resolve(variant, arch).entry is None


def test_clean_orphans_removes_only_orphans(run_cli, warm_cache):
    orphan = write_orphan(warm_cache.root)
    code, payload = run_json(run_cli, "clean", "--orphans")
    assert code == 0 and payload["removed"] == [str(orphan)]
    assert not orphan.exists() and warm_cache.entry.exists()


def test_clean_without_selection_exits_2(run_cli, warm_cache):
    code, out, err = run_cli("clean")
    assert code == 2 and "--all" in err
    assert warm_cache.entry.exists()


def test_clean_stale_removes_the_leftovers_of_builds_but_no_live_stage(run_cli, warm_cache, monkeypatch):
    monkeypatch.setenv("DSV4JIT_BUILD_TIMEOUT", "30")
    folder = warm_cache.entry.parent
    old, fresh = folder / ".stage-selftest__fp32_pdl-old-1", folder / ".stage-selftest__fp32_pdl-fresh-2"
    swapped, set_aside = folder / f".old-{warm_cache.entry.name}-1a2b3c4d", folder / f".bad-{warm_cache.entry.name}-5e6f7a8b"
    other_schema = warm_cache.root / "v0"
    for leftover in (old, fresh, swapped, set_aside, other_schema):
        leftover.mkdir()
        (leftover / "wrapper.cu").write_text("// partial\n")
    past = time.time() - 3600  # an hour ago, far beyond the 30 s build timeout
    os.utime(old, (past, past))
    failed = warm_cache.root / "failed" / "selftest__fp32_pdl-abc"
    failed.mkdir(parents=True)
    (failed / "build.log").write_text("error\n")

    code, payload = run_json(run_cli, "clean", "--stale")
    assert code == 0
    assert sorted(payload["removed"]) == sorted(str(p) for p in (old, swapped, set_aside, other_schema,
                                                                 warm_cache.root / "failed"))
    assert not any(p.exists() for p in (old, swapped, set_aside, other_schema, failed))
    assert fresh.exists()  # a stage younger than the timeout may be a live build
    assert warm_cache.entry.exists()


def test_clean_of_an_explicit_root_touches_only_that_root(warm_cache, prebuilt, tmp_path):
    from dsv4jit.jit.clean import clean

    other = tmp_path / "other-root"
    shutil.copytree(prebuilt.root, other)
    [entry] = entries_on_disk(other)
    size = cache.dir_size(entry)
    planned = clean(kernels={"selftest"}, dry_run=True, root=other)
    assert (planned.root, planned.removed, planned.bytes, planned.dry_run) == (other, [entry], size, True)
    assert entry.exists()
    done = clean(kernels={"selftest"}, root=other)
    assert (done.removed, done.bytes, done.dry_run) == ([entry], size, False)
    assert entries_on_disk(other) == [] and warm_cache.entry.exists()
    assert clean(kernels={"selftest"}, dry_run=True).removed == [warm_cache.entry]  # the default: DSV4JIT_CACHE_DIR


def test_clean_stale_removes_superseded_keys(run_cli, warm_cache, monkeypatch):
    """An entry built with other flags is no longer the variant's current key: stale."""
    code, payload = run_json(run_cli, "clean", "--stale", "--dry-run")
    assert code == 0 and payload["removed"] == []
    monkeypatch.setenv("DSV4JIT_EXTRA_CUDA_FLAGS", "-DSOMETHING_NEW=1")
    code, payload = run_json(run_cli, "clean", "--stale")
    assert code == 0 and payload["removed"] == [str(warm_cache.entry)]
    assert not warm_cache.entry.exists()


# --------------------------------------------------------------------------------------------
# info


@pytest.mark.parametrize("argv", [["list", "--set", "all", "--arch", "9.0a,10.0a"], ["info", "plan[pdl=1]"]],
                         ids=["list", "info"])
def test_output_into_a_reader_that_left_exits_quietly(argv, warm_cache):
    """`dsv4jit list ... | head -1`: the reader is gone before the output is: no traceback, no 'internal
    error', the exit status of a process stopped by SIGPIPE."""
    child = subprocess.Popen([sys.executable, "-m", "dsv4jit", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before the child writes: its first write finds no reader
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 128 + 13 and err == ""


@pytest.mark.parametrize("value, words", [("8.0", "unsupported CUDA arch '8.0' (sm_80)"),
                                          ("garbage", "invalid CUDA arch 'garbage'")])
def test_info_warns_of_an_invalid_arch_setting_and_its_check_refuses_it(run_cli, warm_cache, monkeypatch, value, words):
    monkeypatch.setenv("DSV4JIT_CUDA_ARCH", value)
    code, out, err = run_cli("info")
    assert code == 0 and f"env: DSV4JIT_CUDA_ARCH={value}" in out
    assert err.startswith(f"dsv4jit: warning: DSV4JIT_CUDA_ARCH: {words}"), err
    code, out, err = run_cli("info", "--check")
    assert (code, out) == (2, "") and err.startswith(f"dsv4jit: DSV4JIT_CUDA_ARCH: {words}"), err


def test_info_text(run_cli, warm_cache):
    code, out, err = run_cli("info")
    assert code == 0, err
    assert out.startswith(f"dsv4jit {__version__}")
    assert "nvcc: " in out and "tvm-ffi: " in out and "torch: " in out
    assert f"cache root: {warm_cache.root} (writable" in out
    assert "env: DSV4JIT_CUDA_ARCH=9.0a" in out


def test_info_json_fields(run_cli, warm_cache):
    import torch

    code, info = run_json(run_cli, "info")
    assert code == 0
    assert {"nvcc", "tvm_ffi", "torch", "gpus", "cache_roots", "env"} <= set(info)
    assert info["torch"]["version"] == torch.__version__
    assert info["tvm_ffi"]["version"] == cache.tvm_ffi_info()["version"]
    assert info["cache_roots"][0]["path"] == str(warm_cache.root)
    assert info["cache_roots"][0]["writable"] is True and info["cache_roots"][0]["bytes"] > 0
    assert info["env"]["DSV4JIT_CUDA_ARCH"] == "9.0a"
    assert info["env"]["DSV4JIT_CACHE_DIR"] == str(warm_cache.root)
    if not torch.cuda.is_available():
        assert info["gpus"] == []
    assert "path" in info["nvcc"] or "error" in info["nvcc"]


def test_info_check_without_gpu(run_cli, warm_cache):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with a GPU the check runs the kernel")
    code, info = run_json(run_cli, "info", "--check")
    assert code == 0
    assert info["check"]["ok"] is True
    assert SELFTEST_ID in info["check"]["detail"] and "not run" in info["check"]["detail"]


@pytest.mark.parametrize("argv, setting, expected", [
    (["--arch", "9.0a"], None, "selftest[dtype=fp32,pdl=1] for sm_90a"),
    (["--arch", "9.0a"], "DSV4JIT_DISABLE_PDL", "selftest[dtype=fp32,pdl=0] for sm_90a"),
])
def test_info_check_loads_the_variant_the_ops_would(run_cli, fake_nvcc, prebuilt, monkeypatch, argv, setting, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the check loads and does not run
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    if setting:
        monkeypatch.setenv(setting, "1")
    code, info = run_json(run_cli, "info", "--check", *argv)
    assert code == 0 and info["check"]["ok"] is True
    assert info["check"]["detail"].startswith(f"{expected} loaded in ")


SUPPORTED = "the kernels build for sm_90a (H100, H200), sm_100a (B200, GB200), sm_120a (RTX 50-series, RTX PRO Blackwell)"


@pytest.mark.parametrize("argv, setting, error", [
    (["precompile", "--arch", "8.0"], None, "unsupported CUDA arch '8.0' (sm_80)"),
    (["precompile", "--arch", "9.0a,9.5"], None, "unsupported CUDA arch '9.5' (sm_95a)"),
    (["info", "--check", "--arch", "sm_103a"], None, "unsupported CUDA arch 'sm_103a' (sm_103a)"),
    (["list", "--kernel", "plan"], "10.0f", "DSV4JIT_CUDA_ARCH: unsupported CUDA arch '10.0f' (sm_100f)"),
])
def test_an_unsupported_arch_is_rejected_before_compiling(run_cli, fake_nvcc, tmp_path, monkeypatch, argv, setting,
                                                          error):
    calls = tmp_path / "nvcc-calls"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", counter=calls)))
    if setting:
        monkeypatch.setenv("DSV4JIT_CUDA_ARCH", setting)
    code, out, err = run_cli(*argv)
    assert (code, out, err) == (2, "", f"dsv4jit: {error}: {SUPPORTED}\n")
    assert not calls.exists()


def test_a_gpu_of_an_unsupported_arch_is_named_before_compiling(run_cli, fake_nvcc, tmp_path, monkeypatch):
    import torch

    from dsv4jit.errors import DSV4JITToolchainError

    calls = tmp_path / "nvcc-calls"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", counter=calls)))
    monkeypatch.delenv("DSV4JIT_CUDA_ARCH")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    error = f"GPU 0 (NVIDIA A100-SXM4-80GB) is sm_80, which dsv4jit does not support ({SUPPORTED})"
    assert run_cli("precompile", "--kernel", "selftest") == (2, "", f"dsv4jit: {error}\n")
    with pytest.raises(DSV4JITToolchainError, match=re.escape(error)):
        loader.arch_for(torch.device("cuda", 0))  # what the ops and warmup resolve
    assert not calls.exists()


def test_info_check_reports_a_failed_build(run_cli, fake_nvcc, monkeypatch):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail")))
    code, out, err = run_cli("info", "--check")
    assert code == 1
    assert "check: FAILED" in out and "something broke" in out


def test_info_variant_shows_the_key_document(run_cli, warm_cache):
    code, out, err = run_cli("info", SELFTEST_ID, "--arch", "9.0a")
    assert code == 0, err
    assert f"variant {SELFTEST_ID} sm_90a: key {warm_cache.key} entry {warm_cache.entry}" in out
    assert f'"variant": "{SELFTEST_ID}"' in out and '"headers": {' in out
    code, info = run_json(run_cli, "info", SELFTEST_ID, "--arch", "9.0a")
    [item] = info["variant"]
    assert item["key"] == warm_cache.key
    assert item["document"] == cache.read_manifest(warm_cache.entry)["document"]


# --------------------------------------------------------------------------------------------
# rules shared by the subcommands


# argv -> the arches the output names (--json)
TARGETS_OF = {
    "precompile": (["precompile", "--kernel", "selftest", "--set", SELFTEST_ID, "--dry-run"],
                   lambda p: [r["arch"] for r in p["results"]]),
    "list": (["list", "--kernel", "selftest", "--set", SELFTEST_ID], lambda p: [r["arch"] for r in p["variants"]]),
    "info": (["info", SELFTEST_ID], lambda p: [v["arch"] for v in p["variant"]]),
    "info --check": (["info", "--check"], lambda p: re.findall(r" for (sm_\w+) ", p["check"]["detail"])),
    "clean": (["clean", "--arch", "auto", "--dry-run"], lambda p: [Path(e).parts[-3] for e in p["removed"]]),
}


@pytest.mark.parametrize("command", TARGETS_OF)
def test_without_gpu_or_arch_every_subcommand_targets_sm90a_and_says_so(command, run_cli, warm_cache, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DSV4JIT_CUDA_ARCH")
    argv, archs = TARGETS_OF[command]
    code, out, err = run_cli(*argv, "--json")
    assert code == 0, err
    assert archs(json.loads(out)) == ["sm_90a"]
    assert "dsv4jit: no GPU visible: targeting sm_90a (pass --arch or set DSV4JIT_CUDA_ARCH" in err


def test_unknown_kernels_are_rejected_alike_by_every_subcommand(run_cli, warm_cache):
    from dsv4jit.jit.kernels import SPECS

    errors = set()
    for argv in (["precompile", "--kernel", "nosuch"], ["precompile", "--set", "nosuch[x=1]"],
                 ["list", "--kernel", "nosuch"], ["clean", "--kernel", "nosuch"], ["info", "nosuch[x=1]"],
                 ["info", "nosuch"]):
        code, out, err = run_cli(*argv)
        assert code == 2 and out == "", argv
        errors.add(err)
    assert errors == {f"dsv4jit: unknown kernel 'nosuch'; known: {', '.join(sorted(SPECS))}\n"}
    assert warm_cache.entry.exists()  # clean removed nothing


@pytest.mark.parametrize("argv, error", [
    (["info", "plan"], "kernel 'plan': missing parameter(s) ['pdl']"),
    (["list", "--set", "selftest[dtype=fp64,pdl=1]"], "parameter 'dtype' must be one of ['fp32', 'bf16']"),
    (["precompile", "--set", "store[dtype=fp32"], "malformed variant id 'store[dtype=fp32'"),
])
def test_variant_id_errors_show_ids_that_work(run_cli, argv, error):
    code, out, err = run_cli(*argv)
    assert code == 2 and error in err
    examples = re.search(r"variant ids look like (\S+) or (\S+) \(", err)
    assert examples, err
    for example in examples.groups():
        code, payload = run_json(run_cli, "list", "--set", example)
        assert code == 0 and [r["variant"] for r in payload["variants"]] == [example]


def test_a_bug_shows_its_traceback_and_exits_3(run_cli, warm_cache, monkeypatch):
    """A ValueError from inside the library is not a usage error: nothing the user typed is wrong."""
    def broken(root):
        raise ValueError("manifest table in a bad state")

    monkeypatch.setattr(cache, "iter_entries", broken)
    code, out, err = run_cli("list", "--entries")
    assert code == cli.EXIT_BUG == 3 and out == ""
    assert "Traceback (most recent call last)" in err and "ValueError: manifest table in a bad state" in err
    assert "dsv4jit: internal error (exit 3): a bug in dsv4jit" in err.splitlines()[-1]


@pytest.mark.parametrize("setting, value, argv, message", [
    ("DSV4JIT_JOBS", "many", ["precompile", *SELECT],
     "DSV4JIT_JOBS='many' is not valid: it must be a whole number greater than 0"),
    ("DSV4JIT_JOBS", "inf", ["precompile", *SELECT],
     "DSV4JIT_JOBS='inf' is not valid: it must be a whole number greater than 0"),
    ("DSV4JIT_BUILD_TIMEOUT", "1h", ["clean", "--stale"],
     "DSV4JIT_BUILD_TIMEOUT='1h' is not valid: it must be a number greater than 0"),
    ("DSV4JIT_CUDA_ARCH", "hopper", ["list", "--kernel", "selftest"],
     "DSV4JIT_CUDA_ARCH: invalid CUDA arch 'hopper': expected e.g. 9.0a, 90a or sm_90a"),
    ("DSV4JIT_LOG_LEVEL", "chatty", ["list", "--kernel", "selftest"],
     "DSV4JIT_LOG_LEVEL='chatty' is not a log level: use one of DEBUG, INFO, WARNING, ERROR, CRITICAL, any case"),
    ("DSV4JIT_FORCE_REBUILD", "y", ["precompile", *SELECT],
     "DSV4JIT_FORCE_REBUILD='y' is not a boolean: use one of 1, true, yes, on (on) or 0, false, no, off (off), "
     "any case"),
    ("DSV4JIT_CACHE_DIR", "~nosuchuser/x", ["list", "--entries"],
     "DSV4JIT_CACHE_DIR='~nosuchuser/x' cannot be used as a path: Could not determine home directory."),
    ("DSV4JIT_EXTRA_CUDA_FLAGS", '"-O3', ["list", "--kernel", "selftest"],
     "DSV4JIT_EXTRA_CUDA_FLAGS='\"-O3' cannot be split into words as a shell would (No closing quotation)"),
])
def test_a_malformed_setting_is_a_usage_error(run_cli, warm_cache, monkeypatch, setting, value, argv, message):
    (warm_cache.entry.parent / ".stage-selftest__fp32_pdl-x-1").mkdir()  # clean --stale reads the timeout for it
    monkeypatch.setenv(setting, value)
    code, out, err = run_cli(*argv)
    assert (code, out, err) == (2, "", f"dsv4jit: {message}\n")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("name", ["demo", "bench", "precompile", "package", "list", "clean", "info"])
def test_help_explains_every_option_and_shows_its_default(name):
    parser = subcommands()[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action)
        assert text, f"{name} {action.option_strings or action.dest} has no help"
        if action.option_strings and action.nargs != 0 and action.default is not None:
            assert "default" in text, (name, action.option_strings)
    rendered = parser.format_help()  # argparse %-formats every text here
    assert all(option in rendered for action in parser._actions for option in action.option_strings)


@pytest.mark.parametrize("name", ["demo", "bench", "precompile", "package", "list", "clean", "info"])
def test_help_says_what_the_subcommand_does(name):
    parser = subcommands()[name]
    lines = parser.format_help().splitlines()
    usage_end = lines.index("")  # the usage lines, then a blank line, then the description
    assert parser.description and lines[usage_end + 1].startswith(parser.description.split()[0])
    assert len(parser.description.split(".")[0].split()) >= 8, parser.description  # a sentence, not a label


def test_demo_help_shows_the_gpu_and_cpu_defaults():
    from dsv4jit.demo import CPU_DEFAULTS, GPU_DEFAULTS

    text = " ".join(subcommands()["demo"].format_help().split())
    for option, field in (("--requests", "requests"), ("--min-prompt", "min_prompt"), ("--max-prompt", "max_prompt"),
                          ("--chunk", "chunk"), ("--decode-steps", "decode_steps")):
        gpu, cpu = getattr(GPU_DEFAULTS, field), getattr(CPU_DEFAULTS, field)
        assert gpu != cpu
        assert re.search(rf"{option} \S+ (?:(?!--).)*?\(default: {gpu} on a GPU, {cpu} on the CPU\)", text), option
    assert f"random seed (default: {GPU_DEFAULTS.seed})" in text
    assert f"(default: {GPU_DEFAULTS.decode_plans})" in text


def test_a_long_compile_says_it_is_alive(run_cli, fake_nvcc, prebuilt, monkeypatch, caplog):
    from dsv4jit.jit import progress

    monkeypatch.setattr(progress, "INTERVAL", 0.3)
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, sleep=1.5)))
    caplog.set_level(logging.INFO, logger="dsv4jit")
    code, out, err = run_cli("precompile", *SELECT)
    assert code == 0, err
    alive = [r.getMessage() for r in caplog.records if "still compiling" in r.getMessage()]
    assert alive and all(re.fullmatch(rf"dsv4jit: \.\.\. still compiling {re.escape(SELFTEST_ID)} for sm_90a "
                                      r"\(\d+s\)", m) for m in alive), alive
    time.sleep(3 * progress.INTERVAL)
    assert sum("still compiling" in r.getMessage() for r in caplog.records) == len(alive)  # silent once done


# --------------------------------------------------------------------------------------------
# demo and bench (their own behaviour is tested in test_demo.py and test_bench_report.py)


def test_help_lists_every_subcommand(run_cli):
    with pytest.raises(SystemExit) as exit_:
        run_cli("--help")
    assert exit_.value.code == 0
    out = cli.build_parser().format_help()
    for name in ("demo", "bench", "precompile", "package", "list", "clean", "info"):
        assert name in out


def test_bench_list_names_the_benchmark_modules(run_cli):
    code, payload = run_json(run_cli, "bench", "--list")
    assert code == 0
    assert {"compress", "store", "plan", "overhead"} <= set(payload["benchmarks"])
    code, payload = run_json(run_cli, "bench", "--list", "--bench", "plan")
    assert payload["benchmarks"] == ["plan"]


def test_bench_usage_errors_exit_2(run_cli, monkeypatch):
    code, _, err = run_cli("bench", "--bench", "nosuch", "--out", "x")
    assert code == 2 and "unknown benchmark nosuch" in err
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_cli("bench", "--out", "x")
    assert code == 2 and "needs a CUDA GPU" in err
