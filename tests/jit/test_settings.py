"""Every DSV4JIT_* variable is parsed strictly (docs/jit.md, section 4): a value outside what it
accepts is a `DSV4JITSettingError` naming the variable, the value and the accepted values, raised
where the setting is first used, never a silent default. The command line turns it into one line
and exit 2 (tests/cli/test_cli.py)."""

from __future__ import annotations

import re

import pytest

from dsv4jit import cli, env, runtime
from dsv4jit.errors import DSV4JITCacheError, DSV4JITSettingError, DSV4JITToolchainError
from dsv4jit.jit import loader, toolchain
from helpers.child_process import counted
from helpers.jit_env import SELFTEST_ID

pytestmark = pytest.mark.usefixtures("jit_env")

BOOLEANS = {"DSV4JIT_NO_COMPILE": env.no_compile, "DSV4JIT_FORCE_REBUILD": env.force_rebuild,
            "DSV4JIT_LINEINFO": env.lineinfo, "DSV4JIT_DEBUG": env.debug_build, "DSV4JIT_DISABLE_PDL": env.disable_pdl,
            "DSV4JIT_VERBOSE_BUILD": env.verbose_build, "DSV4JIT_CHECK": env.checks}


@pytest.mark.parametrize("name", BOOLEANS)
def test_a_boolean_accepts_the_documented_words_only(name, monkeypatch):
    read = BOOLEANS[name]
    for value, expected in (("1", True), ("TRUE", True), ("yes", True), ("On", True), ("0", False),
                            ("false", False), ("NO", False), ("off", False), ("", False)):
        monkeypatch.setenv(name, value)
        assert read() is expected, value
    for value in ("y", "enabled", "2", "enable"):  # each used to be a silent "off"
        monkeypatch.setenv(name, value)
        with pytest.raises(DSV4JITSettingError, match=rf"^{name}='{value}' is not a boolean: use one of 1, true, "
                                                     r"yes, on \(on\) or 0, false, no, off \(off\), any case$"):
            read()


@pytest.mark.parametrize("name, value", [
    *[("DSV4JIT_JOBS", v) for v in ("inf", "nan", "0", "-1", "2.5", "many")],
    *[(name, v) for name in ("DSV4JIT_JOB_MEM_GB", "DSV4JIT_BUILD_TIMEOUT", "DSV4JIT_LOCK_TIMEOUT")
      for v in ("0", "-5", "inf", "nan", "1h")],
])
def test_a_number_must_be_finite_and_positive(name, value, monkeypatch):
    monkeypatch.setenv(name, value)
    read = {"DSV4JIT_JOBS": env.jobs, "DSV4JIT_JOB_MEM_GB": env.job_mem_gb, "DSV4JIT_BUILD_TIMEOUT": env.build_timeout,
            "DSV4JIT_LOCK_TIMEOUT": env.lock_timeout}[name]
    kind = "a whole number" if name == "DSV4JIT_JOBS" else "a number"
    with pytest.raises(DSV4JITSettingError, match=rf"^{name}='{value}' is not valid: it must be {kind} greater than "
                                                 "0$"):
        read()


def test_numbers_and_their_defaults(monkeypatch):
    assert (env.jobs(), env.job_mem_gb(), env.build_timeout(), env.lock_timeout()) == (None, 4.0, 600.0, 1200.0)
    for name, value in (("DSV4JIT_JOBS", "3"), ("DSV4JIT_JOB_MEM_GB", "0.5"), ("DSV4JIT_BUILD_TIMEOUT", "90")):
        monkeypatch.setenv(name, value)
    assert (env.jobs(), env.job_mem_gb(), env.build_timeout(), env.lock_timeout()) == (3, 0.5, 90.0, 180.0)


def test_no_compile_of_another_spelling_is_an_error_not_a_compile(fake_nvcc, tmp_path, monkeypatch, selftest, arch):
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", counter=counter)))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "y")
    with pytest.raises(DSV4JITSettingError, match="DSV4JIT_NO_COMPILE='y' is not a boolean"):
        loader.load(selftest, arch)
    assert counted(counter) == 0


def test_checked_mode_and_pdl_settings_are_checked_at_first_use(monkeypatch):
    monkeypatch.setenv("DSV4JIT_CHECK", "enabled")
    with pytest.raises(DSV4JITSettingError, match="DSV4JIT_CHECK='enabled'"):
        runtime.set_checks(None)
    monkeypatch.setenv("DSV4JIT_DISABLE_PDL", "y")
    with pytest.raises(DSV4JITSettingError, match="DSV4JIT_DISABLE_PDL='y'"):
        runtime.variant("selftest", dtype="fp32")


@pytest.mark.parametrize("name", ["DSV4JIT_NVCC", "CUDA_HOME", "CUDA_PATH"])
def test_an_nvcc_setting_that_names_nothing_is_an_error_not_another_toolkit(name, monkeypatch, tmp_path):
    """A toolkit is found on PATH or in /usr/local/cuda here (the suite compiles), yet none is used."""
    for other in ("DSV4JIT_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, str(tmp_path / "nonexistent"))
    nvcc = tmp_path / "nonexistent" if name == "DSV4JIT_NVCC" else tmp_path / "nonexistent" / "bin" / "nvcc"
    with pytest.raises(DSV4JITToolchainError, match=rf"^{name}='{re.escape(str(tmp_path))}/nonexistent' names no nvcc "
                                                    rf"\({re.escape(str(nvcc))} is not an executable file\)"):
        toolchain.toolchain(need_cuda=True)


def test_a_malformed_arch_names_the_variable_on_the_op_path(monkeypatch):
    """Not a ValueError: the ops would report that as a bad argument of theirs."""
    monkeypatch.setenv("DSV4JIT_CUDA_ARCH", "hopper")
    with pytest.raises(DSV4JITSettingError, match="^DSV4JIT_CUDA_ARCH: invalid CUDA arch 'hopper'") as err:
        toolchain.resolve_arch(0)
    assert not isinstance(err.value, ValueError)


def test_paths_and_flags_are_parsed_strictly(monkeypatch, selftest, arch):
    for name, read in (("DSV4JIT_CACHE_DIR", env.cache_dir), ("DSV4JIT_CACHE_PATH", env.cache_path),
                       ("DSV4JIT_LOCK_DIR", env.lock_dir)):
        monkeypatch.setenv(name, "~nosuchuser/x")
        with pytest.raises(DSV4JITSettingError, match=rf"^{name}='~nosuchuser/x' cannot be used as a path"):
            read()
        monkeypatch.delenv(name)
    monkeypatch.setenv("DSV4JIT_EXTRA_CUDA_FLAGS", '-O3 "-DX=1')
    with pytest.raises(DSV4JITSettingError, match="^DSV4JIT_EXTRA_CUDA_FLAGS='-O3 \"-DX=1' cannot be split"):
        loader.resolve(selftest, arch)


def test_a_lock_dir_that_is_a_file_is_a_cache_error_naming_it(fake_nvcc, prebuilt, tmp_path, monkeypatch, capsys,
                                                              selftest, arch):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module)))
    monkeypatch.setenv("DSV4JIT_LOCK_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(DSV4JITCacheError, match=rf"^dsv4jit: cannot write the kernel cache at "
                                                rf"{re.escape(str(tmp_path))}/a-file/\S+: Not a directory; set "
                                                "DSV4JIT_LOCK_DIR to a writable folder"):
        loader.load(selftest, arch)
    capsys.readouterr()
    assert cli.main(["precompile", "--kernel", "selftest", "--set", SELFTEST_ID]) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("name, value, error", [
    ("DSV4JIT_BUILD_TIMEOUT", "0", "is not valid: it must be a number greater than 0"),
    ("DSV4JIT_VERBOSE_BUILD", "x", "is not a boolean: use one of 1, true, yes, on (on) or 0, false, no, off (off), "
                                   "any case"),
])
def test_a_setting_read_by_the_builds_stops_precompile_as_a_usage_error(name, value, error, fake_nvcc, prebuilt,
                                                                        tmp_path, monkeypatch, capsys):
    """Rejected once, before any compile: DSV4JIT_BUILD_TIMEOUT=0 used to fail every build (each timed
    out at once), DSV4JIT_VERBOSE_BUILD=x to be read after each compile, which was thrown away."""
    counter = tmp_path / "nvcc-runs"
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=prebuilt.module, counter=counter)))
    monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli.main(["precompile", "--kernel", "selftest", "--set", "all", "-j", "2"]) == 2
    out, err = capsys.readouterr()
    assert err == f"dsv4jit: {name}='{value}' {error}\n"
    assert counted(counter) == 0
