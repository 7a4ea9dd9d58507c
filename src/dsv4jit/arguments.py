"""Python-level argument checks of the public functions: what the kernels' own checks
(csrc/common/tensor_check.h) cannot see or name. Messages take their form:
``dsv4jit.<function>: argument '<name>' must be <expected>, got <actual>``.

Hot paths pay for no more than a type test per scalar: tensor arguments are checked by the kernel
call (or the CPU path) that uses them, and when that fails with a TypeError or AttributeError
(a list where a tensor belongs, say), `explain` names the argument of the wrong type instead.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch


def _fail(op: str, name: str, expected: str, value) -> TypeError:
    return TypeError(f"dsv4jit.{op}: argument '{name}' must be {expected}, got {type(value).__name__} {value!r}")


def integer(op: str, name: str, value) -> int:
    """`value` as an int: an int or another integer type (numpy, a 0-d integer tensor), not a bool or float."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise _fail(op, name, "an int", value) from None


def flag(op: str, name: str, value) -> bool:
    """`value` as a bool: a bool, or the int 0 or 1."""
    if type(value) is bool:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise _fail(op, name, "a bool", value)


def nonnegative(op: str, name: str, value) -> float:
    """`value` as a finite float >= 0 (an int or float, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(op, name, "a float", value)
    if not 0 <= value < math.inf:
        raise ValueError(f"dsv4jit.{op}: argument '{name}' must be a finite number >= 0, got {value!r}")
    return float(value)


def tensors(op: str, named: Mapping[str, object], optional: Iterable[str] = ()) -> None:
    """TypeError naming the first entry of `named` that is not a tensor (None allowed for `optional`)."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) and not (value is None and name in optional):
            expected = "a torch.Tensor or None" if name in optional else "a torch.Tensor"
            raise TypeError(f"dsv4jit.{op}: argument '{name}' must be {expected}, got {type(value).__name__}")


def explain(op: str, given: Mapping[str, object], tensor_names: Iterable[str] = (), optional: Iterable[str] = (),
            int_names: Iterable[str] = (), flag_names: Iterable[str] = ()) -> None:
    """After a failed call: raise the TypeError that names an argument in `given` (the caller's
    locals) of a wrong type, tensors first, then ints, then flags, each in the order given; return
    if all are fine, so that the caller re-raises the original error (a dtype the kernel rejected,
    say)."""
    tensors(op, {name: given[name] for name in (*tensor_names, *optional)}, optional)
    for name in int_names:
        integer(op, name, given[name])
    for name in flag_names:
        flag(op, name, given[name])


@contextmanager
def explained(op: str, given: Mapping[str, object], tensor_names: Iterable[str] = (), optional: Iterable[str] = (),
              int_names: Iterable[str] = (), flag_names: Iterable[str] = ()) -> Iterator[None]:
    """A block whose TypeError or AttributeError is explained (`explain`) before it propagates."""
    try:
        yield
    except (TypeError, AttributeError):
        explain(op, given, tensor_names, optional, int_names, flag_names)
        raise
