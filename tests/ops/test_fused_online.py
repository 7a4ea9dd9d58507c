"""compress_and_store(..., is_online=True): byte-identical to compress_forward(..., is_online=True)
followed by compress_norm_rope_store (contract §5, then contract §6).

Two copies of one online c128 state pool (one running-softmax row per request, random request slots)
and of one paged V4 cache run the same steps (same generate_online plans, same random inputs): copy A
through the two public ops, copy B through the fused op. After every step the state pools and the
caches must be equal bit for bit. Both caches start from the same random bytes, so a row the fused op
fails to store (or stores where it must not) shows up; the steps whose two-step path stored a row are
counted and asserted, so no comparison is vacuous (helpers.fused_twin.Twin: out_loc, store arguments,
compare).

Histories: chunked prefills of 0/1/37/127/128/129/300 tokens that start and end mid-chunk, then decodes
through at least one 128-boundary per request; fp32 and bf16 state, V4 fp8 and bf16 stores, page sizes
2 and 64, int32 and int64 out_loc, a bank offset (state_slot_offset=9, committed into both pools alike
as MTP does) with a flat state view, GPU-resident lengths (bucket-sized plans) and use_cuda_graph
padding (invalid plan rows), a CUDA-graph decode replay, an empty batch and the argument errors.
On "cpu" the op runs the reference of the two steps (API wiring); on "cuda" the fused kernels.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4jit import (CompressorDecodePlan, CompressorPrefillPlan, compress_and_store, compress_forward,
                     compress_norm_rope_store)
from dsv4jit.ops import fused as fused_ops
from dsv4jit.geometry import page_bytes
from helpers.compress_scenario import C128_128, CUDA_MARKS, DEVICES
from helpers.fused_twin import MAX_CTX, Twin, fused_entries

HD, R = 512, 128
FORMATS = ["v4_fp8", "v4_bf16"]
CHOICES = [0, 1, 37, 127, 128, 129, 300]


class OnlineTwin(Twin):
    """Twin over an online state pool ``[slots + offset, 1, 3·HD]`` (m | s | k rows, s > 0)."""

    def __init__(self, device, fmt="v4_fp8", *, state_dtype=torch.float32, offset=0, page_size=2, flat=False,
                 num_reqs=3, seed=0, num_locs=2 * MAX_CTX):
        super().__init__(device, C128_128, fmt, num_reqs=num_reqs, seed=seed, num_locs=num_locs)  # ape [128, HD]
        sc, gen = self.sc, self.sc.gen
        if page_size != self.page_size:
            self.page_size, num_locs = page_size, self.locs.numel()
            pages = -(-num_locs // page_size)
            self.cache_a = torch.randint(0, 256, (pages, page_bytes(fmt, page_size)), generator=gen,
                                         dtype=torch.uint8).to(sc.device)
            self.cache_b = self.cache_a.clone()
            self.locs = torch.randperm(pages * page_size, generator=gen)[:num_locs]
        slots = num_reqs + 5
        self.offset, self.flat = offset, flat
        self.rpi = torch.randperm(slots, generator=gen)[:num_reqs]
        self.r2t = torch.zeros(slots, 4, dtype=torch.int32, device=sc.device)
        rows = (slots + offset, 1, HD)
        state = torch.cat([torch.randn(rows, generator=gen), 1 + 4 * torch.rand(rows, generator=gen),
                           torch.randn(rows, generator=gen)], dim=-1)
        sc.state = state.to(state_dtype).to(sc.device)
        self.state_b = sc.state.clone()
        self.step = 0

    def loc_dtype(self):
        self.step += 1
        return torch.int32 if self.step % 2 else torch.int64

    def two_step(self, x, plan, out_loc):
        kv = compress_forward(self.sc.state, x, self.sc.ape, plan, head_dim=HD, compress_ratio=R, is_online=True)
        compress_norm_rope_store(kv, plan, kvcache=self.cache_a, **self.store_args(out_loc))

    def fused(self, x, plan, out_loc):
        state = self.state_b.view(-1, 3 * HD) if self.flat else self.state_b
        compress_and_store(state, x, self.sc.ape, plan, head_dim=HD, compress_ratio=R, kvcache=self.cache_b,
                           is_online=True, **self.store_args(out_loc))

    def run_both(self, x, plan, out_loc, active):
        before = self.cache_a.clone()
        self.two_step(x, plan, out_loc)
        self.fused(x, plan, out_loc)
        self.compare(before)
        self.commit(active)

    def commit(self, active):
        """With a bank offset, steps store rid + offset (prefill merges from rid): commit, as MTP does."""
        if self.offset:
            for pool in (self.sc.state, self.state_b):
                rows = self.rpi[active].to(pool.device)
                pool[rows] = pool[rows + self.offset]

    def prefill(self, exts, *, gpu_lengths=False, use_cuda_graph=False, pad=0):
        """pad: extra (bucket) tokens past the batch's, which only GPU-resident lengths may have."""
        sc = self.sc
        active = torch.tensor([b for b, e in enumerate(exts) if e], dtype=torch.int64)
        seq = torch.tensor([sc.lens[b] + exts[b] for b in active.tolist()])
        ext = torch.tensor([exts[b] for b in active.tolist()])
        num_q, dev = int(ext.sum()) + pad, sc.device if gpu_lengths else "cpu"
        plan = CompressorPrefillPlan.generate_online(seq.to(dev), ext.to(dev), self.rpi[active].to(sc.device),
                                                     self.r2t, num_q, use_cuda_graph, self.offset)
        self.run_both(sc.random_rows(num_q), plan, self.out_loc(num_q, self.loc_dtype()), active)
        for b in active.tolist():
            sc.lens[b] += exts[b]

    def decode_plan(self, active, seq=None, rpi=None):
        """seq / rpi: static device tensors under CUDA-graph capture (no host copies there)."""
        dev = self.sc.device
        if seq is None:
            seq = torch.tensor([self.sc.lens[b] + 1 for b in active.tolist()], dtype=torch.int64).to(dev)
        rpi = self.rpi[active].to(dev) if rpi is None else rpi
        return CompressorDecodePlan.generate_online(seq, rpi, self.r2t, self.offset)

    def decode(self, rids=None):
        sc = self.sc
        active = torch.tensor(range(sc.num_reqs) if rids is None else rids, dtype=torch.int64)
        n = len(active)
        self.run_both(sc.random_rows(n), self.decode_plan(active), self.out_loc(n, self.loc_dtype()), active)
        for b in active.tolist():
            sc.lens[b] += 1


def _case(device, state, fmt, offset=0):
    marks = CUDA_MARKS if device == "cuda" else ()
    return pytest.param(device, state, fmt, offset, id=f"{device}-{state}-{fmt}" + ("-offset9-flat" * bool(offset)),
                        marks=marks)


# The CPU runs (the reference of the two steps: API wiring) take two cases; the GPU runs all.
CASES = [_case("cpu", "fp32", "v4_fp8"), _case("cpu", "bf16", "v4_bf16", 9)]
CASES += [_case("cuda", state, fmt) for state in ("fp32", "bf16") for fmt in FORMATS]
CASES += [_case("cuda", "fp32", "v4_fp8", 9), _case("cuda", "bf16", "v4_bf16", 9)]


@pytest.mark.parametrize("device, state, fmt, offset", CASES)
def test_fused_online_equals_two_step(device, state, fmt, offset):
    seed = FORMATS.index(fmt) + 2 * (state == "bf16") + offset
    tw = OnlineTwin(device, fmt, state_dtype=torch.bfloat16 if state == "bf16" else torch.float32, offset=offset,
                    page_size=64 if fmt == "v4_bf16" or offset else 2, flat=bool(offset), seed=seed)
    sc, rng = tw.sc, random.Random(seed)
    # Round 1 on cuda: GPU-resident lengths, a bucket 17 tokens larger than the batch; round 2: use_cuda_graph.
    # Both plans carry invalid padding rows.
    for i in range(3):
        exts = [rng.choice(CHOICES) for _ in range(sc.num_reqs)]
        gpu = i == 1 and device == "cuda"
        if any(exts):
            tw.prefill(exts, gpu_lengths=gpu, pad=17 if gpu else 0, use_cuda_graph=i == 2)
    if device == "cpu" and any((R - 3 - n) % R for n in sc.lens):  # wiring only: prefill to 3 before a boundary
        tw.prefill([(R - 3 - n) % R for n in sc.lens])
    ends = [(n // R + 1) * R + rng.randint(0, 3) for n in sc.lens]  # every request decodes across a boundary
    while any(n < e for n, e in zip(sc.lens, ends)):
        tw.decode([b for b in range(sc.num_reqs) if sc.lens[b] < ends[b]])
    assert tw.stored_steps >= 4, "the scenario stored too few rows to prove anything"


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_online_prefills_of_many_rows(device, monkeypatch):
    """Prefills of ONLINE_FUSED_PREFILL_MIN_ROWS plan rows or more run the fused kernel (a block
    per row), fewer the two-step entry: 48 requests closing 3 chunks each, twice (the second merging
    mid-chunk states), a decode step, then a prefill of a few rows."""
    calls = fused_entries(monkeypatch)
    n = 48
    tw = OnlineTwin(device, num_reqs=n, seed=13, num_locs=32 * 1024)
    tw.prefill([400] * n)  # chunks closed at 128, 256, 384; a state left at 400
    tw.prefill([380 + 37 * b % 60 for b in range(n)], gpu_lengths=True)  # closed at 512, 640, 768
    tw.decode()
    tw.prefill([300] * 4 + [0] * (n - 4))
    assert 3 * n >= fused_ops.ONLINE_FUSED_PREFILL_MIN_ROWS > 4 * 4
    assert [entry for _, entry in calls] == ["prefill", "prefill", "decode", "prefill_two_step"]
    assert tw.stored_steps >= 3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_online_decode_in_cuda_graph(device, fmt):
    """A captured decode step (GPU planner + fused op) replays across boundaries; eager two-step on copy A."""
    tw = OnlineTwin(device, fmt)
    sc = tw.sc
    tw.prefill([126, 255, 125])  # stores request 1's first chunk
    active = torch.arange(3)
    rpi = tw.rpi.to(sc.device)
    seq = torch.tensor([n + 1 for n in sc.lens], device=sc.device)  # static buffers, refreshed per replay
    x = torch.zeros(3, 2 * HD, device=sc.device)
    loc = torch.zeros(3, dtype=torch.int64, device=sc.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    snapshot = (tw.state_b.clone(), tw.cache_b.clone())
    with torch.cuda.stream(side):
        tw.fused(x, tw.decode_plan(active, seq, rpi), loc)  # warm-up (loads the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    tw.state_b.copy_(snapshot[0])
    tw.cache_b.copy_(snapshot[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tw.fused(x, tw.decode_plan(active, seq, rpi), loc)
    for _ in range(5):  # seq_lens 127..131, 256..260 (store, then a chunk reset), 126..130
        x.copy_(sc.random_rows(3))
        loc.copy_(tw.out_loc(3))
        seq.copy_(torch.tensor([n + 1 for n in sc.lens]))
        before = tw.cache_a.clone()
        tw.two_step(x, tw.decode_plan(active), loc)
        graph.replay()
        tw.compare(before)
        for b in range(3):
            sc.lens[b] += 1
    assert tw.stored_steps == 4  # the prefill, then each request's boundary on its own step


@pytest.mark.parametrize("device", DEVICES)
def test_fused_online_empty_decode_batch(device):
    tw = OnlineTwin(device)
    tw.decode([])
    assert tw.stored_steps == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fused_online_argument_errors_name_the_argument(device):
    tw = OnlineTwin(device)
    sc = tw.sc
    tw.prefill([5, 130, 1])
    plan, x, loc = tw.decode_plan(torch.arange(3)), sc.random_rows(3), tw.out_loc(3)
    one = torch.tensor([0])
    legacy = CompressorPrefillPlan.generate_legacy(R, tw.rpi[one].to(sc.device), one + 5, one + 5, 5, sc.device)
    assert legacy.plan_w.shape[1] != 16  # 8-byte WritePlan rows: not an online plan
    before = (tw.state_b.clone(), tw.cache_b.clone())

    def call(x=x, plan=plan, out_loc=loc, **kw):
        args = dict(tw.store_args(out_loc), head_dim=HD, compress_ratio=R, kvcache=tw.cache_b, is_online=True)
        compress_and_store(tw.state_b, x, sc.ape, plan, **dict(args, **kw))

    for arg, kw in (("compress_ratio", {"compress_ratio": 4}), ("head_dim", {"head_dim": 128}),
                    ("use_fp4", {"use_fp4": True}),
                    ("plan", {"plan": legacy, "x": sc.random_rows(5), "out_loc": tw.out_loc(5)})):
        with pytest.raises(ValueError, match=arg):
            call(**kw)
    with pytest.raises(TypeError, match="kv_score_input"):
        call(x=x.bfloat16())
    assert torch.equal(tw.state_b, before[0]) and torch.equal(tw.cache_b, before[1]), "a rejected call wrote"
    call()  # the same arguments, unmodified, are accepted


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_online_decode_across_a_boundary(device, fmt):
    """Short (compute-sanitizer sized): prefill to one token before a boundary, decode twice."""
    tw = OnlineTwin(device, fmt)
    stored = []
    for step in (lambda: tw.prefill([127, 255, 1]), tw.decode, tw.decode):
        step()
        stored.append(tw.stored_steps)
    assert stored == [1, 2, 2]  # prefill closes request 1's chunk; decode 1 closes requests 0 and 1
