"""``Sim``: requests with true token histories driven step by step through dsv4jit.compat's
flash_c4_decode / flash_c4_prefill (ring or paged mode) and checked against the fp64 history oracle
and, on request, the torch references; ``run_schedule`` drives one through random prefill chunks and
decode runs. tests/reference/test_reference_compat.py runs it on the CPU, tests/ops/test_compat.py on
the GPU."""

from __future__ import annotations

import math
import random

import torch

from dsv4jit.compat import flash_c4_decode, flash_c4_prefill
from dsv4jit.plan_layout import encode_compress_plan, encode_decode_plan, encode_write_plan
from dsv4jit.reference import compat as ref_compat
from dsv4jit.reference import compress as main_ref
from dsv4jit.reference.compat import encode_legacy_plan

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


def i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def legacy_plan(*rows) -> torch.Tensor:
    return encode_legacy_plan(*zip(*rows)) if rows else torch.zeros(0, 16, dtype=torch.uint8)


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
