"""Pure-PyTorch reference of online c128's speculative-decoding ops (contract §5.6): the CPU backend.

The state pool holds banks of ``state_slot_stride`` rows: bank 0 the requests' main states (row =
the request's slot), bank ``k`` the state after the first ``k`` draft tokens of the pending verify.

* ``write_prefix_states``: continue each request's main state (unless its length before the verify
  is a multiple of 128: a new chunk) with its ``V`` draft tokens, and store the state after token
  ``k`` in bank ``k + 1`` unless that prefix closes a 128-token chunk. The running state stays in fp32
  between tokens; only the stored copies take the pool's dtype.
* ``mark_pending``: reset the first ``num_req_slots`` pending lengths to −1, then record each batch
  request's length before the verify under its slot.
* ``commit_pending``: for each batch request with a recorded length, ``a`` = the accepted tokens
  (its length now minus the recorded one, clamped to ``[0, V]``); unless ``a == 0`` or the accepted
  prefix closes a chunk, copy bank ``a``'s row into the main row.

Every argument is checked before anything is written, the requests as the planner checks them
(`check_requests`: no negative length, no slot twice); an empty batch (``batch_size`` 0) writes
nothing.
"""

from __future__ import annotations

import torch

from dsv4jit.arguments import STATE_DTYPES, contiguous, distinct, dtype_in, finite, in_range
from dsv4jit.errors import ArgumentError
from dsv4jit.geometry import CHUNK, online_input_width, online_state_width
from dsv4jit.reference.online import online_reset, online_state_from_row, online_state_to_row, online_update

__all__ = ["MAX_VERIFY_TOKENS", "check_requests", "commit_pending", "mark_pending", "write_prefix_states"]

#: Draft tokens a verify step may feed per request.
MAX_VERIFY_TOKENS = 8


def _at_least(name: str, value: int, minimum: int, what: str = "") -> None:
    if value < minimum:
        raise ArgumentError(f"{name}: must be >= {minimum}{what}, got {value}")


def _indices(name: str, t: torch.Tensor, batch_size: int) -> torch.Tensor:
    dtype_in(name, t, (torch.int32, torch.int64))
    if t.dim() != 1 or t.shape[0] < batch_size:
        raise ArgumentError(f"{name}: expected a vector of at least batch_size = {batch_size} entries, "
                            f"got shape {list(t.shape)}")
    return t[:batch_size].to(torch.int64)


def check_requests(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                   batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's lengths and slots as int64, checked as the planner checks them: no negative
    length, and no slot named by two requests (the second would overwrite the first's rows, or its
    pending length). Slots outside a range an op reads are that op's to check, or to skip."""
    seq = _indices("seq_lens", seq_lens, batch_size)
    slots = _indices("req_pool_indices", req_pool_indices, batch_size)
    if seq.numel() and int(seq.min()) < 0:
        raise ArgumentError(f"seq_lens: entries must be >= 0, got {int(seq.min())}")
    distinct("req_pool_indices", slots, "of the batch name one slot (two requests would write one state)")
    return seq, slots


def _banks(state: torch.Tensor, head_dim: int, num_verify_tokens: int, state_slot_stride: int) -> torch.Tensor:
    """The pool as flat rows, after checking it holds a main bank and a draft bank per verify token."""
    if not 1 <= num_verify_tokens <= MAX_VERIFY_TOKENS:
        raise ArgumentError(f"num_verify_tokens: must be in [1, {MAX_VERIFY_TOKENS}], got {num_verify_tokens}")
    _at_least("state_slot_stride", state_slot_stride, 1)
    dtype_in("state", state, STATE_DTYPES)
    width = online_state_width(head_dim)
    if list(state.shape[1:]) not in ([width], [1, width]):
        raise ArgumentError(f"state: expected a [rows, 1, {width}] (or flat) pool, got shape {list(state.shape)}")
    contiguous("state", state)
    flat = state.view(-1, width)
    if flat.shape[0] < (num_verify_tokens + 1) * state_slot_stride:
        raise ArgumentError(f"state_slot_stride: must be at most num_state_rows / (num_verify_tokens + 1) = "
                            f"{flat.shape[0]} / {num_verify_tokens + 1} (a main bank and a draft bank per verify "
                            f"token), got {state_slot_stride}")
    return flat


def _pending(pending_seq_lens: torch.Tensor, num_req_slots: int) -> None:
    _at_least("num_req_slots", num_req_slots, 0)
    dtype_in("pending_seq_lens", pending_seq_lens, (torch.int64,))
    if pending_seq_lens.dim() != 1 or pending_seq_lens.shape[0] < num_req_slots:
        raise ArgumentError(f"num_req_slots: must be at most the entries of pending_seq_lens (shape "
                            f"{list(pending_seq_lens.shape)}), got {num_req_slots}")


def _req_to_token(req_to_token: torch.Tensor) -> None:
    """Checked as the kernels check it; its rows are not read (the slots come from req_pool_indices)."""
    dtype_in("req_to_token", req_to_token, (torch.int32,))
    if req_to_token.dim() != 2:
        raise ArgumentError(f"req_to_token: expected 2 dimensions, got shape {list(req_to_token.shape)}")


def write_prefix_states(kv_score_input: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                        req_to_token: torch.Tensor, ape: torch.Tensor, state: torch.Tensor, batch_size: int, num_verify_tokens: int,
                        state_slot_stride: int, *, head_dim: int, dtype: torch.dtype = torch.float32) -> None:
    """Store each request's state after each prefix of its draft tokens (math in ``dtype``)."""
    _at_least("batch_size", batch_size, 0)
    flat = _banks(state, head_dim, num_verify_tokens, state_slot_stride)
    dtype_in("kv_score_input", kv_score_input, (torch.float32,), " (online c128)")
    dtype_in("ape", ape, (torch.float32,), " (online c128)")
    if kv_score_input.dim() != 2 or kv_score_input.shape[1] != online_input_width(head_dim) \
            or kv_score_input.shape[0] < batch_size * num_verify_tokens:
        raise ArgumentError(f"kv_score_input: expected [>= batch_size · num_verify_tokens = "
                            f"{batch_size * num_verify_tokens}, {online_input_width(head_dim)}], got "
                            f"{list(kv_score_input.shape)}")
    contiguous("kv_score_input", kv_score_input)
    if list(ape.shape) != [CHUNK, head_dim]:
        raise ArgumentError(f"ape: expected shape [{CHUNK}, {head_dim}], got {list(ape.shape)}")
    _req_to_token(req_to_token)
    seq, slots = check_requests(seq_lens, req_pool_indices, batch_size)
    in_range("req_pool_indices", "every entry", slots, state_slot_stride, "the main bank: [0, state_slot_stride)")
    tokens = kv_score_input[:batch_size * num_verify_tokens]
    finite("kv_score_input", tokens)
    finite("ape", ape)
    if batch_size == 0:
        return  # an empty verify writes nothing
    tokens = tokens.view(batch_size, num_verify_tokens, -1).to(dtype)
    stores = []  # every main state is read before any draft row is written
    for b, (length, slot) in enumerate(zip(seq.tolist(), slots.tolist())):
        start = length % CHUNK
        run = online_state_from_row(flat[slot], head_dim, dtype) if start else None
        for k in range(num_verify_tokens):
            offset = (start + k) % CHUNK
            kv, z = tokens[b, k, :head_dim], tokens[b, k, head_dim:] + ape[offset].to(dtype)
            run = online_reset(kv, z) if offset == 0 else online_update(run, kv, z)
            if (length + k + 1) % CHUNK:
                stores.append((slot + (k + 1) * state_slot_stride, online_state_to_row(run, flat.dtype)))
    for row, value in stores:
        flat[row] = value


def mark_pending(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, pending_seq_lens: torch.Tensor,
                 batch_size: int, num_req_slots: int) -> None:
    """Reset the pending lengths, then record this verify batch's lengths under its slots."""
    _at_least("batch_size", batch_size, 0)
    _pending(pending_seq_lens, num_req_slots)
    seq, slots = check_requests(seq_lens, req_pool_indices, batch_size)
    if batch_size == 0:
        return  # an empty verify records nothing (and resets nothing)
    pending_seq_lens[:num_req_slots] = -1
    keep = (slots >= 0) & (slots < num_req_slots)
    pending_seq_lens[slots[keep]] = seq[keep]


def commit_pending(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                   pending_seq_lens: torch.Tensor, state: torch.Tensor, batch_size: int, num_verify_tokens: int, state_slot_stride: int,
                   num_req_slots: int, *, head_dim: int) -> None:
    """Copy each request's accepted-prefix draft state into its main row."""
    _at_least("batch_size", batch_size, 0)
    flat = _banks(state, head_dim, num_verify_tokens, state_slot_stride)
    _pending(pending_seq_lens, num_req_slots)
    if num_req_slots > state_slot_stride:
        raise ArgumentError(f"state_slot_stride: must be at least num_req_slots = {num_req_slots} (a draft bank must "
                            f"not reach into the main one), got {state_slot_stride}")
    _req_to_token(req_to_token)
    seq, slots = check_requests(seq_lens, req_pool_indices, batch_size)
    for length, slot in zip(seq.tolist(), slots.tolist()):
        if not 0 <= slot < num_req_slots or int(pending_seq_lens[slot]) < 0:
            continue  # not a request of the pending verify
        before = int(pending_seq_lens[slot])
        accepted = min(max(length - before, 0), num_verify_tokens)
        if accepted and (before + accepted) % CHUNK:
            flat[slot] = flat[slot + accepted * state_slot_stride]
