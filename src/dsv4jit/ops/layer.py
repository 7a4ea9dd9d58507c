"""``compress_and_store_c4_layer``: a c4 layer's two compressor steps — the core latent (head_dim 512,
V4 cache) and the indexer keys (head_dim 128, indexer cache) — in one op and one launch per pass
(csrc/fused/layer.cuh), over the layer's one plan. Each compressor's caches and states are
byte-identical to its own ``compress_and_store`` call. CPU tensors run the two ``compress_and_store``
references, every argument of both checked before either writes.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import arguments, library, runtime
from ..arguments import STATE_DTYPES
from ..errors import ArgumentError, argument_error
from ..family import Family, KernelChoice
from ..geometry import INDEXER_HEAD_DIM, V4_HEAD_DIM
from ..plan import CompressorDecodePlan, CompressorPrefillPlan, as_plan, check_batch
from . import binding, checked, common
from .fused import DESCRIBE, fused_op

_OP = "compress_and_store_c4_layer"
RATIO = 4
_CORE = ("kv_score_buffer", "kv_score_input", "ape", "norm_weight", "out_loc", "kvcache")
_INDEXER = tuple(f"indexer_{name}" for name in _CORE)
_SHARED = ("plan", "freq_cis")
_PLAN_FIELDS = {"plan_c": "plan", "plan_w": "plan", "plan_d": "plan"}


def kernel(core_format: str, indexer_format: str, state: str, input: str) -> KernelChoice:
    """The variant a call runs (dtypes by kernel name: ``fp32``, ``bf16``)."""
    return "fused_c4_layer", {"core_format": core_format, "indexer_format": indexer_format, "state": state,
                              "input": input}


FAMILY = Family("c4_layer", lambda cfg: [kernel(cfg.store_format(RATIO, V4_HEAD_DIM),
                                                cfg.store_format(RATIO, INDEXER_HEAD_DIM), cfg.state, cfg.input)]
                if {V4_HEAD_DIM, INDEXER_HEAD_DIM} <= set(cfg.head_dims.get(RATIO, ())) else [])

_FAST = runtime.call_cache()


def compress_and_store_c4_layer(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
                                indexer_kv_score_buffer: torch.Tensor, indexer_kv_score_input: torch.Tensor,
                                indexer_ape: torch.Tensor, plan: Union[CompressorPrefillPlan, CompressorDecodePlan],
                                *, norm_weight: torch.Tensor, indexer_norm_weight: torch.Tensor, norm_eps: float,
                                freq_cis: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int,
                                indexer_kvcache: torch.Tensor, indexer_out_loc: Optional[torch.Tensor] = None,
                                indexer_page_size: Optional[int] = None, use_fp4: bool = False,
                                bf16_store: bool = False, layout: str = "v4", fp8_2buff: bool = False,
                                kvcache_rope: Optional[torch.Tensor] = None) -> None:
    """``compress_and_store`` of a c4 layer's core compressor (head_dim 512: the first six tensors,
    V4 cache, ``bf16_store``) and of its indexer (head_dim 128: the ``indexer_*`` tensors, indexer
    cache, ``use_fp4``), both on the layer's c4 `plan`, with one rope table and norm epsilon.
    ``indexer_out_loc`` and ``indexer_page_size`` default to the core's. Decode is one launch;
    prefill two (both pool-and-store passes, then both state-ring write passes), or one where the
    plan's pool passes read no state row (``plan.reads_state`` False). ``layout``, ``fp8_2buff``,
    ``kvcache_rope``: the core cache's KVLayout (or its name, any case) or the V4 latent in two pools,
    as compress_norm_rope_store takes them; the indexer cache keeps its format."""
    indexer_out_loc = out_loc if indexer_out_loc is None else indexer_out_loc
    indexer_page_size = page_size if indexer_page_size is None else indexer_page_size
    if (type(page_size) is int and type(indexer_page_size) is int and type(norm_eps) is float
            and 0.0 < norm_eps < math.inf and not library.tracing()):
        try:
            launch = _FAST[_fast_key(plan, use_fp4, bf16_store, layout, fp8_2buff, kv_score_buffer, kv_score_input)]
            return launch(kv_score_buffer, kv_score_input, ape, norm_weight, out_loc, kvcache, kvcache_rope, page_size,
                          indexer_kv_score_buffer, indexer_kv_score_input, indexer_ape, indexer_norm_weight,
                          indexer_out_loc, indexer_kvcache, indexer_page_size, plan, freq_cis, norm_eps)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    return _layer(plan, dict(  # not locals(): torch.compile traces this call
        kv_score_buffer=kv_score_buffer, kv_score_input=kv_score_input, ape=ape, norm_weight=norm_weight,
        out_loc=out_loc, kvcache=kvcache, page_size=page_size, indexer_kv_score_buffer=indexer_kv_score_buffer,
        indexer_kv_score_input=indexer_kv_score_input, indexer_ape=indexer_ape,
        indexer_norm_weight=indexer_norm_weight, indexer_out_loc=indexer_out_loc, indexer_kvcache=indexer_kvcache,
        indexer_page_size=indexer_page_size, freq_cis=freq_cis, norm_eps=norm_eps, use_fp4=use_fp4,
        bf16_store=bf16_store, layout=layout, fp8_2buff=fp8_2buff, kvcache_rope=kvcache_rope))


def _fast_key(plan, use_fp4: bool, bf16_store: bool, layout, fp8_2buff: bool, buffer: torch.Tensor,
              inputs: torch.Tensor) -> tuple:
    """What picks a call's launcher (the launcher converts ape and the weights, the kernel checks freq_cis)."""
    return plan.__class__, use_fp4, bf16_store, layout, fp8_2buff, buffer.dtype, inputs.dtype, inputs.device


def _layer(plan, g: dict) -> None:
    """The full path (`g`: the call's other arguments by name): every check, then the custom op (the
    kernel, or on the CPU the two steps' references); remembers the call's launcher for the fast path."""
    op = _OP
    plan = as_plan(op, plan)
    for name in ("page_size", "indexer_page_size"):
        arguments.integer(op, name, g[name])
    for name in ("use_fp4", "bf16_store", "fp8_2buff"):
        arguments.flag(op, name, g[name])
    eps = arguments.positive(op, "norm_eps", g["norm_eps"])
    arguments.tensors(op, {name: g[name] for name in (*_CORE, *_INDEXER, "freq_cis")})
    if plan.compress_ratio != RATIO:
        raise ArgumentError(f"dsv4jit.{op}: argument 'plan' must be a c4 plan, "
                            f"got compress_ratio {plan.compress_ratio}")
    core_format = common.store_format(op, V4_HEAD_DIM, False, g["bf16_store"], "head_dim",
                                      common.layout_value(op, g["layout"]), g["fp8_2buff"])
    common.check_rope_pool(op, g["fp8_2buff"], g["kvcache_rope"])
    indexer_format = common.store_format(op, INDEXER_HEAD_DIM, g["use_fp4"], False, "head_dim")
    dtype = g["kv_score_input"].dtype
    t = {name: g[name] for name in (*_CORE, *_INDEXER)}
    for name in ("ape", "indexer_ape", "norm_weight", "indexer_norm_weight"):
        if t[name].dtype != dtype and t[name].dtype.is_floating_point:
            t[name] = t[name].to(dtype)
    try:
        check_batch(op, plan, {n: g[n] for n in ("kv_score_input", "indexer_kv_score_input")},
                    {n: g[n] for n in ("out_loc", "indexer_out_loc")})
        layer_op(*(t[name] for name in _CORE), g["kvcache_rope"], g["page_size"], *(t[name] for name in _INDEXER),
                 g["indexer_page_size"], plan.plan_rows, plan.write_rows, common.freq_table(g["freq_cis"]), eps,
                 plan.kernel_num_q_tokens, plan.is_decode, plan.reads_state, core_format, indexer_format)
    except (ValueError, TypeError, AttributeError) as e:
        common.check_freq(op, g["freq_cis"])
        # an indexer argument that defaulted to the core's is reported under the name the caller gave
        same = {name for name in ("out_loc", "page_size") if g["indexer_" + name] is g[name]}
        raise _reworded(e, same) from None
    if not library.tracing() and g["kv_score_input"].is_cuda and not runtime.checks_enabled():
        key = _fast_key(plan, g["use_fp4"], g["bf16_store"], g["layout"], g["fp8_2buff"], g["kv_score_buffer"],
                        g["kv_score_input"])
        name, params = _choice(core_format, indexer_format, g["kv_score_buffer"], g["kv_score_input"])
        _FAST[key] = _launcher(runtime.function(name, "run", g["kv_score_input"].device, **params), dtype)


def _choice(core_format: str, indexer_format: str, state: torch.Tensor, inputs: torch.Tensor) -> KernelChoice:
    return kernel(core_format, indexer_format, common.dtype_name(state, "kv_score_buffer", _OP, STATE_DTYPES),
                  common.dtype_name(inputs, "kv_score_input", _OP, STATE_DTYPES))


def _reworded(error: Exception, same: set = frozenset()) -> Exception:
    """An error of the core (``[core]``) or the indexer (``[indexer]``) step as the layer op's own:
    the indexer's arguments get their ``indexer_`` names, except those in `same` (the caller passed
    one value for both) and the shared plan and rope table."""
    text = str(error)
    for part, prefix in (("[core]", ""), ("[indexer]", "indexer_")):
        head = f"dsv4jit.{_OP}{part}: argument '"
        if text.startswith(head):
            name = text[len(head):].split("'", 1)[0]
            shared = name in _SHARED or name in same or name.startswith("plan")
            text = f"dsv4jit.{_OP}: argument '{name if shared else prefix + name}" + text[len(head) + len(name):]
        text = text.replace(f"dsv4jit.{_OP}{part}", f"dsv4jit.{_OP} ({part[1:-1]})")
    return argument_error(error, text)


@library.custom_op("compress_and_store_c4_layer",
                   mutates_args=("kv_score_buffer", "kvcache", "kvcache_rope", "indexer_kv_score_buffer",
                                 "indexer_kvcache"))
def layer_op(kv_score_buffer: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor,
             norm_weight: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor,
             kvcache_rope: Optional[torch.Tensor], page_size: int,
             indexer_kv_score_buffer: torch.Tensor, indexer_kv_score_input: torch.Tensor, indexer_ape: torch.Tensor,
             indexer_norm_weight: torch.Tensor, indexer_out_loc: torch.Tensor, indexer_kvcache: torch.Tensor,
             indexer_page_size: int, plan_rows: torch.Tensor, plan_w: Optional[torch.Tensor], freq: torch.Tensor,
             norm_eps: float, num_q_tokens: int, is_decode: bool, reads_state: bool, core_format: str,
             indexer_format: str) -> None:
    """compress_and_store_c4_layer on unpacked plan tensors (plan_w: None in decode; freq: the real table;
    reads_state: the prefill plan's, True in decode)."""
    device = common.cuda_device(kv_score_buffer, kv_score_input, ape, norm_weight, out_loc, kvcache, kvcache_rope,
                                indexer_kv_score_buffer, indexer_kv_score_input, indexer_ape, indexer_norm_weight,
                                indexer_out_loc, indexer_kvcache, plan_rows, plan_w, freq)
    if device is None:  # the indexer into copies first: a bad argument of either step writes nothing
        staged_state, staged_cache = indexer_kv_score_buffer.clone(), indexer_kvcache.clone()
        steps = ((f"{_OP}[indexer]", INDEXER_HEAD_DIM, indexer_format, staged_state, indexer_kv_score_input,
                  indexer_ape, indexer_norm_weight, indexer_out_loc, staged_cache, None, indexer_page_size),
                 (f"{_OP}[core]", V4_HEAD_DIM, core_format, kv_score_buffer, kv_score_input, ape, norm_weight, out_loc,
                  kvcache, kvcache_rope, page_size))
        for step, hd, fmt, state, inputs, step_ape, weight, locs, cache, rope, page in steps:
            try:
                fused_op.impl(state, inputs, step_ape, plan_rows, plan_w, weight, freq, locs, cache, rope, fmt, page,
                              hd, RATIO, is_decode, norm_eps, num_q_tokens, reads_state)
            except (ValueError, TypeError) as e:
                raise arguments.reworded(step, e, (*_CORE, "freq_cis", "page_size"), _PLAN_FIELDS) from None
        indexer_kv_score_buffer.copy_(staged_state)
        indexer_kvcache.copy_(staged_cache)
        return
    name, params = _choice(core_format, indexer_format, kv_score_buffer, kv_score_input)
    status = runtime.status_word(device, words=4)
    if status is not None:
        checked.layer(_OP, plan_rows, plan_w, freq, RATIO, (kv_score_input, ape, norm_weight, out_loc),
                      (indexer_kv_score_input, indexer_ape, indexer_norm_weight, indexer_out_loc))
    run_layer(runtime.function(name, "run", device, **params), kv_score_buffer, kv_score_input, ape, norm_weight,
              out_loc, kvcache, kvcache_rope, page_size, indexer_kv_score_buffer, indexer_kv_score_input, indexer_ape,
              indexer_norm_weight, indexer_out_loc, indexer_kvcache, indexer_page_size, plan_rows, plan_w, freq,
              norm_eps, num_q_tokens, status, is_decode, reads_state)
    if status is not None and any(status.tolist()):
        describe = [runtime.function(name, DESCRIBE[i % 2], device, **params) for i in range(4)]
        texts = [f"{'core' if i < 2 else 'indexer'}: {describe[i](w)}" for i, w in enumerate(status.tolist()) if w]
        raise ArgumentError(f"dsv4jit.{_OP} (checked mode): {'; '.join(texts)}")


def _launcher(fn, row_dtype: torch.dtype):
    """The fast path's call of a resolved signature: ape and the norm weights converted to the rows'
    dtype where they differ; it raises, before any launch, what the full path then explains."""

    def launch(buffer, inputs, ape, weight, out_loc, kvcache, kvcache_rope, page_size, i_buffer, i_inputs, i_ape,
               i_weight, i_out_loc, i_kvcache, i_page_size, plan, freq_cis, norm_eps):
        if plan.compress_ratio != RATIO:
            raise ArgumentError("not a c4 plan")
        if ape.dtype != row_dtype:
            ape = _as_rows(ape, row_dtype)
        if i_ape.dtype != row_dtype:
            i_ape = _as_rows(i_ape, row_dtype)
        if weight.dtype != row_dtype:
            weight = _as_rows(weight, row_dtype)
        if i_weight.dtype != row_dtype:
            i_weight = _as_rows(i_weight, row_dtype)
        run_layer(fn, buffer, inputs, ape, weight, out_loc, kvcache, kvcache_rope, page_size, i_buffer, i_inputs, i_ape,
                  i_weight, i_out_loc, i_kvcache, i_page_size, plan.plan_rows, plan.write_rows, freq_cis, norm_eps,
                  plan.kernel_num_q_tokens, None, plan.is_decode, plan.reads_state)

    return launch


@binding.calls(("fused_c4_layer",), "run")
def run_layer(fn, kv_score_buffer, kv_score_input, ape, norm_weight, out_loc, kvcache, kvcache_rope, page_size,
              indexer_kv_score_buffer, indexer_kv_score_input, indexer_ape, indexer_norm_weight, indexer_out_loc,
              indexer_kvcache, indexer_page_size, plan_rows, plan_w, freq, norm_eps, num_q_tokens, status, is_decode,
              reads_state) -> None:
    fn(kv_score_buffer, kv_score_input, ape, norm_weight, out_loc, kvcache, kvcache_rope, page_size,
       indexer_kv_score_buffer, indexer_kv_score_input, indexer_ape, indexer_norm_weight, indexer_out_loc,
       indexer_kvcache, indexer_page_size, plan_rows, plan_w, freq, norm_eps, num_q_tokens, status, is_decode,
       reads_state)


def _as_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating-point ape or norm weight in the rows' dtype, as the full path converts it; a tensor
    of another dtype goes as it is, for the kernel's check to name."""
    return t.to(dtype) if t.dtype.is_floating_point else t
