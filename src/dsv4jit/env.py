"""Every ``DSV4JIT_*`` environment variable, read and parsed in one place (documented in docs/jit.md).

Values are read when used, not at import, and parsed strictly: a value outside what a variable
accepts raises `DSV4JITSettingError` naming the variable, the value and the accepted values, never
a silent default. Results derived from them are memoised per process where a hot path needs it:
the toolchain, device arches, loaded modules, and DSV4JIT_CHECK (see ``dsv4jit.set_checks`` to
change checked mode at run time).
"""

from __future__ import annotations

import math
import os
import shlex
from pathlib import Path

from .errors import DSV4JITSettingError

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Seconds one compiler run may take. A variant compiles in seconds to about a minute, so a hung
#: compiler, which every first-use caller of that variant waits on, is found in minutes, with a wide
#: margin for a busy machine.
DEFAULT_BUILD_TIMEOUT = 600.0


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _flag(name: str) -> bool:
    """Unset or empty: off."""
    value = _raw(name).lower()
    if value in TRUE:
        return True
    if value in FALSE or not value:
        return False
    raise DSV4JITSettingError(f"{name}={os.environ[name]!r} is not a boolean: use one of "
                              f"{', '.join(TRUE)} (on) or {', '.join(FALSE)} (off), any case")


def _positive(name: str, default: float, integer: bool = False) -> float:
    """A finite number > 0 (an integer if `integer`); unset or empty: `default`."""
    raw = _raw(name)
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        kind = "a whole number" if integer else "a number"
        raise DSV4JITSettingError(f"{name}={os.environ[name]!r} is not valid: it must be {kind} greater than 0")
    return value


def _path(name: str, raw: str) -> Path:
    try:
        return Path(raw).expanduser()
    except RuntimeError as e:  # "~someone" of an unknown user, or no home folder
        raise DSV4JITSettingError(f"{name}={raw!r} cannot be used as a path: {e}") from None


def cache_dir() -> Path:
    """Write root of the kernel cache."""
    if raw := os.environ.get("DSV4JIT_CACHE_DIR"):
        return _path("DSV4JIT_CACHE_DIR", raw)
    return _path("XDG_CACHE_HOME", os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "dsv4jit"


def cache_path() -> list[Path]:
    """Extra read-only cache roots (colon separated), searched after the write root."""
    raw = os.environ.get("DSV4JIT_CACHE_PATH", "")
    return [_path("DSV4JIT_CACHE_PATH", p) for p in raw.split(os.pathsep) if p]


def prebuilt() -> bool:
    """Whether the installed prebuilt kernels are searched (DSV4JIT_PREBUILT; unset or empty: on)."""
    return _flag("DSV4JIT_PREBUILT") if _raw("DSV4JIT_PREBUILT") else True


def no_compile() -> bool:
    return _flag("DSV4JIT_NO_COMPILE")


def force_rebuild() -> bool:
    return _flag("DSV4JIT_FORCE_REBUILD")


def cuda_arch() -> str | None:
    """The text of DSV4JIT_CUDA_ARCH (parsed by ``toolchain.forced_arch``)."""
    return _raw("DSV4JIT_CUDA_ARCH") or None


def nvcc() -> str | None:
    return os.environ.get("DSV4JIT_NVCC") or None


def cuda_homes() -> list[tuple[str, str]]:
    """(variable, value) of CUDA_HOME and CUDA_PATH, those that are set, in that order."""
    return [(name, value) for name in ("CUDA_HOME", "CUDA_PATH") if (value := os.environ.get(name))]


def cxx() -> tuple[str, str] | None:
    """(variable, value) of the first of DSV4JIT_CXX and CXX that is set, or None."""
    return next(((name, value) for name in ("DSV4JIT_CXX", "CXX") if (value := os.environ.get(name))), None)


def jobs() -> int | None:
    """DSV4JIT_JOBS, or None (unset: the memory-aware default)."""
    return int(_positive("DSV4JIT_JOBS", 0, integer=True)) or None


def job_mem_gb() -> float:
    return _positive("DSV4JIT_JOB_MEM_GB", 4.0)


def build_timeout() -> float:
    return _positive("DSV4JIT_BUILD_TIMEOUT", DEFAULT_BUILD_TIMEOUT)


def lock_timeout() -> float:
    return _positive("DSV4JIT_LOCK_TIMEOUT", 2 * build_timeout())


def lock_dir() -> Path | None:
    raw = os.environ.get("DSV4JIT_LOCK_DIR")
    return _path("DSV4JIT_LOCK_DIR", raw) if raw else None


def extra_cuda_flags() -> list[str]:
    raw = os.environ.get("DSV4JIT_EXTRA_CUDA_FLAGS", "")
    try:
        return shlex.split(raw)
    except ValueError as e:  # an unclosed quote
        raise DSV4JITSettingError(f"DSV4JIT_EXTRA_CUDA_FLAGS={raw!r} cannot be split into words as a shell "
                                  f"would ({e})") from None


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
    value = _raw("DSV4JIT_LOG_LEVEL").upper() or "INFO"
    if value not in LOG_LEVELS:
        raise DSV4JITSettingError(f"DSV4JIT_LOG_LEVEL={os.environ['DSV4JIT_LOG_LEVEL']!r} is not a log level: use "
                                  f"one of {', '.join(LOG_LEVELS)}, any case")
    return value


def verbose_build() -> bool:
    return _flag("DSV4JIT_VERBOSE_BUILD")


def cache_fallback() -> str:
    value = _raw("DSV4JIT_CACHE_FALLBACK").lower() or "error"
    if value not in ("error", "tmp"):
        raise DSV4JITSettingError(f"DSV4JIT_CACHE_FALLBACK={os.environ['DSV4JIT_CACHE_FALLBACK']!r} is not valid: "
                                  "use error or tmp")
    return value


def checks() -> bool:
    """Checked mode: data-dependent input validation that needs a device sync."""
    return _flag("DSV4JIT_CHECK")


def all_settings() -> dict[str, str]:
    """The ``DSV4JIT_*`` variables and nvcc's flag variables currently set (for ``dsv4jit info``)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DSV4JIT_")} | nvcc_flag_variables()
