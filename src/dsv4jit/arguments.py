"""Argument checks shared by the public functions and the torch references: one module, so that
a rule (the dtypes a state pool may have, an index range, a tensor's shape) is written once.

* Scalars and argument types (`integer`, `flag`, `positive`, `tensors`, `explain`), and a device
  mix (`one_device`): what the kernels' own checks (csrc/common/tensor_check.h) cannot see or name. Messages take their form:
  ``dsv4jit.<function>: argument '<name>' must be <expected>, got <actual>``.
* Dtypes (`FLOAT_DTYPES`, `STATE_DTYPES`, `dtype_key`): what the kernels take, by our dtype names.
* Tensors (`TensorCheck`): the rules and messages of tensor_check.h for the CPU paths that stand in
  for a kernel.
* Data (`dtype_in`, `contiguous`, `in_range`, `distinct`, `finite`): the references' checks, whose messages
  start with the argument's name (``plan_w: write_loc must lie in ...``); `reworded` turns such a message
  into the public function's (``dsv4jit.<function>: argument 'plan' (plan_w): ...``).

Hot paths pay for no more than a type test per scalar: tensor arguments are checked by the kernel
call (or the CPU path) that uses them, and when that fails with a TypeError or AttributeError
(a list where a tensor belongs, say), `explain` names the argument of the wrong type instead.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch

from .errors import ArgumentError, ArgumentTypeError, argument_error


def _fail(op: str, name: str, expected: str, value) -> ArgumentTypeError:
    return ArgumentTypeError(f"dsv4jit.{op}: argument '{name}' must be {expected}, "
                             f"got {type(value).__name__} {value!r}")


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


def positive(op: str, name: str, value) -> float:
    """`value` as a finite float > 0 (an int or float, not a bool): an epsilon that keeps an
    all-zero row finite (with 0 its RMSNorm is 0 · inf = NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(op, name, "a float", value)
    if not 0 < value < math.inf:
        raise ArgumentError(f"dsv4jit.{op}: argument '{name}' must be a finite number > 0 (0 turns an all-zero row "
                            f"into NaN), got {value!r}")
    return float(value)


def tensors(op: str, named: Mapping[str, object], optional: Iterable[str] = ()) -> None:
    """TypeError naming the first entry of `named` that is not a tensor (None allowed for `optional`)."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) and not (value is None and name in optional):
            expected = "a torch.Tensor or None" if name in optional else "a torch.Tensor"
            raise ArgumentTypeError(f"dsv4jit.{op}: argument '{name}' must be {expected}, got {type(value).__name__}")


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


def one_device(op: str, named: Mapping[str, torch.Tensor]) -> None:
    """After a failed call: TypeError naming each tensor of `named` (what the caller passed, in its
    order) and its device, when they are not all on one device."""
    if len({t.device for t in named.values()}) > 1:
        placed = ", ".join(f"{name} on {t.device}" for name, t in named.items())
        raise ArgumentTypeError(f"dsv4jit.{op}: tensors on different devices: {placed}")


@contextmanager
def explained(op: str, given: Mapping[str, object], tensor_names: Iterable[str] = (), optional: Iterable[str] = (),
              int_names: Iterable[str] = (), flag_names: Iterable[str] = ()) -> Iterator[None]:
    """A block whose TypeError or AttributeError is explained (`explain`) before it propagates."""
    try:
        yield
    except (TypeError, AttributeError):
        explain(op, given, tensor_names, optional, int_names, flag_names)
        raise


# ----------------------------------------------------------------------------------------------
# Dtypes

_DTYPE_NAMES = {torch.float32: ("fp32", "float32"), torch.bfloat16: ("bf16", "bfloat16"),
                torch.float16: ("fp16", "float16")}
#: Inputs and outputs of the compressors (kv_score_input, out).
FLOAT_DTYPES = tuple(_DTYPE_NAMES)
#: State pools, and every row the store step reads.
STATE_DTYPES = (torch.float32, torch.bfloat16)


def dtype_names(allowed: Iterable[torch.dtype]) -> str:
    """``float32, bfloat16 or float16``."""
    words = [str(d).removeprefix("torch.") for d in allowed]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def dtype_key(dtype: torch.dtype, op: str, arg: str, allowed: tuple = FLOAT_DTYPES) -> str:
    """The kernel-parameter name of `dtype` (``fp32``, ``bf16``, ``fp16``); TypeError naming the
    argument if it is not `allowed`."""
    if dtype in allowed:
        return _DTYPE_NAMES[dtype][0]
    raise ArgumentTypeError(f"dsv4jit.{op}: argument '{arg}': dtype must be {dtype_names(allowed)}, got {dtype}")


# ----------------------------------------------------------------------------------------------
# Tensors, as the kernels check them


class TensorCheck:
    """The checks of csrc/common/tensor_check.h for a CPU path: shape (symbolic sizes bind on first
    use and must match later), dtype, contiguity, alignment; the same messages."""

    def __init__(self, op: str):
        self.op = op
        self.sizes: dict[str, tuple[int, str]] = {}

    def _fail(self, exc, arg: str, what: str):
        raise exc(f"dsv4jit.{self.op}: argument '{arg}': {what}")

    def __call__(self, arg: str, t: torch.Tensor, shape: tuple, dtypes: tuple, align: int = 16) -> None:
        if t.dim() != len(shape):
            self._fail(ArgumentError, arg, f"must have {len(shape)} dimensions, got {t.dim()} (shape {list(t.shape)})")
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            if isinstance(want, str):
                bound, by = self.sizes.setdefault(want, (got, arg))
                if bound != got:
                    self._fail(ArgumentError, arg, f"dim {i} ('{want}') must be {bound} (as in '{by}'), got {got}")
            elif want != got:
                self._fail(ArgumentError, arg, f"dim {i} must be {want}, got {got} (shape {list(t.shape)})")
        if t.dtype not in dtypes:
            self._fail(ArgumentTypeError, arg, f"dtype must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if not t.is_contiguous():
            self._fail(ArgumentError, arg, "must be contiguous (row-major)")
        if t.data_ptr() % align:
            self._fail(ArgumentError, arg, f"data pointer must be {align}-byte aligned")

    def bound(self, name: str) -> int:
        """The value a symbolic size was bound to."""
        return self.sizes[name][0]


# ----------------------------------------------------------------------------------------------
# The references' checks: messages lead with the argument's name


def dtype_in(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype], why: str = "") -> None:
    """TypeError unless `t`'s dtype is one of `allowed` (`why`: a condition, e.g. ``(online c128)``)."""
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise ArgumentTypeError(f"{name}: expected dtype {dtype_names(allowed)}{why}, got {t.dtype}")


def contiguous(name: str, t: torch.Tensor) -> None:
    """ValueError unless `t` is contiguous (row-major): the kernels refuse any other layout of a tensor
    they read or write by rows (tensor_check.h), so a CPU call must too, or it would pass where the
    same call on the GPU fails."""
    if not t.is_contiguous():
        raise ArgumentError(f"{name}: must be contiguous (row-major), got strides {list(t.stride())}")


def in_range(name: str, what: str, values, size: int, of: str = "") -> None:
    """ValueError unless every entry of `values` (a tensor or an int) lies in [0, size); `of` names
    what the range indexes. Advanced indexing wraps negative indices silently, and a malformed plan
    must not read a wrong row."""
    where = f" ({of})" if of else ""
    if isinstance(values, int):
        if not 0 <= values < size:
            raise ArgumentError(f"{name}: {what} must lie in [0, {size}){where}, got {values}")
    elif values.numel() and (int(values.min()) < 0 or int(values.max()) >= size):
        raise ArgumentError(f"{name}: {what} must lie in [0, {size}){where}, got range [{int(values.min())}, "
                            f"{int(values.max())}]")


def distinct(name: str, values: torch.Tensor, what: str) -> None:
    """ValueError if two entries of `values` are equal (`what`: what two such rows do)."""
    if values.numel() != torch.unique(values).numel():
        raise ArgumentError(f"{name}: two rows {what}")


def finite(name: str, t: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """ValueError unless every value of `t` is finite, naming the first NaN or infinity by its index
    (`rows`: which row of the argument each row of `t` is, where `t` holds some of them). A NaN in
    an input would reach the state and the cache without a word (integer tensors hold none)."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        index = bad.nonzero()[0].tolist()
        value = t[tuple(index)].item()
        if rows is not None:
            index[0] = int(rows[index[0]])
        raise ArgumentError(f"{name}: must hold finite values only (no NaN or infinity), got {value} at {index}")


_NAMED_OP = re.compile(r"dsv4jit\.[\w.]+")


def reworded(op: str, error: Exception, names: Iterable[str], fields: Mapping[str, str] | None = None) -> Exception:
    """`error` as public function `op` reports it: a message already naming a function gets `op`'s
    name; one leading with an argument in `names` names that argument; one leading with a key of
    `fields` (a field of an argument, as ``plan_w`` of ``plan``) names the argument and the field."""
    text = str(error)
    if text.startswith("dsv4jit."):
        text = _NAMED_OP.sub(f"dsv4jit.{op}", text, count=1)
    else:
        name = re.match(r"\w*", text).group()
        if fields and name in fields:
            text = f"dsv4jit.{op}: argument '{fields[name]}' ({name}){text[len(name):]}"
        elif name and name in names:
            text = f"dsv4jit.{op}: argument '{name}'{text[len(name):]}"
        else:
            text = f"dsv4jit.{op}: {text}"
    return argument_error(error, text)
