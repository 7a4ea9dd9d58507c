"""Online c128 with speculative decoding (contract §5.6): the three draft-state ops a serving stack
calls around a verify step, under upstream's names and signatures.

The state pool of the online compressor holds banks of ``state_slot_stride`` rows: bank 0 the main
states (row = request slot), bank ``k`` the state after the first ``k`` draft tokens of a verify.
``online_c128_mtp_write_prefix_states`` fills the draft banks from the verify batch's tokens,
``online_c128_mtp_mark_pending`` records the lengths before the verify, and
``online_c128_mtp_commit_pending`` copies each request's accepted-prefix state into its main row.
CUDA tensors run csrc/compress/online_mtp.cuh, CPU tensors reference/online_mtp.py. The requests are
checked as the planner checks them (no negative length, no slot named twice) on every all-CPU call
and, in checked mode, on the GPU; an empty batch (``batch_size`` 0) writes nothing and launches nothing.
"""

from __future__ import annotations

import torch

from .. import library, runtime
from ..arguments import STATE_DTYPES, dtype_key
from ..errors import ArgumentError
from ..family import Family, KernelChoice
from ..geometry import online_input_width, online_state_width
from ..jit.kernels import ONLINE_MTP
from ..reference import online_mtp as ref_mtp
from . import checked, common
from .online import RATIO

_WRITE = "online_c128_mtp_write_prefix_states"
_MARK = "online_c128_mtp_mark_pending"
_COMMIT = "online_c128_mtp_commit_pending"
_KERNEL_HEAD_DIMS = ONLINE_MTP.param("head_dim").choices


def kernel(head_dim: int, state: str) -> KernelChoice:
    """The variant a call runs (state by kernel dtype name: ``fp32``, ``bf16``)."""
    return "online_mtp", {"head_dim": head_dim, "state": state}


FAMILY = Family("online_mtp", lambda cfg: [kernel(hd, cfg.state) for hd in cfg.head_dims.get(RATIO, ())])

#: Each op's eager fast path: (head_dim, dtypes, device) -> the kernel export.
_WRITE_FAST, _MARK_FAST, _COMMIT_FAST = runtime.call_cache(), runtime.call_cache(), runtime.call_cache()


def _function(op: str, export: str, head_dim: int, state: str, device: torch.device):
    if head_dim not in _KERNEL_HEAD_DIMS:
        raise ArgumentError(f"dsv4jit.{op}: argument 'head_dim' must be one of {list(_KERNEL_HEAD_DIMS)} on CUDA, "
                            f"got {head_dim}")
    name, params = kernel(head_dim, state)
    return runtime.function(name, export, device, **params), name, params


def _eager_cuda(t: torch.Tensor) -> bool:
    """After a successful call: whether its signature may take the fast path next time."""
    return not library.tracing() and t.is_cuda and not runtime.checks_enabled()


def _widths(op: str, head_dim: int, rows: dict):
    """After a failed call: the explanation that names head_dim when the rows of `rows` (name ->
    (tensor, width as a function of head_dim)) do not have its width (a pool of another head_dim)."""
    return lambda text: common.check_widths(op, text, head_dim, "in the online compressor",
                                            {name: (t, width(head_dim)) for name, (t, width) in rows.items()})


def _scalars(op: str, values: dict) -> None:
    """TypeError naming an int argument of another type; ValueError for a head_dim the online
    compressor has no state row for."""
    if any(type(v) is not int for v in values.values()):
        common.scalars(op, values, {})
    head_dim = values["head_dim"]
    if head_dim <= 0 or head_dim % 128:
        raise ArgumentError(f"dsv4jit.{op}: argument 'head_dim' must be a positive multiple of 128, got {head_dim}")


def online_c128_mtp_write_prefix_states(kv_score_input: torch.Tensor, seq_lens: torch.Tensor,
                                        req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                        ape: torch.Tensor, state: torch.Tensor, batch_size: int,
                                        num_verify_tokens: int, state_slot_stride: int, *, head_dim: int) -> None:
    """Stage the state after each draft token of a verify batch in that token's draft slot.

    kv_score_input: ``[≥ batch_size·V, 2·head_dim]`` fp32, request-major (V = num_verify_tokens, 1–8).
    seq_lens: each request's length before the verify; req_pool_indices: its slot (main row), in
    ``[0, state_slot_stride)``; both int32 or int64. req_to_token: int32 ``[slots, tokens]`` (checked,
    not read). ape: ``[128, head_dim]``. state: the online pool ``[rows, 1, 3·head_dim]`` (or flat),
    fp32 or bf16, with ``rows ≥ (V + 1)·state_slot_stride``. The state after the first k + 1 tokens
    goes to row ``slot + (k + 1)·state_slot_stride``, unless that prefix closes a 128-token chunk.
    """
    if type(head_dim) is int and not library.tracing():
        try:
            fn = _WRITE_FAST[(head_dim, state.dtype, ape.dtype, kv_score_input.device)]
            return fn(kv_score_input, seq_lens, req_pool_indices, req_to_token, ape, state, batch_size,
                      num_verify_tokens, state_slot_stride, None)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass  # a new signature, or an error the full path explains
    op = _WRITE
    _scalars(op, {"batch_size": batch_size, "num_verify_tokens": num_verify_tokens,
                  "state_slot_stride": state_slot_stride, "head_dim": head_dim})
    try:
        write_prefix_op(kv_score_input, seq_lens, req_pool_indices, req_to_token, common.ape_as(op, ape, torch.float32),
                        state, batch_size, num_verify_tokens, state_slot_stride, head_dim)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("kv_score_input", "seq_lens", "req_pool_indices", "req_to_token",
                                              "ape", "state"), (),
                            _widths(op, head_dim, {"state": (state, online_state_width),
                                                   "kv_score_input": (kv_score_input, online_input_width),
                                                   "ape": (ape, lambda hd: hd)}))
    if ape.dtype == torch.float32 and _eager_cuda(state):
        _WRITE_FAST[(head_dim, state.dtype, ape.dtype, kv_score_input.device)] = _function(
            op, "write_prefix_states", head_dim, common.dtype_name(state, "state", op, STATE_DTYPES), state.device)[0]


def online_c128_mtp_mark_pending(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                                 pending_seq_lens: torch.Tensor, batch_size: int, num_req_slots: int, *,
                                 head_dim: int, state_dtype: torch.dtype) -> None:
    """Reset ``pending_seq_lens[:num_req_slots]`` to −1, then record each verify request's length
    (before the verify) under its slot. pending_seq_lens: int64. head_dim and state_dtype: those of the
    pools the commit will copy (they pick the kernel module, as for the other two ops)."""
    if type(head_dim) is int and not library.tracing():
        try:
            fn = _MARK_FAST[(head_dim, state_dtype, seq_lens.device)]
            return fn(seq_lens, req_pool_indices, pending_seq_lens, batch_size, num_req_slots)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass
    op = _MARK
    _scalars(op, {"batch_size": batch_size, "num_req_slots": num_req_slots, "head_dim": head_dim})
    try:
        state = dtype_key(state_dtype, op, "state_dtype", STATE_DTYPES)
        mark_pending_op(seq_lens, req_pool_indices, pending_seq_lens, batch_size, num_req_slots, head_dim, state)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("seq_lens", "req_pool_indices", "pending_seq_lens"))
    if _eager_cuda(seq_lens):
        _MARK_FAST[(head_dim, state_dtype, seq_lens.device)] = _function(op, "mark_pending", head_dim, state,
                                                                         seq_lens.device)[0]


def online_c128_mtp_commit_pending(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                                   req_to_token: torch.Tensor, pending_seq_lens: torch.Tensor, state: torch.Tensor,
                                   batch_size: int, num_verify_tokens: int, state_slot_stride: int,
                                   num_req_slots: int, *, head_dim: int) -> None:
    """Copy each request's accepted-prefix draft state into its main row.

    seq_lens: lengths after acceptance; a request whose slot has a pending length ``p ≥ 0`` accepted
    ``a = clamp(seq_len − p, 0, V)`` tokens; its row ``slot + a·state_slot_stride`` is copied to row
    ``slot`` unless ``a == 0`` or ``p + a`` is a multiple of 128. ``num_req_slots ≤ state_slot_stride``.
    """
    if type(head_dim) is int and not library.tracing():
        try:
            fn = _COMMIT_FAST[(head_dim, state.dtype, seq_lens.device)]
            return fn(seq_lens, req_pool_indices, req_to_token, pending_seq_lens, state, batch_size, num_verify_tokens,
                      state_slot_stride, num_req_slots)
        except (KeyError, AttributeError, TypeError, ValueError):
            pass
    op = _COMMIT
    _scalars(op, {"batch_size": batch_size, "num_verify_tokens": num_verify_tokens,
               "state_slot_stride": state_slot_stride, "num_req_slots": num_req_slots, "head_dim": head_dim})
    try:
        commit_pending_op(seq_lens, req_pool_indices, req_to_token, pending_seq_lens, state, batch_size,
                          num_verify_tokens, state_slot_stride, num_req_slots, head_dim)
    except (ValueError, TypeError, AttributeError) as e:
        common.public_error(op, e, locals(), ("seq_lens", "req_pool_indices", "req_to_token", "pending_seq_lens",
                                              "state"), (),
                            _widths(op, head_dim, {"state": (state, online_state_width)}))
    if _eager_cuda(seq_lens):
        _COMMIT_FAST[(head_dim, state.dtype, seq_lens.device)] = _function(
            op, "commit_pending", head_dim, common.dtype_name(state, "state", op, STATE_DTYPES), state.device)[0]


@library.custom_op("online_mtp_write_prefix_states", mutates_args=("state",))
def write_prefix_op(kv_score_input: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                    req_to_token: torch.Tensor, ape: torch.Tensor, state: torch.Tensor, batch_size: int,
                    num_verify_tokens: int, state_slot_stride: int, head_dim: int) -> None:
    """online_c128_mtp_write_prefix_states with ape in fp32."""
    device = common.cuda_device(kv_score_input, seq_lens, req_pool_indices, req_to_token, ape, state)
    if device is None:
        ref_mtp.write_prefix_states(kv_score_input, seq_lens, req_pool_indices, req_to_token, ape, state, batch_size,
                                    num_verify_tokens, state_slot_stride, head_dim=head_dim)
        return
    fn, name, params = _function(_WRITE, "write_prefix_states", head_dim,
                                 common.dtype_name(state, "state", _WRITE, STATE_DTYPES), device)
    status = runtime.status_word(device)
    if status is not None:  # the checks the reference makes on the CPU, before the launch
        ref_mtp.check_requests(seq_lens, req_pool_indices, batch_size)
        checked.inputs(_WRITE, kv_score_input=kv_score_input[:batch_size * num_verify_tokens], ape=ape)
    fn(kv_score_input, seq_lens, req_pool_indices, req_to_token, ape, state, batch_size, num_verify_tokens,
       state_slot_stride, status)
    runtime.raise_status(status, _WRITE, name, device, params)


@library.custom_op("online_mtp_mark_pending", mutates_args=("pending_seq_lens",))
def mark_pending_op(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, pending_seq_lens: torch.Tensor,
                    batch_size: int, num_req_slots: int, head_dim: int, state: str) -> None:
    """online_c128_mtp_mark_pending with the state dtype by kernel name."""
    device = common.cuda_device(seq_lens, req_pool_indices, pending_seq_lens)
    if device is None:
        ref_mtp.mark_pending(seq_lens, req_pool_indices, pending_seq_lens, batch_size, num_req_slots)
        return
    fn, _, _ = _function(_MARK, "mark_pending", head_dim, state, device)
    if runtime.checks_enabled():
        ref_mtp.check_requests(seq_lens, req_pool_indices, batch_size)
    fn(seq_lens, req_pool_indices, pending_seq_lens, batch_size, num_req_slots)


@library.custom_op("online_mtp_commit_pending", mutates_args=("state",))
def commit_pending_op(seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                      pending_seq_lens: torch.Tensor, state: torch.Tensor, batch_size: int, num_verify_tokens: int,
                      state_slot_stride: int, num_req_slots: int, head_dim: int) -> None:
    """online_c128_mtp_commit_pending."""
    device = common.cuda_device(seq_lens, req_pool_indices, req_to_token, pending_seq_lens, state)
    if device is None:
        ref_mtp.commit_pending(seq_lens, req_pool_indices, req_to_token, pending_seq_lens, state, batch_size,
                               num_verify_tokens, state_slot_stride, num_req_slots, head_dim=head_dim)
        return
    fn, _, _ = _function(_COMMIT, "commit_pending", head_dim,
                         common.dtype_name(state, "state", _COMMIT, STATE_DTYPES), device)
    if runtime.checks_enabled():
        ref_mtp.check_requests(seq_lens, req_pool_indices, batch_size)
    fn(seq_lens, req_pool_indices, req_to_token, pending_seq_lens, state, batch_size, num_verify_tokens,
       state_slot_stride, num_req_slots)
