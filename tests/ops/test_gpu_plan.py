"""The planner on the GPU: every path gives the reference's bytes (GPU tests)."""

from __future__ import annotations

import pytest
import torch

from dsv4jit import plan_layout, runtime
from dsv4jit.plan import CompressorDecodePlan, CompressorPrefillPlan
from dsv4jit.reference import plan as ref
from helpers.pool_utils import planner_inputs, random_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIGS = [  # (ratio, ring_size, use_req_ring)
    (4, 8, False), (4, 16, False), (4, 8, True), (4, 16, True), (128, 128, False), (128, 256, False)]


def _all_paths(ratio, ring, req_ring, rpi, seq, ext, r2t, f2s, num_q=None):
    """Plans from the reference and from our three paths (CPU-resident, CPU lengths, GPU lengths)."""
    num_q = int(ext.sum()) if num_q is None else num_q
    cuda = torch.device("cuda")
    args = (256, ring, num_q)
    out = {"reference": ref.plan_prefill(ratio, rpi, seq, ext, r2t, f2s, *args, use_cuda_graph=True,
                                         use_req_ring=req_ring)}
    for name, (lens_dev, tab_dev) in {"cpu_resident": ("cpu", "cpu"), "cpu_lengths": ("cpu", cuda),
                                      "gpu_lengths": (cuda, cuda)}.items():
        p = CompressorPrefillPlan.generate(ratio, rpi.to(tab_dev), seq.to(lens_dev), ext.to(lens_dev),
                                           r2t.to(tab_dev), f2s.to(tab_dev), *args, use_cuda_graph=True,
                                           use_req_ring=req_ring)
        out[name] = (p.plan_c.cpu(), p.plan_w.cpu())
    return out


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_all_paths_bit_identical(ratio, ring, req_ring, seed):
    rpi, seq, ext, r2t, f2s = planner_inputs(seed, batch=1 + 7 * seed)
    plans = _all_paths(ratio, ring, req_ring, rpi, seq, ext, r2t, f2s)
    ref_c, ref_w = plans.pop("reference")
    for name, (c, w) in plans.items():
        assert torch.equal(c, ref_c), f"{name}: plan_c differs from the reference"
        assert torch.equal(w, ref_w), f"{name}: plan_w differs from the reference"


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS)
def test_cpu_lengths_exact_shapes(ratio, ring, req_ring):
    rpi, seq, ext, r2t, f2s = planner_inputs(11, batch=9)
    num_q = int(ext.sum())
    ref_c, ref_w = ref.plan_prefill(ratio, rpi, seq, ext, r2t, f2s, 256, ring, num_q, use_req_ring=req_ring)
    p = CompressorPrefillPlan.generate(ratio, rpi.cuda(), seq, ext, r2t.cuda(), f2s.cuda(), 256, ring, num_q,
                                       use_req_ring=req_ring)
    assert p.plan_c.shape == ref_c.shape and p.plan_w.shape == ref_w.shape
    assert torch.equal(p.plan_c.cpu(), ref_c) and torch.equal(p.plan_w.cpu(), ref_w)
    assert p.num_q_tokens == num_q and not p.is_decode and p[1] is p.plan_c and p[2] is p.plan_w


@pytest.mark.parametrize("ratio", [4, 128])
def test_many_requests_chunked_table(ratio):
    """More requests than one kernel-parameter table holds (CPU lengths): chunked launches."""
    rpi, seq, ext, r2t, f2s = planner_inputs(5, batch=1500, max_extend=20, max_prefix=300)
    num_q = int(ext.sum())
    ref_c, ref_w = ref.plan_prefill(ratio, rpi, seq, ext, r2t, f2s, 256, ratio * 2, num_q)
    p = CompressorPrefillPlan.generate(ratio, rpi.cuda(), seq, ext, r2t.cuda(), f2s.cuda(), 256, ratio * 2, num_q)
    assert torch.equal(p.plan_c.cpu(), ref_c) and torch.equal(p.plan_w.cpu(), ref_w)


@pytest.mark.parametrize("extends", [[4] * 72 + [3] * 24, [3] * 104 + [2] * 24])
def test_ragged_batch_is_not_mistaken_for_uniform(extends):
    """Regression inputs: a ragged batch must not take the uniform-extend shortcut."""
    gen = torch.Generator().manual_seed(3)
    batch = len(extends)
    ext = torch.tensor(extends, dtype=torch.int64)
    seq = ext + torch.randint(0, 500, (batch,), generator=gen)
    r2t, f2s = random_pool(batch, int(seq.max()) + 8, gen)
    rpi = torch.arange(batch, dtype=torch.int64)
    plans = _all_paths(4, 16, False, rpi, seq, ext, r2t, f2s)
    num_q = int(ext.sum())
    c, w = plan_layout.decode_compress_plan(plans["gpu_lengths"][0]), plan_layout.decode_write_plan(plans["gpu_lengths"][1])
    assert bool((c.ragged_id[c.valid] < num_q).all()) and bool((w.ragged_id[w.valid] < num_q).all())
    assert torch.equal(plans["gpu_lengths"][0], plans["reference"][0])
    assert torch.equal(plans["gpu_lengths"][1], plans["reference"][1])


@pytest.mark.parametrize("extend", [1, 4, 32, 33])
def test_uniform_extend_batches(extend):
    rpi, seq, ext, r2t, f2s = planner_inputs(7, batch=256, uniform_extend=extend)
    plans = _all_paths(4, 16, False, rpi, seq, ext, r2t, f2s)
    assert torch.equal(plans["gpu_lengths"][0], plans["reference"][0])
    assert torch.equal(plans["gpu_lengths"][1], plans["reference"][1])


def test_cuda_graph_padding_rows_invalid():
    """seq [4, 20], extend [2, 6] (8 tokens) in a bucket of 12: rows from the counts on are invalid."""
    gen = torch.Generator().manual_seed(0)
    r2t, f2s = random_pool(2, 64, gen)
    rpi = torch.tensor([1, 0])
    seq, ext = torch.tensor([4, 20]), torch.tensor([2, 6])
    p = CompressorPrefillPlan.generate(4, rpi.cuda(), seq.cuda(), ext.cuda(), r2t.cuda(), f2s.cuda(), 256, 8, 12)
    c, w = p.rows()
    assert p.plan_c.shape == (12, 16) and p.plan_w.shape == (12, 8)
    # Events at p=3 (request 0, ragged 1) and p=15, 19 (request 1, ragged 3, 7). Writes: both tokens
    # of request 0, and positions 16..19 of request 1 (first_w = 20 - 4): 6 rows.
    assert c.valid.tolist() == [True] * 3 + [False] * 9
    assert w.valid.tolist() == [True] * 6 + [False] * 6
    assert c.seq_len[:3].tolist() == [4, 16, 20] and c.ragged_id[:3].tolist() == [1, 3, 7]


def test_graph_capture_and_replay_with_new_lengths():
    gen = torch.Generator().manual_seed(9)
    batch, num_q = 8, 256
    r2t, f2s = random_pool(batch, 2048, gen)
    rpi, r2t, f2s = torch.arange(batch, dtype=torch.int64).cuda(), r2t.cuda(), f2s.cuda()
    seq_buf = torch.zeros(batch, dtype=torch.int64, device="cuda")
    ext_buf = torch.zeros(batch, dtype=torch.int64, device="cuda")

    def fill(seed):
        g = torch.Generator().manual_seed(seed)
        ext = torch.randint(1, num_q // batch + 1, (batch,), generator=g)
        seq = ext + torch.randint(0, 1500, (batch,), generator=g)
        seq_buf.copy_(seq)
        ext_buf.copy_(ext)
        return seq, ext

    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        CompressorPrefillPlan.generate(4, rpi, seq_buf, ext_buf, r2t, f2s, 256, 8, num_q, use_cuda_graph=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = CompressorPrefillPlan.generate(4, rpi, seq_buf, ext_buf, r2t, f2s, 256, 8, num_q,
                                                  use_cuda_graph=True)
    for seed in range(1, 5):
        seq, ext = fill(seed)
        captured.plan_c.fill_(0xAB)
        captured.plan_w.fill_(0xAB)
        graph.replay()
        torch.cuda.synchronize()
        ref_c, ref_w = ref.plan_prefill(4, rpi.cpu(), seq, ext, r2t.cpu(), f2s.cpu(), 256, 8, int(ext.sum()),
                                        use_cuda_graph=True)
        n_c, n_w = ref_c.shape[0], ref_w.shape[0]
        assert torch.equal(captured.plan_c[:n_c].cpu(), ref_c)
        assert torch.equal(captured.plan_w[:n_w].cpu(), ref_w)
        assert torch.equal(captured.plan_c[n_c:].cpu(), plan_layout.invalid_compress_rows(num_q - n_c))
        assert torch.equal(captured.plan_w[n_w:].cpu(), plan_layout.invalid_write_rows(num_q - n_w))


@pytest.mark.parametrize("ratio,ring,req_ring", CONFIGS)
def test_decode_matches_reference(ratio, ring, req_ring):
    rpi, seq, _, r2t, f2s = planner_inputs(21, batch=300)
    expect = ref.plan_decode(ratio, rpi, r2t, f2s, seq, 256, ring, req_ring)
    d = CompressorDecodePlan.generate(ratio, rpi.cuda(), r2t.cuda(), f2s.cuda(), seq.cuda(), 256, ring, req_ring)
    assert d.plan_d.device == rpi.cuda().device and d.plan_d.is_contiguous()
    assert torch.equal(d.plan_d.cpu(), expect)
    host = CompressorDecodePlan.generate(ratio, rpi, r2t, f2s, seq, 256, ring, req_ring)
    assert host.plan_d.device.type == "cpu" and torch.equal(host.plan_d, expect)


def test_decode_plan_filled_in_place_where_kernels_cannot_allocate(monkeypatch):
    """Without torch's DLPack exchange API the wrapper allocates plan_d and the kernel fills it."""
    rpi, seq, _, r2t, f2s = planner_inputs(6, batch=70)
    monkeypatch.setattr(runtime, "_kernel_allocation", [False])
    d = CompressorDecodePlan.generate(4, rpi.cuda(), r2t.cuda(), f2s.cuda(), seq.cuda(), 256, 8)
    online = CompressorDecodePlan.generate_online(seq.cuda(), rpi.cuda(), r2t.cuda(), 3)
    assert torch.equal(d.plan_d.cpu(), ref.plan_decode(4, rpi, r2t, f2s, seq, 256, 8))
    assert torch.equal(online.plan_d.cpu(), CompressorDecodePlan.generate_online(seq, rpi, r2t, 3).plan_d)


def test_decode_plan_captured_in_a_graph_and_on_a_side_stream():
    """plan_d comes from torch's caching allocator inside the kernel call: it must belong to the
    graph's pool under capture and to the current stream on a side stream, like a torch.empty."""
    rpi, seq, _, r2t, f2s = planner_inputs(5, batch=64)
    rpi_d, r2t_d, f2s_d, seq_buf = rpi.cuda(), r2t.cuda(), f2s.cuda(), seq.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = CompressorDecodePlan.generate(4, rpi_d, r2t_d, f2s_d, seq_buf, 256, 8)
        on_side_bytes = on_side.plan_d.clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side_bytes.cpu(), ref.plan_decode(4, rpi, r2t, f2s, seq, 256, 8))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = CompressorDecodePlan.generate(4, rpi_d, r2t_d, f2s_d, seq_buf, 256, 8)
    for step in range(1, 4):
        new_seq = seq + step  # decode steps: the pool holds 64 positions past the longest request
        seq_buf.copy_(new_seq)
        captured.plan_d.fill_(0xAB)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured.plan_d.cpu(), ref.plan_decode(4, rpi, r2t, f2s, new_seq, 256, 8))


@pytest.mark.parametrize("ratio", [4, 128])
def test_legacy_paths(ratio):
    rpi, seq, ext, _, _ = planner_inputs(4, batch=12)
    num_q = int(ext.sum())
    ref_c, ref_w = ref.plan_prefill_legacy(ratio, rpi, seq, ext, num_q)
    p = CompressorPrefillPlan.generate_legacy(ratio, rpi.cuda(), seq, ext, num_q, device="cuda")
    assert torch.equal(p.plan_c.cpu(), ref_c) and torch.equal(p.plan_w.cpu(), ref_w)
    d = CompressorDecodePlan.generate_legacy(ratio, rpi.cuda(), seq.cuda())
    assert torch.equal(d.plan_d.cpu(), ref.plan_decode_legacy(ratio, rpi, seq))


def test_empty_batch():
    e = torch.zeros(0, dtype=torch.int64)
    r2t, f2s = torch.zeros(1, 8, dtype=torch.int32).cuda(), torch.zeros(8, dtype=torch.int64).cuda()
    p = CompressorPrefillPlan.generate(4, e.cuda(), e, e, r2t, f2s, 256, 8, 0)
    assert p.plan_c.shape == (0, 16) and p.plan_w.shape == (0, 8)
    p = CompressorPrefillPlan.generate(4, e.cuda(), e.cuda(), e.cuda(), r2t, f2s, 256, 8, 0)
    assert p.plan_c.shape == (0, 16) and p.plan_w.shape == (0, 8)
    assert CompressorDecodePlan.generate(4, e.cuda(), r2t, f2s, e.cuda(), 256, 8).plan_d.shape == (0, 16)


def test_checked_mode_reports_device_data_violations():
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=4)
    num_q = int(ext.sum())
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match="sum of extend_lens"):  # bucket smaller than the tokens
            CompressorPrefillPlan.generate(4, rpi.cuda(), seq.cuda(), ext.cuda(), r2t.cuda(), f2s.cuda(), 256, 8,
                                           num_q - 1)
        bad = r2t.clone()
        bad[rpi[0], : int(seq[0])] = 10**9  # slots past full_to_state
        with pytest.raises(ValueError, match=rf"argument 'req_to_token': entry \[{int(rpi[0])}, \d+\] \(request 0, "
                                             rf"position \d+\) must be an index of full_to_state .*, got 1000000000"):
            CompressorDecodePlan.generate(4, rpi.cuda(), bad.cuda(), f2s.cuda(), seq.cuda(), 256, 8)
        ok = CompressorPrefillPlan.generate(4, rpi.cuda(), seq.cuda(), ext.cuda(), r2t.cuda(),
                                            torch.arange(f2s.numel(), dtype=torch.int64).cuda(), 256, 8, num_q)
        assert ok.plan_c.shape[0] == num_q
    finally:
        runtime.set_checks(None)


def _clean_inputs(**batch_kw):
    """planner_inputs without evicted slots, so that the only violation is the one a test makes."""
    rpi, seq, ext, r2t, f2s = planner_inputs(5, batch=4, **batch_kw)
    return rpi, seq, ext, r2t, torch.arange(f2s.numel(), dtype=torch.int64)


def _entry(t: torch.Tensor, index: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


# (what is wrong, the inputs, the message of checked mode): device-resident tables and lengths
DEVICE_DATA = {
    "request slot": (lambda rpi, seq, ext, r2t, f2s: (_entry(rpi, 1, r2t.shape[0]), seq, ext, r2t, f2s),
                     r"argument 'req_pool_indices': entry 1 must be a row of req_to_token \(in \[0, 7\)\), got 7"),
    "negative request slot": (lambda rpi, seq, ext, r2t, f2s: (_entry(rpi, 2, -1), seq, ext, r2t, f2s),
                              r"argument 'req_pool_indices': entry 2 must be a row of req_to_token .*, got -1"),
    "short full_to_state": (lambda rpi, seq, ext, r2t, f2s: (rpi, seq, ext, r2t, f2s[:10]),
                            r"argument 'req_to_token': entry \[\d+, \d+\] \(request 0, position \d+\) must be an "
                            r"index of full_to_state \(in \[0, 10\)\), got \d+"),
    "evicted slot": (lambda rpi, seq, ext, r2t, f2s: (rpi, seq, ext, r2t,
                                                      _entry(f2s, int(r2t[rpi[3], int(seq[3]) - 1]), -1)),
                     r"argument 'full_to_state': entry \d+ \(req_to_token\[\d+, \d+\], request 3\) must be a "
                     r"state slot \(>= 0\).*, got -1"),
}


@pytest.mark.parametrize("path", ["gpu_lengths", "cpu_lengths", "decode"])
@pytest.mark.parametrize("kind", DEVICE_DATA)
def test_checked_mode_names_the_first_offending_entry(kind, path):
    """Device-resident tables: checked mode names the argument, the first offending entry and its
    value (read back from the inputs); default mode launches without a sync and reports nothing."""
    spoil, message = DEVICE_DATA[kind]
    rpi, seq, ext, r2t, f2s = spoil(*_clean_inputs())
    cuda = torch.device("cuda")
    lengths = cuda if path != "cpu_lengths" else torch.device("cpu")

    def plan():
        if path == "decode":
            return CompressorDecodePlan.generate(4, rpi.to(cuda), r2t.to(cuda), f2s.to(cuda), seq.to(cuda), 256, 8)
        return CompressorPrefillPlan.generate(4, rpi.to(cuda), seq.to(lengths), ext.to(lengths), r2t.to(cuda),
                                              f2s.to(cuda), 256, 8, int(ext.sum()))

    plan()  # default mode: no error, no sync
    torch.cuda.synchronize()
    runtime.set_checks(True)
    try:
        op = "CompressorDecodePlan.generate" if path == "decode" else "CompressorPrefillPlan.generate"
        with pytest.raises(ValueError, match=rf"^dsv4jit\.{op} \(checked mode\): {message}"):
            plan()
    finally:
        runtime.set_checks(None)


def test_checked_mode_names_bad_device_lengths():
    rpi, seq, ext, r2t, f2s = _clean_inputs()
    cuda = torch.device("cuda")
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match=r"argument 'extend_lens': entry 2 must be in \[1, seq_lens\[2\] = \d+\], "
                                             r"got 0"):
            CompressorPrefillPlan.generate(4, rpi.cuda(), seq.cuda(), _entry(ext, 2, 0).cuda(), r2t.cuda(),
                                           f2s.cuda(), 256, 8, int(ext.sum()))
        with pytest.raises(ValueError, match=r"argument 'seq_lens': entry 1 must be in \[1, 2\^31\), got 0"):
            CompressorDecodePlan.generate(4, rpi.to(cuda), r2t.to(cuda), f2s.to(cuda), _entry(seq, 1, 0).to(cuda),
                                          256, 8)
        narrow = r2t[:, :int(seq[3]) - 1].contiguous()
        with pytest.raises(ValueError, match=r"argument 'seq_lens': entry \d must be at most \d+ \(the columns of "
                                             r"req_to_token\)"):
            CompressorDecodePlan.generate(4, rpi.to(cuda), narrow.to(cuda), f2s.to(cuda), seq.to(cuda), 256, 8)
    finally:
        runtime.set_checks(None)


def test_host_lengths_are_checked_in_default_mode():
    """Lengths on the host cost nothing to check, even with the tables on the GPU."""
    rpi, seq, ext, r2t, f2s = _clean_inputs()
    narrow = r2t[:, :int(seq.max()) - 1].contiguous().cuda()
    with pytest.raises(ValueError, match=r"^dsv4jit\.CompressorPrefillPlan\.generate: argument 'seq_lens': entry \d "
                                         r"must be at most \d+ \(the columns of req_to_token\)"):
        CompressorPrefillPlan.generate(4, rpi.cuda(), seq, ext, narrow, f2s.cuda(), 256, 8, int(ext.sum()))


def test_a_cpu_tensor_among_cuda_ones_is_the_one_named():
    rpi, seq, ext, r2t, f2s = _clean_inputs()
    with pytest.raises(TypeError, match=r"argument 'req_pool_indices': must be a CUDA tensor, got device cpu"):
        CompressorDecodePlan.generate(4, rpi, r2t.cuda(), f2s.cuda(), seq.cuda(), 256, 8)
    with pytest.raises(TypeError, match=r"argument 'req_pool_indices': must be a CUDA tensor, got device cpu"):
        CompressorPrefillPlan.generate(4, rpi, seq, ext, r2t.cuda(), f2s.cuda(), 256, 8, int(ext.sum()))
    with pytest.raises(TypeError, match=r"argument 'full_to_state': must be a CUDA tensor, got device cpu"):
        CompressorDecodePlan.generate(4, rpi.cuda(), r2t.cuda(), f2s, seq.cuda(), 256, 8)


def test_default_mode_never_reads_out_of_bounds():
    """Excess tokens are dropped (no sync, no error) and rows stay inside the plan tensors."""
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=4)
    num_q = int(ext.sum()) - 3
    p = CompressorPrefillPlan.generate(4, rpi.cuda(), seq.cuda(), ext.cuda(), r2t.cuda(), f2s.cuda(), 256, 8, num_q)
    torch.cuda.synchronize()
    c, w = p.rows()
    assert bool((c.ragged_id[c.valid] < num_q).all()) and bool((w.ragged_id[w.valid] < num_q).all())


def test_argument_errors_name_the_argument():
    rpi, seq, ext, r2t, f2s = planner_inputs(2, batch=4)
    num_q = int(ext.sum())
    with pytest.raises(ValueError, match="compress_ratio"):
        CompressorPrefillPlan.generate(8, rpi.cuda(), seq, ext, r2t.cuda(), f2s.cuda(), 256, 8, num_q)
    with pytest.raises(TypeError, match="req_to_token"):
        CompressorPrefillPlan.generate(4, rpi.cuda(), seq, ext, r2t.cuda().long(), f2s.cuda(), 256, 8, num_q)
    with pytest.raises(ValueError, match="num_q_tokens"):
        CompressorPrefillPlan.generate(4, rpi.cuda(), seq, ext, r2t.cuda(), f2s.cuda(), 256, 8, num_q + 1)
    with pytest.raises(TypeError, match="full_to_state"):
        CompressorPrefillPlan.generate(4, rpi.cuda(), seq, ext, r2t.cuda(), f2s, 256, 8, num_q)
    with pytest.raises(ValueError, match="seq_lens"):
        CompressorPrefillPlan.generate(4, rpi.cuda().repeat(300), seq.cuda().repeat(300), ext.cuda().repeat(300),
                                       r2t.cuda(), f2s.cuda(), 256, 8, num_q * 300)
    with pytest.raises(ValueError, match="ring_size"):
        CompressorDecodePlan.generate(4, rpi.cuda(), r2t.cuda(), f2s.cuda(), seq.cuda(), 256, 6)
