"""Rows of one step of a ratio-1 / ratio-2 layer (contract §10.4, contract §10.6), drawn on the CPU from a seed:
per row its request slot, position and full-pool slot (raw_out_loc; 0 = a padded row), requests back to
back with pages of their own (page 0, the padding sink, never handed out), and an extend's
extend_start_loc / extend_seq_lens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FULL_PAGE = 256  # the full pool's page: a c1 page, two c2 pages' worth of pairs


@dataclass
class Rows:
    req: torch.Tensor        # int64 [n]
    pos: torch.Tensor        # int64 [n]
    raw: torch.Tensor        # int64 [n]
    num_pages: int           # full pages addressed (page 0 included)
    num_slots: int           # request slots (ring rows: num_slots * ring_size + spare rows)
    starts: torch.Tensor     # int32 [requests]
    lens: torch.Tensor       # int32 [requests]

    @property
    def n(self) -> int:
        return self.raw.numel()

    def to(self, device) -> Rows:
        return Rows(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in
                      (self.req, self.pos, self.raw, self.num_pages, self.num_slots, self.starts, self.lens)))


def rows(first_pos: list[int], lens: list[int], *, pad: int = 0, seed: int = 0) -> Rows:
    """Request i has lens[i] consecutive rows from position first_pos[i], in a random slot of 2 × requests,
    on full pages of its own placed at random; then `pad` padded rows (req 0, position 0, raw 0)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(first_pos)
    slots = torch.randperm(2 * bs, generator=g)[:bs]
    req, pos, raw, starts = [], [], [], []
    span = max((f + n) // FULL_PAGE - f // FULL_PAGE + 1 for f, n in zip(first_pos, lens))
    placement = torch.randperm(bs, generator=g)
    for i, (first, n) in enumerate(zip(first_pos, lens)):
        starts.append(sum(lens[:i]))
        p = torch.arange(first, first + n)
        page = 1 + int(placement[i]) * span + (p // FULL_PAGE - first // FULL_PAGE)
        req.append(torch.full((n,), int(slots[i]))), pos.append(p), raw.append(page * FULL_PAGE + p % FULL_PAGE)
    z = torch.zeros(pad, dtype=torch.int64)
    cat = lambda parts: torch.cat([*parts, z]).to(torch.int64)  # noqa: E731
    return Rows(cat(req), cat(pos), cat(raw), 1 + bs * span, 2 * bs, torch.tensor(starts, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32))


def ring_rows(num_slots: int, ring_size: int) -> int:
    """A pair ring's rows: a ring per request slot, a spare ring and a "no slot" row, rounded up to even
    (contract §10.4)."""
    n = num_slots * ring_size + ring_size + 1
    return n + n % 2
