"""Byte addressing of the paged caches the references write (contract §6.5; the V4.1 layouts:
contract §10.1).

A cache is a 2-D ``uint8`` tensor, one page per row. Location ``loc`` lives in page
``loc >> log2(page_size)`` at slot ``loc & (page_size − 1)``; where a slot's bytes lie inside its page
is the format's business (the callers give the byte offsets). Gathers and scatters run on the
cache's own device; everything they return is on the CPU.
"""

from __future__ import annotations

import torch

from ..arguments import contiguous
from ..errors import ArgumentError, ArgumentTypeError


def check_cache(kvcache: torch.Tensor, width: int, formula: str, name: str = "kvcache") -> None:
    """Raise unless ``kvcache`` is a 2-D uint8 tensor of rows of ``width`` bytes (``formula``: how the
    width comes about, for the message)."""
    if kvcache.dtype != torch.uint8 or kvcache.dim() != 2:
        raise ArgumentTypeError(f"{name} must be a 2-D uint8 tensor, got {kvcache.dim()}-D {kvcache.dtype}")
    if kvcache.shape[1] != width:
        raise ArgumentError(f"{name} rows must be {formula} = {width} bytes, got {kvcache.shape[1]}")
    contiguous(name, kvcache)  # one rule on the CPU and the GPU (the kernels take contiguous pages)


def page_slot(kvcache: torch.Tensor, locs, page_size: int, name: str = "out_loc"):
    """(page, slot) int64 CPU tensors of each location, after checking that each lies in the cache
    (``name``: the argument the locations come from)."""
    locs = torch.as_tensor(locs).detach().cpu().to(torch.int64).reshape(-1)
    shift = page_size.bit_length() - 1
    page, slot = locs >> shift, locs & (page_size - 1)
    if locs.numel() and (bool((locs < 0).any()) or int(page.max()) >= kvcache.shape[0]):
        raise ArgumentError(f"{name}: the cache locations of the stored rows must lie in "
                            f"[0, {kvcache.shape[0] * page_size}) ({kvcache.shape[0]} pages of {page_size} "
                            f"in the cache), "
                            f"got min {int(locs.min())} max {int(locs.max())}")
    return page, slot


def scatter(kvcache: torch.Tensor, page: torch.Tensor, offset: torch.Tensor, data: torch.Tensor) -> None:
    """kvcache[page[i], offset[i] + j] = data[i, j] (data: uint8 [n, L])."""
    cols = offset[:, None] + torch.arange(data.shape[1], dtype=torch.int64)
    dev = kvcache.device
    kvcache[page[:, None].expand_as(cols).to(dev), cols.to(dev)] = data.to(dev)


def gather(kvcache: torch.Tensor, page: torch.Tensor, offset: torch.Tensor, length: int) -> torch.Tensor:
    """uint8 [n, length] CPU tensor of kvcache[page[i], offset[i] + j]."""
    cols = offset[:, None] + torch.arange(length, dtype=torch.int64)
    dev = kvcache.device
    return kvcache[page[:, None].expand_as(cols).to(dev), cols.to(dev)].cpu().contiguous()


def as_rows(values: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``values`` as contiguous fp32 CPU rows ``[n, head_dim]``."""
    values = values.detach().cpu().to(torch.float32)
    if values.dim() != 2 or values.shape[1] != head_dim:
        raise ArgumentError(f"values must be [n, {head_dim}], got {list(values.shape)}")
    return values.contiguous()
