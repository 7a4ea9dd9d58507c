"""``compress_forward(..., is_online=True)``: the online c128 compressor (contract §5).

Each request keeps one running softmax state row (m | s | k, ``3·head_dim`` values, fp32 or bf16)
instead of a 128-row ring; plans come from ``CompressorPrefillPlan.generate_online`` /
``CompressorDecodePlan.generate_online``. Input, ape and output are fp32. CUDA tensors run
csrc/compress/online.cuh, CPU tensors reference/online.py. Fused with the store step: ops/fused.py.
"""

from __future__ import annotations

import torch

from .. import library, runtime
from ..arguments import STATE_DTYPES
from ..family import Family, KernelChoice
from ..geometry import CHUNK, online_input_width, online_state_width
from ..jit.kernels import COMPRESS_ONLINE
from ..plan import CompressorDecodePlan, CompressorPrefillPlan
from ..reference import online as ref_online
from . import common

_OP = "compress_forward"
RATIO = CHUNK  # one compressed row per 128-token chunk: the online compressor is c128
_KERNEL_HEAD_DIMS = COMPRESS_ONLINE.param("head_dim").choices


def kernel(head_dim: int, state: str) -> KernelChoice:
    """The variant a call runs (state by kernel dtype name: ``fp32``, ``bf16``)."""
    return "compress_online", {"head_dim": head_dim, "state": state}


FAMILY = Family("online", lambda cfg: [kernel(hd, cfg.state) for hd in cfg.head_dims.get(RATIO, ())])


def check_online(op: str, plan: CompressorPrefillPlan | CompressorDecodePlan, compress_ratio: int, head_dim: int,
                 kv_score_input: torch.Tensor) -> None:
    """What is_online=True requires of the ratio, the plan, head_dim and the input dtype."""
    if compress_ratio != RATIO:
        raise ValueError(f"dsv4jit.{op}: argument 'compress_ratio' must be 128 with is_online=True, "
                         f"got {compress_ratio}")
    if plan.compress_ratio != RATIO:
        raise ValueError(f"dsv4jit.{op}: argument 'plan' must be an online (compress_ratio 128) plan, "
                         f"got compress_ratio {plan.compress_ratio}")
    if head_dim <= 0 or head_dim % 128:
        raise ValueError(f"dsv4jit.{op}: argument 'head_dim' must be a positive multiple of 128 with "
                         f"is_online=True, got {head_dim}")
    if not plan.is_decode and plan.plan_w.shape[-1] != 16:
        raise ValueError(f"dsv4jit.{op}: argument 'plan' must come from generate_online (16-byte plan_w rows), "
                         f"got plan_w of shape {list(plan.plan_w.shape)}")
    if kv_score_input.dtype != torch.float32:
        raise TypeError(f"dsv4jit.{op}: argument 'kv_score_input': dtype must be float32 with is_online=True, "
                        f"got {kv_score_input.dtype}")


def online_widths(op: str, message: str, head_dim: int, kv_score_buffer, kv_score_input, ape) -> None:
    """After a failed call: ValueError naming head_dim when the state or input rows do not have its width."""
    common.check_widths(op, message, head_dim, "in the online compressor",
                        {"kv_score_buffer": (kv_score_buffer, online_state_width(head_dim)),
                         "kv_score_input": (kv_score_input, online_input_width(head_dim)), "ape": (ape, head_dim)})


def compress_forward_online(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                            plan: CompressorPrefillPlan | CompressorDecodePlan, *, head_dim: int,
                            compress_ratio: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Fold this step's tokens into the running states; returns ``[plan[1].shape[0], head_dim]`` fp32.

    kv_score_buffer: ``[rows, 1, 3·head_dim]`` (or flat ``[rows, 3·head_dim]``), fp32 or bf16, updated in
    place. kv_score_input: ``[tokens, 2·head_dim]`` fp32. ape: ``[128, head_dim]`` (converted to fp32).
    Prefill: output row i is the pooled row of the segment in plan_c row i (invalid rows untouched).
    Decode: row b holds the pooled row when position seq_len − 1 closes a 128-chunk, else zeros.
    """
    try:
        check_online(_OP, plan, compress_ratio, head_dim, kv_score_input)
        ape = common.ape_as(_OP, ape, torch.float32)
        rows = torch.empty((plan[1].shape[0], head_dim), dtype=torch.float32,
                           device=kv_score_input.device) if out is None else out  # `out`: what the caller passed
        online_op(kv_score_buffer, kv_score_input, ape, plan[1], common.write_rows(plan), rows, head_dim)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(_OP, e, locals(), ("kv_score_buffer", "kv_score_input", "ape"), ("out",),
                            lambda text: online_widths(_OP, text, head_dim, kv_score_buffer, kv_score_input, ape))
    return rows


@library.custom_op("compress_online", mutates_args=("kv_score_buffer", "out"))
def online_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
              plan_rows: torch.Tensor, plan_w: torch.Tensor | None, out: torch.Tensor, head_dim: int) -> None:
    """compress_forward_online on unpacked plan tensors (plan_rows: plan_c or plan_d; plan_w: None in decode)."""
    kv_score_buffer = common.state_pool(kv_score_buffer, 1, online_state_width(head_dim))
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, out, plan_rows, plan_w)
    if device is None:
        if plan_w is None:
            ref_online.online_decode(kv_score_buffer, kv_score_input, ape, plan_rows, head_dim=head_dim, out=out)
        else:
            ref_online.online_prefill(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, head_dim=head_dim,
                                      out=out)
        return
    if head_dim not in _KERNEL_HEAD_DIMS:
        raise ValueError(f"dsv4jit.{_OP}: argument 'head_dim' must be one of {list(_KERNEL_HEAD_DIMS)} on CUDA "
                         f"with is_online=True, got {head_dim}")
    name, params = kernel(head_dim, common.dtype_name(kv_score_buffer, "kv_score_buffer", _OP, STATE_DTYPES))
    fn = runtime.function(name, "decode" if plan_w is None else "prefill", device, **params)
    status = runtime.status_word(device)
    if plan_w is None:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, out, status)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status)
    runtime.raise_status(status, _OP, name, device, params)
