"""``compress_forward``: the ring compressors, c4 and c128 (contract §4). CUDA tensors run
csrc/compress/ring.cuh, CPU tensors reference/compress.py; ``is_online=True`` hands the call to the online
compressor (ops/online.py)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import arguments, geometry, library, runtime
from ..arguments import STATE_DTYPES
from ..family import Family, KernelChoice
from ..geometry import row_width
from ..plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan
from ..reference import compress as ref_compress
from . import common
from .online import compress_forward_online

_OP = "compress_forward"


def kernel(compress_ratio: int, head_dim: int, state: str, input: str, output: str) -> KernelChoice:
    """The variant a call runs (dtypes by kernel name: ``fp32``, ``bf16``, ``fp16``)."""
    return f"compress_c{compress_ratio}", {"head_dim": head_dim, "state": state, "input": input, "output": output}


FAMILY = Family("compress", lambda cfg: [kernel(ratio, hd, cfg.state, cfg.input, cfg.output)
                                          for ratio, hd in cfg.pairs()])


def check_ratio(op: str, plan, compress_ratio: int) -> None:
    """compress_ratio is 4 or 128, and the plan's."""
    try:
        geometry.check_ratio(compress_ratio)
    except ValueError as e:
        raise arguments.reworded(op, e, ("compress_ratio",)) from None
    if plan.compress_ratio != compress_ratio:
        raise ValueError(f"dsv4jit.{op}: argument 'plan' was built for compress_ratio {plan.compress_ratio}, "
                         f"got compress_ratio {compress_ratio}")


def ring_widths(op: str, message: str, head_dim: int, compress_ratio: int, kv_score_buffer, kv_score_input,
                ape) -> None:
    """After a failed call: ValueError naming head_dim when the ring rows do not have its width."""
    width = row_width(head_dim, compress_ratio)
    common.check_widths(op, message, head_dim, f"with compress_ratio {compress_ratio}",
                        {"kv_score_buffer": (kv_score_buffer, width), "kv_score_input": (kv_score_input, width),
                         "ape": (ape, head_dim)})


def compress_forward(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                     plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *, head_dim: int,
                     compress_ratio: int, out: Optional[torch.Tensor] = None,
                     is_online: bool = False) -> torch.Tensor:
    """Softmax-pool every compress event of `plan` and store this step's tokens in the state ring.

    kv_score_buffer: state pool ``[num_pages, R, last_dim]`` (or flat ``[rows, last_dim]``), fp32 or
    bf16, updated in place; last_dim = 4·head_dim (c4) or 2·head_dim (c128).
    kv_score_input: ``[tokens, last_dim]`` (prefill: ragged; decode: one row per request).
    ape: ``[8, head_dim]`` (c4, rearranged) or ``[128, head_dim]``; converted to the input dtype.
    Returns ``[plan[1].shape[0], head_dim]`` (input dtype unless `out` is given): prefill row i pairs
    with plan_c row i (invalid rows untouched); decode rows off a compress boundary are zero.
    """
    plan = as_plan(_OP, plan)
    if type(head_dim) is not int or type(compress_ratio) is not int or type(is_online) is not bool:
        common.scalars(_OP, {"head_dim": head_dim, "compress_ratio": compress_ratio}, {"is_online": is_online})
    if is_online:
        return compress_forward_online(kv_score_buffer, kv_score_input, ape, plan, head_dim=head_dim,
                                       compress_ratio=compress_ratio, out=out)
    check_ratio(_OP, plan, compress_ratio)
    try:
        ape = common.ape_as(_OP, ape, kv_score_input.dtype)
        # on the input's device, so that a device mix is the caller's; `out` stays what the caller passed
        rows = torch.empty((plan[1].shape[0], head_dim), dtype=kv_score_input.dtype,
                           device=kv_score_input.device) if out is None else out
        compress_op(kv_score_buffer, kv_score_input, ape, plan[1], common.write_rows(plan), rows, head_dim,
                    compress_ratio, plan.is_decode)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(_OP, e, locals(), ("kv_score_buffer", "kv_score_input", "ape"), ("out",),
                            lambda text: ring_widths(_OP, text, head_dim, compress_ratio, kv_score_buffer,
                                                     kv_score_input, ape))
    return rows


@library.custom_op("compress", mutates_args=("kv_score_buffer", "out"))
def compress_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], out: torch.Tensor, head_dim: int,
                compress_ratio: int, is_decode: bool) -> None:
    """compress_forward on unpacked plan tensors (plan_rows: plan_c or plan_d; plan_w: None in decode)."""
    kv_score_buffer = common.state_pool(kv_score_buffer, compress_ratio, row_width(head_dim, compress_ratio))
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, out, plan_rows, plan_w)
    if device is None:
        _reference(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, head_dim, compress_ratio, out)
        return
    name, params = kernel(compress_ratio, head_dim,
                          common.dtype_name(kv_score_buffer, "kv_score_buffer", _OP, STATE_DTYPES),
                          common.dtype_name(kv_score_input, "kv_score_input", _OP), common.dtype_name(out, "out", _OP))
    fn = runtime.function(name, "decode" if is_decode else "prefill", device, **params)
    status = runtime.status_word(device)
    if is_decode:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, out, status)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status)
    runtime.raise_status(status, _OP, name, device, params)


def _reference(buffer, inputs, ape, plan_rows, plan_w, head_dim, ratio, out) -> None:
    if plan_w is None:
        ref_compress.compress_decode(buffer, inputs, ape, plan_rows, head_dim=head_dim, compress_ratio=ratio, out=out)
    else:
        ref_compress.compress_prefill(buffer, inputs, ape, plan_rows, plan_w, head_dim=head_dim, compress_ratio=ratio,
                                      out=out)
