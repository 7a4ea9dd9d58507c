"""The per-token metadata of a step that the DeepSeek-V4.1 ratio-1 and ratio-2 ops take in place of a
plan (contract §10.6): each token's position, request slot and full-pool slot, and where the index-K
store of each ratio puts it.

Built with a fixed number of torch ops on the device of the inputs and no host sync (no ``.item()``,
no data-dependent shape): on CUDA it runs inside a CUDA graph, and a step's metadata is built once
and shared by every ratio-1 and ratio-2 layer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import arguments, runtime
from .errors import ArgumentError, ArgumentTypeError

_OP = "low_ratio_metadata"


class LowRatioMetadata(NamedTuple):
    """One step's tokens in batch order (``N`` rows, the step's padded token count); rows past the
    batch's tokens are padding: position, request and slots 0."""

    positions: torch.Tensor  #: int64 [N], the token's position
    req: torch.Tensor  #: int64 [N], the token's request slot (req_pool_indices per token)
    raw_out_loc: torch.Tensor  #: int64 [N], the token's full-pool slot, req_to_token[req, position]
    c1_out_loc: torch.Tensor  #: int64 [N], ratio 1's index-K slot: raw_out_loc
    c2_out_loc: torch.Tensor  #: int64 [N], ratio 2's: raw_out_loc // 2 at an odd position, else -1
    extend_start_loc: torch.Tensor  #: int32 [B], each request's first row
    extend_seq_lens: torch.Tensor  #: int32 [B], each request's rows


def low_ratio_metadata(req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                       req_to_token: torch.Tensor, num_tokens: int) -> LowRatioMetadata:
    """The metadata of a step of ``B`` requests: request b has ``seq_lens[b]`` tokens after the step, of
    which the last ``extend_lens[b]`` are this step's (1 in decode, the draft length in a speculative
    verify, the chunk in an extend); ``num_tokens`` (``N``) is the step's row count, at least the sum
    of ``extend_lens`` (a CUDA graph pads the batch). req_pool_indices, seq_lens, extend_lens: int32 or
    int64 ``[B]`` on one device; req_to_token: int32 ``[slots, context]``.

    Shapes, dtypes and devices are checked on every call; the values on all-CPU calls and in checked
    mode (contract §8.5), as a CUDA check needs a host sync."""
    num_tokens = arguments.integer(_OP, "num_tokens", num_tokens)
    tensors = {"req_pool_indices": req_pool_indices, "seq_lens": seq_lens, "extend_lens": extend_lens}
    for name, t in tensors.items():
        _check_int(name, t, 1, (torch.int32, torch.int64))
        if t.shape != req_pool_indices.shape:
            raise ArgumentError(f"dsv4jit.{_OP}: argument '{name}' must have shape {list(req_pool_indices.shape)} "
                                f"(one entry per request, as req_pool_indices), got {list(t.shape)}")
    _check_int("req_to_token", req_to_token, 2, (torch.int32,))
    arguments.one_device(_OP, {**tensors, "req_to_token": req_to_token})
    if num_tokens < 0:
        raise ArgumentError(f"dsv4jit.{_OP}: argument 'num_tokens' must be >= 0, got {num_tokens}")
    if req_pool_indices.device.type == "cpu" or runtime.checks_enabled():  # checked mode may sync
        _check_values(*(t.cpu() for t in (req_pool_indices, seq_lens, extend_lens)), req_to_token.shape, num_tokens)

    device = req_pool_indices.device
    rows = torch.arange(num_tokens, device=device)
    if req_pool_indices.numel() == 0:  # no request: every row is padding
        zeros = torch.zeros_like(rows)
        starts = torch.zeros(0, dtype=torch.int32, device=device)
        return LowRatioMetadata(zeros, zeros.clone(), zeros.clone(), zeros.clone(), zeros.clone(), starts, starts)
    lens = extend_lens.long()
    ends = torch.cumsum(lens, 0)
    starts = ends - lens
    # each row's request: the first whose rows end beyond it; B (clamped below) for a padded row
    owner = torch.searchsorted(ends, rows, right=True)
    real = owner < lens.numel()
    b = owner.clamp(max=lens.numel() - 1)
    positions = torch.where(real, seq_lens.long()[b] - lens[b] + (rows - starts[b]), 0)
    req = torch.where(real, req_pool_indices.long()[b], 0)
    # clamped so that values the CUDA path does not check read a wrong slot rather than fault
    slots, context = req_to_token.shape
    raw_out_loc = torch.where(real, req_to_token[req.clamp(0, slots - 1), positions.clamp(0, context - 1)].long(), 0)
    c2_out_loc = torch.where(real & (positions % 2 == 0), -1, raw_out_loc // 2)
    return LowRatioMetadata(positions, req, raw_out_loc, raw_out_loc.clone(), c2_out_loc,
                            starts.int(), extend_lens.int())


def _check_int(name: str, t, dims: int, dtypes: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"dsv4jit.{_OP}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ArgumentTypeError(f"dsv4jit.{_OP}: argument '{name}': dtype must be "
                                f"{' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dims:
        raise ArgumentError(f"dsv4jit.{_OP}: argument '{name}' must have {dims} dimension{'s' * (dims > 1)}, "
                            f"got shape {list(t.shape)}")


def _check_values(req_pool_indices, seq_lens, extend_lens, table_shape, num_tokens: int) -> None:
    """All-CPU calls and checked mode: the values, each named (on CUDA a check needs a sync)."""
    slots, context = table_shape
    checks = (
        ("extend_lens", bool((extend_lens < 0).any()), "entries must be >= 0"),
        ("extend_lens", int(extend_lens.sum()) > num_tokens,
         f"entries must sum to at most num_tokens ({num_tokens}), got {int(extend_lens.sum())}"),
        ("seq_lens", bool((seq_lens < extend_lens).any()), "entries must be >= extend_lens (the step's tokens)"),
        ("seq_lens", bool((seq_lens > context).any()), f"entries must be <= req_to_token's context ({context})"),
        ("req_pool_indices", bool(((req_pool_indices < 0) | (req_pool_indices >= slots)).any()),
         f"entries must lie in [0, {slots}) (req_to_token's rows)"),
    )
    for name, failed, what in checks:
        if failed:
            raise ArgumentError(f"dsv4jit.{_OP}: argument '{name}': {what}")
