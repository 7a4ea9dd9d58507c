"""Reference planner: the compress / write / decode plans of contract §3, in plain Python.

Written for clarity, not speed: loops over requests and tokens, Python integers with explicit
C-style division and int32 narrowing where the contract has them. Inputs may live on any device
(they are read on the CPU); plans come back as CPU ``uint8`` tensors built by ``plan_layout``.

Prefill plans are built in two passes, for clarity: ``enumerate_stage0`` lists the compress events
and the tokens to store (contract §3.2, contract §3.3) with each row's batch id and position still in
its fields, then ``_translate`` turns those into state rows and pages with one of the addressing
schemes of contract §3.1 (contract §3.4) and pads for CUDA graphs (contract §3.5). That intermediate
form is this module's own: the planner kernels (csrc/planner/rules.h) write each row final, in one
pass, and both give the same bytes.
"""

from __future__ import annotations

from typing import Callable

import torch

from dsv4jit.errors import ArgumentError
from dsv4jit.geometry import check_ratio, window_size
from dsv4jit.plan_layout import (
    decode_compress_plan,
    decode_write_plan,
    encode_compress_plan,
    encode_decode_plan,
    encode_write_plan,
    invalid_compress_rows,
    invalid_write_rows,
)

__all__ = [
    "window_size",
    "mtp_pad_for",
    "paged_swa_row",
    "request_ring_row",
    "legacy_page",
    "legacy_row",
    "enumerate_stage0",
    "plan_prefill",
    "plan_prefill_legacy",
    "plan_decode",
    "plan_decode_legacy",
]

#: Ragged ids and batch ids travel as u16 (contract §2.2, contract §8.2).
MAX_NUM_Q_TOKENS = 65536
MAX_BATCH = 65535  # B < 65536: pack(65535, 65535) would equal the invalid WritePlan sentinel

# The addressing scheme the translation applies: row_of(rid, pos) -> state row.
RowFn = Callable[[int, int], int]


# ---------------------------------------------------------------------------------------------
# C-style integer helpers
# ---------------------------------------------------------------------------------------------

def _i32(x: int) -> int:
    """Narrow to int32 the way a C cast does (two's complement wrap)."""
    return (x + 2**31) % 2**32 - 2**31


def _cdiv(a: int, b: int) -> int:
    """Division truncating toward zero (C), unlike Python's floor division."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _cmod(a: int, b: int) -> int:
    """Remainder with the sign of the dividend (C)."""
    return a - b * _cdiv(a, b)


def _cpu_list(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.detach().to("cpu").reshape(-1).tolist()]


def _lookup(table: torch.Tensor, index: tuple[int, ...], name: str) -> int:
    # Python would silently wrap a negative index; the device code would read out of bounds.
    for i, size in zip(index, table.shape):
        if not 0 <= i < size:
            raise IndexError(f"{name}: index {index} out of range for shape {tuple(table.shape)}")
    return int(table[index])


# ---------------------------------------------------------------------------------------------
# Addressing (contract §3.1, contract §3.3; window_size: dsv4jit.geometry)
# ---------------------------------------------------------------------------------------------

def mtp_pad_for(compress_ratio: int, ring_size: int) -> int:
    """Trailing tokens the paged planner keeps resident for speculative rollback (0 without spec)."""
    wn = window_size(compress_ratio)
    return ring_size - wn + 2 if ring_size > wn else 0


def paged_swa_row(req_to_token: torch.Tensor, full_to_state: torch.Tensor, rid: int, pos: int,
                  swa_page_size: int, ring_size: int) -> int:
    """Paged SWA scheme (c4, no request ring): each SWA page owns a private ring of ring_size rows."""
    full_slot = _lookup(req_to_token, (rid, pos), "req_to_token")
    swa = _i32(_lookup(full_to_state, (full_slot,), "full_to_state"))
    return _i32(_cdiv(swa, swa_page_size) * ring_size + _cmod(swa, ring_size))


def request_ring_row(rid: int, pos: int, ring_size: int) -> int:
    """Request-ring scheme (c128 always, c4 with use_req_ring): 64-bit product, narrowed to int32."""
    return _i32(rid * ring_size + _cmod(pos, ring_size))


def legacy_page(compress_ratio: int, rid: int, pos: int) -> int:
    """Legacy (non-paged) scheme: two alternating 4-row pages per request for c4, one page for c128."""
    rid = _i32(rid)
    if compress_ratio == 4:
        return _i32(2 * rid + _cmod(_cdiv(pos, 4), 2))
    return rid


def legacy_row(compress_ratio: int, rid: int, pos: int) -> int:
    return _i32(legacy_page(compress_ratio, rid, pos) * compress_ratio + _cmod(pos, compress_ratio))


# ---------------------------------------------------------------------------------------------
# Enumeration (contract §3.2, contract §3.3)
# ---------------------------------------------------------------------------------------------

def enumerate_stage0(compress_ratio: int, seq_lens, extend_lens, mtp_pad: int = 0,
                     page_tail: bool = False, swa_page_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The enumerated rows of a prefill batch, batch-major and position-ascending (the CPU order).

    Returns (plan_c, plan_w) in their *pre-translation* form: compress rows carry
    ``read_page_0 = -1`` and ``read_page_1 = batch id``; write rows carry the packed
    ``ragged_id | batch_id << 16`` and ``write_loc = position + 1``.
    ``page_tail`` applies the paged-c4 rule that keeps the last R tokens of every SWA page.
    Inputs are assumed valid (the public planners check them).
    """
    R = compress_ratio
    overlap = R == 4
    wn = window_size(R)
    seq_lens = _cpu_list(torch.as_tensor(seq_lens))
    extend_lens = _cpu_list(torch.as_tensor(extend_lens))

    c_seq, c_rg, c_buf, c_bid = [], [], [], []
    w_packed, w_loc = [], []
    ragged_base = 0
    for b, (seq_len, extend_len) in enumerate(zip(seq_lens, extend_lens)):
        prefix_len = seq_len - extend_len
        last_c = _cdiv(seq_len, R) * R  # start of the window still open after this step
        first_w = min(last_c - (R if overlap else 0), seq_len - mtp_pad)
        for j in range(extend_len):
            p = prefix_len + j
            rg = ragged_base + j
            if (p + 1) % R == 0:
                c_seq.append(p + 1)
                c_rg.append(rg)
                c_buf.append(wn - min(j + 1, wn))  # window slots that precede this step
                c_bid.append(b)
            write = p >= first_w
            if not write and page_tail:
                # A later request resuming at an SWA-page boundary (prefix-cache hit) needs the
                # overlap half of its first window from the previous page's ring.
                write = _cmod(p, swa_page_size) >= swa_page_size - R
            if write:
                w_packed.append(rg | (b << 16))
                w_loc.append(p + 1)
        ragged_base += extend_len

    n_c = len(c_seq)
    plan_c = encode_compress_plan(
        torch.tensor(c_seq, dtype=torch.int64), torch.tensor(c_rg, dtype=torch.int64),
        torch.tensor(c_buf, dtype=torch.int64), torch.full((n_c,), -1, dtype=torch.int64),
        torch.tensor(c_bid, dtype=torch.int64))
    plan_w = encode_write_plan(torch.tensor(w_packed, dtype=torch.int64), torch.tensor(w_loc, dtype=torch.int64))
    return plan_c, plan_w


# ---------------------------------------------------------------------------------------------
# Translation (contract §3.4)
# ---------------------------------------------------------------------------------------------

def _translate(compress_ratio: int, plan_c0: torch.Tensor, plan_w0: torch.Tensor, rids: list[int],
               row_of: RowFn, translate_all: bool, num_padded: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn the enumerated (batch id, position) into state rows / pages, then pad with invalid rows.

    ``translate_all``: legacy translates every compress row; the paged planner only those with
    ``buffer_len > 0`` (the others keep read_page_0 = -1, read_page_1 = batch id; contract §3.4).
    """
    R = compress_ratio
    c = decode_compress_plan(plan_c0)
    read_page_0, read_page_1 = c.read_page_0.tolist(), c.read_page_1.tolist()
    for i, (seq_len, buffer_len) in enumerate(zip(c.seq_len.tolist(), c.buffer_len.tolist())):
        if not translate_all and buffer_len == 0:
            continue
        p1 = seq_len - 1
        p0 = max(p1 - R, 0)
        rid = rids[read_page_1[i]]  # the enumeration parked the batch id in read_page_1
        read_page_0[i] = _cdiv(row_of(rid, p0), R)
        read_page_1[i] = _cdiv(row_of(rid, p1), R)
    plan_c = encode_compress_plan(c.seq_len, c.ragged_id, c.buffer_len,
                                  torch.tensor(read_page_0, dtype=torch.int64),
                                  torch.tensor(read_page_1, dtype=torch.int64))

    w = decode_write_plan(plan_w0)
    ragged_ids, write_locs = [], []
    for packed, loc in zip(w.ragged_id.tolist(), w.write_loc.tolist()):
        rg, b = packed & 0xFFFF, packed >> 16
        ragged_ids.append(rg)
        write_locs.append(row_of(rids[b], loc - 1))
    plan_w = encode_write_plan(torch.tensor(ragged_ids, dtype=torch.int64), torch.tensor(write_locs, dtype=torch.int64))

    if num_padded is not None:  # cuda-graph shape: both arrays have num_q_tokens rows
        plan_c = torch.cat([plan_c, invalid_compress_rows(num_padded - plan_c.shape[0])])
        plan_w = torch.cat([plan_w, invalid_write_rows(num_padded - plan_w.shape[0])])
    return plan_c, plan_w


# ---------------------------------------------------------------------------------------------
# Checks (contract §8.2, contract §9.2)
# ---------------------------------------------------------------------------------------------

def _check_ring(compress_ratio: int, swa_page_size: int, ring_size: int, use_req_ring: bool) -> None:
    if use_req_ring and compress_ratio != 4:
        raise ArgumentError(f"use_req_ring requires compress_ratio == 4, got compress_ratio={compress_ratio}")
    if ring_size <= 0 or ring_size % compress_ratio != 0:
        raise ArgumentError(f"ring_size must be a positive multiple of compress_ratio={compress_ratio}, "
                            f"got {ring_size}")
    if swa_page_size <= 0 or swa_page_size % ring_size != 0:
        raise ArgumentError(f"swa_page_size must be a positive multiple of ring_size={ring_size}, got {swa_page_size}")


def _batch_lists(req_pool_indices, **lens) -> tuple[list[int], dict[str, list[int]]]:
    rids = _cpu_list(req_pool_indices)
    out = {}
    for name, t in lens.items():
        out[name] = _cpu_list(t)
        if len(out[name]) != len(rids):
            raise ArgumentError(f"{name} must have one entry per request (B={len(rids)}), got {len(out[name])}")
    return rids, out


def _check_prefill_batch(seq_lens: list[int], extend_lens: list[int], num_q_tokens: int) -> int:
    num_q_tokens = int(num_q_tokens)
    B = len(seq_lens)
    if B > MAX_BATCH:
        raise ArgumentError(f"req_pool_indices: batch size must be < 65536, got {B}")
    if not 0 <= num_q_tokens <= MAX_NUM_Q_TOKENS:
        raise ArgumentError(f"num_q_tokens must be in [0, {MAX_NUM_Q_TOKENS}], got {num_q_tokens}")
    if B > num_q_tokens:
        raise ArgumentError(f"num_q_tokens must be >= batch size {B}, got {num_q_tokens}")
    for b, (seq_len, extend_len) in enumerate(zip(seq_lens, extend_lens)):
        if not 0 < extend_len <= seq_len:
            raise ArgumentError(f"extend_lens[{b}] must satisfy 0 < extend_len <= seq_len "
                                f"(seq_lens[{b}]={seq_len}), got {extend_len}")
    if sum(extend_lens) != num_q_tokens:
        raise ArgumentError(f"num_q_tokens must equal sum(extend_lens)={sum(extend_lens)}, got {num_q_tokens}")
    return num_q_tokens


def _check_decode_seq_lens(seq_lens: list[int]) -> None:
    for b, seq_len in enumerate(seq_lens):
        if seq_len < 1:  # seq_len 0 would address position -1
            raise ArgumentError(f"seq_lens[{b}] must be >= 1 in decode, got {seq_len}")


def _paged_row_fn(compress_ratio: int, req_to_token: torch.Tensor, full_to_state: torch.Tensor,
                  swa_page_size: int, ring_size: int, use_req_ring: bool) -> RowFn:
    if compress_ratio == 128 or use_req_ring:
        return lambda rid, pos: request_ring_row(rid, pos, ring_size)
    return lambda rid, pos: paged_swa_row(req_to_token, full_to_state, rid, pos, swa_page_size, ring_size)


def _tables(req_to_token: torch.Tensor, full_to_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    req_to_token = req_to_token.detach().to("cpu")
    full_to_state = full_to_state.detach().to("cpu")
    if req_to_token.dim() != 2:
        raise ArgumentError(f"req_to_token must be 2-D [num_reqs, max_ctx], got shape {tuple(req_to_token.shape)}")
    if full_to_state.dim() != 1:
        raise ArgumentError(f"full_to_state must be 1-D, got shape {tuple(full_to_state.shape)}")
    return req_to_token, full_to_state


# ---------------------------------------------------------------------------------------------
# Public planners
# ---------------------------------------------------------------------------------------------

def plan_prefill(compress_ratio: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 extend_lens: torch.Tensor, req_to_token: torch.Tensor, full_to_state: torch.Tensor,
                 swa_page_size: int, ring_size: int, num_q_tokens: int, use_cuda_graph: bool = False,
                 use_req_ring: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged prefill plan (contract §3): (plan_c [Nc,16], plan_w [Nw,8]), or num_q_tokens rows each
    with ``use_cuda_graph`` (padding rows are the invalid sentinel)."""
    check_ratio(compress_ratio)
    _check_ring(compress_ratio, swa_page_size, ring_size, use_req_ring)
    req_to_token, full_to_state = _tables(req_to_token, full_to_state)
    rids, lens = _batch_lists(req_pool_indices, seq_lens=seq_lens, extend_lens=extend_lens)
    num_q_tokens = _check_prefill_batch(lens["seq_lens"], lens["extend_lens"], num_q_tokens)

    page_tail = compress_ratio == 4 and not use_req_ring
    plan_c0, plan_w0 = enumerate_stage0(compress_ratio, lens["seq_lens"], lens["extend_lens"],
                                        mtp_pad=mtp_pad_for(compress_ratio, ring_size),
                                        page_tail=page_tail, swa_page_size=swa_page_size)
    row_of = _paged_row_fn(compress_ratio, req_to_token, full_to_state, swa_page_size, ring_size, use_req_ring)
    return _translate(compress_ratio, plan_c0, plan_w0, rids, row_of, translate_all=False,
                      num_padded=num_q_tokens if use_cuda_graph else None)


def plan_prefill_legacy(compress_ratio: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        extend_lens: torch.Tensor, num_q_tokens: int,
                        use_cuda_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Legacy (non-paged) prefill plan: no mtp_pad, no page-tail rule, every compress row translated."""
    check_ratio(compress_ratio)
    rids, lens = _batch_lists(req_pool_indices, seq_lens=seq_lens, extend_lens=extend_lens)
    num_q_tokens = _check_prefill_batch(lens["seq_lens"], lens["extend_lens"], num_q_tokens)

    plan_c0, plan_w0 = enumerate_stage0(compress_ratio, lens["seq_lens"], lens["extend_lens"])
    return _translate(compress_ratio, plan_c0, plan_w0, rids,
                      lambda rid, pos: legacy_row(compress_ratio, rid, pos), translate_all=True,
                      num_padded=num_q_tokens if use_cuda_graph else None)


def plan_decode(compress_ratio: int, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                full_to_state: torch.Tensor, seq_lens: torch.Tensor, swa_page_size: int, ring_size: int,
                use_req_ring: bool = False) -> torch.Tensor:
    """Paged decode plan (contract §3.7): one row per request; the current token is at seq_len - 1."""
    check_ratio(compress_ratio)
    _check_ring(compress_ratio, swa_page_size, ring_size, use_req_ring)
    req_to_token, full_to_state = _tables(req_to_token, full_to_state)
    rids, lens = _batch_lists(req_pool_indices, seq_lens=seq_lens)
    _check_decode_seq_lens(lens["seq_lens"])

    R = compress_ratio
    row_of = _paged_row_fn(R, req_to_token, full_to_state, swa_page_size, ring_size, use_req_ring)
    write_loc, read_page_0, read_page_1 = [], [], []
    for rid, seq_len in zip(rids, lens["seq_lens"]):
        p1 = seq_len - 1
        p0 = max(p1 - R, 0)
        write_loc.append(row_of(rid, p1))
        read_page_0.append(_cdiv(row_of(rid, p0), R))
        read_page_1.append(_cdiv(write_loc[-1], R))
    return encode_decode_plan(torch.tensor(lens["seq_lens"], dtype=torch.int64),
                              torch.tensor(write_loc, dtype=torch.int64),
                              torch.tensor(read_page_0, dtype=torch.int64),
                              torch.tensor(read_page_1, dtype=torch.int64))


def plan_decode_legacy(compress_ratio: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Legacy decode plan: state rows / pages from the legacy scheme of contract §3.1."""
    check_ratio(compress_ratio)
    rids, lens = _batch_lists(req_pool_indices, seq_lens=seq_lens)
    _check_decode_seq_lens(lens["seq_lens"])

    R = compress_ratio
    write_loc, read_page_0, read_page_1 = [], [], []
    for rid, seq_len in zip(rids, lens["seq_lens"]):
        p1 = seq_len - 1
        p0 = max(p1 - R, 0)
        write_loc.append(legacy_row(R, rid, p1))
        read_page_0.append(legacy_page(R, rid, p0))
        read_page_1.append(legacy_page(R, rid, p1))
    return encode_decode_plan(torch.tensor(lens["seq_lens"], dtype=torch.int64),
                              torch.tensor(write_loc, dtype=torch.int64),
                              torch.tensor(read_page_0, dtype=torch.int64),
                              torch.tensor(read_page_1, dtype=torch.int64))
