"""Pure-PyTorch reference of the compress ops (contract §4: c4 and c128).

Everything here is written from docs/contract.md: windows are gathered per compress event exactly as
contract §4.2 / contract §4.3 describe, pooled with the window softmax of contract §4.1, and the state
ring is updated in the order contract §4.4 / contract §4.5 prescribe. Tensors may live on any device;
the math runs there with plain torch ops.

State rows and input rows share one layout (``last_dim`` values per token, ``dsv4jit.geometry``):

* c4   (R = 4,   Wn = 8):   kv_overlap | kv | score_overlap | score   (4·hd)
* c128 (R = 128, Wn = 128): kv | score                                 (2·hd)

Window slot ``s`` of the event closing at position ``p`` holds position ``p − Wn + 1 + s``.
The online c128 math lives in reference/online.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4jit.arguments import FLOAT_DTYPES, STATE_DTYPES, contiguous, distinct, dtype_in, finite, in_range, one_device
from dsv4jit.errors import ArgumentError, ArgumentTypeError
from dsv4jit.geometry import check_ratio, head_dim_multiple, row_width, window_size
from dsv4jit.plan_layout import decode_compress_plan, decode_decode_plan, decode_write_plan

__all__ = ["check_finite", "compress_prefill", "compress_decode", "event_window_reference", "input_use",
           "prefill_use", "window_softmax"]


#: c4 slots 0–3 play the "overlap" role (previous block), slots 4–7 the "current" role.
_C4_OVERLAP_SLOTS = 4


# ----------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------

def _check_geometry(head_dim: int, compress_ratio: int) -> None:
    check_ratio(compress_ratio)
    # The kernels' channel tiling; the reference holds callers to the same contract.
    multiple = head_dim_multiple(compress_ratio)
    if head_dim <= 0 or head_dim % multiple:
        raise ArgumentError(f"head_dim: expected a positive multiple of {multiple} for c{compress_ratio}, "
                            f"got {head_dim}")


def _check_tensors(kv_score_buffer, kv_score_input, ape, out, *, head_dim, compress_ratio, out_rows):
    last_dim = row_width(head_dim, compress_ratio)
    wn = window_size(compress_ratio)
    dtype_in("kv_score_buffer", kv_score_buffer, STATE_DTYPES)
    dtype_in("kv_score_input", kv_score_input, FLOAT_DTYPES)
    contiguous("kv_score_input", kv_score_input)
    if ape.dtype != kv_score_input.dtype:
        raise ArgumentTypeError(f"ape: expected the input dtype {kv_score_input.dtype}, got {ape.dtype}")
    dtype_in("out", out, FLOAT_DTYPES)
    if kv_score_buffer.shape[-1] != last_dim or kv_score_buffer.numel() % (compress_ratio * last_dim):
        raise ArgumentError(f"kv_score_buffer: expected shape [pages, {compress_ratio}, {last_dim}], "
                            f"got {list(kv_score_buffer.shape)}")
    if kv_score_input.dim() != 2 or kv_score_input.shape[1] != last_dim:
        raise ArgumentError(f"kv_score_input: expected shape [rows, {last_dim}], got {list(kv_score_input.shape)}")
    if list(ape.shape) != [wn, head_dim]:
        raise ArgumentError(f"ape: expected shape [{wn}, {head_dim}], got {list(ape.shape)}")
    if list(out.shape) != [out_rows, head_dim]:
        raise ArgumentError(f"out: expected shape [{out_rows}, {head_dim}], got {list(out.shape)}")
    one_device("reference.compress", {"kv_score_buffer": kv_score_buffer, "kv_score_input": kv_score_input,
                                       "ape": ape, "out": out})


def check_finite(kv_score_input: torch.Tensor, ape: torch.Tensor, used: torch.Tensor | None) -> None:
    """ValueError naming kv_score_input or ape where a value the step uses is NaN or infinite: the
    input values `used` marks (a bool mask of kv_score_input's shape; None: all of it, as in decode,
    where every request's row is written) and ape. What no plan row uses may hold anything (CUDA-graph
    padding rows, the role a window slot does not read), and the state is not checked: a cleared
    state row's score is -inf by design, as a masked window slot's (their weight is 0)."""
    if used is None:
        finite("kv_score_input", kv_score_input)
    else:  # what is not used counts as 0, so that the index named is the argument's own
        finite("kv_score_input", kv_score_input.masked_fill(~used.to(kv_score_input.device), 0))
    finite("ape", ape)


def input_use(shape: torch.Size, head_dim: int, compress_ratio: int, read_rows: torch.Tensor,
              read_slots: torch.Tensor, written_rows: torch.Tensor) -> torch.Tensor:
    """Which values of a kv_score_input of `shape` a step uses (CPU bool mask): the columns of its
    slot's role in each row a window reads (`read_rows` at window slots `read_slots`), and every
    column of each row written to the state ring (later windows read both roles). Rows outside
    the input are left out: they are a bad plan's, which its range checks name."""
    used = torch.zeros(shape, dtype=torch.bool)
    inside = (read_rows >= 0) & (read_rows < shape[0])
    read_rows, read_slots = read_rows[inside], read_slots[inside]
    written_rows = written_rows[(written_rows >= 0) & (written_rows < shape[0])]
    used[written_rows] = True
    if compress_ratio != 4:  # one role per row: kv | score
        used[read_rows] = True
        return used
    hd = head_dim
    for slot in range(window_size(compress_ratio)):  # one row per slot and event: no index repeats
        overlap = slot < _C4_OVERLAP_SLOTS
        for first in ((0, 2 * hd) if overlap else (hd, 3 * hd)):  # the role's kv and score columns
            used[read_rows[read_slots == slot], first:first + hd] = True
    return used


def prefill_use(plan_c: torch.Tensor, plan_w: torch.Tensor, shape: torch.Size, head_dim: int,
                compress_ratio: int) -> torch.Tensor:
    """`input_use` of a prefill step's plans: its window slots taken from the input, its ring writes."""
    c, w = decode_compress_plan(plan_c), decode_write_plan(plan_w)
    valid = c.valid
    wn = window_size(compress_ratio)
    slot = torch.arange(wn)[None, :]
    from_input = (slot >= c.buffer_len[valid][:, None]) & ~_first_window_mask(c.seq_len[valid], compress_ratio)
    rows = c.ragged_id[valid][:, None] - (wn - 1) + slot
    return input_use(shape, head_dim, compress_ratio, rows[from_input], slot.expand_as(rows)[from_input],
                     w.ragged_id[w.valid])


def _flat_state(kv_score_buffer: torch.Tensor, last_dim: int) -> torch.Tensor:
    """The pool as ``[rows, last_dim]``; a view, so writes land in the caller's buffer."""
    contiguous("kv_score_buffer", kv_score_buffer)
    return kv_score_buffer.view(-1, last_dim)


# ----------------------------------------------------------------------------------------------
# Window gathering (contract §4.2 / contract §4.3) and the window softmax (contract §4.1)
# ----------------------------------------------------------------------------------------------

def _split_roles(rows: torch.Tensor, head_dim: int, compress_ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot kv and score ``[..., Wn, hd]`` from full token rows ``[..., Wn, last_dim]``."""
    hd = head_dim
    if compress_ratio == 4:
        o = _C4_OVERLAP_SLOTS
        kv = torch.cat([rows[..., :o, 0:hd], rows[..., o:, hd:2 * hd]], dim=-2)
        score = torch.cat([rows[..., :o, 2 * hd:3 * hd], rows[..., o:, 3 * hd:4 * hd]], dim=-2)
        return kv, score
    return rows[..., 0:hd], rows[..., hd:2 * hd]


def _first_window_mask(seq_len: torch.Tensor, compress_ratio: int) -> torch.Tensor:
    """``[N, Wn]`` bool: slots with no token behind them (c4 overlap half of the event at L == 4)."""
    wn = window_size(compress_ratio)
    slot = torch.arange(wn, device=seq_len.device)
    if compress_ratio != 4:
        return torch.zeros(seq_len.numel(), wn, dtype=torch.bool, device=seq_len.device)
    return (seq_len == 4)[:, None] & (slot < _C4_OVERLAP_SLOTS)[None, :]


@dataclass(frozen=True)
class _Windows:
    """Where the Wn slots of N compress events come from, with every index range-checked."""

    masked: torch.Tensor  # [N, Wn] slots before the sequence start: kv 0, score -inf
    from_state: torch.Tensor  # [N, Wn]
    from_input: torch.Tensor
    state_index: torch.Tensor  # flat state rows of the from_state slots
    input_index: torch.Tensor  # kv_score_input rows of the from_input slots


def _window_sources(plan: str, flat_state, kv_score_input, *, seq_len, ragged_id, buffer_len, read_page_0,
                    read_page_1, compress_ratio) -> _Windows:
    """Slot s comes from the state if ``s < buffer_len`` (c4: slots 0–3 from page read_page_0 row s,
    slots 4–7 from page read_page_1 row s−4; c128: page read_page_1 row s), else from input row
    ``ragged_id − (Wn−1) + s``. Masked slots are never read, because their source rows may not
    exist (contract §4.2); read_page_* are likewise only used where ``s < buffer_len`` (for buffer_len == 0
    they hold planner leftovers, contract §3.4). Index tensors are on the state's device."""
    R, wn = compress_ratio, window_size(compress_ratio)
    slot = torch.arange(wn, device=flat_state.device)[None, :]

    masked = _first_window_mask(seq_len, R)
    from_state = (slot < buffer_len[:, None]) & ~masked
    from_input = (slot >= buffer_len[:, None]) & ~masked

    if R == 4:
        page = torch.where(slot < _C4_OVERLAP_SLOTS, read_page_0[:, None], read_page_1[:, None])
        state_row = page * R + slot % _C4_OVERLAP_SLOTS
    else:
        state_row = read_page_1[:, None] * R + slot
    input_row = ragged_id[:, None] - (wn - 1) + slot

    w = _Windows(masked, from_state, from_input, state_row[from_state], input_row[from_input])
    in_range(plan, "the state rows it reads (read_page_0, read_page_1)", w.state_index, flat_state.shape[0],
             "the rows of kv_score_buffer")
    in_range(plan, "the input rows it reads (ragged_id)", w.input_index, kv_score_input.shape[0],
             "the rows of kv_score_input")
    return w


def _gather_windows(w: _Windows, flat_state, kv_score_input, *, head_dim, compress_ratio):
    """kv, score ``[N, Wn, hd]`` in fp32 for N compress events; masked slots get kv = 0, score = −inf."""
    n, wn = w.masked.shape
    rows = torch.zeros(n, wn, flat_state.shape[1], dtype=torch.float32, device=flat_state.device)
    # Mixed dtypes: state values go through the input dtype first (contract §4.1).
    rows[w.from_state] = flat_state[w.state_index].to(kv_score_input.dtype).to(torch.float32)
    rows[w.from_input] = kv_score_input[w.input_index].to(torch.float32)

    kv, score = _split_roles(rows, head_dim, compress_ratio)
    score = score.masked_fill(w.masked[:, :, None], float("-inf"))
    return kv, score


def window_softmax(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, *, dtype=torch.float32) -> torch.Tensor:
    """Softmax pooling over the slot axis, per channel (contract §4.1), computed in ``dtype``.

    kv, score: ``[..., Wn, hd]``; ape: ``[Wn, hd]``. Returns ``[..., hd]`` in ``dtype``.
    A slot with score −inf has weight exactly 0 (its kv must be finite, e.g. 0).
    """
    z = score.to(dtype) + ape.to(dtype)
    m = z.amax(dim=-2, keepdim=True)
    e = torch.exp(z - m)
    return (kv.to(dtype) * e).sum(dim=-2) / e.sum(dim=-2)


# ----------------------------------------------------------------------------------------------
# Prefill and decode
# ----------------------------------------------------------------------------------------------

def compress_prefill(kv_score_buffer, kv_score_input, ape, plan_c, plan_w, *, head_dim, compress_ratio, out):
    """One prefill step (contract §4.4): compress every valid plan_c row, then apply plan_w writes.

    Output row i pairs with plan_c row i; rows of invalid plan_c entries are left untouched.
    ``kv_score_buffer`` is updated in place; returns ``out``.
    """
    _check_geometry(head_dim, compress_ratio)
    c = decode_compress_plan(plan_c)
    w = decode_write_plan(plan_w)
    _check_tensors(kv_score_buffer, kv_score_input, ape, out, head_dim=head_dim,
                   compress_ratio=compress_ratio, out_rows=plan_c.shape[0])
    if kv_score_input.shape[0] < plan_w.shape[0]:
        raise ArgumentError(f"kv_score_input: expected at least {plan_w.shape[0]} rows (plan_w rows), "
                            f"got {kv_score_input.shape[0]}")
    device = kv_score_buffer.device
    flat = _flat_state(kv_score_buffer, row_width(head_dim, compress_ratio))
    rows = torch.nonzero(c.valid).flatten()
    windows = _window_sources("plan_c", flat, kv_score_input, seq_len=c.seq_len[rows].to(device),
                              ragged_id=c.ragged_id[rows].to(device), buffer_len=c.buffer_len[rows].to(device),
                              read_page_0=c.read_page_0[rows].to(device), read_page_1=c.read_page_1[rows].to(device),
                              compress_ratio=compress_ratio)
    write = w.valid
    ragged_id, write_loc = w.ragged_id[write].to(device), w.write_loc[write].to(device)
    in_range("plan_w", "ragged_id", ragged_id, kv_score_input.shape[0], "the rows of kv_score_input")
    in_range("plan_w", "write_loc", write_loc, flat.shape[0], "the rows of kv_score_buffer")
    # contract §4.4: no two valid writes of one step target the same state row, so writes are order-free.
    distinct("plan_w", write_loc, "write the same state row (write_loc)")
    check_finite(kv_score_input, ape, prefill_use(plan_c, plan_w, kv_score_input.shape, head_dim, compress_ratio))
    # Every row either pass touches is checked above: a bad plan writes nothing.

    # 1. Compress. Everything is gathered before any write below: the compress reads the ring as it
    #    was before this step, even where this step's writes reuse the same rows.
    if rows.numel():
        kv, score = _gather_windows(windows, flat, kv_score_input, head_dim=head_dim, compress_ratio=compress_ratio)
        pooled = window_softmax(kv, score, ape, dtype=torch.float32)
        out[rows.to(out.device)] = pooled.to(out.dtype)

    # 2. Write: verbatim copy of the input row, rounded to the state dtype.
    flat[write_loc] = kv_score_input[ragged_id].to(flat.dtype)
    return out


def compress_decode(kv_score_buffer, kv_score_input, ape, plan_d, *, head_dim, compress_ratio, out):
    """One decode step (contract §4.5), one request per plan_d row b.

    Input row b is written to state row write_loc first; a row whose event fires (c4: seq_len % 4 == 0,
    c128: write_loc % 128 == 127) then pools all Wn slots from the state, including that row. Other
    output rows are zero-filled (contract §9.3). ``kv_score_buffer`` is updated in place; returns ``out``.

    All writes happen before all reads; rows of different requests never alias, so this equals the
    per-row write-then-read order.
    """
    _check_geometry(head_dim, compress_ratio)
    d = decode_decode_plan(plan_d)
    batch = plan_d.shape[0]
    _check_tensors(kv_score_buffer, kv_score_input, ape, out, head_dim=head_dim,
                   compress_ratio=compress_ratio, out_rows=batch)
    if kv_score_input.shape[0] != batch:
        raise ArgumentError(f"kv_score_input: expected {batch} rows (plan_d rows), got {kv_score_input.shape[0]}")
    device = kv_score_buffer.device
    flat = _flat_state(kv_score_buffer, row_width(head_dim, compress_ratio))
    wn = window_size(compress_ratio)

    write_loc = d.write_loc.to(device)
    in_range("plan_d", "write_loc", write_loc, flat.shape[0], "the rows of kv_score_buffer")
    if compress_ratio == 4:
        boundary = d.seq_len % 4 == 0
    else:
        boundary = d.write_loc % 128 == 127
    rows = torch.nonzero(boundary).flatten()
    windows = _window_sources("plan_d", flat, kv_score_input, seq_len=d.seq_len[rows].to(device),
                              ragged_id=torch.zeros_like(rows, device=device),
                              buffer_len=torch.full((rows.numel(),), wn, dtype=torch.int64, device=device),
                              read_page_0=d.read_page_0[rows].to(device), read_page_1=d.read_page_1[rows].to(device),
                              compress_ratio=compress_ratio)
    check_finite(kv_score_input, ape, None)
    # Checked before anything is written. No distinctness check: cuda-graph padding rows (seq_len 1)
    # may share one dummy write_loc.
    flat[write_loc] = kv_score_input.to(flat.dtype)
    out.zero_()
    if rows.numel():
        kv, score = _gather_windows(windows, flat, kv_score_input, head_dim=head_dim, compress_ratio=compress_ratio)
        pooled = window_softmax(kv, score, ape, dtype=torch.float32)
        out[rows.to(out.device)] = pooled.to(out.dtype)
    return out


# ----------------------------------------------------------------------------------------------
# History oracle (contract §3.11)
# ----------------------------------------------------------------------------------------------

def event_window_reference(history: torch.Tensor, p: int, ape: torch.Tensor, *, head_dim: int,
                           compress_ratio: int) -> torch.Tensor:
    """fp64 ``[hd]`` compressed row of the event closing at position ``p`` of one request.

    ``history`` is ``[L, last_dim]``: the request's token rows by position (any float dtype). Pools
    positions ``p − Wn + 1 … p`` with the slot roles of contract §4.2 / contract §4.3; positions
    before 0 (only the c4 overlap half of p = 3) are masked. Independent of plans, rings and chunking.
    """
    _check_geometry(head_dim, compress_ratio)
    R, wn = compress_ratio, window_size(compress_ratio)
    last_dim = row_width(head_dim, compress_ratio)
    if history.dim() != 2 or history.shape[1] != last_dim:
        raise ArgumentError(f"history: expected shape [L, {last_dim}], got {list(history.shape)}")
    if p < 0 or (p + 1) % R or p >= history.shape[0]:
        raise ArgumentError(f"p: expected an event position ((p+1) % {R} == 0) below {history.shape[0]}, got {p}")
    positions = torch.arange(p - wn + 1, p + 1, device=history.device)
    present = positions >= 0
    rows = torch.zeros(wn, last_dim, dtype=torch.float64, device=history.device)
    rows[present] = history[positions[present]].to(torch.float64)
    kv, score = _split_roles(rows, head_dim, R)
    score = score.masked_fill(~present[:, None], float("-inf"))
    return window_softmax(kv, score, ape, dtype=torch.float64)
