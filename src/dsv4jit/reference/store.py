"""Pure-torch reference of ``compress_norm_rope_store`` (contract §6) and readers of the caches it fills.

The op takes the compressed rows ``kv [N, hd]``, applies RMSNorm (contract §6.2) and RoPE on the last 64
dims (contract §6.3; plus the 128-point Hadamard for the indexer, contract §6.4), quantizes, and scatters
each processed row into a paged byte cache (contract §6.5). Formats:

* ``"v4_fp8"``      hd 512: V4 FlashMLA latent, 576 data bytes + 8 scale bytes per token (contract §6.7)
* ``"v4_bf16"``     hd 512: ``bf16_store``, 1024 bytes per token (contract §6.8)
* ``"indexer_fp8"`` hd 128: 128 e4m3 + one fp32 scale per token (contract §6.9)
* ``"indexer_fp4"`` hd 128: 64 packed fp4 bytes + 4 UE8M0 scales per token (contract §6.10)

A ``layout`` other than ``"v4"`` (a DeepSeek-V4.1 layout), or ``fp8_2buff`` (the V4 latent in two pools),
stores the 512-dim rows as contract §10.3 describes instead.

The byte geometry of each format (``page_bytes``, ``store_format``, the offsets) lives in
``dsv4jit.geometry``. The cache is a 2-D ``uint8`` tensor, one page per row. A location ``loc`` lives
in page ``loc >> log2(page_size)`` at slot ``loc & (page_size - 1)``. Writers touch exactly the bytes
contract §6.5 assigns to a token and nothing else (notably byte 7 of a V4 scale row stays as it was).

Everything is computed on the CPU; the cache may live on any device and is mutated in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..arguments import FLOAT_DTYPES, contiguous, distinct, dtype_in, finite
from ..errors import ArgumentError, ArgumentTypeError
from ..geometry import (
    BF16_TOKEN_BYTES,
    FORMATS,
    INDEXER_FP4_DATA_BYTES,
    INDEXER_FP4_GROUP,
    INDEXER_FP4_SCALE_BYTES,
    INDEXER_FP8_DATA_BYTES,
    INDEXER_FP8_SCALE_BYTES,
    INDEXER_HEAD_DIM,
    ROPE_DIM,
    V4_HEAD_DIM,
    check_page_size,
    check_ratio,
    store_format,
)
from ..kv_layout import KVLayout
from ..plan_layout import decode_compress_plan, decode_decode_plan
from .layouts import read_v4, store_slots, write_layout, write_v4, write_v4_2buff
from .paging import as_rows, gather, scatter
from .quant import (
    E4M3_MAX,
    FP4_MAX,
    UE8M0_BIAS,
    e4m3_decode,
    e4m3_encode,
    floored,
    fp4_decode,
    fp4_encode,
    hadamard128,
    ldexp,
    ue8m0_exponent,
    ue8m0_scale,
)


# ------------------------------------------------------------------------------- norm and rope

def freq_table(freq_cis: torch.Tensor) -> torch.Tensor:
    """fp32 ``[max_pos, rope_dim]`` table of interleaved ``(cos_k, sin_k)`` from complex ``[max_pos, rope_dim/2]``."""
    if not torch.is_complex(freq_cis) or freq_cis.dim() != 2:
        raise ArgumentTypeError(f"freq_cis must be a 2-D complex tensor, got {freq_cis.dim()}-D {freq_cis.dtype}")
    real = torch.view_as_real(freq_cis.detach().cpu().to(torch.complex64).contiguous())
    return real.flatten(1).contiguous()


def yarn_freq_cis(max_pos: int, *, theta: float = 40000.0, factor: float = 16.0, original: int = 65536,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """complex64 ``[max_pos, rope_dim/2]`` RoPE rotations (a ``freq_cis``, contract §6.3): pair k turns by
    ``theta^(-2k/rope_dim)`` per position. With ``max_pos > original`` they are YaRN-scaled: pairs that
    turn more than ``beta_fast`` times in ``original`` positions keep their frequency, those turning
    fewer than ``beta_slow`` times are divided by ``factor``, a linear ramp between. The defaults are
    DeepSeek-V4's compressed layers'."""
    freqs = 1.0 / theta ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float64) / ROPE_DIM)
    if max_pos > original:
        def dim_of(rotations: float) -> float:
            return ROPE_DIM * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(dim_of(beta_fast)), 0), min(math.ceil(dim_of(beta_slow)), ROPE_DIM - 1)
        ramp = ((torch.arange(ROPE_DIM // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def rms_norm(kv: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """RMSNorm of each row in fp32 (contract §6.2): ``y_d = (x_d · rsqrt(Σx²/hd + eps)) · w_d``."""
    x = kv.detach().cpu().to(torch.float32)
    w = norm_weight.detach().cpu().to(torch.float32)
    hd = x.shape[-1]
    # The sum of squares is accumulated in fp64 and rounded once (a kernel's fp32 reduction order
    # is unspecified); the rest follows the fp32 formula step by step.
    sum_sq = (x.to(torch.float64) ** 2).sum(-1, keepdim=True).to(torch.float32)
    mean_eps = sum_sq / hd + torch.tensor(norm_eps, dtype=torch.float32)
    r = torch.rsqrt(mean_eps.to(torch.float64)).to(torch.float32)
    return (x * r) * w


def _check_positions(positions, freq: torch.Tensor) -> torch.Tensor:
    positions = torch.as_tensor(positions).detach().cpu().to(torch.int64).reshape(-1)
    if positions.numel() and (bool((positions < 0).any()) or int(positions.max()) >= freq.shape[0]):
        raise ArgumentError(f"freq_cis: the RoPE positions of the stored rows (seq_len - compress_ratio) must lie in "
                            f"[0, {freq.shape[0]}) (its rows), "
                            f"got min {int(positions.min())} max {int(positions.max())}")
    return positions


def apply_rope(y: torch.Tensor, freq: torch.Tensor, positions: torch.Tensor, rope_dim: int = ROPE_DIM) -> torch.Tensor:
    """Rotate the trailing ``rope_dim`` dims of fp32 ``y`` (contract §6.3), interleaved (GPT-J) pairs.

    Pair k is dims ``(base + 2k, base + 2k + 1)`` as (re, im), rotated by ``freq[position, 2k:2k+2]``
    = (cos, sin): ``re' = re·cos − im·sin``, ``im' = re·sin + im·cos``, in fp32.
    """
    hd = y.shape[-1]
    base = hd - rope_dim
    if rope_dim % 2 or base < 0 or freq.shape[-1] != rope_dim:
        raise ArgumentError(f"rope_dim {rope_dim} does not fit head_dim {hd} / freq table {list(freq.shape)}")
    positions = _check_positions(positions, freq)
    f = freq.detach().cpu().to(torch.float32)[positions]
    cos, sin = f[:, 0::2], f[:, 1::2]
    out = y.clone()
    re, im = y[:, base::2], y[:, base + 1::2]
    out[:, base::2] = re * cos - im * sin
    out[:, base + 1::2] = re * sin + im * cos
    return out


def norm_rope(kv: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, freq: torch.Tensor,
              positions: torch.Tensor, rope_dim: int = ROPE_DIM) -> torch.Tensor:
    """RMSNorm then RoPE of rows ``kv [n, hd]`` at ``positions [n]``; fp32 ``[n, hd]`` (contract §6.2, contract §6.3).

    ``freq`` is the fp32 ``[max_pos, rope_dim]`` table of interleaved (cos, sin) (see ``freq_table``).
    """
    if kv.dim() != 2:
        raise ArgumentError(f"kv must be [n, hd], got {list(kv.shape)}")
    if norm_weight.shape != (kv.shape[1],):
        raise ArgumentError(f"norm_weight must be [{kv.shape[1]}], got {list(norm_weight.shape)}")
    return apply_rope(rms_norm(kv, norm_weight, norm_eps), freq, positions, rope_dim)


# ----------------------------------------------------------------------------------- bf16 store

def write_bf16(kvcache: torch.Tensor, locs: torch.Tensor, values: torch.Tensor, page_size: int = 1) -> None:
    """Store rows ``values [n, 512]`` as 512 bf16 each at ``loc · 1024`` bytes (contract §6.8)."""
    values = as_rows(values, V4_HEAD_DIM)
    page, slot = store_slots(kvcache, locs, page_size, fmt="v4_bf16")
    data = values.to(torch.bfloat16).contiguous().view(torch.uint8)
    scatter(kvcache, page, slot * BF16_TOKEN_BYTES, data)


def read_bf16(kvcache: torch.Tensor, locs: torch.Tensor, page_size: int = 1) -> torch.Tensor:
    """fp32 ``[n, 512]`` rows of a bf16_store cache."""
    page, slot = store_slots(kvcache, locs, page_size, fmt="v4_bf16")
    data = gather(kvcache, page, slot * BF16_TOKEN_BYTES, BF16_TOKEN_BYTES)
    return data.view(torch.bfloat16).to(torch.float32)


# --------------------------------------------------------------------------------- indexer fp8

def write_indexer_fp8(kvcache: torch.Tensor, locs: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
    """Store post-Hadamard rows ``values [n, 128]`` as e4m3 + one fp32 scale each (contract §6.9)."""
    values = as_rows(values, INDEXER_HEAD_DIM)
    page, slot = store_slots(kvcache, locs, page_size, fmt="indexer_fp8")
    # A plain fp32 scale (no power-of-two rounding); the quantizer multiplies by its reciprocal.
    scale = floored(values.abs().amax(-1, keepdim=True)) / E4M3_MAX
    inv_scale = 1.0 / scale
    codes = e4m3_encode((values * inv_scale).clamp(-E4M3_MAX, E4M3_MAX))
    scatter(kvcache, page, slot * INDEXER_FP8_DATA_BYTES, codes)
    scatter(kvcache, page, page_size * INDEXER_FP8_DATA_BYTES + slot * INDEXER_FP8_SCALE_BYTES,
             scale.contiguous().view(torch.uint8))


def read_indexer_fp8(kvcache: torch.Tensor, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantized fp32 ``[n, 128]`` rows of an indexer fp8 cache."""
    page, slot = store_slots(kvcache, locs, page_size, fmt="indexer_fp8")
    codes = gather(kvcache, page, slot * INDEXER_FP8_DATA_BYTES, INDEXER_FP8_DATA_BYTES)
    scale = gather(kvcache, page, page_size * INDEXER_FP8_DATA_BYTES + slot * INDEXER_FP8_SCALE_BYTES,
                    INDEXER_FP8_SCALE_BYTES).view(torch.float32)
    return e4m3_decode(codes) * scale


# --------------------------------------------------------------------------------- indexer fp4

def write_indexer_fp4(kvcache: torch.Tensor, locs: torch.Tensor, values: torch.Tensor, page_size: int) -> None:
    """Store post-Hadamard rows ``values [n, 128]`` as packed fp4 + 4 UE8M0 scales each (contract §6.10)."""
    values = as_rows(values, INDEXER_HEAD_DIM)
    page, slot = store_slots(kvcache, locs, page_size, fmt="indexer_fp4")
    n = values.shape[0]
    groups = values.reshape(n, -1, INDEXER_FP4_GROUP)
    e = ue8m0_exponent(floored(groups.abs().amax(-1)) / FP4_MAX)
    codes = fp4_encode(ldexp(groups, (UE8M0_BIAS - e)[..., None])).reshape(n, INDEXER_HEAD_DIM)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even dim in the low nibble
    scatter(kvcache, page, slot * INDEXER_FP4_DATA_BYTES, packed)
    scatter(kvcache, page, page_size * INDEXER_FP4_DATA_BYTES + slot * INDEXER_FP4_SCALE_BYTES,
             e.to(torch.uint8))


def read_indexer_fp4(kvcache: torch.Tensor, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantized fp32 ``[n, 128]`` rows of an indexer fp4 cache."""
    page, slot = store_slots(kvcache, locs, page_size, fmt="indexer_fp4")
    n = page.numel()
    packed = gather(kvcache, page, slot * INDEXER_FP4_DATA_BYTES, INDEXER_FP4_DATA_BYTES)
    e = gather(kvcache, page, page_size * INDEXER_FP4_DATA_BYTES + slot * INDEXER_FP4_SCALE_BYTES,
                INDEXER_FP4_SCALE_BYTES)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1, INDEXER_FP4_GROUP)
    return (fp4_decode(codes) * ue8m0_scale(e)[..., None]).reshape(n, INDEXER_HEAD_DIM)


WRITERS = {"v4_fp8": write_v4, "v4_bf16": write_bf16,
           "indexer_fp8": write_indexer_fp8, "indexer_fp4": write_indexer_fp4}
READERS = {"v4_fp8": read_v4, "v4_bf16": read_bf16,
           "indexer_fp8": read_indexer_fp8, "indexer_fp4": read_indexer_fp4}


def read_cache(fmt: str, kvcache: torch.Tensor, locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantized fp32 rows at ``locs`` of a cache in format ``fmt`` (one of ``FORMATS``)."""
    if fmt not in READERS:
        raise ArgumentError(f"unknown store format {fmt!r}; expected one of {FORMATS}")
    return READERS[fmt](kvcache, locs, page_size)


# ------------------------------------------------------------------------------------------ op

def check_out_loc(out_loc: torch.Tensor, rows: int, *, is_decode: bool, num_q_tokens: int = -1) -> None:
    """out_loc has one entry per decode plan row (`rows`), or in prefill at least the tokens of the step
    (`num_q_tokens`, as the plan recorded it; -1: not recorded, the ragged ids bound it instead)."""
    if is_decode and out_loc.numel() != rows:
        raise ArgumentError(f"out_loc must have one entry per decode row ({rows}), got {out_loc.numel()}")
    if not is_decode and out_loc.numel() < num_q_tokens:
        raise ArgumentError(f"out_loc must have at least num_q_tokens ({num_q_tokens}) entries, got {out_loc.numel()}")


def select_rows(plan: torch.Tensor, out_loc: torch.Tensor, *, is_decode: bool, compress_ratio: int):
    """(row indices, RoPE positions, cache locations) of the plan rows that store a token (contract §6.1).

    Prefill: valid CompressPlan rows, ``loc = out_loc[ragged_id]``. Decode: DecodePlan rows with
    ``seq_len mod R == 0``, ``loc = out_loc[i]``. Both: ``position = seq_len − R``.
    """
    out_loc = out_loc.detach().cpu().to(torch.int64)
    if is_decode:
        check_out_loc(out_loc, plan.shape[0], is_decode=True)
        rows = decode_decode_plan(plan)
        keep = torch.nonzero(rows.seq_len % compress_ratio == 0).flatten()
        loc_index = keep
    else:
        rows = decode_compress_plan(plan)
        keep = torch.nonzero(rows.valid).flatten()
        loc_index = rows.ragged_id[keep]
        if keep.numel() and int(loc_index.max()) >= out_loc.numel():
            raise ArgumentError(f"out_loc is indexed by ragged id and has {out_loc.numel()} entries, "
                                f"but a plan row has ragged_id {int(loc_index.max())}")
    positions = rows.seq_len[keep] - compress_ratio
    locs = out_loc[loc_index]
    distinct("out_loc", locs, "that store a compressed token name one cache location (one would overwrite the other)")
    return keep, positions, locs


def freq_rows(freq_cis: torch.Tensor, name: str = "freq_cis") -> torch.Tensor:
    """The fp32 ``[max_pos, 64]`` (cos, sin) table of ``freq_cis``: complex ``[max_pos, 32]``, or that
    fp32 table itself."""
    freq = freq_cis.detach().cpu() if not torch.is_complex(freq_cis) else freq_table(freq_cis)
    if freq.dim() != 2 or freq.shape[1] != ROPE_DIM or freq.dtype != torch.float32:
        raise ArgumentError(f"{name} must be complex [max_pos, {ROPE_DIM // 2}] (or fp32 [max_pos, {ROPE_DIM}]), "
                            f"got {list(freq_cis.shape)} {freq_cis.dtype}")
    return freq


def check_layout_flags(layout, head_dim: int, *, use_fp4: bool, bf16_store: bool, fp8_2buff: bool,
                       kvcache_rope) -> KVLayout:
    """The store's ``layout`` (a KVLayout or its name) and two-pool arguments against the others:
    a V4.1 layout stores the 512-dim latent alone; ``fp8_2buff`` is the V4 latent into two pools
    (contract §10.3)."""
    layout = KVLayout.parse(layout)
    if layout is not KVLayout.V4:
        for flag, value in (("use_fp4", use_fp4), ("bf16_store", bf16_store), ("fp8_2buff", fp8_2buff)):
            if value:
                raise ArgumentError(f"layout: {layout.value!r} (a V4.1 layout) has its own row format, "
                                    f"so {flag} must be False, got {flag}=True")
        if head_dim != V4_HEAD_DIM:
            raise ArgumentError(f"layout: {layout.value!r} (a V4.1 layout) stores the {V4_HEAD_DIM}-dim latent "
                                f"only, got head_dim {head_dim}")
    if fp8_2buff:
        for flag, value in (("use_fp4", use_fp4), ("bf16_store", bf16_store)):
            if value:
                raise ArgumentError(f"fp8_2buff: the two-pool store has its own row format, so {flag} must be False, "
                                    f"got {flag}=True")
        if head_dim != V4_HEAD_DIM:
            raise ArgumentError(f"fp8_2buff: the two-pool store holds the {V4_HEAD_DIM}-dim latent only, got head_dim "
                                f"{head_dim}")
        if kvcache_rope is None:
            raise ArgumentError("fp8_2buff: the two-pool store needs kvcache_rope (the bf16 rope pool), got None")
    elif kvcache_rope is not None:
        raise ArgumentError("kvcache_rope: only the two-pool store (fp8_2buff=True) writes it, got a tensor with "
                            "fp8_2buff=False")
    return layout


@dataclass(frozen=True)
class StoreRows:
    """What `compress_norm_rope_store` stores, found by `checked_store`: the cache format (a
    contract §6.5 format for layout v4 without fp8_2buff, else None), the layout and the two-pool flag, the kv
    rows that store a token, their RoPE positions and cache locations, and the fp32 (cos, sin) table."""

    fmt: str | None
    layout: KVLayout
    fp8_2buff: bool
    keep: torch.Tensor
    positions: torch.Tensor
    locs: torch.Tensor
    freq: torch.Tensor


def checked_store(kv: torch.Tensor, plan: torch.Tensor, *, is_decode: bool, compress_ratio: int,
                  norm_weight: torch.Tensor, freq_cis: torch.Tensor, out_loc: torch.Tensor, kvcache: torch.Tensor,
                  page_size: int, use_fp4: bool = False, bf16_store: bool = False, num_q_tokens: int = -1,
                  layout="v4", fp8_2buff: bool = False, kvcache_rope: torch.Tensor | None = None) -> StoreRows:
    """Every check of `compress_norm_rope_store` (arguments as there; kv's values are not read: the
    rows it stores are checked finite by the caller), so that a caller that computes kv first (the
    fused op) can check the store before writing anything."""
    if kv.dim() != 2:
        raise ArgumentError(f"kv must be [N, hd], got {list(kv.shape)}")
    dtype_in("kv", kv, FLOAT_DTYPES)
    contiguous("kv", kv)
    check_ratio(compress_ratio)
    if plan.shape[0] != kv.shape[0]:
        raise ArgumentError(f"plan must have one row per kv row ({kv.shape[0]}), got {plan.shape[0]}")
    if out_loc.dim() != 1 or out_loc.dtype not in (torch.int32, torch.int64):
        raise ArgumentTypeError(f"out_loc must be a 1-D int32 or int64 tensor, got {out_loc.dim()}-D {out_loc.dtype}")
    check_out_loc(out_loc, plan.shape[0], is_decode=is_decode, num_q_tokens=num_q_tokens)
    head_dim = kv.shape[1]
    layout = check_layout_flags(layout, head_dim, use_fp4=use_fp4, bf16_store=bf16_store, fp8_2buff=fp8_2buff,
                                kvcache_rope=kvcache_rope)
    fmt = store_format(head_dim, use_fp4=use_fp4, bf16_store=bf16_store)
    if norm_weight.shape != (head_dim,):
        raise ArgumentError(f"norm_weight must be [{head_dim}], got {list(norm_weight.shape)}")
    check_page_size(page_size)
    freq = freq_rows(freq_cis)
    keep, positions, locs = stored_rows(None, plan, out_loc, norm_weight, freq, is_decode=is_decode,
                                        compress_ratio=compress_ratio)
    _check_positions(positions, freq)
    store_slots(kvcache, locs, page_size, layout=layout, fmt=fmt, fp8_2buff=fp8_2buff, kvcache_rope=kvcache_rope)
    v4_format = fmt if layout is KVLayout.V4 and not fp8_2buff else None
    return StoreRows(v4_format, layout, fp8_2buff, keep, positions, locs, freq)


def v41_values(kv: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, freq: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
    """The fp32 rows a V4.1 layout encodes (contract §10.3): RMSNorm rounded to kv's dtype (a no-op for
    fp32 kv), RoPE in fp32 on those values, the rotated dims rounded to kv's dtype again."""
    def round_to_kv(x: torch.Tensor) -> torch.Tensor:
        return x.to(kv.dtype).to(torch.float32)

    return round_to_kv(apply_rope(round_to_kv(rms_norm(kv, norm_weight, norm_eps)), freq, positions))


def stored_rows(kv: torch.Tensor | None, plan: torch.Tensor, out_loc: torch.Tensor, norm_weight: torch.Tensor,
                freq: torch.Tensor, *, is_decode: bool, compress_ratio: int):
    """The checks of the rows a store step writes, before it writes any: `select_rows` (no two of them
    name one location), then a ValueError naming what those rows read that is not finite: a stored
    row of kv (`keep`; kv None: rows a fused op computes), the norm weight, or the rope table
    (`freq`, either form) at a stored position. Rows that are not stored (invalid plan rows) may
    hold anything."""
    keep, positions, locs = select_rows(plan, out_loc, is_decode=is_decode, compress_ratio=compress_ratio)
    if kv is not None:
        finite("kv", kv.detach()[keep.to(kv.device)], rows=keep)
    finite("norm_weight", norm_weight)
    # a position outside the table is the range checks' to name (on the GPU, the kernel's status word):
    # gathering it would index out of bounds
    in_table = positions[(positions >= 0) & (positions < freq.shape[0])]
    finite("freq_cis", freq[in_table.to(freq.device)], rows=in_table)
    return keep, positions, locs


def compress_norm_rope_store(kv: torch.Tensor, plan: torch.Tensor, *, is_decode: bool, compress_ratio: int,
                             norm_weight: torch.Tensor, norm_eps: float, freq_cis: torch.Tensor,
                             out_loc: torch.Tensor, kvcache: torch.Tensor, page_size: int,
                             use_fp4: bool = False, bf16_store: bool = False, num_q_tokens: int = -1,
                             layout="v4", fp8_2buff: bool = False, kvcache_rope: torch.Tensor | None = None) -> None:
    """RMSNorm + RoPE (+ Hadamard for hd 128) + quantize + scatter of compressed rows (contract §6).

    ``kv [N, hd]`` (fp32, bf16 or fp16) row i goes with plan row i (CompressPlan rows in prefill,
    DecodePlan rows in decode). ``freq_cis`` is complex64 ``[max_pos, 32]`` (an fp32 ``[max_pos, 64]``
    table of interleaved (cos, sin) is accepted as well). ``kvcache`` (2-D uint8, one page per row) is
    written in place, after every check; rows that are skipped write nothing. ``num_q_tokens`` (a
    prefill plan's record of the step's tokens; -1: none) is the least number of out_loc entries.

    ``layout`` (a KVLayout or its name, any case) other than ``"v4"`` stores the 512-dim rows in that
    V4.1 layout (the RMSNorm and rotated values rounded to kv's dtype, no Hadamard); ``fp8_2buff`` stores
    the V4 latent into ``kvcache`` (512 bytes a slot) and ``kvcache_rope`` (``[pages · page_size, 128]``
    uint8) instead (contract §10.3).
    """
    rows = checked_store(kv, plan, is_decode=is_decode, compress_ratio=compress_ratio, norm_weight=norm_weight,
                         freq_cis=freq_cis, out_loc=out_loc, kvcache=kvcache, page_size=page_size, use_fp4=use_fp4,
                         bf16_store=bf16_store, num_q_tokens=num_q_tokens, layout=layout, fp8_2buff=fp8_2buff,
                         kvcache_rope=kvcache_rope)
    finite("kv", kv.detach()[rows.keep.to(kv.device)], rows=rows.keep)
    if rows.keep.numel() == 0:
        return
    # The op's wrapper casts the weight to kv's dtype before the fp32 math.
    weight = norm_weight.detach().to(kv.dtype)
    kv_rows = kv.detach().cpu()[rows.keep]
    if rows.layout is not KVLayout.V4:
        values = v41_values(kv_rows, weight, norm_eps, rows.freq, rows.positions)
        write_layout(kvcache, rows.locs, values, page_size, rows.layout)
        return
    values = norm_rope(kv_rows, weight, norm_eps, rows.freq, rows.positions)
    if rows.fp8_2buff:
        write_v4_2buff(kvcache, kvcache_rope, rows.locs, values, page_size)
        return
    if kv.shape[1] == INDEXER_HEAD_DIM:
        values = hadamard128(values)
    WRITERS[rows.fmt](kvcache, rows.locs, values, page_size)
