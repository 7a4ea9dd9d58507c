"""``compress_norm_rope_store``: RMSNorm, RoPE (+ Hadamard for the indexer), quantize and store the
compressed rows in the paged cache (contract §6). CUDA tensors run csrc/store/store.cuh, CPU tensors
reference/store.py."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import arguments, geometry, library, runtime
from ..arguments import STATE_DTYPES
from ..errors import ArgumentError
from ..geometry import RATIOS
from ..family import Family, KernelChoice
from ..plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan, check_batch
from ..reference import store as ref_store
from . import binding, checked, common

_OP = "compress_norm_rope_store"


def kernel(dtype: str, store_format: str) -> KernelChoice:
    """The variant a call runs (dtype of the compressed rows by kernel name: ``fp32``, ``bf16``)."""
    return "store", {"dtype": dtype, "format": store_format}


FAMILY = Family("store", lambda cfg: [kernel(cfg.output, cfg.store_format(ratio, hd))
                                      for ratio, hd in cfg.pairs() if ratio in RATIOS])

_FAST = runtime.call_cache()


def compress_norm_rope_store(kv: torch.Tensor, plan: Union[CompressorPrefillPlan, CompressorDecodePlan], *,
                             norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                             out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int, use_fp4: bool = False,
                             bf16_store: bool = False, layout: str = "v4", fp8_2buff: bool = False,
                             kvcache_rope: Optional[torch.Tensor] = None) -> None:
    """RMSNorm, RoPE at position seq_len − R (+ Hadamard for the indexer), quantize, store at out_loc.

    kv: compressed rows ``[plan.plan_rows.shape[0], head_dim]`` (fp32 or bf16), as compress_forward returns.
    Prefill processes the valid plan rows and stores at ``out_loc[ragged_id]`` (out_loc covers every
    token of the step); decode processes the rows at a compress boundary and stores at ``out_loc[b]``.
    kvcache: ``[num_pages, page_bytes]`` uint8 view of the paged cache; formats by head_dim and flags:
    512 -> V4 fp8 latent (or bf16 rows with bf16_store), 128 -> indexer fp8 (or fp4 with use_fp4).
    layout (a KVLayout or its name, any case): a DeepSeek-V4.1 layout stores 512-dim rows in its encoding
    instead (contract §10.3); fp8_2buff=True stores the V4 fp8 latent in two pools, the rope dims as bf16
    rows of kvcache_rope ``[num_pages · page_size, 128]`` uint8.
    """
    if (type(page_size) is int and type(norm_eps) is float and 0.0 < norm_eps < math.inf
            and not library.tracing()):
        try:
            launch = _FAST[_fast_key(plan, use_fp4, bf16_store, layout, fp8_2buff, kv, norm_weight)]
            return launch(kv, plan, norm_weight, norm_eps, freq_cis, out_loc, kvcache, kvcache_rope, page_size)
        except (KeyError, AttributeError, TypeError, ValueError, IndexError):
            pass  # a new signature, or an error the full path explains
    return _compress_norm_rope_store(kv, plan, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size, use_fp4,
                                     bf16_store, layout, fp8_2buff, kvcache_rope)


def _fast_key(plan, use_fp4: bool, bf16_store: bool, layout, fp8_2buff: bool, kv: torch.Tensor,
              norm_weight: torch.Tensor) -> tuple:
    """What picks a call's launcher (freq_cis takes no part: the kernel reads either form of the table
    and checks its dtype; `layout` as given: a KVLayout hashes as its value)."""
    return plan.__class__, use_fp4, bf16_store, layout, fp8_2buff, kv.dtype, kv.shape[1], norm_weight.dtype, kv.device


def _compress_norm_rope_store(kv, plan, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size, use_fp4,
                              bf16_store, layout, fp8_2buff, kvcache_rope) -> None:
    """compress_norm_rope_store with every check; remembers the call's launcher for the fast path."""
    op = _OP
    plan = as_plan(op, plan)
    if (type(page_size) is not int or type(use_fp4) is not bool or type(bf16_store) is not bool
            or type(fp8_2buff) is not bool):
        common.scalars(op, {"page_size": page_size}, {"use_fp4": use_fp4, "bf16_store": bf16_store,
                                                       "fp8_2buff": fp8_2buff})
    eps = arguments.positive(op, "norm_eps", norm_eps)
    layout_name = common.layout_value(op, layout)
    try:
        check_batch(op, plan, locations={"out_loc": out_loc})
        if kv.dim() != 2:
            raise ArgumentError(f"dsv4jit.{op}: argument 'kv' must be 2-D [rows, head_dim], got shape {list(kv.shape)}")
        fmt = common.store_format(op, kv.shape[1], use_fp4, bf16_store, "kv: head_dim (kv.shape[1])", layout_name,
                                  fp8_2buff)
        common.check_rope_pool(op, fp8_2buff, kvcache_rope)
        weight = norm_weight if norm_weight.dtype == kv.dtype else norm_weight.to(kv.dtype)
        store_op(kv, plan.plan_rows, weight, common.freq_table(freq_cis), out_loc, kvcache, kvcache_rope, fmt,
                 page_size, plan.compress_ratio, plan.is_decode, eps, plan.kernel_num_q_tokens)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("kv", "norm_weight", "freq_cis", "out_loc", "kvcache"), ("kvcache_rope",),
                            lambda text: common.check_freq(op, freq_cis))
    if not library.tracing() and kv.is_cuda and not runtime.checks_enabled():
        name, params = kernel(common.dtype_name(kv, "kv", op, STATE_DTYPES), fmt)
        _FAST[_fast_key(plan, use_fp4, bf16_store, layout, fp8_2buff, kv, norm_weight)] = _launcher(
            runtime.function(name, "run", kv.device, **params), kv.dtype)


def _launcher(fn, dtype: torch.dtype):
    """The fast path's call of a resolved signature (the norm weight converted to the rows' dtype
    where it differs); it raises, before any launch, what the full path then explains."""

    def launch(kv, plan, norm_weight, norm_eps, freq_cis, out_loc, kvcache, kvcache_rope, page_size):
        if norm_weight.dtype != dtype:
            norm_weight = norm_weight.to(dtype)
        run_store(fn, kv, plan.plan_rows, norm_weight, freq_cis, out_loc, kvcache, kvcache_rope, None, page_size,
                  plan.compress_ratio, plan.is_decode, norm_eps, plan.kernel_num_q_tokens)

    return launch


@binding.calls(("store",), "run")
def run_store(fn, kv, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope, status, page_size, compress_ratio,
              is_decode, norm_eps, num_q_tokens) -> None:
    fn(kv, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope, status, page_size, compress_ratio, is_decode,
       norm_eps, num_q_tokens)


@library.custom_op("norm_rope_store", mutates_args=("kvcache", "kvcache_rope"))
def store_op(kv: torch.Tensor, plan_rows: torch.Tensor, norm_weight: torch.Tensor, freq: torch.Tensor,
             out_loc: torch.Tensor, kvcache: torch.Tensor, kvcache_rope: Optional[torch.Tensor], store_format: str,
             page_size: int, compress_ratio: int, is_decode: bool, norm_eps: float, num_q_tokens: int) -> None:
    """compress_norm_rope_store on unpacked plan rows (freq: the real (cos, sin) table; num_q_tokens -1:
    not recorded by the plan; kvcache_rope: the two-pool format's rope pool, else None)."""
    device = common.cuda_device(kv, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope)
    if device is None:
        ref_store.compress_norm_rope_store(kv, plan_rows, is_decode=is_decode, compress_ratio=compress_ratio,
                                           norm_weight=norm_weight, norm_eps=norm_eps,
                                           freq_cis=common.complex_freq(freq), out_loc=out_loc, kvcache=kvcache,
                                           page_size=page_size, num_q_tokens=num_q_tokens, kvcache_rope=kvcache_rope,
                                           **geometry.format_options(store_format))
        return
    name, params = kernel(common.dtype_name(kv, "kv", _OP, STATE_DTYPES), store_format)  # contract §8.4
    fn = runtime.function(name, "run", device, **params)
    status = runtime.status_word(device)
    if status is not None:
        checked.store(_OP, kv, plan_rows, norm_weight, freq, out_loc, compress_ratio, is_decode)
    run_store(fn, kv, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope, status, page_size, compress_ratio,
              is_decode, norm_eps, num_q_tokens)
    runtime.raise_status(status, _OP, name, device, params)


def check_store(rows: torch.Tensor, plan_rows: torch.Tensor, norm_weight: torch.Tensor, freq: torch.Tensor,
                out_loc: torch.Tensor, kvcache: torch.Tensor, kvcache_rope: Optional[torch.Tensor], store_format: str,
                page_size: int, compress_ratio: int, is_decode: bool, num_q_tokens: int) -> None:
    """The store step's checks on the CPU (rows: its input, values not read), for a fused op to run
    before its compress step writes the state."""
    ref_store.checked_store(rows, plan_rows, is_decode=is_decode, compress_ratio=compress_ratio,
                            norm_weight=norm_weight, freq_cis=common.complex_freq(freq), out_loc=out_loc,
                            kvcache=kvcache, page_size=page_size, num_q_tokens=num_q_tokens, kvcache_rope=kvcache_rope,
                            **geometry.format_options(store_format))
