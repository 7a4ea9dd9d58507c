"""Prebuilt kernels as a package: ``dsv4jit package`` writes the wheel, and once installed the loader
finds it beneath the user's cache, with no nvcc and DSV4JIT_NO_COMPILE=1, and refuses it by name
where it does not fit (another CUDA toolkit, tvm-ffi, platform or arch).

The package under test is the one installed in this environment when there is one (CI installs the
wheel it builds), else one that `dsv4jit package` writes from the session's selftest module and CPU
planner, unpacked as pip installs a wheel.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from dsv4jit import __version__, cli
from dsv4jit.errors import DSV4JITCacheMiss, DSV4JITToolchainError
from dsv4jit.jit import cache, loader, prebuilt
from dsv4jit.jit.kernels import SPECS
from dsv4jit.jit.registry import parse_variant_id
from dsv4jit.jit.toolchain import Arch
from helpers.jit_env import SELFTEST_ID, copy_entry

pytestmark = pytest.mark.usefixtures("jit_env")

INSTALLED = prebuilt.installed()  # before any test puts one on the path


def unpack(wheel: Path, site: Path) -> Path:
    """Install `wheel` into `site` as pip does for a wheel whose files all go to site-packages."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    return site / prebuilt.PACKAGE


@pytest.fixture
def built_wheel(warm_cache, host_planner, cache_dir, tmp_path, capsys) -> tuple[Path, dict]:
    """The wheel `dsv4jit package` writes of the cached selftest (sm_90a) and CPU planner, and its --json."""
    copy_entry(cache_dir, host_planner)
    capsys.readouterr()
    code = cli.main(["package", "--arch", "9.0a", "--set", SELFTEST_ID, "--set", "plan_host",
                     "--out", str(tmp_path / "dist"), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0, payload
    return Path(payload["wheel"]), payload


@pytest.fixture
def kernels(request, tmp_path, cache_dir, monkeypatch) -> prebuilt.Package:
    """The package under test (see the module's docstring), found by `prebuilt.installed`, and an
    empty user cache."""
    monkeypatch.setenv("DSV4JIT_PREBUILT", "1")
    if INSTALLED is None:
        wheel, _ = request.getfixturevalue("built_wheel")
        unpack(wheel, tmp_path / "site")
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        shutil.rmtree(cache_dir)
        cache_dir.mkdir()
    package = prebuilt.installed()
    assert package is not None and package.tags is not None, package
    return package


@pytest.fixture
def copied_kernels(kernels, tmp_path, monkeypatch) -> prebuilt.Package:
    """A copy of the package under test, first on the path, to change."""
    site = tmp_path / "site-copy"
    shutil.copytree(kernels.root, site / prebuilt.PACKAGE)
    monkeypatch.syspath_prepend(str(site))
    return prebuilt.installed()


def held(package: prebuilt.Package) -> list[tuple]:
    """(variant, arch) of every entry the package holds."""
    return [(parse_variant_id(m["variant"], SPECS), Arch(m["arch"])) for _, m in cache.iter_entries(package.root)]


def a_cuda_variant(package: prebuilt.Package) -> tuple:
    return next((v, a) for v, a in held(package) if not a.is_host)


# --------------------------------------------------------------------------------------------
# the wheel


def test_the_wheel_is_tagged_with_its_build_and_installable(built_wheel):
    wheel, payload = built_wheel
    tags = payload["tags"]
    import tvm_ffi

    assert tags["tvm_ffi"] == tvm_ffi.__version__ and tags["dsv4jit"] == __version__
    assert re.fullmatch(r"\d+\.\d+", tags["cuda"]) and f"release {tags['cuda']}," in tags["nvcc"]
    assert tags["arches"] == ["sm_90a", "host"] and tags["platform"] == cache.platform_tag()
    version = f"{__version__}+cu{tags['cuda'].replace('.', '')}.tvmffi{tags['tvm_ffi']}"
    assert wheel.name == f"dsv4jit_kernels-{version}-py3-none-linux_{tags['platform'].split('-')[0]}.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = f"dsv4jit_kernels-{version}.dist-info"
        metadata = z.read(f"{info}/METADATA").decode()
        assert "Name: dsv4jit-kernels\n" in metadata and f"Version: {version}\n" in metadata
        assert f"Requires-Dist: dsv4jit=={__version__}\n" in metadata
        assert f"Tag: py3-none-linux_{tags['platform'].split('-')[0]}\n" in z.read(f"{info}/WHEEL").decode()
        assert json.loads(z.read("dsv4jit_kernels/prebuilt.json")) == tags
        record = [line.split(",") for line in z.read(f"{info}/RECORD").decode().splitlines()]
        assert sorted(name for name, _, _ in record) == sorted(names)
        for name, digest, size in record:
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
    modules = sorted(n for n in names if n.endswith("/module.so"))
    assert [n.split("/")[2:4] for n in modules] == [["host", "plan_host"], ["sm_90a", "selftest"]]
    assert not [n for n in names if n.endswith("build.log")]


def test_the_same_entries_give_the_same_wheel(built_wheel, tmp_path, capsys):
    wheel, _ = built_wheel
    first = wheel.read_bytes()
    code = cli.main(["package", "--arch", "9.0a", "--set", SELFTEST_ID, "--set", "plan_host",
                     "--out", str(wheel.parent)])
    assert code == 0 and "cached 2" in capsys.readouterr().out
    assert wheel.read_bytes() == first


def test_package_needs_the_toolkit_it_tags(run_cli, no_toolchain, warm_cache):
    code, out, err = run_cli("package", "--arch", "9.0a", "--set", SELFTEST_ID)
    assert code == 2 and out == "" and "nvcc not found" in err


# --------------------------------------------------------------------------------------------
# discovery


def test_every_entry_loads_beneath_the_users_cache_without_nvcc(kernels, no_toolchain, monkeypatch):
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    pairs = held(kernels)
    assert pairs and {a.name for _, a in pairs} == set(kernels.tags["arches"])
    for variant, arch in pairs:
        assert loader.resolve(variant, arch).entry.is_relative_to(kernels.root), variant.id
        assert loader.load(variant, arch) is not None


def test_with_a_compiler_the_package_is_found_by_its_source_key(kernels, monkeypatch, fake_nvcc):
    # another toolkit root (and nvcc text) than the package's build, same release: its entries still serve
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", version=f"release {kernels.tags['cuda']}, V0 (other)")))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(kernels)
    assert loader.resolve(variant, arch).entry.is_relative_to(kernels.root)
    assert loader.load(variant, arch) is not None


def test_the_users_cache_comes_first(kernels, no_toolchain, cache_dir):
    variant, arch = a_cuda_variant(kernels)
    own = copy_entry(cache_dir, loader.resolve(variant, arch).entry)
    assert loader.resolve(variant, arch).entry == own


def test_list_and_info_show_the_package(kernels, no_toolchain, run_cli):
    variant, arch = a_cuda_variant(kernels)
    code, out, err = run_cli("list", "--arch", arch.name, "--set", variant.id, "--json")
    [row] = json.loads(out)["variants"]
    assert code == 0 and row["status"] == "cached" and Path(row["entry"]).is_relative_to(kernels.root)
    code, out, err = run_cli("info")
    [line] = [line for line in out.splitlines() if line.startswith("prebuilt kernels: ")]
    assert code == 0 and str(kernels.root) in line and f"{arch} used" in line


def test_a_newer_glibc_runs_the_package(kernels, no_toolchain, monkeypatch):
    built = kernels.tags["platform"]
    monkeypatch.setattr(cache, "platform_tag", lambda: re.sub(r"glibc[\d.]+$", "glibc9.99", built))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(kernels)
    assert loader.resolve(variant, arch).entry.is_relative_to(kernels.root)


@pytest.mark.parametrize("built, here, fits", [
    ("x86_64-glibc2.36", "x86_64-glibc2.36", True), ("x86_64-glibc2.36", "x86_64-glibc2.39", True),
    ("x86_64-glibc2.36", "x86_64-glibc2.4", False), ("x86_64-glibc2.36", "x86_64-glibc2.100", True),
    ("x86_64-glibc2.36", "aarch64-glibc2.36", False), ("x86_64-unknown", "x86_64-unknown", True),
    ("x86_64-glibc2.36", "x86_64-unknown", False), ("x86_64-musl1.2", "x86_64-musl1.3", False),
])
def test_a_platform_fits_the_same_cpu_and_libc_at_least_as_recent(built, here, fits):
    assert prebuilt.platform_fits(built, here) is fits


# --------------------------------------------------------------------------------------------
# refusals: by name, never loaded


def refused(variant, arch, *words: str) -> str:
    with pytest.raises(DSV4JITCacheMiss) as miss:
        loader.load(variant, arch)
    text = str(miss.value)
    assert "dsv4jit-kernels" in text and "is not used for" in text, text
    for word in words:
        assert word in text, (word, text)
    return text


def test_another_cuda_than_torchs_is_refused(kernels, no_toolchain, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "11.8")
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(kernels)
    refused(variant, arch, f"built with CUDA {kernels.tags['cuda']}, this process has CUDA 11.8 (torch ")
    if "host" in kernels.tags["arches"]:  # host modules hold no CUDA: they still serve
        assert loader.load(loader.variant("plan_host"), Arch.host()) is not None


def test_another_cuda_than_nvccs_is_refused(kernels, monkeypatch, fake_nvcc):
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", version="release 11.8, V11.8.89")))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(kernels)
    refused(variant, arch, f"built with CUDA {kernels.tags['cuda']}, this process has CUDA 11.8 (nvcc)")


def test_another_tvm_ffi_is_refused(kernels, no_toolchain, monkeypatch):
    other = dict(cache.tvm_ffi_info(), version="0.1.99")
    monkeypatch.setattr(cache, "tvm_ffi_info", lambda: other)
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(kernels)
    refused(variant, arch, f"built with tvm-ffi {kernels.tags['tvm_ffi']}, this process has tvm-ffi 0.1.99")


@pytest.mark.parametrize("here", ["aarch64-glibc2.36", "x86_64-glibc2.4"])
def test_another_platform_is_refused(kernels, no_toolchain, monkeypatch, here):
    monkeypatch.setattr(cache, "platform_tag", lambda: here)
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(kernels)
    refused(variant, arch, f"built on {kernels.tags['platform']}, which does not run on {here}")


def test_an_arch_it_does_not_hold_is_named(kernels, no_toolchain, monkeypatch):
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, _ = a_cuda_variant(kernels)
    refused(variant, Arch.parse("12.0a"), f"it holds {', '.join(kernels.tags['arches'])}, not sm_120a")


def test_without_a_compiler_the_toolchain_error_names_the_refusal(kernels, no_toolchain, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "11.8")
    variant, arch = a_cuda_variant(kernels)
    with pytest.raises(DSV4JITToolchainError, match="dsv4jit-kernels .* is not used for .*this process has CUDA 11.8"):
        loader.load(variant, arch)


def test_unreadable_tags_refuse_the_package(copied_kernels, no_toolchain, monkeypatch):
    tags = copied_kernels.root / prebuilt.TAGS
    tags.write_text(json.dumps(dict(copied_kernels.tags, arches="sm_90a")))
    monkeypatch.setenv("DSV4JIT_NO_COMPILE", "1")
    variant, arch = a_cuda_variant(copied_kernels)
    refused(variant, arch, "its prebuilt.json is malformed: its 'arches' is \"sm_90a\"")


def test_a_compile_in_place_of_a_refused_package_says_so_once(kernels, fake_nvcc, request, monkeypatch, caplog):
    module = request.getfixturevalue("prebuilt").module  # the session's selftest build, for the stand-in to copy
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("copy", copy_from=module, version="release 11.8, V11")))
    caplog.set_level(logging.WARNING, logger="dsv4jit")
    selftest, arch = loader.variant("selftest", dtype="fp32", pdl=True), Arch.parse("9.0a")
    loader.load(selftest, arch)
    loader.clear_memo()
    loader.load(selftest, arch)  # the compiled entry is a hit now: no second warning
    warnings = [r.getMessage() for r in caplog.records if "dsv4jit-kernels" in r.getMessage()]
    assert len(warnings) == 1 and "is not used for sm_90a: it was built with CUDA" in warnings[0], warnings


def test_dsv4jit_prebuilt_off_ignores_the_package(kernels, no_toolchain, monkeypatch):
    from dsv4jit import env
    from dsv4jit.errors import DSV4JITSettingError

    variant, arch = a_cuda_variant(kernels)
    for value, on in (("", True), ("1", True), ("on", True), ("0", False), ("OFF", False)):
        monkeypatch.setenv("DSV4JIT_PREBUILT", value)
        assert env.prebuilt() is on and (prebuilt.installed() is not None) is on
        assert (loader.resolve(variant, arch).entry is not None) is on, value
    monkeypatch.delenv("DSV4JIT_PREBUILT")
    assert env.prebuilt() is True
    monkeypatch.setenv("DSV4JIT_PREBUILT", "y")
    with pytest.raises(DSV4JITSettingError, match="DSV4JIT_PREBUILT='y' is not a boolean"):
        loader.resolve(variant, arch)
