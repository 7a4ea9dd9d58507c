"""The public ops as torch custom ops (namespace ``dsv4jit``), so torch.compile and graph tracers see
one opaque op per kernel call instead of tracing into tvm-ffi (which they cannot).

An op's implementation takes only tensors and scalars (the public wrapper unpacks plans, checks
arguments and allocates outputs) and writes its results into tensors it is given:

    @library.custom_op("name", mutates_args=("out",))
    def _name(x: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        ...  # kernel (CUDA tensors) or torch reference (CPU tensors)

The decorated function is what the wrapper calls. Eagerly it calls the implementation directly: a
mutating custom op costs tens of µs of host time per call through the dispatcher (about 50 µs
measured), ten times what a decode kernel runs. While torch.compile traces, or under a dispatch
mode (fake tensors, make_fx, export), it calls
``torch.ops.dsv4jit.name``, whose fake implementation only describes outputs (none for an op that
only mutates its arguments).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Optional

import torch

NAMESPACE = "dsv4jit"


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack  # fake tensors, make_fx, non-strict export


def tracing() -> bool:
    """Whether torch.compile is tracing or a dispatch mode is active: the ops must then go through
    ``torch.ops.dsv4jit`` (their eager fast paths call the kernels directly otherwise)."""
    return _is_compiling() or bool(_dispatch_modes())


def _returns_none(impl: Callable) -> bool:
    return inspect.signature(impl).return_annotation in (None, "None")


def custom_op(name: str, *, mutates_args: tuple[str, ...], fake: Optional[Callable] = None):
    """Register `impl` as ``torch.ops.dsv4jit.<name>`` and return its dispatching caller.

    `mutates_args` names every tensor argument the implementation writes. `fake` computes output
    shapes from fake tensors; ops that return nothing need none.
    """

    def register(impl: Callable) -> Callable:
        if fake is None and not _returns_none(impl):
            raise TypeError(f"dsv4jit op {name!r} returns tensors and needs a fake implementation")
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=mutates_args)
        op.register_fake(fake or _no_outputs)
        overload = getattr(getattr(torch.ops, NAMESPACE), name).default

        def call(*args):
            if tracing():  # about 0.1 µs: this runs on every eager call
                return overload(*args)
            return impl(*args)

        call.__name__ = call.__qualname__ = impl.__name__
        call.__doc__ = impl.__doc__
        call.impl = impl  # for ops built from other ops' implementations (no dispatch in between)
        return call

    return register


def _no_outputs(*args, **kwargs) -> None:
    return None
