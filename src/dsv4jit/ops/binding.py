"""The ops' kernel calls: one function per kernel export, which both paths of an op use (the full path's
custom op and the eager fast path), so the tvm-ffi argument order is written once. Each function's
parameters after the loaded export `fn` are named as the C++ entry point's, which
tests/ops/test_bindings.py reads from the headers and compares, by name."""

from __future__ import annotations

from collections.abc import Callable

#: (kernel spec names, export, call function, parameters the call takes but the export does not)
CALLS: list[tuple[tuple[str, ...], str, Callable, tuple[str, ...]]] = []


def calls(kernels: tuple[str, ...], export: str, unbound: tuple[str, ...] = ()) -> Callable:
    """Declare the decorated function as the call of `export` of each of `kernels` (jit spec names)."""

    def register(call: Callable) -> Callable:
        CALLS.append((kernels, export, call, unbound))
        return call

    return register
