"""Cache keys, header scanning, arch parsing and variant canonicalisation.

Keys are computed through ``loader.resolve`` (what a load uses) with a stand-in nvcc, so no test
here compiles anything; only the ``compile``-marked tests touch the real CUDA toolkit.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dsv4jit.jit import cache, compiler, loader, toolchain
from dsv4jit.jit.kernels import SELFTEST, SPECS
from dsv4jit.jit.registry import Param, KernelSpec, parse_variant_id
from dsv4jit.jit.toolchain import Arch
from helpers.jit_env import DEFAULT_VERSION, REAL_NVCC

pytestmark = pytest.mark.usefixtures("jit_env")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolve_info(variant, arch) -> cache.KeyInfo:
    """Key info as a fresh process would compute it (no memoised toolchain or header scan)."""
    toolchain.reset()
    cache._closure_memo.cache_clear()
    res = loader.resolve(variant, arch)
    assert res.info is not None, "a toolchain should have been found"
    return res.info


@pytest.fixture
def fake_toolchain(fake_nvcc, monkeypatch) -> Path:
    """A stand-in nvcc that identifies itself; nothing here compiles, so its compile mode is 'fail'."""
    nvcc = fake_nvcc("fail")
    monkeypatch.setenv("DSV4JIT_NVCC", str(nvcc))
    return nvcc


@pytest.fixture
def csrc_copy(tmp_path, monkeypatch):
    """Factory: copy the package's csrc tree somewhere else and make the loader use that copy.

    Moving ``cache.CSRC`` is enough: ``header_closure`` reads it at each call (its ``csrc`` argument
    defaults to None, see ``test_key_follows_a_relocated_csrc``); the closure memo is cleared so that
    no digest of the old tree is reused.
    """

    def make(where: str) -> Path:
        tree = tmp_path / where / "csrc"
        shutil.copytree(cache.CSRC, tree)
        monkeypatch.setattr(cache, "CSRC", tree)
        cache._closure_memo.cache_clear()
        return tree

    yield make
    cache._closure_memo.cache_clear()


# --------------------------------------------------------------------------------------------
# What changes the key


@pytest.mark.parametrize("edited", ["common/types.cuh", "common/dtypes.h"])
def test_key_changes_when_a_nested_header_changes(fake_toolchain, csrc_copy, selftest, arch, edited):
    # types.cuh is included by selftest.cuh and by pdl.cuh; dtypes.h only through other headers.
    tree = csrc_copy("pkg")
    before = resolve_info(selftest, arch)
    with open(tree / edited, "a") as f:
        f.write("\n// an edit that changes nothing but the bytes\n")
    after = resolve_info(selftest, arch)
    assert after.key != before.key
    assert after.source_key != before.source_key
    changed = {h for h in after.document["headers"] if after.document["headers"][h] != before.document["headers"].get(h)}
    assert changed == {edited}


def test_key_follows_a_relocated_csrc(fake_toolchain, tmp_path, monkeypatch, selftest, arch):
    # Only the module attribute moves: the compile command (-I<CSRC>) and the depfile check use the
    # new tree, so the header digests in the key must come from it as well.
    tree = tmp_path / "pkg" / "csrc"
    shutil.copytree(cache.CSRC, tree)
    monkeypatch.setattr(cache, "CSRC", tree)
    before = resolve_info(selftest, arch)
    with open(tree / "common" / "types.cuh", "a") as f:
        f.write("\n// edited\n")
    assert resolve_info(selftest, arch).key != before.key


@pytest.mark.parametrize("name, value, expected_arg", [
    ("DSV4JIT_EXTRA_CUDA_FLAGS", "-DDSV4JIT_TEST_FLAG=1 -Xptxas=-v", "-DDSV4JIT_TEST_FLAG=1"),
    ("DSV4JIT_LINEINFO", "1", "-lineinfo"),
    ("DSV4JIT_DEBUG", "1", "-G"),
])
def test_key_changes_with_compile_flags(fake_toolchain, monkeypatch, selftest, arch, name, value, expected_arg):
    before = resolve_info(selftest, arch)
    monkeypatch.setenv(name, value)
    after = resolve_info(selftest, arch)
    assert expected_arg not in before.document["command"]
    assert expected_arg in after.document["command"]
    assert after.key != before.key


def test_key_and_entry_change_with_the_arch(fake_toolchain, selftest, arch):
    hopper = resolve_info(selftest, arch)
    blackwell_arch = Arch.parse("10.0a")
    blackwell = resolve_info(selftest, blackwell_arch)
    assert blackwell.key != hopper.key
    assert "-gencode=arch=compute_100a,code=sm_100a" in blackwell.document["command"]
    assert "-DDSV4JIT_CUDA_ARCH=1000" in blackwell.document["command"]
    root = cache.roots()[0]
    assert cache.entry_dir(root, arch, selftest, hopper.key).parts[-3] == "sm_90a"
    assert cache.entry_dir(root, blackwell_arch, selftest, blackwell.key).parts[-3] == "sm_100a"


def test_key_changes_with_the_nvcc_version_text(fake_nvcc, monkeypatch, selftest, arch):
    # The same script path is rewritten, so the toolkit root stays; only --version differs.
    v13 = DEFAULT_VERSION
    v12 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.9, V12.9.41 (a longer fake)"
    nvcc = fake_nvcc("fail", version=v13)
    monkeypatch.setenv("DSV4JIT_NVCC", str(nvcc))
    first = resolve_info(selftest, arch)
    assert first.document["toolchain"]["nvcc_version"] == v13

    assert fake_nvcc("fail", version=v12) == nvcc
    second = resolve_info(selftest, arch)
    assert second.document["toolchain"]["nvcc_version"] == v12
    assert second.key != first.key
    assert second.source_key == first.source_key  # the toolchain is kept out of the source key

    fake_nvcc("fail", version=v13)  # back to the first toolkit: the first key again
    assert resolve_info(selftest, arch).key == first.key


def test_key_changes_with_the_toolkit_root(fake_nvcc, monkeypatch, selftest, arch):
    # Two toolkits reporting the same version text are still different toolchains.
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", name="cuda-a")))
    a = resolve_info(selftest, arch)
    monkeypatch.setenv("DSV4JIT_NVCC", str(fake_nvcc("fail", name="cuda-b")))
    b = resolve_info(selftest, arch)
    assert a.document["toolchain"]["nvcc_version"] == b.document["toolchain"]["nvcc_version"]
    assert a.key != b.key


# --------------------------------------------------------------------------------------------
# What does not change the key


def test_key_ignores_where_the_package_lives(fake_toolchain, csrc_copy, selftest, arch):
    original = resolve_info(selftest, arch)
    keys = {}
    for where in ("site-a", "elsewhere/site-b"):
        tree = csrc_copy(where)
        command = compiler.compile_command(selftest, arch, toolchain.toolchain())
        assert f"-I{tree}" in command.argv  # the copy really is what would be compiled
        keys[where] = resolve_info(selftest, arch).key
    assert keys == {"site-a": original.key, "elsewhere/site-b": original.key}


def test_key_ignores_a_symlinked_cuda_home(fake_nvcc, tmp_path, monkeypatch, selftest, arch):
    nvcc = fake_nvcc("fail")
    toolkit = nvcc.parent.parent
    link = tmp_path / "cuda-link"
    link.symlink_to(toolkit, target_is_directory=True)
    monkeypatch.delenv("DSV4JIT_NVCC", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)

    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    direct = resolve_info(selftest, arch)
    monkeypatch.setenv("CUDA_HOME", str(link))
    through_link = resolve_info(selftest, arch)
    assert toolchain.toolchain().cuda_root == toolkit.resolve()
    assert through_link.key == direct.key


@pytest.mark.compile
def test_key_ignores_the_spelling_of_the_real_toolkit(tmp_path, monkeypatch, selftest, arch):
    # The real nvcc reports TOP through the path it was started from; every spelling of the same
    # toolkit (real dir, a symlink to it, the wrapper script on PATH) must give one key.
    top = subprocess.run([REAL_NVCC, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    toolkit = Path(re.search(r"^#\$ TOP=(.*)$", top, re.M).group(1)).resolve()  # REAL_NVCC may be a wrapper
    link = tmp_path / "cuda-link"
    link.symlink_to(toolkit, target_is_directory=True)
    monkeypatch.delenv("DSV4JIT_NVCC", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    keys = {}
    for home in (toolkit, link):
        monkeypatch.setenv("CUDA_HOME", str(home))
        keys[str(home)] = resolve_info(selftest, arch).key
    monkeypatch.setenv("DSV4JIT_NVCC", REAL_NVCC)
    keys["DSV4JIT_NVCC"] = resolve_info(selftest, arch).key
    assert len(set(keys.values())) == 1, keys
    assert toolchain.toolchain().cuda_root == toolkit


def test_key_ignores_the_torch_version(fake_toolchain, monkeypatch, selftest, arch):
    import torch

    before = resolve_info(selftest, arch)
    monkeypatch.setattr(torch, "__version__", "99.0.0+somethingelse")
    after = resolve_info(selftest, arch)
    assert after.key == before.key
    assert "99.0.0" not in repr(after.document)


# --------------------------------------------------------------------------------------------
# make_key itself


def test_make_key_hashes_its_document(selftest, arch):
    command = ["<cuda>/bin/nvcc", "-O3", "wrapper.cu"]
    ident = {"nvcc_version": "13.0", "cuda_root": "/opt/cuda", "cxx_version": "g++ 12"}
    info = cache.make_key(selftest, arch, command, ident)
    assert len(info.key) == cache.KEY_CHARS and len(info.source_key) == cache.KEY_CHARS
    assert info.key == cache._hash(info.document)
    assert info.document["toolchain"] == ident
    # Deterministic, and every input moves it.
    assert cache.make_key(selftest, arch, list(command), dict(ident)).key == info.key
    others = [
        cache.make_key(selftest, arch, command + ["-lineinfo"], ident),
        cache.make_key(selftest, Arch.parse("10.0a"), command, ident),
        cache.make_key(selftest, arch, command, {**ident, "nvcc_version": "12.9"}),
        cache.make_key(SELFTEST.variant(dtype="bf16", pdl=True), arch, command, ident),
        cache.make_key(selftest, arch, command, ident, header_digests={"selftest.cuh": "0" * 64}),
    ]
    assert len({info.key, *(o.key for o in others)}) == 1 + len(others)


def test_source_key_leaves_out_the_toolchain(selftest, arch):
    command = ["<cuda>/bin/nvcc", "wrapper.cu"]
    with_tc = cache.make_key(selftest, arch, command, {"nvcc_version": "13.0"})
    other_tc = cache.make_key(selftest, arch, command, {"nvcc_version": "12.9"})
    without = cache.make_key(selftest, arch, command, None)
    assert with_tc.source_key == other_tc.source_key == without.source_key
    assert "toolchain" not in without.document
    assert without.key == without.source_key
    assert with_tc.key != other_tc.key


# --------------------------------------------------------------------------------------------
# Header scanning


def test_header_closure_of_selftest_is_its_include_closure():
    # Check the scan against the headers themselves: every in-package file named by a quoted or
    # angled include of a scanned file is scanned too, and nothing else is.

    csrc = cache.CSRC
    closure = cache.header_closure("selftest.cuh")
    assert "<tree>" not in closure
    assert {"selftest.cuh", "common/launch.cuh", "common/pdl.cuh", "common/tensor_check.h",
            "common/types.cuh", "common/dtypes.h"} <= set(closure)

    reached = {"selftest.cuh"}
    for rel in closure:
        path = csrc / rel
        for quoted, angled in re.findall(r'^\s*#\s*include\s*(?:"([^"]+)"|<([^>]+)>)', path.read_text(), re.M):
            bases = (path.parent, csrc) if quoted else (csrc,)
            hit = next(((b / (quoted or angled)).resolve() for b in bases if (b / (quoted or angled)).is_file()), None)
            if hit is not None and csrc in hit.parents:
                reached.add(str(hit.relative_to(csrc)))
    assert set(closure) == reached
    assert closure == {rel: sha256(csrc / rel) for rel in sorted(closure)}
    assert list(closure) == sorted(closure)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_header_closure_resolution_rules(tmp_path):
    tree = write_tree(tmp_path / "csrc", {
        "top.cuh": '#include "sub/a.h"\n#include <b.h>\n#include <cuda_runtime.h>\n// #include "unused.h"\n',
        "sub/a.h": '#pragma once\n  #  include "c.h"\n#include "d.h"\n',  # c.h next to a.h; d.h from the root
        "sub/c.h": '#include "a.h"\n',  # a cycle must terminate
        "b.h": "int b;\n",
        "d.h": "int d;\n",
        "c.h": "// shadowed by sub/c.h for includes from sub/\n",
        "unused.h": "int unused;\n",
    })
    closure = cache.header_closure("top.cuh", tree)
    assert closure == {rel: sha256(tree / rel) for rel in ("b.h", "d.h", "sub/a.h", "sub/c.h", "top.cuh")}


def test_computed_include_falls_back_to_the_tree_digest(tmp_path):
    tree = write_tree(tmp_path / "csrc", {
        "top.cuh": '#include "a.h"\n#define KERNEL_IMPL "impl_v2.h"\n#include KERNEL_IMPL\n',
        "a.h": "int a;\n",
        "impl_v2.h": "int v2;\n",
        "notes.txt": "not a header\n",
    })
    closure = cache.header_closure("top.cuh", tree)
    assert closure == {"<tree>": cache._digest_tree(tree)}
    # The fallback covers headers the scan cannot see, and only headers.
    (tree / "notes.txt").write_text("edited\n")
    assert cache.header_closure("top.cuh", tree) == closure
    (tree / "impl_v2.h").write_text("int v2 = 1;\n")
    assert cache.header_closure("top.cuh", tree) != closure


def test_computed_include_in_the_package_keys_on_every_header(fake_toolchain, csrc_copy, selftest, arch):
    tree = csrc_copy("pkg")
    with open(tree / "selftest.cuh", "a") as f:
        f.write('\n#define DSV4JIT_EXTRA_HEADER "common/warp.cuh"\n#include DSV4JIT_EXTRA_HEADER\n')
    before = resolve_info(selftest, arch)
    assert list(before.document["headers"]) == ["<tree>"]
    unrelated = tree / "common" / "unrelated_by_scan.cuh"
    unrelated.write_text("// only reachable through a macro\n")
    assert resolve_info(selftest, arch).key != before.key


def test_depfile_finding_a_header_the_scan_missed_is_logged(tmp_path, monkeypatch, caplog, selftest):
    tree = write_tree(tmp_path / "csrc", {"top.cuh": '#include "a.h"\n', "a.h": "", "hidden.h": ""})
    monkeypatch.setattr(cache, "CSRC", tree.resolve())
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "deps.d").write_text(f"module.so: wrapper.cu {tree}/top.cuh \\\n {tree}/a.h \\\n {tree}/hidden.h\n")
    scanned = cache.header_closure("top.cuh", tree)

    with caplog.at_level(logging.WARNING, logger="dsv4jit"):
        compiler.check_depfile(selftest, stage, scanned)
    assert "hidden.h" in caplog.text and "missed" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dsv4jit"):
        compiler.check_depfile(selftest, stage, {**scanned, "hidden.h": "x"})
        compiler.check_depfile(selftest, stage, {"<tree>": "x"})
    assert caplog.text == ""


# --------------------------------------------------------------------------------------------
# Arch parsing


@pytest.mark.parametrize("text", ["9.0", "9.0a", "90a", "90", "sm_90a", "sm_90", "compute_90a", " SM_90A "])
def test_arch_parse_hopper_spellings(text):
    arch = Arch.parse(text)
    assert arch == Arch("sm_90a")
    assert arch.number == 900
    assert arch.gencode() == "-gencode=arch=compute_90a,code=sm_90a"


@pytest.mark.parametrize("text, name", [("10.0a", "sm_100a"), ("100a", "sm_100a"), ("10.0", "sm_100a"),
                                        ("12.0", "sm_120a"), ("sm_120a", "sm_120a")])
def test_arch_parse_other_targets(text, name):
    assert Arch.parse(text).name == name


@pytest.mark.parametrize("text, name", [("8.0", "sm_80"), ("sm_86", "sm_86"), ("9.5", "sm_95a"), ("12.0f", "sm_120f"),
                                        ("10.3a", "sm_103a"), ("121", "sm_121a")])
def test_arch_parse_rejects_unsupported_targets_naming_the_supported_ones(text, name):
    with pytest.raises(ValueError, match=re.escape(f"unsupported CUDA arch {text!r} ({name}): the kernels build for "
                                                   "sm_90a (H100, H200), sm_100a (B200, GB200), sm_120a")):
        Arch.parse(text)


@pytest.mark.parametrize("junk", ["", "9", "abc", "sm_", "9.0b", "9.0.0", "hopper", "sm_90aa", "-90"])
def test_arch_parse_rejects_junk(junk):
    with pytest.raises(ValueError, match="invalid CUDA arch"):
        Arch.parse(junk)


# --------------------------------------------------------------------------------------------
# Variants


def test_variant_id_slug_and_wrapper_are_canonical():
    a = SELFTEST.variant(pdl=True, dtype="fp32")
    b = SELFTEST.variant(dtype="fp32", pdl="1")
    c = SELFTEST.variant(dtype="fp32", pdl=1)
    assert a == b == c
    assert a.id == "selftest[dtype=fp32,pdl=1]"  # schema order, bools as 0/1
    assert a.slug == "selftest__fp32_pdl"
    assert a.wrapper_source() == (
        "// dsv4jit generated wrapper for selftest[dtype=fp32,pdl=1]\n"
        '#include "selftest.cuh"\n'
        "\n"
        "TVM_FFI_DLL_EXPORT_TYPED_FUNC(affine, (dsv4::SelfTestEntry<float, true>::affine));\n")
    off = SELFTEST.variant(dtype="bf16", pdl="false")
    assert off.id == "selftest[dtype=bf16,pdl=0]"
    assert off.slug == "selftest__bf16_nopdl"
    assert "dsv4::SelfTestEntry<dsv4::bf16_t, false>::affine" in off.wrapper_source()


def test_variant_rejects_unknown_and_missing_parameters():
    with pytest.raises(ValueError, match=r"head_dim"):
        SELFTEST.variant(dtype="fp32", pdl=True, head_dim=512)
    with pytest.raises(ValueError, match=r"missing.*'pdl'"):
        SELFTEST.variant(dtype="fp32")
    with pytest.raises(ValueError, match=r"'dtype'.*fp64"):
        SELFTEST.variant(dtype="fp64", pdl=True)


def test_int_parameters_are_canonical():
    spec = KernelSpec("toy", "toy.cuh", (Param("head_dim", "int", (64, 512)),), {"run": "Toy<{head_dim}>::run"})
    assert spec.variant(head_dim="512") == spec.variant(head_dim=512)
    assert spec.variant(head_dim=512).id == "toy[head_dim=512]"
    with pytest.raises(ValueError, match="head_dim"):
        spec.variant(head_dim=128)


@pytest.mark.parametrize("junk", ["ture", "2", "enabled"])
def test_bool_parameters_reject_junk(junk):
    with pytest.raises(ValueError, match="pdl"):
        parse_variant_id(f"selftest[dtype=fp32,pdl={junk}]", SPECS)


def test_parse_variant_id_round_trips_every_variant():
    variants = [v for spec in SPECS.values() for v in spec.all_variants()]
    assert variants, "the registry is empty"
    for v in variants:
        assert parse_variant_id(v.id, SPECS) == v
    assert len({v.id for v in variants}) == len({v.slug for v in variants}) == len(variants)


def test_the_registry_shows_a_real_variant_id():
    from dsv4jit.jit import registry
    [shown] = re.findall(r"its id \(``([^`]+)``\)", registry.__doc__)
    assert parse_variant_id(shown, SPECS).id == shown


def test_parse_variant_id_normalises_and_reports():
    assert parse_variant_id("selftest[pdl=true, dtype=fp32]", SPECS).id == "selftest[dtype=fp32,pdl=1]"
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        parse_variant_id("nope[x=1]", SPECS)
    with pytest.raises(ValueError, match="malformed"):
        parse_variant_id("selftest[dtype=fp32,pdl=1", SPECS)
    with pytest.raises(ValueError, match="not k=v"):
        parse_variant_id("selftest[dtype=fp32,pdl]", SPECS)
