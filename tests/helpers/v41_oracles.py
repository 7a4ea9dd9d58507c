"""Independent formulations of the DeepSeek-V4.1 codecs for the reference
tests: scalar Python over fp32 values, CUDA's own e2m1 conversion algorithm, torch's float8 cast and
exact rational arithmetic, none of which the code under test uses."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def f32(x: float) -> float:
    """x rounded to fp32 (round to nearest even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def cuda_e2m1(x: float) -> int:
    """e2m1 code of a double, as cuda_fp4.hpp's ``__nv_cvt_double_to_fp4`` computes it (round to nearest
    even, satfinite, NaN -> +max)."""
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    sign = (bits >> 63) << 3
    exp = (((bits >> 52) & 0x7FF) - 1023 + 1) & 0xFF
    mantissa = (bits >> 51) & 1
    absx = bits & 0x7FFF_FFFF_FFFF_FFFF
    half_ulp = 1 << 50
    if absx <= 0x3FD0_0000_0000_0000:        # <= 2^-2: zero (signed)
        res = 0
    elif absx > 0x4018_0000_0000_0000:      # > 6: saturate; NaN loses its sign
        if absx > 0x7FF0_0000_0000_0000:
            sign = 0
        res = 7
    elif absx >= 0x3FF0_0000_0000_0000:     # normal: [1, 6]
        res = (exp << 1) | mantissa
        rounded_off = bits & ((half_ulp << 1) - 1)
        if rounded_off > half_ulp or (rounded_off == half_ulp and mantissa & 1):
            res += 1
    else:                                   # denormal: (2^-2, 1)
        shift = (1 - exp) & 0xFF
        res = (mantissa | 2) >> shift
        rounded_off = (bits | (1 << 52)) & ((half_ulp << (shift + 1)) - 1)
        if rounded_off > (half_ulp << shift) or (rounded_off == (half_ulp << shift) and res & 1):
            res += 1
    return res | sign


def e2m1_value(code: int) -> float:
    return -E2M1_GRID[code & 7] if code & 8 else E2M1_GRID[code & 7]


def torch_e4m3(x: float) -> int:
    """e4m3fn byte of an fp32 value in [-448, 448] by torch's own cast."""
    return int(torch.tensor([x], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


def e4m3_value(code: int) -> float:
    return float(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32))


def ceil_log2(q: Fraction) -> int:
    """The least k with 2^k >= q > 0."""
    k = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** k < q:
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return k


def v41_exponent(amax: float) -> int:
    """127 + ceil(log2(max(amax / 448, 1e-4))), the quotient exact."""
    return 127 + ceil_log2(max(Fraction(amax) / 448, Fraction(1, 10000)))


def fp4_scale(amax: float) -> int:
    """The v41_fp4 scale byte: e4m3(clamp(fl(amax / 6), 2^-9, 448))."""
    return torch_e4m3(min(max(f32(amax / 6.0), 2.0 ** -9), 448.0))


def v41_row(values: list[float]) -> tuple[list[int], list[int]]:
    """(data bytes, scale bytes) of one v41 row."""
    data, scales = [], []
    for t in range(0, len(values), 32):
        tile = values[t:t + 32]
        e = v41_exponent(max(abs(v) for v in tile))
        scales.append(e)
        data += [torch_e4m3(math.ldexp(v, 127 - e)) for v in tile]
    return data, scales


def v41_fp4_row(values: list[float]) -> tuple[list[int], list[int]]:
    """(data bytes, scale bytes) of one v41_fp4 row: dim 2j in the low nibble of byte j."""
    codes, scales = [], []
    for t in range(0, len(values), 16):
        tile = values[t:t + 16]
        scale_byte = fp4_scale(max(abs(v) for v in tile))
        scales.append(scale_byte)
        s = e4m3_value(scale_byte)
        codes += [cuda_e2m1(f32(v / s)) for v in tile]
    return [codes[j] | (codes[j + 1] << 4) for j in range(0, len(codes), 2)], scales


def uniform_fp8_row(values: list[float]) -> list[int]:
    return [torch_e4m3(min(max(v, -448.0), 448.0)) for v in values]


def fake_quant_16(values: list[float]) -> list[float]:
    """The compressed-KV fp4 fake quant of one row: s = e4m3(clamp(fl(a · fl(1/6)), 2^-9, 448)), u = fl(v / s) + 0.0,
    grid(e2m1rn(u)) · s."""
    one_sixth = f32(1.0 / 6.0)
    out = []
    for t in range(0, len(values), 16):
        block = values[t:t + 16]
        s = e4m3_value(torch_e4m3(min(max(f32(max(abs(v) for v in block) * one_sixth), 2.0 ** -9), 448.0)))
        out += [e2m1_value(cuda_e2m1(f32(v / s) + 0.0)) * s for v in block]
    return out


def interleave(page: torch.Tensor, page_size: int, data_bytes: int, scale_bytes: int) -> torch.Tensor:
    """A block-split page (data rows, then scale rows) rearranged to the interleaved one (each token's
    data then its scales), as sglang's test converter does."""
    data = page[:page_size * data_bytes].reshape(page_size, data_bytes)
    scales = page[page_size * data_bytes:page_size * (data_bytes + scale_bytes)].reshape(page_size, scale_bytes)
    return torch.cat([data, scales], dim=1).reshape(-1)
