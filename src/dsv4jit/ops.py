"""Public ops. CUDA tensors run the kernels; CPU tensors run the torch references (same results
within the precision contract), so the API works on a machine without a GPU.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import runtime
from .plan import CompressorDecodePlan, CompressorPrefillPlan
from .reference import compress as ref_compress
from .reference import store as ref_store

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_OP = "compress_forward"


def _cuda_device(*tensors: Optional[torch.Tensor]) -> Optional[torch.device]:
    """Kernels run when any tensor is on a GPU (their checks then name a tensor left on the CPU, so a
    device mix is an error, never a silent fallback to the reference); None when all are on the CPU."""
    return next((t.device for t in tensors if t is not None and t.device.type == "cuda"), None)


def _dtype_name(t: torch.Tensor, arg: str, op: str = _OP) -> str:
    try:
        return _DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"dsv4jit.{op}: argument '{arg}': dtype must be float32, bfloat16 or float16, "
                        f"got {t.dtype}") from None


_COMPRESS_STATUS = {1: "a plan row names a state page outside kv_score_buffer",
                    2: "a plan row names a ragged row outside kv_score_input",
                    4: "a plan row names a state row (write_loc) outside kv_score_buffer"}
_STORE_STATUS = {1: "an out_loc entry of a stored row lies outside kvcache",
                 2: "a rope position (seq_len - compress_ratio) lies outside freq_cis",
                 4: "a plan row's ragged id lies beyond out_loc"}


def _describe(texts: dict[int, str]):
    return lambda code: "; ".join(text for bit, text in texts.items() if code & bit)


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
    if not ape.dtype.is_floating_point:
        raise TypeError(f"dsv4jit.{_OP}: argument 'ape': dtype must be a floating-point type, got {ape.dtype}")
    if ape.dtype != kv_score_input.dtype:
        ape = ape.to(kv_score_input.dtype)
    device = _cuda_device(kv_score_buffer, kv_score_input, ape, out, plan[1],
                          None if plan.is_decode else plan.plan_w)
    if out is None:
        out = torch.empty((plan[1].shape[0], head_dim), dtype=kv_score_input.dtype,
                          device=device or kv_score_input.device)
    if device is None:
        return _reference(kv_score_buffer, kv_score_input, ape, plan, head_dim, compress_ratio, out)
    if kv_score_buffer.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"dsv4jit.{_OP}: argument 'kv_score_buffer': dtype must be float32 or bfloat16, "
                        f"got {kv_score_buffer.dtype}")
    fn = runtime.function(f"compress_c{compress_ratio}", "decode" if plan.is_decode else "prefill",
                          device, head_dim=head_dim,
                          state=_dtype_name(kv_score_buffer, "kv_score_buffer"),
                          input=_dtype_name(kv_score_input, "kv_score_input"), output=_dtype_name(out, "out"))
    status = runtime.status_word(device)
    if plan.is_decode:
        fn(kv_score_buffer, kv_score_input, ape, plan.plan_d, out, status)
    else:
        fn(kv_score_buffer, kv_score_input, ape, plan.plan_c, plan.plan_w, out, status)
    runtime.raise_status(status, _OP, _describe(_COMPRESS_STATUS))
    return out


def _reference(buffer, inputs, ape, plan, head_dim, ratio, out):
    if plan.is_decode:
        return ref_compress.compress_decode(buffer, inputs, ape, plan.plan_d, head_dim=head_dim,
                                            compress_ratio=ratio, out=out)
    return ref_compress.compress_prefill(buffer, inputs, ape, plan.plan_c, plan.plan_w, head_dim=head_dim,
                                         compress_ratio=ratio, out=out)


def _store_format(head_dim: int, use_fp4: bool, bf16_store: bool) -> str:
    op = "compress_norm_rope_store"
    if head_dim == 512:
        if use_fp4:
            raise ValueError(f"dsv4jit.{op}: argument 'use_fp4' needs the indexer head_dim 128, got head_dim 512")
        return "v4_bf16" if bf16_store else "v4_fp8"
    if head_dim == 128:
        if bf16_store:
            raise ValueError(f"dsv4jit.{op}: argument 'bf16_store' needs head_dim 512, got head_dim 128")
        return "indexer_fp4" if use_fp4 else "indexer_fp8"
    raise ValueError(f"dsv4jit.{op}: argument 'kv': head_dim (kv.shape[1]) must be 512 or 128, got {head_dim}")


def _check_out_loc(op: str, plan, out_loc: torch.Tensor, rows: int) -> None:
    if plan.is_decode and out_loc.shape[0] != rows:
        raise ValueError(f"dsv4jit.{op}: argument 'out_loc' must have one entry per decode row ({rows}), "
                         f"got {out_loc.shape[0]}")
    if not plan.is_decode and plan.num_q_tokens is not None and out_loc.shape[0] < plan.num_q_tokens:
        raise ValueError(f"dsv4jit.{op}: argument 'out_loc' must have at least num_q_tokens "
                         f"({plan.num_q_tokens}) entries, got {out_loc.shape[0]}")


def _freq_table(freq_cis: torch.Tensor) -> torch.Tensor:
    """complex64 [max_pos, 32] -> fp32 [max_pos, 64] of interleaved (cos, sin): a view, no copy."""
    if freq_cis.is_complex():
        return torch.view_as_real(freq_cis).reshape(freq_cis.shape[0], -1)
    return freq_cis


def compress_norm_rope_store(kv: torch.Tensor, plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *,
                             norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                             out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, use_fp4: bool = False,
                             bf16_store: bool = False, layout: str = "v4", fp8_2buff: bool = False,
                             kvcache_rope: Optional[torch.Tensor] = None) -> None:
    """RMSNorm, RoPE at position seq_len − R (+ Hadamard for the indexer), quantize, store at out_loc.

    kv: compressed rows ``[plan[1].shape[0], head_dim]`` (fp32 or bf16), as compress_forward returns.
    Prefill processes the valid plan rows and stores at ``out_loc[ragged_id]`` (out_loc covers every
    token of the step); decode processes the rows at a compress boundary and stores at ``out_loc[b]``.
    kvcache: ``[num_pages, page_bytes]`` uint8 view of the paged cache; formats by head_dim and flags:
    512 -> V4 fp8 latent (or bf16 rows with bf16_store), 128 -> indexer fp8 (or fp4 with use_fp4).
    """
    op = "compress_norm_rope_store"
    if layout != "v4" or fp8_2buff or kvcache_rope is not None:
        raise NotImplementedError(f"dsv4jit.{op}: only layout='v4' without fp8_2buff/kvcache_rope is available")
    if kv.dim() != 2:
        raise ValueError(f"dsv4jit.{op}: argument 'kv' must be 2-D [rows, head_dim], got shape {list(kv.shape)}")
    fmt = _store_format(kv.shape[1], use_fp4, bf16_store)
    ratio = plan.compress_ratio
    if norm_weight.dtype != kv.dtype:
        norm_weight = norm_weight.to(kv.dtype)
    device = _cuda_device(kv, plan[1], norm_weight, freq_cis, out_loc, kvcache)
    if device is None:
        _check_out_loc(op, plan, out_loc, kv.shape[0])  # the kernels' entry points check this themselves
        ref_store.compress_norm_rope_store(kv, plan[1], is_decode=plan.is_decode, compress_ratio=ratio,
                                           norm_weight=norm_weight, norm_eps=norm_eps, freq_cis=freq_cis,
                                           out_loc=out_loc, kvcache=kvcache, page_size=page_size, use_fp4=use_fp4,
                                           bf16_store=bf16_store)
        return
    fn = runtime.function("store", "run", device, dtype=_dtype_name(kv, "kv", op), format=fmt)
    status = runtime.status_word(device)
    num_q = -1 if plan.is_decode or plan.num_q_tokens is None else plan.num_q_tokens
    fn(kv, plan[1], norm_weight, _freq_table(freq_cis), out_loc, kvcache, status, page_size, ratio, plan.is_decode,
       float(norm_eps), num_q)
    runtime.raise_status(status, op, _describe(_STORE_STATUS))
