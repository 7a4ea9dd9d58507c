"""Exceptions: a rejected argument of an op, and the JIT loader's and the settings' errors."""

from __future__ import annotations


class ArgumentError(ValueError, RuntimeError):
    """A rejected argument value: a bad value, shape, size, limit or layout, named in the message.
    Also a RuntimeError, as the reference's argument checks are (they surface through tvm-ffi as
    RuntimeError): a caller's ``except RuntimeError`` around the reference's call keeps working.
    The kernels throw it as the tvm-ffi error kind ``DSV4JITArgumentError`` (common/tensor_check.h)."""


class ArgumentTypeError(TypeError, RuntimeError):
    """A rejected argument type: a dtype, a device, a non-tensor or a plan of another class; a
    RuntimeError too, as `ArgumentError` is. The kernels' kind: ``DSV4JITArgumentTypeError``."""


def argument_error(error: Exception, text: str) -> Exception:
    """`error`, met while checking arguments, reworded as `text`: a ValueError or TypeError becomes
    the argument error of its kind (torch's and Python's own included), another keeps its class."""
    if isinstance(error, TypeError):
        return ArgumentTypeError(text)
    return ArgumentError(text) if isinstance(error, ValueError) else type(error)(text)


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
