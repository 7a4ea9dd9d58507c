"""CPU tests of the pure-PyTorch compress reference (contract §4, contract §5, contract §3.11).

Expected values come from the contract's formulas evaluated independently here: scalar loops with
math.exp over one channel, and the plain fp64 softmax over a request's token history. Plans are
built by hand (or by the small request-ring planner below, written from contract §3.2, contract §3.3
and contract §3.7) with the plan_layout encoders.
"""

import math

import pytest
import torch

from dsv4jit.plan_layout import (
    encode_compress_plan,
    encode_decode_plan,
    encode_write_plan,
    invalid_compress_rows,
    invalid_write_rows,
)
from dsv4jit.reference.compress import compress_decode, compress_prefill, event_window_reference, window_softmax
from dsv4jit.reference.online import (online_merge, online_pool, online_reset, online_state_from_row,
                                      online_state_to_row, online_update)

HD = {4: 128, 128: 64}   # c4 needs hd % 128 == 0; c128 runs with hd = 64 to stay small
WN = {4: 8, 128: 128}
WIDTH = {4: 4, 128: 2}   # values per token row, in units of hd


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def ring_row(rid, pos, ring):
    return rid * ring + pos % ring


def ints(values):
    return torch.tensor(list(values), dtype=torch.int64)


def compress_plan(rows):
    """rows: [(seq_len, ragged_id, buffer_len, read_page_0, read_page_1)]."""
    cols = list(zip(*rows)) if rows else [()] * 5
    return encode_compress_plan(*map(ints, cols))


def write_plan(rows):
    """rows: [(ragged_id, write_loc)]."""
    cols = list(zip(*rows)) if rows else [()] * 2
    return encode_write_plan(*map(ints, cols))


def decode_plan(rows):
    """rows: [(seq_len, write_loc, read_page_0, read_page_1)]."""
    return encode_decode_plan(*map(ints, zip(*rows)))


def ring_prefill_plans(R, ring, reqs):
    """Request-ring prefill plans of one step (contract §3.2, contract §3.3 rows + contract §3.4 translation).

    reqs: [(rid, prefix_len, extend_len)] in batch order. Returns plan_c, plan_w and, per plan_c
    row, the (batch index, closing position) of its event.
    """
    wn = WN[R]
    mtp_pad = ring - wn + 2 if ring > wn else 0
    c_rows, w_rows, events = [], [], []
    base = 0
    for b, (rid, prefix, extend) in enumerate(reqs):
        seq = prefix + extend
        last_c = seq // R * R
        first_w = min(last_c - (R if R == 4 else 0), seq - mtp_pad)
        for j in range(extend):
            p, rg = prefix + j, base + j
            if (p + 1) % R == 0:
                buffer_len = wn - min(j + 1, wn)
                if buffer_len > 0:
                    pages = (ring_row(rid, max(p - R, 0), ring) // R, ring_row(rid, p, ring) // R)
                else:
                    pages = (-1, b)  # untranslated stage-0 leftovers (contract §3.4)
                c_rows.append((p + 1, rg, buffer_len, *pages))
                events.append((b, p))
            if p >= first_w:
                w_rows.append((rg, ring_row(rid, p, ring)))
        base += extend
    return compress_plan(c_rows), write_plan(w_rows), events


def ring_decode_plan(R, ring, reqs):
    """reqs: [(rid, seq_len)] -> plan_d (contract §3.7, request ring)."""
    rows = []
    for rid, seq in reqs:
        p1 = seq - 1
        p0 = max(p1 - R, 0)
        rows.append((seq, ring_row(rid, p1, ring), ring_row(rid, p0, ring) // R, ring_row(rid, p1, ring) // R))
    return decode_plan(rows)


def fill_ring(flat, rid, history, ring):
    """Store positions 0..len(history)-1 in order, so the ring keeps the latest ones (as steps would)."""
    for pos in range(history.shape[0]):
        flat[ring_row(rid, pos, ring)] = history[pos].to(flat.dtype)


def slot_values(history, p, s, d, R):
    """(kv, score) of channel d in window slot s of the event at p, straight from contract §4.2,
    contract §4.3 and contract §1.3."""
    hd, wn = HD[R], WN[R]
    row = history[p - wn + 1 + s].double()
    if R == 4 and s < 4:
        return float(row[d]), float(row[2 * hd + d])
    if R == 4:
        return float(row[hd + d]), float(row[3 * hd + d])
    return float(row[d]), float(row[hd + d])


def scalar_pool(kvs, scores, apes):
    """contract §4.1 for one channel, one slot at a time."""
    z = [sc + a for sc, a in zip(scores, apes)]
    m = max(z)
    e = [math.exp(zi - m) for zi in z]
    return sum(k * ei for k, ei in zip(kvs, e)) / sum(e)


def scalar_event(history, p, ape, d, R, first_slot=0):
    """One channel of the event at p, pooled over slots first_slot..Wn-1 (earlier slots masked)."""
    slots = range(first_slot, WN[R])
    kvs, scores = zip(*(slot_values(history, p, s, d, R) for s in slots))
    return scalar_pool(kvs, scores, [float(ape[s, d]) for s in slots])


def new_pool(gen, R, rows, dtype=torch.float32):
    """A flat state pool of random garbage (never zeros), `rows` a multiple of R."""
    return randn(gen, rows, WIDTH[R] * HD[R], dtype=dtype)


def close(actual, expected, tol):
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# window_softmax
# ---------------------------------------------------------------------------------------------

def test_window_softmax_matches_scalar_loop():
    gen = torch.Generator().manual_seed(1)
    kv, score, ape = randn(gen, 3, 8, 128), randn(gen, 3, 8, 128, scale=3.0), randn(gen, 8, 128)
    got32 = window_softmax(kv, score, ape)
    got64 = window_softmax(kv, score, ape, dtype=torch.float64)
    assert got32.dtype == torch.float32 and got64.dtype == torch.float64 and got32.shape == (3, 128)
    for b, d in [(0, 0), (1, 77), (2, 127)]:
        want = scalar_pool(kv[b, :, d].tolist(), score[b, :, d].tolist(), ape[:, d].tolist())
        assert abs(float(got64[b, d]) - want) < 1e-12
        assert abs(float(got32[b, d]) - want) < 1e-5


# ---------------------------------------------------------------------------------------------
# c4 prefill with state context: the worked example of contract §3.10 (request ring, ring_size 8)
# ---------------------------------------------------------------------------------------------

def c4_worked_example(gen, buffer_dtype=torch.float32, input_dtype=torch.float32):
    """Request rid 2, prefix 5, extend 6: one event at p = 7 reading positions 0–4 from the state;
    the six writes (positions 5–10) reuse the rows of positions 0–2 in the 8-row ring."""
    R, hd, ring, rid = 4, HD[4], 8, 2
    history = randn(gen, 11, 4 * hd, dtype=input_dtype, scale=2.0)
    flat = new_pool(gen, R, 4 * ring, dtype=buffer_dtype)
    fill_ring(flat, rid, history[:5], ring)
    plan_c = compress_plan([(8, 2, 5, ring_row(rid, 0, ring) // 4, ring_row(rid, 7, ring) // 4)])
    write_locs = [ring_row(rid, p, ring) for p in range(5, 11)]
    plan_w = write_plan(list(zip(range(6), write_locs)))
    ape = randn(gen, 8, hd, dtype=input_dtype)
    return dict(history=history, flat=flat, plan_c=plan_c, plan_w=plan_w, ape=ape,
                inputs=history[5:11].clone(), write_locs=write_locs)


def test_c4_prefill_channels_by_hand():
    gen = torch.Generator().manual_seed(2)
    ex = c4_worked_example(gen)
    hd = HD[4]
    out = torch.full((1, hd), float("nan"))
    compress_prefill(ex["flat"].view(-1, 4, 4 * hd), ex["inputs"], ex["ape"], ex["plan_c"], ex["plan_w"],
                     head_dim=hd, compress_ratio=4, out=out)
    for d in (0, 5, 127):
        assert abs(float(out[0, d]) - scalar_event(ex["history"], 7, ex["ape"], d, 4)) < 1e-5
    close(out[0], event_window_reference(ex["history"], 7, ex["ape"], head_dim=hd, compress_ratio=4), 1e-5)


def test_prefill_compress_reads_state_before_this_steps_writes():
    gen = torch.Generator().manual_seed(3)
    ex = c4_worked_example(gen)
    hd, flat = HD[4], ex["flat"]
    before = flat.clone()
    read_rows = {ring_row(2, p, 8) for p in range(5)}
    assert read_rows & set(ex["write_locs"]), "the example must alias a read row with a write"

    out = torch.empty(1, hd)
    compress_prefill(flat.view(-1, 4, 4 * hd), ex["inputs"], ex["ape"], ex["plan_c"], ex["plan_w"],
                     head_dim=hd, compress_ratio=4, out=out)
    old = event_window_reference(ex["history"], 7, ex["ape"], head_dim=hd, compress_ratio=4)
    close(out[0], old, 1e-5)
    # Had the writes come first, slots 0–2 would have pooled positions 8–10 instead of 0–2.
    aliased = ex["history"].clone()
    aliased[0:3] = ex["history"][8:11]
    wrong = event_window_reference(aliased, 7, ex["ape"], head_dim=hd, compress_ratio=4)
    assert (out[0].double() - wrong).abs().max() > 1e-2

    # After the step the ring holds the new tokens; every other row is untouched.
    for j, loc in enumerate(ex["write_locs"]):
        assert torch.equal(flat[loc], ex["inputs"][j])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[ex["write_locs"]] = False
    assert torch.equal(flat[untouched], before[untouched])


# ---------------------------------------------------------------------------------------------
# c4 first window (seq_len == 4): slots 0–3 masked and never read
# ---------------------------------------------------------------------------------------------

def scalar_event_masked(history, ape, d):
    """Event at p = 3 pooled over the current slots 4–7 only (positions 0–3)."""
    hd = HD[4]
    kvs = [float(history[q, hd + d]) for q in range(4)]
    scores = [float(history[q, 3 * hd + d]) for q in range(4)]
    return scalar_pool(kvs, scores, [float(ape[4 + q, d]) for q in range(4)])


def test_c4_first_window_prefill_without_rows_before_the_window():
    gen = torch.Generator().manual_seed(4)
    hd = HD[4]
    history = randn(gen, 4, 4 * hd, scale=2.0)
    ape = randn(gen, 8, hd)
    flat = new_pool(gen, 4, 8)
    # The input holds exactly the 4 tokens: rows for slots 0–3 (ragged ids −4…−1) do not exist.
    out = torch.full((1, hd), float("nan"))
    compress_prefill(flat.view(-1, 4, 4 * hd), history, ape, compress_plan([(4, 3, 0, -1, 0)]),
                     write_plan([]), head_dim=hd, compress_ratio=4, out=out)
    for d in (0, 64, 127):
        assert abs(float(out[0, d]) - scalar_event_masked(history, ape, d)) < 1e-5


def test_c4_first_window_does_not_read_overlap_state_page():
    gen = torch.Generator().manual_seed(5)
    hd, ring, rid = HD[4], 8, 1
    history = randn(gen, 4, 4 * hd, scale=2.0)
    ape = randn(gen, 8, hd)
    nan_page = 4  # rows 16–19: filled with NaN, named as read_page_0 of both events below
    flat = new_pool(gen, 4, 4 * ring + 4)
    flat[4 * nan_page:4 * nan_page + 4] = float("nan")

    # Prefill, prefix 2 + extend 2: buffer_len 6 covers the masked slots 0–3 and positions 0–1.
    prefill_flat = flat.clone()
    fill_ring(prefill_flat, rid, history[:2], ring)
    out = torch.full((1, hd), float("nan"))
    compress_prefill(prefill_flat.view(-1, 4, 4 * hd), history[2:4].clone(), ape,
                     compress_plan([(4, 1, 6, nan_page, ring_row(rid, 0, ring) // 4)]), write_plan([]),
                     head_dim=hd, compress_ratio=4, out=out)
    assert torch.isfinite(out).all()
    for d in (0, 100):
        assert abs(float(out[0, d]) - scalar_event_masked(history, ape, d)) < 1e-5

    # Decode of position 3: all 8 slots from the state, slots 0–3 masked.
    decode_flat = flat.clone()
    fill_ring(decode_flat, rid, history[:3], ring)
    out = torch.full((1, hd), float("nan"))
    compress_decode(decode_flat.view(-1, 4, 4 * hd), history[3:4].clone(), ape,
                    decode_plan([(4, ring_row(rid, 3, ring), nan_page, ring_row(rid, 3, ring) // 4)]),
                    head_dim=hd, compress_ratio=4, out=out)
    assert torch.isfinite(out).all()
    for d in (3, 127):
        assert abs(float(out[0, d]) - scalar_event_masked(history, ape, d)) < 1e-5


# ---------------------------------------------------------------------------------------------
# c128 prefill with context (the c128 example of contract §3.10), two requests
# ---------------------------------------------------------------------------------------------

def test_c128_prefill_with_context():
    gen = torch.Generator().manual_seed(6)
    R, hd, ring = 128, HD[128], 128
    rid0, rid1 = 3, 2
    hist0 = randn(gen, 300, 2 * hd, scale=2.0)  # prefix 100, extend 200
    hist1 = randn(gen, 130, 2 * hd, scale=2.0)  # prefix 0, extend 130
    ape = randn(gen, 128, hd)
    flat = new_pool(gen, R, 4 * ring + R)
    fill_ring(flat, rid0, hist0[:100], ring)
    inputs = torch.cat([hist0[100:300], hist1])
    plan_c = compress_plan([
        (128, 27, 100, rid0, rid0),   # p = 127 of request 0: slots 0–99 from page rid0
        (256, 155, 0, -1, 0),         # p = 255: all ragged; read pages are stage-0 leftovers
        (128, 200 + 127, 0, -1, 1),   # p = 127 of request 1
    ])
    w_rows = [(p - 100, ring_row(rid0, p, ring)) for p in range(256, 300)]  # ragged = p − prefix
    w_rows += [(200 + p, ring_row(rid1, p, ring)) for p in (128, 129)]
    out = torch.full((3, hd), float("nan"))
    compress_prefill(flat.view(-1, R, 2 * hd), inputs, ape, plan_c, write_plan(w_rows),
                     head_dim=hd, compress_ratio=R, out=out)

    for row, (hist, p) in enumerate([(hist0, 127), (hist0, 255), (hist1, 127)]):
        close(out[row], event_window_reference(hist, p, ape, head_dim=hd, compress_ratio=R), 1e-5)
    for d in (0, 63):
        assert abs(float(out[0, d]) - scalar_event(hist0, 127, ape, d, R)) < 1e-5
    for rg, loc in w_rows:
        assert torch.equal(flat[loc], inputs[rg])


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("R", [4, 128])
def test_decode_boundary_and_non_boundary_rows(R):
    gen = torch.Generator().manual_seed(7 + R)
    hd, ring = HD[R], WN[R]
    # (rid, seq_len): a boundary, a non-boundary, and (c4) the first window / (c128) the first event.
    reqs = [(0, 12), (1, 7), (2, 4)] if R == 4 else [(0, 256), (1, 200), (2, 128)]
    histories = [randn(gen, seq, WIDTH[R] * hd, scale=2.0) for _, seq in reqs]
    ape = randn(gen, WN[R], hd)
    flat = new_pool(gen, R, 3 * ring + R)
    for (rid, seq), hist in zip(reqs, histories):
        fill_ring(flat, rid, hist[:seq - 1], ring)
    inputs = torch.stack([hist[-1] for hist in histories])
    out = torch.full((3, hd), float("nan"))
    compress_decode(flat.view(-1, R, WIDTH[R] * hd), inputs, ape, ring_decode_plan(R, ring, reqs),
                    head_dim=hd, compress_ratio=R, out=out)

    close(out[0], event_window_reference(histories[0], reqs[0][1] - 1, ape, head_dim=hd, compress_ratio=R), 1e-5)
    close(out[2], event_window_reference(histories[2], reqs[2][1] - 1, ape, head_dim=hd, compress_ratio=R), 1e-5)
    assert torch.equal(out[1], torch.zeros(hd))  # non-boundary: zero-filled (contract §9.3)
    d = hd - 1
    assert abs(float(out[0, d]) - scalar_event(histories[0], reqs[0][1] - 1, ape, d, R)) < 1e-5
    for b, (rid, seq) in enumerate(reqs):  # every row stored its token, boundary or not
        assert torch.equal(flat[ring_row(rid, seq - 1, ring)], inputs[b])


def test_prefill_invalid_rows_left_untouched():
    gen = torch.Generator().manual_seed(8)
    hd, ring, rid = HD[4], 8, 0
    history = randn(gen, 8, 4 * hd, scale=2.0)
    ape = randn(gen, 8, hd)
    flat = new_pool(gen, 4, 2 * ring)
    before = flat.clone()
    # No-context prefill of 8 tokens, with invalid (padding) rows interleaved in both plans.
    valid_c = compress_plan([(4, 3, 0, -1, 0), (8, 7, 0, -1, 0)])
    plan_c = torch.cat([invalid_compress_rows(1), valid_c[0:1], invalid_compress_rows(2), valid_c[1:2]])
    w_rows = [(rg, ring_row(rid, rg, ring)) for rg in range(4, 8)]
    plan_w = torch.cat([write_plan(w_rows[:2]), invalid_write_rows(3), write_plan(w_rows[2:])])
    out = torch.full((5, hd), float("nan"))
    compress_prefill(flat.view(-1, 4, 4 * hd), history, ape, plan_c, plan_w, head_dim=hd, compress_ratio=4, out=out)

    assert torch.isnan(out[[0, 2, 3]]).all()
    assert torch.isfinite(out[[1, 4]]).all()
    close(out[1], event_window_reference(history, 3, ape, head_dim=hd, compress_ratio=4), 1e-5)
    close(out[4], event_window_reference(history, 7, ape, head_dim=hd, compress_ratio=4), 1e-5)
    written = [loc for _, loc in w_rows]
    for rg, loc in w_rows:
        assert torch.equal(flat[loc], history[rg])
    keep = torch.ones(flat.shape[0], dtype=torch.bool)
    keep[written] = False
    assert torch.equal(flat[keep], before[keep])


# ---------------------------------------------------------------------------------------------
# Mixed dtypes (contract §9.6 and contract §9.10)
# ---------------------------------------------------------------------------------------------

def bf16_round_nearest_even(x):
    """fp32 -> bf16 by integer arithmetic on the bit pattern (finite inputs)."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (rounded << 16).to(torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("buffer_dtype, input_dtype, out_dtype, tol", [
    (torch.float32, torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.float32, torch.float32, 5e-3),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 5e-3),
    (torch.float32, torch.float16, torch.float16, 5e-3),
    (torch.bfloat16, torch.float16, torch.float32, 5e-3),
    (torch.float32, torch.bfloat16, torch.float32, 5e-3),
])
def test_mixed_dtypes_prefill_then_decode(buffer_dtype, input_dtype, out_dtype, tol):
    gen = torch.Generator().manual_seed(9)
    hd, ring, rid = HD[4], 8, 2
    ex = c4_worked_example(gen, buffer_dtype, input_dtype)
    flat, history, ape = ex["flat"], ex["history"], ex["ape"]
    out = torch.full((1, hd), float("nan"), dtype=out_dtype)
    compress_prefill(flat.view(-1, 4, 4 * hd), ex["inputs"], ape, ex["plan_c"], ex["plan_w"],
                     head_dim=hd, compress_ratio=4, out=out)
    assert out.dtype == out_dtype

    # What the state holds is the input rounded to the state dtype (round to nearest even).
    stored = history.to(buffer_dtype).to(input_dtype)
    for j, loc in enumerate(ex["write_locs"]):
        assert flat[loc].dtype == buffer_dtype
        assert torch.equal(flat[loc], ex["inputs"][j].to(buffer_dtype))
        if buffer_dtype == torch.bfloat16 and input_dtype == torch.float32:
            assert torch.equal(flat[loc].float(), bf16_round_nearest_even(ex["inputs"][j]))

    # Prefill event at p = 7: positions 0–4 come from the state, 5–7 straight from the input.
    seen = history.clone()
    seen[0:5] = stored[0:5]
    close(out[0], event_window_reference(seen, 7, ape, head_dim=hd, compress_ratio=4), tol)

    # Decode of position 11 pools positions 4–11, every one of them through the state.
    last = randn(gen, 1, 4 * hd, dtype=input_dtype, scale=2.0)
    out = torch.full((1, hd), float("nan"), dtype=out_dtype)
    compress_decode(flat.view(-1, 4, 4 * hd), last, ape, ring_decode_plan(4, ring, [(rid, 12)]),
                    head_dim=hd, compress_ratio=4, out=out)
    seen = torch.cat([history, last]).to(buffer_dtype).to(input_dtype)
    close(out[0], event_window_reference(seen, 11, ape, head_dim=hd, compress_ratio=4), tol)


# ---------------------------------------------------------------------------------------------
# event_window_reference vs compress_prefill, no context
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("R, seq_len", [(4, 8), (128, 256)])
def test_event_window_reference_matches_no_context_prefill(R, seq_len):
    gen = torch.Generator().manual_seed(10 + R)
    hd, ring, rid = HD[R], WN[R], 1
    history = randn(gen, seq_len, WIDTH[R] * hd, scale=2.0)
    ape = randn(gen, WN[R], hd)
    flat = new_pool(gen, R, 2 * ring)
    events = list(range(R - 1, seq_len, R))
    plan_c = compress_plan([(p + 1, p, 0, -1, 0) for p in events])
    first_w = seq_len - (R if R == 4 else 0)  # c4 keeps the next overlap half; c128 keeps nothing
    w_rows = [(p, ring_row(rid, p, ring)) for p in range(first_w, seq_len)]
    out = torch.full((len(events), hd), float("nan"))
    compress_prefill(flat.view(-1, R, WIDTH[R] * hd), history, ape, plan_c, write_plan(w_rows),
                     head_dim=hd, compress_ratio=R, out=out)
    for i, p in enumerate(events):
        close(out[i], event_window_reference(history, p, ape, head_dim=hd, compress_ratio=R), 1e-5)
    for rg, loc in w_rows:
        assert torch.equal(flat[loc], history[rg])


# ---------------------------------------------------------------------------------------------
# contract §3.11: any chunking of prefills and decodes gives the plain softmax over the history
# ---------------------------------------------------------------------------------------------

SCHEDULES = {
    # per step: ("prefill", [extend_len per request]) or ("decode", n) = n decode steps
    4: [("prefill", [5, 3]), ("prefill", [6, 9]), ("decode", 9), ("prefill", [7, 2]), ("decode", 3)],
    128: [("prefill", [100, 127]), ("decode", 1), ("prefill", [282, 127]), ("decode", 1), ("prefill", [3, 140])],
}


@pytest.mark.parametrize("R, ring", [(4, 8), (4, 16), (128, 128), (128, 256)])
def test_chunked_steps_match_history_oracle(R, ring):
    gen = torch.Generator().manual_seed(11 + R + ring)
    hd, width = HD[R], WIDTH[R] * HD[R]
    rids = [3, 0]
    schedule = SCHEDULES[R]
    total = [0, 0]
    for kind, arg in schedule:
        for b in range(2):
            total[b] += arg[b] if kind == "prefill" else arg
    histories = [randn(gen, n, width, scale=2.0) for n in total]
    ape = randn(gen, WN[R], hd)
    flat = new_pool(gen, R, 4 * ring + R)
    seq = [0, 0]
    checked = 0
    for kind, arg in schedule:
        steps = [arg] if kind == "prefill" else [[1, 1]] * arg
        for extends in steps:
            inputs = torch.cat([histories[b][seq[b]:seq[b] + extends[b]] for b in range(2)])
            if kind == "prefill":
                reqs = [(rids[b], seq[b], extends[b]) for b in range(2)]
                plan_c, plan_w, events = ring_prefill_plans(R, ring, reqs)
                out = torch.full((plan_c.shape[0], hd), float("nan"))
                compress_prefill(flat.view(-1, R, width), inputs, ape, plan_c, plan_w,
                                 head_dim=hd, compress_ratio=R, out=out)
            else:
                plan_d = ring_decode_plan(R, ring, [(rids[b], seq[b] + 1) for b in range(2)])
                out = torch.full((2, hd), float("nan"))
                compress_decode(flat.view(-1, R, width), inputs, ape, plan_d, head_dim=hd, compress_ratio=R, out=out)
                events = [(b, seq[b]) if (seq[b] + 1) % R == 0 else None for b in range(2)]
            for row, event in enumerate(events):
                if event is None:
                    assert torch.equal(out[row], torch.zeros(hd))
                    continue
                b, p = event
                close(out[row], event_window_reference(histories[b], p, ape, head_dim=hd, compress_ratio=R), 1e-5)
                checked += 1
            seq = [seq[b] + extends[b] for b in range(2)]
    assert checked >= 4


# ---------------------------------------------------------------------------------------------
# Online c128 running state (contract §5)
# ---------------------------------------------------------------------------------------------

def online_inputs(gen, n, hd=64, dtype=torch.float64):
    kv = randn(gen, n, hd, dtype=dtype)
    score = randn(gen, n, hd, dtype=dtype, scale=3.0)
    ape = randn(gen, 128, hd, dtype=dtype)
    return kv, score, ape


def test_online_updates_equal_window_softmax():
    gen = torch.Generator().manual_seed(12)
    kv, score, ape = online_inputs(gen, 256)
    z = score + ape.repeat(2, 1)  # ape row = position mod 128
    for chunk in range(2):
        state = None
        for pos in range(128 * chunk, 128 * chunk + 128):
            if pos % 128 == 0:
                state = online_reset(kv[pos], z[pos])
            else:
                state = online_update(state, kv[pos], z[pos])
        window = slice(128 * chunk, 128 * chunk + 128)
        want = window_softmax(kv[window], score[window], ape, dtype=torch.float64)
        close(state.k, want, 1e-12)
        assert torch.equal(state.m, z[window].amax(dim=0))
        close(state.s, torch.exp(z[window] - state.m).sum(dim=0), 1e-12)

    # The same running state in fp32 stays within fp32 rounding of the fp64 softmax.
    state32 = online_pool(kv[:128].float(), z[:128].float())
    close(state32.k, window_softmax(kv[:128], score[:128], ape, dtype=torch.float64), 1e-5)


def test_online_merge_of_partial_states_equals_one_pass():
    gen = torch.Generator().manual_seed(13)
    kv, score, ape = online_inputs(gen, 128)
    z = score + ape
    whole = online_pool(kv, z)
    merged = None
    for lo, hi in [(0, 37), (37, 90), (90, 128)]:
        part = online_pool(kv[lo:hi], z[lo:hi])
        merged = part if merged is None else online_merge(merged, part)
    assert torch.equal(merged.m, whole.m)
    close(merged.s, whole.s, 1e-12)
    close(merged.k, whole.k, 1e-12)
    close(merged.k, window_softmax(kv, score, ape, dtype=torch.float64), 1e-12)


def test_online_state_row_layout_round_trip():
    gen = torch.Generator().manual_seed(14)
    kv, score, ape = online_inputs(gen, 5)
    state = online_pool(kv, score + ape[:5])
    row = online_state_to_row(state)
    assert row.shape == (3 * 64,)
    assert torch.equal(row[:64], state.m) and torch.equal(row[64:128], state.s) and torch.equal(row[128:], state.k)
    back = online_state_from_row(row, 64)
    assert all(torch.equal(a, b) for a, b in zip(back, state))


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------

def test_bad_arguments_raise():
    gen = torch.Generator().manual_seed(15)
    hd = HD[4]
    history = randn(gen, 8, 4 * hd)
    ape = randn(gen, 8, hd)
    flat = new_pool(gen, 4, 16)
    plan_c, plan_w = compress_plan([(8, 7, 0, -1, 0)]), write_plan([])
    out = torch.empty(1, hd)

    def run(**over):
        args = dict(kv_score_buffer=flat.view(-1, 4, 4 * hd), kv_score_input=history, ape=ape,
                    plan_c=plan_c, plan_w=plan_w, head_dim=hd, compress_ratio=4, out=out)
        args.update(over)
        return compress_prefill(**args)

    with pytest.raises(ValueError, match="head_dim"):
        run(head_dim=64)
    with pytest.raises(ValueError, match="compress_ratio"):
        run(compress_ratio=8)
    with pytest.raises(ValueError, match="ape"):
        run(ape=randn(gen, 4, hd))
    with pytest.raises(TypeError, match="ape"):
        run(ape=ape.double())
    with pytest.raises(ValueError, match="input rows"):
        run(plan_c=compress_plan([(8, 9, 0, -1, 0)]))  # window runs past the input
    with pytest.raises(ValueError, match="state rows"):
        run(plan_c=compress_plan([(8, 7, 3, 99, 99)]))  # page outside the pool
    with pytest.raises(ValueError, match="write_loc"):
        run(plan_w=write_plan([(0, 5), (1, 5)]))  # two writes to one state row
