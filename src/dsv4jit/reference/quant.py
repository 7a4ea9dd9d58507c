"""Scalar codecs of the compressed KV cache (contract §6.4, contract §6.6), in plain torch on fp32 values.

* UE8M0: an 8-bit biased exponent ``e``; the scale it stands for is ``2^(e-127)``. Scales are rounded
  **up** to a power of two so that ``x / scale`` never leaves the quantizer's range.
* e4m3 (OCP FP8 "e4m3fn"): bias 7, 3 mantissa bits, no infinities, max 448, code 0x7F/0xFF = NaN.
  Encoding is round-to-nearest-even with saturation to ±448 (``cvt.rn.satfinite``).
* fp4 (e2m1 values {0, .5, 1, 1.5, 2, 3, 4, 6}) with the reference's *threshold* rounding: ties go to
  the smaller magnitude and a negative value that rounds to zero is stored as +0.

Power-of-two scalings are done exactly by building the factor from its exponent bits (never through
``pow``/``exp2`` approximations), so ``x * 2^k`` is the correctly rounded fp32 product.
"""

from __future__ import annotations

import math

import torch

from ..errors import ArgumentError

E4M3_MAX = 448.0
#: amax floor of every UE8M0 / fp32-scale quantizer (contract §6.6): an all-zero tile keeps a finite, tiny scale.
AMAX_FLOOR = 1e-4
#: UE8M0 bias: the exponent byte ``e`` encodes ``2^(e - 127)``.
UE8M0_BIAS = 127
#: fp4 decision thresholds: the code index is the number of thresholds strictly below ``min(|u|, 6)``.
FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: fp4 magnitudes by code index 0..7.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 value of ``bf16(x)`` (round to nearest even), i.e. ``f32(bf16(x))``."""
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2^k`` as fp64 for integer ``k`` in [-1022, 1023] (built from the exponent bits)."""
    k = torch.as_tensor(k).to(torch.int64)
    if bool(((k < -1022) | (k > 1023)).any()):
        raise ArgumentError("pow2: exponent out of the fp64 normal range")
    return ((k + 1023) << 52).view(torch.float64)


def ldexp(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """fp32 ``x · 2^k``, correctly rounded (exact unless it under/overflows fp32).

    The product is formed in fp64, where it is exact, then rounded once to fp32: the same result as an
    fp32 multiply by an exactly representable ``2^k``.
    """
    return (x.to(torch.float64) * pow2(k)).to(torch.float32)


def floored(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-4)`` in fp32."""
    return torch.maximum(amax, torch.tensor(AMAX_FLOOR, dtype=torch.float32))


def fdiv(a, b) -> torch.Tensor:
    """IEEE fp32 ``a / b``, round to nearest even: the quotient of the fp32 operands is formed in fp64 and
    rounded once, which is the correctly rounded fp32 quotient (fp64 has more than 2·24 + 2 bits), whatever
    division the device would use (CUDA's torch divides by a scalar through its reciprocal)."""
    a = torch.as_tensor(a, dtype=torch.float32).to(torch.float64)
    b = torch.as_tensor(b, dtype=torch.float32).to(torch.float64)
    return (a / b).to(torch.float32)


# ---------------------------------------------------------------------------------------------- UE8M0

def ue8m0_exponent(scale_raw):
    """UE8M0 exponent of ``scale_raw`` rounded **up** to a power of two (contract §6.6).

    ``e = biased_exponent(scale_raw) + (mantissa(scale_raw) != 0)``, so ``2^(e-127) >= scale_raw``.
    ``scale_raw`` must be positive (callers floor amax at 1e-4 first). Tensor in → int64 tensor out;
    a Python float in → an int out.
    """
    scalar = not isinstance(scale_raw, torch.Tensor)
    s = torch.as_tensor(scale_raw, dtype=torch.float32)
    bits = s.contiguous().view(torch.int32).to(torch.int64)
    biased = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    e = (biased + (mantissa != 0).to(torch.int64)).clamp(max=255)
    return int(e) if scalar else e


def ue8m0_scale(e: torch.Tensor) -> torch.Tensor:
    """fp32 scale ``2^(e-127)`` of a UE8M0 exponent byte (uint8 or integer tensor)."""
    e = torch.as_tensor(e).to(torch.int64)
    return pow2(e - UE8M0_BIAS).to(torch.float32)


# ----------------------------------------------------------------------------------------------- e4m3

def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) of fp32 ``x``: round-to-nearest-even, saturating finite values to ±448.

    NaN maps to 0x7F (with the sign bit of the input). The sign of zero is kept (``-0 → 0x80``), as the
    hardware conversion does.
    """
    x = x.to(torch.float32)
    sign = torch.signbit(x).to(torch.int64) << 7
    a = x.abs().clamp(max=E4M3_MAX)  # satfinite; NaN stays NaN
    nan = torch.isnan(a)
    a = torch.where(nan, torch.zeros_like(a), a)
    # Binade of a: a = m·2^ex with m in [0.5, 1), so floor(log2 a) = ex - 1. Below the smallest
    # normal (2^-6) the spacing is fixed at 2^-9 (subnormals).
    _, ex = torch.frexp(a)
    binade = torch.where(a < 2.0 ** -6, torch.full_like(ex, -6), ex - 1).to(torch.int64)
    step = binade - 3  # 3 mantissa bits
    # a / 2^step is exact; torch.round is round-half-to-even.
    n = torch.round(ldexp(a, -step)).to(torch.int64)
    # Normal code: (biased exponent << 3) | mantissa, with n in [8, 16]; n == 16 (rounded up into the
    # next binade) carries into the exponent field by itself. Subnormals: binade -6 gives code n.
    code = ((binade + 7) << 3) + n - 8
    code = torch.where(nan, torch.full_like(code, 0x7F), code)
    return (code | sign).to(torch.uint8)


def e4m3_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3 codes (uint8); 0x7F/0xFF decode to NaN."""
    c = code.to(torch.int64)
    negative = (c >> 7) & 1
    exponent = (c >> 3) & 0xF
    mantissa = c & 0x7
    subnormal = mantissa.to(torch.float64) * 2.0 ** -9
    normal = (8 + mantissa).to(torch.float64) * pow2(exponent - 10)
    v = torch.where(exponent == 0, subnormal, normal)
    v = torch.where((exponent == 0xF) & (mantissa == 0x7), torch.full_like(v, math.nan), v)
    v = torch.where(negative == 1, -v, v)
    return v.to(torch.float32)


# ------------------------------------------------------------------------------------------------ fp4

def fp4_encode(u: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 in 0..15) of already-scaled fp32 values ``u`` (contract §6.6).

    ``idx`` = number of thresholds strictly below ``min(|u|, 6)`` (a value equal to a threshold takes
    the smaller code); bit 8 is the sign, set only for ``u < 0`` with ``idx != 0`` (no -0).
    """
    u = u.to(torch.float32)
    mag = u.abs().clamp(max=FP4_MAX)
    idx = torch.zeros(u.shape, dtype=torch.int64, device=u.device)
    for t in FP4_THRESHOLDS:
        idx += (mag > t).to(torch.int64)
    negative = (u < 0) & (idx != 0)
    return (idx | (negative.to(torch.int64) << 3)).to(torch.uint8)


def fp4_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit codes (uint8 in 0..15)."""
    c = code.to(torch.int64)
    mag = torch.tensor(FP4_VALUES, dtype=torch.float32)[c & 0x7]
    return torch.where((c & 0x8) != 0, -mag, mag)


# ------------------------------------------------------------------------------------------- Hadamard

def hadamard_matrix(n: int = 128) -> torch.Tensor:
    """Unscaled ±1 Walsh–Hadamard matrix in natural (Sylvester) order: ``H[i, j] = (-1)^popcount(i & j)``."""
    if n <= 0 or n & (n - 1):
        raise ArgumentError(f"hadamard_matrix: n must be a power of two, got {n}")
    i = torch.arange(n, dtype=torch.int64)
    parity = i[:, None] & i[None, :]
    bit_sum = torch.zeros_like(parity)
    for b in range(n.bit_length()):
        bit_sum += (parity >> b) & 1
    return 1.0 - 2.0 * (bit_sum & 1).to(torch.float64)


def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """128-point Walsh–Hadamard transform of the last dim, scaled by 1/sqrt(128) (contract §6.4), fp32.

    ``v'_i = 128^(-1/2) · Σ_j (-1)^popcount(i & j) v_j``. Evaluated in fp64 and rounded once, so it is
    the exact transform to fp32 precision (a kernel's fp32 butterfly may differ in the last ulp).
    """
    if x.shape[-1] != 128:
        raise ArgumentError(f"hadamard128: last dim must be 128, got {x.shape[-1]}")
    h = hadamard_matrix(128)
    return ((x.to(torch.float64) @ h) / math.sqrt(128.0)).to(torch.float32)
