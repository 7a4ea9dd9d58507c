"""The compiled planner on the CPU (every input on the host) against the torch reference."""

from __future__ import annotations

import re

import pytest
import torch

from dsv4jit import plan_layout, runtime
from dsv4jit.plan import CompressorDecodePlan, CompressorPrefillPlan
from dsv4jit.reference import plan as ref
from helpers.pool_utils import planner_inputs, random_pool

CONFIGS = [(4, 8, False), (4, 16, False), (4, 8, True), (4, 16, True), (128, 128, False), (128, 256, False)]


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS)
@pytest.mark.parametrize("use_cuda_graph", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_prefill_matches_reference(ratio, ring, req_ring, use_cuda_graph, seed):
    rpi, seq, ext, r2t, f2s = planner_inputs(seed, batch=1 + 5 * seed)
    num_q = int(ext.sum())
    expect_c, expect_w = ref.plan_prefill(ratio, rpi, seq, ext, r2t, f2s, 256, ring, num_q,
                                          use_cuda_graph=use_cuda_graph, use_req_ring=req_ring)
    p = CompressorPrefillPlan.generate(ratio, rpi, seq, ext, r2t, f2s, 256, ring, num_q,
                                       use_cuda_graph=use_cuda_graph, use_req_ring=req_ring)
    assert p.plan_c.device.type == "cpu"
    assert torch.equal(p.plan_c, expect_c) and torch.equal(p.plan_w, expect_w)


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS)
def test_reads_state_is_false_only_without_prefixes(ratio, ring, req_ring):
    """reads_state is False where generate sees on the host that no request has a prefix, and then no
    compress row reads a state row: a c4 row's buffered slots are the masked ones of a request's
    first window (seq_len 4), a c128 row has none. A prefix, a copy_ of such a plan and the tuple
    form make it True."""
    rpi, seq, ext, r2t, f2s = planner_inputs(4, batch=9)
    fresh = CompressorPrefillPlan.generate(ratio, rpi, ext, ext, r2t, f2s, 256, ring, int(ext.sum()),
                                           use_req_ring=req_ring)
    assert not fresh.reads_state
    rows = fresh.rows()[0]
    buffered = rows.valid & (rows.buffer_len > 0)
    assert buffered.sum() == (0 if ratio == 128 else int((ext >= 4).sum()))
    assert (rows.seq_len[buffered] == 4).all() and (rows.buffer_len[buffered] <= 4).all()
    prefixed = CompressorPrefillPlan.generate(ratio, rpi, seq, ext, r2t, f2s, 256, ring, int(ext.sum()),
                                              use_req_ring=req_ring)
    assert bool((seq > ext).any()) and prefixed.reads_state
    padded = [CompressorPrefillPlan.generate(ratio, rpi, lens, ext, r2t, f2s, 256, ring, int(ext.sum()),
                                             use_cuda_graph=True, use_req_ring=req_ring) for lens in (ext, seq)]
    assert not padded[0].reads_state and padded[0].copy_(padded[1]).reads_state
    assert CompressorPrefillPlan(*fresh[:4]).reads_state


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS)
def test_decode_matches_reference(ratio, ring, req_ring):
    rpi, seq, _, r2t, f2s = planner_inputs(3, batch=40)
    d = CompressorDecodePlan.generate(ratio, rpi, r2t, f2s, seq, 256, ring, req_ring)
    assert torch.equal(d.plan_d, ref.plan_decode(ratio, rpi, r2t, f2s, seq, 256, ring, req_ring))
    assert d.is_decode and d[1] is d.plan_d and d.rows().seq_len.tolist() == seq.tolist()


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS[:1] + CONFIGS[-1:])
def test_decode_plan_filled_in_place_where_kernels_cannot_allocate(monkeypatch, ratio, ring, req_ring):
    """Without torch's DLPack exchange API the wrapper allocates plan_d and the call fills it."""
    rpi, seq, _, r2t, f2s = planner_inputs(4, batch=33)
    default_online = CompressorDecodePlan.generate_online(seq, rpi, r2t, 5)  # whichever path this torch takes
    monkeypatch.setattr(runtime, "_kernel_allocation", [False])
    d = CompressorDecodePlan.generate(ratio, rpi, r2t, f2s, seq, 256, ring, req_ring)
    assert torch.equal(d.plan_d, ref.plan_decode(ratio, rpi, r2t, f2s, seq, 256, ring, req_ring))
    online = CompressorDecodePlan.generate_online(seq, rpi, r2t, 5)
    assert torch.equal(online.plan_d, default_online.plan_d)


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_legacy_matches_reference(ratio, use_cuda_graph):
    rpi, seq, ext, _, _ = planner_inputs(8, batch=10)
    num_q = int(ext.sum())
    p = CompressorPrefillPlan.generate_legacy(ratio, rpi, seq, ext, num_q, device="cpu", use_cuda_graph=use_cuda_graph)
    expect_c, expect_w = ref.plan_prefill_legacy(ratio, rpi, seq, ext, num_q, use_cuda_graph=use_cuda_graph)
    assert torch.equal(p.plan_c, expect_c) and torch.equal(p.plan_w, expect_w)
    d = CompressorDecodePlan.generate_legacy(ratio, rpi, seq)
    assert torch.equal(d.plan_d, ref.plan_decode_legacy(ratio, rpi, seq))


def test_large_prefill_and_limits():
    """The largest bucket (65536 tokens) plans; one more token is refused."""
    gen = torch.Generator().manual_seed(1)
    seq, ext = torch.tensor([70000, 40000]), torch.tensor([40000, 25536])
    r2t, f2s = random_pool(2, 70000, gen)
    rpi = torch.tensor([1, 0])
    p = CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, f2s, 256, 8, 65536)
    expect_c, expect_w = ref.plan_prefill(4, rpi, seq, ext, r2t, f2s, 256, 8, 65536)
    assert torch.equal(p.plan_c, expect_c) and torch.equal(p.plan_w, expect_w)
    with pytest.raises(ValueError, match="num_q_tokens"):
        CompressorPrefillPlan.generate(4, rpi, seq + 1, ext + torch.tensor([1, 0]), r2t, f2s, 256, 8, 65537)


def test_empty_batch():
    e = torch.zeros(0, dtype=torch.int64)
    r2t, f2s = torch.zeros(1, 8, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)
    for cg in (False, True):
        p = CompressorPrefillPlan.generate(4, e, e, e, r2t, f2s, 256, 8, 0, use_cuda_graph=cg)
        assert p.plan_c.shape == (0, 16) and p.plan_w.shape == (0, 8)
    assert CompressorDecodePlan.generate(128, e, r2t, f2s, e, 256, 128).plan_d.shape == (0, 16)


@pytest.mark.parametrize("bad,match", [
    (dict(compress_ratio=8), "argument 'compress_ratio' must be 4 or 128, got 8"),
    (dict(ring_size=6), "argument 'ring_size' must be a positive multiple of compress_ratio"),
    (dict(swa_page_size=100), "argument 'swa_page_size' must be a positive multiple of ring_size"),
    (dict(use_req_ring=True, compress_ratio=128, ring_size=128), "argument 'use_req_ring'"),
    (dict(num_q_tokens=5), "argument 'num_q_tokens'"),
])
def test_argument_errors_name_the_argument(bad, match):
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=3)
    kw = dict(compress_ratio=4, req_pool_indices=rpi, seq_lens=seq, extend_lens=ext, req_to_token=r2t,
              full_to_state=f2s, swa_page_size=256, ring_size=8, num_q_tokens=int(ext.sum()))
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        CompressorPrefillPlan.generate(**kw)


def test_bad_lengths_and_dtypes():
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=3)
    bad_ext = ext.clone()
    bad_ext[1] = seq[1] + 1
    with pytest.raises(ValueError, match=r"argument 'extend_lens': entry 1 must be in \[1, seq_lens\[1\] = \d+\], got \d+"):
        CompressorPrefillPlan.generate(4, rpi, seq, bad_ext, r2t, f2s, 256, 8, int(bad_ext.sum()))
    with pytest.raises(TypeError, match="argument 'full_to_state': dtype must be int64, got int32"):
        CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, f2s.int(), 256, 8, int(ext.sum()))
    with pytest.raises(ValueError, match=r"argument 'seq_lens': entry 0 must be in \[1, 2\^31\), got 0"):
        CompressorDecodePlan.generate(4, rpi, r2t, f2s, seq * 0, 256, 8)
    with pytest.raises(ValueError, match="req_to_token and full_to_state are required"):
        CompressorDecodePlan.generate(4, rpi, None, None, seq, 256, 8)


def test_out_of_range_lookups_raise_in_default_mode():
    """Host-resident tables cost nothing to check: the first bad lookup is named with its value."""
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=3)
    short = f2s[:10]  # almost every req_to_token slot now points past full_to_state
    rid = int(rpi[0])
    with pytest.raises(ValueError) as err:
        CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, short, 256, 8, int(ext.sum()))
    m = re.fullmatch(rf"dsv4jit\.CompressorPrefillPlan\.generate: argument 'req_to_token': entry \[{rid}, (\d+)\] "
                     rf"\(request 0, position \1\) must be an index of full_to_state \(in \[0, 10\)\), got (\d+)",
                     str(err.value))
    assert m, str(err.value)
    pos, value = int(m.group(1)), int(m.group(2))
    assert pos < int(seq[0]) and value == int(r2t[rid, pos]) >= 10


def test_negative_state_slots_raise_in_checked_mode():
    """full_to_state marks evicted slots -1; a needed token's -1 gives row -1 (C arithmetic, contract §9.11),
    which only checked mode reports."""
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=3)
    num_q = int(ext.sum())
    rid, pos = int(rpi[1]), int(seq[1]) - 1  # request 1's last token is always written
    evicted = f2s.clone()
    evicted[int(r2t[rid, pos])] = -1
    plain = CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, evicted, 256, 8, num_q)
    assert bool((plan_layout.decode_write_plan(plain.plan_w).write_loc == -1).any())
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match=rf"argument 'full_to_state': entry {int(r2t[rid, pos])} "
                                             rf"\(req_to_token\[{rid}, {pos}\], request 1\) must be a state slot"):
            CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, evicted, 256, 8, num_q)
    finally:
        runtime.set_checks(None)


def test_copy_refreshes_graph_buffers():
    rpi, seq, ext, r2t, f2s = planner_inputs(6, batch=4)
    num_q = int(ext.sum())
    a = CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, f2s, 256, 8, num_q, use_cuda_graph=True)
    b = CompressorPrefillPlan.generate(4, rpi.flip(0), seq, ext, r2t, f2s, 256, 8, num_q, use_cuda_graph=True)
    a.copy_(b)
    assert torch.equal(a.plan_c, b.plan_c) and torch.equal(a.plan_w, b.plan_w)
    with pytest.raises(ValueError, match="compress_ratio must be 4, got 128"):
        a.copy_(CompressorPrefillPlan(128, b.plan_c, b.plan_w))
    with pytest.raises(ValueError, match="plan_c must have shape"):
        a.copy_(CompressorPrefillPlan(4, b.plan_c[:1], b.plan_w))
    c, w = a.rows()
    assert bool(c.valid.any()) and bool(w.valid.any())


def test_two_requests_on_one_slot_are_named():
    """Two requests of a step on one state slot would write one state: the planner names
    req_pool_indices (on the host always; on the GPU in checked mode)."""
    rpi, seq, ext, r2t, f2s = planner_inputs(4, batch=6)
    rpi[3] = rpi[1]
    with pytest.raises(ValueError, match=r"^dsv4jit\.CompressorDecodePlan\.generate: argument 'req_pool_indices': "
                                         r"two requests name one slot"):
        CompressorDecodePlan.generate(4, rpi, r2t, f2s, seq, 256, 8)
    with pytest.raises(ValueError, match=r"argument 'req_pool_indices': two requests name one slot"):
        CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, f2s, 256, 8, int(ext.sum()))
    with pytest.raises(ValueError, match=r"generate_online: argument 'req_pool_indices': two requests name one slot"):
        CompressorDecodePlan.generate_online(seq, rpi, r2t)


def test_a_negative_length_names_seq_lens():
    rpi, seq, ext, r2t, f2s = planner_inputs(5, batch=3)
    seq[1], ext[1] = -2, 1
    with pytest.raises(ValueError, match=r"argument 'seq_lens': entry 1 must be >= 1, got -2"):
        CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t, f2s, 256, 8, int(ext.sum()))
