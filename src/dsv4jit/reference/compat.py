"""Pure-PyTorch reference of the older c4 entry points (contract §7; window math of contract §4.2, contract §4.1).

Two page modes, chosen by ``extra``:

* ring (``extra is None``): ``kv_score_buffer [num_indices, 8, 4·hd]``; request ``indices[b]`` keeps
  position q at ring row ``q mod 8``; window slot s of the event with seq_len L reads ring row
  ``(L + s) mod 8``.
* paged (``extra`` given): ``kv_score_buffer [num_pages, 4, 4·hd]``, position q at row ``q mod 4`` of
  an explicit page. Decode: ``indices[b]`` = page of the current block (written at row
  ``(L − 1) mod 4``), ``extra[b, 0]`` = page of the previous block (the overlap slots 0–3).
  Prefill: ``extra[b] = (load_first_page, load_second_page, write_first_page, last_position)``;
  a window with ``window_len ≤ 4`` buffered slots reads them from load_second_page, a longer one its
  overlap slots from load_first_page and its current slots from load_second_page; a write at
  ``position < last_position`` (unsigned) goes to write_first_page, else to page ``indices[b]``.

Prefill plans are ``uint8 [rows, 16]`` tensors of four u32 fields ``ragged_id, batch_id, position,
window_len`` (invalid: ``ragged_id == 0xFFFFFFFF``); the event's compressed row goes to output row
``ragged_id``. Slot s (position ``position − 7 + s``) comes from the state iff ``s < window_len``, else
from input row ``ragged_id − 7 + s``. The first window (seq_len 4) has its overlap slots masked and
never read. Decode writes before it pools; prefill pools every compress row before any write.
Decode rows off a compress boundary are zero-filled.

Only data-dependent checks live here (ranges, malformed rows, colliding writes), raising
``ValueError`` that names the argument; shapes, dtypes and layouts are checked by ``dsv4jit.compat``.
"""

from __future__ import annotations

import torch

from dsv4jit.arguments import distinct, in_range
from dsv4jit.errors import ArgumentError
from dsv4jit.plan_layout import LegacyRows, decode_legacy_plan, encode_legacy_plan
from dsv4jit.reference.compress import check_finite, input_use, window_softmax

__all__ = ["LegacyRows", "c4_decode", "c4_prefill", "decode_legacy_plan", "encode_legacy_plan"]

_SLOTS = 8
_OVERLAP_SLOTS = 4


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------

def _check_range(name: str, values: torch.Tensor, size: int) -> None:
    in_range(name, "entries", values, size)


def _check_true(name: str, ok: torch.Tensor, what: str) -> None:
    if not bool(ok.all()):
        raise ArgumentError(f"{name}: {what} (rows {torch.nonzero(~ok).flatten()[:8].tolist()})")


# ----------------------------------------------------------------------------------------------
# window gathering and pooling
# ----------------------------------------------------------------------------------------------

def _pool(rows: torch.Tensor, masked: torch.Tensor, ape: torch.Tensor, head_dim: int, dtype) -> torch.Tensor:
    """Pool windows ``rows [N, 8, 4·hd]`` (values already in ``dtype``); masked slots weigh 0."""
    hd = head_dim
    overlap = (torch.arange(_SLOTS, device=rows.device) < _OVERLAP_SLOTS)[None, :, None]
    kv = torch.where(overlap, rows[..., 0:hd], rows[..., hd:2 * hd]).masked_fill(masked[..., None], 0.0)
    score = torch.where(overlap, rows[..., 2 * hd:3 * hd], rows[..., 3 * hd:4 * hd])
    score = score.masked_fill(masked[..., None], float("-inf"))
    return window_softmax(kv, score, ape, dtype=dtype)


def _gather(flat_state, inputs, state_row, input_row, from_state, from_input, dtype):
    """``[N, 8, 4·hd]`` window rows in ``dtype``: state values go through the input dtype (contract §4.1)."""
    rows = torch.zeros(*state_row.shape, flat_state.shape[1], dtype=dtype, device=flat_state.device)
    rows[from_state] = flat_state[state_row[from_state]].to(inputs.dtype).to(dtype)
    rows[from_input] = inputs[input_row[from_input]].to(dtype)
    return rows


def _first_window(seq_len: torch.Tensor) -> torch.Tensor:
    slot = torch.arange(_SLOTS, device=seq_len.device)
    return (seq_len == 4)[:, None] & (slot < _OVERLAP_SLOTS)[None, :]


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------

def c4_decode(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, seq_lens,
              extra: torch.Tensor | None = None, *, compute_dtype=torch.float32):
    """One decode step (one token per request b). Writes input row b at position seq_lens[b] − 1,
    then, where ``seq_lens[b] % 4 == 0``, pools all 8 slots from the state into output row b (other
    rows are zeroed). The state is updated in place; returns ``kv_compressed_output``. Everything is
    validated before anything is written."""
    hd = kv_compressed_output.shape[1]
    paged = extra is not None
    rows_per = 4 if paged else 8
    flat = kv_score_buffer.view(-1, 4 * hd)
    device = flat.device
    index = indices.to(device=device, dtype=torch.int64)
    seq_len = seq_lens.to(device=device, dtype=torch.int64)
    _check_true("seq_lens", seq_len >= 1, "every entry must be >= 1")
    _check_range("indices", index, kv_score_buffer.shape[0])

    event = torch.nonzero(seq_len % 4 == 0).flatten()
    L, idx = seq_len[event], index[event]
    slot = torch.arange(_SLOTS, device=device)[None, :]
    masked = _first_window(L)
    if paged:
        overlap_page = extra[:, 0].to(device=device, dtype=torch.int64)[event]
        _check_range("extra", overlap_page[L != 4], kv_score_buffer.shape[0])
        page = torch.where(slot < _OVERLAP_SLOTS, overlap_page[:, None], idx[:, None])
        state_row = page * 4 + slot % 4
    else:
        state_row = idx[:, None] * 8 + (L[:, None] + slot) % 8
    check_finite(kv_score_input, ape, None)  # every request's row is written

    flat[index * rows_per + (seq_len - 1) % rows_per] = kv_score_input.to(flat.dtype)
    kv_compressed_output.zero_()
    if event.numel():  # reads after the write: the window's last slot is the token just stored
        rows = _gather(flat, kv_score_input, state_row, state_row, ~masked, torch.zeros_like(masked), compute_dtype)
        pooled = _pool(rows, masked, ape, hd, compute_dtype)
        kv_compressed_output[event.to(kv_compressed_output.device)] = pooled.to(kv_compressed_output.dtype)
    return kv_compressed_output


def prefill_use(compress_plan: torch.Tensor, write_plan: torch.Tensor, shape: torch.Size, hd: int) -> torch.Tensor:
    """Which values of a kv_score_input of `shape` a prefill step uses (reference/compress.py,
    `input_use`): its windows' slots taken from the input, in their role's columns, and the rows it
    stores."""
    c, w = decode_legacy_plan(compress_plan), decode_legacy_plan(write_plan)
    ragged, window_len = c.ragged_id[c.valid], c.window_len[c.valid]
    slot = torch.arange(_SLOTS)[None, :]
    from_input = (slot >= window_len[:, None]) & ~_first_window(c.position[c.valid] + 1)
    rows = ragged[:, None] - (_SLOTS - 1) + slot
    return input_use(shape, hd, 4, rows[from_input], slot.expand_as(rows)[from_input], w.ragged_id[w.valid])


def c4_prefill(kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, compress_plan, write_plan,
               extra: torch.Tensor | None = None, *, compute_dtype=torch.float32):
    """One prefill step: pool every valid compress row into output row ``ragged_id`` (reading the state
    as it was before this step), then store every valid write row's input row. Output rows that no
    compress row names are left untouched. Everything is validated before anything is written.
    Returns ``kv_compressed_output``."""
    hd = kv_compressed_output.shape[1]
    paged = extra is not None
    flat = kv_score_buffer.view(-1, 4 * hd)
    device = flat.device
    num_tokens, batch = kv_score_input.shape[0], indices.shape[0]
    index = indices.to(device=device, dtype=torch.int64)
    bundle = extra.to(device=device, dtype=torch.int64) if paged else None
    c, w = decode_legacy_plan(compress_plan), decode_legacy_plan(write_plan)

    # Compress rows: window sources.
    ragged_c, b, position, window_len = (f[c.valid].to(device) for f in c)
    _check_range("compress_plan batch_id", b, batch)
    _check_true("compress_plan", window_len < _SLOTS, "window_len must be < 8")
    _check_true("compress_plan", position % 4 == 3, "position must close a window (position % 4 == 3)")
    _check_range("compress_plan ragged_id", ragged_c, num_tokens)
    distinct("compress_plan", ragged_c, "name the same ragged_id (output row)")
    L = position + 1
    slot = torch.arange(_SLOTS, device=device)[None, :]
    masked = _first_window(L)
    from_state = (slot < window_len[:, None]) & ~masked
    from_input = (slot >= window_len[:, None]) & ~masked
    if paged:
        first, second = bundle[b, 0], bundle[b, 1]
        overlap_page = torch.where(window_len <= 4, second, first)
        page = torch.where(slot < _OVERLAP_SLOTS, overlap_page[:, None], second[:, None])
        state_row = page * 4 + slot % 4
    else:
        state_row = index[b][:, None] * 8 + (L[:, None] + slot) % 8
    input_row = ragged_c[:, None] - (_SLOTS - 1) + slot
    _check_range("kv_score_buffer rows read (indices / extra pages)", state_row[from_state], flat.shape[0])
    _check_range("kv_score_input rows read (ragged_id - 7 + slot)", input_row[from_input], num_tokens)

    # Write rows: destinations.
    ragged_w, b, position = (f[w.valid].to(device) for f in w[:3])
    _check_range("write_plan batch_id", b, batch)
    _check_range("write_plan ragged_id", ragged_w, num_tokens)
    if paged:
        page = torch.where(position < (bundle[b, 3] & 0xFFFFFFFF), bundle[b, 2], index[b])
        write_row = page * 4 + position % 4
    else:
        write_row = index[b] * 8 + position % 8
    _check_range("kv_score_buffer rows written (indices / extra pages)", write_row, flat.shape[0])
    distinct("write_plan", write_row, "write the same state row")
    check_finite(kv_score_input, ape, prefill_use(compress_plan, write_plan, kv_score_input.shape, hd))

    # 1. Compress: reads the state as it was before this step's writes.
    if ragged_c.numel():
        rows = _gather(flat, kv_score_input, state_row, input_row, from_state, from_input, compute_dtype)
        pooled = _pool(rows, masked, ape, hd, compute_dtype)
        kv_compressed_output[ragged_c.to(kv_compressed_output.device)] = pooled.to(kv_compressed_output.dtype)
    # 2. Write: verbatim copies of input rows, rounded to the state dtype.
    flat[write_row] = kv_score_input[ragged_w].to(flat.dtype)
    return kv_compressed_output
