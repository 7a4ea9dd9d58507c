"""Pure-torch reference of the DeepSeek-V4.1 ratio-1 and ratio-2 compressors (contract §10.4, contract §10.5):
the CPU backend of the ops and the oracle of their GPU tests.

* ``c1_decode_norm_rope_store``: each row's RMSNorm is its latent (ratio 1: every token produces one),
  stored at the row's own full slot ``out_loc`` in a page-256 pool.
* ``c2_decode_norm_rope_store`` / ``c2_prefill_norm_rope_store``: an odd position closes the pair
  ``(p − 1, p)``; its latent is the RMSNorm of the pair's softmax pooling, stored at ``raw_out_loc >> 1``
  (page 128) with RoPE position ``p − 1``. Partners come from the previous input row or from the pair
  ring ``kv_state`` (one ``| kv | score |`` row per ``(request, pos mod ring_size)``), which even rows
  fill (decode, verify) or a write-back pass fills after all reads (prefill).
* ``c2_decode_pool``: the pair pooling of a decode step alone, pooled values only.

The arithmetic, which the GPU kernels reproduce (operations in this order, each rounded to fp32 once,
no fused multiply-add; where they may differ: contract §10.7):

* RMSNorm as ``store.rms_norm``, then bf16: ``L = bf((x · r) · w)``, ``w`` the bf16 weight widened; the
  sum of squares is exact, rounded once (a kernel's fp32 reduction order may move it by an ulp).
* c2 pooling of partner ``(kv_o, s_o)`` and own ``(kv_n, s_n)``, per channel: ``d = s_o − s_n``,
  ``e = exp(−|d|)``; ``(w_o, w_n) = (1, e)`` if ``d > 0`` else ``(e, 1)``;
  ``pooled = ((kv_o · w_o) + (kv_n · w_n)) / (1 + e)``; the latent is the RMSNorm of ``bf(pooled)``.
* ``exp`` is evaluated in fp64 and rounded to fp32 (the correctly rounded ``expf``, but for rare
  double-rounding cases); CUDA's accurate ``expf`` may differ from it in the last place.
* Store: the latent's rope dims rotated in fp32 at the RoPE position and rounded to
  bf16; fp4 layouts encode that; the others encode ``fake_quant_fp4_16`` of it (``v4``: the V4 latent
  writer, whose bf16 rounding is then exact).

Every argument is checked, and every location, ring row and RoPE position bounded, before anything
is written; ``N = 0`` writes nothing.
"""

from __future__ import annotations

import torch

from ..arguments import distinct, dtype_in, in_range, integer, positive
from ..errors import ArgumentError, ArgumentTypeError
from ..geometry import V4_HEAD_DIM, check_page_size
from ..kv_layout import KVLayout
from .layouts import check_layout_cache, write_layout
from .paging import page_slot
from .quant import bf16_round, fdiv
from .quant_v41 import fake_quant_fp4_16
from .store import apply_rope, freq_rows, rms_norm

HEAD_DIM = V4_HEAD_DIM
#: Columns of a ratio-2 input or ring row: | kv (512) | score (512) |.
PAIR_ROW = 2 * HEAD_DIM
INDEX_DTYPES = (torch.int32, torch.int64)
CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
INT32_LIMIT = 1 << 31
READ = "read (req * ring_size + (positions - 1) mod ring_size)"
WRITTEN = "written (req * ring_size + positions mod ring_size)"


# ------------------------------------------------------------------------------------------- checks

def _tensor(name: str, t, shape: tuple, dtypes: tuple) -> torch.Tensor:
    """``t`` after checking it is a tensor of ``dtypes`` and ``shape`` (``None``: any size)."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    dtype_in(name, t, dtypes)
    if t.dim() != len(shape) or any(want is not None and want != got for want, got in zip(shape, t.shape)):
        expected = ", ".join("*" if want is None else str(want) for want in shape)
        raise ArgumentError(f"{name}: expected shape [{expected}], got {list(t.shape)}")
    return t


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().to(torch.int64)


def _cache_bytes(k_cache, page_size: int, layout: KVLayout) -> torch.Tensor:
    """The cache as uint8 ``[pages, page_bytes(layout, page_size)]`` (an fp8-typed pool is viewed as its bytes)."""
    _tensor("k_cache", k_cache, (None, None), CACHE_DTYPES)
    cache = k_cache.view(torch.uint8)
    check_layout_cache(cache, page_size, layout, "k_cache")
    return cache


def _out(out, n: int, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(n, HEAD_DIM, dtype=torch.bfloat16, device=like.device)
    return _tensor("out", out, (n, HEAD_DIM), (torch.bfloat16,))


def _common(op: str, norm_weight, positions, n: int, eps, freqs_cis, page_size, layout):
    """(layout, positions int64, eps, freq table) after the checks every c1/c2 op makes."""
    layout = KVLayout.parse(layout)
    _tensor("norm_weight", norm_weight, (HEAD_DIM,), (torch.bfloat16,))
    positions = _ints(_tensor("positions", positions, (n,), INDEX_DTYPES))
    if positions.numel() and int(positions.min()) < 0:
        raise ArgumentError(f"positions: must be >= 0, got {int(positions.min())}")
    check_page_size(integer(op, "page_size", page_size))
    if not isinstance(freqs_cis, torch.Tensor):
        raise ArgumentTypeError(f"freqs_cis: expected a torch.Tensor, got {type(freqs_cis).__name__}")
    return layout, positions, positive(op, "eps", eps), freq_rows(freqs_cis, "freqs_cis")


def _stored_locs(name: str, locs: torch.Tensor, cache: torch.Tensor, page_size: int) -> None:
    """The cache locations of the stored rows lie in the cache, one row each."""
    page_slot(cache, locs, page_size, name)
    distinct(name, locs, "that store a latent name one cache location (one would overwrite the other)")


def _rope_positions(rope_positions: torch.Tensor, freq: torch.Tensor) -> None:
    in_range("positions", "the RoPE positions of the stored rows", rope_positions, freq.shape[0], "freqs_cis rows")


def _ring_size(op: str, ring_size, kv_state) -> int:
    ring_size = integer(op, "ring_size", ring_size)
    if ring_size <= 0:
        raise ArgumentError(f"ring_size: must be > 0, got {ring_size}")
    _tensor("kv_state", kv_state, (None, PAIR_ROW), (torch.float32,))
    return ring_size


def _ring_rows(what: str, rows: torch.Tensor, kv_state: torch.Tensor) -> torch.Tensor:
    in_range("req", f"the ring rows {what}", rows, kv_state.shape[0], "kv_state rows")
    return rows


def write_rows(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[rows[i], :width] = values[i]``; where a row repeats, the last write wins."""
    rows = rows.to(torch.int64)
    later = torch.zeros(rows.numel(), dtype=torch.bool)
    if rows.numel() > 1:
        later[:-1] = (rows[:-1, None] == rows[None, 1:]).triu().any(-1)
    keep = ~later
    dst[rows[keep].to(dst.device), :values.shape[1]] = values[keep].to(dst.device)


# --------------------------------------------------------------------------------------- arithmetic

def fexp(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``exp(x)``: evaluated in fp64, rounded once."""
    return x.to(torch.float64).exp().to(torch.float32)


def latent(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The bf16 latent (as fp32) of rows ``x``: ``bf((x · r) · w)``."""
    return bf16_round(rms_norm(x, norm_weight, eps))


def pool_pairs_c2(partner: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The fused kernels' pair pooling of ``| kv | score |`` rows, fp32 ``[n, 512]``."""
    kv_o, s_o = partner[:, :HEAD_DIM], partner[:, HEAD_DIM:]
    kv_n, s_n = own[:, :HEAD_DIM], own[:, HEAD_DIM:]
    d = s_o - s_n
    e = fexp(-d.abs())
    one = torch.ones_like(e)
    w_o, w_n = torch.where(d > 0, one, e), torch.where(d > 0, e, one)
    return fdiv(kv_o * w_o + kv_n * w_n, 1.0 + e)


def store_latents(cache: torch.Tensor, locs: torch.Tensor, latents: torch.Tensor, rope_positions: torch.Tensor,
                  freq: torch.Tensor, page_size: int, layout: KVLayout) -> None:
    """The store of a latent: rope dims of the bf16 ``latents`` rotated in fp32 and rounded to bf16; fp4 layouts
    store that, the others its compressed-KV fp4 fake quant."""
    z = bf16_round(apply_rope(latents, freq, rope_positions))
    write_layout(cache, locs, z if layout.is_fp4 else fake_quant_fp4_16(z), page_size, layout)


# ---------------------------------------------------------------------------------------------- c1

def c1_decode_norm_rope_store(kv_input, norm_weight, positions, out_loc, eps, freqs_cis, k_cache, *, page_size,
                              layout="v4", out=None):
    """Ratio 1, decode and extend alike (contract §10.4): ``out[r]`` = the latent of ``kv_input[r]`` (bf16
    ``[N, 512]``, the raw projection) for every row, padded ones included; rows with ``out_loc > 0``
    (int32 or int64; ``<= 0``: padding) store it at slot ``out_loc`` of ``k_cache`` with RoPE position
    ``positions[r]``. Returns ``out`` (bf16 ``[N, 512]``, allocated if None)."""
    op = "c1_decode_norm_rope_store"
    kv_input = _tensor("kv_input", kv_input, (None, HEAD_DIM), (torch.bfloat16,))
    n = kv_input.shape[0]
    layout, positions, eps, freq = _common(op, norm_weight, positions, n, eps, freqs_cis, page_size, layout)
    locs = _ints(_tensor("out_loc", out_loc, (n,), INDEX_DTYPES))
    if locs.numel() and (int(locs.min()) < -INT32_LIMIT or int(locs.max()) >= INT32_LIMIT):
        raise ArgumentError(f"out_loc: the kernels narrow locations to int32, got range [{int(locs.min())}, "
                            f"{int(locs.max())}]")
    cache = _cache_bytes(k_cache, page_size, layout)
    out = _out(out, n, kv_input)
    stored = torch.nonzero(locs > 0).flatten()
    _stored_locs("out_loc", locs[stored], cache, page_size)
    _rope_positions(positions[stored], freq)
    if n == 0:
        return out
    latents = latent(kv_input.detach().cpu(), norm_weight.detach().cpu(), eps)
    out.copy_(latents.to(torch.bfloat16))
    if stored.numel():
        store_latents(cache, locs[stored], latents[stored], positions[stored], freq, page_size, layout)
    return out


# ---------------------------------------------------------------------------------------------- c2

def _c2_rows(op: str, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freqs_cis, k_cache,
             page_size, ring_size, layout, out):
    """The checks c2 decode and prefill share: ((input rows, ring) on the CPU, positions, req and raw
    locations as int64, layout, eps, freq table, cache bytes, out, ring_size)."""
    kv_input = _tensor("kv_input", kv_input, (None, PAIR_ROW), (torch.float32,))
    n = kv_input.shape[0]
    ring_size = _ring_size(op, ring_size, kv_state)
    layout, positions, eps, freq = _common(op, norm_weight, positions, n, eps, freqs_cis, page_size, layout)
    req = _ints(_tensor("req", req, (n,), (torch.int64,)))
    raw = _ints(_tensor("raw_out_loc", raw_out_loc, (n,), INDEX_DTYPES))
    if raw.numel() and (int(raw.min()) < 0 or int(raw.max()) >= INT32_LIMIT):
        raise ArgumentError(f"raw_out_loc: full-pool slots must lie in [0, 2^31) (0: a padded row), got range "
                            f"[{int(raw.min())}, {int(raw.max())}]")
    cache = _cache_bytes(k_cache, page_size, layout)
    out = _out(out, n, kv_input)
    rows = kv_input.detach().cpu(), kv_state.detach().cpu()
    return rows, positions, req, raw, layout, eps, freq, cache, out, ring_size


def _close_pairs(closing: torch.Tensor, partners: torch.Tensor, kv_input: torch.Tensor, positions, raw, norm_weight,
                 eps, freq, cache, page_size, layout, out) -> None:
    """Pool each closing row with its partner row, write its latent to ``out`` and store it at
    ``raw >> 1`` with RoPE position ``p − 1`` (the bounds already checked)."""
    if closing.numel() == 0:
        return
    pooled = pool_pairs_c2(partners, kv_input[closing])
    latents = latent(bf16_round(pooled), norm_weight.detach().cpu(), eps)
    out[closing.to(out.device)] = latents.to(torch.bfloat16).to(out.device)
    store_latents(cache, raw[closing] >> 1, latents, positions[closing] - 1, freq, page_size, layout)


def _check_closing(closing: torch.Tensor, positions, raw, freq, cache, page_size) -> None:
    _stored_locs("raw_out_loc", raw[closing] >> 1, cache, page_size)
    _rope_positions(positions[closing] - 1, freq)


def c2_decode_norm_rope_store(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freqs_cis, k_cache,
                              *, page_size, ring_size, draft_len=1, layout="v4", out=None):
    """Ratio 2, decode (``draft_len = 1``: one row per request) or target verify (``draft_len = d > 1``:
    request-major blocks of ``d`` consecutive positions), contract §10.4.

    ``kv_input`` fp32 ``[N, 1024]`` (``| kv | score |``). A row's partner is the previous input row inside a
    verify block, else ring row ``req · ring_size + (p − 1) mod ring_size`` of ``kv_state`` (read for every
    row, padded ones included). An odd, non-padded row (``raw_out_loc != 0``) closes its pair: ``out`` and
    the cache. An even, non-padded row parks its input row at ring row ``req · ring_size + p mod ring_size``
    (after every read). Padded rows write nothing. Returns ``out``.
    """
    op = "c2_decode_norm_rope_store"
    draft_len = integer(op, "draft_len", draft_len)
    (kv_input, ring), positions, req, raw, layout, eps, freq, cache, out, ring_size = _c2_rows(
        op, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freqs_cis, k_cache, page_size,
        ring_size, layout, out)
    n = kv_input.shape[0]
    if draft_len < 1:
        raise ArgumentError(f"draft_len: must be >= 1, got {draft_len}")
    if draft_len > 1 and n % draft_len:
        raise ArgumentError(f"draft_len: a verify batch has draft_len rows per request, but N = {n} is not a multiple "
                            f"of {draft_len}")
    if draft_len > 1 and ring_size <= draft_len:
        raise ArgumentError(f"ring_size: must exceed draft_len ({draft_len}) in a verify batch, got {ring_size}")
    from_input = torch.arange(n) % draft_len != 0  # the partner is the previous input row
    from_ring = torch.nonzero(~from_input).flatten()
    read_rows = _ring_rows(READ, req[from_ring] * ring_size + (positions[from_ring] - 1) % ring_size, ring)
    live, odd = raw != 0, positions % 2 == 1
    closing = torch.nonzero(live & odd).flatten()
    parked = torch.nonzero(live & ~odd).flatten()
    park_rows = _ring_rows(WRITTEN, req[parked] * ring_size + positions[parked] % ring_size, ring)
    _check_closing(closing, positions, raw, freq, cache, page_size)
    if n == 0:
        return out
    partners = torch.empty_like(kv_input)
    partners[from_ring] = ring[read_rows]
    partners[from_input] = kv_input[torch.nonzero(from_input).flatten() - 1]
    _close_pairs(closing, partners[closing], kv_input, positions, raw, norm_weight, eps, freq, cache, page_size,
                 layout, out)
    write_rows(kv_state, park_rows, kv_input[parked])
    return out


def c2_prefill_norm_rope_store(kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freqs_cis, k_cache,
                               extend_start_loc, extend_seq_lens, *, page_size, ring_size, layout="v4", out=None):
    """Ratio 2, an extend batch (contract §10.4): request ``i`` owns input rows ``[extend_start_loc[i],
    extend_start_loc[i] + extend_seq_lens[i])`` (int32). Padded rows (``raw_out_loc == 0``) take no part;
    rows of no request (padding after the last one) are never written back.

    Pooling pass: an odd, non-padded row pairs with the previous input row when that row is of the same
    request (``req``), at position ``p − 1`` and not padded, else with ring row ``(req, p − 1)``; it writes
    ``out`` and the cache. Write-back, after every read: each request's last ``min(len, ring_size)``
    non-padded rows are copied verbatim to ring rows ``req · ring_size + p mod ring_size``. Returns ``out``.
    """
    op = "c2_prefill_norm_rope_store"
    (kv_input, ring), positions, req, raw, layout, eps, freq, cache, out, ring_size = _c2_rows(
        op, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, eps, freqs_cis, k_cache, page_size,
        ring_size, layout, out)
    n = kv_input.shape[0]
    starts = _ints(_tensor("extend_start_loc", extend_start_loc, (None,), (torch.int32,)))
    lens = _ints(_tensor("extend_seq_lens", extend_seq_lens, (starts.numel(),), (torch.int32,)))
    in_range("extend_start_loc", "the requests' first rows", starts, n + 1, "rows of kv_input, or N")
    if lens.numel() and (int(lens.min()) < 0 or int((starts + lens).max()) > n):
        raise ArgumentError(f"extend_seq_lens: each request's rows [start, start + len) must lie in [0, N = {n}), got "
                            f"lens in [{int(lens.min())}, {int(lens.max())}] and a last row end "
                            f"{int((starts + lens).max())}")
    live, odd = raw != 0, positions % 2 == 1
    closing = torch.nonzero(live & odd).flatten()
    previous = (closing - 1).clamp(min=0)
    in_batch = ((closing > 0) & (req[previous] == req[closing]) & (positions[previous] == positions[closing] - 1)
                & live[previous])
    from_ring = closing[~in_batch]
    read_rows = _ring_rows(READ, req[from_ring] * ring_size + (positions[from_ring] - 1) % ring_size, ring)
    tail = write_back_rows(starts, lens, ring_size)
    tail = tail[live[tail]]
    back_rows = _ring_rows(WRITTEN, req[tail] * ring_size + positions[tail] % ring_size, ring)
    _check_closing(closing, positions, raw, freq, cache, page_size)
    if n == 0:
        return out
    partners = kv_input[previous]
    partners[~in_batch] = ring[read_rows]
    _close_pairs(closing, partners, kv_input, positions, raw, norm_weight, eps, freq, cache, page_size, layout, out)
    write_rows(kv_state, back_rows, kv_input[tail])
    return out


def write_back_rows(starts: torch.Tensor, lens: torch.Tensor, ring_size: int) -> torch.Tensor:
    """Row indices of each request's last ``min(len, ring_size)`` rows, request by request."""
    kept = torch.minimum(lens, torch.tensor(ring_size))
    return torch.cat([torch.arange(int(s + l - k), int(s + l)) for s, l, k in zip(starts, lens, kept)]
                     or [torch.zeros(0, dtype=torch.int64)])


# ---------------------------------------------------------------------------------------- decode pool

def c2_decode_pool(kv, score, pos, raw_out_loc, out_loc, req, state_kv, state_score, pad_row, *, ring_size=0):
    """Ratio-2 decode pair pooling alone (contract §10.5): ``(pooled, group_pos, slots)``, updating the
    state rows in place.

    ``kv``, ``score``: fp32 ``[n, D]``; ``pos``, ``req`` int64; ``raw_out_loc``, ``out_loc`` int32 or int64;
    ``state_kv``, ``state_score``: fp32 rows of at least ``D`` columns (e.g. the two halves of the pair ring).
    Partner row: ``ring_size > 0``: ``pad_row`` if ``raw == 0`` or ``pos == 0``, else ``req · ring_size +
    (pos − 1) mod ring_size``, and each non-padded row then writes its own kv and score at ``req ·
    ring_size + pos mod ring_size``; ``ring_size == 0``: ``pad_row`` if ``raw == 0``, else row ``req``,
    which then holds the row's own values (even ``pos``) or the partner's unchanged (odd). Every read comes
    before every write; padded rows of ``ring_size == 0`` all write ``pad_row`` (the last one wins here, in
    no defined order on a GPU).

    Bitwise the torch ``pool_pairs`` arithmetic: ``m = max(s_o, s_n)``, ``e_o = exp(s_o − m)``,
    ``e_n = exp(s_n − m)``, ``pooled = (kv_o · (e_o / (e_o + e_n))) + (kv_n · (e_n / (e_o + e_n)))``.
    ``group_pos = pos − 1`` for odd ``pos``, else ``pos``; ``slots = out_loc`` where ``>= 0``, else 0.
    """
    op = "c2_decode_pool"
    kv = _tensor("kv", kv, (None, None), (torch.float32,))
    n, d = kv.shape
    _tensor("score", score, (n, d), (torch.float32,))
    pos_in = _tensor("pos", pos, (n,), (torch.int64,))
    raw = _ints(_tensor("raw_out_loc", raw_out_loc, (n,), INDEX_DTYPES))
    out_loc = _tensor("out_loc", out_loc, (n,), INDEX_DTYPES)
    rid = _ints(_tensor("req", req, (n,), (torch.int64,)))
    _tensor("state_kv", state_kv, (None, None), (torch.float32,))
    _tensor("state_score", state_score, (None, None), (torch.float32,))
    state_rows = min(state_kv.shape[0], state_score.shape[0])
    if min(state_kv.shape[1], state_score.shape[1]) < d:
        raise ArgumentError(f"state_kv: state rows need at least D = {d} columns, got state_kv {list(state_kv.shape)} "
                            f"and state_score {list(state_score.shape)}")
    pad_row = integer(op, "pad_row", pad_row)
    in_range("pad_row", "the padded rows' state row", pad_row, state_rows, "rows of state_kv and state_score")
    ring_size = integer(op, "ring_size", ring_size)
    if ring_size < 0:
        raise ArgumentError(f"ring_size: must be >= 0 (0: one state row per request), got {ring_size}")
    p = _ints(pos_in)
    if p.numel() and int(p.min()) < 0:
        raise ArgumentError(f"pos: must be >= 0, got {int(p.min())}")
    padded, odd = raw == 0, p % 2 == 1
    if ring_size:
        read = torch.where(padded | (p == 0), torch.tensor(pad_row), rid * ring_size + (p - 1) % ring_size)
        writers = torch.nonzero(~padded).flatten()
        write = rid[writers] * ring_size + p[writers] % ring_size
    else:
        read = torch.where(padded, torch.tensor(pad_row), rid)
        writers, write = torch.arange(n), read
    in_range("req", "the state rows read (from req and pos)", read, state_rows, "rows of state_kv and state_score")
    in_range("req", "the state rows written (from req and pos)", write, state_rows, "rows of state_kv and state_score")
    kv_n, s_n = kv.detach().cpu(), score.detach().cpu()
    kv_o, s_o = state_kv.detach().cpu()[read, :d], state_score.detach().cpu()[read, :d]
    m = torch.maximum(s_o, s_n)
    e_o, e_n = fexp(s_o - m), fexp(s_n - m)
    denom = e_o + e_n
    pooled = kv_o * fdiv(e_o, denom) + kv_n * fdiv(e_n, denom)
    if ring_size:
        new_kv, new_score = kv_n[writers], s_n[writers]
    else:  # an odd row rewrites its partner unchanged
        new_kv, new_score = torch.where(odd[:, None], kv_o, kv_n), torch.where(odd[:, None], s_o, s_n)
    write_rows(state_kv, write, new_kv)
    write_rows(state_score, write, new_score)
    group_pos = torch.where(odd, p - 1, p).to(pos_in.device)
    slots = out_loc.clamp(min=0)
    return pooled.to(kv.device), group_pos, slots
