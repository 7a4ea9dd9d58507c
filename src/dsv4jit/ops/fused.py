"""``compress_and_store``: a compressor and the store step in one op, the pooled rows going from
registers to the cache (csrc/fused/fused.cuh; contract §6.11), or the two steps from the same entry
point where those measured faster (runs_fused). The ring compressors (``fused``) and, with
``is_online=True``, the online c128 one (``fused_online``); CPU tensors run the two steps'
references, the store's arguments checked before the first write.

Eager calls of a signature seen before take the fast path: one dict lookup, then the kernel call.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Optional, Union

import torch

from .. import arguments, library, runtime
from ..arguments import STATE_DTYPES
from ..errors import ArgumentError
from ..family import Family, KernelChoice
from ..geometry import RATIOS, V4_HEAD_DIM
from ..plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan, check_batch
from . import binding, checked, common
from .compress import RING, compress_op
from .online import KIND as ONLINE
from .online import RATIO as ONLINE_RATIO
from .online import online_op
from .store import check_store, store_op

_OP = "compress_and_store"
_TENSORS = ("kv_score_buffer", "kv_score_input", "ape", "norm_weight", "freq_cis", "out_loc", "kvcache")
_OPTIONAL = ("kvcache_rope",)
#: The exports that tell the two status words of a fused kernel: its compressor's, then the store's.
DESCRIBE = ("describe_compress_status", "describe_store_status")

#: Where one fused kernel measured slower than the two steps, the op runs the two steps itself, from
#: the same entry point, which checks both first (docs/design-notes.md, "One kernel or two steps, by measurement"):
#: ring c128 prefill (its rows' stores wait on the last of 8 slice blocks, where the store kernel
#: runs them all at once), and online prefill below this many plan rows (it pools each segment row
#: in one block, which leaves SMs idle that the compressor's 8 blocks per row keep busy).
ONLINE_FUSED_PREFILL_MIN_ROWS = 129


def runs_fused(compress_ratio: int, is_online: bool, is_decode: bool, rows: int) -> bool:
    """Whether compress_and_store runs one fused kernel for a call of `rows` plan rows (else the two
    steps, byte-identical either way)."""
    if is_online:
        return is_decode or rows >= ONLINE_FUSED_PREFILL_MIN_ROWS
    return compress_ratio == 4 or is_decode


#: Ring c128 rows are pooled by 8 blocks, one per 64-channel slice, and stored by the last of them:
#: a scratch line per plan row for the pooled values and a counter per plan row, zero between calls
#: (csrc/fused/fused.cuh, LastSliceStores). The counters, and on the fast path the scratch, live as
#: long as the plan's rows tensor, shared by the calls on that plan, which run in stream order (each
#: kernel waits for the one before it). Keyed by id (tensors compare elementwise), checked by identity.
_SCRATCH: dict[int, dict] = {}


def block_units(compress_ratio: int, is_online: bool) -> bool:
    """Whether the fused kernel pools a row in blocks of one slice each (scratch and row counters)."""
    return compress_ratio == 128 and not is_online


def _kept(plan_rows: torch.Tensor) -> dict:
    """The scratch entry of `plan_rows`: its counters (made on its device) and scratch per dtype."""
    key = id(plan_rows)
    mine = _SCRATCH.get(key)
    if mine is None or mine["plan_rows"]() is not plan_rows:
        mine = _SCRATCH[key] = {"plan_rows": weakref.ref(plan_rows),
                                "counts": torch.zeros(plan_rows.shape[0], dtype=torch.int32, device=plan_rows.device)}
        weakref.finalize(plan_rows, _forget, key, mine)
    return mine


def _forget(key: int, mine: dict) -> None:
    if _SCRATCH.get(key) is mine:
        del _SCRATCH[key]


def plan_row_counts(plan_rows: torch.Tensor) -> torch.Tensor:
    """The ring c128 kernel's zeroed int32 counters, one per plan row, kept with `plan_rows` (a traced
    call gets its own)."""
    if library.tracing():
        return torch.zeros(plan_rows.shape[0], dtype=torch.int32, device=plan_rows.device)
    return _kept(plan_rows)["counts"]


#: The last row_scratch answer, weakly (it goes with the plan): the calls of a step's layers share one
#: plan, and an identity check costs less host time than the lookup in _SCRATCH.
_LAST_SCRATCH = [(lambda: None, 0, None, lambda: None, lambda: None)]


def row_scratch(plan_rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple:
    """(scratch [plan rows, head_dim] of `dtype`, plan_row_counts) for the fast path's ring c128 calls."""
    seen, dim, kind, rows, counts = _LAST_SCRATCH[0]
    if (seen() is plan_rows and dim == head_dim and kind is dtype and (rows := rows()) is not None
            and (counts := counts()) is not None):
        return rows, counts
    mine = _kept(plan_rows)
    rows = mine.get(dtype)
    if rows is None or rows.shape[1] != head_dim:
        rows = mine[dtype] = torch.empty((plan_rows.shape[0], head_dim), dtype=dtype, device=plan_rows.device)
    counts = mine["counts"]
    _LAST_SCRATCH[0] = (weakref.ref(plan_rows), head_dim, dtype, weakref.ref(rows), weakref.ref(counts))
    return rows, counts


def kernel(compress_ratio: int, store_format: str, state: str, input: str) -> KernelChoice:
    """The variant a ring-compressor call runs (dtypes by kernel name: ``fp32``, ``bf16``)."""
    return "fused", {"ratio": compress_ratio, "format": store_format, "state": state, "input": input}


def online_kernel(store_format: str, state: str) -> KernelChoice:
    """The variant an ``is_online=True`` call runs."""
    return "fused_online", {"format": store_format, "state": state}


FAMILY = Family("fused", lambda cfg: [kernel(ratio, cfg.store_format(ratio, hd), cfg.state, cfg.input)
                                      for ratio, hd in cfg.pairs() if ratio in RATIOS])
ONLINE_FAMILY = Family("fused_online", lambda cfg: [online_kernel(cfg.store_format(ONLINE_RATIO, hd), cfg.state)
                                                    for hd in cfg.head_dims.get(ONLINE_RATIO, ()) if hd == V4_HEAD_DIM])

_FAST = runtime.call_cache()


def compress_and_store(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                       plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *, head_dim: int,
                       compress_ratio: int, norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                       out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, use_fp4: bool = False,
                       bf16_store: bool = False, is_online: bool = False, layout: str = "v4", fp8_2buff: bool = False,
                       kvcache_rope: Optional[torch.Tensor] = None) -> None:
    """compress_forward followed by compress_norm_rope_store, fused: the pooled rows go straight from
    registers to the cache and never reach memory. Same arguments as the two ops (the compressed rows
    take the input dtype, fp32 or bf16); caches and states are byte-identical to the two-step path.

    Decode is one kernel launch; prefill is the fused pool-and-store kernel followed by the state-ring
    write pass (this step's ring writes may alias rows the pooling reads, so they must come after it).
    Where one kernel is the slower path (ring c128 prefill, online prefills below 129 plan rows:
    runs_fused), the call runs the two steps instead, every argument of both checked before the first
    launch.
    is_online=True fuses the online c128 compressor instead (online plans, head_dim 512, fp32 rows).
    layout, fp8_2buff, kvcache_rope: the cache's KVLayout (or its name, any case), or the V4 latent in two
    pools, as compress_norm_rope_store takes them (512-dim rows).
    Ring c128 calls on one plan share a scratch buffer kept with the plan: run them in stream order.
    """
    if (type(head_dim) is int and type(compress_ratio) is int and type(page_size) is int
            and type(norm_eps) is float and 0.0 < norm_eps < math.inf and not library.tracing()):
        try:
            launch = _FAST[_fast_key(plan, head_dim, compress_ratio, use_fp4, bf16_store, is_online, layout,
                                     fp8_2buff, kv_score_buffer, kv_score_input, ape, norm_weight)]
            return launch(kv_score_buffer, kv_score_input, ape, plan, norm_weight, norm_eps, freq_cis, out_loc,
                          kvcache, kvcache_rope, page_size)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    return _compress_and_store(kv_score_buffer, kv_score_input, ape, plan, head_dim, compress_ratio, norm_weight,
                               norm_eps, freq_cis, out_loc, kvcache, page_size, use_fp4, bf16_store, is_online, layout,
                               fp8_2buff, kvcache_rope)


def _fast_key(plan, head_dim: int, compress_ratio: int, use_fp4: bool, bf16_store: bool, is_online: bool, layout,
              fp8_2buff: bool, buffer: torch.Tensor, inputs: torch.Tensor, ape: torch.Tensor,
              norm_weight: torch.Tensor) -> tuple:
    """What picks a call's launcher (freq_cis takes no part: the kernels read either form of the table
    and check its dtype; `layout` as given: a KVLayout hashes as its value)."""
    return (plan.__class__, head_dim, compress_ratio, use_fp4, bf16_store, is_online, layout, fp8_2buff, buffer.dtype,
            inputs.dtype, ape.dtype, norm_weight.dtype, inputs.device)


def _compress_and_store(kv_score_buffer, kv_score_input, ape, plan, head_dim, compress_ratio, norm_weight, norm_eps,
                        freq_cis, out_loc, kvcache, page_size, use_fp4, bf16_store, is_online, layout, fp8_2buff,
                        kvcache_rope) -> None:
    """compress_and_store with every check; remembers the call's launcher for the fast path."""
    op = _OP
    plan = as_plan(op, plan)
    if (type(head_dim) is not int or type(compress_ratio) is not int or type(page_size) is not int
            or type(use_fp4) is not bool or type(bf16_store) is not bool or type(is_online) is not bool):
        common.scalars(op, {"head_dim": head_dim, "compress_ratio": compress_ratio, "page_size": page_size},
                       {"use_fp4": use_fp4, "bf16_store": bf16_store, "is_online": is_online})
    eps = arguments.positive(op, "norm_eps", norm_eps)
    kind = ONLINE if is_online else RING
    try:
        kind.check(op, plan, compress_ratio, head_dim, kv_score_input)
    except (TypeError, AttributeError):  # locals() only here: torch.compile traces the happy path
        arguments.explain(op, locals(), _TENSORS)
        raise
    fmt = common.store_format(op, head_dim, use_fp4, bf16_store, "head_dim", common.layout_value(op, layout),
                              arguments.flag(op, "fp8_2buff", fp8_2buff))
    common.check_rope_pool(op, fp8_2buff, kvcache_rope)
    if (is_online or compress_ratio == 128) and head_dim != V4_HEAD_DIM:
        where = "is_online=True" if is_online else "compress_ratio 128"
        raise ArgumentError(f"dsv4jit.{op}: argument 'head_dim' must be 512 with {where} (the V4 cache formats), "
                            f"got {head_dim}")
    try:
        check_batch(op, plan, {"kv_score_input": kv_score_input}, {"out_loc": out_loc})
        row_dtype = kind.row_dtype(kv_score_input.dtype)
        kernel_ape = common.ape_as(op, ape, row_dtype)
        weight = norm_weight if norm_weight.dtype == row_dtype else norm_weight.to(row_dtype)
        one_kernel = runs_fused(compress_ratio, is_online, plan.is_decode, plan.plan_rows.shape[0])
        counts = (plan_row_counts(plan.plan_rows) if block_units(compress_ratio, is_online) and one_kernel
                  and kv_score_input.is_cuda else None)
        fused_op(kv_score_buffer, kv_score_input, kernel_ape, plan.plan_rows, plan.write_rows, weight,
                 common.freq_table(freq_cis), out_loc, kvcache, kvcache_rope, fmt, page_size, head_dim, compress_ratio,
                 plan.is_decode, eps, plan.kernel_num_q_tokens, plan.reads_state, is_online, counts)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), _TENSORS, _OPTIONAL, lambda text: (
            kind.widths(op, text, head_dim, compress_ratio, kv_score_buffer, kv_score_input, ape),
            common.check_freq(op, freq_cis)))
    if not library.tracing() and kv_score_input.is_cuda and not runtime.checks_enabled():
        key = _fast_key(plan, head_dim, compress_ratio, use_fp4, bf16_store, is_online, layout, fp8_2buff,
                        kv_score_buffer, kv_score_input, ape, norm_weight)
        name, params = _choice(is_online, compress_ratio, fmt, kv_score_buffer, kv_score_input)
        fn = runtime.function(name, "run", kv_score_input.device, **params)
        _FAST[key] = _launcher(fn, compress_ratio, head_dim, plan.is_decode, is_online,
                               None if ape.dtype == row_dtype else row_dtype,
                               None if norm_weight.dtype == row_dtype else row_dtype, row_dtype)


def _choice(is_online: bool, compress_ratio: int, store_format: str, state: torch.Tensor,
            inputs: torch.Tensor) -> KernelChoice:
    state_name = common.dtype_name(state, "kv_score_buffer", _OP, STATE_DTYPES)
    if is_online:
        return online_kernel(store_format, state_name)
    return kernel(compress_ratio, store_format, state_name, common.dtype_name(inputs, "kv_score_input", _OP,
                                                                               STATE_DTYPES))


def _launcher(fn, compress_ratio: int, head_dim: int, decode: bool, is_online: bool, ape_dtype, weight_dtype,
              row_dtype):
    """The fast path's call of a resolved signature (ape and the norm weight converted where the
    kernel reads another dtype); it raises, before any launch, what the full path then explains."""
    one_kernel = functools.partial(runs_fused, compress_ratio, is_online, decode)
    # runs_fused alike for no rows and for any number: the choice is the signature's, made once here
    always = None if one_kernel(0) != one_kernel(1 << 31) else one_kernel(0)
    blocks = block_units(compress_ratio, is_online)

    def launch(kv_score_buffer, kv_score_input, ape, plan, norm_weight, norm_eps, freq_cis, out_loc, kvcache,
               kvcache_rope, page_size):
        if plan.compress_ratio != compress_ratio:
            raise ArgumentError("plan of another compress ratio")
        if ape_dtype is not None:
            ape = ape.to(ape_dtype)
        if weight_dtype is not None:
            norm_weight = norm_weight.to(weight_dtype)
        rows = plan.plan_rows
        one = always if always is not None else one_kernel(rows.shape[0])
        if not one:
            buffer = torch.empty((rows.shape[0], head_dim), dtype=row_dtype, device=kv_score_input.device)
            counts = None
        elif blocks:
            buffer, counts = row_scratch(rows, head_dim, row_dtype)
        else:
            buffer = counts = None
        run_fused(fn, kv_score_buffer, kv_score_input, ape, rows, plan.write_rows, norm_weight, freq_cis, out_loc,
                  kvcache, kvcache_rope, None, page_size, norm_eps, plan.kernel_num_q_tokens, decode, plan.reads_state,
                  one, buffer,
                  counts)

    return launch


@binding.calls(("fused", "fused_online"), "run")
def run_fused(fn, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache,
              kvcache_rope, status, page_size, norm_eps, num_q_tokens, is_decode, reads_state, one_kernel, rows,
              row_counts) -> None:
    fn(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache, kvcache_rope,
       status, page_size, norm_eps, num_q_tokens, is_decode, reads_state, one_kernel, rows, row_counts)


@library.custom_op("compress_and_store", mutates_args=("kv_score_buffer", "kvcache", "kvcache_rope"))
def fused_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
             plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], norm_weight: torch.Tensor,
             freq: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, kvcache_rope: Optional[torch.Tensor],
             store_format: str, page_size: int, head_dim: int, compress_ratio: int, is_decode: bool, norm_eps: float,
             num_q_tokens: int, reads_state: bool, is_online: bool = False,
             row_counts: Optional[torch.Tensor] = None) -> None:
    """compress_and_store on unpacked plan tensors (plan_w: None in decode; freq: the real table;
    reads_state: the prefill plan's, True in decode and online; kvcache_rope: the two pools' rope pool,
    else None). Ring c128 on CUDA: row_counts from plan_row_counts() (zero again after the call)."""
    kind = ONLINE if is_online else RING
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc,
                                kvcache, kvcache_rope)
    if device is None:  # the reference of the two steps, the store's arguments checked before the first writes
        rows = torch.empty((plan_rows.shape[0], head_dim), dtype=kind.row_dtype(kv_score_input.dtype))
        check_store(rows, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope, store_format, page_size,
                    compress_ratio, is_decode, num_q_tokens)
        if is_online:
            online_op.impl(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, rows, head_dim, is_decode)
        else:
            compress_op.impl(kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, rows, head_dim, compress_ratio,
                             is_decode, reads_state)
        store_op.impl(rows, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope, store_format, page_size,
                      compress_ratio, is_decode, norm_eps, num_q_tokens)
        return
    name, params = _choice(is_online, compress_ratio, store_format, kv_score_buffer, kv_score_input)
    fn = runtime.function(name, "run", device, **params)
    status = runtime.status_word(device, words=2)
    if status is not None:
        checked.fused(_OP, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, head_dim,
                      compress_ratio)
    # the two steps' rows, or the ring c128 kernel's scratch beside row_counts
    one_kernel = runs_fused(compress_ratio, is_online, is_decode, plan_rows.shape[0])
    blocks = one_kernel and block_units(compress_ratio, is_online)
    rows = None if one_kernel and not blocks else torch.empty(
        (plan_rows.shape[0], head_dim), dtype=kind.row_dtype(kv_score_input.dtype), device=device)
    run_fused(fn, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, norm_weight, freq, out_loc, kvcache,
              kvcache_rope, status, page_size, norm_eps, num_q_tokens, is_decode, reads_state, one_kernel, rows,
              row_counts if blocks else None)
    runtime.raise_status(status, _OP, name, device, params, DESCRIBE)
