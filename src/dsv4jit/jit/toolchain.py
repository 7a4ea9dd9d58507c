"""Compilers and target architectures.

nvcc is found through DSV4JIT_NVCC, CUDA_HOME, CUDA_PATH, PATH, then /usr/local/cuda, and always
resolved to the real toolkit (``nvcc --dryrun`` prints ``#$ TOP=<toolkit>/bin/..`` even through
wrapper scripts). The identity that enters cache keys (version texts, real toolkit root) is
remembered on disk per compiler file (path, size, mtime), so a warm load runs no subprocess.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import env
from ..errors import DSV4JITSettingError, DSV4JITToolchainError
from . import metadata

_NVCC_SEARCH = "DSV4JIT_NVCC, CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda"

#: The GPU targets the kernels are written for, and their GPUs: the kernels use Hopper's thread-block
#: clusters and programmatic dependent launch, so nothing before sm_90, and an arch-specific (``a``)
#: target of each; the serving set compiles for each (CI compiles it for sm_90a and sm_100a), the GPU
#: tests run on sm_90a.
SUPPORTED_ARCHS = {"sm_90a": "H100, H200", "sm_100a": "B200, GB200", "sm_120a": "RTX 50-series, RTX PRO Blackwell"}
_SUPPORTED_TEXT = "the kernels build for " + ", ".join(f"{arch} ({gpus})" for arch, gpus in SUPPORTED_ARCHS.items())


@dataclass(frozen=True)
class Arch:
    """A build target: ``sm_90a`` for a GPU, or ``host`` for host-only modules."""

    name: str

    @staticmethod
    def host() -> "Arch":
        return Arch("host")

    @staticmethod
    def parse(text: str) -> "Arch":
        """Accepts ``9.0``, ``9.0a``, ``90a``, ``sm_90a``, ``compute_90a``; sm_90+ gets the ``a`` suffix.
        ValueError for text of another form, and for an arch not in `SUPPORTED_ARCHS` (before
        anything compiles for it)."""
        raw = text.strip().lower()
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)(?:\.(\d+))?([af]?)", raw)
        if not m:
            raise ValueError(f"invalid CUDA arch {text!r}: expected e.g. 9.0a, 90a or sm_90a")
        major, minor, suffix = m.group(1), m.group(2), m.group(3)
        if minor is None:
            if len(major) < 2:
                raise ValueError(f"invalid CUDA arch {text!r}: expected e.g. 9.0a, 90a or sm_90a")
            major, minor = major[:-1], major[-1]
        arch = Arch.from_capability(int(major), int(minor), suffix)
        if not arch.supported:
            raise ValueError(f"unsupported CUDA arch {text!r} ({arch}): {_SUPPORTED_TEXT}")
        return arch

    @staticmethod
    def from_capability(major: int, minor: int, suffix: str | None = None) -> "Arch":
        if suffix is None or suffix == "":
            suffix = "a" if major >= 9 else ""
        return Arch(f"sm_{major}{minor}{suffix}")

    @property
    def is_host(self) -> bool:
        return self.name == "host"

    @property
    def supported(self) -> bool:
        return self.is_host or self.name in SUPPORTED_ARCHS

    @property
    def number(self) -> int:
        """Numeric arch (900 for sm_90a), as ``DSV4JIT_CUDA_ARCH`` seen by the C++ code."""
        digits = re.sub(r"\D", "", self.name)
        return int(digits) * 10

    def gencode(self) -> str:
        code = self.name
        return f"-gencode=arch={code.replace('sm_', 'compute_')},code={code}"

    def __str__(self) -> str:
        return self.name


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> Arch:
    """Arch of a CUDA device, memoised per device index (mixed-GPU processes work)."""
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return Arch.from_capability(major, minor)


def forced_arch() -> Arch | None:
    """``DSV4JIT_CUDA_ARCH`` as a target (a `DSV4JITSettingError` naming it when it is not a supported
    arch), or None when it is unset."""
    if not (text := env.cuda_arch()):
        return None
    try:
        return Arch.parse(text)
    except ValueError as e:
        raise DSV4JITSettingError(f"DSV4JIT_CUDA_ARCH: {e}") from None


def device_target(index: int) -> Arch:
    """The arch of CUDA device `index` as a build target; a GPU of an arch the kernels do not support
    is a toolchain error naming the device (no build could run on it)."""
    arch = device_arch(index)
    if not arch.supported:
        import torch

        raise DSV4JITToolchainError(f"GPU {index} ({torch.cuda.get_device_name(index)}) is {arch}, which dsv4jit "
                                    f"does not support ({_SUPPORTED_TEXT})")
    return arch


def resolve_arch(device_index: int | None = None) -> Arch:
    """``DSV4JIT_CUDA_ARCH`` if set, else the arch of the given (or current) CUDA device."""
    if forced := forced_arch():
        return forced
    import torch

    if not torch.cuda.is_available():
        raise DSV4JITToolchainError(
            "no CUDA device is visible to pick a target arch: pass --arch (e.g. --arch 9.0a) "
            "or set DSV4JIT_CUDA_ARCH")
    return device_target(torch.cuda.current_device() if device_index is None else device_index)


# --------------------------------------------------------------------------------------------
# Compiler identity, cached on disk by the compiler file's stat so warm loads spawn nothing.


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def _cached(kind: str, path: Path, compute, valid, cache_file: Path):
    """The record of compiler file `path` in `cache_file`, if its stamps match and `valid(value)`;
    else ``compute()`` (value, files it depends on), stored. A file or record of another form (written
    by hand, or by a broken writer) counts as absent and is replaced."""
    stamp = _stat_key(path)
    table = metadata.load(cache_file)[0] or {}
    entry = table.get(f"{kind}:{path}")
    if (isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("deps"), dict)
            and all(_safe_stat(Path(p)) == s for p, s in entry["deps"].items()) and valid(entry.get("value"))):
        return entry["value"]
    value, deps = compute()
    table[f"{kind}:{path}"] = {"stamp": stamp, "value": value,
                               "deps": {str(p): _safe_stat(p) for p in deps}}
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, cache_file)
    except OSError:  # a read-only or full cache only costs the subprocess next time
        with contextlib.suppress(OSError):
            tmp.unlink()
    return value


def _safe_stat(path: Path):
    try:
        return _stat_key(path)
    except OSError:
        return None


def _run(cmd: list[str]) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DSV4JITToolchainError(f"running {' '.join(cmd)} failed: {e}") from e
    if res.returncode != 0:
        said = res.stderr.strip()[:500]
        raise DSV4JITToolchainError(f"{' '.join(cmd)} exited with {res.returncode}"
                                    + (f": {said}" if said else ", with no error message"))
    return res.stdout + res.stderr


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _find_nvcc() -> Path:
    """The nvcc that the first of DSV4JIT_NVCC, CUDA_HOME, CUDA_PATH that is set names (never passed
    over for another toolkit); with none set, nvcc on PATH, else /usr/local/cuda's."""
    if explicit := env.nvcc():
        return _named_nvcc("DSV4JIT_NVCC", explicit, explicit)
    if homes := env.cuda_homes():
        name, home = homes[0]
        return _named_nvcc(name, home, os.path.join(home, "bin", "nvcc"))
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and _executable(candidate):
            return Path(candidate).absolute()
    raise DSV4JITToolchainError(
        f"nvcc not found (looked at {_NVCC_SEARCH}); install the CUDA toolkit or precompile this "
        "variant where one exists: python -m dsv4jit precompile --arch 9.0a")


def _named_nvcc(variable: str, value: str, nvcc: str) -> Path:
    if not _executable(nvcc):
        raise DSV4JITToolchainError(f"{variable}={value!r} names no nvcc ({nvcc} is not an executable file); "
                                    f"set it to {'an nvcc' if variable == 'DSV4JIT_NVCC' else 'a CUDA toolkit'}, "
                                    "or unset it")
    return Path(nvcc).absolute()


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path | None  # real nvcc inside the toolkit (None for host-only use)
    cuda_root: Path | None
    nvcc_version: str
    cxx: Path
    cxx_version: str

    @property
    def cuda_release(self) -> str | None:
        """The toolkit's ``major.minor`` (``13.0``), from nvcc's ``release 13.0, V13.0.88`` line."""
        m = re.search(r"release (\d+\.\d+)", self.nvcc_version)
        return m.group(1) if m else None

    def identity(self, host_only: bool) -> dict:
        """What enters cache keys: version texts and the real toolkit root, never PATH spellings."""
        ident = {"cxx_version": self.cxx_version}
        if not host_only:
            ident.update(nvcc_version=self.nvcc_version, cuda_root=str(self.cuda_root))
        return ident


def _nvcc_identity(nvcc: Path, cache_file: Path):
    def compute():
        out = _run([str(nvcc), "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"])
        m = re.search(r"^#\$ TOP=(.*)$", out, re.M)
        root = Path(m.group(1).strip()).resolve() if m else nvcc.resolve().parent.parent
        real = root / "bin" / "nvcc"
        version = _run([str(real), "--version"]).strip()
        return {"root": str(root), "version": version}, [real]
    return _cached("nvcc", nvcc, compute, _is_identity, cache_file)


def _is_identity(value) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(k), str) for k in ("root", "version"))


def _find_cxx() -> Path:
    named = env.cxx()
    names = [named[1]] if named else ["g++", "c++", "clang++"]
    for name in names:
        found = shutil.which(name) if name else None
        if found:
            return Path(found).resolve()
    raise DSV4JITToolchainError(f"no host C++ compiler found (looked for {names}); install a C++20 compiler "
                                "(g++ or clang++) or set DSV4JIT_CXX or CXX to one")


def _cxx_version(cxx: Path, cache_file: Path) -> str:
    try:
        return _cached("cxx", cxx, lambda: (_run([str(cxx), "--version"]).strip(), []), lambda v: isinstance(v, str),
                       cache_file)
    except DSV4JITToolchainError as e:
        if (named := env.cxx()) is None:
            raise
        variable, value = named
        raise DSV4JITToolchainError(f"{variable}={value!r} names a compiler that does not run ({e}); set it to a "
                                    "C++20 compiler (g++ or clang++), or unset it") from None


@functools.lru_cache(maxsize=None)
def _toolchain_memo(need_cuda: bool, cache_file: Path, env_key: tuple) -> Toolchain:
    cxx = _find_cxx()
    if not need_cuda:
        return Toolchain(None, None, "", cxx, _cxx_version(cxx, cache_file))
    nvcc = _find_nvcc()
    ident = _nvcc_identity(nvcc, cache_file)
    root = Path(ident["root"])
    return Toolchain(root / "bin" / "nvcc", root, ident["version"], cxx, _cxx_version(cxx, cache_file))


def toolchain(need_cuda: bool = True, root: Path | None = None) -> Toolchain:
    """The toolchain for a build (memoised per process and per relevant env settings). Its identity
    is remembered in ``toolchain.json`` of the write root (`root`, default DSV4JIT_CACHE_DIR's)."""
    cache_file = (env.cache_dir() if root is None else root) / "toolchain.json"
    env_key = (env.nvcc(), env.cxx(), tuple(env.cuda_homes()), os.environ.get("PATH", ""))
    return _toolchain_memo(need_cuda, cache_file, env_key)


def reset() -> None:
    """Forget memoised toolchains and device arches (tests, or after changing env vars)."""
    _toolchain_memo.cache_clear()
    device_arch.cache_clear()
