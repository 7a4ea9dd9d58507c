"""The V4.1 codecs (reference/quant_v41.py) against sglang 0.5.23's rules: hand-worked codes,
CUDA's own e2m1 conversion algorithm, exact rational arithmetic and torch's float8 cast
(tests/helpers/v41_oracles.py)."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from dsv4jit.reference import quant, quant_v41
from helpers.v41_oracles import (
    E2M1_GRID,
    cuda_e2m1,
    e4m3_value,
    f32,
    fake_quant_16,
    fp4_scale,
    uniform_fp8_row,
    v41_exponent,
    v41_fp4_row,
    v41_row,
)

TINY = 2.0 ** -149  # the least fp32 subnormal


def codes(values) -> list[int]:
    return quant_v41.e2m1rn_encode(torch.tensor(values, dtype=torch.float32)).tolist()


def fp32_neighbours(x: float, k: int = 3) -> list[float]:
    """x and its k fp32 neighbours on each side."""
    t = torch.tensor([x], dtype=torch.float32)
    out = [x]
    for direction in (math.inf, -math.inf):
        y = t
        for _ in range(k):
            y = torch.nextafter(y, torch.tensor([direction]))
            out.append(y.item())
    return out


def random_fp32(n: int, seed: int, lo: int = -30, hi: int = 30) -> list[float]:
    rng = random.Random(seed)
    return [f32(rng.choice((-1, 1)) * rng.uniform(1, 2) * 2.0 ** rng.randint(lo, hi)) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ e2m1

def test_e2m1_ties_go_to_the_even_code():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    assert codes(ties) == [0, 2, 2, 4, 4, 6, 6]
    assert [E2M1_GRID[c] for c in codes(ties)] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert codes([-t for t in ties]) == [0x8, 0xA, 0xA, 0xC, 0xC, 0xE, 0xE]


def test_e2m1_is_not_the_v4_threshold_rule():
    """The V4 indexer fp4 rule rounds ties down and has no −0: they differ at 0.75, 1.75, 3.5, −0."""
    values = torch.tensor([0.75, 1.75, 3.5, -0.0, -0.1, 1.25, 2.5, 5.0])
    assert quant_v41.e2m1rn_encode(values).tolist() == [2, 4, 6, 8, 8, 2, 4, 6]
    assert quant.fp4_encode(values).tolist() == [1, 3, 5, 0, 0, 2, 4, 6]


def test_e2m1_signs_saturation_and_specials():
    assert codes([0.0, -0.0, -1e-30, -TINY, TINY, -0.25, -0.2500001, 0.2500001]) == [0, 8, 8, 8, 0, 8, 9, 1]
    assert codes([6.0, 6.5, 7.0, 1e30, 3.4e38, math.inf]) == [7] * 6
    assert codes([-6.0, -100.0, -math.inf]) == [0xF] * 3
    assert codes([math.nan, -math.nan]) == [0x7, 0x7]
    assert codes([0.5, 1.0, 1.5, 2.0, 3.0, 4.0]) == [1, 2, 3, 4, 5, 6]


def test_e2m1_matches_cudas_conversion_algorithm():
    """Every midpoint and grid value with its fp32 neighbours, specials, and random fp32 values over
    a wide range of magnitudes, against cuda_fp4.hpp's double-based algorithm."""
    points = [m for m in quant_v41.E2M1_MIDPOINTS] + list(E2M1_GRID) + [6.0, 2.0 ** -2, 2.0 ** -1]
    values = [v for p in points for x in (p, -p) for v in fp32_neighbours(x, 4)]
    values += [0.0, -0.0, TINY, -TINY, 1e-40, -1e-40, math.inf, -math.inf, math.nan, 3.4e38, -3.4e38]
    values += random_fp32(40000, 1, -12, 6) + random_fp32(10000, 2, -140, 120)
    rng = random.Random(3)
    values += [f32(rng.uniform(-7.0, 7.0)) for _ in range(40000)]
    got = codes(values)
    expected = [cuda_e2m1(v) for v in values]
    assert got == expected


def test_e2m1_decode():
    values = quant_v41.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert values == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert math.copysign(1.0, values[8]) == -1.0


# ---------------------------------------------------------------------------------------------- scales

def test_v41_tile_exponent_is_the_exact_ceil_log2():
    """e = 127 + ceil(log2(max(amax / 448, 1e-4))) over many amax values, tensor and scalar alike."""
    amax = [abs(v) for v in random_fp32(20000, 4, -40, 40)]
    for k in range(-30, 30):  # the boundary: mantissa of amax at 1.75 (M = 0x600000) and around it
        amax += fp32_neighbours(1.75 * 2.0 ** k, 2) + fp32_neighbours(2.0 ** k, 2)
    amax += fp32_neighbours(448.0 * 1e-4, 3) + [448.0, 3.4e38]
    got = quant_v41.v41_tile_exponent(torch.tensor(amax, dtype=torch.float32)).tolist()
    assert got == [v41_exponent(a) for a in amax]
    assert quant_v41.v41_tile_exponent(448.0) == 127
    assert quant_v41.v41_tile_exponent(f32(448.0 * (1 + 2 ** -22))) == 128


def test_v41_tile_exponent_floor_for_zero_and_subnormal_tiles():
    for a in (0.0, TINY, 1e-39, 2.0 ** -126, 1e-3, 448.0 * 2.0 ** -13):
        assert quant_v41.v41_tile_exponent(a) == 114
    assert quant_v41.v41_tile_exponent(f32(448.0 * 2.0 ** -13 * 1.01)) == 115


def test_v41_scaling_never_saturates():
    amax = torch.tensor([abs(v) for v in random_fp32(20000, 5, -20, 20)], dtype=torch.float32)
    e = quant_v41.v41_tile_exponent(amax)
    scaled = quant.ldexp(amax, 127 - e)
    assert float(scaled.max()) <= 448.0


def test_v41_fp4_scale_divides_by_six():
    """s = e4m3(clamp(a ⊘ 6, 2⁻⁹, 448)) with an IEEE division: at an amax whose quotient and
    reciprocal product straddle an e4m3 rounding midpoint, the scale follows the quotient."""
    one_sixth = f32(1.0 / 6.0)
    found = []
    for base in (1.0625, 1.1875, 3.25, 0.15625, 13.0, 26.0, 104.0):  # e4m3 midpoints
        for a in fp32_neighbours(f32(6.0 * base), 30):
            by_div, by_mul = f32(a / 6.0), f32(a * one_sixth)
            if (by_div >= base) != (by_mul >= base) or (by_div > base) != (by_mul > base):
                found.append(a)
    assert found, "no amax separating the two roundings"
    for a in found + [abs(v) for v in random_fp32(3000, 6, -15, 12)] + [0.0, 1e-9, 5000.0, 1e30]:
        code, scale = quant_v41.v41_fp4_scale(a)
        assert code == fp4_scale(a)
        assert scale == e4m3_value(code)
    assert quant_v41.v41_fp4_scale(0.0) == (0x01, 2.0 ** -9)
    assert quant_v41.v41_fp4_scale(1e6) == (0x7E, 448.0)


def test_fake_quant_fp4_16():
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(24, 64, generator=g) * torch.logspace(-6, 3, 24)[:, None]
    rows[0] = 0.0
    rows[1, :16] = torch.tensor([6.0, 0.75, -1.75, 3.5, 5.0, -0.25, 2.5, 1.25, -0.0, -1e-9, 0.0, 1e-9, 4.0, 3.0,
                                 -6.0, 0.5])  # amax 6: s = 1, the values on midpoints
    rows[2, :16] = -1e-30
    rows[2, 0] = 1.0
    got = quant_v41.fake_quant_fp4_16(rows)
    expected = torch.tensor([fake_quant_16(row) for row in rows.tolist()], dtype=torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))
    assert got[1, :16].tolist() == [6.0, 1.0, -2.0, 4.0, 4.0, -0.0, 2.0, 1.0, 0.0, -0.0, 0.0, 0.0, 4.0, 3.0, -6.0, 0.5]
    assert math.copysign(1, got[1, 8].item()) == 1 and math.copysign(1, got[1, 9].item()) == -1  # −0 → +0
    assert torch.equal(got, got.bfloat16().float())  # bf16-exact


# ------------------------------------------------------------------------------------------ row codecs

@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, 512, generator=g) * torch.logspace(-5, 4, 12)[:, None]
    x[0] = 0.0
    x[1, 100:140] = -0.0
    x[2, 448:] = 1e-12
    x[3, :32] = 1000.0  # uniform_fp8 saturates
    return x


def test_v41_row_encoder(rows):
    data, scales = quant_v41.encode_v41_rows(rows)
    expected = [v41_row(r) for r in rows.tolist()]
    assert data.tolist() == [d for d, _ in expected]
    assert scales.tolist() == [s for _, s in expected]
    assert scales.shape == (12, 16) and data.dtype == scales.dtype == torch.uint8


def test_v41_fp4_row_encoder(rows):
    data, scales = quant_v41.encode_v41_fp4_rows(rows)
    expected = [v41_fp4_row(r) for r in rows.tolist()]
    assert data.tolist() == [d for d, _ in expected]
    assert scales.tolist() == [s for _, s in expected]
    assert data.shape == (12, 256) and scales.shape == (12, 32)


def test_uniform_fp8_row_encoder(rows):
    data, scales = quant_v41.encode_uniform_fp8_rows(rows)
    assert data.tolist() == [uniform_fp8_row(r) for r in rows.tolist()]
    assert scales.shape == (12, 0)
    assert data[3, :32].tolist() == [0x7E] * 32


def test_decoders_give_the_value_of_each_code(rows):
    data, scales = quant_v41.encode_v41_rows(rows)
    got = quant_v41.decode_v41_rows(data, scales)
    for i in range(rows.shape[0]):
        for t in (0, 7, 15):
            e = int(scales[i, t])
            for j in range(32 * t, 32 * t + 32, 7):
                assert got[i, j].item() == math.ldexp(e4m3_value(int(data[i, j])), e - 127)
    data, scales = quant_v41.encode_v41_fp4_rows(rows)
    got = quant_v41.decode_v41_fp4_rows(data, scales)
    assert torch.equal(got, got.bfloat16().float())
    for i in range(rows.shape[0]):
        for j in range(0, 512, 5):
            code = (int(data[i, j // 2]) >> (4 * (j % 2))) & 0xF
            value = (-1 if code & 8 else 1) * E2M1_GRID[code & 7] * e4m3_value(int(scales[i, j // 16]))
            assert got[i, j].item() == value
    data, scales = quant_v41.encode_uniform_fp8_rows(rows)
    expected = [[e4m3_value(c) for c in r] for r in data.tolist()]
    assert quant_v41.decode_uniform_fp8_rows(data, scales).tolist() == expected


def test_fdiv_is_the_correctly_rounded_quotient():
    values = random_fp32(5000, 12, -60, 60)
    divisors = [abs(v) for v in random_fp32(5000, 13, -20, 20)]
    got = quant.fdiv(torch.tensor(values), torch.tensor(divisors)).tolist()
    assert got == [f32(a / b) for a, b in zip(values, divisors)]
    assert struct.pack("<f", quant.fdiv(-0.0, 6.0).item()) == struct.pack("<f", -0.0)
