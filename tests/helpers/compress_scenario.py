"""compress_forward scenarios: a state pool in one addressing mode, the true token history of every
request, plans from the real planner, and the checks of every step against the fp64 history oracle
(tests/ops/test_compress.py says what they check; test_fused.py and test_fused_online.py drive the
same scenarios through compress_and_store).

Configurations are ``(ratio, addressing mode, ring_size)``; ``DEVICES`` is "cpu" (the torch reference
backend) and "cuda" (the kernels; skipped without a GPU).
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4jit import CompressorDecodePlan, CompressorPrefillPlan, compress_forward

from .pool_utils import SWA_PAGE, random_pool

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]

#: hd per device and ratio: small on the CPU (c4 needs hd % 128 == 0, c128 hd % 64 == 0), real on the GPU.
HEAD_DIM = {"cpu": {4: 128, 128: 64}, "cuda": {4: 512, 128: 512}}
WINDOW = {4: 8, 128: 128}
ROW_WIDTH = {4: 4, 128: 2}  # values per token row, in units of hd
NAN = float("nan")

# (ratio, addressing mode, ring_size). "paged": c4 per-SWA-page rings; "req_ring": c4 request rings;
# "ring": c128 (always request rings); "legacy": generate_legacy plans (non-paged).
C4_PAGED_8, C4_PAGED_16 = (4, "paged", 8), (4, "paged", 16)
C4_REQ_8, C4_REQ_16 = (4, "req_ring", 8), (4, "req_ring", 16)
C4_LEGACY = (4, "legacy", 8)
C128_128, C128_256 = (128, "ring", 128), (128, "ring", 256)
C128_LEGACY = (128, "legacy", 128)
ALL_CONFIGS = [C4_PAGED_8, C4_PAGED_16, C4_REQ_8, C4_REQ_16, C4_LEGACY, C128_128, C128_256, C128_LEGACY]


def config_id(config) -> str:
    ratio, mode, ring = config
    return f"c{ratio}-{mode}{'' if mode == 'legacy' else ring}"


def dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def tolerance(out_dtype: torch.dtype, device) -> float:
    if out_dtype == torch.float32:
        return 1e-5 if torch.device(device).type == "cpu" else 1e-4
    return 5e-3


_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-exact equality of two ``[rows, cols]`` float tensors (NaN poison included)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    a, e = actual.contiguous().view(_BITS[actual.dtype]), expected.contiguous().view(_BITS[expected.dtype])
    if torch.equal(a, e):
        return
    diff = a != e
    bad_rows = diff.any(dim=-1).nonzero().flatten().cpu()
    r = int(bad_rows[0])
    cols = diff[r].nonzero().flatten()[:4].tolist()
    raise AssertionError(
        f"{what}: {bad_rows.numel()} rows differ (first rows {bad_rows[:8].tolist()}); row {r} cols {cols}: "
        f"got {actual[r, cols].tolist()}, expected {expected[r, cols].tolist()}")


def pool_fp64(rows: torch.Tensor, present: torch.Tensor, ape: torch.Tensor, ratio: int, hd: int) -> torch.Tensor:
    """fp64 softmax pooling (contract §4.1) of windows ``rows [N, Wn, last_dim]``; absent slots weigh 0."""
    rows = rows.to(torch.float64).masked_fill(~present[..., None], 0.0)
    if ratio == 4:  # slots 0-3: overlap role (kv_o, score_o); slots 4-7: current role (kv, score), contract §4.2
        kv = torch.cat([rows[:, :4, 0:hd], rows[:, 4:, hd:2 * hd]], dim=1)
        score = torch.cat([rows[:, :4, 2 * hd:3 * hd], rows[:, 4:, 3 * hd:4 * hd]], dim=1)
    else:  # contract §4.3
        kv, score = rows[..., 0:hd], rows[..., hd:2 * hd]
    z = (score + ape.to(torch.float64)).masked_fill(~present[..., None], float("-inf"))
    e = torch.exp(z - z.amax(dim=1, keepdim=True))
    return (kv * e).sum(dim=1) / e.sum(dim=1)


class Scenario:
    """One state pool + per-request token histories; runs steps through the public API and checks them."""

    def __init__(self, device, ratio, mode="ring", ring=None, *, num_reqs=4, max_ctx=1024, hd=None,
                 state_dtype=torch.float32, in_dtype=torch.float32, ape_dtype=torch.float32, seed=0):
        self.device = torch.empty(0, device=device).device  # normalized: cuda -> cuda:<current>
        self.R, self.mode = ratio, mode
        self.ring = ring if ring is not None else (8 if ratio == 4 else 128)
        self.hd = hd if hd is not None else HEAD_DIM[self.device.type][ratio]
        self.wn = WINDOW[ratio]
        self.last_dim = ROW_WIDTH[ratio] * self.hd
        self.state_dtype, self.in_dtype = state_dtype, in_dtype
        self.num_reqs, self.max_ctx = num_reqs, max_ctx
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        r2t, f2s = random_pool(num_reqs, max_ctx, self.gen)
        self.r2t, self.f2s = r2t.to(self.device), f2s.to(self.device)
        if mode == "paged":
            rows = (f2s.numel() - 1) // SWA_PAGE * self.ring   # every SWA page owns a ring
        elif mode == "legacy":
            rows = num_reqs * self.wn                         # c4: pages 2·rid, 2·rid+1; c128: page rid
        else:
            rows = num_reqs * self.ring                       # request rings
        # All-NaN pool: nothing may read a row that no step wrote.
        self.state = torch.full((rows // ratio, ratio, self.last_dim), NAN, dtype=state_dtype, device=self.device)
        ape = torch.randn(self.wn, self.hd, generator=self.gen, dtype=torch.float64) * 0.5
        self.ape = ape.to(ape_dtype).to(self.device)
        # True token histories (input-dtype values), NaN where not yet produced.
        self.hist = torch.full((num_reqs, max_ctx, self.last_dim), NAN, dtype=in_dtype, device=self.device)
        # What the state must hold after every step: updated from the plans' write rows, compared bit for
        # bit with the real state (one pass over the pool per step, no per-step pool-sized allocation).
        self.shadow = self.state.clone().view(-1, self.last_dim)
        self.lens = [0] * num_reqs
        self.events = [0] * num_reqs   # compress events checked per request
        self.steps = 0

    # ---- inputs and plans -------------------------------------------------------------------
    @property
    def flat_state(self) -> torch.Tensor:
        return self.state.view(-1, self.last_dim)

    def assert_state_unchanged(self, what: str) -> None:
        assert_same_bits(self.flat_state, self.shadow, what)

    def random_rows(self, n: int) -> torch.Tensor:
        """Token rows: kv ~ N(0, 1), scores ~ N(0, 4) (score columns are the second half in both layouts)."""
        x = torch.randn(n, self.last_dim, generator=self.gen, dtype=torch.float64)
        x[:, self.last_dim // 2:] *= 2.0
        return x.to(self.in_dtype).to(self.device)

    def prefill_plan(self, rids, exts, *, num_q=None, gpu_lengths=False, use_cuda_graph=False):
        seq = torch.tensor([self.lens[r] + e for r, e in zip(rids, exts)], dtype=torch.int64)
        ext = torch.tensor(list(exts), dtype=torch.int64)
        num_q = sum(exts) if num_q is None else num_q
        rpi = torch.tensor(list(rids), dtype=torch.int64, device=self.device)
        if self.mode == "legacy":
            assert not gpu_lengths, "legacy prefill plans take CPU lengths"
            return CompressorPrefillPlan.generate_legacy(self.R, rpi, seq, ext, num_q, self.device,
                                                         use_cuda_graph=use_cuda_graph)
        lens_device = self.device if gpu_lengths else torch.device("cpu")
        return CompressorPrefillPlan.generate(self.R, rpi, seq.to(lens_device), ext.to(lens_device), self.r2t,
                                              self.f2s, SWA_PAGE, self.ring, num_q, use_cuda_graph=use_cuda_graph,
                                              use_req_ring=self.mode == "req_ring")

    def decode_plan(self, rids, seq_lens=None, rpi=None):
        if rpi is None:
            rpi = torch.tensor(list(rids), dtype=torch.int64, device=self.device)
        if seq_lens is None:
            seq_lens = torch.tensor([self.lens[r] + 1 for r in rids], dtype=torch.int64, device=self.device)
        if self.mode == "legacy":
            return CompressorDecodePlan.generate_legacy(self.R, rpi, seq_lens)
        return CompressorDecodePlan.generate(self.R, rpi, self.r2t, self.f2s, seq_lens, SWA_PAGE, self.ring,
                                             use_req_ring=self.mode == "req_ring")

    def poisoned(self, rows: int, dtype=None) -> torch.Tensor:
        return torch.full((rows, self.hd), NAN, dtype=dtype or self.in_dtype, device=self.device)

    def call(self, x, plan, out=None):
        return compress_forward(self.state, x, self.ape, plan, head_dim=self.hd, compress_ratio=self.R, out=out)

    # ---- steps ------------------------------------------------------------------------------
    def prefill(self, rids, exts, *, out="poison", out_dtype=None, num_q=None, gpu_lengths=False,
                use_cuda_graph=False):
        """One prefill/extend step of requests ``rids`` (batch order) by ``exts`` tokens; returns the plan."""
        n = sum(exts)
        num_q = n if num_q is None else num_q
        for r, e in zip(rids, exts):
            assert e >= 1 and self.lens[r] + e <= self.max_ctx
        x = self.random_rows(num_q)
        if num_q > n:
            x[n:] = NAN  # bucket padding rows: never referenced by a plan
        plan = self.prefill_plan(rids, exts, num_q=num_q, gpu_lengths=gpu_lengths, use_cuda_graph=use_cuda_graph)
        out_t = self.poisoned(plan[1].shape[0], out_dtype) if out == "poison" else None
        res = self.call(x, plan, out_t)
        self.check_prefill(rids, exts, x, plan, res, out_t)
        return plan

    def decode(self, rids, *, out="poison", out_dtype=None):
        """One decode step (one token for each of ``rids``)."""
        for r in rids:
            assert 1 <= self.lens[r] + 1 <= self.max_ctx
        x = self.random_rows(len(rids))
        plan = self.decode_plan(rids)
        out_t = self.poisoned(len(rids), out_dtype) if out == "poison" else None
        res = self.call(x, plan, out_t)
        self.check_decode(rids, x, plan, res, out_t)
        return plan

    # ---- checks -----------------------------------------------------------------------------
    def _check_output_tensor(self, res, rows, x, out_t):
        assert isinstance(res, torch.Tensor)
        assert res.shape == (rows, self.hd), f"output shape {tuple(res.shape)} != {(rows, self.hd)}"
        assert res.device.type == self.device.type
        if out_t is None:
            assert res.dtype == x.dtype, "the output defaults to the input dtype"
        else:
            assert res.dtype == out_t.dtype
            assert res.data_ptr() == out_t.data_ptr(), "out= must be written in place and returned"

    def _check_state(self, write_loc, write_src):
        """Exactly the rows ``write_loc`` changed since the last step, to ``write_src`` in the state dtype."""
        self.shadow[write_loc.to(self.device)] = write_src.to(self.state_dtype)
        assert_same_bits(self.flat_state, self.shadow, f"state after step {self.steps}")

    def oracle(self, rids, positions, fresh_from) -> torch.Tensor:
        """fp64 rows of the events closing at ``positions`` of requests ``rids``.

        Positions >= ``fresh_from`` (those of the current prefill step) pool the input values; earlier
        ones the values read back from the state (input -> state dtype -> input dtype).
        """
        out = []
        ape = self.ape.to(self.in_dtype)
        for lo in range(0, len(rids), 512):
            rid = torch.tensor(rids[lo:lo + 512], dtype=torch.int64, device=self.device)
            p = torch.tensor(positions[lo:lo + 512], dtype=torch.int64, device=self.device)
            fresh = torch.tensor(fresh_from[lo:lo + 512], dtype=torch.int64, device=self.device)
            pos = p[:, None] - self.wn + 1 + torch.arange(self.wn, device=self.device)
            present = pos >= 0
            rows = self.hist[rid[:, None], pos.clamp(min=0)]
            stored = rows.to(self.state_dtype).to(self.in_dtype)
            rows = torch.where((pos >= fresh[:, None])[..., None], rows, stored)
            out.append(pool_fp64(rows, present, ape, self.R, self.hd))
        return torch.cat(out) if out else torch.zeros(0, self.hd, dtype=torch.float64, device=self.device)

    def _assert_matches(self, actual, expected, what):
        tol = tolerance(actual.dtype, self.device)
        torch.testing.assert_close(actual.to(torch.float64), expected, atol=tol, rtol=tol, equal_nan=False,
                                   msg=lambda m: f"{what}: {m}")

    def check_prefill(self, rids, exts, x, plan, res, out_t):
        """Validate one prefill step and commit its tokens to the histories."""
        self.steps += 1
        c, w = plan.rows()
        self._check_output_tensor(res, c.seq_len.numel(), x, out_t)
        assert c.seq_len.numel() == plan[1].shape[0] and w.ragged_id.numel() == plan[2].shape[0]

        # State: exactly the plan's write rows change, to the input rows cast to the state dtype.
        wv = w.valid
        self._check_state(w.write_loc[wv], x[w.ragged_id[wv].to(self.device)])

        # Commit the step's tokens (input-dtype values) to the histories.
        prefix = [self.lens[r] for r in rids]
        base = [0]
        for r, e in zip(rids, exts):
            self.hist[r, self.lens[r]:self.lens[r] + e] = x[base[-1]:base[-1] + e]
            self.lens[r] += e
            base.append(base[-1] + e)

        # Which (batch, position) each valid compress row claims; it must be exactly the step's events.
        valid = c.valid
        idx = valid.nonzero().flatten()
        starts = torch.tensor(base[:-1], dtype=torch.int64)
        rg = c.ragged_id[idx]
        b = torch.searchsorted(torch.tensor(base[1:], dtype=torch.int64), rg, right=True)
        assert bool((b < len(rids)).all()), "a compress row's ragged_id lies past the step's tokens"
        pos = torch.tensor(prefix, dtype=torch.int64)[b] + rg - starts[b]
        assert torch.equal(pos + 1, c.seq_len[idx]), "compress row: seq_len is not its closing token's position + 1"
        got = sorted(zip(b.tolist(), pos.tolist()))
        want = sorted((i, p) for i, (pre, e) in enumerate(zip(prefix, exts))
                      for p in range(pre, pre + e) if (p + 1) % self.R == 0)
        assert got == want, f"compress rows {got[:10]}... != the step's events {want[:10]}..."

        ev_rids = [rids[i] for i in b.tolist()]
        expected = self.oracle(ev_rids, pos.tolist(), [prefix[i] for i in b.tolist()])
        self._assert_matches(res[idx.to(self.device)], expected, f"prefill step {self.steps} compressed rows")
        for r in ev_rids:
            self.events[r] += 1
        if out_t is not None:  # invalid (padding) plan rows are left untouched
            untouched = res[(~valid).nonzero().flatten().to(self.device)]
            assert bool(torch.isnan(untouched).all()), "an invalid plan_c row's output was written"

    def check_decode(self, rids, x, plan, res, out_t):
        """Validate one decode step and commit its tokens."""
        self.steps += 1
        d = plan.rows()
        self._check_output_tensor(res, len(rids), x, out_t)
        assert d.seq_len.tolist() == [self.lens[r] + 1 for r in rids], "decode plan seq_lens"
        self._check_state(d.write_loc, x)
        for i, r in enumerate(rids):
            self.hist[r, self.lens[r]] = x[i]
            self.lens[r] += 1
        boundary = [i for i, r in enumerate(rids) if self.lens[r] % self.R == 0]
        other = [i for i in range(len(rids)) if i not in boundary]
        if other:
            rest = res[torch.tensor(other, device=self.device)]
            assert bool((rest == 0).all()), "decode rows without a compress event must be zero-filled"
        if boundary:
            ev_rids = [rids[i] for i in boundary]
            expected = self.oracle(ev_rids, [self.lens[r] - 1 for r in ev_rids], [self.max_ctx] * len(boundary))
            self._assert_matches(res[torch.tensor(boundary, device=self.device)], expected,
                                 f"decode step {self.steps} compressed rows")
            for r in ev_rids:
                self.events[r] += 1
