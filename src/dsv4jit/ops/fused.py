"""``compress_and_store``: a compressor and the store step in one op, the pooled rows going from
registers to the cache (csrc/fused/fused.cuh; contract §6.11), or the two steps from one entry point where
those measured faster (runs_fused). The ring compressors (``fused``) and, with ``is_online=True``, the
online c128 one (``fused_online``); CPU tensors run the two steps' references, the store's arguments
checked before the first write."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import arguments, library, runtime
from ..arguments import STATE_DTYPES
from ..family import Family, KernelChoice
from ..geometry import V4_HEAD_DIM, online_state_width, row_width
from ..plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan
from . import common
from .compress import check_ratio, compress_op, ring_widths
from .online import RATIO as ONLINE_RATIO
from .online import check_online, online_op, online_widths
from .store import check_store, store_op

_OP = "compress_and_store"
_TENSORS = ("kv_score_buffer", "kv_score_input", "ape", "norm_weight", "freq_cis", "out_loc", "kvcache")
#: The exports that tell the two status words of a fused kernel: its compressor's, then the store's.
_DESCRIBE = ("describe_compress_status", "describe_store_status")

#: Where one fused kernel measured slower than the two steps, the op runs the two steps itself, from
#: one entry point that checks both first (docs/performance.md, "One kernel or two steps"). A ring
#: c128 row is a cluster of 8 blocks that store only once the slowest has pooled: it pays while
#: the batch leaves SMs free (decode up to this many requests), never in prefill.
RING_C128_FUSED_DECODE_MAX_BATCH = 24
#: Online prefill pools each segment row in one block: it pays from this many plan rows, where
#: fewer would leave SMs idle that the compressor's 8 blocks per row keep busy.
ONLINE_FUSED_PREFILL_MIN_ROWS = 129


def runs_fused(compress_ratio: int, is_online: bool, is_decode: bool, rows: int) -> bool:
    """Whether compress_and_store runs one fused kernel for a call of `rows` plan rows (else the two
    steps, byte-identical either way)."""
    if is_online:
        return is_decode or rows >= ONLINE_FUSED_PREFILL_MIN_ROWS
    return compress_ratio == 4 or (is_decode and rows <= RING_C128_FUSED_DECODE_MAX_BATCH)


def kernel(compress_ratio: int, store_format: str, state: str, input: str) -> KernelChoice:
    """The variant a ring-compressor call runs (dtypes by kernel name: ``fp32``, ``bf16``)."""
    return "fused", {"ratio": compress_ratio, "format": store_format, "state": state, "input": input}


def online_kernel(store_format: str, state: str) -> KernelChoice:
    """The variant an ``is_online=True`` call runs."""
    return "fused_online", {"format": store_format, "state": state}


FAMILY = Family("fused", lambda cfg: [kernel(ratio, cfg.store_format(hd), cfg.state, cfg.input)
                                      for ratio, hd in cfg.pairs()])
ONLINE_FAMILY = Family("fused_online", lambda cfg: [online_kernel(cfg.store_format(hd), cfg.state)
                                                    for hd in cfg.head_dims.get(ONLINE_RATIO, ()) if hd == V4_HEAD_DIM])


def compress_and_store(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                       plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *, head_dim: int,
                       compress_ratio: int, norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                       out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, use_fp4: bool = False,
                       bf16_store: bool = False, is_online: bool = False) -> None:
    """compress_forward followed by compress_norm_rope_store, fused: the pooled rows go straight from
    registers to the cache and never reach memory. Same arguments as the two ops (the compressed rows
    take the input dtype, fp32 or bf16); caches and states are byte-identical to the two-step path.

    Decode is one kernel launch; prefill is the fused pool-and-store kernel followed by the state-ring
    write pass (this step's ring writes may alias rows the pooling reads, so they must come after it).
    Where one kernel is the slower path (ring c128 prefill and decode batches above 24, online
    prefills below 129 plan rows: runs_fused), the call runs the two steps instead, every argument of
    both checked before the first launch. is_online=True fuses the online c128 compressor instead
    (online plans, head_dim 512, fp32 rows).
    """
    op = _OP
    plan = as_plan(op, plan)
    if (type(head_dim) is not int or type(compress_ratio) is not int or type(page_size) is not int
            or type(use_fp4) is not bool or type(bf16_store) is not bool or type(is_online) is not bool):
        common.scalars(op, {"head_dim": head_dim, "compress_ratio": compress_ratio, "page_size": page_size},
                       {"use_fp4": use_fp4, "bf16_store": bf16_store, "is_online": is_online})
    eps = arguments.nonnegative(op, "norm_eps", norm_eps)
    if is_online:
        return _compress_and_store_online(kv_score_buffer, kv_score_input, ape, plan, head_dim=head_dim,
                                          compress_ratio=compress_ratio, norm_weight=norm_weight, norm_eps=eps,
                                          freq_cis=freq_cis, out_loc=out_loc, kvcache=kvcache, page_size=page_size,
                                          use_fp4=use_fp4, bf16_store=bf16_store)
    check_ratio(op, plan, compress_ratio)
    fmt = common.store_format(op, head_dim, use_fp4, bf16_store, "head_dim")
    if compress_ratio == 128 and head_dim != V4_HEAD_DIM:
        raise ValueError(f"dsv4jit.{op}: argument 'head_dim' must be 512 with compress_ratio 128 (the V4 cache "
                         f"formats), got {head_dim}")
    try:
        ape = common.ape_as(op, ape, kv_score_input.dtype)
        if norm_weight.dtype != kv_score_input.dtype:
            norm_weight = norm_weight.to(kv_score_input.dtype)
        fused_op(kv_score_buffer, kv_score_input, ape, plan[1], common.write_rows(plan), norm_weight,
                 common.freq_table(freq_cis), out_loc, kvcache, fmt, page_size, head_dim, compress_ratio,
                 plan.is_decode, eps, common.num_q_tokens(plan))
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), _TENSORS, (), lambda text: (
            ring_widths(op, text, head_dim, compress_ratio, kv_score_buffer, kv_score_input, ape),
            common.check_freq(op, freq_cis)))


@library.custom_op("compress_and_store", mutates_args=("kv_score_buffer", "kvcache"))
def fused_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
             plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], norm_weight: torch.Tensor,
             freq: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, store_format: str,
             page_size: int, head_dim: int, compress_ratio: int, is_decode: bool, norm_eps: float,
             num_q_tokens: int) -> None:
    """compress_and_store on unpacked plan tensors (plan_w: None in decode; freq: the real table)."""
    op = _OP
    kv_score_buffer = common.state_pool(kv_score_buffer, compress_ratio, row_width(head_dim, compress_ratio))
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc,
                                kvcache)
    if device is None:  # the reference of the two steps, the store's arguments checked before the first writes
        rows = torch.empty((plan_rows.shape[0], head_dim), dtype=kv_score_input.dtype)
        check_store(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size,
                    compress_ratio, is_decode, num_q_tokens)
        compress_op.impl(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, rows, head_dim, compress_ratio,
                         is_decode)
        store_op.impl(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size, compress_ratio,
                      is_decode, norm_eps, num_q_tokens)
        return
    choice = kernel(compress_ratio, store_format,
                    common.dtype_name(kv_score_buffer, "kv_score_buffer", op, STATE_DTYPES),
                    common.dtype_name(kv_score_input, "kv_score_input", op, STATE_DTYPES))
    _call_fused(choice, device, runs_fused(compress_ratio, False, is_decode, plan_rows.shape[0]),
                (head_dim, kv_score_input.dtype), kv_score_buffer, kv_score_input, ape, plan_rows, plan_w,
                norm_weight, freq, out_loc, kvcache, page_size, norm_eps, num_q_tokens)


def _compress_and_store_online(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                               plan: CompressorPrefillPlan | CompressorDecodePlan, *, head_dim: int,
                               compress_ratio: int, norm_weight: torch.Tensor, norm_eps: float,
                               freq_cis: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int,
                               use_fp4: bool, bf16_store: bool) -> None:
    """compress_forward(is_online=True) followed by compress_norm_rope_store in one kernel (prefill:
    plus the state write pass); states and caches byte-identical to the two steps. head_dim 512."""
    op = _OP
    try:
        check_online(op, plan, compress_ratio, head_dim, kv_score_input)
        fmt = common.store_format(op, head_dim, use_fp4, bf16_store, "head_dim")
        if head_dim != V4_HEAD_DIM:
            raise ValueError(f"dsv4jit.{op}: argument 'head_dim' must be 512 with is_online=True (the V4 cache "
                             f"formats), got {head_dim}")
        ape = common.ape_as(op, ape, torch.float32)
        if norm_weight.dtype != torch.float32:
            norm_weight = norm_weight.float()
        fused_online_op(kv_score_buffer, kv_score_input, ape, plan[1], common.write_rows(plan), norm_weight,
                        common.freq_table(freq_cis), out_loc, kvcache, fmt, page_size, float(norm_eps),
                        common.num_q_tokens(plan))
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), _TENSORS, (), lambda text: (
            online_widths(op, text, head_dim, kv_score_buffer, kv_score_input, ape), common.check_freq(op, freq_cis)))


@library.custom_op("compress_and_store_online", mutates_args=("kv_score_buffer", "kvcache"))
def fused_online_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                    plan_rows: torch.Tensor, plan_w: torch.Tensor | None, norm_weight: torch.Tensor,
                    freq: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, store_format: str,
                    page_size: int, norm_eps: float, num_q_tokens: int) -> None:
    """compress_and_store(is_online=True) on unpacked plan tensors (plan_w: None in decode; freq: the real table)."""
    op, hd = _OP, V4_HEAD_DIM
    kv_score_buffer = common.state_pool(kv_score_buffer, 1, online_state_width(hd))
    is_decode = plan_w is None
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc,
                                kvcache)
    if device is None:  # the reference of the two steps, the store's arguments checked before the first writes
        rows = torch.empty((plan_rows.shape[0], hd), dtype=torch.float32)
        check_store(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size, ONLINE_RATIO,
                    is_decode, num_q_tokens)
        online_op.impl(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, rows, hd)
        store_op.impl(rows, plan_rows, norm_weight, freq, out_loc, kvcache, store_format, page_size, ONLINE_RATIO,
                      is_decode, norm_eps, num_q_tokens)
        return
    choice = online_kernel(store_format, common.dtype_name(kv_score_buffer, "kv_score_buffer", op, STATE_DTYPES))
    _call_fused(choice, device, runs_fused(ONLINE_RATIO, True, is_decode, plan_rows.shape[0]), (hd, torch.float32),
                kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache,
                page_size, norm_eps, num_q_tokens)


def _call_fused(choice: KernelChoice, device: torch.device, one_kernel: bool, row_layout: tuple[int, torch.dtype],
                kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], norm_weight: torch.Tensor,
                freq: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, norm_eps: float,
                num_q_tokens: int) -> None:
    """Calls a fused entry point (decode: plan_w None): the fused kernel (one_kernel), else the
    two-step entry with a buffer for the compressed rows (row_layout: head_dim, dtype); and raises what
    checked mode found: word 0 of the status holds the compressor's violations, word 1 the store's."""
    name, params = choice
    entry = ("decode" if plan_w is None else "prefill") + ("" if one_kernel else "_two_step")
    fn = runtime.function(name, entry, device, **params)
    status = runtime.status_word(device, words=2)
    plan = (plan_rows,) if plan_w is None else (plan_rows, plan_w)
    head_dim, dtype = row_layout
    buffer = () if one_kernel else (torch.empty((plan_rows.shape[0], head_dim), dtype=dtype, device=device),)
    tail = () if plan_w is None else (num_q_tokens,)
    fn(kv_score_buffer, kv_score_input, ape, *plan, *buffer, norm_weight, freq, out_loc, kvcache, status, page_size,
       norm_eps, *tail)
    runtime.raise_status(status, _OP, name, device, params, _DESCRIBE)
