"""Online c128 kernels (contract §5) through compress_forward(..., is_online=True) on the GPU.

Oracles: the plain c128 window softmax in fp64 of each request's token history (fp32 state: every
emitted row, for any chunking); the contract §5 model in fp64 (reference/online.py with fp64 math) for the
stored states after every step — on its own state for fp32, and as one update of the previously
stored state for bf16 (whose drift from the plain softmax is reported, not asserted: contract §5.5).
Outputs are NaN-poisoned before every call; the state pool starts all-NaN.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4jit import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
    compress_forward,
    plan_layout,
    runtime,
)
from dsv4jit.reference import compress as ref_compress
from dsv4jit.reference import online as ref_online

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HD = 512
NAN = float("nan")


class Runner:
    """A state pool on the GPU, the same pool as an fp64-math reference model on the CPU, and histories."""

    def __init__(self, lengths, *, state_dtype=torch.float32, offset=0, seed=0):
        self.rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.batch = len(lengths)
        self.lengths = lengths
        slots = self.batch + 3
        self.rpi = torch.tensor(self.rng.sample(range(slots), self.batch), dtype=torch.int64)
        self.offset = offset
        self.hist = [2 * torch.randn(n, 2 * HD, generator=gen) for n in lengths]
        self.ape = (0.5 * torch.randn(128, HD, generator=gen)).cuda()
        self.state = torch.full((slots + offset, 1, 3 * HD), NAN, dtype=state_dtype, device="cuda")
        self.model = self.state.cpu()
        self.r2t = torch.zeros(slots, 4, dtype=torch.int32, device="cuda")
        self.done = [0] * self.batch
        self.events = []  # (request, position, emitted row on the GPU)
        self.bf16 = state_dtype == torch.bfloat16

    def _check_step(self, plan, inputs, out, before):
        """Emitted rows and stored states against the fp64 model (for bf16: one update of `before`)."""
        ape = self.ape.cpu()
        plan_cpu = [t.cpu() for t in plan[1:3] if t is not None]
        if self.bf16:
            self.model = before.clone()
        expect = torch.full(out.shape, NAN, dtype=torch.float64)
        if plan.is_decode:
            ref_online.online_decode(self.model, inputs.cpu(), ape, plan_cpu[0], head_dim=HD, out=expect,
                                     dtype=torch.float64)
        else:
            ref_online.online_prefill(self.model, inputs.cpu(), ape, *plan_cpu, head_dim=HD, out=expect,
                                      dtype=torch.float64)
        torch.testing.assert_close(out.cpu().double(), expect, rtol=1e-4, atol=1e-4, equal_nan=True)
        tol = 8e-3 if self.bf16 else 1e-5  # bf16: the rounding of the stored value may differ by one ulp
        torch.testing.assert_close(self.state.cpu().double(), self.model.double(), rtol=tol, atol=tol,
                                   equal_nan=True)

    def prefill(self, extends, plan_path="cpu_lengths"):
        active = [b for b in range(self.batch) if extends[b] > 0 and self.done[b] < self.lengths[b]]
        ext = [min(extends[b], self.lengths[b] - self.done[b]) for b in active]
        seq = torch.tensor([self.done[b] + e for b, e in zip(active, ext)])
        ext_t = torch.tensor(ext)
        lens_dev = "cuda" if plan_path == "gpu_lengths" else "cpu"
        plan = CompressorPrefillPlan.generate_online(seq.to(lens_dev), ext_t.to(lens_dev), self.rpi[active].cuda(),
                                                     self.r2t, sum(ext), state_slot_offset=self.offset)
        inputs = torch.cat([self.hist[b][self.done[b]:self.done[b] + e] for b, e in zip(active, ext)]).cuda()
        before = self.state.cpu()
        out = torch.full((plan.plan_c.shape[0], HD), NAN, device="cuda")
        compress_forward(self.state, inputs, self.ape, plan, head_dim=HD, compress_ratio=128, out=out,
                         is_online=True)
        self._check_step(plan, inputs, out, before)
        c, _ = plan.rows()
        for i in torch.nonzero(c.valid).flatten().tolist():
            b = active[[int(r) for r in self.rpi[active]].index(int(c.load_slot[i]))]
            self.events.append((b, int(c.seq_len[i]) - 1, out[i]))
        for b, e in zip(active, ext):
            self.done[b] += e
        self._commit()

    def decode(self):
        active = [b for b in range(self.batch) if self.done[b] < self.lengths[b]]
        seq = torch.tensor([self.done[b] + 1 for b in active], device="cuda")
        plan = CompressorDecodePlan.generate_online(seq, self.rpi[active].cuda(), self.r2t,
                                                    state_slot_offset=self.offset)
        inputs = torch.stack([self.hist[b][self.done[b]] for b in active]).cuda()
        before = self.state.cpu()
        out = torch.full((len(active), HD), NAN, device="cuda")
        compress_forward(self.state.view(-1, 3 * HD), inputs, self.ape, plan, head_dim=HD, compress_ratio=128,
                         out=out, is_online=True)
        self._check_step(plan, inputs, out, before)
        for i, b in enumerate(active):
            self.done[b] += 1
            if self.done[b] % 128 == 0:
                self.events.append((b, self.done[b] - 1, out[i]))
        self._commit()

    def _commit(self):
        """With a bank offset, prefill stores rid + offset but merges from rid: commit the bank (as MTP does)."""
        if self.offset:
            for pool in (self.state, self.model):
                rows = self.rpi.to(pool.device)
                pool[rows] = pool[rows + self.offset]

    def check_events_against_plain_softmax(self, tol):
        """Max abs deviation of every emitted row from the fp64 window softmax; asserted when tol is set."""
        assert len(self.events) == sum(n // 128 for n in self.lengths)
        worst = 0.0
        for b, p, row in self.events:
            expect = ref_compress.event_window_reference(self.hist[b], p, self.ape.cpu(), head_dim=HD,
                                                         compress_ratio=128)
            if tol is not None:
                torch.testing.assert_close(row.cpu().double(), expect, rtol=tol, atol=tol)
            worst = max(worst, float((row.cpu().double() - expect).abs().max()))
        return worst


def drive(runner: Runner, rng: random.Random, prefill_chunks: int, plan_path="cpu_lengths"):
    """Random prefill chunks that start and end mid-window, then decodes to the end of every history."""
    for _ in range(prefill_chunks):
        runner.prefill([rng.choice([1, 37, 128, 129, rng.randint(1, 300)]) for _ in range(runner.batch)], plan_path)
    while any(d < n for d, n in zip(runner.done, runner.lengths)):
        runner.decode()


@pytest.mark.parametrize("seed,offset,plan_path", [(0, 0, "cpu_lengths"), (1, 0, "gpu_lengths"),
                                                   (2, 16, "cpu_lengths")])
def test_fp32_state_equals_plain_softmax(seed, offset, plan_path):
    rng = random.Random(seed)
    # Decodes start a little before a boundary and run through two or three more.
    lengths = [rng.randint(300, 420) for _ in range(3)]
    runner = Runner(lengths, offset=offset, seed=seed)
    drive(runner, rng, prefill_chunks=1, plan_path=plan_path)
    runner.check_events_against_plain_softmax(1e-4)


def test_fp32_state_long_prefill_chunks():
    """Several chunked prefills per request (whole chunks, partial segments, single tokens), few decodes."""
    rng = random.Random(7)
    lengths = [900, 700, 1030, 260]
    runner = Runner(lengths, seed=7)
    for _ in range(6):
        runner.prefill([rng.choice([1, 127, 128, 200, 333]) for _ in lengths])
    drive(runner, rng, prefill_chunks=0)
    runner.check_events_against_plain_softmax(1e-4)


def test_bf16_state_step_by_step(record_property):
    rng = random.Random(3)
    runner = Runner([300, 270, 390], state_dtype=torch.bfloat16, seed=3)
    drive(runner, rng, prefill_chunks=1)
    drift = runner.check_events_against_plain_softmax(None)
    record_property("measured", f"bf16 online state: max |emitted - plain softmax| = {drift:.4f} "
                                "(not asserted, contract §5.5)")


@pytest.mark.parametrize("use_cuda_graph", [False, True])
@pytest.mark.parametrize("offset", [0, 9])
def test_gpu_plans_equal_cpu_plans(use_cuda_graph, offset):
    rng = random.Random(11 + offset)
    batch = 12
    ext = [rng.choice([1, 5, 127, 128, 129, 300]) for _ in range(batch)]
    seq = [e + rng.choice([0, 1, 100, 128, 500]) for e in ext]
    rpi = torch.tensor(rng.sample(range(40), batch))
    r2t = torch.zeros(40, 4, dtype=torch.int32)
    num_q = sum(ext) + (17 if use_cuda_graph else 0)
    gen = CompressorPrefillPlan.generate_online
    if use_cuda_graph:  # the bucket holds more tokens than the batch has: rows past the counts are invalid
        cpu = gen(torch.tensor(seq), torch.tensor(ext), rpi, r2t, sum(ext), True, offset)
        pad = plan_layout.invalid_compress_rows(17)
        expect_c, expect_w = torch.cat([cpu.plan_c, pad]), torch.cat([cpu.plan_w, pad])
    else:
        cpu = gen(torch.tensor(seq), torch.tensor(ext), rpi, r2t, num_q, False, offset)
        expect_c, expect_w = cpu.plan_c, cpu.plan_w
        host = gen(torch.tensor(seq), torch.tensor(ext), rpi.cuda(), r2t.cuda(), num_q, False, offset)
        assert host.plan_c.is_cuda
        assert torch.equal(host.plan_c.cpu(), expect_c) and torch.equal(host.plan_w.cpu(), expect_w)
    dev = gen(torch.tensor(seq).cuda(), torch.tensor(ext).cuda(), rpi.cuda(), r2t.cuda(), num_q, use_cuda_graph,
              offset)
    assert dev.plan_c.shape == (num_q, 16) and dev.plan_w.shape == (num_q, 16)
    dev_c, dev_w = dev.plan_c.cpu(), dev.plan_w.cpu()
    if not use_cuda_graph:  # device lengths always give bucket-sized plans, invalid past the counts
        n_c, n_w = expect_c.shape[0], expect_w.shape[0]
        assert torch.equal(dev_c[n_c:], plan_layout.invalid_compress_rows(num_q - n_c))
        assert torch.equal(dev_w[n_w:], plan_layout.invalid_compress_rows(num_q - n_w))
        dev_c, dev_w = dev_c[:n_c], dev_w[:n_w]
    assert torch.equal(dev_c, expect_c) and torch.equal(dev_w, expect_w)
    d_cpu = CompressorDecodePlan.generate_online(torch.tensor(seq), rpi, r2t, offset)
    d_gpu = CompressorDecodePlan.generate_online(torch.tensor(seq).cuda(), rpi.cuda(), r2t.cuda(), offset)
    assert torch.equal(d_gpu.plan_d.cpu(), d_cpu.plan_d)


def test_decode_cuda_graph_replay():
    """A decode step captured once and replayed with refreshed plans and inputs (copy_)."""
    runner = Runner([400, 380], seed=5)
    runner.prefill([126, 127])
    seq = torch.tensor([runner.done[0] + 1, runner.done[1] + 1], device="cuda")
    static_plan = CompressorDecodePlan.generate_online(seq, runner.rpi.cuda(), runner.r2t)
    static_in = torch.zeros(2, 2 * HD, device="cuda")
    static_out = torch.full((2, HD), NAN, device="cuda")

    def step():
        compress_forward(runner.state, static_in, runner.ape, static_plan, head_dim=HD, compress_ratio=128,
                         out=static_out, is_online=True)

    saved = runner.state.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (loads the module) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    runner.state.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    runner.state.copy_(saved)
    for _ in range(4):  # offsets 126 -> 127 (emit) -> 0 (reset) -> 1 for request 0
        seq = torch.tensor([runner.done[b] + 1 for b in range(2)], device="cuda")
        static_plan.copy_(CompressorDecodePlan.generate_online(seq, runner.rpi.cuda(), runner.r2t))
        inputs = torch.stack([runner.hist[b][runner.done[b]] for b in range(2)]).cuda()
        static_in.copy_(inputs)
        static_out.fill_(NAN)
        before = runner.state.cpu()
        graph.replay()
        torch.cuda.synchronize()
        runner._check_step(static_plan, inputs, static_out, before)
        for b in range(2):
            runner.done[b] += 1


def test_checked_mode_reports_bad_rows():
    state = torch.zeros(2, 1, 3 * HD, device="cuda")
    inputs = torch.zeros(1, 2 * HD, device="cuda")
    ape = torch.zeros(128, HD, device="cuda")
    bad = CompressorDecodePlan(128, plan_layout.encode_decode_plan(torch.tensor([5]), torch.tensor([7]),
                                                                  torch.tensor([7]), torch.tensor([-1])).cuda())
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match="state row"):
            compress_forward(state, inputs, ape, bad, head_dim=HD, compress_ratio=128, is_online=True)
    finally:
        runtime.set_checks(None)
    out = compress_forward(state, inputs, ape, bad, head_dim=HD, compress_ratio=128, is_online=True)
    assert torch.equal(out.cpu(), torch.zeros(1, HD))  # skipped row: zero output, state untouched
    assert torch.equal(state.cpu(), torch.zeros(2, 1, 3 * HD))
