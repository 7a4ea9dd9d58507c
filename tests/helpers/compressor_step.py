"""One compressor step (plan, compress_forward, compress_norm_rope_store) on random inputs, for tests
that run the same step two ways (eager vs torch.compile, CUDA graph, one GPU vs another) and compare.

Inputs are drawn on the CPU from a seeded generator, then moved, so the same seed gives the same
values on every device. The state pool and the cache hold random bytes (no row is left unread by
accident), out_loc targets are distinct cache slots, and the first request closes a compress window
in every step, so that every step compresses and stores something.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4jit import (CompressorDecodePlan, CompressorPrefillPlan, compress_and_store, compress_forward,
                     compress_norm_rope_store)
from dsv4jit.plan_layout import decode_compress_plan
from dsv4jit.geometry import page_bytes, store_format
from .pool_utils import SWA_PAGE, random_batch, random_pool

EPS = 1e-6
PAGE_SIZE = {4: 64, 128: 2}  # compressed-cache page sizes of the model (contract §1.6)
RING = {4: 8, 128: 128}
ROW_WIDTH = {4: 4, 128: 2}  # state/input row width in units of head_dim


@dataclass
class Step:
    ratio: int
    head_dim: int
    use_fp4: bool
    plan: object
    state: torch.Tensor
    x: torch.Tensor
    ape: torch.Tensor
    weight: torch.Tensor
    freq_cis: torch.Tensor
    out_loc: torch.Tensor
    kvcache: torch.Tensor

    @property
    def page_size(self) -> int:
        return PAGE_SIZE[self.ratio]

    def fresh(self) -> Step:
        """The same step with its own copies of the tensors the ops write (state, cache)."""
        return Step(**{**self.__dict__, "state": self.state.clone(), "kvcache": self.kvcache.clone()})

    def valid_rows(self) -> torch.Tensor:
        """Output rows the op writes: every decode row; prefill rows of valid plan_c entries."""
        if self.plan.is_decode:
            return torch.ones(self.plan.plan_d.shape[0], dtype=torch.bool)
        return torch.as_tensor(decode_compress_plan(self.plan.plan_c.cpu()).valid)


def pipeline(state, x, ape, plan, weight, freq_cis, out_loc, kvcache, *, ratio: int, head_dim: int, page_size: int,
             use_fp4: bool):
    """What a compressor layer does with a plan: compress, then norm/rope/quantize/store."""
    kv = compress_forward(state, x, ape, plan, head_dim=head_dim, compress_ratio=ratio)
    compress_norm_rope_store(kv, plan, norm_weight=weight, norm_eps=EPS, freq_cis=freq_cis, out_loc=out_loc,
                             kvcache=kvcache, page_size=page_size, use_fp4=use_fp4)
    return kv


def fused_pipeline(state, x, ape, plan, weight, freq_cis, out_loc, kvcache, *, ratio: int, head_dim: int,
                   page_size: int, use_fp4: bool) -> None:
    """The same layer step through compress_and_store (the compressed rows never leave the kernel)."""
    compress_and_store(state, x, ape, plan, head_dim=head_dim, compress_ratio=ratio, norm_weight=weight, norm_eps=EPS,
                       freq_cis=freq_cis, out_loc=out_loc, kvcache=kvcache, page_size=page_size, use_fp4=use_fp4)


def run(step: Step, fn=pipeline) -> torch.Tensor:
    return fn(step.state, step.x, step.ape, step.plan, step.weight, step.freq_cis, step.out_loc, step.kvcache,
              ratio=step.ratio, head_dim=step.head_dim, page_size=step.page_size, use_fp4=step.use_fp4)


def planner_inputs(seed: int, batch: int, ratio: int, decode: bool):
    """(req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_state) on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    seq, ext = random_batch(batch, gen, max_extend=40, max_prefix=300)
    if decode:
        seq[0] = 2 * ratio  # a compress boundary: this row compresses and stores
    else:
        ext[0], seq[0] = 16, 2 * ratio + 8  # the extend range closes the window ending at 2R - 1
    num_reqs = batch + 3
    r2t, f2s = random_pool(num_reqs, int(seq.max()) + 64, gen)
    rpi = torch.randperm(num_reqs, generator=gen)[:batch].to(torch.int64)
    return rpi, seq, ext, r2t, f2s


def make_step(device, *, ratio: int = 4, head_dim: int = 512, decode: bool = False, use_fp4: bool = False,
              batch: int = 3, seed: int = 0, lengths_on_device: bool = False) -> Step:
    """Plans from the real planner on `device` (lengths on the host unless `lengths_on_device`)."""
    device = torch.device(device)
    rpi, seq, ext, r2t, f2s = planner_inputs(seed, batch, ratio, decode)
    gen = torch.Generator().manual_seed(seed + 1)
    ring = RING[ratio]
    rows = (f2s.numel() - 1) // SWA_PAGE * ring if ratio == 4 else (batch + 3) * ring
    last_dim = ROW_WIDTH[ratio] * head_dim
    dev_rpi, dev_r2t, dev_f2s = rpi.to(device), r2t.to(device), f2s.to(device)
    if decode:
        plan = CompressorDecodePlan.generate(ratio, dev_rpi, dev_r2t, dev_f2s, seq.to(device), SWA_PAGE, ring)
        num_q = batch
    else:
        lens = device if lengths_on_device else torch.device("cpu")
        num_q = int(ext.sum())
        plan = CompressorPrefillPlan.generate(ratio, dev_rpi, seq.to(lens), ext.to(lens), dev_r2t, dev_f2s,
                                              SWA_PAGE, ring, num_q, use_cuda_graph=lengths_on_device)
    fmt = store_format(head_dim, use_fp4=use_fp4)
    page_size = PAGE_SIZE[ratio]
    num_pages = num_q // page_size + 2
    max_pos = int(seq.max()) + 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    return Step(
        ratio=ratio, head_dim=head_dim, use_fp4=use_fp4, plan=plan,
        state=randn(rows // ratio, ratio, last_dim),
        x=randn(num_q, last_dim),
        ape=randn(2 * ratio if ratio == 4 else ratio, head_dim),
        weight=(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device),
        freq_cis=torch.polar(torch.ones(max_pos, 32), 6.3 * torch.rand(max_pos, 32, generator=gen)).to(device),
        out_loc=torch.randperm(num_pages * page_size, generator=gen)[:num_q].to(device),
        kvcache=torch.randint(0, 256, (num_pages, page_bytes(fmt, page_size)), generator=gen,
                              dtype=torch.uint8).to(device),
    )


def assert_same_result(a: Step, out_a: torch.Tensor, b: Step, out_b: torch.Tensor) -> None:
    """Bit-identical written output rows (when the step returns them), state pools and caches."""
    if out_a is not None or out_b is not None:
        rows = a.valid_rows()
        assert out_a.shape == out_b.shape and out_a.dtype == out_b.dtype
        assert torch.equal(out_a.cpu()[rows], out_b.cpu()[rows]), "compress outputs differ"
    assert torch.equal(a.state.cpu(), b.state.cpu()), "state pools differ"
    assert torch.equal(a.kvcache.cpu(), b.kvcache.cpu()), "caches differ"
