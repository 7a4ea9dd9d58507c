"""Every ``DSV4JIT_*`` environment variable, read in one place (documented in docs/jit.md).

Values are read when used, not at import. Results derived from them are memoised per process
where a hot path needs it: the toolchain, device arches, loaded modules, and DSV4JIT_CHECK (see
``dsv4jit.set_checks`` to change checked mode at run time).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path


class SettingError(ValueError):
    """A ``DSV4JIT_*`` variable holds a value dsv4jit cannot use (the CLI reports it as a usage error)."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _number(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingError(f"{name} must be a number, got {raw!r}") from None


def cache_dir() -> Path:
    """Write root of the kernel cache."""
    if raw := os.environ.get("DSV4JIT_CACHE_DIR"):
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "dsv4jit"


def cache_path() -> list[Path]:
    """Extra read-only cache roots (colon separated), searched after the write root."""
    raw = os.environ.get("DSV4JIT_CACHE_PATH", "")
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p]


def no_compile() -> bool:
    return _flag("DSV4JIT_NO_COMPILE")


def force_rebuild() -> bool:
    return _flag("DSV4JIT_FORCE_REBUILD")


def cuda_arch() -> str | None:
    return os.environ.get("DSV4JIT_CUDA_ARCH") or None


def nvcc() -> str | None:
    return os.environ.get("DSV4JIT_NVCC") or None


def cuda_homes() -> list[str]:
    return [v for v in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if v]


def cxx() -> str | None:
    return os.environ.get("DSV4JIT_CXX") or os.environ.get("CXX") or None


def jobs() -> int | None:
    value = _number("DSV4JIT_JOBS", 0)
    return int(value) if value > 0 else None


def job_mem_gb() -> float:
    return _number("DSV4JIT_JOB_MEM_GB", 4.0)


def build_timeout() -> float:
    return _number("DSV4JIT_BUILD_TIMEOUT", 1800.0)


def lock_timeout() -> float:
    return _number("DSV4JIT_LOCK_TIMEOUT", 2 * build_timeout())


def lock_dir() -> Path | None:
    raw = os.environ.get("DSV4JIT_LOCK_DIR")
    return Path(raw).expanduser() if raw else None


def extra_cuda_flags() -> list[str]:
    return shlex.split(os.environ.get("DSV4JIT_EXTRA_CUDA_FLAGS", ""))


def nvcc_flag_variables() -> dict[str, str]:
    """NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS when set: nvcc itself adds them to every command line."""
    return {name: value for name in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS") if (value := os.environ.get(name))}


def lineinfo() -> bool:
    return _flag("DSV4JIT_LINEINFO")


def debug_build() -> bool:
    return _flag("DSV4JIT_DEBUG")


def disable_pdl() -> bool:
    return _flag("DSV4JIT_DISABLE_PDL")


def log_level() -> str:
    return os.environ.get("DSV4JIT_LOG_LEVEL", "INFO").upper()


def verbose_build() -> bool:
    return _flag("DSV4JIT_VERBOSE_BUILD")


def cache_fallback() -> str:
    value = os.environ.get("DSV4JIT_CACHE_FALLBACK", "error").strip().lower()
    if value not in ("error", "tmp"):
        raise SettingError(f"DSV4JIT_CACHE_FALLBACK must be 'error' or 'tmp', got {value!r}")
    return value


def checks() -> bool:
    """Checked mode: data-dependent input validation that needs a device sync."""
    return _flag("DSV4JIT_CHECK")


def all_settings() -> dict[str, str]:
    """The ``DSV4JIT_*`` variables and nvcc's flag variables currently set (for ``dsv4jit info``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSV4JIT_")} | nvcc_flag_variables()
