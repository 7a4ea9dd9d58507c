"""The codecs DeepSeek-V4.1 adds (contract §10.2), in plain torch on fp32 values, exact.

* e2m1 with **round to nearest, ties to the even code** (the hardware ``cvt.rn.satfinite.e2m1x2.f32``),
  not the threshold rule of the V4 indexer (``quant.fp4_encode``); the sign bit is kept for −0.
* ``v41``: e4m3 values, one UE8M0 exponent per 32 values, ``e = max(E − 8 + (M > 0x600000), 114)``.
* ``v41_fp4``: e2m1 values two per byte, one e4m3 scale per 16 values, ``s = e4m3(clamp(a ⊘ 6, 2⁻⁹, 448))``.
* ``uniform_fp8``: e4m3 of ``clamp(v, ±448)``, no stored scale.
* The compressed-KV fp4 fake quant of the ratio-1/2 compressors (16-value blocks, contract §10.4).

Row codecs take ``[n, 512]`` fp32 rows and give ``(data, scales)`` uint8 ``[n, data_bytes]``,
``[n, scale_bytes]`` of one layout encoding (the ``_new`` layouts use their base encoding's); the
decoders invert them exactly (the dequantized value of each code).
"""

from __future__ import annotations

import torch

from ..kv_layout import KVLayout
from .quant import E4M3_MAX, FP4_MAX, UE8M0_BIAS, e4m3_decode, e4m3_encode, fdiv, fp4_decode, ldexp, ue8m0_scale

#: Midpoints between consecutive e2m1 magnitudes (codes k and k + 1 for the k-th entry).
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
#: The V41 exponent floor: 127 + ceil(log2(1e-4)) (2⁻¹³ is the least power of two >= 1e-4).
V41_MIN_EXPONENT = 114
#: The least fp4 tile scale, the smallest e4m3 subnormal.
FP4_MIN_SCALE = 2.0 ** -9
#: fl(1/6), the fp32 reciprocal the fake quant multiplies by.
FP32_ONE_SIXTH = torch.tensor(1.0 / 6.0, dtype=torch.float32)
#: Values per fake-quant block (ratio-1/2 compressors).
FAKE_QUANT_BLOCK = 16


# ------------------------------------------------------------------------------------------------ e2m1

def e2m1rn_encode(u) -> torch.Tensor:
    """e2m1 codes (uint8 in 0..15) of fp32 ``u``: round to nearest, ties to the even code.

    Magnitudes by code 0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; ties go to the even code (0.25 → 0, 0.75 → 1.0,
    1.25 → 1.0, 1.75 → 2.0, 2.5 → 2.0, 3.5 → 4.0, 5 → 4.0); magnitudes above 6 and +inf saturate to 6.
    Bit 3 is the fp32 sign bit, kept when the magnitude rounds to 0 (−0.0 and tiny negatives give 0x8).
    NaN gives 0x7 (+6), the rule of CUDA's own conversion (contract §10.2).
    """
    u = torch.as_tensor(u, dtype=torch.float32)
    mag = u.abs()
    idx = torch.zeros_like(u, dtype=torch.int64)
    for k, mid in enumerate(E2M1_MIDPOINTS):
        # On a midpoint, an odd lower code k goes up to the even k + 1.
        idx += ((mag >= mid) if k % 2 else (mag > mid)).to(torch.int64)
    nan = torch.isnan(u)
    idx = torch.where(nan, torch.full_like(idx, 7), idx)
    sign = torch.signbit(u) & ~nan
    return (idx | (sign.to(torch.int64) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (uint8 in 0..15), sign included (0x8 is −0.0)."""
    return fp4_decode(codes)


# ---------------------------------------------------------------------------------------------- scales

def v41_tile_exponent(amax):
    """UE8M0 exponent of a ``v41`` tile of max magnitude ``amax`` (fp32, >= 0), from its bits:
    ``e = max(E − 8 + (M > 0x600000), 114)`` with ``E``, ``M`` the biased exponent and mantissa of
    ``amax``; equal to ``127 + ceil(log2(max(amax / 448, 1e-4)))`` with an exact quotient (contract §10.2).
    Tensor in → int64 tensor out; a Python float in → an int out."""
    scalar = not isinstance(amax, torch.Tensor)
    bits = torch.as_tensor(amax, dtype=torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    e = ((bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int64)).clamp(min=V41_MIN_EXPONENT)
    return int(e) if scalar else e


def v41_fp4_scale(amax):
    """``(code, scale)`` of a ``v41_fp4`` tile of max magnitude ``amax``: the e4m3 byte of
    ``s = e4m3(clamp(amax ⊘ 6, 2⁻⁹, 448))`` (an IEEE fp32 division, not a reciprocal multiply) and the
    fp32 value of ``s``. Tensor in → (uint8, fp32) tensors out; a Python float in → (int, float)."""
    scalar = not isinstance(amax, torch.Tensor)
    code = e4m3_encode(fdiv(amax, FP4_MAX).clamp(FP4_MIN_SCALE, E4M3_MAX))
    scale = e4m3_decode(code)
    return (int(code), float(scale)) if scalar else (code, scale)


def fake_quant_fp4_16(v: torch.Tensor) -> torch.Tensor:
    """The compressed-KV fp4 fake quant of the ratio-1/2 compressors, fp32 ``[..., D]`` (contract §10.4).

    Per block of 16 values with max magnitude ``a``: ``s = e4m3(clamp(a ⊗ fl(1/6), 2⁻⁹, 448))`` (an fp32
    multiply by the rounded reciprocal, unlike the ``v41_fp4`` encoder), ``u = (v ⊘ s) + 0.0`` (the ``+0``
    turns an exact −0 into +0; a tiny negative stays negative), result ``grid(e2m1rn(u)) · s`` (exact,
    bf16-representable; a tiny negative gives −0.0).
    """
    v = v.to(torch.float32)
    blocks = v.reshape(*v.shape[:-1], -1, FAKE_QUANT_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = e4m3_decode(e4m3_encode((amax * FP32_ONE_SIXTH).clamp(FP4_MIN_SCALE, E4M3_MAX)))
    u = fdiv(blocks, scale) + 0.0
    return (e2m1_decode(e2m1rn_encode(u)) * scale).reshape(v.shape)


# ------------------------------------------------------------------------------------------ row codecs

def _tiles(values: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    values = values.to(torch.float32)
    return values.reshape(values.shape[0], -1, layout.tile_size)


def encode_v41_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v41``: data byte ``i`` = ``e4m3(v_i ⊗ 2^(127 − e_t))``, scale byte ``t`` = ``e_t`` of 32-value tile
    ``t`` (rope dims included; never saturates)."""
    tiles = _tiles(values, KVLayout.V41)
    e = v41_tile_exponent(tiles.abs().amax(-1))
    codes = e4m3_encode(ldexp(tiles, (UE8M0_BIAS - e)[..., None]))
    return codes.reshape(tiles.shape[0], -1), e.to(torch.uint8)


def decode_v41_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 rows of ``v41`` bytes: ``e4m3_value · 2^(e_t − 127)``."""
    n = data.shape[0]
    tiles = e4m3_decode(data).reshape(n, scales.shape[1], -1)
    return (tiles * ue8m0_scale(scales)[..., None]).reshape(n, -1)


def encode_v41_fp4_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v41_fp4``: per 16-value tile the scale byte of ``v41_fp4_scale``; codes ``e2m1rn(v_i ⊘ s_t)``
    (an IEEE division per element by the stored scale), dim ``2j`` in the low nibble of data byte ``j``."""
    tiles = _tiles(values, KVLayout.V41_FP4)
    code, scale = v41_fp4_scale(tiles.abs().amax(-1))
    values_codes = e2m1rn_encode(fdiv(tiles, scale[..., None])).reshape(tiles.shape[0], -1)
    return values_codes[:, 0::2] | (values_codes[:, 1::2] << 4), code


def decode_v41_fp4_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 rows of ``v41_fp4`` bytes: ``grid(code) · s_t``."""
    n = data.shape[0]
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(n, scales.shape[1], -1)
    return (e2m1_decode(codes) * e4m3_decode(scales)[..., None]).reshape(n, -1)


def encode_uniform_fp8_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``uniform_fp8``: data byte ``i`` = ``e4m3(clamp(v_i, ±448))``; no scale bytes."""
    values = values.to(torch.float32)
    codes = e4m3_encode(values.clamp(-E4M3_MAX, E4M3_MAX))
    return codes, torch.empty(values.shape[0], 0, dtype=torch.uint8)


def decode_uniform_fp8_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 rows of ``uniform_fp8`` bytes (unit scale)."""
    return e4m3_decode(data)


#: encoding -> (row encoder, row decoder) of the V4.1 encodings.
ROW_CODECS = {
    KVLayout.V41: (encode_v41_rows, decode_v41_rows),
    KVLayout.V41_FP4: (encode_v41_fp4_rows, decode_v41_fp4_rows),
    KVLayout.UNIFORM_FP8: (encode_uniform_fp8_rows, decode_uniform_fp8_rows),
}
