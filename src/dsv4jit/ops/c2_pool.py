"""``c2_decode_pool`` (contract §10.5): ratio-2 decode pair pooling alone, sglang's non-fused decode
path (the norm, RoPE and store then run as other ops), with its name and signature. CUDA tensors run
csrc/lowratio/c2_pool.cuh, CPU tensors reference/low_ratio.py.
"""

from __future__ import annotations

import torch

from .. import arguments, library, runtime
from ..family import Family
from ..reference import low_ratio as ref
from . import binding, common

_OP = "c2_decode_pool"
_TENSORS = ("kv", "score", "pos", "raw_out_loc", "out_loc", "req", "state_kv", "state_score")

#: The ratio-2 layers' decode pooling, where a model configuration has ratio-2 compressors.
FAMILY = Family("c2_decode_pool", lambda cfg: [("c2_pool", {})] if 2 in cfg.head_dims else [])

_FAST = runtime.call_cache()


def c2_decode_pool(kv: torch.Tensor, score: torch.Tensor, pos: torch.Tensor, raw_out_loc: torch.Tensor,
                   out_loc: torch.Tensor, req: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                   pad_row: int, *, ring_size: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ratio-2 decode pair pooling: ``kv``, ``score`` fp32 ``[N, 512]``; ``pos``, ``req`` int64;
    ``raw_out_loc``, ``out_loc`` int32 or int64 (``c2_out_loc``: ``raw // 2`` at an odd position, −1 at an
    even one, 0 for padding). ``state_kv`` / ``state_score`` (rows of at least 512 fp32 values, column
    stride 1: the | kv | score | halves of a pair ring with ring_size > 0, or one row per request with
    ring_size 0) are updated in place; ``pad_row`` is the row of padded rows (raw_out_loc 0). Returns
    (pooled fp32 ``[N, 512]``, group_pos (the pair's first position), slots (out_loc where >= 0, else 0))."""
    if type(pad_row) is int and type(ring_size) is int and not library.tracing():
        try:
            return _FAST[kv.device](kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pad_row,
                                    ring_size)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    arguments.integer(_OP, "pad_row", pad_row)
    arguments.integer(_OP, "ring_size", ring_size)
    try:
        pooled, group_pos, slots = _outputs(kv, pos, out_loc)
        pool_op(kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pooled, group_pos, slots, pad_row,
                ring_size)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(_OP, e, locals(), _TENSORS)
    if not library.tracing() and kv.is_cuda and not runtime.checks_enabled():
        _FAST[kv.device] = _launcher(runtime.function("c2_pool", "run", kv.device))
    return pooled, group_pos, slots


def _outputs(kv: torch.Tensor, pos: torch.Tensor, out_loc: torch.Tensor) -> tuple:
    return (torch.empty_like(kv, dtype=torch.float32), torch.empty_like(pos, dtype=torch.int64),
            torch.empty(out_loc.shape, dtype=out_loc.dtype, device=out_loc.device))


def _launcher(fn):
    def launch(kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pad_row, ring_size):
        pooled, group_pos, slots = _outputs(kv, pos, out_loc)
        run_pool(fn, kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pooled, group_pos, slots, None,
                 pad_row, ring_size)
        return pooled, group_pos, slots

    return launch


@binding.calls(("c2_pool",), "run")
def run_pool(fn, kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pooled, group_pos, slots, status,
             pad_row, ring_size) -> None:
    fn(kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pooled, group_pos, slots, status, pad_row,
       ring_size)


@library.custom_op("c2_decode_pool", mutates_args=("state_kv", "state_score", "pooled", "group_pos", "slots"))
def pool_op(kv: torch.Tensor, score: torch.Tensor, pos: torch.Tensor, raw_out_loc: torch.Tensor,
            out_loc: torch.Tensor, req: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
            pooled: torch.Tensor, group_pos: torch.Tensor, slots: torch.Tensor, pad_row: int, ring_size: int) -> None:
    """c2_decode_pool into allocated outputs."""
    device = common.cuda_device(kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pooled, group_pos,
                                slots)
    if device is None:
        results = ref.c2_decode_pool(kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pad_row,
                                     ring_size=ring_size)
        for dst, src in zip((pooled, group_pos, slots), results):
            dst.copy_(src)
        return
    status = runtime.status_word(device)
    run_pool(runtime.function("c2_pool", "run", device), kv, score, pos, raw_out_loc, out_loc, req, state_kv,
             state_score, pooled, group_pos, slots, status, pad_row, ring_size)
    runtime.raise_status(status, _OP, "c2_pool", device, {})
