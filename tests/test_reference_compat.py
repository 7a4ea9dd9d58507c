"""dsv4jit.compat on CPU tensors: the torch reference of the older c4 entry points (contract §7).

* Hand-computed cases: equal scores make an event the plain mean of its 8 (or, in the first window,
  4) kv values, so each test names by hand which ring row / page row / ragged row every slot reads.
* ``Sim``: a pool of requests driven step by step (prefill chunks, decodes) in ring or paged mode,
  with the plans and page bundles built by the test from each request's block -> page table. Every
  event is checked against the fp64 history oracle of contract §3.11 (main reference's
  ``event_window_reference``); the state is checked bit for bit against the rows the test knows
  were written (the pool starts all-NaN); outputs are NaN-poisoned. With ``cross_check`` every step
  also runs the main reference (dsv4jit.reference.compress) on equivalent CompressPlan / WritePlan /
  DecodePlan rows and an equivalent state, and both must agree.
* Argument checks of the CPU path (shapes, dtypes, alignment of extra and plans) and the reference's
  data checks raise ValueError / TypeError naming the argument, and leave the state untouched.

``test_compat.py`` reuses ``Sim`` to check the kernels against this reference on a GPU.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsv4jit.compat import flash_c4_decode, flash_c4_prefill
from dsv4jit.plan_layout import (
    encode_compress_plan,
    encode_decode_plan,
    encode_write_plan,
)
from dsv4jit.reference import compat as ref_compat
from dsv4jit.reference import compress as main_ref
from dsv4jit.reference.compat import decode_legacy_plan, encode_legacy_plan

NAN = float("nan")
INVALID = 0xFFFFFFFF
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a = actual.detach().cpu().contiguous()
    e = expected.detach().cpu().contiguous()
    assert a.shape == e.shape and a.dtype == e.dtype, what
    diff = a.view(_BITS[a.dtype]) != e.view(_BITS[e.dtype])
    if bool(diff.any()):
        rows = diff.reshape(diff.shape[0], -1).any(dim=1).nonzero().flatten()
        raise AssertionError(f"{what}: {rows.numel()} rows differ, first {rows[:8].tolist()}")


def tolerance(out_dtype: torch.dtype, device: torch.device) -> float:
    if out_dtype != torch.float32:
        return 5e-3  # the precision contract (contract §9.6)
    return 1e-5 if device.type == "cpu" else 2e-5


class Sim:
    """Requests with true token histories, driven through flash_c4_* in one page mode.

    Ring mode: request r owns ring ``slot[r]`` of ``[num_reqs + 2, 8, 4·hd]``. Paged mode: block k of
    request r (positions 4k…4k+3) lives on page ``table[r, k]`` of ``[pages, 4, 4·hd]``; pages a step
    must not use are passed as -1.
    """

    def __init__(self, device, paged: bool, *, hd=128, state_dtype=torch.float32, in_dtype=torch.float32,
                 out_dtype=None, num_reqs=4, max_ctx=64, seed=0, cross_check=False, reference_check=False):
        self.device = torch.empty(0, device=device).device
        self.paged, self.hd, self.last = paged, hd, 4 * hd
        self.state_dtype, self.in_dtype = state_dtype, in_dtype
        self.out_dtype = out_dtype or in_dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.max_ctx, self.max_blocks = max_ctx, (max_ctx + 3) // 4
        if paged:
            pages = num_reqs * self.max_blocks + 3
            self.table = torch.randperm(pages, generator=self.gen)[:num_reqs * self.max_blocks]
            self.table = self.table.view(num_reqs, self.max_blocks)
            shape = (pages, 4, self.last)
        else:
            self.slot = torch.randperm(num_reqs + 2, generator=self.gen)[:num_reqs]
            shape = (num_reqs + 2, 8, self.last)
        self.state = torch.full(shape, NAN, dtype=state_dtype, device=self.device)
        self.shadow = self.state.cpu().view(-1, self.last).clone()
        self.ape = (torch.randn(8, hd, generator=self.gen, dtype=torch.float64) * 0.5).to(in_dtype)
        self.hist = torch.full((num_reqs, max_ctx, self.last), NAN, dtype=in_dtype)
        self.lens = [0] * num_reqs
        self.events = 0
        self.main_state = self.state.cpu().clone() if cross_check else None
        self.ref_state = self.state.cpu().clone() if reference_check else None

    # ---- addressing known to the test -------------------------------------------------------
    def page(self, r: int, block: int) -> int:
        return int(self.table[r, block]) if 0 <= block < self.max_blocks else -1

    def row(self, r: int, p: int) -> int:
        """State row (flat) holding position p of request r."""
        return self.page(r, p // 4) * 4 + p % 4 if self.paged else int(self.slot[r]) * 8 + p % 8

    def random_rows(self, n: int) -> torch.Tensor:
        x = torch.randn(n, self.last, generator=self.gen, dtype=torch.float64)
        x[:, 2 * self.hd:] *= 2.0  # scores ~ N(0, 4)
        return x.to(self.in_dtype)

    def oracle(self, r: int, p: int, fresh_from: int) -> torch.Tensor:
        """fp64 event row: positions >= fresh_from come from this step's input, the others from the
        state (input -> state dtype -> input dtype)."""
        h = self.hist[r, :p + 1]
        stored = h.to(self.state_dtype).to(self.in_dtype)
        fresh = (torch.arange(p + 1) >= fresh_from)[:, None]
        seen = torch.where(fresh, h, stored)
        return main_ref.event_window_reference(seen, p, self.ape, head_dim=self.hd, compress_ratio=4)

    def _tensor(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device)

    def _check_out(self, out, expected: dict, untouched: float, what: str) -> None:
        """Rows in ``expected`` match the oracle; every other row holds ``untouched`` (NaN or 0)."""
        got = out.detach().cpu().to(torch.float64)
        tol = tolerance(out.dtype, self.device)
        for i, exp in expected.items():
            torch.testing.assert_close(got[i], exp, atol=tol, rtol=tol, msg=lambda m, i=i: f"{what} row {i}: {m}")
        rest = torch.ones(got.shape[0], dtype=torch.bool)
        rest[list(expected)] = False
        if math.isnan(untouched):
            assert bool(got[rest].isnan().all()), f"{what}: rows no event names were written"
        else:
            assert bool((got[rest] == untouched).all()), f"{what}: rows without an event are not {untouched}"

    def _match_reference(self, out, rows: int, run) -> None:
        """The op's output and state against the reference run in fp64 on CPU copies (NaN where the
        reference leaves the poison, the same state bits)."""
        out64 = torch.full((rows, self.hd), NAN, dtype=torch.float64)
        run(out64)
        tol = tolerance(out.dtype, self.device)
        torch.testing.assert_close(out.cpu().to(torch.float64), out64, atol=tol, rtol=tol, equal_nan=True)
        assert_same_bits(self.state.view(-1, self.last), self.ref_state.view(-1, self.last), "state vs reference")

    def _commit(self, writes: list[tuple[int, torch.Tensor]]) -> None:
        for row, value in writes:
            self.shadow[row] = value.to(self.state_dtype)
        assert_same_bits(self.state.view(-1, self.last), self.shadow, "state")

    # ---- steps ------------------------------------------------------------------------------
    def prefill(self, rids, exts, *, pad_rows=0, invalid_rows=0):
        prefix = [self.lens[r] for r in rids]
        rows_c, rows_w, base = [], [], 0
        for b, (r, e, p0) in enumerate(zip(rids, exts, prefix)):
            last_c = (p0 + e) // 4 * 4
            for j in range(e):
                p = p0 + j
                if (p + 1) % 4 == 0:
                    rows_c.append((base + j, b, p, 8 - min(j + 1, 8)))
                if p >= last_c - 4:  # the open block and the one before it (next window's overlap)
                    rows_w.append((base + j, b, p, 0))
            base += e
        n = base + pad_rows
        rows_c += [(INVALID, 0, 0, 0)] * min(invalid_rows, n - len(rows_c))  # plans have <= n rows
        rows_w += [(INVALID, 0, 0, 0)] * min(invalid_rows, n - len(rows_w))
        self.rng.shuffle(rows_c)  # row order carries no meaning
        self.rng.shuffle(rows_w)
        x = self.random_rows(n)
        x[base:] = NAN  # padding rows: never referenced
        if self.paged:
            indices = [self.page(r, (p0 + e) // 4) for r, e, p0 in zip(rids, exts, prefix)]
            extra = self._tensor([[self.page(r, (p0 - 1) // 4 - 1), self.page(r, (p0 - 1) // 4),
                                   self.page(r, (p0 + e) // 4 - 1), (p0 + e) // 4 * 4]
                                  for r, e, p0 in zip(rids, exts, prefix)]).view(-1, 4)
        else:
            indices, extra = [int(self.slot[r]) for r in rids], None
        plan_c = encode_legacy_plan(*zip(*rows_c)) if rows_c else torch.zeros(0, 16, dtype=torch.uint8)
        plan_w = encode_legacy_plan(*zip(*rows_w)) if rows_w else torch.zeros(0, 16, dtype=torch.uint8)
        out = torch.full((n, self.hd), NAN, dtype=self.out_dtype, device=self.device)
        res = flash_c4_prefill(self.state, x.to(self.device), out, self.ape.to(self.device),
                               self._tensor(indices), plan_c.to(self.device), plan_w.to(self.device), extra)
        assert res is out
        if self.ref_state is not None:
            self._match_reference(out, n, lambda out64: ref_compat.c4_prefill(
                self.ref_state, x, out64, self.ape, i32(*indices), plan_c, plan_w,
                None if extra is None else extra.cpu(), compute_dtype=torch.float64))
        starts = [sum(exts[:b]) for b in range(len(rids))]
        self._commit([(self.row(rids[b], p), x[rg]) for rg, b, p, _ in rows_w if rg != INVALID])
        expected = {}
        for b, (r, e, p0) in enumerate(zip(rids, exts, prefix)):
            self.hist[r, p0:p0 + e] = x[starts[b]:starts[b] + e]
            self.lens[r] += e
        for rg, b, p, _ in rows_c:
            if rg != INVALID:
                expected[rg] = self.oracle(rids[b], p, prefix[b])
        self.events += len(expected)
        self._check_out(out, expected, NAN, f"prefill {list(zip(rids, exts))}")
        if self.main_state is not None:
            self._cross_check_prefill(rids, x, indices, extra, rows_c, rows_w, out)

    def decode(self, rids):
        seq = [self.lens[r] + 1 for r in rids]
        if self.paged:
            indices = [self.page(r, (L - 1) // 4) for r, L in zip(rids, seq)]
            extra = self._tensor([[self.page(r, (L - 1) // 4 - 1)] for r, L in zip(rids, seq)]).view(-1, 1)
        else:
            indices, extra = [int(self.slot[r]) for r in rids], None
        x = self.random_rows(len(rids))
        out = torch.full((len(rids), self.hd), NAN, dtype=self.out_dtype, device=self.device)
        res = flash_c4_decode(self.state, x.to(self.device), out, self.ape.to(self.device), self._tensor(indices),
                              self._tensor(seq), extra)
        assert res is out
        if self.ref_state is not None:
            self._match_reference(out, len(rids), lambda out64: ref_compat.c4_decode(
                self.ref_state, x, out64, self.ape, i32(*indices), i32(*seq), None if extra is None else extra.cpu(),
                compute_dtype=torch.float64))
        self._commit([(self.row(r, L - 1), x[b]) for b, (r, L) in enumerate(zip(rids, seq))])
        expected = {}
        for b, (r, L) in enumerate(zip(rids, seq)):
            self.hist[r, L - 1] = x[b]
            self.lens[r] = L
            if L % 4 == 0:
                expected[b] = self.oracle(r, L - 1, L)  # decode reads its own token back from the state
        self.events += len(expected)
        self._check_out(out, expected, 0.0, f"decode {list(zip(rids, seq))}")
        if self.main_state is not None:
            self._cross_check_decode(rids, seq, x, out)

    # ---- the main reference on equivalent plans ---------------------------------------------
    def _cross_check_prefill(self, rids, x, indices, extra, rows_c, rows_w, out):
        valid = [row for row in rows_c if row[0] != INVALID]
        cols = []
        for rg, b, p, wl in valid:
            L = p + 1
            if self.paged:
                first, second = int(extra[b, 0]), int(extra[b, 1])
                pages = (second if wl <= 4 else first, second)
            else:
                pages = (2 * indices[b] + (L // 4) % 2, 2 * indices[b] + (L // 4 + 1) % 2)
            cols.append((L, rg, wl, *pages))
        plan_c = encode_compress_plan(*zip(*cols)) if cols else torch.zeros(0, 16, dtype=torch.uint8)
        writes = [(rg, self.row(rids[b], p)) for rg, b, p, _ in rows_w if rg != INVALID]
        plan_w = encode_write_plan(*zip(*writes)) if writes else torch.zeros(0, 8, dtype=torch.uint8)
        main_out = torch.full((len(cols), self.hd), NAN, dtype=self.out_dtype)
        main_ref.compress_prefill(self.main_state.view(-1, 4, self.last), x, self.ape, plan_c, plan_w,
                                  head_dim=self.hd, compress_ratio=4, out=main_out)
        compat_rows = out.cpu()[[rg for rg, *_ in valid]]
        torch.testing.assert_close(compat_rows, main_out, atol=1e-6, rtol=1e-6)
        assert_same_bits(self.state.view(-1, self.last), self.main_state.view(-1, self.last), "state vs main")

    def _cross_check_decode(self, rids, seq, x, out):
        cols = [(L, self.row(r, L - 1), self.row(r, max(L - 8, 0)) // 4, self.row(r, L - 1) // 4)
                for r, L in zip(rids, seq)]
        main_out = torch.full((len(rids), self.hd), NAN, dtype=self.out_dtype)
        main_ref.compress_decode(self.main_state.view(-1, 4, self.last), x, self.ape, encode_decode_plan(*zip(*cols)),
                                 head_dim=self.hd, compress_ratio=4, out=main_out)
        torch.testing.assert_close(out.cpu(), main_out, atol=1e-6, rtol=1e-6)
        assert_same_bits(self.state.view(-1, self.last), self.main_state.view(-1, self.last), "state vs main")


def run_schedule(sim: Sim, rng: random.Random, steps: int) -> None:
    """Random prefill chunks (short and long, any alignment) and decode runs over all requests."""
    n = len(sim.lens)
    for _ in range(steps):
        if rng.random() < 0.5:
            rids = rng.sample(range(n), rng.randint(1, n))
            exts = [min(rng.choice([1, 2, 3, 4, 5, 7, 9, 13]), sim.max_ctx - sim.lens[r]) for r in rids]
            keep = [(r, e) for r, e in zip(rids, exts) if e > 0]
            if keep:
                sim.prefill([r for r, _ in keep], [e for _, e in keep], pad_rows=rng.randint(0, 2),
                            invalid_rows=rng.randint(0, 2))
        else:
            rids = [r for r in rng.sample(range(n), rng.randint(1, n)) if sim.lens[r] < sim.max_ctx]
            for _ in range(rng.randint(1, 6)):
                rids = [r for r in rids if sim.lens[r] < sim.max_ctx]
                if rids:
                    sim.decode(rids)


MODES = [pytest.param(False, id="ring"), pytest.param(True, id="paged")]


# ------------------------------------------------------------------------------------------------
# 1. hand-computed cases (hd 128, equal scores: an event is the mean of its unmasked kv values)
# ------------------------------------------------------------------------------------------------

HD = 128


def token(kv_overlap: float, kv: float, *, score_overlap=0.0, score=0.0) -> torch.Tensor:
    return torch.tensor([kv_overlap] * HD + [kv] * HD + [score_overlap] * HD + [score] * HD)


def state_of(rows_per: int, pages: int, fill: dict[int, torch.Tensor]) -> torch.Tensor:
    """All-NaN state with the given flat rows filled (a NaN read would poison the result)."""
    state = torch.full((pages, rows_per, 4 * HD), NAN)
    for row, value in fill.items():
        state.view(-1, 4 * HD)[row] = value
    return state


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of fp32 tensors (NaN included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


ZERO_APE = torch.zeros(8, HD)


def test_decode_ring_hand():
    # Ring 1, seq_len 12: the token (position 11) goes to ring row 3; slot s reads ring row
    # (12 + s) % 8 = 4 5 6 7 | 0 1 2 3: overlap kv of rows 4-7, current kv of rows 0-2 and the token.
    state = state_of(8, 3, {8 + r: token(10 + r, 20 + r) for r in range(8) if r != 3})
    out = torch.full((1, HD), NAN)
    flash_c4_decode(state, token(100, 200)[None], out, ZERO_APE, i32(1), i32(12))
    assert torch.allclose(out, torch.full((1, HD), (14 + 15 + 16 + 17 + 20 + 21 + 22 + 200) / 8))
    assert torch.equal(state[1, 3], token(100, 200))


def test_decode_first_window_never_reads_the_overlap():
    # seq_len 4: slots 0-3 masked (their ring rows 4-7 hold NaN); the mean of rows 0-2 and the token.
    state = state_of(8, 1, {r: token(NAN, 20 + r) for r in range(3)})
    out = torch.full((1, HD), NAN)
    flash_c4_decode(state, token(NAN, 200)[None], out, ZERO_APE, i32(0), i32(4))
    assert torch.allclose(out, torch.full((1, HD), (20 + 21 + 22 + 200) / 4))


def test_decode_paged_hand():
    # Two requests: b0 seq_len 8 (event: overlap page 2 rows 0-3, current page 0 rows 0-2 + token at
    # row 3), b1 seq_len 6 (no event: token at row 1 of page 1, output row zeroed).
    fill = {2 * 4 + r: token(30 + r, NAN) for r in range(4)}
    fill.update({0 * 4 + r: token(NAN, 40 + r) for r in range(3)})
    state = state_of(4, 3, fill)
    out = torch.full((2, HD), NAN)
    x = torch.stack([token(NAN, 400), token(7, 8)])
    flash_c4_decode(state, x, out, ZERO_APE, i32(0, 1), i32(8, 6), i32(2, -1).view(2, 1))
    assert torch.allclose(out[0], torch.full((HD,), (30 + 31 + 32 + 33 + 40 + 41 + 42 + 400) / 8), equal_nan=False)
    assert torch.equal(out[1], torch.zeros(HD))
    assert same(state[0, 3], x[0]) and same(state[1, 1], x[1])


def legacy_plan(*rows) -> torch.Tensor:
    return encode_legacy_plan(*zip(*rows)) if rows else torch.zeros(0, 16, dtype=torch.uint8)


def test_prefill_paged_hand():
    # One request, prefix 5, extend 8 (positions 5-12, ragged 0-7): events at p = 7 (ragged 2,
    # window_len 5) and p = 11 (ragged 6, window_len 1).
    # p = 7: slots 0-3 = positions 0-3 from load_first_page (9), slot 4 = position 4 from
    #        load_second_page (4) row 0, slots 5-7 = ragged 0-2.
    # p = 11: window_len 1 <= 4, so slot 0 (position 4) comes from load_second_page row 0 (overlap
    #        columns), slots 1-7 = ragged 0-6.
    # Writes (positions >= last_c - 4 = 8): 8-11 to write_first_page (6, position < last_position 12),
    # 12 to page indices[0] = 5.
    fill = {9 * 4 + r: token(r, NAN) for r in range(4)}
    fill[4 * 4 + 0] = token(4, 50)
    state = state_of(4, 10, fill)
    x = torch.stack([token(100 + i, 200 + i) for i in range(8)])
    plan_c = legacy_plan((2, 0, 7, 5), (6, 0, 11, 1), (INVALID, 0, 0, 0))
    plan_w = legacy_plan(*[(j, 0, 5 + j, 0) for j in range(3, 8)])
    out = torch.full((8, HD), NAN)
    flash_c4_prefill(state, x, out, ZERO_APE, i32(5), plan_c, plan_w, i32(9, 4, 6, 12).view(1, 4))
    assert torch.allclose(out[2], torch.full((HD,), (0 + 1 + 2 + 3 + 50 + 200 + 201 + 202) / 8))
    assert torch.allclose(out[6], torch.full((HD,), (4 + 100 + 101 + 102 + 203 + 204 + 205 + 206) / 8))
    assert bool(out[[0, 1, 3, 4, 5, 7]].isnan().all())
    for j, pos in zip(range(3, 7), range(8, 12)):
        assert same(state[6, pos % 4], x[j])
    assert same(state[5, 0], x[7])


def test_prefill_ring_hand():
    # Ring 0 of request b1 (indices[1] = 0), prefix 6, extend 3 (positions 6-8, ragged 2-4 after b0's
    # two tokens): event at p = 7 (ragged 3, window_len 6): slot s < 6 reads ring row (8 + s) % 8 = s,
    # slots 6-7 = ragged 2, 3. b0 (ring 2, positions 0-1) has no event.
    state = state_of(8, 3, {r: token(10 + r, 20 + r) for r in range(6)})
    x = torch.stack([token(100 + i, 200 + i) for i in range(5)])
    plan_c = legacy_plan((3, 1, 7, 6))
    plan_w = legacy_plan((0, 0, 0, 0), (1, 0, 1, 0), (2, 1, 6, 0), (3, 1, 7, 0), (4, 1, 8, 0))
    out = torch.full((5, HD), NAN)
    flash_c4_prefill(state, x, out, ZERO_APE, i32(2, 0), plan_c, plan_w)
    assert torch.allclose(out[3], torch.full((HD,), (10 + 11 + 12 + 13 + 24 + 25 + 202 + 203) / 8))
    assert bool(out[[0, 1, 2, 4]].isnan().all())
    assert same(state[2, 0], x[0]) and same(state[2, 1], x[1])
    assert same(state[0, 6], x[2]) and same(state[0, 7], x[3]) and same(state[0, 0], x[4])


@pytest.mark.parametrize("paged", MODES)
def test_prefill_first_window_reads_no_row_before_the_input(paged):
    # The first request's first window (ragged 3, position 3, window_len 0): slots 0-3 would be
    # ragged rows -4..-1. They are masked and never read; slots 4-7 = ragged 0-3.
    state = state_of(4 if paged else 8, 2, {})
    x = torch.stack([token(NAN, 200 + i) for i in range(4)])
    out = torch.full((4, HD), NAN)
    extra = i32(-1, -1, -1, 4).view(1, 4) if paged else None
    flash_c4_prefill(state, x, out, ZERO_APE, i32(1), legacy_plan((3, 0, 3, 0)), legacy_plan(), extra)
    assert torch.allclose(out[3], torch.full((HD,), (200 + 201 + 202 + 203) / 4))


def test_dominant_score_selects_its_slot():
    # Slot 6 (current role, ragged row 1) scores +60 over the others: the output is its kv.
    x = torch.stack([token(1, 2), token(3, 1234.5, score=60.0), token(5, 6)])
    out = torch.full((3, HD), NAN)
    state = state_of(8, 1, {r: token(r, r) for r in range(6)})
    flash_c4_prefill(state, x, out, ZERO_APE, i32(0), legacy_plan((2, 0, 7, 5)), legacy_plan())
    # window_len 5: slots 0-4 from ring rows (8 + s) % 8, slots 5-7 = ragged 0-2
    assert torch.allclose(out[2], torch.full((HD,), 1234.5))


# ------------------------------------------------------------------------------------------------
# 2. multi-step schedules against the history oracle and the main reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("paged", MODES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_schedule_matches_history_and_main_reference(paged, state_dtype):
    sim = Sim("cpu", paged, state_dtype=state_dtype, num_reqs=4, max_ctx=64, seed=3, cross_check=True,
              reference_check=state_dtype == torch.bfloat16)
    run_schedule(sim, random.Random(7), 24)
    assert sim.events > 20


@pytest.mark.parametrize("paged", MODES)
def test_bf16_input_and_output(paged):
    sim = Sim("cpu", paged, state_dtype=torch.bfloat16, in_dtype=torch.bfloat16, num_reqs=3, seed=5,
              cross_check=True)
    run_schedule(sim, random.Random(11), 16)
    sim2 = Sim("cpu", paged, in_dtype=torch.float16, out_dtype=torch.float32, num_reqs=2, seed=6)
    run_schedule(sim2, random.Random(12), 10)
    assert sim.events > 5 and sim2.events > 5


def test_legacy_plan_codec_round_trip():
    rows = [(0, 1, 3, 0), (INVALID, 0, 0, 0), (65536 + 5, 70000, 2**31 + 3, 7)]
    plan = legacy_plan(*rows)
    assert plan.dtype == torch.uint8 and plan.shape == (3, 16)
    back = decode_legacy_plan(plan)
    assert [tuple(int(f[i]) for f in back) for i in range(3)] == rows
    assert back.valid.tolist() == [True, False, True]


# ------------------------------------------------------------------------------------------------
# 3. argument errors (CPU path)
# ------------------------------------------------------------------------------------------------

def _decode_args(paged: bool) -> dict:
    state = torch.zeros(4, 4 if paged else 8, 4 * HD)
    return {"kv_score_buffer": state, "kv_score_input": torch.zeros(2, 4 * HD),
            "kv_compressed_output": torch.zeros(2, HD), "ape": torch.zeros(8, HD), "indices": i32(0, 1),
            "seq_lens": i32(4, 9), "extra": i32(2, 3).view(2, 1) if paged else None}


def _prefill_args(paged: bool) -> dict:
    state = torch.zeros(4, 4 if paged else 8, 4 * HD)
    return {"kv_score_buffer": state, "kv_score_input": torch.zeros(5, 4 * HD),
            "kv_compressed_output": torch.zeros(5, HD), "ape": torch.zeros(8, HD), "indices": i32(0, 1),
            "compress_plan": legacy_plan((3, 0, 3, 0)), "write_plan": legacy_plan((4, 1, 0, 0)),
            "extra": i32(0, 1, 2, 4, 0, 1, 2, 4).view(2, 4) if paged else None}


def misaligned(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """Same values, data pointer moved by `elements` elements (contiguous, not 16-byte aligned)."""
    flat = torch.zeros(t.numel() + elements, dtype=t.dtype)
    out = flat[elements:].view(t.shape)
    out.copy_(t)
    return out


DECODE_ERRORS = {
    "extra_1d": (True, {"extra": i32(2, 3)}, ValueError, "'extra'.*2 dimensions"),
    "extra_two_cols": (True, {"extra": i32(2, 3, 0, 0).view(2, 2)}, ValueError, "'extra'.*dim 1 must be 1"),
    "extra_rows": (True, {"extra": i32(2).view(1, 1)}, ValueError, "'extra'.*batch_size"),
    "extra_int64": (True, {"extra": torch.tensor([[2], [3]])}, TypeError, "'extra'.*int32"),
    "ring_buffer_with_extra": (True, {"kv_score_buffer": torch.zeros(4, 8, 4 * HD)}, ValueError,
                               "'kv_score_buffer'.*dim 1 must be 4"),
    "page_buffer_without_extra": (False, {"kv_score_buffer": torch.zeros(4, 4, 4 * HD)}, ValueError,
                                  "'kv_score_buffer'.*dim 1 must be 8"),
    "buffer_fp16": (False, {"kv_score_buffer": torch.zeros(4, 8, 4 * HD, dtype=torch.float16)}, TypeError,
                    "'kv_score_buffer'.*dtype"),
    "indices_int64": (False, {"indices": torch.tensor([0, 1])}, TypeError, "'indices'.*int32"),
    "seq_lens_int64": (False, {"seq_lens": torch.tensor([4, 9])}, TypeError, "'seq_lens'.*int32"),
    "seq_lens_rows": (False, {"seq_lens": i32(4)}, ValueError, "'seq_lens'.*batch_size"),
    "ape_dtype": (False, {"ape": torch.zeros(8, HD, dtype=torch.bfloat16)}, TypeError, "'ape'.*dtype"),
    "ape_rows": (False, {"ape": torch.zeros(4, HD)}, ValueError, "'ape'"),
    "input_rows": (False, {"kv_score_input": torch.zeros(3, 4 * HD)}, ValueError, "'kv_score_input'"),
    "input_cols": (False, {"kv_score_input": torch.zeros(2, 2 * HD)}, ValueError, "'kv_score_input'"),
    "input_not_contiguous": (False, {"kv_score_input": torch.zeros(4 * HD, 2).t()}, ValueError,
                             "'kv_score_input'.*contiguous"),
    "out_head_dim": (False, {"kv_compressed_output": torch.zeros(2, 256)}, ValueError, "'kv_compressed_output'"),
    "out_int": (False, {"kv_compressed_output": torch.zeros(2, HD, dtype=torch.int32)}, TypeError,
                "'kv_compressed_output'"),
    "indices_not_tensor": (False, {"indices": [0, 1]}, TypeError, "'indices'"),
    # data checks of the reference
    "indices_out_of_range": (False, {"indices": i32(0, 4)}, ValueError, "indices"),
    "negative_index": (True, {"indices": i32(-1, 1)}, ValueError, "indices"),
    "seq_len_zero": (False, {"seq_lens": i32(0, 9)}, ValueError, "seq_lens"),
    "overlap_page_out_of_range": (True, {"seq_lens": i32(8, 9), "extra": i32(4, 0).view(2, 1)}, ValueError, "extra"),
}


@pytest.mark.parametrize("name", list(DECODE_ERRORS))
def test_decode_argument_errors(name):
    paged, overrides, exc, match = DECODE_ERRORS[name]
    args = _decode_args(paged)
    args.update(overrides)
    before = args["kv_score_buffer"].clone()
    with pytest.raises(exc, match=match):
        flash_c4_decode(**args)
    assert torch.equal(args["kv_score_buffer"], before), "a rejected call changed the state"


PREFILL_ERRORS = {
    "extra_three_cols": (True, {"extra": i32(0, 1, 2, 0, 1, 2).view(2, 3)}, ValueError, "'extra'.*dim 1 must be 4"),
    "extra_rows": (True, {"extra": i32(0, 1, 2, 4).view(1, 4)}, ValueError, "'extra'.*batch_size"),
    "extra_misaligned": (True, {"extra": misaligned(i32(0, 1, 2, 4, 0, 1, 2, 4).view(2, 4))}, ValueError,
                         "'extra'.*16-byte aligned"),
    "extra_not_contiguous": (True, {"extra": i32(*range(16)).view(4, 4)[:, :4][::2]}, ValueError,
                             "'extra'.*contiguous"),
    "extra_uint8": (True, {"extra": torch.zeros(2, 4, dtype=torch.uint8)}, TypeError, "'extra'.*int32"),
    "plan_int32_rows": (False, {"compress_plan": legacy_plan((3, 0, 3, 0)).view(torch.int32)}, ValueError,
                        "'compress_plan'.*dim 1 must be 16"),
    "plan_dtype": (False, {"write_plan": torch.zeros(1, 16, dtype=torch.int8)}, TypeError, "'write_plan'.*uint8"),
    "plan_misaligned": (False, {"compress_plan": misaligned(legacy_plan((3, 0, 3, 0)), 8)}, ValueError,
                        "'compress_plan'.*aligned"),
    "out_rows": (False, {"kv_compressed_output": torch.zeros(4, HD)}, ValueError, "'kv_compressed_output'"),
    "fewer_tokens_than_requests": (False, {"kv_score_input": torch.zeros(1, 4 * HD),
                                               "kv_compressed_output": torch.zeros(1, HD),
                                               "compress_plan": legacy_plan(), "write_plan": legacy_plan()},
                                   ValueError, "'kv_score_input'.*batch_size"),
    "plan_longer_than_tokens": (False, {"write_plan": legacy_plan(*[(0, 0, 0, 0)] * 6)}, ValueError,
                                "'write_plan'.*num_q_tokens"),
    # data checks of the reference
    "window_len_8": (False, {"compress_plan": legacy_plan((4, 0, 7, 8))}, ValueError, "window_len"),
    "position_not_closing": (False, {"compress_plan": legacy_plan((4, 0, 6, 1))}, ValueError, "position"),
    "batch_id": (False, {"write_plan": legacy_plan((4, 2, 0, 0))}, ValueError, "batch_id"),
    "ragged_id": (False, {"compress_plan": legacy_plan((5, 0, 3, 0))}, ValueError, "ragged_id"),
    "ragged_rows_before_the_input": (False, {"compress_plan": legacy_plan((2, 0, 7, 0))}, ValueError,
                                     "argument 'kv_score_input' rows read"),
    "load_page_out_of_range": (True, {"compress_plan": legacy_plan((3, 0, 7, 6)),
                                          "extra": i32(9, 1, 2, 4, 0, 1, 2, 4).view(2, 4)}, ValueError, "rows read"),
    "write_page_out_of_range": (True, {"write_plan": legacy_plan((4, 1, 5, 0)),
                                       "extra": i32(0, 1, 2, 4, 0, 1, -1, 8).view(2, 4)}, ValueError,
                                "rows written"),
    "colliding_writes": (False, {"write_plan": legacy_plan((4, 1, 0, 0), (3, 1, 8, 0))}, ValueError,
                         "same state row"),
}


@pytest.mark.parametrize("name", list(PREFILL_ERRORS))
def test_prefill_argument_errors(name):
    paged, overrides, exc, match = PREFILL_ERRORS[name]
    args = _prefill_args(paged)
    args.update(overrides)
    before = args["kv_score_buffer"].clone()
    with pytest.raises(exc, match=match):
        flash_c4_prefill(**args)
    assert torch.equal(args["kv_score_buffer"], before), "a rejected call changed the state"


@pytest.mark.parametrize("paged", MODES)
def test_good_arguments_pass(paged):
    """The baselines of the error tables are valid calls (so each error case tests one defect)."""
    flash_c4_decode(**_decode_args(paged))
    flash_c4_prefill(**_prefill_args(paged))
