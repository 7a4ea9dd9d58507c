"""compress_and_store: byte-identical to compress_forward followed by compress_norm_rope_store.

Two copies of one paged pool run the same steps (same plans, same random inputs): copy A through the
two public ops, copy B through the fused op. After every step the state pools and the compressed
caches of both copies must be equal bit for bit. Both caches start from the same random bytes, so a
row the fused op fails to store (or stores where it must not) shows up as a difference, and every
step asserts that the two-step path did store rows (the comparison is never vacuous).

Scenarios reuse helpers.compress_scenario.Scenario (pools, plans, token rows) through
helpers.fused_twin.Twin over the c4 paged / request-ring / legacy and c128 ring / legacy addressing
modes, every store format, fp32 and bf16 state and input, prefill chunks with unaligned prefixes,
decode batches across boundaries, and CUDA-graph replay.
On "cpu" the op runs the reference of the two steps (API wiring); on "cuda" the fused kernel.
"""

from __future__ import annotations

import pytest
import torch

from dsv4jit import CompressorDecodePlan, compress_and_store, compress_forward, compress_norm_rope_store, set_checks
from dsv4jit.ops import fused as fused_ops
from helpers.compress_scenario import C4_LEGACY, C4_PAGED_8, C4_REQ_8, C128_128, C128_LEGACY, CUDA_MARKS, DEVICES
from helpers.fused_twin import MAX_CTX, Twin, fused_entries
from helpers.kernel_trace import dsv4jit_kernels

CONFIG_FORMATS = [
    (C4_PAGED_8, "v4_fp8"), (C4_PAGED_8, "v4_bf16"), (C4_PAGED_8, "indexer_fp4"), (C4_PAGED_8, "indexer_fp8"),
    (C4_REQ_8, "v4_fp8"), (C4_REQ_8, "indexer_fp4"), (C4_LEGACY, "v4_fp8"),
    (C128_128, "v4_fp8"), (C128_128, "v4_bf16"), (C128_LEGACY, "v4_fp8"),
]


def _id(cf) -> str:
    (ratio, mode, ring), fmt = cf
    return f"c{ratio}-{mode}-{fmt}"


def _prefill_then_decode(tw: Twin, decode_steps: int):
    sc = tw.sc
    r = sc.R
    # chunked prefills: a first chunk, then extends whose prefixes are not ratio-aligned
    tw.prefill([0, 1, 2, 3], [3 * r + 1, 2 * r - 1, r, 5])
    tw.prefill([1, 3, 0], [r + 3, 2 * r + 2, 1])
    tw.prefill([2], [r // 2 + 7])
    for _ in range(decode_steps):
        tw.decode([0, 1, 2, 3])


# The CPU runs (the reference of the two steps: API wiring) take two cases; the GPU runs all.
CASES = [pytest.param("cpu", cf, id=f"cpu-{_id(cf)}") for cf in (CONFIG_FORMATS[2], CONFIG_FORMATS[7])]
CASES += [pytest.param("cuda", cf, id=f"cuda-{_id(cf)}", marks=CUDA_MARKS) for cf in CONFIG_FORMATS]


@pytest.mark.parametrize("device, config_format", CASES)
def test_fused_equals_two_step(device, config_format):
    config, fmt = config_format
    tw = Twin(device, config, fmt)
    _prefill_then_decode(tw, decode_steps=11 if config[0] == 4 else 130)
    assert tw.stored_steps >= 3, "the scenario stored too few rows to prove anything"


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16)], ids=["bf16-state", "bf16-input", "bf16-both"])
@pytest.mark.parametrize("config_format", [(C4_PAGED_8, "v4_fp8"), (C4_PAGED_8, "indexer_fp4"),
                                           (C128_128, "v4_fp8")], ids=_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_equals_two_step_bf16(device, config_format, dtypes):
    config, fmt = config_format
    state_dtype, in_dtype = dtypes
    tw = Twin(device, config, fmt, state_dtype=state_dtype, in_dtype=in_dtype)
    _prefill_then_decode(tw, decode_steps=9 if config[0] == 4 else 130)
    assert tw.stored_steps >= 3


@pytest.mark.parametrize("config_format", [(C4_PAGED_8, "v4_fp8"), (C4_PAGED_8, "indexer_fp8"),
                                           (C128_128, "v4_fp8")], ids=_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_long_random_scenario(device, config_format):
    """Many requests, random chunked prefills and decode batches, int32 and int64 out_loc."""
    import random

    config, fmt = config_format
    tw = Twin(device, config, fmt, num_reqs=12, seed=7)
    sc, rng = tw.sc, random.Random(7)
    for step in range(40):
        room = [r for r in range(sc.num_reqs) if sc.lens[r] < MAX_CTX - 300]
        loc_dtype = torch.int32 if step % 2 else torch.int64
        if step % 3 == 0 or not all(sc.lens):
            rids = rng.sample(room, k=min(len(room), rng.randint(1, 5)))
            tw.prefill(rids, [rng.randint(1, 3 * sc.R + 5) for _ in rids], loc_dtype=loc_dtype,
                       gpu_lengths=step % 2 == 1 and sc.mode != "legacy")
        else:
            tw.decode(rng.sample(room, k=min(len(room), rng.randint(1, 10))), loc_dtype=loc_dtype)
    assert tw.stored_steps >= 10


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_ring_decode_runs_one_kernel(device, monkeypatch):
    """Ring decode calls run the fused kernel, c128 at any batch (every request at a boundary, one,
    none), c4 also in prefill; ring c128 prefill the two-step entry. The states and caches equal the
    public two-step ops' bit for bit."""
    calls = fused_entries(monkeypatch)
    n = 40
    tw = Twin(device, C128_128, "v4_fp8", num_reqs=n + 1, seed=5, num_locs=8 * 1024)
    tw.prefill(list(range(n + 1)), [127] * (n + 1))  # every request one token before its boundary
    tw.decode(list(range(n)))  # n boundary rows
    tw.prefill([n], [128])  # request n closes a window and stops one token before the next
    tw.decode(list(range(n + 1)))  # one boundary row among n + 1
    tw.decode(list(range(n + 1)))  # none
    c4 = Twin(device, C4_PAGED_8, "v4_fp8", num_reqs=n + 1, seed=6)
    c4.prefill(list(range(n + 1)), [9 + r % 4 for r in range(n + 1)])
    c4.decode(list(range(n + 1)))
    assert calls == [("fused", "prefill_two_step"), ("fused", "decode"), ("fused", "prefill_two_step"),
                     ("fused", "decode"), ("fused", "decode"), ("fused", "prefill"), ("fused", "decode")]
    assert tw.stored_steps == 3 and c4.stored_steps == 2


@pytest.mark.parametrize("fmt", ["v4_fp8", "indexer_fp4"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_c4_prefill_without_prefixes_is_one_launch(device, fmt):
    """A c4 prefill in which no request has a prefix is one launch (the write pass's blocks beside the
    pool-and-store pass's); with a prefix, two. Both equal the two steps bit for bit."""
    tw = Twin(device, C4_PAGED_8, fmt, num_reqs=3, seed=11)
    launched = []
    fused = tw.fused
    tw.fused = lambda *args: launched.append(dsv4jit_kernels(lambda: fused(*args)))
    tw.prefill([0, 1], [5, 41])
    tw.prefill([0, 2], [3, 131])  # request 0 resumes
    tw.decode([0, 1, 2])  # request 2 closes a window
    assert [len(names) for names in launched] == [1, 2, 1], launched
    assert "pool_and_store_kernel" in launched[0][0] and "prefill_write_kernel" in launched[1][1], launched
    assert tw.stored_steps == 3


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_ring_c128_calls_share_their_plan_scratch(device):
    """Ring c128 calls on one plan (a model step's layers) share the scratch and row counters kept
    with it: each call equals its two steps, and the counters are zero after every call."""
    n = 40
    tw = Twin(device, C128_128, "v4_fp8", num_reqs=n, seed=9, num_locs=8 * 1024)
    rids = list(range(n))
    tw.prefill(rids, [127 + 64 * (r % 2) for r in rids])  # the even requests one token before a boundary
    plan = tw.sc.decode_plan(rids)
    for _ in range(3):
        tw.run_both(tw.sc.random_rows(n), plan, tw.out_loc(n))
        counts = fused_ops.plan_row_counts(plan.plan_rows)
        assert counts.shape == (n,) and not counts.any(), "row counters left non-zero"
    assert tw.stored_steps == 4  # the prefill (the odd requests close a window) and the three calls


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_c128_calls_of_many_rows(device):
    """Ring c128 steps of many rows: prefills of 160 and 128+ compress events around decode batches
    of 64 requests."""
    n = 64
    tw = Twin(device, C128_128, "v4_fp8", num_reqs=n, seed=11, num_locs=32 * 1024)
    rids = list(range(n))
    tw.prefill(rids, [128 * (3 + r % 2) - 1 for r in rids])  # 2 or 3 events each; every request at R - 1
    tw.decode(rids)  # 64 boundary rows
    tw.prefill(rids, [257 + r * 37 % 128 for r in rids], gpu_lengths=True)  # 2 or 3 events each
    tw.decode(rids)  # mixed
    assert tw.stored_steps >= 3


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
@pytest.mark.parametrize("n", [120, 600])
def test_fused_c128_decode_batch_of_many_requests(device, n):
    """Ring c128 decode batches of several waves of a block per unit (120 requests) and of the resident
    blocks ranking more rows than one chunk (600 > 512): a third of the requests at a boundary, then
    none, then all of them."""
    tw = Twin(device, C128_128, "v4_fp8", num_reqs=n, seed=13, num_locs=128 * 1024)
    rids = list(range(n))
    tw.prefill(rids, [127 if r % 3 == 0 else 1 + r % 100 for r in rids])
    tw.decode(rids)  # the requests r % 3 == 0 close their first window
    tw.decode(rids)  # none closes one
    tw.prefill(rids, [255 - tw.sc.lens[r] if r % 3 == 0 else 127 - tw.sc.lens[r] for r in rids])
    tw.decode(rids)  # every request closes one
    assert tw.stored_steps == 2


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("bad", ["out_loc", "freq_cis"])
def test_fused_c128_decode_skips_a_row_it_cannot_store(device, bad, loc_dtype):
    """Four requests close a window; one row's cache location (or rope position) is out of range. The
    ring c128 decode stores rows from operands its blocks preloaded while pooling: it skips that row
    as the store step does, stores the others, and checked mode names the argument."""
    tw = Twin(device, C128_128, "v4_fp8")
    r = tw.sc.R
    tw.prefill([0, 1, 2, 3], [r - 1, 2 * r - 1, r - 1, 3 * r - 1])
    x, plan = tw.sc.random_rows(4), tw.sc.decode_plan([0, 1, 2, 3])  # rope positions 0, r, 0, 2r
    out_loc = tw.out_loc(4, loc_dtype)
    if bad == "out_loc":
        out_loc[1] = tw.cache_a.shape[0] * tw.page_size  # one past the cache's last location
    else:
        tw.freq_cis = tw.freq_cis[:2 * r - 1]  # the last request's position 2r is past the table
    stored = tw.stored_steps
    tw.run_both(x, plan, out_loc)
    assert tw.stored_steps == stored + 1, "the other rows were stored"
    set_checks(True)
    try:
        with pytest.raises(ValueError, match=bad):
            tw.fused(x, plan, out_loc)
    finally:
        set_checks(None)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_padded_cuda_graph_plans(device):
    """use_cuda_graph prefill plans (invalid padding rows) and GPU-resident lengths (bucket-sized plans)."""
    tw = Twin(device, C4_PAGED_8, "v4_fp8")
    tw.prefill([0, 1], [13, 22], use_cuda_graph=True)
    tw.prefill([2, 3, 0], [9, 4, 7], num_q=40, gpu_lengths=True)
    assert tw.stored_steps == 2


@pytest.mark.parametrize("config_format", [(C4_PAGED_8, "v4_fp8"), (C4_PAGED_8, "indexer_fp4"),
                                           (C128_128, "v4_fp8")], ids=_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_decode_in_cuda_graph(device, config_format):
    """A captured decode step (plan + fused op) replays with fresh lengths and inputs."""
    config, fmt = config_format
    tw = Twin(device, config, fmt)
    sc = tw.sc
    tw.prefill([0, 1, 2, 3], [sc.R * 2 + 1, sc.R * 3 - 2, 7, sc.R])
    rids = [0, 1, 2, 3]
    seq = torch.zeros(4, dtype=torch.int64, device=sc.device)
    x = torch.zeros(4, sc.last_dim, dtype=sc.in_dtype, device=sc.device)
    loc = torch.zeros(4, dtype=torch.int64, device=sc.device)
    rpi = torch.tensor(rids, dtype=torch.int64, device=sc.device)

    def step():
        plan = sc.decode_plan(rids, seq_lens=seq, rpi=rpi)
        tw.fused(x, plan, loc)

    seq.copy_(torch.tensor([sc.lens[r] + 1 for r in rids]))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    snapshot = (tw.state_b.clone(), tw.cache_b.clone())
    with torch.cuda.stream(side):
        step()  # warm-up (loads the kernels) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    tw.state_b.copy_(snapshot[0])
    tw.cache_b.copy_(snapshot[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2 * sc.R + 2 if sc.R == 4 else 130):
        x.copy_(sc.random_rows(4))
        loc.copy_(tw.out_loc(4))
        seq.copy_(torch.tensor([sc.lens[r] + 1 for r in rids]))
        before = tw.cache_a.clone()
        plan = sc.decode_plan(rids)
        kv = compress_forward(sc.state, x, sc.ape, plan, head_dim=sc.hd, compress_ratio=sc.R)
        compress_norm_rope_store(kv, plan, kvcache=tw.cache_a, **tw.store_args(loc))
        graph.replay()
        tw.compare(before)
        for r in rids:
            sc.lens[r] += 1
    assert tw.stored_steps >= 4


@pytest.mark.parametrize("device", DEVICES)
def test_fused_empty_batches(device):
    tw = Twin(device, C4_PAGED_8, "indexer_fp8")
    tw.decode([])
    assert tw.stored_steps == 0


@pytest.mark.parametrize("device", DEVICES)
def test_fused_argument_errors_name_the_argument(device):
    tw = Twin(device, C4_PAGED_8, "v4_fp8")
    sc = tw.sc
    plan = sc.decode_plan([0, 1])
    x = sc.random_rows(2)
    args = dict(head_dim=sc.hd, compress_ratio=4, kvcache=tw.cache_b, **tw.store_args(tw.out_loc(2)))
    with pytest.raises(ValueError, match="compress_ratio"):
        compress_and_store(tw.state_b, x, sc.ape, plan, **dict(args, compress_ratio=128))
    with pytest.raises(ValueError, match="use_fp4"):
        compress_and_store(tw.state_b, x, sc.ape, plan, **dict(args, use_fp4=True))
    with pytest.raises(ValueError, match="out_loc"):
        compress_and_store(tw.state_b, x, sc.ape, plan, **dict(args, out_loc=tw.out_loc(3)))
    with pytest.raises(ValueError, match="kvcache"):
        compress_and_store(tw.state_b, x, sc.ape, plan, **dict(args, kvcache=tw.cache_b[:, :-16]))
    if sc.device.type == "cuda":
        with pytest.raises((ValueError, TypeError), match="kv_score_input"):
            compress_and_store(tw.state_b, x[:, :-4], sc.ape, plan, **args)


SANITIZER_CASES = [(C4_PAGED_8, "v4_fp8"), (C4_PAGED_8, "indexer_fp4"), (C128_128, "v4_fp8"),
                   (C128_128, "v4_bf16")]


@pytest.mark.parametrize("config_format", SANITIZER_CASES, ids=_id)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA_MARKS)])
def test_fused_decode_across_a_boundary(device, config_format):
    """Short (compute-sanitizer sized): prefill to one token before a boundary, decode twice."""
    config, fmt = config_format
    tw = Twin(device, config, fmt)
    r = config[0]
    tw.prefill([0, 1, 2], [r - 1, 2 * r - 1, r + 1])
    tw.decode([0, 1, 2])
    tw.decode([0, 1, 2])
    assert tw.stored_steps == 2  # the prefill of request 2 and the boundary decode


def test_c128_stores_latent_rows_only():
    """c128 rows are latent rows (V4 or a V4.1 layout): the indexer formats (head_dim 128) are rejected
    up front, and the kernel catalogue holds no variant that could not build."""
    from dsv4jit.jit.kernels import SPECS

    plan = CompressorDecodePlan(128, torch.zeros(0, 16, dtype=torch.uint8))
    empty = torch.zeros(0)
    with pytest.raises(ValueError, match="head_dim"):
        compress_and_store(empty, empty, empty, plan, head_dim=128, compress_ratio=128, norm_weight=empty,
                           norm_eps=1e-6, freq_cis=empty, out_loc=empty, kvcache=empty, page_size=2)
    fused = SPECS["fused"]
    assert not [v for v in fused.all_variants() if v.params["ratio"] == 128 and v.params["format"].startswith("indexer")]
    with pytest.raises(ValueError, match="ratio 128"):
        fused.variant(ratio=128, format="indexer_fp4", state="fp32", input="fp32", pdl=True)


def test_plan_scratch_lives_with_the_plan_rows():
    """The ring c128 scratch and counters are made once per plan rows tensor, zeroed, reused by every
    call on it, and forgotten with it."""
    import gc

    rows = torch.zeros(5, 16, dtype=torch.uint8)
    counts = fused_ops.plan_row_counts(rows)
    assert counts is fused_ops.plan_row_counts(rows) and counts.dtype == torch.int32
    assert counts.shape == (5,) and not counts.any()
    scratch, same = fused_ops.row_scratch(rows, 512, torch.float32)
    assert same is counts and scratch.shape == (5, 512) and scratch.dtype == torch.float32
    assert fused_ops.row_scratch(rows, 512, torch.float32)[0] is scratch
    assert fused_ops.row_scratch(rows, 512, torch.bfloat16)[0].dtype == torch.bfloat16
    assert fused_ops.plan_row_counts(torch.zeros(5, 16, dtype=torch.uint8)) is not counts
    gc.collect()
    kept = len(fused_ops._SCRATCH)
    del rows, counts, scratch, same
    gc.collect()
    assert len(fused_ops._SCRATCH) == kept - 1


def test_fast_path_reuses_the_scratch_of_the_plan_it_last_saw():
    """The eager fast path of ring c128 decode passes the scratch and counters kept with the call's
    plan: the same tensors while the plan stays, the next plan's when it changes, and it does not keep
    a plan's scratch alive."""
    import gc

    import inspect

    seen = []
    names = list(inspect.signature(fused_ops.run_fused).parameters)[1:]  # the kernel's parameters, by name

    def kernel(*args):
        named = dict(zip(names, args))
        seen.append((named["rows"], named["row_counts"]))

    launch = fused_ops._launcher(kernel, 128, 512, True, False, None, None, torch.float32)
    x = torch.zeros(1)

    def call(plan):
        launch(x, x, x, plan, x, 1e-6, x, x, x, None, 2)
        return seen[-1]

    first = CompressorDecodePlan(128, torch.zeros(3, 16, dtype=torch.uint8))
    second = CompressorDecodePlan(128, torch.zeros(4, 16, dtype=torch.uint8))
    buffer, counts = call(first)
    kept_buffer, kept_counts = fused_ops.row_scratch(first.plan_d, 512, torch.float32)
    assert buffer is kept_buffer and counts is kept_counts
    del kept_buffer, kept_counts
    assert call(first)[0] is buffer and call(first)[1] is counts
    other = call(second)
    assert other[0].shape == (4, 512) and other[1] is fused_ops.plan_row_counts(second.plan_d)
    assert call(first)[0] is buffer
    gc.collect()
    kept = len(fused_ops._SCRATCH)
    del first, buffer, counts
    seen.clear()
    gc.collect()
    assert len(fused_ops._SCRATCH) == kept - 1
