"""The compressors of DeepSeek-V4 layers: what each one owns, and the per-layer step.

A c4 layer has two compressors sharing the c4 plan (the core latent, head_dim 512, and the sparse
attention indexer, head_dim 128); a c128 layer has one (head_dim 512). ``step`` is the only place
the demo calls the ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..geometry import format_options, page_bytes
from ..ops import compress_and_store, compress_and_store_c4_layer, compress_forward, compress_norm_rope_store
from .pool import SWA_PAGE, PagedPool

NORM_EPS = 1e-6          # rms_norm_eps


@dataclass(frozen=True)
class CompressorSpec:
    name: str
    ratio: int
    head_dim: int
    store: str  # cache format (geometry.FORMATS)

    @property
    def ring_size(self) -> int:
        return 8 if self.ratio == 4 else 128  # no speculative decoding

    @property
    def window(self) -> int:
        return 8 if self.ratio == 4 else 128

    @property
    def last_dim(self) -> int:
        """Values per token row of the state and of the kv_score input (kv and score, overlap roles for c4)."""
        return (4 if self.ratio == 4 else 2) * self.head_dim

    @property
    def page_size(self) -> int:
        """Compressed tokens per cache page: one page per 256-token full page."""
        return SWA_PAGE // self.ratio

    @property
    def use_fp4(self) -> bool:
        return self.store == "indexer_fp4"

    @property
    def layout(self) -> str:
        """The KV layout argument of a 512-dim store (``v4`` for the V4 and indexer formats)."""
        return format_options(self.store)["layout"]


C4_CORE = CompressorSpec("c4 core", 4, 512, "v4_fp8")
C4_INDEXER_FP4 = CompressorSpec("c4 indexer", 4, 128, "indexer_fp4")
C4_INDEXER_FP8 = CompressorSpec("c4 indexer", 4, 128, "indexer_fp8")
C128_CORE = CompressorSpec("c128 core", 128, 512, "v4_fp8")


def layer_specs(num_layers: int, indexer_fp8: bool = False) -> list[tuple[CompressorSpec, ...]]:
    """Layers alternate compress ratios 4 and 128 (as DeepSeek-V4's compressed layers do)."""
    c4 = (C4_CORE, C4_INDEXER_FP8 if indexer_fp8 else C4_INDEXER_FP4)
    return [c4 if i % 2 == 0 else (C128_CORE,) for i in range(num_layers)]


class Compressor:
    """One compressor of one layer on one device: weights, its state ring pool and its cache."""

    def __init__(self, spec: CompressorSpec, pool: PagedPool, gen: torch.Generator, device: torch.device):
        self.spec = spec
        # c4 state follows SWA pages (a ring of 8 rows per page); c128 has a ring per request slot.
        rings = pool.num_swa_pages if spec.ratio == 4 else pool.num_slots
        rows = rings * spec.ring_size
        self.state = torch.zeros(rows // spec.ratio, spec.ratio, spec.last_dim, device=device)
        self.cache = torch.zeros(pool.num_full_pages, page_bytes(spec.store, spec.page_size), dtype=torch.uint8,
                                 device=device)
        # Weights are drawn on the CPU so that every engine of a run gets the same ones.
        self.ape = (0.5 * torch.randn(spec.window, spec.head_dim, generator=gen)).to(device)
        self.norm_weight = (0.5 + torch.rand(spec.head_dim, generator=gen)).to(device)


def step(comp: Compressor, plan, kv_score: torch.Tensor, out_loc: torch.Tensor, freq_cis: torch.Tensor, *,
         fused: bool = False) -> None:
    """One compressor for one forward step: pool the windows this step closes and update the state
    ring, then RMSNorm + RoPE (+ Hadamard) + quantize into the compressed cache (`fused`: in one
    op, compress_and_store; the same bytes)."""
    spec = comp.spec
    if fused:
        compress_and_store(comp.state, kv_score, comp.ape, plan, head_dim=spec.head_dim, compress_ratio=spec.ratio,
                           norm_weight=comp.norm_weight, norm_eps=NORM_EPS, freq_cis=freq_cis, out_loc=out_loc,
                           kvcache=comp.cache, page_size=spec.page_size, use_fp4=spec.use_fp4, layout=spec.layout)
        return
    kv = compress_forward(comp.state, kv_score, comp.ape, plan, head_dim=spec.head_dim, compress_ratio=spec.ratio)
    compress_norm_rope_store(kv, plan, norm_weight=comp.norm_weight, norm_eps=NORM_EPS, freq_cis=freq_cis,
                             out_loc=out_loc, kvcache=comp.cache, page_size=spec.page_size, use_fp4=spec.use_fp4,
                             layout=spec.layout)


def layer_step(comps: list[Compressor], plan, kv_scores: list[torch.Tensor], out_loc: torch.Tensor,
               freq_cis: torch.Tensor, *, fused: bool = False) -> None:
    """One layer's compressors for one forward step; `fused`: a c4 layer's two in one op
    (compress_and_store_c4_layer, one launch per pass), any other compressor through compress_and_store."""
    if fused and len(comps) == 2:
        core, indexer = comps
        compress_and_store_c4_layer(core.state, kv_scores[0], core.ape, indexer.state, kv_scores[1], indexer.ape, plan,
                                    norm_weight=core.norm_weight, indexer_norm_weight=indexer.norm_weight,
                                    norm_eps=NORM_EPS, freq_cis=freq_cis, out_loc=out_loc, kvcache=core.cache,
                                    page_size=core.spec.page_size, indexer_kvcache=indexer.cache,
                                    use_fp4=indexer.spec.use_fp4, layout=core.spec.layout)
        return
    for comp, kv_score in zip(comps, kv_scores):
        step(comp, plan, kv_score, out_loc, freq_cis, fused=fused)
