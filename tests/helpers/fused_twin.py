"""Two copies of one compress scenario, one through the two public ops (compress_forward, then
compress_norm_rope_store) and one through compress_and_store, compared bit for bit after every step
(tests/ops/test_fused.py and tests/ops/test_fused_online.py), and a spy on the fused module's calls."""

from __future__ import annotations

import inspect

import torch

from dsv4jit import compress_and_store, compress_forward, compress_norm_rope_store
from dsv4jit.geometry import page_bytes
from dsv4jit.ops import fused as fused_ops

from .compress_scenario import Scenario

PAGE_SIZE = {4: 64, 128: 2}
FORMAT_HEAD_DIM = {"v4_fp8": 512, "v4_bf16": 512, "indexer_fp8": 128, "indexer_fp4": 128}
MAX_CTX = 1024


class Twin:
    """One scenario (plans, inputs) driving a two-step copy and a fused copy of state and cache."""

    def __init__(self, device, config, fmt, *, state_dtype=torch.float32, in_dtype=torch.float32, num_reqs=4,
                 seed=0, num_locs=2 * MAX_CTX):
        ratio, mode, ring = config
        hd = FORMAT_HEAD_DIM[fmt]  # the store format fixes head_dim
        self.sc = Scenario(device, ratio, mode, ring, num_reqs=num_reqs, max_ctx=MAX_CTX, hd=hd,
                           state_dtype=state_dtype, in_dtype=in_dtype, seed=seed)
        sc = self.sc
        self.fmt, self.page_size = fmt, PAGE_SIZE[ratio]
        self.use_fp4, self.bf16_store = fmt == "indexer_fp4", fmt == "v4_bf16"
        gen = sc.gen
        # finite states (the pool's NaN rows would make every pooled value NaN alike)
        sc.state.copy_(torch.randn(sc.state.shape, generator=gen).to(state_dtype))
        self.state_b = sc.state.clone()
        # out_loc covers every token of a prefill step
        pages = -(-num_locs // self.page_size)
        self.cache_a = torch.randint(0, 256, (pages, page_bytes(fmt, self.page_size)), generator=gen,
                                     dtype=torch.uint8).to(sc.device)
        self.cache_b = self.cache_a.clone()
        self.locs = torch.randperm(pages * self.page_size, generator=gen)[:num_locs]
        self.next_loc = 0
        self.norm_weight = (1 + 0.3 * torch.randn(hd, generator=gen)).to(sc.device)
        angles = torch.rand(MAX_CTX, 32, generator=gen, dtype=torch.float64) * 6.283
        self.freq_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(sc.device)
        self.stored_steps = 0

    def out_loc(self, n: int, dtype=torch.int64) -> torch.Tensor:
        locs = self.locs[self.next_loc:self.next_loc + n]
        self.next_loc = (self.next_loc + n) % (self.locs.numel() - n)
        return locs.to(dtype).to(self.sc.device)

    def store_args(self, out_loc):
        return dict(norm_weight=self.norm_weight, norm_eps=1e-6, freq_cis=self.freq_cis, out_loc=out_loc,
                    page_size=self.page_size, use_fp4=self.use_fp4, bf16_store=self.bf16_store)

    def run_both(self, x, plan, out_loc):
        sc = self.sc
        before = self.cache_a.clone()
        kv = compress_forward(sc.state, x, sc.ape, plan, head_dim=sc.hd, compress_ratio=sc.R)
        compress_norm_rope_store(kv, plan, kvcache=self.cache_a, **self.store_args(out_loc))
        self.fused(x, plan, out_loc)
        self.compare(before)

    def fused(self, x, plan, out_loc):
        sc = self.sc
        compress_and_store(self.state_b, x, sc.ape, plan, head_dim=sc.hd, compress_ratio=sc.R,
                           kvcache=self.cache_b, **self.store_args(out_loc))

    def compare(self, before):
        sc = self.sc
        assert torch.equal(sc.state.view(torch.uint8), self.state_b.view(torch.uint8)), "states differ"
        if not torch.equal(self.cache_a, self.cache_b):
            rows = (self.cache_a != self.cache_b).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"caches differ on pages {rows[:8]} ({len(rows)} pages)")
        if not torch.equal(before, self.cache_a):
            self.stored_steps += 1

    def prefill(self, rids, exts, *, num_q=None, gpu_lengths=False, use_cuda_graph=False, loc_dtype=torch.int64):
        sc = self.sc
        n = sum(exts)
        num_q = n if num_q is None else num_q
        x = sc.random_rows(num_q)
        plan = sc.prefill_plan(rids, exts, num_q=num_q, gpu_lengths=gpu_lengths, use_cuda_graph=use_cuda_graph)
        self.run_both(x, plan, self.out_loc(num_q, loc_dtype))
        for r, e in zip(rids, exts):
            sc.lens[r] += e

    def decode(self, rids, loc_dtype=torch.int64):
        sc = self.sc
        x = sc.random_rows(len(rids))
        plan = sc.decode_plan(rids)
        self.run_both(x, plan, self.out_loc(len(rids), loc_dtype))
        for r in rids:
            sc.lens[r] += 1


def fused_entries(monkeypatch) -> list[tuple[str, str]]:
    """The (kernel, path) of every fused-module call from now on (runs_fused's choice): path is
    decode or prefill, with _two_step where the call asked for the two steps (one_kernel false)."""
    calls, function = [], fused_ops.runtime.function
    names = list(inspect.signature(fused_ops.run_fused).parameters)[1:]  # the kernels' parameters, by name

    def spy(name, entry, *args, **params):
        fn = function(name, entry, *args, **params)
        if not name.startswith("fused") or entry != "run":
            return fn

        def run(*a):
            named = dict(zip(names, a))
            path = ("decode" if named["is_decode"] else "prefill") + ("" if named["one_kernel"] else "_two_step")
            calls.append((name, path))
            return fn(*a)

        return run

    monkeypatch.setattr(fused_ops.runtime, "function", spy)
    fused_ops.runtime.clear_call_caches()  # launchers made before hold the kernels unobserved
    return calls
