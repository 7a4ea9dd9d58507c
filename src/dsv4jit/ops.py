"""Public ops. CUDA tensors run the kernels; CPU tensors run the torch references (same results
within the precision contract), so the API works on a machine without a GPU.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import runtime
from .plan import CompressorDecodePlan, CompressorPrefillPlan
from .reference import compress as ref_compress

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_OP = "compress_forward"


def _dtype_name(t: torch.Tensor, arg: str) -> str:
    try:
        return _DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"dsv4jit.{_OP}: argument '{arg}': dtype must be float32, bfloat16 or float16, "
                        f"got {t.dtype}") from None


def _status(device: torch.device) -> Optional[torch.Tensor]:
    return torch.zeros(1, dtype=torch.int32, device=device) if runtime.checks_enabled() else None


_STATUS_TEXT = {1: "a plan row names a state page outside kv_score_buffer",
                2: "a plan row names a ragged row outside kv_score_input",
                4: "a plan row names a state row (write_loc) outside kv_score_buffer"}


def _raise_status(status: Optional[torch.Tensor]) -> None:
    if status is not None and (code := int(status.item())):
        reasons = "; ".join(text for bit, text in _STATUS_TEXT.items() if code & bit)
        raise ValueError(f"dsv4jit.{_OP} (checked mode): {reasons}")


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
    if is_online:
        raise NotImplementedError("dsv4jit: the online c128 compressor is not available in this version")
    if compress_ratio not in (4, 128):
        raise ValueError(f"dsv4jit.{_OP}: argument 'compress_ratio' must be 4 or 128, got {compress_ratio}")
    if plan.compress_ratio != compress_ratio:
        raise ValueError(f"dsv4jit.{_OP}: argument 'plan' was built for compress_ratio {plan.compress_ratio}, "
                         f"got compress_ratio {compress_ratio}")
    last_dim = (4 if compress_ratio == 4 else 2) * head_dim
    if kv_score_buffer.dim() == 2 and kv_score_buffer.shape[-1] == last_dim and kv_score_buffer.is_contiguous():
        kv_score_buffer = kv_score_buffer.view(-1, compress_ratio, last_dim)
    if ape.dtype != kv_score_input.dtype:
        ape = ape.to(kv_score_input.dtype)
    rows = plan[1].shape[0]
    if out is None:
        out = torch.empty((rows, head_dim), dtype=kv_score_input.dtype, device=kv_score_input.device)
    if kv_score_input.device.type == "cpu":
        return _reference(kv_score_buffer, kv_score_input, ape, plan, head_dim, compress_ratio, out)
    fn = runtime.function(f"compress_c{compress_ratio}", "decode" if plan.is_decode else "prefill",
                          kv_score_input.device, head_dim=head_dim,
                          state=_dtype_name(kv_score_buffer, "kv_score_buffer"),
                          input=_dtype_name(kv_score_input, "kv_score_input"), output=_dtype_name(out, "out"))
    status = _status(kv_score_input.device)
    if plan.is_decode:
        fn(kv_score_buffer, kv_score_input, ape, plan.plan_d, out, status)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan.plan_c, plan.plan_w, out, status)
    _raise_status(status)
    return out


def _reference(buffer, inputs, ape, plan, head_dim, ratio, out):
    if plan.is_decode:
        return ref_compress.compress_decode(buffer, inputs, ape, plan.plan_d, head_dim=head_dim,
                                            compress_ratio=ratio, out=out)
    return ref_compress.compress_prefill(buffer, inputs, ape, plan.plan_c, plan.plan_w, head_dim=head_dim,
                                         compress_ratio=ratio, out=out)
