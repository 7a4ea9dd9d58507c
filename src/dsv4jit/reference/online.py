"""Pure-PyTorch reference of the online c128 compressor (contract §5): the CPU backend and the test oracle.

Each request keeps one running softmax state row of ``3·hd`` values instead of a 128-row ring:
``m`` (running max of z = score + ape) | ``s`` (Σ exp(z − m)) | ``k`` (Σ kv·exp(z − m) / s, normalized).
Positions are grouped in 128-token chunks (chunk offset ``c = pos mod 128`` picks the ape row); the
state is reset at chunk offset 0 and the pooled row is emitted when offset 127 has been folded in.

* Decode (one DecodePlan row per request): ``c = (seq_len − 1) mod 128``; load the state from
  ``read_page_0`` unless ``c == 0``; fold the token in; ``c == 127`` emits ``k'`` to output row b and
  stores nothing, otherwise ``(m', s', k')`` goes to ``write_loc`` and output row b is zero (contract §9.3).
* Prefill (OnlinePlan segment rows, see ``CompressorPrefillPlan.generate_online``): a segment of
  ``segment_len`` tokens ending at ragged id ``ragged_id`` and chunk offset ``(seq_len − 1) mod 128``
  is pooled into a partial state; unless it starts at chunk offset 0 it is merged into the stored state
  of ``load_slot`` (``store_slot`` if ``load_slot < 0``). plan_c rows (run first) write the pooled
  ``k`` to output row i; plan_w rows (run second) store the state into ``store_slot``.

The state math of contract §5.2 is here too: ``online_reset`` / ``online_update`` (one token),
``online_merge`` (two partial states), ``online_pool`` (the literal token-by-token form of a segment)
and the state row codec. A segment's partial state is computed in closed form (``segment_state``:
max, then one exp per token), which is the sequential update regrouped exactly (tests check that
they agree).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsv4jit.arguments import STATE_DTYPES, contiguous, dtype_in, in_range, one_device
from dsv4jit.errors import ArgumentError
from dsv4jit.geometry import CHUNK, head_dim_multiple, online_input_width, online_state_width
from dsv4jit.plan_layout import decode_decode_plan, decode_online_plan
from dsv4jit.reference.compress import check_finite

__all__ = ["CHUNK", "OnlineState", "online_decode", "online_merge", "online_pool", "online_prefill", "online_reset",
           "online_state_from_row", "online_state_to_row", "online_update", "segment_state"]


# ----------------------------------------------------------------------------------------------
# Running state (contract §5.1, contract §5.2): (m, s, k) per channel
# ----------------------------------------------------------------------------------------------

class OnlineState(NamedTuple):
    """Running softmax state: max m (bias included), sum s = Σ exp(z − m), normalized average k."""
    m: torch.Tensor
    s: torch.Tensor
    k: torch.Tensor


def online_reset(kv: torch.Tensor, score_plus_ape: torch.Tensor) -> OnlineState:
    """State after the first token of a 128-chunk (chunk position 0): (m = z, s = 1, k = kv)."""
    z = score_plus_ape
    return OnlineState(z.clone(), torch.ones_like(z), kv.to(z.dtype).clone())


def online_update(state: OnlineState, kv: torch.Tensor, score_plus_ape: torch.Tensor) -> OnlineState:
    """Fold one token (kv, z = score + ape[pos mod 128]) into the state."""
    z = score_plus_ape
    m_new = torch.maximum(state.m, z)
    a = state.s * torch.exp(state.m - m_new)
    b = torch.exp(z - m_new)
    s_new = a + b
    return OnlineState(m_new, s_new, (state.k * a + kv.to(z.dtype) * b) / s_new)


def online_merge(first: OnlineState, second: OnlineState) -> OnlineState:
    """Combine two partial states over disjoint token sets (the update with b = s2·exp(m2 − m'))."""
    m_new = torch.maximum(first.m, second.m)
    a = first.s * torch.exp(first.m - m_new)
    b = second.s * torch.exp(second.m - m_new)
    s_new = a + b
    return OnlineState(m_new, s_new, (first.k * a + second.k * b) / s_new)


def online_pool(kv: torch.Tensor, score_plus_ape: torch.Tensor) -> OnlineState:
    """Partial state of a segment ``[n ≥ 1, hd]``: reset on its first token, then update token by token."""
    state = online_reset(kv[0], score_plus_ape[0])
    for t in range(1, kv.shape[0]):
        state = online_update(state, kv[t], score_plus_ape[t])
    return state


def online_state_to_row(state: OnlineState, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The state row layout of contract §5.1: m | s | k (``3·hd`` values), optionally cast (e.g. to a bf16 state)."""
    row = torch.cat([state.m, state.s, state.k], dim=-1)
    return row if dtype is None else row.to(dtype)


def online_state_from_row(row: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float64) -> OnlineState:
    """Split a ``[..., 3·hd]`` state row into (m, s, k), converted to ``dtype`` for the math."""
    if row.shape[-1] != online_state_width(head_dim):
        raise ArgumentError(f"row: expected last dimension {online_state_width(head_dim)}, got {row.shape[-1]}")
    row = row.to(dtype)
    return OnlineState(row[..., :head_dim], row[..., head_dim:2 * head_dim], row[..., 2 * head_dim:])


def segment_state(kv: torch.Tensor, score_plus_ape: torch.Tensor) -> OnlineState:
    """Partial state ``(m, s, k)`` of a segment of ``n ≥ 1`` tokens (``[n, hd]`` each), in their dtype."""
    m = score_plus_ape.amax(dim=0)
    e = torch.exp(score_plus_ape - m)
    s = e.sum(dim=0)
    return OnlineState(m, s, (kv * e).sum(dim=0) / s)


def _check(state, inputs, ape, out, head_dim, out_rows):
    multiple = head_dim_multiple(CHUNK)  # the c128 channel tiling
    if head_dim <= 0 or head_dim % multiple:
        raise ArgumentError(f"head_dim: expected a positive multiple of {multiple}, got {head_dim}")
    dtype_in("kv_score_buffer", state, STATE_DTYPES)
    dtype_in("kv_score_input", inputs, (torch.float32,), " (online c128)")
    dtype_in("ape", ape, (torch.float32,), " (online c128)")
    dtype_in("out", out, (torch.float32, torch.float64))  # fp64: the tests' model output
    width, input_width = online_state_width(head_dim), online_input_width(head_dim)
    if state.shape[-1] != width:
        raise ArgumentError(f"kv_score_buffer: expected a [rows, 1, {width}] (or flat) state, "
                            f"got shape {list(state.shape)}")
    contiguous("kv_score_buffer", state)
    if inputs.dim() != 2 or inputs.shape[1] != input_width:
        raise ArgumentError(f"kv_score_input: expected shape [rows, {input_width}], got {list(inputs.shape)}")
    contiguous("kv_score_input", inputs)
    if list(ape.shape) != [CHUNK, head_dim]:
        raise ArgumentError(f"ape: expected shape [{CHUNK}, {head_dim}], got {list(ape.shape)}")
    if list(out.shape) != [out_rows, head_dim]:
        raise ArgumentError(f"out: expected shape [{out_rows}, {head_dim}], got {list(out.shape)}")
    one_device("reference.online", {"kv_score_buffer": state, "kv_score_input": inputs, "ape": ape, "out": out})


def _check_slot(plan: str, what: str, slot: int, rows: int) -> None:
    in_range(plan, what, slot, rows, "the state rows of kv_score_buffer")


def online_decode(kv_score_buffer, kv_score_input, ape, plan_d, *, head_dim, out, dtype=torch.float32):
    """One decode step: fold each request's token into its state (math in ``dtype``); returns ``out``."""
    _check(kv_score_buffer, kv_score_input, ape, out, head_dim, plan_d.shape[0])
    if kv_score_input.shape[0] != plan_d.shape[0]:
        raise ArgumentError(f"kv_score_input: expected {plan_d.shape[0]} rows (plan_d rows), "
                            f"got {kv_score_input.shape[0]}")
    d = decode_decode_plan(plan_d)
    flat = kv_score_buffer.view(-1, online_state_width(head_dim))
    chunk_pos = [(int(seq_len) - 1) % CHUNK for seq_len in d.seq_len]
    for b, c in enumerate(chunk_pos):  # every slot checked before anything is written
        if c != 0:
            _check_slot("plan_d", f"read_page_0 of row {b}", int(d.read_page_0[b]), flat.shape[0])
        if c != CHUNK - 1:
            _check_slot("plan_d", f"write_loc of row {b}", int(d.write_loc[b]), flat.shape[0])
    check_finite(kv_score_input, ape, None)
    out.zero_()
    for b, c in enumerate(chunk_pos):
        kv = kv_score_input[b, :head_dim].to(dtype)
        z = kv_score_input[b, head_dim:].to(dtype) + ape[c].to(dtype)
        if c == 0:
            new = online_reset(kv, z)
        else:
            new = online_update(online_state_from_row(flat[int(d.read_page_0[b])], head_dim, dtype), kv, z)
        if c == CHUNK - 1:
            out[b] = new.k.to(out.dtype)
        else:
            flat[int(d.write_loc[b])] = online_state_to_row(new, flat.dtype)
    return out


def _segments(name: str, plan: torch.Tensor, inputs, ape, flat, head_dim, dtype):
    """(row index, merged state, store slot) of every valid segment row, states as stored before this step."""
    rows = decode_online_plan(plan)
    result = []
    for i in torch.nonzero(rows.valid).flatten().tolist():
        end = (int(rows.seq_len[i]) - 1) % CHUNK + 1        # chunk offsets [end - n, end)
        n, last = int(rows.segment_len[i]), int(rows.ragged_id[i])
        if not 1 <= n <= end or last - n + 1 < 0 or last >= inputs.shape[0]:
            raise ArgumentError(f"{name}: row {i} (a segment of {n} tokens ending at ragged id {last}, chunk offset "
                                f"{end - 1}) does not fit the chunk or kv_score_input ({inputs.shape[0]} rows)")
        tokens = inputs[last - n + 1:last + 1].to(dtype)
        state = segment_state(tokens[:, :head_dim], tokens[:, head_dim:] + ape[end - n:end].to(dtype))
        if end - n > 0:  # continues a chunk: merge into the stored partial state
            load = int(rows.load_slot[i]) if int(rows.load_slot[i]) >= 0 else int(rows.store_slot[i])
            _check_slot(name, f"the state row read by row {i}", load, flat.shape[0])
            state = online_merge(online_state_from_row(flat[load], head_dim, dtype), state)
        result.append((i, state, int(rows.store_slot[i])))
    return result


def prefill_use(plan_c: torch.Tensor, plan_w: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Which rows of a kv_score_input of `shape` an online prefill step folds into states (a CPU
    bool mask of that shape): the tokens of every valid segment row of either plan, within it."""
    used = torch.zeros(shape, dtype=torch.bool)
    for rows in map(decode_online_plan, (plan_c, plan_w)):
        for last, n in zip(rows.ragged_id[rows.valid].tolist(), rows.segment_len[rows.valid].tolist()):
            used[max(last - n + 1, 0):last + 1] = True
    return used


def online_prefill(kv_score_buffer, kv_score_input, ape, plan_c, plan_w, *, head_dim, out, dtype=torch.float32):
    """One prefill step: compress pass (plan_c -> out rows), then write pass (plan_w -> state); returns ``out``."""
    _check(kv_score_buffer, kv_score_input, ape, out, head_dim, plan_c.shape[0])
    flat = kv_score_buffer.view(-1, online_state_width(head_dim))
    # Every stored state is read (by both passes' merges) before any is written, and every row
    # checked before anything is written.
    pooled = _segments("plan_c", plan_c, kv_score_input, ape, flat, head_dim, dtype)
    stores = _segments("plan_w", plan_w, kv_score_input, ape, flat, head_dim, dtype)
    for i, _, slot in stores:
        _check_slot("plan_w", f"store_slot of row {i}", slot, flat.shape[0])
    check_finite(kv_score_input, ape, prefill_use(plan_c, plan_w, kv_score_input.shape))
    for i, state, _ in pooled:
        out[i] = state.k.to(out.dtype)
    for _, state, slot in stores:
        flat[slot] = online_state_to_row(state, flat.dtype)
    return out
