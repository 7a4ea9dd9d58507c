"""compress_forward(..., is_online=True) and compress_and_store(..., is_online=True): the online c128
compressor (contract §5), alone and fused with the store step.

Each request keeps one running softmax state row (m | s | k, ``3·head_dim`` values, fp32 or bf16)
instead of a 128-row ring; plans come from ``CompressorPrefillPlan.generate_online`` /
``CompressorDecodePlan.generate_online``. Input, ape and output are fp32. CUDA tensors run
csrc/online.cuh (fused: csrc/fused.cuh); CPU tensors run reference/online.py (and reference/store.py).
"""

from __future__ import annotations

import torch

from . import library, runtime
from .ops import (
    _FUSED_TENSORS,
    _STATE_DTYPES,
    _ape_as,
    _call_fused,
    _check_freq,
    _check_store,
    _check_widths,
    _cuda_device,
    _describe,
    _dtype_name,
    _freq_table,
    _norm_rope_store,
    _num_q_tokens,
    _public_error,
    _state_pool,
    _store_format,
)
from .plan import CompressorDecodePlan, CompressorPrefillPlan
from .reference import online as ref_online

_OP = "compress_forward"
_RATIO = 128
_KERNEL_HEAD_DIMS = (128, 256, 512)
_STATUS = {1: "a plan row names a state row outside kv_score_buffer",
           2: "a segment row names ragged rows outside kv_score_input",
           4: "a segment row's buffer_len is 0 or reaches before its 128-token chunk"}
_DESCRIBE_STATUS = _describe(_STATUS)


def _check_online(op: str, plan: CompressorPrefillPlan | CompressorDecodePlan, compress_ratio: int, head_dim: int,
                  kv_score_input: torch.Tensor) -> None:
    if compress_ratio != _RATIO:
        raise ValueError(f"dsv4jit.{op}: argument 'compress_ratio' must be 128 with is_online=True, "
                         f"got {compress_ratio}")
    if plan.compress_ratio != _RATIO:
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


def _online_widths(op: str, message: str, head_dim: int, kv_score_buffer, kv_score_input, ape) -> None:
    _check_widths(op, message, head_dim, "in the online compressor",
                  {"kv_score_buffer": (kv_score_buffer, 3 * head_dim), "kv_score_input": (kv_score_input, 2 * head_dim),
                   "ape": (ape, head_dim)})


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
        _check_online(_OP, plan, compress_ratio, head_dim, kv_score_input)
        ape = _ape_as(_OP, ape, torch.float32)
        if out is None:
            out = torch.empty((plan[1].shape[0], head_dim), dtype=torch.float32, device=kv_score_input.device)
        _compress_online(kv_score_buffer, kv_score_input, ape, plan[1], None if plan.is_decode else plan.plan_w, out,
                         head_dim)
    except (ValueError, TypeError, AttributeError) as e:
        _public_error(_OP, e, locals(), ("kv_score_buffer", "kv_score_input", "ape"), ("out",),
                      lambda text: _online_widths(_OP, text, head_dim, kv_score_buffer, kv_score_input, ape))
    return out


@library.custom_op("compress_online", mutates_args=("kv_score_buffer", "out"))
def _compress_online(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                     plan_rows: torch.Tensor, plan_w: torch.Tensor | None, out: torch.Tensor,
                     head_dim: int) -> None:
    """compress_forward_online on unpacked plan tensors (plan_rows: plan_c or plan_d; plan_w: None in decode)."""
    kv_score_buffer = _state_pool(kv_score_buffer, 1, 3 * head_dim)
    device = _cuda_device(kv_score_buffer, kv_score_input, ape, out, plan_rows, plan_w)
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
    fn = runtime.function("compress_online", "decode" if plan_w is None else "prefill", device, head_dim=head_dim,
                          state=_dtype_name(kv_score_buffer, "kv_score_buffer", _OP, _STATE_DTYPES))
    status = runtime.status_word(device)
    if plan_w is None:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, out, status)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, out, status)
    runtime.raise_status(status, _OP, _DESCRIBE_STATUS)


_FUSED_OP = "compress_and_store"
_FUSED_HEAD_DIM = 512  # the V4 latent formats


def compress_and_store_online(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                              plan: CompressorPrefillPlan | CompressorDecodePlan, *, head_dim: int,
                              compress_ratio: int, norm_weight: torch.Tensor, norm_eps: float,
                              freq_cis: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int,
                              use_fp4: bool = False, bf16_store: bool = False) -> None:
    """compress_forward_online followed by compress_norm_rope_store in one kernel (prefill: plus the
    state write pass); states and caches byte-identical to the two steps. head_dim 512 (V4 formats)."""
    op = _FUSED_OP
    try:
        _check_online(op, plan, compress_ratio, head_dim, kv_score_input)
        fmt = _store_format(op, head_dim, use_fp4, bf16_store, "'head_dim'")
        if head_dim != _FUSED_HEAD_DIM:
            raise ValueError(f"dsv4jit.{op}: argument 'head_dim' must be 512 with is_online=True (the V4 cache "
                             f"formats), got {head_dim}")
        ape = _ape_as(op, ape, torch.float32)
        if norm_weight.dtype != torch.float32:
            norm_weight = norm_weight.float()
        _compress_and_store_online(kv_score_buffer, kv_score_input, ape, plan[1],
                                   None if plan.is_decode else plan.plan_w, norm_weight, _freq_table(freq_cis),
                                   out_loc, kvcache, fmt, page_size, float(norm_eps), _num_q_tokens(plan))
    except (ValueError, TypeError, AttributeError) as e:
        _public_error(op, e, locals(), _FUSED_TENSORS, (), lambda text: (
            _online_widths(op, text, head_dim, kv_score_buffer, kv_score_input, ape), _check_freq(op, freq_cis)))


@library.custom_op("compress_and_store_online", mutates_args=("kv_score_buffer", "kvcache"))
def _compress_and_store_online(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                               plan_rows: torch.Tensor, plan_w: torch.Tensor | None, norm_weight: torch.Tensor,
                               freq: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, store_format: str,
                               page_size: int, norm_eps: float, num_q_tokens: int) -> None:
    """compress_and_store_online on unpacked plan tensors (plan_w: None in decode; freq: the real table)."""
    op = _FUSED_OP
    hd = _FUSED_HEAD_DIM
    kv_score_buffer = _state_pool(kv_score_buffer, 1, 3 * hd)
    is_decode = plan_w is None
    device = _cuda_device(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache)
    if device is None:  # the reference of the two steps, the store's arguments checked before the first writes
        rows = torch.empty((plan_rows.shape[0], hd), dtype=torch.float32)
        _check_store(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size, _RATIO, is_decode,
                     num_q_tokens)
        _compress_online.impl(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, rows, hd)
        _norm_rope_store.impl(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size, _RATIO,
                              is_decode, norm_eps, num_q_tokens)
        return
    fn = runtime.function("fused_online", "decode" if is_decode else "prefill", device, format=store_format,
                          state=_dtype_name(kv_score_buffer, "kv_score_buffer", op, _STATE_DTYPES))
    _call_fused(fn, op, _DESCRIBE_STATUS, device, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w,
                norm_weight, freq, out_loc, kvcache, page_size, norm_eps, num_q_tokens)
