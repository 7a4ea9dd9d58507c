"""Random paged pools and batches shared by planner and compress tests."""

from __future__ import annotations

import torch

SWA_PAGE = 256


def random_pool(num_reqs: int, max_ctx: int, gen: torch.Generator, evict_fraction: float = 0.0):
    """req_to_token / full_to_state with page-aligned SWA slots (swa % 256 == pos % 256).

    Full pages and SWA pages are random permutations; `evict_fraction` of the SWA mappings are -1
    (as the serving pool marks evicted slots). full_to_state ends with the -1 sentinel entry.
    """
    pages_per_req = (max_ctx + SWA_PAGE - 1) // SWA_PAGE
    n_pages = num_reqs * pages_per_req
    full_page = torch.randperm(n_pages, generator=gen).reshape(num_reqs, pages_per_req)
    swa_page = torch.randperm(n_pages, generator=gen)
    pos = torch.arange(max_ctx)
    req_to_token = (full_page[:, pos // SWA_PAGE] * SWA_PAGE + pos % SWA_PAGE).to(torch.int32)
    offsets = torch.arange(SWA_PAGE)
    full_to_state = (swa_page[:, None] * SWA_PAGE + offsets).reshape(-1).to(torch.int64)
    if evict_fraction > 0:
        evicted = torch.rand(full_to_state.shape, generator=gen) < evict_fraction
        full_to_state[evicted] = -1
    full_to_state = torch.cat([full_to_state, torch.tensor([-1], dtype=torch.int64)])
    return req_to_token, full_to_state


def random_batch(batch: int, gen: torch.Generator, max_extend: int = 300, max_prefix: int = 700,
                 uniform_extend: int | None = None):
    """(seq_lens, extend_lens) with extend >= 1 and prefixes not aligned to any ratio."""
    if uniform_extend is not None:
        ext = torch.full((batch,), uniform_extend, dtype=torch.int64)
    else:
        ext = torch.randint(1, max_extend + 1, (batch,), generator=gen, dtype=torch.int64)
        ext[torch.rand(batch, generator=gen) < 0.2] = 1
    prefix = torch.randint(0, max_prefix + 1, (batch,), generator=gen, dtype=torch.int64)
    return prefix + ext, ext


def planner_inputs(seed: int, batch: int, **batch_kw):
    """A random batch on a random paged pool: (req_pool_indices, seq_lens, extend_lens, req_to_token,
    full_to_state), with a few evicted SWA slots and more request slots than requests."""
    gen = torch.Generator().manual_seed(seed)
    seq, ext = random_batch(batch, gen, **batch_kw)
    num_reqs = batch + 3
    r2t, f2s = random_pool(num_reqs, int(seq.max()) + 64, gen, evict_fraction=0.05)
    rpi = torch.randperm(num_reqs, generator=gen)[:batch].to(torch.int64)
    return rpi, seq, ext, r2t, f2s
