"""Bad input at every public entry point, on the CPU backend (every tensor on the host: the torch
references and the host planner, which check host-resident data in default mode).

Each row names the function, the argument it spoils and how, the exception, the argument the
message must name and a pattern for the rest (the expected and the actual value). Every call
starts from a valid one; the tensors the function writes are compared with copies taken before
the call, so a rejected call must leave them as they were.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import dsv4jit
from dsv4jit import (CompressorDecodePlan, CompressorPrefillPlan, compress_and_store, compress_forward,
                     compress_norm_rope_store)
from dsv4jit.compat import flash_c4_decode, flash_c4_prefill
from dsv4jit.errors import ArgumentError, ArgumentTypeError
from dsv4jit.plan_layout import decode_write_plan, encode_write_plan
from dsv4jit.geometry import page_bytes
from helpers.compressor_step import EPS, PAGE_SIZE, RING, make_step, planner_inputs
from helpers.pool_utils import SWA_PAGE

HD = 128  # the indexer head_dim: the smallest tensors that reach every check


@dataclass(frozen=True)
class Entry:
    call: Callable[..., object]
    base: Callable[[], dict]  # the keyword arguments of a valid call
    outputs: tuple[str, ...] = ()  # the arguments the call writes


def _prefill_tables(online: bool = False) -> dict:
    rpi, seq, ext, r2t, f2s = planner_inputs(0, 3, 128 if online else 4, decode=False)
    kw = dict(req_pool_indices=rpi, seq_lens=seq, extend_lens=ext, num_q_tokens=int(ext.sum()))
    return kw | (dict(req_to_token=r2t) if online else dict(req_to_token=r2t, full_to_state=f2s))


def _decode_tables(online: bool = False) -> dict:
    rpi, seq, _, r2t, f2s = planner_inputs(0, 3, 128 if online else 4, decode=True)
    kw = dict(req_pool_indices=rpi, seq_lens=seq)
    return kw | (dict(req_to_token=r2t) if online else dict(req_to_token=r2t, full_to_state=f2s))


def _paged(kw: dict) -> dict:
    return dict(compress_ratio=4, swa_page_size=SWA_PAGE, ring_size=RING[4]) | kw


def _legacy(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k not in ("req_to_token", "full_to_state")} | dict(compress_ratio=4)


def _compress_args(decode: bool = False) -> dict:
    s = make_step("cpu", ratio=4, head_dim=HD, decode=decode, seed=3)
    out = torch.full((s.plan[1].shape[0], HD), 7.0)
    return dict(kv_score_buffer=s.state, kv_score_input=s.x, ape=s.ape, plan=s.plan, head_dim=HD, compress_ratio=4,
                out=out)


def _store_args() -> dict:
    s = make_step("cpu", ratio=4, head_dim=HD, seed=4)
    kv = torch.randn(s.plan[1].shape[0], HD, generator=torch.Generator().manual_seed(5))
    return dict(kv=kv, plan=s.plan, norm_weight=s.weight, norm_eps=EPS, freq_cis=s.freq_cis, out_loc=s.out_loc,
                kvcache=s.kvcache, page_size=PAGE_SIZE[4])


def _fused_args() -> dict:
    s = make_step("cpu", ratio=4, head_dim=HD, seed=6)
    return dict(kv_score_buffer=s.state, kv_score_input=s.x, ape=s.ape, plan=s.plan, head_dim=HD, compress_ratio=4,
                norm_weight=s.weight, norm_eps=EPS, freq_cis=s.freq_cis, out_loc=s.out_loc, kvcache=s.kvcache,
                page_size=PAGE_SIZE[4])


def _online_args(fused: bool) -> dict:
    """An online c128 prefill (head_dim 512, the V4 fp8 cache for the fused op)."""
    hd, gen = 512, torch.Generator().manual_seed(8)
    t = _prefill_tables(online=True)
    plan = CompressorPrefillPlan.generate_online(t["seq_lens"], t["extend_lens"], t["req_pool_indices"],
                                                 t["req_to_token"], t["num_q_tokens"])
    rows = t["req_to_token"].shape[0]
    kw = dict(kv_score_buffer=torch.randn(rows, 1, 3 * hd, generator=gen),
              kv_score_input=torch.randn(t["num_q_tokens"], 2 * hd, generator=gen),
              ape=torch.randn(128, hd, generator=gen), plan=plan, head_dim=hd, compress_ratio=128, is_online=True)
    if not fused:
        return kw | dict(out=torch.full((plan[1].shape[0], hd), 7.0))
    max_pos = int(t["seq_lens"].max()) + 1
    pages = t["num_q_tokens"] // 2 + 2
    return kw | dict(norm_weight=torch.ones(hd), norm_eps=EPS,
                     freq_cis=torch.polar(torch.ones(max_pos, 32), torch.rand(max_pos, 32, generator=gen)),
                     out_loc=torch.randperm(2 * pages, generator=gen)[:t["num_q_tokens"]], page_size=2,
                     kvcache=torch.zeros(pages, page_bytes("v4_fp8", 2), dtype=torch.uint8))


def _compat_decode_args() -> dict:
    gen = torch.Generator().manual_seed(9)
    return dict(kv_score_buffer=torch.randn(3, 8, 4 * HD, generator=gen), kv_score_input=torch.randn(2, 4 * HD),
                kv_compressed_output=torch.full((2, HD), 7.0), ape=torch.randn(8, HD),
                indices=torch.tensor([0, 2], dtype=torch.int32), seq_lens=torch.tensor([4, 5], dtype=torch.int32))


def _compat_prefill_args() -> dict:
    kw = _compat_decode_args()
    del kw["seq_lens"]
    empty = torch.zeros(0, 16, dtype=torch.uint8)  # no rows: a valid step that does nothing
    return kw | dict(compress_plan=empty, write_plan=empty.clone())


def _copy_args(decode: bool) -> dict:
    plan = _compress_args(decode)["plan"]
    return dict(self=plan, other=plan)


ENTRIES = {
    "CompressorPrefillPlan.generate": Entry(CompressorPrefillPlan.generate, lambda: _paged(_prefill_tables())),
    "CompressorPrefillPlan.generate_legacy": Entry(CompressorPrefillPlan.generate_legacy,
                                                   lambda: _legacy(_prefill_tables())),
    "CompressorPrefillPlan.generate_online": Entry(CompressorPrefillPlan.generate_online,
                                                   lambda: _prefill_tables(online=True)),
    "CompressorDecodePlan.generate": Entry(CompressorDecodePlan.generate, lambda: _paged(_decode_tables())),
    "CompressorDecodePlan.generate_legacy": Entry(CompressorDecodePlan.generate_legacy,
                                                  lambda: _legacy(_decode_tables())),
    "CompressorDecodePlan.generate_online": Entry(CompressorDecodePlan.generate_online,
                                                  lambda: _decode_tables(online=True)),
    "CompressorPrefillPlan.copy_": Entry(lambda self, other: self.copy_(other), lambda: _copy_args(False)),
    "CompressorDecodePlan.copy_": Entry(lambda self, other: self.copy_(other), lambda: _copy_args(True)),
    "compress_forward": Entry(compress_forward, _compress_args, ("kv_score_buffer", "out")),
    "compress_forward (decode)": Entry(compress_forward, lambda: _compress_args(decode=True),
                                       ("kv_score_buffer", "out")),
    "compress_forward (online)": Entry(compress_forward, lambda: _online_args(fused=False), ("kv_score_buffer", "out")),
    "compress_norm_rope_store": Entry(compress_norm_rope_store, _store_args, ("kvcache",)),
    "compress_and_store": Entry(compress_and_store, _fused_args, ("kv_score_buffer", "kvcache")),
    "compress_and_store (online)": Entry(compress_and_store, lambda: _online_args(fused=True),
                                         ("kv_score_buffer", "kvcache")),
    "flash_c4_decode": Entry(flash_c4_decode, _compat_decode_args, ("kv_score_buffer", "kv_compressed_output")),
    "flash_c4_prefill": Entry(flash_c4_prefill, _compat_prefill_args, ("kv_score_buffer", "kv_compressed_output")),
    "warmup": Entry(dsv4jit.warmup, lambda: dict(arch="9.0a")),
    "warmup (cpu)": Entry(dsv4jit.warmup, lambda: dict(device="cpu")),
    "set_checks": Entry(dsv4jit.set_checks, lambda: dict(enabled=None)),
}


# --------------------------------------------------------------------------------------------
# Spoilers: each takes the valid keyword arguments and returns the value of one argument.


def entry_set(name: str, index: int, value: int):
    def spoil(kw):
        t = kw[name].clone()
        t[index] = value
        return t
    return spoil


def narrow_columns(kw):
    """req_to_token with fewer columns than the longest sequence needs."""
    return kw["req_to_token"][:, :int(kw["seq_lens"].max()) - 1]


def plan_with_write_loc(value: int):
    def spoil(kw):
        plan = kw["plan"]
        w = decode_write_plan(plan.plan_w)
        write_loc = w.write_loc.clone()
        write_loc[w.valid.nonzero()[-1]] = value
        return CompressorPrefillPlan(plan.compress_ratio, plan.plan_c, encode_write_plan(w.ragged_id, write_loc),
                                     None, plan.num_q_tokens)
    return spoil


def plan_d_with_write_loc(value: int):
    def spoil(kw):
        plan_d = kw["plan"].plan_d.clone()
        plan_d.view(torch.int32)[0, 1] = value
        return CompressorDecodePlan(kw["plan"].compress_ratio, plan_d)
    return spoil


def cast(name: str, dtype):
    return lambda kw: kw[name].to(dtype)


def shape(name: str, *index):
    return lambda kw: kw[name][index]


def out_loc_beyond_cache(kw):
    out_loc = kw["out_loc"].clone()
    out_loc[:] = kw["kvcache"].shape[0] * kw["page_size"] + torch.arange(out_loc.numel(), device=out_loc.device)
    return out_loc


def out_loc_repeated(kw):
    """Every row stores at one cache location."""
    return torch.zeros_like(kw["out_loc"])


def plan_of_more_requests(kw):
    """The decode plan of a batch with one request more than the tensors hold."""
    plan = kw["plan"]
    return CompressorDecodePlan(plan.compress_ratio, torch.cat([plan.plan_d, plan.plan_d[:1]]))


def plan_of_fewer_tokens(kw):
    """A prefill plan of a step of fewer tokens than the inputs hold: it used to be accepted, the
    tokens past its own never compressed nor kept."""
    plan = kw["plan"]
    return dataclasses.replace(plan, num_q_tokens=plan.num_q_tokens - 1)


def non_finite(name: str, value: float, index=None):
    """`name` with `value` at `index` (None: everywhere, so that the first entry a call uses is named)."""
    def spoil(kw):
        t = kw[name].clone()
        if index is None:
            t.fill_(value)
        else:
            t[index] = value
        return t
    return spoil


def permuted(name):
    return lambda kw: kw[name].transpose(0, 1)


def strided(name):
    """The same values as every other column of a tensor twice as wide (``x[:, ::2]``)."""
    return lambda kw: kw[name].repeat_interleave(2, dim=-1)[..., ::2]


def column_major(name):
    """The same values and shape, stored column by column (a transposed tensor)."""
    return lambda kw: kw[name].t().contiguous().t()


def real_freq(kw):
    """The fp32 table with one column per pair: half of what the real (cos, sin) table has."""
    return torch.view_as_real(kw["freq_cis"])[..., 0].contiguous()


FINITE = r": must hold finite values only \(no NaN or infinity\), got "  # then the value and its index

ROWS = [
    # (function, argument, how it is spoiled, exception, message pattern after the argument named, and
    # the argument named when it is not the one spoiled)
    ("CompressorPrefillPlan.generate", "req_pool_indices", lambda kw: kw["req_pool_indices"].tolist(), TypeError,
     r" must be a torch.Tensor, got list"),
    ("CompressorPrefillPlan.generate", "req_pool_indices", entry_set("req_pool_indices", 1, 6), ValueError,
     r": entry 1 must be a row of req_to_token \(in \[0, 6\)\), got 6"),
    ("CompressorPrefillPlan.generate", "req_pool_indices", entry_set("req_pool_indices", 0, -1), ValueError,
     r": entry 0 must be a row of req_to_token \(in \[0, 6\)\), got -1"),
    ("CompressorPrefillPlan.generate", "req_to_token", narrow_columns, ValueError,
     r": entry \d must be at most \d+ \(the columns of req_to_token\), got \d+", "seq_lens"),
    ("CompressorPrefillPlan.generate", "full_to_state", shape("full_to_state", slice(0, 10)), ValueError,
     r": entry \[\d+, \d+\] \(request 0, position \d+\) must be an index of full_to_state \(in \[0, 10\)\), "
     r"got \d+", "req_to_token"),
    ("CompressorPrefillPlan.generate", "num_q_tokens", lambda kw: float(kw["num_q_tokens"]), TypeError,
     r" must be an int, got float \d+\.0"),
    ("CompressorPrefillPlan.generate", "num_q_tokens", lambda kw: kw["num_q_tokens"] + 1, ValueError,
     r" must be the sum of extend_lens"),
    ("CompressorPrefillPlan.generate", "compress_ratio", lambda kw: 8, ValueError, r" must be 4 or 128, got 8"),
    ("CompressorPrefillPlan.generate", "compress_ratio", lambda kw: 4.0, TypeError, r" must be an int, got float 4.0"),
    ("CompressorPrefillPlan.generate", "ring_size", lambda kw: 6, ValueError,
     r" must be a positive multiple of compress_ratio \(4\), got 6"),
    ("CompressorPrefillPlan.generate", "use_cuda_graph", lambda kw: "yes", TypeError, r" must be a bool, got str"),
    ("CompressorPrefillPlan.generate", "extend_lens", cast("extend_lens", torch.int32), TypeError,
     r": dtype must be int64, got int32"),
    ("CompressorPrefillPlan.generate", "extend_lens", entry_set("extend_lens", 1, 10**4), ValueError,
     r": entry 1 must be in \[1, seq_lens\[1\] = \d+\], got 10000"),
    ("CompressorPrefillPlan.generate", "seq_lens", shape("seq_lens", slice(0, 2)), ValueError,
     r": dim 0 \('batch_size'\) must be 2 \(as in 'seq_lens'\), got 3", "extend_lens"),
    ("CompressorPrefillPlan.generate", "req_to_token", cast("req_to_token", torch.float32), TypeError,
     r": dtype must be int32, got float32"),
    ("CompressorPrefillPlan.generate_legacy", "req_pool_indices", entry_set("req_pool_indices", 2, -1), ValueError,
     r": entry 2 must be >= 0, got -1"),
    ("CompressorPrefillPlan.generate_legacy", "num_q_tokens", lambda kw: 33.0, TypeError,
     r" must be an int, got float 33.0"),
    ("CompressorPrefillPlan.generate_online", "state_slot_offset", lambda kw: -1, ValueError,
     r" must be in \[0, 2\^31\), got -1"),
    ("CompressorPrefillPlan.generate_online", "state_slot_offset", lambda kw: 1.5, TypeError,
     r" must be an int, got float 1.5"),
    ("CompressorPrefillPlan.generate_online", "req_pool_indices", entry_set("req_pool_indices", 0, -1), ValueError,
     r": entry 0 must be >= 0, got -1"),
    ("CompressorDecodePlan.generate", "seq_lens", entry_set("seq_lens", 0, 0), ValueError,
     r": entry 0 must be in \[1, 2\^31\), got 0"),
    ("CompressorDecodePlan.generate", "req_to_token", narrow_columns, ValueError,
     r": entry \d must be at most \d+ \(the columns of req_to_token\), got \d+", "seq_lens"),
    ("CompressorDecodePlan.generate", "req_pool_indices", entry_set("req_pool_indices", 2, 9), ValueError,
     r": entry 2 must be a row of req_to_token \(in \[0, 6\)\), got 9"),
    ("CompressorDecodePlan.generate", "req_to_token", lambda kw: kw["req_to_token"].tolist(), TypeError,
     r" must be a torch.Tensor, got list"),
    ("CompressorDecodePlan.generate", "swa_page_size", lambda kw: 100, ValueError,
     r" must be a positive multiple of ring_size \(8\), got 100"),
    ("CompressorDecodePlan.generate", "use_req_ring", lambda kw: "no", TypeError, r" must be a bool, got str"),
    ("CompressorDecodePlan.generate_legacy", "req_pool_indices", entry_set("req_pool_indices", 1, -3), ValueError,
     r": entry 1 must be >= 0, got -3"),
    ("CompressorDecodePlan.generate_online", "seq_lens", entry_set("seq_lens", 1, 0), ValueError,
     r": entry 1 must be in \[1, 2\^31\), got 0"),
    ("CompressorPrefillPlan.copy_", "other", lambda kw: tuple(kw["other"]), TypeError,
     r" must be a CompressorPrefillPlan, got tuple"),
    ("CompressorDecodePlan.copy_", "other", lambda kw: CompressorDecodePlan(128, kw["other"].plan_d), ValueError,
     r": compress_ratio must be 4, got 128"),
    ("compress_forward", "head_dim", lambda kw: 256, ValueError,
     r" is 256, but the rows of 'kv_score_buffer' have 512 values .*with compress_ratio 4 they have 4·head_dim = 1024"),
    ("compress_forward", "head_dim", lambda kw: 128.0, TypeError, r" must be an int, got float 128.0"),
    ("compress_forward", "plan", lambda kw: "plan", TypeError, r" must be a CompressorPrefillPlan or CompressorDecodePlan"),
    ("compress_forward", "plan", plan_with_write_loc(10**6), ValueError,
     r" \(plan_w\): write_loc must lie in \[0, \d+\) \(the rows of kv_score_buffer\), got range \[\d+, 1000000\]"),
    ("compress_forward", "compress_ratio", lambda kw: 128, ValueError,
     r" was built for compress_ratio 4, got compress_ratio 128", "plan"),
    ("compress_forward", "kv_score_input", lambda kw: kw["kv_score_input"].tolist(), TypeError,
     r" must be a torch.Tensor, got list"),
    ("compress_forward", "kv_score_buffer", permuted("kv_score_buffer"), ValueError, r": must be contiguous"),
    # the kernels refuse a tensor that is not contiguous (tensor_check.h): so does the CPU path, with their words
    ("compress_forward", "kv_score_input", strided("kv_score_input"), ValueError,
     r": must be contiguous \(row-major\), got strides \[1024, 2\]"),
    ("compress_forward (decode)", "kv_score_input", strided("kv_score_input"), ValueError,
     r": must be contiguous \(row-major\)"),
    ("compress_forward (online)", "kv_score_input", strided("kv_score_input"), ValueError,
     r": must be contiguous \(row-major\)"),
    ("compress_norm_rope_store", "kvcache", column_major("kvcache"), ValueError,
     r": must be contiguous \(row-major\), got strides \[1, \d+\]"),
    ("compress_norm_rope_store", "kv", strided("kv"), ValueError, r": must be contiguous \(row-major\)"),
    ("compress_and_store", "kv_score_input", strided("kv_score_input"), ValueError,
     r": must be contiguous \(row-major\)"),
    ("compress_and_store", "kvcache", column_major("kvcache"), ValueError, r": must be contiguous \(row-major\)"),
    ("compress_and_store (online)", "kv_score_input", strided("kv_score_input"), ValueError,
     r": must be contiguous \(row-major\)"),
    ("compress_and_store (online)", "kvcache", column_major("kvcache"), ValueError,
     r": must be contiguous \(row-major\)"),
    ("compress_forward", "kv_score_buffer", cast("kv_score_buffer", torch.int32), TypeError,
     r": expected dtype float32 or bfloat16, got torch.int32"),
    ("compress_forward", "ape", shape("ape", slice(0, 4)), ValueError, r": expected shape \[8, 128\], got \[4, 128\]"),
    ("compress_forward", "out", cast("out", torch.int32), TypeError,
     r": expected dtype float32, bfloat16 or float16, got torch.int32"),
    ("compress_forward", "is_online", lambda kw: "no", TypeError, r" must be a bool, got str"),
    ("compress_forward (decode)", "plan", plan_d_with_write_loc(-1), ValueError,
     r" \(plan_d\): write_loc must lie in \[0, \d+\) \(the rows of kv_score_buffer\), got range \[-1, \d+\]"),
    ("compress_forward (online)", "head_dim", lambda kw: 100, ValueError,
     r" must be a positive multiple of 128 with is_online=True, got 100"),
    ("compress_forward (online)", "head_dim", lambda kw: 256, ValueError,
     r" is 256, but the rows of 'kv_score_buffer' have 1536 values .*they have 3·head_dim = 768"),
    ("compress_forward (online)", "kv_score_input", cast("kv_score_input", torch.bfloat16), TypeError,
     r": dtype must be float32 with is_online=True, got torch.bfloat16"),
    ("compress_norm_rope_store", "norm_eps", lambda kw: -1, ValueError, r" must be a finite number > 0 .*, got -1"),
    ("compress_norm_rope_store", "norm_eps", lambda kw: 0.0, ValueError, r" must be a finite number > 0 \(0 turns an all-zero row into NaN\), got 0.0"),
    ("compress_norm_rope_store", "norm_eps", lambda kw: "1e-6", TypeError, r" must be a float, got str"),
    ("compress_norm_rope_store", "out_loc", out_loc_repeated, ValueError,
     r": two rows that store a compressed token name one cache location"),
    ("compress_norm_rope_store", "freq_cis", shape("freq_cis", slice(0, 0)), ValueError,
     r": the RoPE positions of the stored rows \(seq_len - compress_ratio\) must lie in \[0, 0\)"),
    ("compress_norm_rope_store", "freq_cis", real_freq, ValueError,
     r" must be complex64 \[max_pos, 32\] or float32 \[max_pos, 64\] \(interleaved cos, sin\), "
     r"got \[\d+, 32\] torch.float32"),
    ("compress_norm_rope_store", "freq_cis", shape("freq_cis", slice(None), slice(0, 16)), ValueError,
     r" must be complex64 \[max_pos, 32\] .*got \[\d+, 16\] torch.complex64"),
    ("compress_norm_rope_store", "freq_cis", shape("freq_cis", slice(0, 2)), ValueError,
     r": the RoPE positions of the stored rows \(seq_len - compress_ratio\) must lie in \[0, 2\)"),
    ("compress_norm_rope_store", "out_loc", lambda kw: kw["out_loc"].tolist(), TypeError,
     r" must be a torch.Tensor, got list"),
    ("compress_norm_rope_store", "out_loc", shape("out_loc", slice(0, 3)), ValueError,
     r" and argument 'out_loc' are of different batches or steps: the plan is a prefill plan of \d+ tokens "
     r"\(num_q_tokens\), 'out_loc' has 3 entries", "plan"),
    ("compress_norm_rope_store", "out_loc", out_loc_beyond_cache, ValueError,
     r": the cache locations of the stored rows must lie in \[0, \d+\)"),
    ("compress_norm_rope_store", "page_size", lambda kw: 3, ValueError, r" must be a power of two"),
    ("compress_norm_rope_store", "page_size", lambda kw: 64.0, TypeError, r" must be an int, got float 64.0"),
    ("compress_norm_rope_store", "kvcache", shape("kvcache", slice(None), slice(0, 100)), ValueError,
     r" rows must be page_bytes\('indexer_fp8', 64\) = \d+ bytes, got 100"),
    ("compress_norm_rope_store", "kv", shape("kv", 0), ValueError, r" must be 2-D \[rows, head_dim\], got shape \[128\]"),
    ("compress_norm_rope_store", "bf16_store", lambda kw: True, ValueError, r" needs head_dim 512, got head_dim 128"),
    ("compress_norm_rope_store", "use_fp4", lambda kw: "yes", TypeError, r" must be a bool, got str"),
    ("compress_norm_rope_store", "norm_weight", shape("norm_weight", slice(0, 64)), ValueError,
     r" must be \[128\], got \[64\]"),
    ("compress_norm_rope_store", "plan", lambda kw: tuple(kw["plan"])[:3], TypeError, r" must be a CompressorPrefillPlan"),
    ("compress_norm_rope_store", "layout", lambda kw: "v3", ValueError, r" must be a KVLayout or one of .*got 'v3'"),
    ("compress_norm_rope_store", "layout", lambda kw: "V41", ValueError, r" is 'v41', which stores 512-dim .*got .*128"),
    ("compress_norm_rope_store", "fp8_2buff", lambda kw: True, ValueError, r" needs head_dim 512, got head_dim 128"),
    ("compress_norm_rope_store", "kvcache_rope", lambda kw: torch.zeros(8, 128, dtype=torch.uint8), ValueError,
     r" must be None without fp8_2buff"),
    ("compress_and_store", "norm_eps", lambda kw: float("nan"), ValueError, r" must be a finite number > 0 .*, got nan"),
    ("compress_and_store", "norm_eps", lambda kw: 0.0, ValueError, r" must be a finite number > 0 .*, got 0.0"),
    ("compress_and_store", "out_loc", out_loc_repeated, ValueError,
     r": two rows that store a compressed token name one cache location"),
    ("compress_and_store", "head_dim", lambda kw: 256, ValueError, r" must be 512 or 128, got 256"),
    ("compress_and_store", "out_loc", out_loc_beyond_cache, ValueError,
     r": the cache locations of the stored rows must lie in \[0, \d+\)"),
    ("compress_and_store", "freq_cis", real_freq, ValueError, r" must be complex64 \[max_pos, 32\] or float32"),
    ("compress_and_store", "plan", plan_with_write_loc(-5), ValueError,
     r" \(plan_w\): write_loc must lie in \[0, \d+\) \(the rows of kv_score_buffer\), got range \[-5, \d+\]"),
    ("compress_and_store", "kv_score_input", lambda kw: kw["kv_score_input"].tolist(), TypeError,
     r" must be a torch.Tensor, got list"),
    ("compress_and_store", "page_size", lambda kw: 48, ValueError, r" must be a power of two"),
    ("compress_and_store (online)", "out_loc", out_loc_beyond_cache, ValueError,
     r": the cache locations of the stored rows must lie in \[0, \d+\)"),
    ("compress_and_store (online)", "head_dim", lambda kw: 128, ValueError, r" must be 512 with is_online=True"),
    ("compress_and_store (online)", "kv_score_input", cast("kv_score_input", torch.bfloat16), TypeError,
     r": dtype must be float32 with is_online=True"),
    # a plan of another batch or step (the decode one used to be named as whichever tensor a kernel checked first)
    ("compress_forward (decode)", "plan", plan_of_more_requests, ValueError,
     r" and argument 'kv_score_input' are of different batches or steps: the plan is a decode plan of \d+ requests, "
     r"'kv_score_input' has \d+ rows"),
    ("compress_forward", "plan", plan_of_fewer_tokens, ValueError,
     r" and argument 'kv_score_input' are of different batches or steps: the plan is a prefill plan of \d+ tokens "
     r"\(num_q_tokens\), 'kv_score_input' has \d+ rows"),
    ("compress_forward (online)", "plan", plan_of_fewer_tokens, ValueError,
     r" and argument 'kv_score_input' are of different batches or steps"),
    ("compress_and_store", "plan", plan_of_fewer_tokens, ValueError,
     r" and argument 'kv_score_input' are of different batches or steps: the plan is a prefill plan"),
    ("compress_and_store (online)", "plan", plan_of_fewer_tokens, ValueError,
     r" and argument 'kv_score_input' are of different batches or steps"),
    # non-finite values a call uses (they went into the state and the cache without a word)
    ("compress_forward", "kv_score_input", non_finite("kv_score_input", float("inf")), ValueError, FINITE + r"inf at "),
    ("compress_forward", "ape", non_finite("ape", float("nan"), (3, 5)), ValueError, FINITE + r"nan at \[3, 5\]"),
    ("compress_forward (decode)", "kv_score_input", non_finite("kv_score_input", float("-inf"), (1, 7)), ValueError,
     FINITE + r"-inf at \[1, 7\]"),
    ("compress_forward (online)", "kv_score_input", non_finite("kv_score_input", float("nan")), ValueError,
     FINITE + r"nan at \[0, 0\]"),
    ("compress_norm_rope_store", "kv", non_finite("kv", float("nan")), ValueError, FINITE + r"nan at \[\d+, 0\]"),
    ("compress_norm_rope_store", "norm_weight", non_finite("norm_weight", float("inf"), 9), ValueError,
     FINITE + r"inf at \[9\]"),
    ("compress_norm_rope_store", "freq_cis", non_finite("freq_cis", float("nan")), ValueError,
     FINITE + r"\(?nan.* at \[\d+, 0\]"),
    ("compress_and_store", "kv_score_input", non_finite("kv_score_input", float("nan")), ValueError, FINITE + "nan"),
    ("compress_and_store", "ape", non_finite("ape", float("inf"), (0, 1)), ValueError, FINITE + r"inf at \[0, 1\]"),
    ("compress_and_store", "norm_weight", non_finite("norm_weight", float("nan"), 3), ValueError,
     FINITE + r"nan at \[3\]"),
    ("compress_and_store", "freq_cis", non_finite("freq_cis", float("inf")), ValueError, FINITE),
    ("compress_and_store (online)", "ape", non_finite("ape", float("nan"), (127, 511)), ValueError,
     FINITE + r"nan at \[127, 511\]"),
    ("flash_c4_decode", "kv_score_input", non_finite("kv_score_input", float("nan"), (1, 300)), ValueError,
     FINITE + r"nan at \[1, 300\]"),
    ("flash_c4_decode", "ape", non_finite("ape", float("inf"), (7, 0)), ValueError, FINITE + r"inf at \[7, 0\]"),
    ("flash_c4_decode", "indices", lambda kw: kw["indices"].tolist(), TypeError, r" must be a torch.Tensor, got list"),
    ("flash_c4_decode", "indices", entry_set("indices", 1, 9), ValueError,
     r": entries must lie in \[0, 3\), got range \[0, 9\]"),
    ("flash_c4_decode", "seq_lens", cast("seq_lens", torch.int64), TypeError, r": dtype must be torch.int32"),
    ("flash_c4_decode", "kv_compressed_output", shape("kv_compressed_output", slice(None), slice(0, 100)), ValueError,
     r" must be \[rows, head_dim\] with head_dim 128 or 512, got shape \[2, 100\]"),
    ("flash_c4_prefill", "write_plan", cast("write_plan", torch.int32), TypeError, r": dtype must be torch.uint8"),
    ("flash_c4_prefill", "compress_plan", lambda kw: [], TypeError, r" must be a torch.Tensor, got list"),
    ("warmup", "ops", lambda kw: ["nope"], ValueError, r" has unknown entries \['nope'\]"),
    ("warmup", "state_dtype", lambda kw: torch.int32, TypeError,
     r": dtype must be float32, bfloat16 or float16, got torch.int32"),
    ("warmup", "head_dims", lambda kw: {4: (100,)}, ValueError, r": parameter 'head_dim' must be one of .*, got 100"),
    ("warmup", "head_dims", lambda kw: {4: (128.0,)}, TypeError, r" must be an int, got float 128.0"),
    ("warmup", "use_fp4", lambda kw: "yes", TypeError, r" must be a bool, got str"),
    ("warmup", "jobs", lambda kw: 1.5, TypeError, r" must be an int, got float 1.5"),
    ("warmup", "arch", lambda kw: "sm_9x", ValueError, r": invalid CUDA arch 'sm_9x': expected e.g. 9.0a"),
    ("warmup", "arch", lambda kw: "8.0", ValueError,
     r": unsupported CUDA arch '8.0' \(sm_80\): the kernels build for sm_90a \(H100, H200\), sm_100a"),
    ("warmup", "arch", lambda kw: 9.0, TypeError, r" must be a str such as '9.0a' or 'sm_90a', got float 9.0"),
    ("warmup (cpu)", "device", lambda kw: "gpu:0", ValueError, r" must be a torch device"),
    ("set_checks", "enabled", lambda kw: "yes", TypeError, r" must be a bool or None, got str 'yes'"),
]


def _row_id(row) -> str:
    entry, arg, _, exc, pattern = row[:5]
    return f"{entry}-{arg}-{exc.__name__}-{pattern[:24]}"


def _snapshot(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_bad_input_is_named_and_writes_nothing(row):
    entry_name, arg, spoil, exc, pattern = row[:5]
    named = row[5] if len(row) > 5 else arg
    entry = ENTRIES[entry_name]
    kw = entry.base()
    kw[arg] = spoil(kw)
    before = {name: _snapshot(kw[name]) for name in entry.outputs}
    with pytest.raises(exc) as err:
        entry.call(**kw)
    # a RuntimeError too, as the reference's rejections are (contract §8.1)
    assert type(err.value) is {ValueError: ArgumentError, TypeError: ArgumentTypeError}[exc], err.value
    assert isinstance(err.value, RuntimeError)
    message = str(err.value)
    function = entry_name.split(" ")[0]
    assert message.startswith(f"dsv4jit.{function}"), message
    assert f"argument '{named}'" in message, message
    assert re.search(f"'{named}'" + pattern, message), message
    for name, value in before.items():
        assert torch.equal(kw[name], value), f"{entry_name} wrote {name} although it raised"


@pytest.mark.parametrize("name", ENTRIES)
def test_every_entry_point_has_rows_and_a_valid_base_call(name):
    """The rows above mean something only if each function's base call succeeds as given."""
    assert any(row[0] == name for row in ROWS)
    entry = ENTRIES[name]
    if name == "warmup":
        pytest.skip("its valid call compiles kernels; tests/jit/test_warmup.py covers it")
    entry.call(**entry.base())


def test_plan_tuples_are_accepted_where_plans_are():
    """The reference API's tuple form of a plan gives the same result as the plan object."""
    kw = _compress_args()
    as_tuple = dict(kw, kv_score_buffer=kw["kv_score_buffer"].clone(), out=kw["out"].clone(), plan=tuple(kw["plan"]))
    compress_forward(**kw)
    compress_forward(**as_tuple)
    assert torch.equal(kw["out"], as_tuple["out"]) and torch.equal(kw["kv_score_buffer"], as_tuple["kv_score_buffer"])


@pytest.mark.parametrize("entry_name, without_out", [
    ("compress_forward", False), ("compress_forward", True), ("compress_forward (online)", True),
    ("compress_and_store", False), ("compress_and_store (online)", False)])
def test_a_device_mix_names_each_tensor_passed_and_its_device(entry_name, without_out):
    """One tensor on another device (meta: no data, so nothing can be written): the message lists
    every tensor the caller passed (`out` only when passed) with its device, and nothing is written."""
    entry = ENTRIES[entry_name]
    kw = entry.base()
    if without_out:
        del kw["out"]
    kw["kv_score_input"] = kw["kv_score_input"].to("meta")
    before = {name: kw[name].clone() for name in entry.outputs if name in kw}
    with pytest.raises(TypeError) as err:
        entry.call(**kw)
    placed = ", ".join(f"{name} on {'meta' if name == 'kv_score_input' else 'cpu'}" for name, value in kw.items()
                       if isinstance(value, torch.Tensor) or name == "plan")
    assert str(err.value) == f"dsv4jit.{entry_name.split(' ')[0]}: tensors on different devices: {placed}"
    assert ", out on" not in placed or not without_out
    for name, value in before.items():
        assert torch.equal(kw[name], value), f"{entry_name} wrote {name} although it raised"


@pytest.mark.parametrize("entry_name", ["compress_forward", "compress_forward (decode)", "compress_and_store"])
def test_non_finite_values_the_contract_defines_are_accepted(entry_name):
    """A cleared state row (kv 0, score -inf: a fresh pool, or its "no slot" row) and CUDA-graph
    padding rows no plan row names (here NaN, past a plan of a padded step) are not errors."""
    entry = ENTRIES[entry_name]
    kw = entry.base()
    width = kw["kv_score_buffer"].shape[-1]
    scores = slice(width // 2, None)  # c4 rows: kv_overlap | kv | score_overlap | score
    kw["kv_score_buffer"][..., :width // 2] = 0
    kw["kv_score_buffer"][..., scores] = float("-inf")
    plan = kw["plan"]
    if not plan.is_decode:
        pad = 3
        kw["kv_score_input"] = torch.cat([kw["kv_score_input"], torch.full((pad, width), float("nan"))])
        kw["plan"] = dataclasses.replace(plan, num_q_tokens=plan.num_q_tokens + pad)
        if "out_loc" in kw:
            kw["out_loc"] = torch.cat([kw["out_loc"], kw["out_loc"][:pad]])
    entry.call(**kw)
