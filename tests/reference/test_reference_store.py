"""CPU tests of the norm/rope/store reference (contract §6): codecs, math, cache layouts, row selection.

Expected values come from the contract's formulas re-derived here (scalar loops, math.frexp, torch's own
float8 conversion, hand-worked codes), never from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4jit.geometry import page_bytes
from dsv4jit.plan_layout import encode_compress_plan, encode_decode_plan, invalid_compress_rows
from dsv4jit.reference import quant
from dsv4jit.reference import store

POISON = 0xAB
F8 = torch.float8_e4m3fn


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def f32(v: float) -> float:
    """Round a Python float to fp32."""
    return torch.tensor(v, dtype=torch.float32).item()


def next_up(v: float) -> float:
    return torch.nextafter(torch.tensor(v, dtype=torch.float32), torch.tensor(math.inf)).item()


def ceil_ue8m0(scale_raw: float) -> int:
    """UE8M0 exponent of the smallest power of two >= scale_raw, via math.frexp (scale_raw = m·2^x)."""
    m, x = math.frexp(scale_raw)
    return 127 + (x - 1 if m == 0.5 else x)


def freq_cis_table(max_pos: int, seed: int) -> torch.Tensor:
    """complex64 [max_pos, 32] of unit rotations with distinct angles per position and pair."""
    inv = 40000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    jitter = torch.rand(32, generator=gen(seed), dtype=torch.float64)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * (inv + jitter)[None, :]
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def random_kv(n: int, hd: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    row_scale = torch.logspace(-2, 1.5, n)[torch.randperm(n, generator=g)]
    return torch.randn(n, hd, generator=g) * row_scale[:, None] + 0.05


def random_weight(hd: int, seed: int) -> torch.Tensor:
    return 0.5 + torch.rand(hd, generator=gen(seed))


# ------------------------------------------------------------------------------------ UE8M0

def test_ue8m0_hand_vectors():
    assert quant.ue8m0_exponent(1.0) == 127
    assert quant.ue8m0_exponent(2.0 ** -3) == 124
    assert quant.ue8m0_exponent(2.0 ** 5) == 132
    for k in (-20, -3, 0, 4):
        assert quant.ue8m0_exponent(1.5 * 2.0 ** k) == 127 + k + 1  # rounds up, not to nearest
    assert quant.ue8m0_exponent(next_up(1.0)) == 128
    assert quant.ue8m0_exponent(f32(2.0 - 2.0 ** -23)) == 128
    # tiny amax hits the 1e-4 floor: 1e-4/448 = 2.23e-7 lies in (2^-23, 2^-22]
    floored = (torch.tensor([3e-9]).clamp_min(1e-4) / 448.0)
    e = quant.ue8m0_exponent(floored)
    assert e.tolist() == [127 - 22]
    assert quant.ue8m0_scale(e).tolist() == [2.0 ** -22]
    # vectorized agrees with the frexp rule
    vals = torch.rand(1000, generator=gen(1)) * torch.logspace(-8, 3, 1000)
    got = quant.ue8m0_exponent(vals)
    assert got.tolist() == [ceil_ue8m0(v) for v in vals.tolist()]


# ------------------------------------------------------------------------------------- e4m3

E4M3_HAND = [
    (1.0, 0x38), (1.125, 0x39),
    (1.0625, 0x38),            # tie between 1.0 and 1.125 -> even mantissa (1.0)
    (1.1875, 0x3A),            # tie between 1.125 and 1.25 -> even mantissa (1.25)
    (240.0, 0x77), (256.0, 0x78),
    (448.0, 0x7E), (464.0, 0x7E), (1000.0, 0x7E), (1e30, 0x7E),   # satfinite
    (-448.0, 0xFE), (-1e6, 0xFE), (-1.5, 0xBC), (-0.75, 0xB4),
    (2.0 ** -9, 0x01), (3 * 2.0 ** -9, 0x03), (2.0 ** -7, 0x04), (2.0 ** -6, 0x08),
    (2.0 ** -10, 0x00),        # half the smallest subnormal: tie -> 0
    (3 * 2.0 ** -10, 0x02),    # 1.5 steps -> 2
    (5 * 2.0 ** -10, 0x02),    # 2.5 steps -> 2
    (15 * 2.0 ** -10, 0x08),   # 7.5 steps -> 8 = smallest normal
    (-(2.0 ** -9), 0x81),
    (0.0, 0x00),
]


@pytest.mark.parametrize("value,code", E4M3_HAND)
def test_e4m3_encode_hand_vectors(value, code):
    assert quant.e4m3_encode(torch.tensor([value])).item() == code


def test_e4m3_decode_hand_vectors():
    codes = torch.tensor([0x01, 0x08, 0x38, 0x3A, 0x7E, 0xBC, 0xFE, 0x00], dtype=torch.uint8)
    expect = [2.0 ** -9, 2.0 ** -6, 1.0, 1.25, 448.0, -1.5, -448.0, 0.0]
    assert quant.e4m3_decode(codes).tolist() == expect
    assert math.isnan(quant.e4m3_decode(torch.tensor([0x7F], dtype=torch.uint8)).item())


def test_e4m3_matches_torch_float8():
    g = gen(2)
    x = torch.cat([torch.randn(20000, generator=g) * 100, torch.randn(20000, generator=g) * 1e-2,
                   torch.randn(5000, generator=g) * 1e-3,
                   (torch.rand(5000, generator=g) - 0.5) * 896])
    clamped = x.clamp(-448, 448)
    assert torch.equal(quant.e4m3_encode(clamped), clamped.to(F8).view(torch.uint8))
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    assert torch.equal(quant.e4m3_decode(codes)[finite], codes.view(F8).float()[finite])
    # every finite code survives decode -> encode
    assert torch.equal(quant.e4m3_encode(quant.e4m3_decode(codes[finite])), codes[finite])


# -------------------------------------------------------------------------------------- fp4

def test_fp4_thresholds():
    thresholds = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    for i, t in enumerate(thresholds):
        assert quant.fp4_encode(torch.tensor([t])).item() == i          # the threshold itself: smaller code
        assert quant.fp4_encode(torch.tensor([next_up(t)])).item() == i + 1
        assert quant.fp4_encode(torch.tensor([-next_up(t)])).item() == (i + 1) | 8
    cases = [(0.0, 0), (0.1, 0), (6.0, 7), (7.0, 7), (1e9, 7), (-7.0, 0xF), (-1.0, 0xA), (-0.26, 0x9),
             (-0.1, 0), (-0.25, 0), (-1e-30, 0), (-0.0, 0)]   # no -0: tiny negatives and -0 give code 0
    for u, code in cases:
        assert quant.fp4_encode(torch.tensor([u])).item() == code, u


def test_fp4_decode_table():
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    assert quant.fp4_decode(codes).tolist() == values + [-v for v in values]


# --------------------------------------------------------------------------------- Hadamard

def test_hadamard_matrix_is_sylvester():
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert torch.equal(quant.hadamard_matrix(128), h)


def test_hadamard128_properties():
    eye = torch.eye(128)
    h = quant.hadamard128(eye)
    torch.testing.assert_close(quant.hadamard128(h), eye, atol=1e-6, rtol=0)   # H·H = I
    x = torch.randn(5, 128, generator=gen(3)) + 0.3
    out = quant.hadamard128(x)
    # first row of H is all ones: output 0 is the scaled sum
    torch.testing.assert_close(out[:, 0], x.double().sum(-1).float() / math.sqrt(128), rtol=1e-6, atol=1e-6)
    # one-hot e_j picks column j: (-1)^popcount(i & j) / sqrt(128)
    for j in (0, 1, 37, 127):
        col = quant.hadamard128(eye[j:j + 1])[0]
        expect = torch.tensor([(-1) ** bin(i & j).count("1") for i in range(128)]) / math.sqrt(128)
        torch.testing.assert_close(col, expect.float(), rtol=0, atol=1e-7)


# ----------------------------------------------------------------------------- norm and rope

def scalar_norm_rope(x, w, eps, cos_sin, rope_dim=64):
    """contract §6.2 and contract §6.3 in Python floats, one row."""
    hd = len(x)
    r = 1.0 / math.sqrt(sum(v * v for v in x) / hd + eps)
    y = [x[d] * r * w[d] for d in range(hd)]
    base = hd - rope_dim
    for k in range(rope_dim // 2):
        re, im = y[base + 2 * k], y[base + 2 * k + 1]
        c, s = cos_sin[2 * k], cos_sin[2 * k + 1]
        y[base + 2 * k] = re * c - im * s
        y[base + 2 * k + 1] = re * s + im * c
    return y


@pytest.mark.parametrize("hd", [512, 128])
def test_norm_rope_matches_scalar_loop(hd):
    kv, w = random_kv(6, hd, seed=10 + hd), random_weight(hd, seed=11)
    freq_cis = freq_cis_table(300, seed=12)
    freq = store.freq_table(freq_cis)
    positions = torch.tensor([0, 1, 4, 128, 255, 299])
    got = store.norm_rope(kv, w, 1e-6, freq, positions)
    for i, p in enumerate(positions.tolist()):
        cos_sin = []
        for k in range(32):
            cos_sin += [freq_cis[p, k].real.item(), freq_cis[p, k].imag.item()]
        expect = torch.tensor(scalar_norm_rope(kv[i].tolist(), w.tolist(), f32(1e-6), cos_sin), dtype=torch.float64)
        torch.testing.assert_close(got[i].double(), expect, rtol=2e-6, atol=2e-6 * expect.abs().max().item())


def test_freq_table_interleaves_cos_sin():
    freq_cis = freq_cis_table(20, seed=13)
    t = store.freq_table(freq_cis)
    assert t.shape == (20, 64) and t.dtype == torch.float32
    assert torch.equal(t[:, 0::2], freq_cis.real) and torch.equal(t[:, 1::2], freq_cis.imag)


@pytest.mark.parametrize("hd", [512, 128])
def test_rope_pairs_are_interleaved_trailing_dims(hd):
    kv, w = random_kv(3, hd, seed=14), random_weight(hd, seed=15)
    # a quarter turn on every pair: (re, im) -> (-im, re), exactly
    freq = torch.tensor([0.0, 1.0]).repeat(32)[None, :].repeat(4, 1)
    y = store.norm_rope(kv, w, 1e-6, freq, torch.tensor([3, 3, 3]))
    plain = store.norm_rope(kv, w, 1e-6, torch.tensor([1.0, 0.0]).repeat(32)[None, :], torch.zeros(3, dtype=torch.int64))
    base = hd - 64
    assert torch.equal(y[:, :base], plain[:, :base])               # nope dims untouched by RoPE
    assert torch.equal(y[:, base::2], -plain[:, base + 1::2])
    assert torch.equal(y[:, base + 1::2], plain[:, base::2])


# -------------------------------------------------------------------------------- page bytes

def test_page_bytes_examples():
    assert page_bytes("v4_fp8", 64) == 37440
    assert page_bytes("v4_fp8", 2) == 1728
    assert page_bytes("v4_fp8", 1) == 1152
    assert page_bytes("v4_bf16", 1) == 1024
    for ps in (1, 2, 64):
        assert page_bytes("indexer_fp8", ps) == 132 * ps
        assert page_bytes("indexer_fp4", ps) == 68 * ps
    with pytest.raises(ValueError):
        page_bytes("v4_fp8", 3)


# ------------------------------------------------------------ op: row selection and layouts

# (format, head_dim, R, page_size, flags)
CASES = [
    ("v4_fp8", 512, 4, 64, {}),
    ("v4_fp8", 512, 128, 2, {}),
    ("v4_bf16", 512, 128, 1, {"bf16_store": True}),
    ("indexer_fp8", 128, 4, 64, {}),
    ("indexer_fp4", 128, 4, 64, {"use_fp4": True}),
]
NUM_PAGES = {1: 40, 2: 20, 64: 3}


def written_spans(fmt, slot, ps):
    """(start, length) byte spans a token at ``slot`` owns in its page, per contract §6.5."""
    return {
        "v4_fp8": [(slot * 576, 576), (ps * 576 + slot * 8, 7)],       # scale byte 7 excluded
        "v4_bf16": [(slot * 1024, 1024)],
        "indexer_fp8": [(slot * 128, 128), (ps * 128 + slot * 4, 4)],
        "indexer_fp4": [(slot * 64, 64), (ps * 64 + slot * 4, 4)],
    }[fmt]


def run_case(fmt, hd, R, ps, flags, *, decode, loc_dtype, seed):
    """Run the op on a poisoned cache; return (cache, {loc: position}, kv rows by loc, weight, freq_cis)."""
    g = gen(seed)
    n_pages = NUM_PAGES[ps]
    num_slots = n_pages * ps
    kv, w = random_kv(12, hd, seed + 1), random_weight(hd, seed + 2)
    if hd == 512:
        w[64:128] = 1e-7 * (1 + torch.rand(64, generator=g))   # one nope tile below the amax floor
    freq_cis = freq_cis_table(R * 8 + 1, seed + 3)
    n = kv.shape[0]
    # loc 0 is never a real target: non-event out_loc entries are 0 and must not be dereferenced.
    targets = (torch.randperm(num_slots - 1, generator=g)[:n] + 1)
    seq_len = R * torch.randint(1, 9, (n,), generator=g)
    if decode:
        boundary = torch.rand(n, generator=g) < 0.6
        boundary[:2] = torch.tensor([True, False])
        offset = torch.randint(1, R, (n,), generator=g)
        seq_len = torch.where(boundary, seq_len, seq_len - offset)
        plan = encode_decode_plan(seq_len, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                                  torch.zeros(n, dtype=torch.int64))
        out_loc = torch.where(boundary, targets, torch.zeros_like(targets))
        kept = boundary.nonzero().flatten().tolist()
        loc_of = {i: int(out_loc[i]) for i in kept}
    else:
        num_q = 3 * n
        valid = torch.rand(n, generator=g) < 0.7
        valid[:2] = torch.tensor([True, False])
        ragged = torch.randperm(num_q, generator=g)[:n]
        plan = encode_compress_plan(seq_len, ragged, torch.zeros(n, dtype=torch.int64),
                                    torch.full((n,), -1), torch.full((n,), -1))
        plan[~valid] = invalid_compress_rows(int((~valid).sum()))
        out_loc = torch.zeros(num_q, dtype=torch.int64)
        out_loc[ragged] = targets
        kept = valid.nonzero().flatten().tolist()
        loc_of = {i: int(targets[i]) for i in kept}
    cache = torch.full((n_pages, page_bytes(fmt, ps)), POISON, dtype=torch.uint8)
    store.compress_norm_rope_store(kv, plan, is_decode=decode, compress_ratio=R, norm_weight=w, norm_eps=1e-6,
                                   freq_cis=freq_cis, out_loc=out_loc.to(loc_dtype), kvcache=cache,
                                   page_size=ps, **flags)
    positions = {loc_of[i]: int(seq_len[i]) - R for i in kept}
    rows = {loc_of[i]: kv[i] for i in kept}
    return cache, positions, rows, w, freq_cis


def check_v4(cache, loc, y, ps):
    page, slot = divmod(loc, ps)
    data = cache[page, slot * 576: slot * 576 + 576]
    scale_bytes = cache[page, ps * 576 + slot * 8: ps * 576 + slot * 8 + 7]
    x_hat = y[:448].to(torch.bfloat16).float().reshape(7, 64)
    codes = data[:448].reshape(7, 64)
    for t in range(7):
        amax = x_hat[t].abs().max()
        e = ceil_ue8m0((amax.clamp_min(1e-4) / 448.0).item())
        assert scale_bytes[t].item() == e
        scaled = (x_hat[t] * 2.0 ** (127 - e)).clamp(-448, 448)
        assert torch.equal(codes[t], scaled.to(F8).view(torch.uint8))
        deq = codes[t].view(F8).float() * 2.0 ** (e - 127)
        assert bool(((deq - x_hat[t]).abs() <= 2.0 ** -4 * x_hat[t].abs() + 2.0 ** -10 * 2.0 ** (e - 127)).all())
        assert (deq - x_hat[t]).abs().max() <= 2.0 ** -3 * max(amax.item(), 1e-4)
    assert torch.equal(data[448:].view(torch.bfloat16), y[448:].to(torch.bfloat16))
    return torch.cat([(codes.view(F8).float() * torch.tensor([2.0 ** (b - 127) for b in scale_bytes.tolist()])[:, None]).flatten(),
                      data[448:].view(torch.bfloat16).float()])


def check_bf16(cache, loc, y, ps):
    page, slot = divmod(loc, ps)
    data = cache[page, slot * 1024: slot * 1024 + 1024]
    assert torch.equal(data.view(torch.bfloat16), y.to(torch.bfloat16))
    return data.view(torch.bfloat16).float()


def check_indexer_fp8(cache, loc, v, ps):
    page, slot = divmod(loc, ps)
    codes = cache[page, slot * 128: slot * 128 + 128]
    stored_scale = cache[page, ps * 128 + slot * 4: ps * 128 + slot * 4 + 4].view(torch.float32)
    scale = v.abs().max().clamp_min(1e-4) / 448.0          # fp32, not a power of two
    assert stored_scale.item() == scale.item()
    assert torch.equal(codes, (v * (1.0 / scale)).clamp(-448, 448).to(F8).view(torch.uint8))
    deq = codes.view(F8).float() * scale
    assert bool(((deq - v).abs() <= (2.0 ** -4 + 1e-6) * v.abs() + 2.0 ** -10 * scale).all())
    return deq


def check_indexer_fp4(cache, loc, v, ps):
    page, slot = divmod(loc, ps)
    payload = cache[page, slot * 64: slot * 64 + 64].tolist()
    scale_bytes = cache[page, ps * 64 + slot * 4: ps * 64 + slot * 4 + 4].tolist()
    nibbles = []
    for b in payload:
        nibbles += [b & 0xF, b >> 4]                       # even dim in the low nibble
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    thresholds = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    deq = []
    for grp in range(4):
        vg = v[32 * grp: 32 * grp + 32]
        e = ceil_ue8m0((vg.abs().max().clamp_min(1e-4) / 6.0).item())
        assert scale_bytes[grp] == e
        s = 2.0 ** (e - 127)
        for d in range(32):
            u = vg[d].item() / s
            idx = sum(min(abs(u), 6.0) > t for t in thresholds)
            code = idx | (8 if (u < 0 and idx) else 0)
            nib = nibbles[32 * grp + d]
            assert nib == code, (grp, d, u)
            value = (-1 if nib & 8 else 1) * table[nib & 7] * s
            assert abs(value - vg[d].item()) <= max(0.25 * s, abs(vg[d].item()) / 4)
            deq.append(value)
    return torch.tensor(deq)


CHECKS = {"v4_fp8": check_v4, "v4_bf16": check_bf16, "indexer_fp8": check_indexer_fp8,
          "indexer_fp4": check_indexer_fp4}


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-R{c[2]}-ps{c[3]}" for c in CASES])
def test_store_writes_exactly_its_bytes(case, loc_dtype, decode):
    fmt, hd, R, ps, flags = case
    cache, positions, rows, w, freq_cis = run_case(fmt, hd, R, ps, flags, decode=decode, loc_dtype=loc_dtype,
                                                   seed=100 + hd + R + ps + 7 * decode)
    assert positions, "the case must store at least one row"
    locs = sorted(positions)
    pos = torch.tensor([positions[l] for l in locs])
    # Expected fp32 values before quantization: norm_rope is checked against the scalar loop above.
    y = store.norm_rope(torch.stack([rows[l] for l in locs]), w, 1e-6, store.freq_table(freq_cis), pos)
    if hd == 128:
        y = quant.hadamard128(y)
    owned = torch.zeros_like(cache, dtype=torch.bool)
    deq = []
    for i, loc in enumerate(locs):
        deq.append(CHECKS[fmt](cache, loc, y[i], ps))
        page, slot = divmod(loc, ps)
        for start, length in written_spans(fmt, slot, ps):
            owned[page, start:start + length] = True
    # every byte outside the processed tokens' spans (other slots, skipped/invalid rows, V4 scale
    # byte 7, page padding) keeps the poison
    assert bool((cache[~owned] == POISON).all())
    # the public reader agrees with the decoding done here from the raw bytes
    read = store.read_cache(fmt, cache, torch.tensor(locs, dtype=loc_dtype), ps)
    torch.testing.assert_close(read, torch.stack(deq), rtol=0, atol=0)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
@pytest.mark.parametrize("R", [4, 128])
def test_rope_position_is_seq_len_minus_ratio(R, decode):
    cache, positions, rows, w, freq_cis = run_case("v4_bf16", 512, R, 1, {"bf16_store": True},
                                                   decode=decode, loc_dtype=torch.int64, seed=300 + R)
    freq = store.freq_table(freq_cis)
    for loc, p in positions.items():
        got = store.read_bf16(cache, torch.tensor([loc]))[0]
        cos_sin = freq[p].tolist()
        expect = torch.tensor(scalar_norm_rope(rows[loc].tolist(), w.tolist(), f32(1e-6), cos_sin), dtype=torch.float64)
        torch.testing.assert_close(got.double(), expect, rtol=2 ** -8, atol=1e-6)
        # the closing token's position (seq_len - 1) would rotate differently
        wrong = torch.tensor(scalar_norm_rope(rows[loc].tolist(), w.tolist(), f32(1e-6), freq[p + R - 1].tolist()), dtype=torch.float64)
        assert (got[448:].double() - wrong[448:]).abs().max() > 1e-2


def test_bf16_kv_uses_weight_rounded_to_kv_dtype():
    kv = random_kv(4, 512, seed=400).to(torch.bfloat16)
    w = random_weight(512, seed=401)
    freq_cis = freq_cis_table(64, seed=402)
    plan = encode_decode_plan(torch.tensor([4, 8, 12, 16]), torch.zeros(4, dtype=torch.int64),
                              torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    cache = torch.full((8, 1024), POISON, dtype=torch.uint8)
    locs = torch.tensor([5, 1, 7, 2])
    store.compress_norm_rope_store(kv, plan, is_decode=True, compress_ratio=4, norm_weight=w, norm_eps=1e-6,
                                   freq_cis=freq_cis, out_loc=locs, kvcache=cache, page_size=1, bf16_store=True)
    freq, pos = store.freq_table(freq_cis), torch.tensor([0, 4, 8, 12])
    w_bf16 = w.to(torch.bfloat16).float()
    expect = store.norm_rope(kv.float(), w_bf16, 1e-6, freq, pos).to(torch.bfloat16).float()
    unrounded = store.norm_rope(kv.float(), w, 1e-6, freq, pos).to(torch.bfloat16).float()
    got = store.read_bf16(cache, locs)
    assert torch.equal(got, expect)
    assert not torch.equal(got, unrounded)


@pytest.mark.parametrize("fmt", ["indexer_fp8", "indexer_fp4"])
def test_indexer_writers_tiny_values_hit_amax_floor(fmt):
    v = (torch.randn(3, 128, generator=gen(500)) + 0.1) * 1e-7
    cache = torch.full((2, page_bytes(fmt, 4)), POISON, dtype=torch.uint8)
    locs = torch.tensor([6, 0, 3])
    store.WRITERS[fmt](cache, locs, v, 4)
    if fmt == "indexer_fp8":
        scales = torch.stack([cache[l // 4, 512 + (l % 4) * 4: 512 + (l % 4) * 4 + 4] for l in locs.tolist()])
        assert scales.view(torch.float32).flatten().tolist() == [f32(f32(1e-4) / 448.0)] * 3
    else:
        e = torch.stack([cache[l // 4, 256 + (l % 4) * 4: 256 + (l % 4) * 4 + 4] for l in locs.tolist()])
        assert e.flatten().tolist() == [ceil_ue8m0(f32(f32(1e-4) / 6.0))] * 12
    got = store.read_cache(fmt, cache, locs, 4)
    # values far below the floored scale quantize to (near) zero
    assert got.abs().max() <= 1e-6


def test_empty_batch_is_a_noop():
    cache = torch.full((2, 1728), POISON, dtype=torch.uint8)
    store.compress_norm_rope_store(torch.zeros(0, 512), invalid_compress_rows(0), is_decode=False, compress_ratio=128,
                                   norm_weight=torch.ones(512), norm_eps=1e-6, freq_cis=freq_cis_table(4, 1),
                                   out_loc=torch.zeros(0, dtype=torch.int64), kvcache=cache, page_size=2)
    assert bool((cache == POISON).all())


def test_bad_arguments_raise():
    kv, w, freq_cis = random_kv(2, 512, 600), random_weight(512, 601), freq_cis_table(16, 602)
    plan = encode_decode_plan(torch.tensor([4, 8]), torch.zeros(2, dtype=torch.int64),
                              torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    cache = torch.full((2, page_bytes("v4_fp8", 2)), POISON, dtype=torch.uint8)
    common = dict(is_decode=True, compress_ratio=4, norm_weight=w, norm_eps=1e-6, freq_cis=freq_cis, page_size=2)
    with pytest.raises(ValueError, match="out_loc"):        # decode needs exactly B entries
        store.compress_norm_rope_store(kv, plan, out_loc=torch.tensor([1, 2, 3]), kvcache=cache, **common)
    with pytest.raises(ValueError, match="locations"):      # loc beyond the cache
        store.compress_norm_rope_store(kv, plan, out_loc=torch.tensor([1, 4]), kvcache=cache, **common)
    with pytest.raises(ValueError, match="page_bytes"):     # wrong row stride
        store.compress_norm_rope_store(kv, plan, out_loc=torch.tensor([1, 2]), kvcache=cache[:, :1000], **common)
    with pytest.raises(ValueError, match="use_fp4"):
        store.compress_norm_rope_store(kv, plan, out_loc=torch.tensor([1, 2]), kvcache=cache, use_fp4=True, **common)
    with pytest.raises(TypeError, match="out_loc"):
        store.compress_norm_rope_store(kv, plan, out_loc=torch.tensor([1.0, 2.0]), kvcache=cache, **common)
    prefill = encode_compress_plan(torch.tensor([4, 8]), torch.tensor([0, 5]), torch.zeros(2, dtype=torch.int64),
                                   torch.full((2,), -1), torch.full((2,), -1))
    with pytest.raises(ValueError, match="ragged"):         # out_loc is indexed by ragged id
        store.compress_norm_rope_store(kv, prefill, out_loc=torch.tensor([1, 2]), kvcache=cache,
                                       **{**common, "is_decode": False})
    assert bool((cache == POISON).all())
