"""Prebuilt kernels installed as a package: a read-only cache tier beneath the user's.

``python -m dsv4jit package`` writes a wheel (jit/wheel.py) whose import package, `PACKAGE`, is a
cache root (``v1/<arch>/<kernel>/<slug>-<key>/`` with ``module.so`` and ``manifest.json``) plus
`TAGS`, the facts of its build: the CUDA toolkit and tvm-ffi versions, the platform, the arches it
holds and dsv4jit's version. Once it is installed, the loader looks there after the write root and
the ``DSV4JIT_CACHE_PATH`` roots, by source key as a root is searched without a compiler: a package
is built by one toolkit, which its tags name, so the local compiler's identity does not enter. The
package's platform stands in for this machine's in the key, since a module built against a glibc
runs on a later one.

A package whose tags do not fit this process for an arch is not searched for it, and the reason
names the package: another CUDA toolkit than this process's (nvcc's when one is found, else the one
torch was built with; a CUDA arch only), another tvm-ffi, another CPU or C library or an older glibc,
or an arch the package does not hold.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from .. import __version__, env
from ..errors import DSV4JITToolchainError
from . import cache, metadata
from .registry import Variant
from .toolchain import Arch, Toolchain, toolchain

log = logging.getLogger("dsv4jit")

PACKAGE = "dsv4jit_kernels"  # the import name: one such package per environment
DISTRIBUTION = "dsv4jit-kernels"
TAGS = "prebuilt.json"
#: The fields of `TAGS` and their JSON types; a file with one missing or of another type refuses the package.
TAG_FIELDS = {"dsv4jit": str, "cuda": str, "nvcc": str, "tvm_ffi": str, "platform": str, "arches": list}

_WARNED: set[str] = set()  # refusals already logged by this process


@dataclass(frozen=True)
class Package:
    """An installed package of prebuilt kernels: its cache root and its tags (None, and why, when
    `TAGS` cannot be read or is not of its form)."""

    root: Path
    tags: dict | None
    problem: str | None = None

    def __str__(self) -> str:
        if self.tags is None:
            return f"{DISTRIBUTION} at {self.root}"
        return (f"{DISTRIBUTION} {version(self.tags)} at {self.root} (built on {self.tags['platform']} for "
                f"{', '.join(self.tags['arches'])})")


def version(tags: dict) -> str:
    """The package's version: dsv4jit's, with the toolkit and tvm-ffi it was built with as the local
    label (``0.1.0+cu130.tvmffi0.1.15.post2``)."""
    return f"{tags['dsv4jit']}+cu{tags['cuda'].replace('.', '')}.tvmffi{tags['tvm_ffi']}"


def build_tags(tc: Toolchain, arches: list[Arch]) -> dict:
    """The tags (`TAG_FIELDS`) of a package of modules built here by `tc` for `arches`."""
    if tc.cuda_release is None:
        raise DSV4JITToolchainError(f"{tc.nvcc} --version names no CUDA release to tag the package with")
    release = next(line for line in tc.nvcc_version.splitlines() if "release" in line)
    return {"dsv4jit": __version__, "cuda": tc.cuda_release, "nvcc": release.strip(),
            "tvm_ffi": cache.tvm_ffi_info()["version"], "platform": cache.platform_tag(),
            "arches": [a.name for a in arches]}


def installed() -> Package | None:
    """The installed package of prebuilt kernels, found without importing it; None when there is none
    or DSV4JIT_PREBUILT is off."""
    if not env.prebuilt():
        return None
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    tags, problem = metadata.read(root / TAGS, TAG_FIELDS)
    if tags is not None and not all(isinstance(arch, str) for arch in tags["arches"]):
        tags, problem = None, f"malformed: its 'arches' is {tags['arches']}"
    return Package(root, tags, None if tags is not None else f"its {TAGS} is {problem}")


def cuda_here(root: Path | None = None) -> tuple[str | None, str]:
    """This process's CUDA version and where it comes from: the nvcc the builds would use (its
    identity is kept in write root `root`'s toolchain.json), else the toolkit torch was built with;
    None where neither exists (a CPU build of torch: no CUDA kernel can run)."""
    try:
        return toolchain(need_cuda=True, root=root).cuda_release, "nvcc"
    except DSV4JITToolchainError:
        import torch

        return torch.version.cuda, f"torch {torch.__version__}"


def platform_fits(built: str, here: str) -> bool:
    """Whether modules built on platform tag `built` (``x86_64-glibc2.36``) load on `here`: the same CPU
    and C library, and for glibc a version at least as recent."""
    pattern = r"(.+)-([a-z]+?)([\d.]*)"
    b, h = re.fullmatch(pattern, built), re.fullmatch(pattern, here)
    if b is None or h is None or b.group(1, 2) != h.group(1, 2):
        return False
    if b.group(2) != "glibc":
        return built == here

    def glibc(m: re.Match) -> tuple[int, ...]:
        return tuple(int(x) for x in m.group(3).split(".") if x)

    return glibc(h) >= glibc(b)


def refusal(package: Package, arch: Arch, root: Path | None = None) -> str | None:
    """Why `package` cannot serve `arch` in this process, or None when it can (`root`: the write root)."""
    if package.tags is None:
        return package.problem
    tags = package.tags
    if arch.name not in tags["arches"]:
        return f"it holds {', '.join(tags['arches'])}, not {arch}"
    tvm_ffi = cache.tvm_ffi_info()["version"]
    if tags["tvm_ffi"] != tvm_ffi:
        return f"it was built with tvm-ffi {tags['tvm_ffi']}, this process has tvm-ffi {tvm_ffi}"
    if not platform_fits(tags["platform"], cache.platform_tag()):
        return f"it was built on {tags['platform']}, which does not run on {cache.platform_tag()}"
    if not arch.is_host:
        cuda, source = cuda_here(root)
        if cuda is not None and cuda != tags["cuda"]:
            return f"it was built with CUDA {tags['cuda']}, this process has CUDA {cuda} ({source})"
    return None


def find_entry(variant: Variant, arch: Arch, normalized_command: list[str],
               root: Path | None = None) -> tuple[Path | None, bytes | None, list[cache.Damaged]]:
    """The installed package's verified entry of `variant` for `arch` (by the source key its platform
    gives `normalized_command`), its module's bytes, and the damaged ones met; nothing when the
    package refuses the arch."""
    package = installed()
    if package is None or refusal(package, arch, root) is not None:
        return None, None, []
    info = cache.make_key(variant, arch, normalized_command, None, platform=package.tags["platform"])
    return cache.search([package.root], variant, arch, None, info.source_key)


def note(arch: Arch, root: Path | None = None) -> str:
    """What the installed package did for a variant of `arch` that no root holds, for the messages of
    a miss: ``""`` without a package."""
    package = installed()
    if package is None:
        return ""
    why = refusal(package, arch, root)
    return f"; {package} is not used for {arch}: {why}" if why else f"; {package} holds no entry for it"


def warn_refused(arch: Arch, root: Path | None = None) -> None:
    """Log, once per process and reason, that the installed package is not used for `arch`."""
    package = installed()
    why = refusal(package, arch, root) if package is not None else None
    if why and (text := f"dsv4jit: {package} is not used for {arch}: {why}") not in _WARNED:
        _WARNED.add(text)
        log.warning(text)
