"""What the op modules share: where a call runs, the kernels' dtype names, the state-pool view, the
rope table, and the public wording of errors. Imports nothing of the other op modules."""

from __future__ import annotations

from typing import Optional

import torch

from .. import arguments, geometry
from ..arguments import FLOAT_DTYPES
from ..errors import ArgumentError, ArgumentTypeError
from ..kv_layout import KVLayout

#: Fields of a plan a reference names as its own argument (``plan_w: write_loc must ...``).
_PLAN_FIELDS = {name: "plan" for name in ("plan_c", "plan_w", "plan_d")}
_ROPE_PAIRS = geometry.ROPE_DIM // 2


def cuda_device(*tensors: Optional[torch.Tensor]) -> Optional[torch.device]:
    """Kernels run when any tensor is on a GPU (their checks then name a tensor left on the CPU, so a
    device mix is an error, never a silent fallback to the reference); None when all are on the CPU."""
    for t in tensors:
        if t is not None and t.is_cuda:  # not t.device.type: that builds a device object per tensor
            return t.device
    return None


def dtype_name(t: torch.Tensor, arg: str, op: str, allowed: tuple = FLOAT_DTYPES) -> str:
    """The kernel-parameter name of `t`'s dtype; TypeError naming `arg` if it is not `allowed`."""
    return arguments.dtype_key(t.dtype, op, arg, allowed)


def state_pool(buffer: torch.Tensor, rows_per_page: int, width: int) -> torch.Tensor:
    """A flat contiguous ``[rows, width]`` state pool as the kernels' ``[pages, rows_per_page, width]``."""
    if buffer.dim() == 2 and buffer.shape[-1] == width and buffer.is_contiguous():
        return buffer.view(-1, rows_per_page, width)
    return buffer


def scalars(op: str, ints: dict, flags: dict) -> None:
    """TypeError naming an int or bool argument of another type (the callers test the types first)."""
    for name, value in ints.items():
        arguments.integer(op, name, value)
    for name, value in flags.items():
        arguments.flag(op, name, value)


def ape_as(op: str, ape: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ape in the kernels' dtype (the consumer converts it the same way)."""
    if not ape.dtype.is_floating_point:
        raise ArgumentTypeError(f"dsv4jit.{op}: argument 'ape': dtype must be a floating-point type, got {ape.dtype}")
    return ape if ape.dtype == dtype else ape.to(dtype)


def layout_value(op: str, layout) -> str:
    """The KVLayout value of `layout` (a KVLayout, or its name in any case); ValueError naming the argument."""
    try:
        return KVLayout.parse(layout).value
    except ValueError as e:
        raise arguments.reworded(op, e, ("layout",)) from None


def store_format(op: str, head_dim: int, use_fp4: bool, bf16_store: bool, head_dim_arg: str, layout: str = "v4",
                 fp8_2buff: bool = False) -> str:
    """geometry.store_format, its error worded as op's (`head_dim_arg`: where head_dim came from,
    ``head_dim`` or ``kv: head_dim (kv.shape[1])``; `layout`: a KVLayout value)."""
    try:
        return geometry.store_format(head_dim, use_fp4=use_fp4, bf16_store=bf16_store, layout=layout,
                                     fp8_2buff=fp8_2buff, head_dim_arg=head_dim_arg)
    except ValueError as e:
        raise arguments.reworded(op, e, ("use_fp4", "bf16_store", "fp8_2buff", "layout", "head_dim", "kv")) from None


def check_rope_pool(op: str, fp8_2buff: bool, kvcache_rope: Optional[torch.Tensor]) -> None:
    """kvcache_rope is given exactly with fp8_2buff (the two pools): ValueError naming it otherwise."""
    if (kvcache_rope is not None) != fp8_2buff:
        raise ArgumentError(f"dsv4jit.{op}: argument 'kvcache_rope' must be "
                            + ("the pool of the bf16 rope rows with fp8_2buff=True, got None" if fp8_2buff else
                            "None without fp8_2buff (only the two-pool store has a rope pool), got a tensor"))


def freq_table(freq_cis: torch.Tensor) -> torch.Tensor:
    """complex64 [max_pos, 32] -> fp32 [max_pos, 64] of interleaved (cos, sin): a view, no copy.

    The custom ops take this real table: inductor cannot lower a mutating op with a complex operand.
    """
    if freq_cis.is_complex():
        return torch.view_as_real(freq_cis).flatten(-2)
    return freq_cis


def complex_freq(freq: torch.Tensor) -> torch.Tensor:
    """The complex view of a real (cos, sin) table, for the torch references."""
    return torch.view_as_complex(freq.unflatten(-1, (-1, 2)))


def check_freq(op: str, freq_cis: torch.Tensor) -> None:
    """After a failed call: freq_cis reported as the user passed it when it has neither accepted
    form (the checks downstream see the real view `freq_table` made of it)."""
    if freq_cis.dim() == 2 and ((freq_cis.dtype == torch.complex64 and freq_cis.shape[1] == _ROPE_PAIRS)
                                or (freq_cis.dtype == torch.float32 and freq_cis.shape[1] == 2 * _ROPE_PAIRS)):
        return
    error = ArgumentTypeError if freq_cis.dtype not in (torch.complex64, torch.float32) else ArgumentError
    raise error(f"dsv4jit.{op}: argument 'freq_cis' must be complex64 [max_pos, {_ROPE_PAIRS}] or float32 "
                f"[max_pos, {2 * _ROPE_PAIRS}] (interleaved cos, sin), got {list(freq_cis.shape)} {freq_cis.dtype}")


def check_widths(op: str, message: str, head_dim: int, context: str, rows: dict) -> None:
    """After a failed call (`message`, unless it is about head_dim already): ValueError naming head_dim
    when a tensor's rows do not have the width it implies (`rows`: name -> (tensor, width))."""
    if "argument 'head_dim'" in message:
        return
    for name, (t, width) in rows.items():
        if t.dim() and t.shape[-1] != width:
            factor = "head_dim" if width == head_dim else f"{width // head_dim}·head_dim"
            raise ArgumentError(f"dsv4jit.{op}: argument 'head_dim' is {head_dim}, but the rows of '{name}' have "
                                f"{t.shape[-1]} values (shape {list(t.shape)}); {context} they have {factor} = {width}")


def public_error(op: str, error: Exception, given: dict, names: tuple, optional: tuple = (), explain=None):
    """Raise `error`, met by public op `op`, as what the user passed: an argument of the wrong type
    (arguments.explain), tensors on more than one device (each passed one named, the plan's rows as
    `plan`), then what `explain(message)` finds (a head_dim the tensors do not have, a freq_cis of
    another form), else the error itself under the op's name. A torch reference names its own
    argument (`plan_w`, a field of the op's plan), a step of a fused op names that step: both become
    the op and its argument. Only failing calls get here, so the happy path pays nothing."""
    arguments.explain(op, given, names, optional)
    tensors = {name: given[name][1] if name == "plan" else given[name]  # given: the op's locals, arguments first
               for name in given if name in names or name == "plan" or (name in optional and given[name] is not None)}
    arguments.one_device(op, tensors)
    if explain is not None:
        explain(str(error))
    if not isinstance(error, (ValueError, TypeError)):
        raise error
    raise arguments.reworded(op, error, given, _PLAN_FIELDS) from None
