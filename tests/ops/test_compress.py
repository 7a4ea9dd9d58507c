"""compress_forward through the public API: contract §4, the oracle of contract §3.11, and the
choices of contract §9.3, contract §9.6 and contract §9.10.

Every test runs on "cpu" (the torch reference backend; also exercises the test logic) and on "cuda"
(the kernels; skipped without a GPU). Plans come from the real planner (CompressorPrefillPlan /
CompressorDecodePlan), the state pool is a paged pool from ``helpers.pool_utils.random_pool`` (or a
request ring / the legacy layout), and a ``Scenario`` (helpers/compress_scenario.py) keeps every
request's true token history and runs the checks below.

Oracle (independent of the op): an fp64 window softmax (contract §4.1 to contract §4.3) over the request's token
history. The values pooled are the ones the op is specified to see: a position written by an earlier
step is read back from the state (input -> state dtype -> input dtype, contract §4.1); a position of the
current prefill step comes straight from the input; a decode step reads its own token back from the
state. With an fp32 output the tolerance is 1e-5 (cpu) / 1e-4 (cuda) in atol and rtol, otherwise 5e-3.

Checks after every step: output rows NaN-poisoned before the call; every valid compress row matches the
oracle; invalid / padding plan rows stay NaN; decode rows without an event are exactly 0; the state
rows named by the plan's write rows (plan_w / plan_d write_loc) hold exactly the input rows cast to
the state dtype, and every other state element keeps its bits (the pool starts all-NaN, so a read of
a row that no step wrote would also surface as NaN in an output).
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4jit import CompressorDecodePlan, CompressorPrefillPlan, compress_forward
from helpers.compress_scenario import (ALL_CONFIGS, C4_LEGACY, C4_PAGED_8, C4_PAGED_16, C4_REQ_8, C4_REQ_16, C128_128,
                                       C128_256, C128_LEGACY, CUDA_MARKS, DEVICES, NAN, ROW_WIDTH, Scenario,
                                       config_id, dtype_id)
from helpers.kernel_trace import dsv4jit_kernels
from helpers.pool_utils import SWA_PAGE


def _scenario(device, config, **kw) -> Scenario:
    ratio, mode, ring = config
    return Scenario(device, ratio, mode, ring, **kw)


# ------------------------------------------------------------------------------------------------
# 0. the oracle itself
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_oracle_matches_event_window_reference(device, ratio):
    """The batched fp64 oracle equals dsv4jit.reference's per-event fp64 history pooling."""
    from dsv4jit.reference.compress import event_window_reference

    sc = Scenario(device, ratio, num_reqs=2, max_ctx=400)
    hist = sc.random_rows(400)
    sc.hist[1] = hist
    ps = [p for p in range(200 if ratio == 4 else 400) if (p + 1) % ratio == 0]
    got = sc.oracle([1] * len(ps), ps, [0] * len(ps))
    for i, p in enumerate(ps):
        want = event_window_reference(hist, p, sc.ape, head_dim=sc.hd, compress_ratio=ratio)
        torch.testing.assert_close(got[i], want, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# 1. no-context prefill
# ------------------------------------------------------------------------------------------------

NO_CONTEXT = [(4, s) for s in (4, 8, 32, 256, 1024)] + [(128, s) for s in (128, 256, 512)]


@pytest.mark.parametrize("ratio,seq", NO_CONTEXT, ids=[f"c{r}-seq{s}" for r, s in NO_CONTEXT])
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_no_context(device, ratio, seq):
    sc = Scenario(device, ratio, "paged" if ratio == 4 else "ring", num_reqs=3, max_ctx=seq, seed=seq)
    sc.prefill([2], [seq])
    assert sc.events[2] == seq // ratio


@pytest.mark.parametrize("config", [C4_PAGED_8, C128_128], ids=config_id)
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long_ragged(device, config):
    """A long multi-request prefill (cuda: tens of thousands of tokens at hd 512)."""
    big = torch.device(device).type == "cuda"
    lens = [9000, 4099, 17, 12285] if big else [1500, 259, 3, 1031]
    sc = _scenario(device, config, num_reqs=6, max_ctx=max(lens) + 1, seed=7)
    sc.prefill([5, 0, 3, 2], lens)
    sc.prefill([3, 5], [1, 1])


@pytest.mark.parametrize("config", [C4_PAGED_8, C128_128], ids=config_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_prefill_without_prefixes_is_one_launch(device, config):
    """A prefill in which no request has a prefix (plan.reads_state False: the pool pass reads no state
    row) is one launch, the write pass's blocks beside the pool pass's; with a prefix, two in stream
    order. Both match the oracle."""
    ratio = config[0]
    sc = _scenario(device, config, num_reqs=3, seed=12)
    launched = [dsv4jit_kernels(lambda: sc.prefill([0, 1], [5, 3 * ratio + 1]), "compress::"),
                dsv4jit_kernels(lambda: sc.prefill([0, 2], [ratio + 2, 7]), "compress::")]  # request 0 resumes
    assert [len(names) for names in launched] == [1, 2], launched
    assert "prefill_one_grid_kernel" in launched[0][0] and "prefill_write_kernel" in launched[1][1], launched


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_captured_prefill_keeps_its_passes_in_order(device):
    """A graph captured from a plan without prefixes keeps the two passes in stream order, since it
    replays whatever plan its buffers hold later: after copy_ of a plan with prefixes it pools before
    it writes, as an eager call on that plan does."""
    sc = _scenario(device, C4_PAGED_8, num_reqs=2, max_ctx=64, seed=13)
    rpi = torch.tensor([0, 1], device=sc.device)

    def plan(seq, ext):
        return CompressorPrefillPlan.generate(4, rpi, torch.tensor(seq), torch.tensor(ext), sc.r2t, sc.f2s, SWA_PAGE,
                                              8, 24, use_cuda_graph=True)

    fresh, resumed = plan([10, 14], [10, 14]), plan([21, 17], [13, 11])
    assert not fresh.reads_state and resumed.reads_state
    x = torch.randn(24, sc.last_dim, device=sc.device)
    state = torch.randn(sc.state.shape, device=sc.device)
    out = torch.full((24, sc.hd), NAN, device=sc.device)
    expected_state, expected_out = state.clone(), out.clone()
    compress_forward(expected_state, x, sc.ape, resumed, head_dim=sc.hd, compress_ratio=4, out=expected_out)
    compress_forward(state.clone(), x, sc.ape, fresh, head_dim=sc.hd, compress_ratio=4, out=out.clone())  # loads
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compress_forward(state, x, sc.ape, fresh, head_dim=sc.hd, compress_ratio=4, out=out)
    fresh.copy_(resumed)
    assert len(dsv4jit_kernels(graph.replay, "compress::")) == 2
    assert torch.equal(state, expected_state)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------------
# 2. prefill, then decode steps across compress boundaries
# ------------------------------------------------------------------------------------------------

DECODE_CASES = ([(cfg, pre) for cfg in (C4_PAGED_8, C4_PAGED_16, C4_REQ_8, C4_LEGACY) for pre in (13, 250)]
                + [(cfg, 250) for cfg in (C128_128, C128_256, C128_LEGACY)])


@pytest.mark.parametrize("config,prefill_len", DECODE_CASES,
                         ids=[f"{config_id(c)}-pre{p}" for c, p in DECODE_CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_then_decode(device, config, prefill_len):
    ratio = config[0]
    if ratio == 4:
        steps = 12              # events at three boundaries (13 -> 25; 250 -> 262 crosses the SWA page)
    else:
        steps = 270 if torch.device(device).type == "cuda" else 140   # events at 256, 384 (, 512)
    sc = _scenario(device, config, num_reqs=3, max_ctx=prefill_len + steps, seed=prefill_len)
    sc.prefill([1], [prefill_len])
    for _ in range(steps):
        sc.decode([1])
    assert sc.events[1] == (prefill_len + steps) // ratio


# ------------------------------------------------------------------------------------------------
# 3. extend with a prefix that is not ratio-aligned (buffer slots are read)
# ------------------------------------------------------------------------------------------------

EXTEND_CASES = ([(cfg, pe) for cfg in (C4_PAGED_8, C4_REQ_8, C4_LEGACY)
                 for pe in ((5, 6), (1, 3), (7, 1), (6, 2), (13, 30), (258, 20))]
                + [(cfg, pe) for cfg in (C128_128, C128_LEGACY)
                   for pe in ((100, 200), (1, 127), (127, 1), (200, 100), (129, 127), (255, 1))])


@pytest.mark.parametrize("config,prefix_extend", EXTEND_CASES,
                         ids=[f"{config_id(c)}-p{p}e{e}" for c, (p, e) in EXTEND_CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_extend_unaligned_prefix(device, config, prefix_extend):
    prefix, extend = prefix_extend
    sc = _scenario(device, config, num_reqs=3, max_ctx=prefix + extend + 8, seed=prefix * 1000 + extend)
    sc.prefill([2], [prefix])
    plan = sc.prefill([2], [extend])
    c, _ = plan.rows()
    assert bool((c.buffer_len[c.valid] > 0).any()), "the case is meant to read buffer slots"
    sc.decode([2])


# ------------------------------------------------------------------------------------------------
# 4./5. ragged multi-request batches and mixed decode batches
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("config", ALL_CONFIGS, ids=config_id)
@pytest.mark.parametrize("device", DEVICES)
def test_ragged_batches(device, config, seed):
    """Permuted req_pool_indices, different prefixes and extends (some 1), shared paged pool."""
    ratio = config[0]
    big = torch.device(device).type == "cuda"
    rng = random.Random(seed)
    max_first = (1500 if big else 300) if ratio == 4 else (2000 if big else 420)
    sc = _scenario(device, config, num_reqs=8, max_ctx=2 * max_first + 8, seed=100 + seed)
    rids = rng.sample(range(8), 5)
    first = [rng.randint(1, max_first) for _ in rids]
    first[0] = 1
    sc.prefill(rids, first)
    rng.shuffle(rids)
    ext = [rng.choice([1, rng.randint(1, max_first)]) for _ in rids]
    gpu_lengths = big and config[1] != "legacy" and seed == 1
    n = sum(ext)
    # seed 1: cuda-graph padded plans (cuda: GPU lengths and a bucket larger than the tokens).
    sc.prefill(rids, ext, use_cuda_graph=seed == 1, gpu_lengths=gpu_lengths,
               num_q=n + 37 if gpu_lengths else None)
    rng.shuffle(rids)
    sc.decode(rids)
    assert sum(sc.events) > 0


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=config_id)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_batch_mixed_boundaries(device, config):
    ratio = config[0]
    # next decode lengths: c4 -> 4 (first window), 5, 8, 11, 12, 2; c128 -> 128, 256, 101, 384, 2, 129
    lens = [3, 4, 7, 10, 11, 1] if ratio == 4 else [127, 255, 100, 383, 1, 128]
    rids = [4, 0, 6, 2, 5, 1]
    sc = _scenario(device, config, num_reqs=8, max_ctx=400, seed=5)
    sc.prefill(rids, lens)
    sc.decode(rids)
    assert [sc.events[r] for r in rids] == [(n + 1) // ratio for n in lens]
    order = [rids[i] for i in (3, 1, 5, 0, 2, 4)]
    for step in range(1, 6):
        sc.decode(order if step % 2 else rids, out=None if step == 2 else "poison")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
@pytest.mark.parametrize("n", [120, 700])
def test_c128_decode_batch_of_many_requests(device, n):
    """c128 decode batches of several waves of a block per unit (120 requests: 960 units, over three
    waves on a 132-SM GPU) and of the resident blocks ranking more rows than one chunk of plan rows (700 >
    512): a third of the requests at a boundary (shuffled batch order), then none, then all of them."""
    sc = _scenario(device, C128_128, num_reqs=n, max_ctx=260, seed=13)
    rids = list(range(n))
    random.Random(13).shuffle(rids)
    sc.prefill(rids, [127 if r % 3 == 0 else 1 + r % 100 for r in rids])
    sc.decode(rids)  # the requests r % 3 == 0 close their first window
    assert sum(sc.events) == len(range(0, n, 3))
    sc.decode(rids)  # none closes one
    sc.prefill(rids, [255 - sc.lens[r] if r % 3 == 0 else 127 - sc.lens[r] for r in rids])
    sc.decode(rids)  # every request closes one
    assert sum(sc.events) == len(range(0, n, 3)) + n


# ------------------------------------------------------------------------------------------------
# 6. dtypes: state {fp32, bf16} x input {fp32, bf16, fp16}; explicit out of another dtype
# ------------------------------------------------------------------------------------------------

STATE_DTYPES = [torch.float32, torch.bfloat16]
IN_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _dtype_walk(sc: Scenario, out="poison", out_dtype=None):
    """prefill -> unaligned extend -> decode steps over a boundary, for two requests."""
    if sc.R == 4:
        sc.prefill([3, 1], [11, 6], out=out, out_dtype=out_dtype)
        sc.prefill([1, 3], [1, 3], out=out, out_dtype=out_dtype)       # request 1 -> 7, request 3 -> 14
        steps = 6
    else:
        sc.prefill([3, 1], [200, 130], out=out, out_dtype=out_dtype)
        sc.prefill([1, 3], [125, 54], out=out, out_dtype=out_dtype)    # request 1 -> 255, request 3 -> 254
        steps = 3
    for _ in range(steps):
        sc.decode([1, 3], out=out, out_dtype=out_dtype)
    assert sc.events[1] > 0 and sc.events[3] > 0


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_default_output(device, ratio, state_dtype, in_dtype):
    """Default output (allocated by the op, input dtype); ape passed as fp32 (converted by the op)."""
    config = C4_PAGED_8 if ratio == 4 else C128_128
    sc = _scenario(device, config, num_reqs=4, max_ctx=300, state_dtype=state_dtype, in_dtype=in_dtype,
                   seed=11)
    _dtype_walk(sc, out=None)


@pytest.mark.parametrize("in_dtype", IN_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("state_dtype", STATE_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_dtypes_poisoned_output(device, ratio, state_dtype, in_dtype):
    """Same walk with NaN-poisoned out= of the input dtype and ape already in the input dtype."""
    config = C4_REQ_8 if ratio == 4 else C128_256
    sc = _scenario(device, config, num_reqs=4, max_ctx=300, state_dtype=state_dtype, in_dtype=in_dtype,
                   ape_dtype=in_dtype, seed=12)
    _dtype_walk(sc, out="poison")


OUT_DTYPE_CASES = [(torch.float32, torch.bfloat16, torch.float32), (torch.float32, torch.float32, torch.bfloat16),
                   (torch.bfloat16, torch.float16, torch.float32), (torch.bfloat16, torch.float32, torch.float16)]


@pytest.mark.parametrize("state_dtype,in_dtype,out_dtype", OUT_DTYPE_CASES,
                         ids=[f"state_{dtype_id(s)}-in_{dtype_id(i)}-out_{dtype_id(o)}" for s, i, o in OUT_DTYPE_CASES])
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_explicit_out_of_another_dtype(device, ratio, state_dtype, in_dtype, out_dtype):
    config = C4_PAGED_16 if ratio == 4 else C128_128
    sc = _scenario(device, config, num_reqs=4, max_ctx=300, state_dtype=state_dtype, in_dtype=in_dtype, seed=13)
    _dtype_walk(sc, out="poison", out_dtype=out_dtype)


# ------------------------------------------------------------------------------------------------
# 7. long random scenario: the contract §3.11 oracle over chunked prefills and decodes
# ------------------------------------------------------------------------------------------------

def run_random_scenario(sc: Scenario, rng: random.Random, *, num_requests, max_prompt, max_chunk, decode_steps):
    rids = rng.sample(range(sc.num_reqs), num_requests)
    target = {r: rng.randint(1, max_prompt) for r in rids}
    target[rids[0]] = max_prompt                     # at least one long prompt
    step = 0
    while any(sc.lens[r] < target[r] for r in rids):
        pending = [r for r in rids if sc.lens[r] < target[r]]
        batch = rng.sample(pending, rng.randint(1, len(pending)))
        # running requests sometimes join with a short extend (chunked-prefill mixing)
        batch += [r for r in rids if r not in pending and rng.random() < 0.3 and sc.lens[r] < max_prompt + 40]
        rng.shuffle(batch)
        exts = []
        for r in batch:
            left = max(target[r] - sc.lens[r], 1)
            e = rng.choice([1, 2, 3, 5, 8, rng.randint(1, max_chunk), rng.randint(1, max_chunk)])
            exts.append(min(e, left))
        sc.prefill(batch, exts, use_cuda_graph=step % 3 == 2)
        step += 1
    for i in range(decode_steps):
        batch = [r for r in rids if rng.random() < 0.85] or [rng.choice(rids)]
        rng.shuffle(batch)
        sc.decode(batch, out=None if i % 7 == 3 else "poison")
    return rids


RANDOM_CASES = [(C4_PAGED_8, torch.float32), (C4_PAGED_16, torch.float32), (C4_REQ_8, torch.float32),
                (C4_PAGED_8, torch.bfloat16), (C128_128, torch.float32), (C128_256, torch.float32),
                (C128_256, torch.bfloat16)]


@pytest.mark.parametrize("config,state_dtype", RANDOM_CASES,
                         ids=[f"{config_id(c)}-state_{dtype_id(d)}" for c, d in RANDOM_CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_random_scenario_history_oracle(device, config, state_dtype):
    """4-6 requests, random chunked prefills (chunks incl. 1, unaligned prefixes), then decode steps;
    every compress event equals the fp64 pooling of the request's full history (contract §3.11)."""
    ratio = config[0]
    big = torch.device(device).type == "cuda"
    seed = 1000 + 10 * ALL_CONFIGS.index(config) + (state_dtype == torch.bfloat16)
    rng = random.Random(seed)
    if ratio == 4:
        max_prompt, max_chunk, decode_steps = (3000, 700, 40) if big else (400, 120, 20)
    else:
        max_prompt, max_chunk, decode_steps = (3000, 700, 260) if big else (400, 150, 135)
    sc = _scenario(device, config, num_reqs=8, max_ctx=max_prompt + decode_steps + 48, state_dtype=state_dtype,
                   seed=seed)
    rids = run_random_scenario(sc, rng, num_requests=rng.randint(4, 6), max_prompt=max_prompt,
                               max_chunk=max_chunk, decode_steps=decode_steps)
    for r in rids:
        assert sc.events[r] == sc.lens[r] // ratio, f"request {r}: every event of its history was checked"


@pytest.mark.parametrize("ring", [8, 16])
@pytest.mark.parametrize("device", DEVICES)
def test_paged_prefix_cache_resume_at_swa_page_boundary(device, ring):
    """Paged c4: request B reuses request A's first SWA page (prefix-cache hit at position 256) and
    extends from there; its first window's overlap half (positions 252-255) lives in A's page ring."""
    sc = Scenario(device, 4, "paged", ring, num_reqs=4, max_ctx=600, seed=21)
    a, b = 2, 0
    sc.prefill([a], [300])
    sc.r2t[b, :SWA_PAGE] = sc.r2t[a, :SWA_PAGE]       # shared full slots -> shared SWA slots
    sc.hist[b, :SWA_PAGE] = sc.hist[a, :SWA_PAGE]
    sc.lens[b] = SWA_PAGE
    plan = sc.prefill([b, a], [30, 5])
    c, _ = plan.rows()
    assert int(c.buffer_len[0]) == 4, "B's first event reads the overlap half from the state"
    for _ in range(6):
        sc.decode([a, b])


# ------------------------------------------------------------------------------------------------
# 8. empty plans
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches(device, ratio):
    sc = Scenario(device, ratio, "paged" if ratio == 4 else "ring", num_reqs=2, max_ctx=256)
    sc.prefill([1], [37])  # some state content, so "unchanged" means something
    empty = torch.zeros(0, dtype=torch.int64)
    rpi = empty.to(sc.device)
    x = torch.zeros(0, sc.last_dim, dtype=sc.in_dtype, device=sc.device)
    plans = [CompressorPrefillPlan.generate(ratio, rpi, empty, empty, sc.r2t, sc.f2s, SWA_PAGE, sc.ring, 0,
                                            use_cuda_graph=cg) for cg in (False, True)]
    if sc.device.type == "cuda":
        plans.append(CompressorPrefillPlan.generate(ratio, rpi, rpi, rpi, sc.r2t, sc.f2s, SWA_PAGE, sc.ring, 0,
                                                    use_cuda_graph=True))
    plans.append(CompressorDecodePlan.generate(ratio, rpi, sc.r2t, sc.f2s, rpi, SWA_PAGE, sc.ring))
    for plan in plans:
        assert plan[1].shape[0] == 0
        res = sc.call(x, plan)
        assert res.shape == (0, sc.hd) and res.dtype == sc.in_dtype and res.device == sc.device
        out = torch.empty(0, sc.hd, dtype=torch.float32, device=sc.device)
        res = sc.call(x, plan, out)
        assert res.shape == (0, sc.hd) and res.dtype == torch.float32
        sc.assert_state_unchanged("state after an empty step")


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("device", DEVICES)
def test_prefill_without_events_writes_state(device, ratio):
    """No compress event in the step: a [0, hd] output, but the write rows still land."""
    sc = Scenario(device, ratio, "paged" if ratio == 4 else "ring", num_reqs=2, max_ctx=256)
    plan = sc.prefill([1], [2 if ratio == 4 else 100])
    assert plan[1].shape[0] == 0 and plan[2].shape[0] > 0
    plan = sc.prefill([1], [1 if ratio == 4 else 20], use_cuda_graph=True)  # padded plans, still event-free
    assert plan[1].shape[0] == plan[2].shape[0] and not bool(plan.rows()[0].valid.any())
    assert sc.events[1] == 0


# ------------------------------------------------------------------------------------------------
# 9. CUDA-graph capture and replay of plan + compress
# ------------------------------------------------------------------------------------------------

class GraphStep:
    """Runs ``body()`` (plan + compress on static tensors): captured once and replayed on cuda, called
    eagerly on cpu (where it exercises the same static-buffer flow without a graph)."""

    def __init__(self, sc: Scenario, body, warmup):
        self.body = body
        self.graph = None
        self.plan = None
        if sc.device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                warmup()  # loads the kernels outside the capture, on a scratch state
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.plan = body()

    def run(self):
        if self.graph is None:
            self.plan = self.body()
        else:
            self.graph.replay()
        return self.plan


GRAPH_CONFIGS = [C4_PAGED_8, C4_REQ_16, C128_128, C128_256]


@pytest.mark.parametrize("config", GRAPH_CONFIGS, ids=config_id)
@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_prefill_replay(device, config):
    """Capture generate(GPU-resident lengths, use_cuda_graph=True) + compress_forward into a static
    output; replay with new lengths / inputs copied into the static tensors."""
    from dsv4jit import runtime

    ratio, mode, ring = config
    sc = _scenario(device, config, num_reqs=5, max_ctx=1100, seed=31)
    rids = [3, 0, 2]
    if ratio == 4:
        schedule, bucket = [[13, 20, 7], [5, 1, 30], [8, 8, 8], [1, 1, 1], [4, 9, 2]], 64
    else:
        schedule, bucket = [[200, 130, 60], [100, 1, 127], [56, 200, 90], [1, 1, 1], [128, 128, 128]], 512
    cuda = sc.device.type == "cuda"
    st_rpi = torch.tensor(rids, dtype=torch.int64, device=sc.device)
    st_seq = torch.ones(len(rids), dtype=torch.int64, device=sc.device)
    st_ext = torch.ones(len(rids), dtype=torch.int64, device=sc.device)
    st_x = torch.full((bucket, sc.last_dim), NAN, dtype=sc.in_dtype, device=sc.device)
    st_out = sc.poisoned(bucket)
    num_q = [bucket]

    def body(state=None, out=None):
        plan = CompressorPrefillPlan.generate(ratio, st_rpi, st_seq, st_ext, sc.r2t, sc.f2s, SWA_PAGE, ring,
                                              num_q[0], use_cuda_graph=True, use_req_ring=mode == "req_ring")
        compress_forward(sc.state if state is None else state, st_x[:num_q[0]], sc.ape, plan, head_dim=sc.hd,
                         compress_ratio=ratio, out=(st_out if out is None else out)[:num_q[0]])
        return plan

    runtime.set_checks(False)  # checked mode syncs, which a capture forbids
    try:
        st_seq.copy_(torch.tensor(schedule[0]))
        st_ext.copy_(torch.tensor(schedule[0]))
        graph = GraphStep(sc, body, lambda: body(sc.state.clone(), st_out.clone()))
        for exts in schedule:
            n = sum(exts)
            if not cuda:
                num_q[0] = n  # the CPU planner needs sum(extend) == num_q_tokens: no bucket padding
            st_seq.copy_(torch.tensor([sc.lens[r] + e for r, e in zip(rids, exts)]))
            st_ext.copy_(torch.tensor(exts))
            st_x.fill_(NAN)
            st_x[:n] = sc.random_rows(n)
            st_out.fill_(NAN)
            plan = graph.run()
            assert plan[1].shape[0] == num_q[0]
            sc.check_prefill(rids, exts, st_x[:num_q[0]], plan, st_out[:num_q[0]], st_out[:num_q[0]])
    finally:
        runtime.set_checks(None)
    assert all(sc.events[r] > 0 for r in rids)


@pytest.mark.parametrize("config", GRAPH_CONFIGS + [C4_LEGACY], ids=config_id)
@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_decode_replay(device, config):
    """Capture a decode step (plan from device seq_lens + compress_forward) and replay it for several
    consecutive decode steps."""
    from dsv4jit import runtime

    ratio = config[0]
    sc = _scenario(device, config, num_reqs=6, max_ctx=400, seed=41)
    rids = [3, 0, 2, 5]
    sc.prefill(rids, [13, 6, 3, 9] if ratio == 4 else [250, 120, 127, 300])
    steps = 12 if ratio == 4 else 10
    st_rpi = torch.tensor(rids, dtype=torch.int64, device=sc.device)  # no H2D copies inside the capture
    st_seq = torch.tensor([sc.lens[r] + 1 for r in rids], dtype=torch.int64, device=sc.device)
    st_x = sc.random_rows(len(rids))
    st_out = sc.poisoned(len(rids))

    def body(state=None, out=None):
        plan = sc.decode_plan(rids, st_seq, st_rpi)
        compress_forward(sc.state if state is None else state, st_x, sc.ape, plan, head_dim=sc.hd,
                         compress_ratio=ratio, out=st_out if out is None else out)
        return plan

    runtime.set_checks(False)
    try:
        graph = GraphStep(sc, body, lambda: body(sc.state.clone(), st_out.clone()))
        for _ in range(steps):
            st_seq.copy_(torch.tensor([sc.lens[r] + 1 for r in rids]))
            st_x.copy_(sc.random_rows(len(rids)))
            st_out.fill_(NAN)
            plan = graph.run()
            sc.check_decode(rids, st_x, plan, st_out, st_out)
    finally:
        runtime.set_checks(None)
    assert all(sc.events[r] > 0 for r in rids)


# ------------------------------------------------------------------------------------------------
# 10. argument errors
# ------------------------------------------------------------------------------------------------

def _error_cases(sc: Scenario, x, plan, out):
    """name -> (kwargs overrides of the good call, exception type, regex the message must match)."""
    hd, ld, R = sc.hd, sc.last_dim, sc.R
    dev = sc.device
    pages = sc.state.shape[0]
    fp32_pool = torch.zeros(pages, R, ld, dtype=torch.float32, device=dev)
    bf16_pool = torch.zeros(pages, R, ld, dtype=torch.bfloat16, device=dev)
    rpi = torch.tensor([1], dtype=torch.int64, device=dev)
    seq, ext = torch.tensor([13]), torch.tensor([13])
    c128_plan = CompressorPrefillPlan.generate(128, rpi, seq, ext, sc.r2t, sc.f2s, SWA_PAGE, 128, 13)
    c128_decode = CompressorDecodePlan.generate(128, rpi, sc.r2t, sc.f2s, seq.to(dev), SWA_PAGE, 128)
    d_plan = CompressorDecodePlan.generate(R, torch.tensor([1, 2], device=dev), sc.r2t, sc.f2s,
                                           torch.tensor([5, 9], device=dev), SWA_PAGE, sc.ring)
    small_hd = 64  # not a multiple of 128 (c4 tiling)
    cases = {
        "input_last_dim": (dict(kv_score_input=torch.zeros(x.shape[0], 3 * hd, dtype=x.dtype, device=dev)),
                           ValueError, "kv_score_input"),
        "input_not_2d": (dict(kv_score_input=x.view(x.shape[0], 4, hd)), ValueError, "kv_score_input"),
        "buffer_last_dim": (dict(kv_score_buffer=torch.zeros(pages, R, 2 * ld, device=dev)), ValueError,
                            "kv_score_buffer"),
        "bf16_state_viewed_from_fp32_pool": (dict(kv_score_buffer=fp32_pool.view(torch.bfloat16)), ValueError,
                                             "kv_score_buffer"),
        "bf16_state_viewed_as_fp32": (dict(kv_score_buffer=bf16_pool.view(torch.float32)), ValueError,
                                      "kv_score_buffer"),
        "buffer_dtype_fp16": (dict(kv_score_buffer=fp32_pool.half()), TypeError, "kv_score_buffer"),
        "input_dtype_fp64": (dict(kv_score_input=x.double()), TypeError, "kv_score_input"),
        "ape_dtype_int": (dict(ape=torch.zeros(sc.wn, hd, dtype=torch.int32, device=dev)), TypeError, "ape"),
        "ape_rows": (dict(ape=sc.ape[:4].contiguous()), ValueError, "ape"),
        "ape_of_the_other_ratio": (dict(ape=torch.zeros(128 if R == 4 else 8, hd, device=dev)), ValueError, "ape"),
        "ape_cols": (dict(ape=torch.zeros(sc.wn, hd + 128, device=dev)), ValueError, "ape"),
        "prefill_plan_of_the_wrong_ratio": (dict(plan=c128_plan), ValueError, "plan|compress_ratio"),
        "decode_plan_of_the_wrong_ratio": (dict(plan=c128_decode, kv_score_input=x[:1].contiguous(),
                                                out=None), ValueError, "plan|compress_ratio"),
        "compress_ratio_argument": (dict(compress_ratio=128), ValueError, "plan|compress_ratio|kv_score"),
        "head_dim_not_tiled": (dict(head_dim=small_hd,
                                    kv_score_buffer=torch.zeros(4, R, ROW_WIDTH[R] * small_hd, device=dev),
                                    kv_score_input=torch.zeros(x.shape[0], ROW_WIDTH[R] * small_hd, device=dev),
                                    ape=torch.zeros(sc.wn, small_hd, device=dev), out=None),
                               ValueError, "head_dim"),
        "out_rows": (dict(out=sc.poisoned(out.shape[0] + 1)), ValueError, "out"),
        "out_cols": (dict(out=torch.zeros(out.shape[0], hd * 2, device=dev)), ValueError, "out"),
        "out_dtype_int": (dict(out=torch.zeros(out.shape[0], hd, dtype=torch.int32, device=dev)), TypeError, "out"),
        "decode_input_rows": (dict(plan=d_plan, kv_score_input=sc.random_rows(3), out=None), ValueError,
                              "kv_score_input"),
    }
    if dev.type == "cuda":
        cpu_plan = sc.prefill_plan([1], [13])
        cpu_plan = CompressorPrefillPlan(R, cpu_plan.plan_c.cpu(), cpu_plan.plan_w.cpu(), None, 13)
        cases.update({
            "input_on_cpu": (dict(kv_score_input=x.cpu()), TypeError, "kv_score_input"),
            "out_on_cpu": (dict(out=out.cpu()), TypeError, "out"),
            "buffer_on_cpu": (dict(kv_score_buffer=sc.state.cpu()), TypeError, "kv_score_buffer"),
            "plan_on_cpu": (dict(plan=cpu_plan), TypeError, "plan"),
        })
    return cases


ERROR_NAMES = ["input_last_dim", "input_not_2d", "buffer_last_dim", "bf16_state_viewed_from_fp32_pool",
               "bf16_state_viewed_as_fp32", "buffer_dtype_fp16", "input_dtype_fp64", "ape_dtype_int", "ape_rows",
               "ape_of_the_other_ratio", "ape_cols", "prefill_plan_of_the_wrong_ratio",
               "decode_plan_of_the_wrong_ratio", "compress_ratio_argument", "head_dim_not_tiled", "out_rows",
               "out_cols", "out_dtype_int", "decode_input_rows"]
CUDA_ERROR_NAMES = ["input_on_cpu", "out_on_cpu", "buffer_on_cpu", "plan_on_cpu"]


@pytest.mark.parametrize("name", ERROR_NAMES + [pytest.param(n, marks=CUDA_MARKS) for n in CUDA_ERROR_NAMES])
@pytest.mark.parametrize("device", DEVICES)
def test_argument_errors_name_the_argument(device, name):
    if name in CUDA_ERROR_NAMES and torch.device(device).type != "cuda":
        pytest.skip("CPU/CUDA mixes need a CUDA device")
    sc = Scenario(device, 4, "paged", 8, num_reqs=3, max_ctx=64)
    plan = sc.prefill_plan([1], [13])
    x = sc.random_rows(13)
    out = sc.poisoned(plan[1].shape[0])
    overrides, exc, match = _error_cases(sc, x, plan, out)[name]
    kwargs = dict(kv_score_buffer=sc.state, kv_score_input=x, ape=sc.ape, plan=plan, head_dim=sc.hd,
                  compress_ratio=4, out=out)
    kwargs.update(overrides)
    with pytest.raises(exc, match=match):
        compress_forward(kwargs.pop("kv_score_buffer"), kwargs.pop("kv_score_input"), kwargs.pop("ape"),
                         kwargs.pop("plan"), **kwargs)
    sc.assert_state_unchanged(f"state after a rejected call ({name})")
