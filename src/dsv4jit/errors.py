"""Exceptions raised by the JIT loader and the settings. Kernel argument errors are plain ValueError/TypeError."""

from __future__ import annotations


class DSV4JITError(RuntimeError):
    """Base class of loader errors."""


class DSV4JITBuildError(DSV4JITError):
    """A kernel variant failed to compile or to load after compiling."""

    def __init__(self, variant: str, arch: str, first_error: str, log_path: str, command: str):
        self.variant, self.arch, self.first_error = variant, arch, first_error
        self.log_path, self.command = log_path, command
        super().__init__(
            f"dsv4jit: building {variant} for {arch} failed: {first_error}\n"
            f"  full log: {log_path}\n"
            f"  reproduce: {command}"
        )


class DSV4JITCacheMiss(DSV4JITError):
    """DSV4JIT_NO_COMPILE=1 and the variant is in no cache root."""


class DSV4JITToolchainError(DSV4JITError):
    """No usable CUDA compiler (or host compiler) was found, or no GPU to target: none visible, or
    one of an arch the kernels do not support."""


class DSV4JITCacheError(DSV4JITError):
    """The cache directory cannot be written (permissions, read-only, disk full)."""


class DSV4JITSettingError(DSV4JITError):
    """A ``DSV4JIT_*`` variable (or another variable dsv4jit reads) holds a value it cannot use; the
    message names the variable, the value and what it accepts."""


class DSV4JITLockTimeout(DSV4JITError):
    """Waited longer than DSV4JIT_LOCK_TIMEOUT for another process's build."""
