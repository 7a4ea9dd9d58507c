"""The DeepSeek-V4.1 ratio-1 and ratio-2 compressors (contract §10.4, contract §10.5), with sglang's names
and signatures: ``c1_decode_norm_rope_store``, ``c2_decode_norm_rope_store`` (decode and speculative
verify), ``c2_prefill_norm_rope_store`` (ragged extends) and ``c2_decode_pool``. CUDA tensors run
csrc/lowratio/ (one launch each), CPU tensors reference/low_ratio.py.

Eager calls of a signature seen before take the fast path: one dict lookup, then the kernel call.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import arguments, geometry, library, runtime
from ..family import Family, KernelChoice
from ..reference import low_ratio as ref
from . import binding, common

_C1 = "c1_decode_norm_rope_store"
_C2_DECODE = "c2_decode_norm_rope_store"
_C2_PREFILL = "c2_prefill_norm_rope_store"
_C2_POOL = "c2_decode_pool"
RATIOS = (1, 2)
HEAD_DIM = geometry.V4_HEAD_DIM


def kernel(ratio: int, store_format: str) -> KernelChoice:
    """The variant a c1 (ratio 1) or c2 (ratio 2) call runs."""
    return f"c{ratio}", {"format": store_format}


FAMILY = Family("low_ratio", lambda cfg: [kernel(ratio, cfg.store_format(ratio, HEAD_DIM))
                                          for ratio, hd in cfg.pairs() if ratio in RATIOS and hd == HEAD_DIM])

_FAST = runtime.call_cache()


def _bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: its bytes (an fp8-typed pool is viewed as uint8)."""
    return k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)


def _format(op: str, layout) -> str:
    return common.store_format(op, HEAD_DIM, False, False, "head_dim", common.layout_value(op, layout))


def _scalars(op: str, eps, page_size, ints: dict) -> float:
    arguments.integer(op, "page_size", page_size)
    for name, value in ints.items():
        arguments.integer(op, name, value)
    return arguments.positive(op, "eps", eps)


def c1_decode_norm_rope_store(kv_input: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor,
                              out_loc: torch.Tensor, eps: float, freqs_cis: torch.Tensor, k_cache: torch.Tensor, *,
                              page_size: int, layout="v4", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ratio 1, decode and extend alike: ``out[r]`` = the bf16 latent (RMSNorm) of ``kv_input[r]`` (bf16
    ``[N, 512]``, the raw projection) for every row, padded ones included; rows with ``out_loc > 0``
    (int32 or int64) store it, RoPE at ``positions[r]``, at slot ``out_loc`` of ``k_cache`` (uint8 or fp8
    ``[pages, page_bytes(layout, page_size)]``). Returns ``out`` (bf16 ``[N, 512]``, allocated if None)."""
    if type(page_size) is int and type(eps) is float and 0.0 < eps < math.inf and not library.tracing():
        try:
            launch = _FAST[(_C1, layout, kv_input.device)]
            return launch(kv_input, norm_weight, positions, out_loc, freqs_cis, k_cache, page_size, eps, out)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    op = _C1
    eps = _scalars(op, eps, page_size, {})
    fmt = _format(op, layout)
    try:
        out = _out(out, kv_input)
        c1_op(kv_input, norm_weight, positions, out_loc, common.freq_table(freqs_cis), _bytes(k_cache), out, fmt,
              page_size, eps)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("kv_input", "norm_weight", "positions", "out_loc", "freqs_cis", "k_cache"),
                            ("out",))
    _remember(_C1, layout, kv_input, lambda fn: _c1_launcher(fn), 1, fmt)
    return out


def _out(out: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    return torch.empty((rows.shape[0], HEAD_DIM), dtype=torch.bfloat16, device=rows.device) if out is None else out


def _remember(op: str, layout, rows: torch.Tensor, make, ratio: int, fmt: str, export: str = "run") -> None:
    """After a successful unchecked eager call on CUDA tensors: the fast path's launcher of its signature."""
    if not library.tracing() and rows.is_cuda and not runtime.checks_enabled():
        name, params = kernel(ratio, fmt)
        _FAST[(op, layout, rows.device)] = make(runtime.function(name, export, rows.device, **params))


def _c1_launcher(fn):
    def launch(kv_input, norm_weight, positions, out_loc, freqs_cis, k_cache, page_size, eps, out):
        out = _out(out, kv_input)
        run_c1(fn, kv_input, norm_weight, positions, out_loc, common.freq_table(freqs_cis), _bytes(k_cache), out, None,
               page_size, eps)
        return out

    return launch


@binding.calls(("c1",), "run")
def run_c1(fn, kv_input, norm_weight, positions, out_loc, freqs_cis, k_cache, out, status, page_size, eps) -> None:
    fn(kv_input, norm_weight, positions, out_loc, freqs_cis, k_cache, out, status, page_size, eps)


@library.custom_op("c1_norm_rope_store", mutates_args=("k_cache", "out"))
def c1_op(kv_input: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor,
          freq: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, store_format: str, page_size: int,
          eps: float) -> None:
    """c1_decode_norm_rope_store (freq: the real (cos, sin) table; k_cache: its bytes)."""
    device = common.cuda_device(kv_input, norm_weight, positions, out_loc, freq, k_cache, out)
    if device is None:
        ref.c1_decode_norm_rope_store(kv_input, norm_weight, positions, out_loc, eps, freq, k_cache,
                                      page_size=page_size, layout=geometry.format_options(store_format)["layout"],
                                      out=out)
        return
    name, params = kernel(1, store_format)
    status = runtime.status_word(device)
    run_c1(runtime.function(name, "run", device, **params), kv_input, norm_weight, positions, out_loc, freq, k_cache,
           out, status, page_size, eps)
    runtime.raise_status(status, _C1, name, device, params)


def c2_decode_norm_rope_store(kv_input: torch.Tensor, kv_state: torch.Tensor, norm_weight: torch.Tensor,
                              positions: torch.Tensor, req: torch.Tensor, raw_out_loc: torch.Tensor, eps: float,
                              freqs_cis: torch.Tensor, k_cache: torch.Tensor, *, page_size: int, ring_size: int,
                              draft_len: int = 1, layout="v4", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ratio 2, decode (one row per request) or target verify (``draft_len`` > 1: request-major blocks of
    draft_len consecutive positions; ``ring_size > draft_len``): ``kv_input`` fp32 ``[N, 1024]`` (| kv |
    score |) rows; an even position parks its row in the pair ring ``kv_state`` (fp32 ``[rows, 1024]``, row
    ``req · ring_size + position mod ring_size``); an odd one pools with its partner (the row before it in
    its block, else the ring), writes the bf16 latent to ``out[r]`` and stores it at ``raw_out_loc >> 1``
    with RoPE at ``position − 1``. ``raw_out_loc`` 0: a padded row (nothing read or written). ``req``:
    int64. Returns ``out`` (bf16 ``[N, 512]``; only closing rows written)."""
    if (type(page_size) is int and type(ring_size) is int and type(draft_len) is int and type(eps) is float
            and 0.0 < eps < math.inf and not library.tracing()):
        try:
            launch = _FAST[(_C2_DECODE, layout, kv_input.device)]
            return launch(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, page_size,
                          ring_size, draft_len, eps, out)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    op = _C2_DECODE
    eps = _scalars(op, eps, page_size, {"ring_size": ring_size, "draft_len": draft_len})
    fmt = _format(op, layout)
    try:
        out = _out(out, kv_input)
        c2_decode_op(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, common.freq_table(freqs_cis),
                     _bytes(k_cache), out, fmt, page_size, ring_size, draft_len, eps)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("kv_input", "kv_state", "norm_weight", "positions", "req",
                                              "raw_out_loc", "freqs_cis", "k_cache"), ("out",))
    _remember(_C2_DECODE, layout, kv_input, _c2_decode_launcher, 2, fmt, "decode")
    return out


def _c2_decode_launcher(fn):
    def launch(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, page_size, ring_size,
               draft_len, eps, out):
        out = _out(out, kv_input)
        run_c2_decode(fn, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, common.freq_table(freqs_cis),
                      _bytes(k_cache), out, None, page_size, ring_size, draft_len, eps)
        return out

    return launch


@binding.calls(("c2",), "decode")
def run_c2_decode(fn, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, out, status,
                  page_size, ring_size, draft_len, eps) -> None:
    fn(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, out, status, page_size,
       ring_size, draft_len, eps)


@library.custom_op("c2_decode_norm_rope_store", mutates_args=("kv_state", "k_cache", "out"))
def c2_decode_op(kv_input: torch.Tensor, kv_state: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor,
                 req: torch.Tensor, raw_out_loc: torch.Tensor, freq: torch.Tensor, k_cache: torch.Tensor,
                 out: torch.Tensor, store_format: str, page_size: int, ring_size: int, draft_len: int,
                 eps: float) -> None:
    """c2_decode_norm_rope_store (freq: the real (cos, sin) table; k_cache: its bytes)."""
    device = common.cuda_device(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freq, k_cache, out)
    if device is None:
        ref.c2_decode_norm_rope_store(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freq, k_cache,
                                      page_size=page_size, ring_size=ring_size, draft_len=draft_len,
                                      layout=geometry.format_options(store_format)["layout"], out=out)
        return
    name, params = kernel(2, store_format)
    status = runtime.status_word(device)
    run_c2_decode(runtime.function(name, "decode", device, **params), kv_input, kv_state, norm_weight, positions, req,
                  raw_out_loc, freq, k_cache, out, status, page_size, ring_size, draft_len, eps)
    runtime.raise_status(status, _C2_DECODE, name, device, params)


def c2_prefill_norm_rope_store(kv_input: torch.Tensor, kv_state: torch.Tensor, norm_weight: torch.Tensor,
                               positions: torch.Tensor, req: torch.Tensor, raw_out_loc: torch.Tensor, eps: float,
                               freqs_cis: torch.Tensor, k_cache: torch.Tensor, extend_start_loc: torch.Tensor,
                               extend_seq_lens: torch.Tensor, *, page_size: int, ring_size: int, layout="v4",
                               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """c2_decode_norm_rope_store for an extend batch: request ``i`` owns rows ``[extend_start_loc[i],
    + extend_seq_lens[i])`` (int32); an odd row pools with the row before it when that is its partner
    (same request, position − 1, not padding), else with the ring; then each request's last
    ``min(len, ring_size)`` rows are written back to the ring, after every read of the step. One launch.
    Returns ``out``."""
    if (type(page_size) is int and type(ring_size) is int and type(eps) is float and 0.0 < eps < math.inf
            and not library.tracing()):
        try:
            launch = _FAST[(_C2_PREFILL, layout, kv_input.device)]
            return launch(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache,
                          extend_start_loc, extend_seq_lens, page_size, ring_size, eps, out)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    op = _C2_PREFILL
    eps = _scalars(op, eps, page_size, {"ring_size": ring_size})
    fmt = _format(op, layout)
    try:
        out = _out(out, kv_input)
        c2_prefill_op(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, common.freq_table(freqs_cis),
                      _bytes(k_cache), extend_start_loc, extend_seq_lens, out, fmt, page_size, ring_size, eps)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("kv_input", "kv_state", "norm_weight", "positions", "req",
                                              "raw_out_loc", "freqs_cis", "k_cache", "extend_start_loc",
                                              "extend_seq_lens"), ("out",))
    _remember(_C2_PREFILL, layout, kv_input, _c2_prefill_launcher, 2, fmt, "prefill")
    return out


def _c2_prefill_launcher(fn):
    def launch(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, extend_start_loc,
               extend_seq_lens, page_size, ring_size, eps, out):
        out = _out(out, kv_input)
        run_c2_prefill(fn, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, common.freq_table(freqs_cis),
                       _bytes(k_cache), extend_start_loc, extend_seq_lens, out, None, page_size, ring_size, eps)
        return out

    return launch


@binding.calls(("c2",), "prefill")
def run_c2_prefill(fn, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache,
                   extend_start_loc, extend_seq_lens, out, status, page_size, ring_size, eps) -> None:
    fn(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, extend_start_loc,
       extend_seq_lens, out, status, page_size, ring_size, eps)


@library.custom_op("c2_prefill_norm_rope_store", mutates_args=("kv_state", "k_cache", "out"))
def c2_prefill_op(kv_input: torch.Tensor, kv_state: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor,
                  req: torch.Tensor, raw_out_loc: torch.Tensor, freq: torch.Tensor, k_cache: torch.Tensor,
                  extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor, out: torch.Tensor, store_format: str,
                  page_size: int, ring_size: int, eps: float) -> None:
    """c2_prefill_norm_rope_store (freq: the real (cos, sin) table; k_cache: its bytes)."""
    device = common.cuda_device(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freq, k_cache,
                                extend_start_loc, extend_seq_lens, out)
    if device is None:
        ref.c2_prefill_norm_rope_store(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freq, k_cache,
                                       extend_start_loc, extend_seq_lens, page_size=page_size, ring_size=ring_size,
                                       layout=geometry.format_options(store_format)["layout"], out=out)
        return
    name, params = kernel(2, store_format)
    status = runtime.status_word(device)
    run_c2_prefill(runtime.function(name, "prefill", device, **params), kv_input, kv_state, norm_weight, positions,
                   req, raw_out_loc, freq, k_cache, extend_start_loc, extend_seq_lens, out, status, page_size,
                   ring_size, eps)
    runtime.raise_status(status, _C2_PREFILL, name, device, params)
