"""Pure-PyTorch reference of the online c128 compressor (contract §5): the CPU backend and the test oracle.

Each request keeps one running softmax state row of ``3·hd`` values instead of a 128-row ring:
``m`` (running max of z = score + ape) | ``s`` (Σ exp(z − m)) | ``k`` (Σ kv·exp(z − m) / s, normalized).
Positions are grouped in 128-token chunks (chunk offset ``c = pos mod 128`` picks the ape row); the
state is reset at chunk offset 0 and the pooled row is emitted when offset 127 has been folded in.

* Decode (one DecodePlan row per request): ``c = (seq_len − 1) mod 128``; load the state from
  ``read_page_0`` unless ``c == 0``; fold the token in; ``c == 127`` emits ``k'`` to output row b and
  stores nothing, otherwise ``(m', s', k')`` goes to ``write_loc`` and output row b is zero (contract §9.3).
* Prefill (segment rows, see ``CompressorPrefillPlan.generate_online``): a segment of
  ``buffer_len`` tokens ending at ragged id ``ragged_id`` and chunk offset ``(seq_len − 1) mod 128``
  is pooled into a partial state; unless it starts at chunk offset 0 it is merged into the stored state
  of ``read_page_1`` (``read_page_0`` if ``read_page_1 < 0``). plan_c rows (run first) write the pooled
  ``k`` to output row i; plan_w rows (run second) store the state into ``read_page_0``.

A segment's partial state is computed in closed form (max, then one exp per token), which is the
sequential update of contract §5.2 regrouped exactly (``online_pool`` of reference/compress.py is the literal
token-by-token form; tests check they agree).
"""

from __future__ import annotations

import torch

from dsv4jit.plan_layout import decode_compress_plan, decode_decode_plan
from dsv4jit.reference.compress import (
    OnlineState,
    online_merge,
    online_reset,
    online_state_from_row,
    online_state_to_row,
    online_update,
)

__all__ = ["CHUNK", "online_decode", "online_prefill", "segment_state"]

#: Tokens per compressed row (the ratio): the state restarts every CHUNK positions.
CHUNK = 128
_STATE_DTYPES = (torch.float32, torch.bfloat16)


def segment_state(kv: torch.Tensor, score_plus_ape: torch.Tensor) -> OnlineState:
    """Partial state ``(m, s, k)`` of a segment of ``n ≥ 1`` tokens (``[n, hd]`` each), in their dtype."""
    m = score_plus_ape.amax(dim=0)
    e = torch.exp(score_plus_ape - m)
    s = e.sum(dim=0)
    return OnlineState(m, s, (kv * e).sum(dim=0) / s)


def _check(state, inputs, ape, out, head_dim, out_rows):
    if head_dim <= 0 or head_dim % 64:
        raise ValueError(f"head_dim: expected a positive multiple of 64, got {head_dim}")
    if state.dtype not in _STATE_DTYPES:
        raise TypeError(f"kv_score_buffer: expected dtype float32 or bfloat16, got {state.dtype}")
    for name, t in (("kv_score_input", inputs), ("ape", ape)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32 (online c128), got {t.dtype}")
    if out.dtype not in (torch.float32, torch.float64):  # fp64: the tests' model output
        raise TypeError(f"out: expected dtype float32 (or float64), got {out.dtype}")
    if state.shape[-1] != 3 * head_dim or not state.is_contiguous():
        raise ValueError(f"kv_score_buffer: expected a contiguous [rows, 1, {3 * head_dim}] (or flat) state, "
                         f"got shape {list(state.shape)}")
    if inputs.dim() != 2 or inputs.shape[1] != 2 * head_dim:
        raise ValueError(f"kv_score_input: expected shape [rows, {2 * head_dim}], got {list(inputs.shape)}")
    if list(ape.shape) != [CHUNK, head_dim]:
        raise ValueError(f"ape: expected shape [{CHUNK}, {head_dim}], got {list(ape.shape)}")
    if list(out.shape) != [out_rows, head_dim]:
        raise ValueError(f"out: expected shape [{out_rows}, {head_dim}], got {list(out.shape)}")


def _check_slot(plan: str, what: str, slot: int, rows: int) -> None:
    if not 0 <= slot < rows:
        raise ValueError(f"{plan}: {what} must lie in [0, {rows}) (the state rows of kv_score_buffer), got {slot}")


def online_decode(kv_score_buffer, kv_score_input, ape, plan_d, *, head_dim, out, dtype=torch.float32):
    """One decode step: fold each request's token into its state (math in ``dtype``); returns ``out``."""
    _check(kv_score_buffer, kv_score_input, ape, out, head_dim, plan_d.shape[0])
    if kv_score_input.shape[0] != plan_d.shape[0]:
        raise ValueError(f"kv_score_input: expected {plan_d.shape[0]} rows (plan_d rows), "
                         f"got {kv_score_input.shape[0]}")
    d = decode_decode_plan(plan_d)
    flat = kv_score_buffer.view(-1, 3 * head_dim)
    chunk_pos = [(int(seq_len) - 1) % CHUNK for seq_len in d.seq_len]
    for b, c in enumerate(chunk_pos):  # every slot checked before anything is written
        if c != 0:
            _check_slot("plan_d", f"read_page_0 of row {b}", int(d.read_page_0[b]), flat.shape[0])
        if c != CHUNK - 1:
            _check_slot("plan_d", f"write_loc of row {b}", int(d.write_loc[b]), flat.shape[0])
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
    rows = decode_compress_plan(plan)
    result = []
    for i in torch.nonzero(rows.valid).flatten().tolist():
        end = (int(rows.seq_len[i]) - 1) % CHUNK + 1        # chunk offsets [end - n, end)
        n, last = int(rows.buffer_len[i]), int(rows.ragged_id[i])
        if not 1 <= n <= end or last - n + 1 < 0 or last >= inputs.shape[0]:
            raise ValueError(f"{name}: row {i} (a segment of {n} tokens ending at ragged id {last}, chunk offset "
                             f"{end - 1}) does not fit the chunk or kv_score_input ({inputs.shape[0]} rows)")
        tokens = inputs[last - n + 1:last + 1].to(dtype)
        state = segment_state(tokens[:, :head_dim], tokens[:, head_dim:] + ape[end - n:end].to(dtype))
        if end - n > 0:  # continues a chunk: merge into the stored partial state
            load = int(rows.read_page_1[i]) if int(rows.read_page_1[i]) >= 0 else int(rows.read_page_0[i])
            _check_slot(name, f"the state row read by row {i}", load, flat.shape[0])
            state = online_merge(online_state_from_row(flat[load], head_dim, dtype), state)
        result.append((i, state, int(rows.read_page_0[i])))
    return result


def online_prefill(kv_score_buffer, kv_score_input, ape, plan_c, plan_w, *, head_dim, out, dtype=torch.float32):
    """One prefill step: compress pass (plan_c -> out rows), then write pass (plan_w -> state); returns ``out``."""
    _check(kv_score_buffer, kv_score_input, ape, out, head_dim, plan_c.shape[0])
    flat = kv_score_buffer.view(-1, 3 * head_dim)
    # Every stored state is read (by both passes' merges) before any is written, and every row
    # checked before anything is written.
    pooled = _segments("plan_c", plan_c, kv_score_input, ape, flat, head_dim, dtype)
    stores = _segments("plan_w", plan_w, kv_score_input, ape, flat, head_dim, dtype)
    for i, _, slot in stores:
        _check_slot("plan_w", f"read_page_0 of row {i}", slot, flat.shape[0])
    for i, state, _ in pooled:
        out[i] = state.k.to(out.dtype)
    for _, state, slot in stores:
        flat[slot] = online_state_to_row(state, flat.dtype)
    return out
