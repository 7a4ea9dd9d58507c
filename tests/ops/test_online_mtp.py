"""Online c128 with speculative decoding (contract §5.6): write_prefix_states, mark_pending and
commit_pending on the CPU (the torch reference) and, with a GPU, the kernels.

Oracles: a float64 model of the rules written here from the contract (every draft slot, and every
row the rules do not name keeps its NaN poison), and the property that a verify of V draft tokens
of which `a` are accepted and committed leaves the main state that `a` ordinary online decode steps
leave.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import dsv4jit
from dsv4jit import CompressorDecodePlan, compress_forward, runtime

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu,
                                   pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])
DEVICES = ["cpu", CUDA]
NAN = float("nan")


# ---- the float64 model of the rules -------------------------------------------------------------

def model_write_prefix(state, x, seq, slots, ape, verify, stride, hd):
    """The draft rows the rules write, as {row: float64 [3·hd]}, from the float64 pool `state`."""
    rows = {}
    for b, (length, slot) in enumerate(zip(seq, slots)):
        start = length % 128
        m = s = k = None
        if start:
            m, s, k = state[slot, :hd], state[slot, hd:2 * hd], state[slot, 2 * hd:]
        for i in range(verify):
            pos = (start + i) % 128
            kv, z = x[b * verify + i, :hd], x[b * verify + i, hd:] + ape[pos]
            if pos == 0:
                m, s, k = z, torch.ones_like(z), kv
            else:
                m2 = torch.maximum(m, z)
                a, e = s * torch.exp(m - m2), torch.exp(z - m2)
                m, s, k = m2, a + e, (k * a + kv * e) / (a + e)
            if (length + i + 1) % 128:
                rows[slot + (i + 1) * stride] = torch.cat([m, s, k])
    return rows


def model_commit(state, seq_after, slots, pending, verify, stride, num_req_slots):
    """{main row: source row} of a commit."""
    copies = {}
    for length, slot in zip(seq_after, slots):
        if not 0 <= slot < num_req_slots or pending[slot] < 0:
            continue
        accepted = min(max(length - pending[slot], 0), verify)
        if accepted and (pending[slot] + accepted) % 128:
            copies[slot] = slot + accepted * stride
    return copies


# ---- scenarios ----------------------------------------------------------------------------------

class Verify:
    """A pool of `slots` requests with `verify` draft banks, NaN-poisoned except the main rows of the
    batch's requests that continue a chunk (those hold a valid state), and a verify batch."""

    def __init__(self, device, lengths, verify, *, hd=128, state_dtype=torch.float32, index_dtype=torch.int64,
                 extra_slots=3, stride=None, flat=False, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.hd, self.verify, self.device = hd, verify, device
        self.batch = len(lengths)
        self.num_req_slots = self.batch + extra_slots
        self.stride = self.num_req_slots + rng.randint(0, 2) if stride is None else stride
        self.lengths = lengths
        self.slots = rng.sample(range(self.num_req_slots), self.batch)
        rows = (verify + 1) * self.stride + rng.randint(0, 3)
        pool = torch.full((rows, 3 * hd), NAN, dtype=torch.float64)
        for slot in self.slots:  # a valid state: max, positive sum, average
            pool[slot] = torch.cat([torch.randn(hd, generator=gen), torch.rand(hd, generator=gen) * 5 + 1,
                                    torch.randn(hd, generator=gen)])
        pool = pool.to(state_dtype)
        self.state = (pool if flat else pool.view(rows, 1, 3 * hd)).to(device)
        self.x = (2 * torch.randn(self.batch * verify, 2 * hd, generator=gen)).to(device)
        self.ape = (0.5 * torch.randn(128, hd, generator=gen)).to(device)
        self.seq = torch.tensor(lengths, dtype=index_dtype, device=device)
        self.rid = torch.tensor(self.slots, dtype=index_dtype, device=device)
        self.r2t = torch.zeros(self.num_req_slots, 8, dtype=torch.int32, device=device)
        self.pending = torch.full((self.num_req_slots + 2,), 7, dtype=torch.int64, device=device)

    def pool64(self):
        return self.state.cpu().double().view(-1, 3 * self.hd)

    def write_prefix(self):
        dsv4jit.online_c128_mtp_write_prefix_states(self.x, self.seq, self.rid, self.r2t, self.ape, self.state,
                                                    self.batch, self.verify, self.stride, head_dim=self.hd)

    def mark(self, seq=None, batch=None):
        dsv4jit.online_c128_mtp_mark_pending(self.seq if seq is None else seq, self.rid, self.pending,
                                             self.batch if batch is None else batch, self.num_req_slots,
                                             head_dim=self.hd, state_dtype=self.state.dtype)

    def commit(self, seq_after):
        dsv4jit.online_c128_mtp_commit_pending(seq_after, self.rid, self.r2t, self.pending, self.state, self.batch,
                                               self.verify, self.stride, self.num_req_slots, head_dim=self.hd)


def tolerance(state_dtype):
    return 1e-2 if state_dtype == torch.bfloat16 else 1e-5  # bf16: one rounding of the stored value


def assert_rows(pool_after, pool_before, expected: dict, state_dtype):
    """Rows in `expected` hold their values; every other row is unchanged (bit for bit, NaN included)."""
    touched = sorted(expected)
    tol = tolerance(state_dtype)
    if touched:
        torch.testing.assert_close(pool_after[touched], torch.stack([expected[r] for r in touched]).to(state_dtype)
                                   .double(), rtol=tol, atol=tol)
    keep = [r for r in range(pool_after.shape[0]) if r not in expected]
    assert torch.equal(pool_after[keep].isnan(), pool_before[keep].isnan())
    assert torch.equal(pool_after[keep].nan_to_num(), pool_before[keep].nan_to_num())


LENGTHS = [0, 1, 5, 127, 128, 126, 250, 255, 256, 1000, 123]  # chunk offsets 0, 1, 5, 127, 0, 126, ...


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("verify", range(1, 9))
def test_write_prefix_states_every_draft_row(device, verify):
    v = Verify(device, LENGTHS, verify, seed=verify)
    before = v.pool64()
    v.write_prefix()
    expected = model_write_prefix(before, v.x.cpu().double(), LENGTHS, v.slots, v.ape.cpu().double(), verify,
                                  v.stride, v.hd)
    assert len(expected) < len(LENGTHS) * verify  # some prefixes close a chunk: their rows stay poisoned
    assert_rows(v.pool64(), before, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("hd, flat", [(128, False), (256, True), (512, False)])
def test_write_prefix_states_variants(device, state_dtype, index_dtype, hd, flat):
    lengths = [3, 124, 127, 128, 640, 77]
    v = Verify(device, lengths, 5, hd=hd, state_dtype=state_dtype, index_dtype=index_dtype, flat=flat, seed=hd)
    before = v.pool64()
    v.write_prefix()
    expected = model_write_prefix(before, v.x.cpu().double(), lengths, v.slots, v.ape.cpu().double(), 5, v.stride,
                                  hd)
    assert_rows(v.pool64(), before, expected, state_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_mark_and_commit(device, index_dtype):
    lengths = [10, 126, 127, 300, 511, 2, 40]
    verify = 4
    v = Verify(device, lengths, verify, index_dtype=index_dtype, seed=5)
    v.write_prefix()
    v.mark()
    pending = [-1] * v.num_req_slots
    for n, slot in zip(lengths, v.slots):
        pending[slot] = n
    assert v.pending.tolist() == pending + [7, 7]  # entries past num_req_slots untouched
    # accepted: 1, 2 (closes the chunk at 128: no copy), 0 (a length below the recorded one), 9 -> clamped
    # to 4, 4, 3, 1
    after = [11, 128, 120, 309, 515, 5, 41]
    before = v.pool64()
    v.commit(torch.tensor(after, dtype=index_dtype, device=device))
    copies = model_commit(before, after, v.slots, pending, verify, v.stride, v.num_req_slots)
    assert sorted(copies) == sorted(v.slots[i] for i in (0, 3, 4, 5, 6))
    expected = {main: before[src] for main, src in copies.items()}
    pool = v.pool64()
    assert torch.equal(pool[list(expected)], torch.stack(list(expected.values())))  # copies, bit for bit
    assert_rows(pool, before, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_skips_requests_not_pending(device):
    v = Verify(device, [5, 6, 7], 2, seed=3)
    v.write_prefix()
    v.mark()
    v.pending[v.slots[1]] = -1
    rid = v.rid.clone()
    rid[2] = v.num_req_slots  # outside the pending slots: skipped, as upstream
    before = v.pool64()
    dsv4jit.online_c128_mtp_commit_pending(v.seq + 1, rid, v.r2t, v.pending, v.state, 3, 2, v.stride,
                                           v.num_req_slots, head_dim=v.hd)
    assert_rows(v.pool64(), before, {v.slots[0]: before[v.slots[0] + v.stride]}, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_mark_pending_empty_batch_writes_nothing(device):
    v = Verify(device, [5, 6], 2)
    v.mark(batch=0)
    assert v.pending.tolist() == [7] * (v.num_req_slots + 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_accept_commit_equals_decode_steps(device, state_dtype):
    """A verify of V tokens with `a` accepted and committed = `a` online decode steps of those tokens."""
    hd, verify = 128, 6
    lengths = [1, 126, 127, 200, 380, 125, 64]
    accepted = [6, 2, 1, 3, 5, 4, 6]  # 126 + 2 and 125 + 4 cross a chunk boundary
    v = Verify(device, lengths, verify, hd=hd, state_dtype=state_dtype, seed=11)
    decoded = v.state.clone()
    v.write_prefix()
    v.mark()
    v.commit(v.seq + torch.tensor(accepted, dtype=v.seq.dtype, device=device))
    tokens = v.x.view(v.batch, verify, -1)
    for step in range(verify):
        active = [b for b in range(v.batch) if step < accepted[b]]
        seq = torch.tensor([lengths[b] + step + 1 for b in active], device=device)
        plan = CompressorDecodePlan.generate_online(seq, v.rid[active].to(torch.int64), v.r2t, 0)
        out = torch.empty(len(active), hd, device=device)
        compress_forward(decoded, tokens[active, step].contiguous(), v.ape, plan, head_dim=hd, compress_ratio=128,
                         is_online=True, out=out)
    main = [s for s, n, a in zip(v.slots, lengths, accepted) if (n + a) % 128]
    got, want = v.pool64()[main], decoded.cpu().double().view(-1, 3 * hd)[main]
    # fp32: the decode steps round-trip the state through the pool after every token, the verify
    # keeps it in registers; bf16: each decode step rounds the state to bf16
    tol = 3e-2 if state_dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# ---- bad arguments: a clear error naming the argument, nothing written ---------------------------

def _call(v: Verify, op: str, **change):
    args = dict(kv_score_input=v.x, seq_lens=v.seq, req_pool_indices=v.rid, req_to_token=v.r2t, ape=v.ape,
                state=v.state, batch_size=v.batch, num_verify_tokens=v.verify, state_slot_stride=v.stride,
                head_dim=v.hd, pending_seq_lens=v.pending, num_req_slots=v.num_req_slots,
                state_dtype=v.state.dtype)
    args.update(change)
    names = {"write": ("kv_score_input", "seq_lens", "req_pool_indices", "req_to_token", "ape", "state",
                       "batch_size", "num_verify_tokens", "state_slot_stride"),
             "mark": ("seq_lens", "req_pool_indices", "pending_seq_lens", "batch_size", "num_req_slots"),
             "commit": ("seq_lens", "req_pool_indices", "req_to_token", "pending_seq_lens", "state", "batch_size",
                        "num_verify_tokens", "state_slot_stride", "num_req_slots")}[op]
    fn = {"write": dsv4jit.online_c128_mtp_write_prefix_states, "mark": dsv4jit.online_c128_mtp_mark_pending,
          "commit": dsv4jit.online_c128_mtp_commit_pending}[op]
    keywords = {"head_dim": args["head_dim"]}
    if op == "mark":
        keywords["state_dtype"] = args["state_dtype"]
    fn(*(args[n] for n in names), **keywords)


BAD = [  # (op, the change of arguments, error, the argument it names)
    ("write", lambda v: {"num_verify_tokens": 0}, ValueError, "num_verify_tokens"),
    ("write", lambda v: {"num_verify_tokens": 9}, ValueError, "num_verify_tokens"),
    ("commit", lambda v: {"num_verify_tokens": 9}, ValueError, "num_verify_tokens"),
    ("write", lambda v: {"state_slot_stride": 100}, ValueError, "state_slot_stride"),
    ("write", lambda v: {"state_slot_stride": 0}, ValueError, "state_slot_stride"),
    ("commit", lambda v: {"num_req_slots": v.stride + 1}, ValueError, "state_slot_stride"),
    ("commit", lambda v: {"num_req_slots": 99}, ValueError, "num_req_slots"),
    ("mark", lambda v: {"num_req_slots": 99}, ValueError, "num_req_slots"),
    ("write", lambda v: {"batch_size": -1}, ValueError, "batch_size"),
    ("write", lambda v: {"batch_size": 2.0}, TypeError, "batch_size"),
    ("commit", lambda v: {"num_verify_tokens": "4"}, TypeError, "num_verify_tokens"),
    ("write", lambda v: {"head_dim": 100}, ValueError, "head_dim"),
    ("mark", lambda v: {"state_dtype": torch.float16}, TypeError, "state_dtype"),
    ("write", lambda v: {"seq_lens": "lengths"}, TypeError, "seq_lens"),
    ("mark", lambda v: {"pending_seq_lens": "pending"}, TypeError, "pending_seq_lens"),
    ("write", lambda v: {"seq_lens": v.seq[:2]}, ValueError, "seq_lens"),
    ("write", lambda v: {"seq_lens": v.seq.float()}, TypeError, "seq_lens"),
    ("commit", lambda v: {"req_pool_indices": v.rid[:1]}, ValueError, "req_pool_indices"),
    ("write", lambda v: {"kv_score_input": v.x[:2]}, ValueError, "kv_score_input"),
    ("write", lambda v: {"kv_score_input": v.x.double()}, TypeError, "kv_score_input"),
    ("write", lambda v: {"ape": v.ape[:64]}, ValueError, "ape"),
    ("write", lambda v: {"state": v.state.half()}, TypeError, "state"),
    ("write", lambda v: {"req_to_token": v.r2t.long()}, TypeError, "req_to_token"),
    ("commit", lambda v: {"pending_seq_lens": v.pending.int()}, TypeError, "pending_seq_lens"),
    ("mark", lambda v: {"pending_seq_lens": v.pending.int()}, TypeError, "pending_seq_lens"),
    # rows of another width: the message names head_dim and the pool, as compress_forward's does
    ("commit", lambda v: {"state": v.state.view(-1, 3 * v.hd)[:, :3 * 64]}, ValueError, "head_dim"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, change, error, name", BAD, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(BAD)])
def test_bad_arguments_named_and_nothing_written(device, op, change, error, name):
    v = Verify(device, [5, 130, 127], 3, extra_slots=1, stride=4)
    v.write_prefix()
    v.mark()
    pool, pending = v.pool64(), v.pending.clone()
    with pytest.raises(error, match=rf"^dsv4jit\.online_c128_mtp_\w+: argument '{name}'"):
        _call(v, op, **change(v))
    assert torch.equal(v.pool64().nan_to_num(), pool.nan_to_num()) and torch.equal(v.pending, pending)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", ["slot", "length"])
def test_bad_request_rows(device, bad):
    """A slot outside [0, state_slot_stride) (it would write other requests' draft rows, or outside the
    pool) or a negative length: the CPU path raises before writing; the kernel skips a slot outside,
    writes the others', and checked mode reports it; a negative length checked mode names before the
    launch, as the CPU path does."""
    v = Verify(device, [5, 6], 2, seed=1)
    if bad == "slot":
        v.rid[1] = 10**6
    else:
        v.seq[1] = -3
    before = v.pool64()
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match="seq_lens|req_pool_indices"):
            v.write_prefix()
    finally:
        runtime.set_checks(None)
    written = [v.slots[0] + k * v.stride for k in (1, 2)] if device == "cuda" and bad == "slot" else []
    assert_rows(v.pool64(), before, {r: v.pool64()[r] for r in written}, torch.float32)
    assert not v.pool64()[written].isnan().any()


# ---- the planner's input rules: empty batches, duplicate slots, negative lengths, head_dim ---------

@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_batch_is_valid_on_every_op(device):
    """batch_size 0 with empty inputs writes nothing (write_prefix_states used to fail: "cannot reshape
    tensor of 0 elements")."""
    v = Verify(device, [5, 6], 2)
    empty = dict(kv_score_input=v.x[:0], seq_lens=v.seq[:0], req_pool_indices=v.rid[:0], batch_size=0)
    pool, pending = v.pool64(), v.pending.clone()
    for op in ("write", "mark", "commit"):
        _call(v, op, **empty)
    assert torch.equal(v.pool64().nan_to_num(), pool.nan_to_num()) and torch.equal(v.pending, pending)


REQUEST_RULES = [  # (the change of the batch's requests, the argument named, the rest of the message)
    (lambda v: {"req_pool_indices": v.rid[[0, 1, 1]]}, "req_pool_indices",
     r": two rows of the batch name one slot \(two requests would write one state\)"),
    (lambda v: {"seq_lens": torch.full_like(v.seq, -5)}, "seq_lens", r": entries must be >= 0, got -5"),
]


def _checked(device: str):
    """Checked mode on the GPU (where the rules cost a sync); the CPU path checks them always."""
    runtime.set_checks(device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["write", "mark", "commit"])
@pytest.mark.parametrize("rule", range(len(REQUEST_RULES)))
def test_duplicate_slots_and_negative_lengths_are_named_on_every_op(device, op, rule):
    """As the planner names them ("two requests name one slot"); they used to overwrite a row, or
    record a negative pending length that commit then ignored."""
    change, name, rest = REQUEST_RULES[rule]
    v = Verify(device, [5, 130, 127], 3, extra_slots=1, stride=4)
    v.write_prefix()
    v.mark()
    pool, pending = v.pool64(), v.pending.clone()
    _checked(device)
    try:
        with pytest.raises(ValueError, match=rf"^dsv4jit\.online_c128_mtp_\w+: argument '{name}'{rest}"):
            _call(v, op, **change(v))
    finally:
        runtime.set_checks(None)
    assert torch.equal(v.pool64().nan_to_num(), pool.nan_to_num()) and torch.equal(v.pending, pending)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["write", "commit"])
def test_a_head_dim_the_pool_does_not_have_is_named(device, op):
    """head_dim 256 on a pool of 128-wide states: the message named 'state'."""
    v = Verify(device, [5, 6], 2)
    pool = v.pool64()
    with pytest.raises(ValueError, match=r"^dsv4jit\.online_c128_mtp_\w+: argument 'head_dim' is 256, but the rows of "
                                         r"'state' have 384 values .*in the online compressor they have 3·head_dim = 768"):
        _call(v, op, head_dim=256)
    assert torch.equal(v.pool64().nan_to_num(), pool.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["kv_score_input", "ape"])
def test_a_non_finite_input_of_write_prefix_states_is_named(device, name):
    """On every all-CPU call, and in checked mode on the GPU; nothing is written."""
    v = Verify(device, [5, 130, 127], 3, extra_slots=1, stride=4)
    spoiled = getattr(v, {"kv_score_input": "x", "ape": "ape"}[name]).clone()
    spoiled[1, 2] = float("inf")
    pool = v.pool64()
    _checked(device)
    try:
        with pytest.raises(ValueError, match=rf"^dsv4jit\.online_c128_mtp_write_prefix_states: argument '{name}': must "
                                             r"hold finite values only \(no NaN or infinity\), got inf at \[1, 2\]"):
            _call(v, "write", **{name: spoiled})
    finally:
        runtime.set_checks(None)
    assert torch.equal(v.pool64().nan_to_num(), pool.nan_to_num())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture():
    v = Verify("cuda", [5, 126, 300], 4, hd=512, seed=2)
    fresh = Verify("cuda", [5, 126, 300], 4, hd=512, seed=2)
    after = v.seq + 3
    for w in (v, fresh):  # warm: load the modules outside the capture
        w.write_prefix()
        w.mark()
        w.commit(after)
    v = Verify("cuda", [5, 126, 300], 4, hd=512, seed=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        v.write_prefix()
        v.mark()
        v.commit(after)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(v.pool64().nan_to_num(), fresh.pool64().nan_to_num())
    assert torch.equal(v.pending, fresh.pending)
    assert math.isfinite(float(v.pool64()[v.slots[0]].sum()))
