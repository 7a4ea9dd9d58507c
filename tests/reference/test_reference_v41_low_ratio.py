"""The ratio-1 / ratio-2 compressors (reference/low_ratio.py) against the behaviour of sglang 0.5.23.

The expected values follow the rules step by step, here: the RMSNorm formula, the fused pair pooling
and the pool_pairs softmax per element in plain Python floats, the rope tail, the fake quant of
tests/helpers/v41_oracles.py, then the paged writer (tested on its own in test_reference_v41_store.py);
rings, outputs and caches start poisoned or random, so a stray or missing write shows."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4jit.kv_layout import KVLayout
from dsv4jit.reference import layouts, low_ratio
from helpers.v41_oracles import f32, fake_quant_16

EPS = 1e-6
POISON = 0xAB
SENTINEL = -7.0  # what `out` rows hold before the call


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def freq_table(max_pos: int, seed: int) -> torch.Tensor:
    angles = torch.rand(max_pos, 32, generator=gen(seed), dtype=torch.float64) * 6.3
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles).to(torch.complex64)).flatten(1)


def weight(seed: int) -> torch.Tensor:
    return (0.5 + torch.rand(512, generator=gen(seed))).bfloat16()


def finish(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf((x · r) · w), r = rsqrt(Σx² / 512 + eps) (the sum of squares exact, then rounded once)."""
    x = x.float()
    sum_sq = (x.double() ** 2).sum(-1, keepdim=True).float()
    r = torch.rsqrt((sum_sq / 512 + torch.tensor(EPS)).double()).float()
    return ((x * r) * w.float()).bfloat16().float()


def pool_fused(partner: list[float], own: list[float]) -> list[float]:
    """The fused kernels' pooling, per channel in fp32."""
    out = []
    for c in range(512):
        d = f32(partner[512 + c] - own[512 + c])
        e = f32(math.exp(-abs(d)))
        w_o, w_n = (1.0, e) if d > 0 else (e, 1.0)
        out.append(f32(f32(f32(partner[c] * w_o) + f32(own[c] * w_n)) / f32(1.0 + e)))
    return out


def rope_tail(latent: torch.Tensor, pos: int, freq: torch.Tensor) -> torch.Tensor:
    z = latent.clone()
    cos, sin = freq[pos, 0::2], freq[pos, 1::2]
    re, im = latent[448::2], latent[449::2]
    z[448::2], z[449::2] = re * cos - im * sin, re * sin + im * cos
    return z.bfloat16().float()


def expected_cache(cache: torch.Tensor, stored: list[tuple[int, torch.Tensor, int]], freq: torch.Tensor,
                   page_size: int, layout: KVLayout) -> torch.Tensor:
    """The cache after storing each (loc, latent, RoPE position): rope tail, fake quant unless fp4, write."""
    cache = cache.clone()
    for loc, latent, pos in stored:
        z = rope_tail(latent, pos, freq)
        value = z if layout.is_fp4 else torch.tensor(fake_quant_16(z.tolist()))
        layouts.write_layout(cache, torch.tensor([loc]), value[None], page_size, layout)
    return cache


def poisoned(layout: KVLayout, pages: int, page_size: int) -> torch.Tensor:
    return torch.full((pages, layout.page_bytes(page_size)), POISON, dtype=torch.uint8)


def sentinel_out(n: int) -> torch.Tensor:
    return torch.full((n, 512), SENTINEL, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------- c1

@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", list(KVLayout))
def test_c1_is_the_torch_pipeline_and_the_store(layout, index_dtype):
    """Every row's latent in `out` (padded rows too); rows with out_loc > 0 stored at out_loc, RoPE at the
    row's own position; out_loc <= 0 stores nothing."""
    positions = torch.tensor([700, 5, 0, 1023, 0, 300])
    locs = torch.tensor([256 + 700 % 256, 512 + 5, 0, 256 + 1023 % 256, -1, 512 + 300 % 256])
    x = (torch.randn(6, 512, generator=gen(1)) * 2).bfloat16()
    x[4] = 0.0
    x[0, :20] = -0.0  # −0 latents: e2m1 code 0x8 in the fp4 layouts, +0 after the fake quant
    w, freq = weight(2), freq_table(1024, 3)
    cache = poisoned(layout, 3, 256)
    out = sentinel_out(6)
    got = low_ratio.c1_decode_norm_rope_store(x, w, positions.to(index_dtype), locs.to(index_dtype), EPS, freq, cache,
                                              page_size=256, layout=layout.value, out=out)
    assert got is out
    latents = finish(x, w)
    assert torch.equal(out.float(), latents)
    stored = [(int(loc), latents[i], int(positions[i])) for i, loc in enumerate(locs) if loc > 0]
    assert torch.equal(cache, expected_cache(poisoned(layout, 3, 256), stored, freq, 256, layout))


def test_c1_allocates_out_and_takes_an_fp8_typed_cache():
    x, w, freq = torch.randn(2, 512, generator=gen(4)).bfloat16(), weight(5), freq_table(8, 6)
    cache = poisoned(KVLayout.V41_FP4, 2, 256)
    out = low_ratio.c1_decode_norm_rope_store(x, w, torch.tensor([3, 4]), torch.tensor([259, 260]), EPS, freq,
                                              cache.view(torch.float8_e4m3fn), page_size=256, layout="V41_FP4")
    assert out.dtype == torch.bfloat16 and out.shape == (2, 512)
    stored = [(259, finish(x, w)[0], 3), (260, finish(x, w)[1], 4)]
    assert torch.equal(cache, expected_cache(poisoned(KVLayout.V41_FP4, 2, 256), stored, freq, 256, KVLayout.V41_FP4))


# ---------------------------------------------------------------------------------------------- c2

class PairModel:
    """The pair rules one row at a time: the ring, `out` and the stored latents."""

    def __init__(self, ring: torch.Tensor, ring_size: int, n: int):
        self.ring, self.ring_size = ring.clone(), ring_size
        self.out = sentinel_out(n).float()
        self.stored: list[tuple[int, torch.Tensor, int]] = []

    def ring_row(self, req: int, pos: int) -> int:
        return req * self.ring_size + pos % self.ring_size

    def close(self, i: int, partner: torch.Tensor, own: torch.Tensor, pos: int, raw: int, w: torch.Tensor) -> None:
        pooled = torch.tensor(pool_fused(partner.tolist(), own.tolist()))
        latent = finish(pooled.bfloat16().float()[None], w)[0]
        self.out[i] = latent
        self.stored.append((raw >> 1, latent, pos - 1))

    def decode(self, kv: torch.Tensor, pos, req, raw, w: torch.Tensor, draft_len: int = 1) -> None:
        reads = [kv[i - 1] if i % draft_len else self.ring[self.ring_row(int(req[i]), int(pos[i]) - 1)].clone()
                 for i in range(kv.shape[0])]
        parks = []
        for i in range(kv.shape[0]):
            if raw[i] == 0:
                continue
            if pos[i] % 2:
                self.close(i, reads[i], kv[i], int(pos[i]), int(raw[i]), w)
            else:
                parks.append(i)
        for i in parks:
            self.ring[self.ring_row(int(req[i]), int(pos[i]))] = kv[i]


def run_c2_decode(kv, ring, w, pos, req, raw, freq, cache, page_size, ring_size, layout, draft_len=1):
    state, out = ring.clone(), sentinel_out(kv.shape[0])
    low_ratio.c2_decode_norm_rope_store(kv, state, w, pos, req, raw, EPS, freq, cache, page_size=page_size,
                                        ring_size=ring_size, draft_len=draft_len, layout=layout, out=out)
    return state, out


@pytest.mark.parametrize("layout", [KVLayout.V4, KVLayout.V41_FP4, KVLayout.V41_NEW, KVLayout.UNIFORM_FP8])
def test_c2_decode(layout):
    """Odd rows pool with ring row (req, p − 1) and store at raw >> 1 with RoPE at p − 1; even rows park;
    padded rows (raw 0) write nothing."""
    pos = torch.tensor([5, 6, 7, 0, 300, 255, 0])
    req = torch.tensor([0, 1, 2, 3, 4, 5, 0])
    raw = torch.tensor([256 + 5, 512 + 6, 768 + 7, 1024, 1280 + 300 % 256, 1536 + 255, 0])
    kv = torch.randn(7, 1024, generator=gen(7)) * 2
    ring = torch.randn(14, 1024, generator=gen(8)) * 2
    ring[4, 512:] = -math.inf  # a cleared partner: pooled = own kv
    w, freq = weight(9), freq_table(400, 10)
    cache = poisoned(layout, 7, 128)
    state, out = run_c2_decode(kv, ring, w, pos, req, raw.to(torch.int32), freq, cache, 128, 2, layout)
    model = PairModel(ring, 2, 7)
    model.decode(kv, pos, req, raw, w)
    assert torch.equal(out.float(), model.out) and torch.equal(state, model.ring)
    assert torch.equal(cache, expected_cache(poisoned(layout, 7, 128), model.stored, freq, 128, layout))
    assert [loc for loc, _, _ in model.stored] == [130, 387, 895] and torch.equal(state[2], kv[1])


def test_c2_verify_is_the_decodes_of_its_rows_in_order():
    """draft_len 3, ring 4: inside a block the partner is the previous input row, which is what the
    previous row's decode would have parked; a padded block writes nothing."""
    pos = torch.tensor([5, 6, 7, 10, 11, 12, 0, 0, 0])
    req = torch.tensor([2, 2, 2, 0, 0, 0, 0, 0, 0])
    raw = torch.tensor([512 + 5, 512 + 6, 512 + 7, 256 + 10, 256 + 11, 256 + 12, 0, 0, 0])
    kv = torch.randn(9, 1024, generator=gen(11))
    ring = torch.randn(14, 1024, generator=gen(12))
    w, freq, layout = weight(13), freq_table(16, 14), KVLayout.V41_FP4
    cache = poisoned(layout, 4, 128)
    state, out = run_c2_decode(kv, ring, w, pos, req, raw, freq, cache, 128, 4, layout, draft_len=3)
    seq_state, seq_cache, seq_out = ring.clone(), poisoned(layout, 4, 128), sentinel_out(9)
    for i in range(9):
        low_ratio.c2_decode_norm_rope_store(kv[i:i + 1], seq_state, w, pos[i:i + 1], req[i:i + 1], raw[i:i + 1], EPS,
                                            freq, seq_cache, page_size=128, ring_size=4, layout=layout,
                                            out=seq_out[i:i + 1])
    assert torch.equal(out, seq_out) and torch.equal(state, seq_state) and torch.equal(cache, seq_cache)
    model = PairModel(ring, 4, 9)
    model.decode(kv, pos, req, raw, w, draft_len=3)
    assert torch.equal(out.float(), model.out) and torch.equal(state, model.ring)
    assert [(loc, p) for loc, _, p in model.stored] == [(258, 4), (259, 6), (133, 10)]


def run_prefill(kv, ring, w, pos, req, raw, starts, lens, freq, cache, ring_size, layout):
    state, out = ring.clone(), sentinel_out(kv.shape[0])
    low_ratio.c2_prefill_norm_rope_store(kv, state, w, pos, req, raw, EPS, freq, cache,
                                         torch.tensor(starts, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                         page_size=128, ring_size=ring_size, layout=layout, out=out)
    return state, out


def test_the_spec_worked_example():
    """The worked example of the V4.1 facts: ring_size 2, request slot 3, full page 5 (raw = 1280 + pos)."""
    layout, w, freq = KVLayout.V41_FP4, weight(15), freq_table(8, 16)
    kv = torch.randn(7, 1024, generator=gen(17))
    ring = torch.randn(10, 1024, generator=gen(18))
    cache = poisoned(layout, 6, 128)
    pos = torch.arange(5)
    state, out = run_prefill(kv[:5], ring, w, pos, torch.full((5,), 3), 1280 + pos, [0], [5], freq, cache, 2, layout)
    model = PairModel(ring, 2, 5)
    model.close(1, kv[0], kv[1], 1, 1281, w)
    model.close(3, kv[2], kv[3], 3, 1283, w)
    assert [(loc, p) for loc, _, p in model.stored] == [(640, 0), (641, 2)]
    assert torch.equal(out.float(), model.out)
    expected_ring = ring.clone()
    expected_ring[6], expected_ring[7] = kv[4], kv[3]  # positions 4 and 3 parked
    assert torch.equal(state, expected_ring)
    stored = list(model.stored)
    # decode at position 5 pools with ring row 6 (position 4) into loc 642 at RoPE position 4
    state, out = run_c2_decode(kv[5:6], state, w, torch.tensor([5]), torch.tensor([3]), torch.tensor([1285]), freq,
                               cache, 128, 2, layout)
    model = PairModel(state, 2, 1)
    model.close(0, kv[4], kv[5], 5, 1285, w)
    stored += model.stored
    assert [(loc, p) for loc, _, p in stored][-1] == (642, 4) and torch.equal(out.float(), model.out)
    # decode at 6 parks itself at row 6
    state, _ = run_c2_decode(kv[6:7], state, w, torch.tensor([6]), torch.tensor([3]), torch.tensor([1286]), freq,
                             cache, 128, 2, layout)
    expected_ring[6] = kv[6]
    assert torch.equal(state, expected_ring)
    assert torch.equal(cache, expected_cache(poisoned(layout, 6, 128), stored, freq, 128, layout))


def test_prefill_write_back_comes_after_every_read():
    """A chunk of positions 3-6 reads ring row (1, 2) for position 3 and writes it back with position 6."""
    layout, w, freq = KVLayout.V41, weight(19), freq_table(8, 20)
    kv, ring = torch.randn(4, 1024, generator=gen(21)), torch.randn(6, 1024, generator=gen(22))
    pos = torch.arange(3, 7)
    cache = poisoned(layout, 3, 128)
    state, out = run_prefill(kv, ring, w, pos, torch.ones(4, dtype=torch.int64), 256 + pos, [0], [4], freq, cache,
                             2, layout)
    model = PairModel(ring, 2, 4)
    model.close(0, ring[2], kv[0], 3, 259, w)  # the ring row as it was before the step
    model.close(2, kv[1], kv[2], 5, 261, w)
    assert torch.equal(out.float(), model.out)
    expected_ring = ring.clone()
    expected_ring[3], expected_ring[2] = kv[2], kv[3]
    assert torch.equal(state, expected_ring)
    assert torch.equal(cache, expected_cache(poisoned(layout, 3, 128), model.stored, freq, 128, layout))


def test_prefill_mixed_requests_padding_and_partners():
    """Requests in any order with padded rows among them and rows of no request after them; a partner
    comes from the previous input row only when it is the same request, position p − 1, not padded."""
    pos = [9, 10, 11, 12, 13, 14, 15] + [0, 1, 2, 3, 4, 5] + [7, 8, 9] + [2, 0]
    req = [1] * 7 + [0] * 6 + [2, 2, 2] + [3, 0]
    raw = [256 + p for p in pos[:7]] + [512 + p for p in pos[7:13]] + [768 + 7, 0, 768 + 9] + [1024 + 2, 0]
    raw[10] = 0  # padding inside request 0; row 14 (position 8) is padding too: row 15 pairs with the ring
    starts, lens = [7, 0, 13], [6, 7, 3]
    n, ring_size = len(pos), 4
    kv, ring = torch.randn(n, 1024, generator=gen(23)), torch.randn(16, 1024, generator=gen(24))
    w, freq, layout = weight(25), freq_table(16, 26), KVLayout.V41_FP4_NEW
    cache = poisoned(layout, 4, 128)
    pos_t, req_t, raw_t = torch.tensor(pos), torch.tensor(req), torch.tensor(raw)
    state, out = run_prefill(kv, ring, w, pos_t, req_t, raw_t, starts, lens, freq, cache, ring_size, layout)
    model = PairModel(ring, ring_size, n)
    for i in range(n):
        if raw[i] == 0 or pos[i] % 2 == 0:
            continue
        in_batch = i > 0 and req[i - 1] == req[i] and pos[i - 1] == pos[i] - 1 and raw[i - 1] != 0
        partner = kv[i - 1] if in_batch else ring[model.ring_row(req[i], pos[i] - 1)]
        model.close(i, partner, kv[i], pos[i], raw[i], w)
    for start, length in zip(starts, lens):
        for i in range(start + length - min(length, ring_size), start + length):
            if raw[i]:
                model.ring[model.ring_row(req[i], pos[i])] = kv[i]
    assert torch.equal(out.float(), model.out) and torch.equal(state, model.ring)
    assert torch.equal(cache, expected_cache(poisoned(layout, 4, 128), model.stored, freq, 128, layout))
    assert sorted(i for i in range(n) if out[i, 0] != SENTINEL) == [0, 2, 4, 6, 8, 12, 13, 15]
    assert torch.equal(state[4], kv[3])    # read by row 0 (position 8), then written back with position 12
    assert torch.equal(state[14], ring[14])  # row 16 belongs to no request: never parked
    assert torch.equal(state[0], kv[11]) and torch.equal(state[3], ring[3])  # row 10 (padded) not parked


# ---------------------------------------------------------------------------------------- decode pool

def pool_pairs(kv_o: list[float], s_o: list[float], kv_n: list[float], s_n: list[float]) -> list[float]:
    """c2_decode_pool per channel in fp32: the two normalised softmax weights, then the weighted sum."""
    out = []
    for a, sa, b, sb in zip(kv_o, s_o, kv_n, s_n):
        m = max(sa, sb)
        e_o, e_n = f32(math.exp(f32(sa - m))), f32(math.exp(f32(sb - m)))
        denom = f32(e_o + e_n)
        out.append(f32(f32(a * f32(e_o / denom)) + f32(b * f32(e_n / denom))))
    return out


@pytest.mark.parametrize("ring_size", [0, 2, 4])
def test_c2_decode_pool(ring_size):
    #        odd   even  pos 0  odd    padded
    pos = torch.tensor([5, 6, 0, 301, 0])
    req = torch.tensor([0, 1, 2, 3, 0])
    raw = torch.tensor([256 + 5, 512 + 6, 768, 1024 + 301 % 256, 0], dtype=torch.int32)
    out_loc = torch.tensor([130, -1, -1, 534, 0])
    kv, score = torch.randn(5, 512, generator=gen(27)), torch.randn(5, 512, generator=gen(28)) * 3
    if ring_size:
        buf = torch.randn(4 * ring_size + ring_size + 2, 1024, generator=gen(29))
        state_kv, state_score, pad_row = buf[:, :512], buf[:, 512:], buf.shape[0] - 1
    else:
        state_kv, state_score = torch.randn(5, 512, generator=gen(30)), torch.randn(5, 512, generator=gen(31))
        pad_row = 4
    before_kv, before_score = state_kv.clone(), state_score.clone()
    pooled, group_pos, slots = low_ratio.c2_decode_pool(kv, score, pos, raw, out_loc, req, state_kv, state_score,
                                                        pad_row, ring_size=ring_size)
    expected_kv, expected_score = before_kv.clone(), before_score.clone()
    for i in range(5):
        padded = raw[i] == 0
        if ring_size:
            r = pad_row if padded or pos[i] == 0 else int(req[i]) * ring_size + (int(pos[i]) - 1) % ring_size
        else:
            r = pad_row if padded else int(req[i])
        partner_kv, partner_score = before_kv[r], before_score[r]
        assert pooled[i].tolist() == pool_pairs(partner_kv.tolist(), partner_score.tolist(), kv[i].tolist(),
                                                score[i].tolist())
        weights = torch.softmax(torch.stack([partner_score, score[i]]).double(), dim=0)
        softmax_pooled = weights[0] * partner_kv.double() + weights[1] * kv[i].double()
        assert torch.allclose(pooled[i].double(), softmax_pooled, rtol=1e-6, atol=1e-6)
        if ring_size and not padded:
            row = int(req[i]) * ring_size + int(pos[i]) % ring_size
            expected_kv[row], expected_score[row] = kv[i], score[i]
        elif not ring_size:
            odd = bool(pos[i] % 2)
            expected_kv[r] = partner_kv if odd else kv[i]
            expected_score[r] = partner_score if odd else score[i]
    assert torch.equal(state_kv, expected_kv) and torch.equal(state_score, expected_score)
    assert group_pos.tolist() == [4, 6, 0, 300, 0] and group_pos.dtype == torch.int64
    assert slots.tolist() == [130, 0, 0, 534, 0] and slots.dtype == out_loc.dtype
    if ring_size:
        assert torch.equal(state_kv[pad_row], before_kv[pad_row])  # never written with a ring
