"""Comparison of two engines' final states and caches (contract §9.6: the precision contract).

States are copies of input rows, so they must be bit-identical. Caches are compared per format:

* every byte outside the tokens that were stored (other slots, V4 scale byte 7, page padding)
  must be identical;
* every stored token must be written in both caches (its scale bytes, or its codes where a layout
  has no scale bytes, are never all zero);
* the dequantized values may differ only where an fp32 rounding tie flipped one code (the kernels
  pool with a fast exponential, so their fp32 rows differ from the reference by about an ulp):
  each difference is within one code step (plus a scale flip at a power-of-two boundary), and at
  most ``FLIP_FRACTION`` of the values differ at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import geometry
from ..kv_layout import KVLayout
from ..reference.layouts import read_layout
from ..reference.store import read_cache


def _addressing(fmt: str, page_size: int) -> tuple[int, int, int, int, int]:
    """(data stride, data bytes, scale base, scale stride, scale bytes) of a token in its page
    (contract §6.5, contract §10.1): the bytes the store writes; byte 7 of a V4 scale row is padding that no one
    writes."""
    if fmt in geometry.V41_FORMATS:
        layout = KVLayout(fmt)
        data_stride, scale_base, scale_stride = layout.row_addressing(page_size)
        return data_stride, layout.data_bytes, scale_base, scale_stride, layout.scale_bytes
    data, scales = geometry.token_bytes(fmt)
    return data, data, page_size * data, scales, geometry.written_bytes(fmt) - data


#: Largest share of stored values allowed to differ (a flipped scale moves a whole tile).
FLIP_FRACTION = {"v4_fp8": 5e-3, "indexer_fp8": 5e-3, "indexer_fp4": 2e-2, "v41": 5e-3, "v41_new": 5e-3,
                 "uniform_fp8": 5e-3, "v41_fp4": 2e-2, "v41_fp4_new": 2e-2}


@dataclass
class Check:
    layer: int
    compressor: str
    part: str  # "state" or "cache"
    ok: bool
    detail: str


def compare_state(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, str]:
    got = got.cpu().reshape(-1, got.shape[-1])
    want = want.cpu().reshape(-1, want.shape[-1])
    differ = (got.view(torch.int32) != want.view(torch.int32)).any(dim=1)
    if not bool(differ.any()):
        return True, f"bit-identical ({got.shape[0]} rows)"
    return False, f"{int(differ.sum())} of {got.shape[0]} rows differ (first row {int(differ.nonzero()[0])})"


def _span_index(fmt: str, page_size: int, page_bytes: int, locs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat byte indices of each stored token's data and scale bytes: ([n, data], [n, scale])."""
    data_stride, data_len, scale_base, scale_stride, scale_len = _addressing(fmt, page_size)
    page, slot = locs // page_size, locs % page_size
    base = page * page_bytes
    data = base[:, None] + (slot * data_stride)[:, None] + torch.arange(data_len)
    scale = base[:, None] + (scale_base + slot * scale_stride)[:, None] + torch.arange(scale_len)
    return data, scale


def _read(fmt: str, cache: torch.Tensor, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    if fmt in geometry.V41_FORMATS:
        return read_layout(cache, locs, page_size, fmt)
    return read_cache(fmt, cache, locs, page_size)


def _allowed_error(fmt: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One quantization step at each value (e4m3: 2^-3 relative plus the subnormal step; fp4: the
    grid's step), plus one bf16 ulp for the V4 rope dims; from the larger of the two values."""
    m = torch.maximum(a.abs(), b.abs())
    n = m.shape[0]
    if fmt in geometry.V41_FORMATS:  # every dim coded in tiles of one scale
        tile = KVLayout(fmt).tile_size
        amax = m.reshape(n, -1, tile).amax(-1, keepdim=True).expand(n, -1, tile).reshape(n, -1)
        if KVLayout(fmt).is_fp4:
            return 0.5 * m + amax / 3
        return 2.0 ** -3 * m + 2.0 ** -8 * amax.clamp_min(1e-4) / 448 + 2.0 ** -9
    if fmt == "indexer_fp4":
        amax = m.reshape(n, 4, 32).amax(-1, keepdim=True).expand(n, 4, 32).reshape(n, 128)
        return 0.5 * m + amax / 3
    if fmt == "indexer_fp8":
        amax = m.amax(-1, keepdim=True)
        return 2.0 ** -3 * m + 2.0 ** -8 * amax / 448 + 2.0 ** -20 * amax
    nope, rope = m[:, :448], m[:, 448:]
    tile_amax = nope.reshape(n, 7, 64).amax(-1, keepdim=True).expand(n, 7, 64).reshape(n, 448)
    nope_bound = 2.0 ** -3 * nope + 2.0 ** -8 * tile_amax.clamp_min(1e-4) / 448
    rope_bound = 2.0 ** -7 * rope + 2.0 ** -20 * rope.amax(-1, keepdim=True)
    return torch.cat([nope_bound, rope_bound], dim=1)


def compare_cache(fmt: str, page_size: int, got: torch.Tensor, want: torch.Tensor,
                  locs: torch.Tensor) -> tuple[bool, str]:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return False, f"cache shapes differ: {list(got.shape)} vs {list(want.shape)}"
    locs = torch.unique(locs.cpu().to(torch.int64))
    data, scale = _span_index(fmt, page_size, got.shape[1], locs)
    flat_got, flat_want = got.reshape(-1), want.reshape(-1)
    owned = torch.zeros_like(flat_got, dtype=torch.bool)
    owned[data.reshape(-1)] = True
    owned[scale.reshape(-1)] = True
    outside = int((flat_got != flat_want)[~owned].sum())
    if outside:
        return False, f"{outside} bytes outside the {len(locs)} stored tokens differ"
    written = scale if scale.shape[1] else data  # uniform_fp8 has no scale bytes
    for name, cache in (("kernel", flat_got), ("reference", flat_want)):
        unwritten = int((cache[written] == 0).all(dim=1).sum())
        if unwritten:
            return False, f"{unwritten} of {len(locs)} tokens were never stored in the {name} cache"
    if not len(locs):
        return True, "no tokens stored"
    a = _read(fmt, got, locs, page_size).to(torch.float64)
    b = _read(fmt, want, locs, page_size).to(torch.float64)
    err = (a - b).abs()
    if not bool(torch.isfinite(a).all()):
        return False, "non-finite values in the cache"
    beyond = err > _allowed_error(fmt, a, b)
    if bool(beyond.any()):
        t, d = beyond.nonzero()[0].tolist()
        return False, (f"{int(beyond.sum())} values beyond one quantization step; first: token {t} dim {d}: "
                       f"{float(a[t, d]):.6g} vs reference {float(b[t, d]):.6g}")
    differ = int((err > 0).sum())
    allowed = max(1, int(FLIP_FRACTION[fmt] * err.numel()))
    if differ > allowed:
        return False, f"{differ} of {err.numel()} values differ (at most {allowed} rounding ties allowed)"
    if differ:
        return True, f"{len(locs)} tokens; {differ} of {err.numel()} values off by one step (rounding ties)"
    return True, f"{len(locs)} tokens; byte-identical"


def compare_engines(got, want, stored: dict[int, torch.Tensor]) -> list[Check]:
    """Checks of every compressor: `got` (the engine under test) against `want` (the reference)."""
    checks = []
    for (layer, comp), (_, ref) in zip(got.compressors(), want.compressors()):
        spec = comp.spec
        checks.append(Check(layer, spec.name, "state", *compare_state(comp.state, ref.state)))
        checks.append(Check(layer, spec.name, "cache",
                            *compare_cache(spec.store, spec.page_size, comp.cache, ref.cache, stored[spec.ratio])))
    return checks
