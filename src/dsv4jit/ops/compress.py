"""``compress_forward``: the ring compressors, c4 and c128 (contract §4), and with ``is_online=True``
the online c128 one (ops/online.py): one path over the compressor kinds of ops/compressor.py. CUDA
tensors run csrc/compress/ring.cuh (online.cuh), CPU tensors reference/compress.py (online.py).

Eager calls of a signature seen before take the fast path: one dict lookup, then the kernel call.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import arguments, geometry, library, runtime
from ..errors import ArgumentError
from ..family import Family, KernelChoice
from ..geometry import RATIOS, row_width
from ..plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan, check_batch
from ..reference import compress as ref_compress
from . import binding, common, compressor, online

_OP = "compress_forward"


def kernel(compress_ratio: int, head_dim: int, state: str, input: str, output: str) -> KernelChoice:
    """The variant a call runs (dtypes by kernel name: ``fp32``, ``bf16``, ``fp16``)."""
    return f"compress_c{compress_ratio}", {"head_dim": head_dim, "state": state, "input": input, "output": output}


FAMILY = Family("compress", lambda cfg: [kernel(ratio, hd, cfg.state, cfg.input, cfg.output)
                                          for ratio, hd in cfg.pairs() if ratio in RATIOS])


def check_ratio(op: str, plan, compress_ratio: int, head_dim: int = 0, kv_score_input=None) -> None:
    """compress_ratio is 4 or 128, and the plan's (head_dim and the input: Kind.check's other arguments,
    which the ring compressor's kernels check)."""
    try:
        geometry.check_ratio(compress_ratio)
    except ValueError as e:
        raise arguments.reworded(op, e, ("compress_ratio",)) from None
    if plan.compress_ratio != compress_ratio:
        raise ArgumentError(f"dsv4jit.{op}: argument 'plan' was built for compress_ratio {plan.compress_ratio}, "
                            f"got compress_ratio {compress_ratio}")


def ring_widths(op: str, message: str, head_dim: int, compress_ratio: int, kv_score_buffer, kv_score_input,
                ape) -> None:
    """After a failed call: ValueError naming head_dim when the ring rows do not have its width."""
    width = row_width(head_dim, compress_ratio)
    common.check_widths(op, message, head_dim, f"with compress_ratio {compress_ratio}",
                        {"kv_score_buffer": (kv_score_buffer, width), "kv_score_input": (kv_score_input, width),
                         "ape": (ape, head_dim)})


def _reference(buffer, inputs, ape, plan_rows, plan_w, head_dim, ratio, out) -> None:
    if plan_w is None:
        ref_compress.compress_decode(buffer, inputs, ape, plan_rows, head_dim=head_dim, compress_ratio=ratio, out=out)
    else:
        ref_compress.compress_prefill(buffer, inputs, ape, plan_rows, plan_w, head_dim=head_dim, compress_ratio=ratio,
                                      out=out)


@binding.calls(("compress_c4", "compress_c128"), "prefill")
def run_prefill(fn, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status, reads_state) -> None:
    fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status, reads_state)


RING = compressor.Kind(
    check=check_ratio, kernel=kernel, rows_per_page=lambda ratio: ratio, width=row_width,
    row_dtype=lambda input_dtype: input_dtype, widths=ring_widths, reference=_reference, run_prefill=run_prefill)

_FAST = runtime.call_cache()


def compress_forward(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                     plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *, head_dim: int,
                     compress_ratio: int, out: Optional[torch.Tensor] = None,
                     is_online: bool = False) -> torch.Tensor:
    """Softmax-pool every compress event of `plan` and store this step's tokens in the state ring.

    kv_score_buffer: state pool ``[num_pages, R, last_dim]`` (or flat ``[rows, last_dim]``), fp32 or
    bf16, updated in place; last_dim = 4·head_dim (c4) or 2·head_dim (c128).
    kv_score_input: ``[tokens, last_dim]`` (prefill: ragged; decode: one row per request).
    ape: ``[8, head_dim]`` (c4, rearranged) or ``[128, head_dim]``; converted to the input dtype.
    Returns ``[plan.plan_rows.shape[0], head_dim]`` (input dtype unless `out` is given): prefill row i pairs
    with plan_c row i (invalid rows untouched); decode rows off a compress boundary are zero.

    With ``is_online=True`` the online c128 compressor runs instead (ops/online.py): state
    ``[rows, 1, 3·head_dim]`` (or flat), an online plan, fp32 input, ape and output.
    """
    if type(head_dim) is int and type(compress_ratio) is int and not library.tracing():
        try:
            launch = _FAST[_fast_key(plan, head_dim, compress_ratio, is_online, kv_score_buffer, kv_score_input, ape,
                                     out)]
            return launch(kv_score_buffer, kv_score_input, ape, plan, out)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    return _compress_forward(kv_score_buffer, kv_score_input, ape, plan, head_dim, compress_ratio, out, is_online)


def _fast_key(plan, head_dim: int, compress_ratio: int, is_online: bool, buffer: torch.Tensor, inputs: torch.Tensor,
              ape: torch.Tensor, out: Optional[torch.Tensor]) -> tuple:
    """What picks a call's launcher."""
    return (plan.__class__, head_dim, compress_ratio, is_online, buffer.dtype, inputs.dtype, ape.dtype, inputs.device,
            out is None or out.dtype)


def _compress_forward(kv_score_buffer, kv_score_input, ape, plan, head_dim, compress_ratio, out, is_online):
    """compress_forward with every check; remembers the call's launcher for the fast path."""
    plan = as_plan(_OP, plan)
    if type(head_dim) is not int or type(compress_ratio) is not int or type(is_online) is not bool:
        common.scalars(_OP, {"head_dim": head_dim, "compress_ratio": compress_ratio}, {"is_online": is_online})
    kind = online.KIND if is_online else RING
    try:
        kind.check(_OP, plan, compress_ratio, head_dim, kv_score_input)
    except (TypeError, AttributeError):  # locals() only here: torch.compile traces the happy path
        arguments.explain(_OP, locals(), ("kv_score_buffer", "kv_score_input", "ape"), ("out",))
        raise
    try:
        check_batch(_OP, plan, {"kv_score_input": kv_score_input})
        row_dtype = kind.row_dtype(kv_score_input.dtype)
        kernel_ape = common.ape_as(_OP, ape, row_dtype)
        # on the input's device, so that a device mix is the caller's; `out` stays what the caller passed
        rows = torch.empty((plan.plan_rows.shape[0], head_dim), dtype=row_dtype,
                           device=kv_score_input.device) if out is None else out
        args = (kv_score_buffer, kv_score_input, kernel_ape, plan.plan_rows, plan.write_rows, rows, head_dim)
        if is_online:
            online.online_op(*args, plan.is_decode)
        else:
            compress_op(*args, compress_ratio, plan.is_decode, plan.reads_state)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(_OP, e, locals(), ("kv_score_buffer", "kv_score_input", "ape"), ("out",),
                            lambda text: kind.widths(_OP, text, head_dim, compress_ratio, kv_score_buffer,
                                                     kv_score_input, ape))
    _remember(kind, plan, head_dim, compress_ratio, is_online, kv_score_buffer, kv_score_input, ape, rows, out)
    return rows


def _remember(kind, plan, head_dim, compress_ratio, is_online, buffer, inputs, ape, out, given_out) -> None:
    """After a successful unchecked eager call on CUDA tensors: the fast path's launcher of its signature."""
    if library.tracing() or not inputs.is_cuda or runtime.checks_enabled():
        return
    name, params = kind.choice(_OP, compress_ratio, head_dim, buffer, inputs, out)
    fn = runtime.function(name, "decode" if plan.is_decode else "prefill", inputs.device, **params)
    row_dtype = kind.row_dtype(inputs.dtype)
    _FAST[_fast_key(plan, head_dim, compress_ratio, is_online, buffer, inputs, ape, given_out)] = compressor.launcher(
        fn, kind, compress_ratio, head_dim, plan.is_decode, None if ape.dtype == row_dtype else row_dtype,
        None if inputs.dtype == row_dtype else row_dtype)


@library.custom_op("compress", mutates_args=("kv_score_buffer", "out"))
def compress_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], out: torch.Tensor, head_dim: int,
                compress_ratio: int, is_decode: bool, reads_state: bool) -> None:
    """compress_forward on unpacked plan tensors (plan_rows: plan_c or plan_d; plan_w: None in decode;
    reads_state: the prefill plan's, True in decode)."""
    compressor.run(RING, _OP, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, head_dim, compress_ratio,
                   is_decode, reads_state)
