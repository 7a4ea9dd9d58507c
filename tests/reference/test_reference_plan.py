"""CPU tests of the reference planner (contract §3).

Expectations are derived from docs/contract.md by hand (worked examples, edge cases) or from independent
restatements of the contract: the state-row formulas below use the simplified forms contract §3.1
proves equivalent (in-ring offset = pos mod ring_size, legacy = request ring of Wn rows), and the
simulator applies plans the way the kernels do (contract §4.4, contract §4.5) on integer token ids.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

import pytest
import torch

from dsv4jit.plan_layout import INVALID_U32, decode_compress_plan, decode_decode_plan, decode_write_plan
from dsv4jit.reference.plan import (
    enumerate_stage0,
    legacy_page,
    legacy_row,
    paged_swa_row,
    plan_decode,
    plan_decode_legacy,
    plan_prefill,
    plan_prefill_legacy,
    request_ring_row,
)

SWA_PAGE_SIZE = 256
#: mtp_pad per (ratio, ring_size), the table of contract §3.9.
MTP_PAD = {(4, 8): 0, (4, 16): 10, (128, 128): 0, (128, 256): 130}


def i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# Pool model: full slots and page-aligned SWA slots
# ---------------------------------------------------------------------------------------------

@dataclass
class Pool:
    req_to_token: torch.Tensor   # i32 [num_reqs, max_ctx], random distinct full slots
    full_to_state: torch.Tensor  # i64 [num_full + 1], trailing -1 like the SWA allocator's mapping
    swa_page_of: list[list[int]]  # swa_page_of[rid][pos // SWA_PAGE_SIZE]


def make_pool(gen: torch.Generator, num_reqs: int, max_ctx: int) -> Pool:
    num_full = num_reqs * max_ctx
    req_to_token = torch.randperm(num_full, generator=gen).reshape(num_reqs, max_ctx).to(torch.int32)
    pages_per_req = -(-max_ctx // SWA_PAGE_SIZE)
    swa_page_of = torch.randperm(num_reqs * pages_per_req, generator=gen).reshape(num_reqs, pages_per_req)
    pos = torch.arange(max_ctx)
    # SWA slots are page aligned: swa mod swa_page_size == pos mod swa_page_size.
    swa = swa_page_of[:, pos // SWA_PAGE_SIZE] * SWA_PAGE_SIZE + pos % SWA_PAGE_SIZE
    full_to_state = torch.full((num_full + 1,), -1, dtype=torch.int64)
    full_to_state[req_to_token.long().reshape(-1)] = swa.reshape(-1)
    return Pool(req_to_token, full_to_state, swa_page_of.tolist())


@dataclass(frozen=True)
class Cfg:
    mode: str  # "paged" (incl. c128, which always uses request rings), "req_ring", "legacy"
    R: int
    ring: int

    @property
    def wn(self) -> int:
        return 8 if self.R == 4 else 128

    @property
    def mtp_pad(self) -> int:
        return 0 if self.mode == "legacy" else MTP_PAD[(self.R, self.ring)]

    def __str__(self) -> str:
        return f"{self.mode}-c{self.R}-ring{self.ring}"


CONFIGS = [Cfg("paged", 4, 8), Cfg("paged", 4, 16), Cfg("req_ring", 4, 8), Cfg("req_ring", 4, 16),
           Cfg("paged", 128, 128), Cfg("paged", 128, 256), Cfg("legacy", 4, 8), Cfg("legacy", 128, 128)]


def expected_row(cfg: Cfg, pool: Pool, rid: int, pos: int) -> int:
    if cfg.mode == "legacy":  # identical to a request ring of Wn rows (contract §3.1)
        return rid * cfg.wn + pos % cfg.wn
    if cfg.mode == "req_ring" or cfg.R == 128:
        return rid * cfg.ring + pos % cfg.ring
    return pool.swa_page_of[rid][pos // SWA_PAGE_SIZE] * cfg.ring + pos % cfg.ring


def expected_write_positions(cfg: Cfg, seq_len: int, extend_len: int) -> set[int]:
    """The write set of contract §3.3, as a set: open window (+ the overlap half for c4),
    the trailing mtp_pad tokens, and (paged c4) the last 4 tokens of every SWA page."""
    keep = set(range(seq_len - seq_len % cfg.R - (4 if cfg.R == 4 else 0), seq_len))
    keep |= set(range(seq_len - cfg.mtp_pad, seq_len))
    if cfg.mode == "paged" and cfg.R == 4:
        keep |= {p for p in range(seq_len) if p % SWA_PAGE_SIZE >= SWA_PAGE_SIZE - 4}
    return {p for p in keep if seq_len - extend_len <= p < seq_len}


def run_prefill(cfg: Cfg, pool: Pool, rids, seq_lens, extend_lens, use_cuda_graph=False):
    num_q_tokens = sum(extend_lens)
    if cfg.mode == "legacy":
        return plan_prefill_legacy(cfg.R, i64(rids), i64(seq_lens), i64(extend_lens), num_q_tokens, use_cuda_graph)
    return plan_prefill(cfg.R, i64(rids), i64(seq_lens), i64(extend_lens), pool.req_to_token, pool.full_to_state,
                        SWA_PAGE_SIZE, cfg.ring, num_q_tokens, use_cuda_graph, use_req_ring=cfg.mode == "req_ring")


def run_decode(cfg: Cfg, pool: Pool, rids, seq_lens):
    if cfg.mode == "legacy":
        return plan_decode_legacy(cfg.R, i64(rids), i64(seq_lens))
    return plan_decode(cfg.R, i64(rids), pool.req_to_token, pool.full_to_state, i64(seq_lens),
                       SWA_PAGE_SIZE, cfg.ring, use_req_ring=cfg.mode == "req_ring")


def c_rows(plan):
    return [tuple(r) for r in torch.stack(list(decode_compress_plan(plan)), dim=1).tolist()]


def w_rows(plan):
    return [tuple(r) for r in torch.stack(list(decode_write_plan(plan)), dim=1).tolist()]


INVALID_C = (INVALID_U32, 0, 0, -1, -1)
INVALID_W = (INVALID_U32, -1)


# ---------------------------------------------------------------------------------------------
# Addressing helpers (contract §3.1)
# ---------------------------------------------------------------------------------------------

def test_addressing_helpers():
    # req 1 position 300 -> full slot 7 -> SWA slot 2*256 + 44 (page 2, page aligned).
    req_to_token = torch.zeros(2, 512, dtype=torch.int32)
    req_to_token[1, 300] = 7
    full_to_state = torch.full((9,), -1, dtype=torch.int64)
    full_to_state[7] = 2 * 256 + 44
    assert paged_swa_row(req_to_token, full_to_state, 1, 300, 256, 8) == 2 * 8 + 44 % 8
    assert paged_swa_row(req_to_token, full_to_state, 1, 300, 256, 16) == 2 * 16 + 44 % 16
    # An evicted slot (-1) follows C arithmetic: row -1 (contract §9.11).
    req_to_token[1, 301] = 8
    assert paged_swa_row(req_to_token, full_to_state, 1, 301, 256, 8) == -1
    # full_to_state values are narrowed to int32.
    full_to_state[7] = 2**32 + 5
    assert paged_swa_row(req_to_token, full_to_state, 1, 300, 256, 8) == 5

    assert request_ring_row(3, 21, 16) == 3 * 16 + 5
    assert request_ring_row(2**27, 1, 16) == -(2**31) + 1  # 64-bit product, narrowed to int32

    assert [legacy_page(4, 5, p) for p in (0, 3, 4, 7, 8, 13)] == [10, 10, 11, 11, 10, 11]
    assert [legacy_row(4, 5, p) for p in (0, 3, 4, 7, 8, 13)] == [40, 43, 44, 47, 40, 45]
    assert legacy_page(128, 5, 1000) == 5 and legacy_row(128, 5, 1000) == 5 * 128 + 1000 % 128
    assert legacy_page(128, 2**32 + 3, 0) == 3  # rid narrowed to int32


# ---------------------------------------------------------------------------------------------
# Stage 0 (contract §3.2, contract §3.3)
# ---------------------------------------------------------------------------------------------

def test_stage0_rows_before_translation():
    # Batch: (seq 11, ext 6) then (seq 4, ext 4); c4, no pad. Ragged 0..5 then 6..9.
    plan_c0, plan_w0 = enumerate_stage0(4, [11, 4], [6, 4])
    # Events: b0 p=7 (j=2, buffer_len 8-3=5); b1 p=3 (j=3, buffer_len 8-4=4).
    assert c_rows(plan_c0) == [(8, 2, 5, -1, 0), (4, 9, 4, -1, 1)]
    # b0: last_c 8, first_w 4 -> positions 5..10; b1: last_c 4, first_w 0 -> positions 0..3.
    expected_w = [(rg | (0 << 16), p + 1) for rg, p in zip(range(6), range(5, 11))]
    expected_w += [((6 + j) | (1 << 16), j + 1) for j in range(4)]
    assert w_rows(plan_w0) == expected_w


def test_stage0_mtp_pad_and_page_tail_flags():
    # c4, seq 600 from scratch. Plain: 596..599. Page tail adds 252..255 and 508..511.
    _, w = enumerate_stage0(4, [600], [600])
    assert [loc - 1 for _, loc in w_rows(w)] == list(range(596, 600))
    _, w = enumerate_stage0(4, [600], [600], page_tail=True, swa_page_size=256)
    assert [loc - 1 for _, loc in w_rows(w)] == [*range(252, 256), *range(508, 512), *range(596, 600)]
    # mtp_pad 10 with seq 30: first_w = min(28-4, 30-10) = 20.
    _, w = enumerate_stage0(4, [30], [30], mtp_pad=10)
    assert [loc - 1 for _, loc in w_rows(w)] == list(range(20, 30))


# ---------------------------------------------------------------------------------------------
# Worked examples (the scenarios of contract §3.10)
# ---------------------------------------------------------------------------------------------

def _single_request_tables(rid: int, swa_page: int, ctx: int = 512):
    """req_to_token[rid][pos] = 1000 + pos; full slot 1000 + pos -> SWA slot swa_page*256 + pos."""
    req_to_token = torch.zeros(rid + 1, ctx, dtype=torch.int32)
    req_to_token[rid] = 1000 + torch.arange(ctx, dtype=torch.int32)
    full_to_state = torch.full((1000 + ctx + 1,), -1, dtype=torch.int64)
    full_to_state[1000:1000 + ctx] = swa_page * 256 + torch.arange(ctx)
    return req_to_token, full_to_state


def test_worked_example_c4_paged_prefill_then_decode():
    rid, swa_page = 3, 5  # rows of this SWA page's ring: 5*8 + pos mod 8
    req_to_token, full_to_state = _single_request_tables(rid, swa_page)
    plan_c, plan_w = plan_prefill(4, i64([rid]), i64([11]), i64([6]), req_to_token, full_to_state,
                                  256, 8, 6)
    # Event at p=7 (j=2): seq_len 8, ragged 2, buffer_len 5; read_page_0 = page of max(7-4,0)=3
    # = row 43 div 4 = 10 (= swa_page*2), read_page_1 = page of 7 = row 47 div 4 = 11.
    assert c_rows(plan_c) == [(8, 2, 5, 10, 11)]
    # last_c 8, first_w 4: all six tokens (positions 5..10) written at 40 + p mod 8.
    assert w_rows(plan_w) == [(0, 45), (1, 46), (2, 47), (3, 40), (4, 41), (5, 42)]

    # Next decode at seq_len 12: write row of 11 (= 43); read_page_0 = page of 7 = swa_page*2+1,
    # read_page_1 = page of 11 = swa_page*2.
    plan_d = plan_decode(4, i64([rid]), req_to_token, full_to_state, i64([12]), 256, 8)
    d = decode_decode_plan(plan_d)
    assert plan_d.shape == (1, 16) and plan_d.dtype == torch.uint8
    assert (d.seq_len.tolist(), d.write_loc.tolist(), d.read_page_0.tolist(), d.read_page_1.tolist()) == \
        ([12], [43], [11], [10])


def test_worked_example_c128_prefix_100_extend_200():
    rid = 2
    req_to_token, full_to_state = _single_request_tables(rid, swa_page=0)
    plan_c, plan_w = plan_prefill(128, i64([rid]), i64([300]), i64([200]), req_to_token, full_to_state,
                                  256, 128, 200)
    # p=127 (j=27): buffer_len 100, both read pages = page of the ring row rid*128 + p mod 128 -> 2.
    # p=255 (j=155): buffer_len 0 -> untranslated: read_page_0 -1, read_page_1 = batch id 0.
    assert c_rows(plan_c) == [(128, 27, 100, 2, 2), (256, 155, 0, -1, 0)]
    # last_c 256, first_w 256: positions 256..299 = ragged 156..199, rows 256 + p mod 128.
    assert w_rows(plan_w) == [(156 + k, 256 + k) for k in range(44)]

    # Legacy translates the buffer_len 0 row too (page = rid for c128).
    plan_c, plan_w = plan_prefill_legacy(128, i64([rid]), i64([300]), i64([200]), 200)
    assert c_rows(plan_c) == [(128, 27, 100, 2, 2), (256, 155, 0, 2, 2)]
    assert w_rows(plan_w) == [(156 + k, 256 + k) for k in range(44)]


# ---------------------------------------------------------------------------------------------
# Edge cases named in contract §3.3
# ---------------------------------------------------------------------------------------------

def test_c4_seq_multiple_of_4_still_writes_last_4():
    pool = make_pool(torch.Generator().manual_seed(0), 4, 512)
    for cfg in (Cfg("paged", 4, 8), Cfg("req_ring", 4, 8), Cfg("legacy", 4, 8)):
        # last_c 16, first_w 12: the next event's overlap half is positions 12..15.
        plan_c, plan_w = run_prefill(cfg, pool, [1], [16], [16])
        assert [rg for rg, _ in w_rows(plan_w)] == [12, 13, 14, 15], cfg
        assert [r[0] for r in c_rows(plan_c)] == [4, 8, 12, 16]


def test_c128_seq_multiple_of_128_writes_nothing_without_pad():
    pool = make_pool(torch.Generator().manual_seed(1), 4, 512)
    plan_c, plan_w = run_prefill(Cfg("paged", 128, 128), pool, [2], [256], [200])
    assert plan_w.shape == (0, 8)
    # Events p=127 (j=71, buffer_len 128-72=56) and p=255 (j=199, buffer_len 0).
    assert [(r[0], r[1], r[2]) for r in c_rows(plan_c)] == [(128, 71, 56), (256, 199, 0)]
    _, plan_w = run_prefill(Cfg("legacy", 128, 128), pool, [2], [256], [200])
    assert plan_w.shape == (0, 8)
    # ring 256: mtp_pad 130 keeps positions 126..255 (the extend range starts at 56).
    _, plan_w = run_prefill(Cfg("paged", 128, 256), pool, [2], [256], [200])
    assert [rg for rg, _ in w_rows(plan_w)] == [p - 56 for p in range(126, 256)]
    assert [loc for _, loc in w_rows(plan_w)] == [2 * 256 + p for p in range(126, 256)]


def test_mtp_pad_keeps_trailing_tokens_c4_ring16():
    pool = make_pool(torch.Generator().manual_seed(2), 4, 512)
    for mode in ("paged", "req_ring"):
        # seq 30 from scratch: last_c 28, first_w = min(24, 30-10) = 20.
        _, plan_w = run_prefill(Cfg(mode, 4, 16), pool, [1], [30], [30])
        assert [rg for rg, _ in w_rows(plan_w)] == list(range(20, 30))
        _, plan_w = run_prefill(Cfg(mode, 4, 8), pool, [1], [30], [30])
        assert [rg for rg, _ in w_rows(plan_w)] == list(range(24, 30))
    # The pad never reaches before the extend range: prefix 25, extend 5 writes only 25..29.
    _, plan_w = run_prefill(Cfg("paged", 4, 16), pool, [1], [30], [5])
    assert [rg for rg, _ in w_rows(plan_w)] == list(range(5))


def test_page_tail_rule_only_for_paged_c4():
    pool = make_pool(torch.Generator().manual_seed(3), 4, 1024)
    rid = 3
    expected_tail = [*range(252, 256), *range(508, 512)]
    _, plan_w = run_prefill(Cfg("paged", 4, 8), pool, [rid], [600], [600])
    rows = w_rows(plan_w)
    assert [rg for rg, _ in rows] == expected_tail + list(range(596, 600))
    page = pool.swa_page_of[rid]
    assert [loc for _, loc in rows] == [page[p // 256] * 8 + p % 8 for p in expected_tail + list(range(596, 600))]
    for cfg in (Cfg("req_ring", 4, 8), Cfg("legacy", 4, 8)):
        _, plan_w = run_prefill(cfg, pool, [rid], [600], [600])
        assert [rg for rg, _ in w_rows(plan_w)] == list(range(596, 600)), cfg
    # c128 has no page tail either.
    _, plan_w = run_prefill(Cfg("paged", 128, 128), pool, [rid], [600], [600])
    assert [rg for rg, _ in w_rows(plan_w)] == list(range(512, 600))


def test_buffer_len_zero_rows_paged_vs_legacy():
    pool = make_pool(torch.Generator().manual_seed(4), 8, 512)
    rids, seq, ext = [6, 1, 4], [8, 16, 13], [3, 16, 13]
    # b0: prefix 5, event p=7 (j=2) buffer_len 5. b1: events 3,7,11,15 with buffer_len 4,0,0,0.
    # b2: prefix 0, events 3,7,11 with buffer_len 4,0,0.
    plan_c, _ = run_prefill(Cfg("paged", 4, 8), pool, rids, seq, ext)
    rows = c_rows(plan_c)
    assert [r[2] for r in rows] == [5, 4, 0, 0, 0, 4, 0, 0]
    for r, b in zip(rows, [0, 1, 1, 1, 1, 2, 2, 2]):
        if r[2] == 0:
            assert (r[3], r[4]) == (-1, b)
        else:
            p = r[0] - 1
            row = lambda q: pool.swa_page_of[rids[b]][q // 256] * 8 + q % 8  # noqa: E731
            assert (r[3], r[4]) == (row(max(p - 4, 0)) // 4, row(p) // 4)
    plan_c, _ = run_prefill(Cfg("legacy", 4, 8), pool, rids, seq, ext)
    for r, b in zip(c_rows(plan_c), [0, 1, 1, 1, 1, 2, 2, 2]):
        p = r[0] - 1
        assert (r[3], r[4]) == (rids[b] * 2 + (max(p - 4, 0) // 4) % 2, rids[b] * 2 + (p // 4) % 2)


def test_first_c4_window():
    pool = make_pool(torch.Generator().manual_seed(5), 4, 512)
    # Prefix 1, extend 3: event at p=3 (j=2), buffer_len 8-3 = 5 (slots 0-3 masked, slot 4 = position 0).
    plan_c, plan_w = run_prefill(Cfg("req_ring", 4, 8), pool, [2], [4], [3])
    # read_page_0 = page of max(3-4, 0) = 0, read_page_1 = page of 3: both 2*8 div 4 = 4 (aliased, contract §3.4).
    assert c_rows(plan_c) == [(4, 2, 5, 4, 4)]
    assert w_rows(plan_w) == [(0, 17), (1, 18), (2, 19)]
    # Decode at seq_len 4 for c4 req-ring and legacy: pages of 0 and 3 alias.
    d = decode_decode_plan(run_decode(Cfg("req_ring", 4, 16), pool, [2], [4]))
    assert (d.write_loc.item(), d.read_page_0.item(), d.read_page_1.item()) == (35, 8, 8)
    d = decode_decode_plan(run_decode(Cfg("legacy", 4, 8), pool, [2], [4]))
    assert (d.write_loc.item(), d.read_page_0.item(), d.read_page_1.item()) == (19, 4, 4)


def test_decode_c128_and_legacy_values():
    pool = make_pool(torch.Generator().manual_seed(6), 8, 512)
    # c128 ring 256, rid 5, seq 300: p1 = 299 -> row 5*256 + 43; p0 = 171 -> row 5*256 + 171.
    d = decode_decode_plan(run_decode(Cfg("paged", 128, 256), pool, [5, 1], [300, 1]))
    assert d.seq_len.tolist() == [300, 1]
    assert d.write_loc.tolist() == [1280 + 43, 256]
    assert d.read_page_0.tolist() == [(1280 + 171) // 128, 2]
    assert d.read_page_1.tolist() == [(1280 + 43) // 128, 2]
    # Legacy c4, rid 5, seq 14: p1 = 13 -> page 2*5 + (13 div 4) mod 2 = 11, row 45;
    # p0 = 9 -> page 2*5 + (9 div 4) mod 2 = 10.
    d = decode_decode_plan(run_decode(Cfg("legacy", 4, 8), pool, [5], [14]))
    assert (d.write_loc.item(), d.read_page_0.item(), d.read_page_1.item()) == (45, 10, 11)
    # Legacy c128: page = rid.
    d = decode_decode_plan(run_decode(Cfg("legacy", 128, 128), pool, [5], [300]))
    assert (d.write_loc.item(), d.read_page_0.item(), d.read_page_1.item()) == (5 * 128 + 43, 5, 5)


def test_cuda_graph_padding():
    pool = make_pool(torch.Generator().manual_seed(7), 4, 512)
    # c4 paged, seq [4, 20], ext [2, 6], 8 tokens.
    # b0: positions 2,3 (ragged 0,1); event p=3 (ragged 1, buffer_len 6); first_w 0 -> writes ragged 0,1.
    # b1: positions 14..19 (ragged 2..7); events p=15 (ragged 3, buffer_len 6), p=19 (ragged 7,
    #     buffer_len 2); first_w 16 -> writes ragged 4..7.  So Nc = 3, Nw = 6.
    args = (Cfg("paged", 4, 8), pool, [0, 3], [4, 20], [2, 6])
    plan_c, plan_w = run_prefill(*args)
    assert plan_c.shape == (3, 16) and plan_w.shape == (6, 8)
    assert [r[:3] for r in c_rows(plan_c)] == [(4, 1, 6), (16, 3, 6), (20, 7, 2)]
    assert [rg for rg, _ in w_rows(plan_w)] == [0, 1, 4, 5, 6, 7]
    pc, pw = run_prefill(*args, use_cuda_graph=True)
    assert pc.shape == (8, 16) and pw.shape == (8, 8)
    assert torch.equal(pc[:3], plan_c) and torch.equal(pw[:6], plan_w)
    assert c_rows(pc)[3:] == [INVALID_C] * 5
    assert w_rows(pw)[6:] == [INVALID_W] * 2
    pc, pw = plan_prefill_legacy(4, i64([0, 3]), i64([4, 20]), i64([2, 6]), 8, use_cuda_graph=True)
    assert pc.shape == (8, 16) and c_rows(pc)[3:] == [INVALID_C] * 5 and w_rows(pw)[6:] == [INVALID_W] * 2
    # The CPU path requires num_q_tokens == sum(extend_lens), also with cuda-graph padding.
    with pytest.raises(ValueError, match="num_q_tokens"):
        plan_prefill(4, i64([0, 1]), i64([1, 3]), i64([1, 2]), pool.req_to_token, pool.full_to_state,
                     256, 8, 4, use_cuda_graph=True)


def test_empty_batch():
    pool = make_pool(torch.Generator().manual_seed(8), 2, 256)
    e = i64([])
    for graph in (False, True):
        pc, pw = plan_prefill(4, e, e, e, pool.req_to_token, pool.full_to_state, 256, 8, 0, graph)
        assert pc.shape == (0, 16) and pw.shape == (0, 8) and pc.dtype == pw.dtype == torch.uint8
        pc, pw = plan_prefill_legacy(128, e, e, e, 0, graph)
        assert pc.shape == (0, 16) and pw.shape == (0, 8)
    assert plan_decode(128, e, pool.req_to_token, pool.full_to_state, e, 256, 128).shape == (0, 16)
    assert plan_decode_legacy(4, e, e).shape == (0, 16)


def test_num_q_tokens_limit_is_inclusive():
    # 65536 tokens: ragged ids 0..65535 fit in u16. c128 legacy, seq multiple of 128 -> no writes.
    plan_c, plan_w = plan_prefill_legacy(128, i64([0]), i64([65536]), i64([65536]), 65536)
    rows = c_rows(plan_c)
    assert len(rows) == 512 and rows[-1][:3] == (65536, 65535, 0) and plan_w.shape == (0, 8)


# ---------------------------------------------------------------------------------------------
# Limits (contract §8.2): ValueError naming the argument
# ---------------------------------------------------------------------------------------------

def test_limits_raise_value_error():
    pool = make_pool(torch.Generator().manual_seed(9), 4, 512)
    t2t, f2s = pool.req_to_token, pool.full_to_state

    def paged(R=4, rids=(0,), seq=(8,), ext=(8,), sps=256, ring=8, nq=None, rr=False):
        nq = sum(ext) if nq is None else nq
        return plan_prefill(R, i64(list(rids)), i64(list(seq)), i64(list(ext)), t2t, f2s, sps, ring, nq,
                            use_req_ring=rr)

    for fn, arg in [(lambda: paged(R=8, ring=8), "compress_ratio"),
                    (lambda: plan_prefill_legacy(2, i64([0]), i64([8]), i64([8]), 8), "compress_ratio"),
                    (lambda: plan_decode(64, i64([0]), t2t, f2s, i64([8]), 256, 128), "compress_ratio"),
                    (lambda: plan_decode_legacy(8, i64([0]), i64([8])), "compress_ratio"),
                    (lambda: paged(R=128, ring=128, rr=True), "use_req_ring"),
                    (lambda: plan_decode(128, i64([0]), t2t, f2s, i64([8]), 256, 128, use_req_ring=True), "use_req_ring"),
                    (lambda: paged(ring=6), "ring_size"),
                    (lambda: paged(R=128, ring=64), "ring_size"),
                    (lambda: paged(sps=100), "swa_page_size"),
                    (lambda: plan_decode(4, i64([0]), t2t, f2s, i64([8]), 100, 8), "swa_page_size"),
                    (lambda: paged(ext=(0,), nq=1), "extend_lens"),
                    (lambda: paged(seq=(4,), ext=(5,)), "extend_lens"),
                    (lambda: plan_prefill_legacy(4, i64([0, 1]), i64([8, 8]), i64([8, 0]), 8), "extend_lens"),
                    (lambda: paged(nq=9), "num_q_tokens"),
                    (lambda: plan_prefill_legacy(4, i64([0]), i64([8]), i64([8]), 7), "num_q_tokens"),
                    (lambda: paged(rids=(0, 1, 2), seq=(8, 8, 8), ext=(1, 1, 1), nq=2), "num_q_tokens"),
                    (lambda: paged(rids=(0,), seq=(70000,), ext=(65537,)), "num_q_tokens"),
                    (lambda: plan_prefill_legacy(4, torch.zeros(65536, dtype=torch.int64), torch.ones(65536, dtype=torch.int64),
                                                 torch.ones(65536, dtype=torch.int64), 65536), "req_pool_indices"),
                    (lambda: paged(rids=(0, 1), seq=(8,), ext=(8,)), "seq_lens"),
                    (lambda: plan_decode(4, i64([0]), t2t, f2s, i64([0]), 256, 8), "seq_lens"),
                    (lambda: plan_decode_legacy(4, i64([0]), i64([0])), "seq_lens")]:
        with pytest.raises(ValueError, match=arg):
            fn()


# ---------------------------------------------------------------------------------------------
# Invariants on randomized batches (contract §3.11)
# ---------------------------------------------------------------------------------------------

def random_batch(rng: random.Random, cfg: Cfg, num_reqs: int, max_ctx: int):
    B = rng.randint(1, 16)
    rids = rng.sample(range(num_reqs), B)
    seq_lens, extend_lens = [], []
    for _ in range(B):
        ext = rng.choice([1, 1, rng.randint(2, 9), rng.randint(1, 130), rng.randint(1, 600)])
        prefix = rng.choice([0, rng.randint(0, 700), rng.randint(0, 5) * cfg.R])
        seq_len = prefix + ext
        if rng.random() < 0.3:  # end exactly on a ratio boundary
            seq_len = -(-seq_len // cfg.R) * cfg.R
        seq_lens.append(min(seq_len, max_ctx))
        extend_lens.append(min(ext, seq_lens[-1]))
    return rids, seq_lens, extend_lens


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_invariants_random_batches(cfg: Cfg):
    gen = torch.Generator().manual_seed(1234 + CONFIGS.index(cfg))
    rng = random.Random(4321 + CONFIGS.index(cfg))
    num_reqs, max_ctx = 24, 1536
    pool = make_pool(gen, num_reqs, max_ctx)
    for _ in range(12):
        rids, seq_lens, extend_lens = random_batch(rng, cfg, num_reqs, max_ctx)
        nq = sum(extend_lens)
        bases = [sum(extend_lens[:b]) for b in range(len(rids))]
        plan_c, plan_w = run_prefill(cfg, pool, rids, seq_lens, extend_lens)

        events, prev = [], None
        for seq_len, rg, buffer_len, rp0, rp1 in c_rows(plan_c):
            assert seq_len % cfg.R == 0 and buffer_len < cfg.wn and rg < nq
            b = bisect.bisect_right(bases, rg) - 1
            prefix = seq_lens[b] - extend_lens[b]
            p = seq_len - 1
            assert rg == bases[b] + p - prefix  # ragged id of the closing token
            assert buffer_len == max(0, prefix - (p - cfg.wn + 1))  # window slots before this step
            if buffer_len > 0 or cfg.mode == "legacy":
                assert rp0 == expected_row(cfg, pool, rids[b], max(p - cfg.R, 0)) // cfg.R
                assert rp1 == expected_row(cfg, pool, rids[b], p) // cfg.R
            else:
                assert (rp0, rp1) == (-1, b)
            assert prev is None or (b, p) > prev  # CPU order: batch-major, position ascending
            prev = (b, p)
            events.append((b, p))
        assert events == [(b, p) for b in range(len(rids))
                          for p in range(seq_lens[b] - extend_lens[b], seq_lens[b]) if (p + 1) % cfg.R == 0]

        written = {b: set() for b in range(len(rids))}
        state_rows, prev = set(), None
        for rg, loc in w_rows(plan_w):
            assert rg < nq
            b = bisect.bisect_right(bases, rg) - 1
            p = seq_lens[b] - extend_lens[b] + rg - bases[b]
            assert loc == expected_row(cfg, pool, rids[b], p)
            assert loc not in state_rows  # no two writes of a step hit the same row
            state_rows.add(loc)
            assert prev is None or rg > prev
            prev = rg
            written[b].add(p)
        for b in range(len(rids)):
            assert written[b] == expected_write_positions(cfg, seq_lens[b], extend_lens[b])


# ---------------------------------------------------------------------------------------------
# Simulation: apply plans to a state ring of token ids and check every compress window (contract §3.11)
# ---------------------------------------------------------------------------------------------

@dataclass
class Request:
    rid: int
    history: list[int]   # token id at each position (the request's true content)
    done: int            # tokens already processed (prefix_len of the next step)
    prefill_to: int      # prefill until this length, then decode to len(history)
    windows_checked: list[int] = field(default_factory=list)


class RingSim:
    """State rows hold token ids; a compress event must see exactly positions p-Wn+1 .. p."""

    def __init__(self, cfg: Cfg, pool: Pool):
        self.cfg, self.pool = cfg, pool
        self.state: dict[int, int] = {}

    def _check_window(self, req: Request, p: int, slot_token) -> None:
        cfg = self.cfg
        for s in range(cfg.wn):
            if cfg.R == 4 and p + 1 == 4 and s < 4:
                continue  # first c4 window: overlap slots masked, never loaded
            assert slot_token(s) == req.history[p - cfg.wn + 1 + s], (str(cfg), req.rid, p, s)
        req.windows_checked.append(p)

    def _page_row(self, page: int, r: int) -> int | None:
        return self.state.get(page * self.cfg.R + r)

    def prefill(self, batch: list[tuple[Request, int]]) -> None:
        cfg = self.cfg
        rids = [req.rid for req, _ in batch]
        seq_lens = [req.done + ext for req, ext in batch]
        extend_lens = [ext for _, ext in batch]
        ragged = [t for req, ext in batch for t in req.history[req.done:req.done + ext]]
        bases = [sum(extend_lens[:b]) for b in range(len(batch))]
        plan_c, plan_w = run_prefill(cfg, self.pool, rids, seq_lens, extend_lens)

        # Compress first: it reads the ring as it was before this step's writes (contract §4.4).
        for seq_len, rg, buffer_len, rp0, rp1 in c_rows(plan_c):
            if seq_len == INVALID_U32:
                continue
            req = batch[bisect.bisect_right(bases, rg) - 1][0]
            p = seq_len - 1

            def slot_token(s, rg=rg, buffer_len=buffer_len, rp0=rp0, rp1=rp1):
                if s >= buffer_len:
                    return ragged[rg - cfg.wn + 1 + s]
                if cfg.R == 4:  # overlap half from read_page_0, current half from read_page_1
                    return self._page_row(rp0, s) if s < 4 else self._page_row(rp1, s - 4)
                return self._page_row(rp1, s)

            self._check_window(req, p, slot_token)

        writes = [(rg, loc) for rg, loc in w_rows(plan_w) if rg != INVALID_U32]
        assert len({loc for _, loc in writes}) == len(writes)
        for rg, loc in writes:
            self.state[loc] = ragged[rg]
        for req, ext in batch:
            req.done += ext

    def decode(self, batch: list[Request]) -> None:
        cfg = self.cfg
        seq_lens = [req.done + 1 for req in batch]
        d = decode_decode_plan(run_decode(cfg, self.pool, [req.rid for req in batch], seq_lens))
        for b, req in enumerate(batch):
            seq_len, loc, rp0, rp1 = (int(x[b]) for x in d)
            p = seq_len - 1
            self.state[loc] = req.history[p]  # decode writes before it reads (contract §4.5)
            if cfg.R == 4:
                fires = seq_len % 4 == 0
                slot_token = lambda s: self._page_row(rp0, s) if s < 4 else self._page_row(rp1, s - 4)  # noqa: E731
            else:
                fires = loc % 128 == 127  # contract §4.5 trigger, equivalent to seq_len % 128 == 0
                assert fires == (seq_len % 128 == 0)
                slot_token = lambda s: self._page_row(rp1, s)  # noqa: E731
            if fires:
                self._check_window(req, p, slot_token)
            req.done += 1


def simulate(cfg: Cfg, seed: int, num_requests: int = 4) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    max_ctx = 1024
    pool = make_pool(gen, 12, max_ctx)
    sim = RingSim(cfg, pool)
    next_token = iter(range(10**9))
    reqs = []
    for rid in rng.sample(range(12), num_requests):
        prefill_to = rng.randint(1, 320 if cfg.R == 4 else 700)
        total = prefill_to + (rng.randint(5, 24) if cfg.R == 4 else rng.randint(60, 200))
        reqs.append(Request(rid, [next(next_token) for _ in range(total)], 0, prefill_to))
    max_chunk = 64 if cfg.R == 4 else 300

    while True:
        prefilling = [r for r in reqs if r.done < r.prefill_to]
        decoding = [r for r in reqs if r.prefill_to <= r.done < len(r.history)]
        if not prefilling and not decoding:
            break
        if prefilling and (not decoding or rng.random() < 0.5):
            chosen = rng.sample(prefilling, rng.randint(1, len(prefilling)))
            chunks = [min(r.prefill_to - r.done, rng.choice([1, rng.randint(1, 9), rng.randint(1, max_chunk)]))
                      for r in chosen]
            sim.prefill(list(zip(chosen, chunks)))
        else:
            sim.decode(rng.sample(decoding, rng.randint(1, len(decoding))))

    for r in reqs:  # every event of every request was checked exactly once
        assert r.windows_checked == [p for p in range(len(r.history)) if (p + 1) % cfg.R == 0]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_simulation_windows_exact(cfg: Cfg):
    for seed in range(3 if cfg.R == 4 else 2):
        simulate(cfg, 100 * seed + CONFIGS.index(cfg))


@pytest.mark.parametrize("ring", [8, 16])
def test_simulation_prefix_cache_resume_at_swa_page_boundary(ring: int):
    """A request resuming at an SWA-page boundary of a shared prefix reads the overlap half of its
    first window from the other request's page ring, which only the page-tail rule kept."""
    cfg = Cfg("paged", 4, ring)
    pool = make_pool(torch.Generator().manual_seed(11), 4, 1024)
    owner, sharer = 1, 2
    pool.req_to_token[sharer, :256] = pool.req_to_token[owner, :256]  # same full slots -> same SWA page
    history = list(range(400))
    sim = RingSim(cfg, pool)
    a = Request(owner, history, 0, 400)
    sim.prefill([(a, 400)])  # one chunk: positions 252..255 are kept only by the page-tail rule
    b = Request(sharer, history[:256] + list(range(1000, 1100)), 256, 300)
    sim.prefill([(b, 44)])
    while b.done < len(b.history):
        sim.decode([b])
    assert b.windows_checked[0] == 259
    assert b.windows_checked == [p for p in range(259, len(b.history)) if (p + 1) % 4 == 0]
    # Without the rule nothing would have kept them: the request-ring plan of the same step skips them.
    _, plan_w = run_prefill(Cfg("req_ring", 4, ring), pool, [owner], [400], [400])
    assert not {rg for rg, _ in w_rows(plan_w)} & {252, 253, 254, 255}


# ---------------------------------------------------------------------------------------------
# Speculative verify steps with rollback (contract §3.3 mtp_pad, contract §3.11)
# ---------------------------------------------------------------------------------------------

class Tokens:
    def __init__(self, start: int = 0):
        self.next_id = start

    def fresh(self, n: int) -> list[int]:
        self.next_id += n
        return list(range(self.next_id - n, self.next_id))


def verify_then_rollback(sim: RingSim, batch: list[tuple[Request, int, int]], tokens: Tokens) -> None:
    """One verify step: each request runs `extend` draft tokens and keeps the first `accept`;
    the rejected positions get new content, as if regenerated by the next steps."""
    for req, extend, _ in batch:
        req.history[req.done:req.done + extend] = tokens.fresh(extend)
    start = {id(req): req.done for req, _, _ in batch}
    sim.prefill([(req, extend) for req, extend, _ in batch])
    for req, extend, accept in batch:
        keep = start[id(req)] + accept
        req.history[keep:] = tokens.fresh(len(req.history) - keep)
        req.done = keep
        # Events on rejected tokens are discarded by the caller; they fire again later.
        req.windows_checked = [p for p in req.windows_checked if p < keep]


@pytest.mark.parametrize("cfg", [Cfg("paged", 4, 16), Cfg("req_ring", 4, 16), Cfg("paged", 128, 256)], ids=str)
def test_simulation_speculative_rollback(cfg: Cfg):
    # A verify step of up to mtp_pad tokens, at least one accepted (the target model's own token).
    rng = random.Random(77 + cfg.R + cfg.ring)
    pool = make_pool(torch.Generator().manual_seed(77), 8, 2048)
    sim, tokens = RingSim(cfg, pool), Tokens()
    target = 200 if cfg.R == 4 else 1500
    reqs = [Request(rid, tokens.fresh(target), 0, 0) for rid in rng.sample(range(8), 3)]
    for req in reqs:  # prefix of random length, in up to two chunks
        first = rng.randint(1, target // 4)
        sim.prefill([(req, first)])
        sim.prefill([(req, rng.randint(1, target // 4))])
    while True:
        live = [r for r in reqs if r.done + cfg.mtp_pad < target]
        if not live:
            break
        if rng.random() < 0.2:
            sim.decode(live)
            continue
        batch = []
        for req in live:
            extend = rng.choice([cfg.mtp_pad, rng.randint(1, cfg.mtp_pad)])
            batch.append((req, extend, rng.choice([1, rng.randint(1, extend)])))
        verify_then_rollback(sim, batch, tokens)
    for r in reqs:
        assert r.windows_checked == [p for p in range(r.done) if (p + 1) % cfg.R == 0]


@pytest.mark.parametrize("extend, breaks", [(10, False), (11, True)])
def test_simulation_rollback_limit_is_mtp_pad(extend: int, breaks: bool):
    # c4 ring 16 (mtp_pad 10), prefix 30, accept 1: the next event at p = 31 needs 24..30.
    # With 11 draft tokens the rejected writes 31..40 overwrite the rows of 15..24, and
    # position 30 falls before first_w = min(36, 41 - 10) = 31, so the window breaks.
    cfg = Cfg("paged", 4, 16)
    pool = make_pool(torch.Generator().manual_seed(12), 4, 512)
    sim, tokens = RingSim(cfg, pool), Tokens()
    req = Request(1, tokens.fresh(64), 0, 0)
    sim.prefill([(req, 30)])
    verify_then_rollback(sim, [(req, extend, 1)], tokens)
    if breaks:
        with pytest.raises(AssertionError):
            sim.decode([req])
    else:
        sim.decode([req])
        assert req.windows_checked[-1] == 31
