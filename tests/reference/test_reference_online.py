"""Online c128 (contract §5) on the CPU: the torch reference (also the CPU backend of compress_forward with
is_online=True) and the host planner (generate_online with every input on the CPU).

Oracles: hand-computed updates; the plain c128 window softmax in fp64 of the same token history
(reference.compress.event_window_reference), which the online state must reproduce for any chunking;
and a small Python enumeration of the segment plans written here from contract §3.8.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsv4jit import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
    compress_forward,
    plan_layout,
)
from dsv4jit.reference import compress as ref_compress
from dsv4jit.reference import online as ref_online

HD = 128  # smallest head_dim the op accepts with is_online=True


# ---- the contract §3.8 segment enumeration (independent of the planner) -------------------------

def expected_plans(seq, ext, rpi, offset, num_q, use_cuda_graph):
    """(plan_c, plan_w) bytes of contract §3.8: segments split at 128-chunk boundaries, batch-major,
    positions ascending."""
    rows_c, rows_w, base = [], [], 0
    for b, (s, e) in enumerate(zip(seq, ext)):
        prefix, pos = s - e, s - e
        while pos < s:
            end = min((pos // 128 + 1) * 128, s)         # segment [pos, end)
            row = (end, base + end - 1 - prefix, end - pos, rpi[b] + offset, rpi[b])
            (rows_c if end % 128 == 0 else rows_w).append(row)
            pos = end
        base += e

    def encode(rows, total):
        pad = [(0xFFFFFFFF, 0, 0, -1, -1)] * (total - len(rows))
        cols = list(zip(*(rows + pad))) if rows + pad else [[]] * 5
        return plan_layout.encode_compress_plan(*[torch.tensor(c, dtype=torch.int64) for c in cols])

    return (encode(rows_c, num_q if use_cuda_graph else len(rows_c)),
            encode(rows_w, num_q if use_cuda_graph else len(rows_w)))


def random_lengths(rng: random.Random, batch: int):
    ext = [rng.choice([1, 2, 127, 128, 129, 255, 256, 300, rng.randint(1, 700)]) for _ in range(batch)]
    prefix = [rng.choice([0, 1, 127, 128, 200, rng.randint(0, 1000)]) for _ in range(batch)]
    return [p + e for p, e in zip(prefix, ext)], ext


@pytest.mark.parametrize("use_cuda_graph", [False, True])
@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("seed", range(6))
def test_prefill_plan_matches_enumeration(seed, offset, use_cuda_graph):
    rng = random.Random(seed)
    batch = 1 + 3 * seed
    seq, ext = random_lengths(rng, batch)
    rpi = rng.sample(range(batch + 10), batch)
    num_q = sum(ext)
    p = CompressorPrefillPlan.generate_online(torch.tensor(seq), torch.tensor(ext), torch.tensor(rpi),
                                              torch.zeros(batch + 10, 8, dtype=torch.int32), num_q,
                                              use_cuda_graph=use_cuda_graph, state_slot_offset=offset)
    exp_c, exp_w = expected_plans(seq, ext, rpi, offset, num_q, use_cuda_graph)
    assert p.plan_c.device.type == "cpu" and p.num_q_tokens == num_q and p.compress_ratio == 128
    assert torch.equal(p.plan_c, exp_c) and torch.equal(p.plan_w, exp_w)
    c, w = p.rows()  # online plan_w decodes as segment rows
    assert bool((w.segment_len[w.valid] < 128).all()) and bool((c.seq_len[c.valid] % 128 == 0).all())


@pytest.mark.parametrize("offset", [0, 3])
def test_decode_plan(offset):
    seq, rpi = torch.tensor([1, 127, 128, 129, 5000]), torch.tensor([4, 0, 2, 1, 3])
    d = CompressorDecodePlan.generate_online(seq, rpi, torch.zeros(5, 4, dtype=torch.int32), state_slot_offset=offset)
    rows = d.rows()
    assert d.is_decode and d.compress_ratio == 128
    assert rows.seq_len.tolist() == seq.tolist()
    assert rows.write_loc.tolist() == (rpi + offset).tolist() and rows.read_page_0.tolist() == (rpi + offset).tolist()
    assert rows.read_page_1.tolist() == [-1] * 5


def test_plan_limits_and_errors():
    r2t = torch.zeros(4, 4, dtype=torch.int32)
    seq, ext, rpi = torch.tensor([300, 10]), torch.tensor([200, 10]), torch.tensor([0, 1])
    gen = CompressorPrefillPlan.generate_online
    with pytest.raises(ValueError, match="num_q_tokens"):
        gen(seq, ext, rpi, r2t, 209)
    with pytest.raises(ValueError, match="extend_len"):
        gen(seq, torch.tensor([200, 11]), rpi, r2t, 211)
    with pytest.raises(ValueError, match="state_slot_offset"):
        gen(seq, ext, rpi, r2t, 210, state_slot_offset=-1)
    with pytest.raises(TypeError, match="req_pool_indices"):
        gen(seq, ext, rpi.to(torch.int32), r2t, 210)
    with pytest.raises(TypeError, match="req_to_token"):
        gen(seq, ext, rpi, r2t.to(torch.int64), 210)
    with pytest.raises(ValueError, match="extend_lens"):
        gen(seq, torch.tensor([200]), rpi, r2t, 200)
    # ragged ids are u16: 65536 tokens plan, one more is refused
    big = gen(torch.tensor([70000, 40000]), torch.tensor([40000, 25536]), rpi, r2t, 65536)
    assert int(plan_layout.decode_compress_plan(big.plan_c).ragged_id.max()) < 65536
    with pytest.raises(ValueError, match="num_q_tokens"):
        gen(torch.tensor([70001, 40000]), torch.tensor([40001, 25536]), rpi, r2t, 65537)
    with pytest.raises(ValueError, match="seq_lens"):
        CompressorDecodePlan.generate_online(torch.tensor([0]), torch.tensor([0]), r2t)
    with pytest.raises(ValueError, match="state_slot_offset"):
        CompressorDecodePlan.generate_online(torch.tensor([3]), torch.tensor([0]), r2t, state_slot_offset=-2)


def test_empty_batch():
    none = torch.zeros(0, dtype=torch.int64)
    r2t = torch.zeros(1, 4, dtype=torch.int32)
    p = CompressorPrefillPlan.generate_online(none, none, none, r2t, 0)
    assert p.plan_c.shape == (0, 16) and p.plan_w.shape == (0, 16)
    d = CompressorDecodePlan.generate_online(none, none, r2t)
    assert d.plan_d.shape == (0, 16)
    state = torch.randn(2, 1, 3 * HD)
    before = state.clone()
    for plan in (p, d):
        out = compress_forward(state, torch.zeros(0, 2 * HD), torch.zeros(128, HD), plan, head_dim=HD,
                               compress_ratio=128, is_online=True)
        assert out.shape == (0, HD)
    assert torch.equal(state, before)


# ---- the reference math --------------------------------------------------------------------------

def test_hand_computed_decode_steps():
    """Two tokens of one chunk: m' = ln 3, a = 1/3, b = 1, s' = 4/3, k' = (1·1/3 + 3·1) / (4/3) = 2.5."""
    hd = 64
    state = torch.full((1, 1, 3 * hd), float("nan"))
    ape = torch.zeros(128, hd)
    ape[1] = 0.5
    out = torch.empty(1, hd)
    plan = plan_layout.encode_decode_plan(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([-1]))
    ref_online.online_decode(state, torch.cat([torch.ones(1, hd), torch.zeros(1, hd)], 1), ape, plan,
                             head_dim=hd, out=out)
    assert torch.equal(out, torch.zeros(1, hd))
    assert torch.equal(state.view(3, hd), torch.stack([torch.zeros(hd), torch.ones(hd), torch.ones(hd)]))
    plan = plan_layout.encode_decode_plan(torch.tensor([2]), torch.tensor([0]), torch.tensor([0]), torch.tensor([-1]))
    token = torch.cat([torch.full((1, hd), 3.0), torch.full((1, hd), math.log(3) - 0.5)], 1)
    ref_online.online_decode(state, token, ape, plan, head_dim=hd, out=out, dtype=torch.float64)
    m, s, k = state.view(3, hd)
    torch.testing.assert_close(m, torch.full((hd,), math.log(3)), rtol=0, atol=1e-6)
    torch.testing.assert_close(s, torch.full((hd,), 4 / 3), rtol=0, atol=1e-6)
    torch.testing.assert_close(k, torch.full((hd,), 2.5), rtol=0, atol=1e-6)


def test_hand_computed_boundary_emits_and_keeps_state():
    """Offset 127 emits k' and does not store; a prefill segment continuing a chunk merges the stored state."""
    hd = 64
    state = torch.zeros(1, 1, 3 * hd)
    state.view(3, hd)[1] = 2.0          # stored: m = 0, s = 2, k = 0 (tokens 0..126)
    before = state.clone()
    ape = torch.zeros(128, hd)
    out = torch.empty(1, hd)
    plan = plan_layout.encode_decode_plan(torch.tensor([128]), torch.tensor([0]), torch.tensor([0]),
                                          torch.tensor([-1]))
    token = torch.cat([torch.full((1, hd), 6.0), torch.zeros(1, hd)], 1)   # z = 0 = m: weight 1 of 3
    ref_online.online_decode(state, token, ape, plan, head_dim=hd, out=out)
    torch.testing.assert_close(out, torch.full((1, hd), 2.0))
    assert torch.equal(state, before)
    # The same token as a 1-token prefill segment closing the chunk (plan_c), merging from read_page_1.
    seg = plan_layout.encode_compress_plan(torch.tensor([128]), torch.tensor([0]), torch.tensor([1]),
                                           torch.tensor([7]), torch.tensor([0]))
    out = torch.empty(1, hd)
    ref_online.online_prefill(state, token, ape, seg, plan_layout.invalid_compress_rows(0),
                              head_dim=hd, out=out)
    torch.testing.assert_close(out, torch.full((1, hd), 2.0))


def test_segment_state_is_the_sequential_update():
    gen = torch.Generator().manual_seed(0)
    kv, z = torch.randn(37, 64, generator=gen, dtype=torch.float64), 3 * torch.randn(37, 64, generator=gen,
                                                                                     dtype=torch.float64)
    closed, seq = ref_online.segment_state(kv, z), ref_online.online_pool(kv, z)
    for a, b in zip(closed, seq):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    left = ref_online.segment_state(kv[:10], z[:10])
    right = ref_online.segment_state(kv[10:], z[10:])
    for a, b in zip(ref_online.online_merge(left, right), closed):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def run_history(rng: random.Random, lengths, steps, state_dtype=torch.float32, offset=0, hd=HD):
    """Drive compress_forward(is_online=True) on the CPU through prefill chunks and decodes; returns
    (request, position, emitted row) of every compress event, the histories and ape. `offset` is a
    bank stride (rid + offset never aliases another request's rid)."""
    gen = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    batch = len(lengths)
    rpi = torch.tensor(rng.sample(range(batch + 2), batch))
    hist = [2 * torch.randn(n, 2 * hd, generator=gen) for n in lengths]
    ape = torch.randn(128, hd, generator=gen)
    state = torch.full(((batch + 2) + offset, 1, 3 * hd), float("nan"), dtype=state_dtype)
    r2t = torch.zeros(batch + 2, 1, dtype=torch.int32)
    done = [0] * batch
    events = []
    for step in steps:  # step: list of extend lengths (prefill) or the string "decode"
        if step == "decode":
            active = [b for b in range(batch) if done[b] < lengths[b]]
            seq = torch.tensor([done[b] + 1 for b in active])
            plan = CompressorDecodePlan.generate_online(seq, rpi[active], r2t, state_slot_offset=offset)
            inputs = torch.stack([hist[b][done[b]] for b in active])
            out = compress_forward(state, inputs, ape, plan, head_dim=hd, compress_ratio=128, is_online=True)
            for i, b in enumerate(active):
                done[b] += 1
                if done[b] % 128 == 0:
                    events.append((b, done[b] - 1, out[i]))
                else:
                    assert torch.equal(out[i], torch.zeros(hd))
            if offset:  # decode loads its own bank: keep the committed bank in step for later prefills
                state[rpi] = state[rpi + offset]
            continue
        active = [b for b in range(batch) if step[b] > 0]
        ext = [min(step[b], lengths[b] - done[b]) for b in active]
        seq = [done[b] + e for b, e in zip(active, ext)]
        plan = CompressorPrefillPlan.generate_online(torch.tensor(seq), torch.tensor(ext), rpi[active], r2t,
                                                     sum(ext), state_slot_offset=offset)
        inputs = torch.cat([hist[b][done[b]:done[b] + e] for b, e in zip(active, ext)])
        out = compress_forward(state, inputs, ape, plan, head_dim=hd, compress_ratio=128, is_online=True)
        c, _ = plan.rows()
        for i in range(len(c.seq_len)):
            b = active[int((c.load_slot[i] == rpi[active]).nonzero())]
            events.append((b, int(c.seq_len[i]) - 1, out[i]))
        if offset:  # prefill stores bank rid + offset and merges from rid: commit it (as MTP would)
            state[rpi] = state[rpi + offset]
        for b, e in zip(active, ext):
            done[b] += e
    return events, hist, ape


@pytest.mark.parametrize("seed", range(3))
def test_reference_equals_plain_window_softmax(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(300, 420) for _ in range(3)]
    steps = [[rng.randint(1, 200) for _ in lengths] for _ in range(2)] + ["decode"] * 40
    steps.append([500] * 3)  # the rest as one prefill chunk
    events, hist, ape = run_history(rng, lengths, steps, offset=(len(lengths) + 2) * (seed % 2))
    assert len(events) == sum(n // 128 for n in lengths)
    for b, p, row in events:
        expect = ref_compress.event_window_reference(hist[b], p, ape, head_dim=HD, compress_ratio=128)
        torch.testing.assert_close(row.double(), expect, rtol=1e-5, atol=1e-5)


def test_op_argument_errors():
    r2t = torch.zeros(1, 1, dtype=torch.int32)
    plan = CompressorDecodePlan.generate_online(torch.tensor([3]), torch.tensor([0]), r2t)
    state, inputs, ape = torch.zeros(1, 1, 3 * HD), torch.zeros(1, 2 * HD), torch.zeros(128, HD)
    with pytest.raises(ValueError, match="compress_ratio"):
        compress_forward(state, inputs, ape, plan, head_dim=HD, compress_ratio=4, is_online=True)
    with pytest.raises(ValueError, match="head_dim"):
        compress_forward(state, inputs, ape, plan, head_dim=64, compress_ratio=128, is_online=True)
    with pytest.raises(TypeError, match="kv_score_input"):
        compress_forward(state, inputs.bfloat16(), ape, plan, head_dim=HD, compress_ratio=128, is_online=True)
    with pytest.raises(TypeError, match="kv_score_buffer"):
        compress_forward(state.half(), inputs, ape, plan, head_dim=HD, compress_ratio=128, is_online=True)
    ring_plan = CompressorPrefillPlan.generate_legacy(128, torch.tensor([0]), torch.tensor([3]), torch.tensor([3]), 3)
    with pytest.raises(ValueError, match="generate_online"):
        compress_forward(state, torch.zeros(3, 2 * HD), ape, ring_plan, head_dim=HD, compress_ratio=128,
                         is_online=True)
    # flat buffer and bf16 ape are accepted
    out = compress_forward(state.view(1, -1), inputs, ape.bfloat16(), plan, head_dim=HD, compress_ratio=128,
                           is_online=True)
    assert out.dtype == torch.float32 and torch.equal(out, torch.zeros(1, HD))
