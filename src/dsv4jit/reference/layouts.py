"""Paged writers and readers of the KV layouts (contract §10.1; ``v4`` is contract §6.7) and of the
V4 two-pool store (``fp8_2buff``, contract §10.3), for ``[n, 512]`` fp32 rows.

``write_layout`` encodes each row with its layout's row codec (``v4`` below, the V4.1 ones in
``quant_v41``) and scatters its data and scale bytes to the slot's addresses (``KVLayout.row_addressing``:
block-split or interleaved). A writer touches exactly the bytes a token owns: page padding and the
8th ``v4`` scale byte are never written. Readers dequantize (the value of each stored code).
"""

from __future__ import annotations

import torch

from ..errors import ArgumentError
from ..geometry import ROPE_DIM, V4_HEAD_DIM, V4_NOPE_DIM, V4_TILE, page_bytes
from ..kv_layout import KVLayout
from .paging import as_rows, check_cache, gather, page_slot, scatter
from .quant import (E4M3_MAX, UE8M0_BIAS, bf16_round, e4m3_decode, e4m3_encode, floored, ldexp, ue8m0_exponent,
                    ue8m0_scale)
from .quant_v41 import ROW_CODECS

#: UE8M0 exponents of a V4 latent: one per 64-value nope tile.
V4_EXPONENTS = V4_NOPE_DIM // V4_TILE
#: Bytes of a token's row in the two-pool store's fp8 pool, and of its row in the rope pool.
TWO_POOL_ROW_BYTES = 512
TWO_POOL_ROPE_BYTES = 2 * ROPE_DIM


# ------------------------------------------------------------------------------------ v4 latent

def v4_nope_codes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes uint8 [n, 448], UE8M0 exponents int64 [n, 7]) of the nope dims of rows [n, 512]:
    each value rounded to bf16 first, then one round-up power-of-two scale per 64-value tile,
    ``e = ue8m0(max(amax, 1e-4) / 448)`` (contract §6.7)."""
    n = values.shape[0]
    nope = bf16_round(values[:, :V4_NOPE_DIM]).reshape(n, -1, V4_TILE)
    e = ue8m0_exponent(floored(nope.abs().amax(-1)) / E4M3_MAX)
    scaled = ldexp(nope, (UE8M0_BIAS - e)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    return e4m3_encode(scaled).reshape(n, V4_NOPE_DIM), e


def decode_v4_nope(codes: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    n = codes.shape[0]
    return (e4m3_decode(codes).reshape(n, -1, V4_TILE) * ue8m0_scale(e)[..., None]).reshape(n, V4_NOPE_DIM)


def bf16_bytes(values: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 2·d] of fp32 [n, d] rounded once to bf16."""
    return values.to(torch.bfloat16).contiguous().view(torch.uint8)


def from_bf16_bytes(data: torch.Tensor) -> torch.Tensor:
    return data.contiguous().view(torch.bfloat16).to(torch.float32)


def encode_v4_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v4``: data = 448 e4m3 nope codes + the 64 rope dims as bf16 (once rounded); scales = the 7
    exponents (the 8th scale byte is padding, not part of what a token writes)."""
    codes, e = v4_nope_codes(values)
    return torch.cat([codes, bf16_bytes(values[:, V4_NOPE_DIM:])], dim=1), e.to(torch.uint8)


def decode_v4_rows(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    nope = decode_v4_nope(data[:, :V4_NOPE_DIM], scales[:, :V4_EXPONENTS])
    return torch.cat([nope, from_bf16_bytes(data[:, V4_NOPE_DIM:])], dim=1)


_ROW_CODECS = {KVLayout.V4: (encode_v4_rows, decode_v4_rows), **ROW_CODECS}


# -------------------------------------------------------------------------------- every layout

def page_width(page_size: int, layout: KVLayout = KVLayout.V4, fmt: str = "v4_fp8",
               fp8_2buff: bool = False) -> tuple[int, str]:
    """The bytes of a cache row a store writes and how they come about, for messages: a page of
    ``fp8_2buff``'s fp8 pool, a V4.1 layout's page, else a page of the V4 format ``fmt``."""
    if fp8_2buff:
        return TWO_POOL_ROW_BYTES * page_size, f"512 * page_size ({page_size}) (fp8_2buff)"
    if layout is not KVLayout.V4:
        return layout.page_bytes(page_size), f"page_bytes({layout.value!r}, {page_size})"
    return page_bytes(fmt, page_size), f"page_bytes({fmt!r}, {page_size})"


def check_layout_cache(kvcache: torch.Tensor, page_size: int, layout: KVLayout, name: str = "kvcache") -> None:
    """Raise unless ``kvcache`` is 2-D uint8 with rows of ``layout.page_bytes(page_size)`` bytes."""
    width, formula = page_width(page_size, layout)
    check_cache(kvcache, width, formula, name)


def token_addresses(kvcache: torch.Tensor, locs, page_size: int, layout: KVLayout, name: str = "out_loc"):
    """(page, data offset, scale offset) of each location's token, after the checks."""
    check_layout_cache(kvcache, page_size, layout)
    page, slot = page_slot(kvcache, locs, page_size, name)
    data_stride, scale_base, scale_stride = layout.row_addressing(page_size)
    return page, slot * data_stride, scale_base + slot * scale_stride


def write_layout(kvcache: torch.Tensor, locs, values: torch.Tensor, page_size: int, layout) -> None:
    """Store rows ``values [n, 512]`` (fp32) at ``locs`` in ``layout`` (a KVLayout or its name)."""
    layout = KVLayout.parse(layout)
    values = as_rows(values, V4_HEAD_DIM)
    page, data_at, scales_at = token_addresses(kvcache, locs, page_size, layout)
    encode, _ = _ROW_CODECS[layout.encoding]
    data, scales = encode(values)
    scatter(kvcache, page, data_at, data)
    if scales.shape[1]:
        scatter(kvcache, page, scales_at, scales)


def read_layout(kvcache: torch.Tensor, locs, page_size: int, layout) -> torch.Tensor:
    """Dequantized fp32 ``[n, 512]`` rows at ``locs`` of a cache in ``layout``."""
    layout = KVLayout.parse(layout)
    page, data_at, scales_at = token_addresses(kvcache, locs, page_size, layout)
    _, decode = _ROW_CODECS[layout.encoding]
    return decode(gather(kvcache, page, data_at, layout.data_bytes),
                  gather(kvcache, page, scales_at, layout.scale_bytes))


def write_v4(kvcache: torch.Tensor, locs, values: torch.Tensor, page_size: int) -> None:
    """Store normed+rotated rows ``values [n, 512]`` in the V4 fp8 latent layout (contract §6.7)."""
    write_layout(kvcache, locs, values, page_size, KVLayout.V4)


def read_v4(kvcache: torch.Tensor, locs, page_size: int) -> torch.Tensor:
    """Dequantized fp32 ``[n, 512]`` rows of a V4 fp8 latent cache."""
    return read_layout(kvcache, locs, page_size, KVLayout.V4)


# ------------------------------------------------------------------------------ V4 two-pool store

def write_v4_2buff(kvcache: torch.Tensor, kvcache_rope: torch.Tensor, locs, values: torch.Tensor,
                   page_size: int) -> None:
    """Store rows ``values [n, 512]`` in the V4 two-pool store (``fp8_2buff``): token ``loc``'s 512-byte
    row of ``kvcache`` holds the nope codes of the V4 latent (bytes 0-447) and its 7 exponents, each
    written twice (bytes ``448 + 2t`` and ``449 + 2t``; bytes 462-511 are never written); row ``loc`` of
    ``kvcache_rope`` holds the 64 rope dims as bf16."""
    values = as_rows(values, V4_HEAD_DIM)
    page, slot = store_slots(kvcache, locs, page_size, fp8_2buff=True, kvcache_rope=kvcache_rope)
    codes, e = v4_nope_codes(values)
    row_at = slot * TWO_POOL_ROW_BYTES
    scatter(kvcache, page, row_at, codes)
    scatter(kvcache, page, row_at + V4_NOPE_DIM, e.to(torch.uint8).repeat_interleave(2, dim=1))
    rope_rows = page * page_size + slot
    scatter(kvcache_rope, rope_rows, torch.zeros_like(rope_rows), bf16_bytes(values[:, V4_NOPE_DIM:]))


def read_v4_2buff(kvcache: torch.Tensor, kvcache_rope: torch.Tensor, locs, page_size: int) -> torch.Tensor:
    """Dequantized fp32 ``[n, 512]`` rows of the V4 two-pool store (the first copy of each exponent)."""
    page, slot = store_slots(kvcache, locs, page_size, fp8_2buff=True, kvcache_rope=kvcache_rope)
    row_at = slot * TWO_POOL_ROW_BYTES
    codes = gather(kvcache, page, row_at, V4_NOPE_DIM)
    e = gather(kvcache, page, row_at + V4_NOPE_DIM, 2 * V4_EXPONENTS)[:, 0::2]
    rope_rows = page * page_size + slot
    rope = gather(kvcache_rope, rope_rows, torch.zeros_like(rope_rows), TWO_POOL_ROPE_BYTES)
    return torch.cat([decode_v4_nope(codes, e), from_bf16_bytes(rope)], dim=1)


# ------------------------------------------------------------------------------ a store's cache

def store_slots(kvcache: torch.Tensor, locs, page_size: int, *, layout: KVLayout = KVLayout.V4,
                fmt: str = "v4_fp8", fp8_2buff: bool = False, kvcache_rope: torch.Tensor | None = None):
    """(page, slot) of each location of ``locs`` a store writes, after checking that the cache has
    the pages it stores into (a V4.1 layout's pages, else those of the V4 format ``fmt``; with
    ``fp8_2buff`` the two pools: ``kvcache`` u8 ``[pages, 512·page_size]`` and ``kvcache_rope`` u8
    ``[pages·page_size, 128]``) and holds each location."""
    width, formula = page_width(page_size, layout, fmt, fp8_2buff)
    check_cache(kvcache, width, formula)
    if fp8_2buff:
        check_cache(kvcache_rope, TWO_POOL_ROPE_BYTES, "2 * 64 (the bf16 rope dims of a token)", "kvcache_rope")
        if kvcache_rope.shape[0] != kvcache.shape[0] * page_size:
            raise ArgumentError(f"kvcache_rope must have one row per slot of kvcache ({kvcache.shape[0]} pages of "
                                f"{page_size} = {kvcache.shape[0] * page_size}), got {kvcache_rope.shape[0]} rows")
    return page_slot(kvcache, locs, page_size)
