"""Byte layouts of the plan rows, in one place for Python.

Plans travel as ``uint8`` tensors ``[rows, 16]`` (CompressPlan, OnlinePlan, DecodePlan) or
``[rows, 8]`` (WritePlan); the kernels reinterpret the bytes (see ``csrc/common/plan_structs.h`` for
the C++ side). This module encodes and decodes them for the reference planner, tests and debugging.

CompressPlan (16 B): u32 seq_len | u16 ragged_id | u16 buffer_len | i32 read_page_0 | i32 read_page_1
OnlinePlan   (16 B): u32 seq_len | u16 ragged_id | u16 segment_len | i32 store_slot | i32 load_slot
                     (the online c128 prefill's segment rows: CompressPlan's layout, fields of their own)
WritePlan    ( 8 B): u32 ragged_id | i32 write_loc
DecodePlan   (16 B): u32 seq_len | i32 write_loc | i32 read_page_0 | i32 read_page_1
Legacy PrefillPlan of the older c4 kernel (16 B): u32 ragged_id | u32 batch_id | u32 position | u32 window_len
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import ArgumentError

COMPRESS_PLAN_BYTES = 16
ONLINE_PLAN_BYTES = 16  # CompressPlan's layout (contract §2.5)
WRITE_PLAN_BYTES = 8
DECODE_PLAN_BYTES = 16
LEGACY_PLAN_BYTES = 16  # the older c4 kernel's PrefillPlan {ragged_id, batch_id, position, window_len}
#: ``seq_len`` (CompressPlan, OnlinePlan) and ``ragged_id`` (WritePlan) of an invalid row.
INVALID_U32 = 0xFFFFFFFF


def _words(plan: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """The plan as int64 columns of its 32-bit words (u32 fields come out non-negative)."""
    if plan.dtype != torch.uint8 or plan.dim() != 2 or plan.shape[1] != row_bytes:
        raise ArgumentError(f"expected a uint8 plan of shape [rows, {row_bytes}], got {list(plan.shape)} {plan.dtype}")
    return plan.detach().cpu().contiguous().view(torch.int32).to(torch.int64)


def _pack(columns: list[torch.Tensor]) -> torch.Tensor:
    """Pack int64 columns (each a 32-bit pattern) into a uint8 plan tensor."""
    if columns[0].numel():
        words = torch.stack([c.to(torch.int64) for c in columns], dim=1)
    else:
        words = torch.zeros(0, len(columns), dtype=torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous().view(torch.uint8).reshape(-1, 4 * len(columns))


class CompressRows(NamedTuple):
    seq_len: torch.Tensor
    ragged_id: torch.Tensor
    buffer_len: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.seq_len != INVALID_U32


class OnlineRows(NamedTuple):
    """Fields of online segment rows (contract §2.5): ``segment_len`` tokens ending at ragged id
    ``ragged_id`` and position ``seq_len - 1``, inside one 128-token chunk; the state goes to
    ``store_slot``, and a segment that continues its chunk merges the state of ``load_slot``
    (``store_slot`` where ``load_slot < 0``)."""

    seq_len: torch.Tensor
    ragged_id: torch.Tensor
    segment_len: torch.Tensor
    store_slot: torch.Tensor
    load_slot: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.seq_len != INVALID_U32


class WriteRows(NamedTuple):
    ragged_id: torch.Tensor
    write_loc: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.ragged_id != INVALID_U32


class DecodeRows(NamedTuple):
    seq_len: torch.Tensor
    write_loc: torch.Tensor
    read_page_0: torch.Tensor
    read_page_1: torch.Tensor


class LegacyRows(NamedTuple):
    """Fields of the older 16-byte PrefillPlan rows (int64 columns holding the u32 values)."""

    ragged_id: torch.Tensor
    batch_id: torch.Tensor
    position: torch.Tensor
    window_len: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.ragged_id != INVALID_U32


def decode_legacy_plan(plan: torch.Tensor) -> LegacyRows:
    u32 = _words(plan, LEGACY_PLAN_BYTES) & 0xFFFFFFFF
    return LegacyRows(u32[:, 0], u32[:, 1], u32[:, 2], u32[:, 3])


def encode_legacy_plan(ragged_id, batch_id, position, window_len) -> torch.Tensor:
    """``uint8 [rows, 16]`` plan from four equal-length integer sequences (u32 values)."""
    return _pack([torch.as_tensor(c, dtype=torch.int64) for c in (ragged_id, batch_id, position, window_len)])


def decode_compress_plan(plan: torch.Tensor) -> CompressRows:
    w = _words(plan, COMPRESS_PLAN_BYTES)
    u32 = w & 0xFFFFFFFF
    return CompressRows(u32[:, 0], w[:, 1] & 0xFFFF, (w[:, 1] >> 16) & 0xFFFF, w[:, 2], w[:, 3])


def encode_compress_plan(seq_len, ragged_id, buffer_len, read_page_0, read_page_1) -> torch.Tensor:
    ragged_id, buffer_len = torch.as_tensor(ragged_id), torch.as_tensor(buffer_len)
    return _pack([torch.as_tensor(seq_len), ragged_id | (buffer_len << 16),
                  torch.as_tensor(read_page_0), torch.as_tensor(read_page_1)])


def decode_online_plan(plan: torch.Tensor) -> OnlineRows:
    return OnlineRows(*decode_compress_plan(plan))  # the same words, named for what they hold


def decode_write_plan(plan: torch.Tensor) -> WriteRows:
    w = _words(plan, WRITE_PLAN_BYTES)
    return WriteRows(w[:, 0] & 0xFFFFFFFF, w[:, 1])


def encode_write_plan(ragged_id, write_loc) -> torch.Tensor:
    return _pack([torch.as_tensor(ragged_id), torch.as_tensor(write_loc)])


def decode_decode_plan(plan: torch.Tensor) -> DecodeRows:
    w = _words(plan, DECODE_PLAN_BYTES)
    return DecodeRows(w[:, 0] & 0xFFFFFFFF, w[:, 1], w[:, 2], w[:, 3])


def encode_decode_plan(seq_len, write_loc, read_page_0, read_page_1) -> torch.Tensor:
    return _pack([torch.as_tensor(seq_len), torch.as_tensor(write_loc),
                  torch.as_tensor(read_page_0), torch.as_tensor(read_page_1)])


def invalid_compress_rows(n: int) -> torch.Tensor:
    full = torch.full((n,), INVALID_U32, dtype=torch.int64)
    zero = torch.zeros(n, dtype=torch.int64)
    return encode_compress_plan(full, zero, zero, zero - 1, zero - 1)


def invalid_write_rows(n: int) -> torch.Tensor:
    return encode_write_plan(torch.full((n,), INVALID_U32, dtype=torch.int64), torch.full((n,), -1, dtype=torch.int64))
