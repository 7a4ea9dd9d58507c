"""Tensors on a GPU that is not the current one: plans, compress and store run on the tensors' device
(device guard in the launcher, allocations on the tensors' device, the arch of that device, checked
mode's status word there) and on that device's current torch stream, never on the current device's.

Needs two GPUs (skipped otherwise). Results on cuda:1 must equal, bit for bit, the same step on cuda:0.
"""

from __future__ import annotations

import pytest
import torch

import dsv4jit
from dsv4jit import CompressorDecodePlan, compress_forward
from dsv4jit.plan_layout import decode_decode_plan, encode_decode_plan
from helpers.compressor_step import assert_same_result, make_step, run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

CONFIGS = [(4, 512, False), (128, 512, False), (4, 128, True)]
NAN = float("nan")


def step_on(device: str, **kw):
    step = make_step(device, **kw)
    return step, run(step)


@pytest.mark.parametrize("checked", [False, True], ids=["default", "checked"])
@pytest.mark.parametrize("mode", ["prefill-host-lengths", "prefill-device-lengths", "decode"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"c{c[0]}-hd{c[1]}" + ("-fp4" if c[2] else ""))
def test_second_gpu_while_the_first_is_current(config, mode, checked):
    ratio, hd, fp4 = config
    kw = {"ratio": ratio, "head_dim": hd, "use_fp4": fp4, "decode": mode == "decode",
          "lengths_on_device": mode == "prefill-device-lengths", "seed": 21}
    dsv4jit.set_checks(checked)
    try:
        with torch.cuda.device(0):
            on1, out1 = step_on("cuda:1", **kw)
            assert torch.cuda.current_device() == 0
        with torch.cuda.device(1):  # the reference run: cuda:0 while cuda:1 is current
            on0, out0 = step_on("cuda:0", **kw)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    finally:
        dsv4jit.set_checks(None)
    for t in (out1, on1.plan[1], on1.state, on1.kvcache):
        assert t.device == torch.device("cuda", 1)
    assert torch.equal(on1.plan[1].cpu(), on0.plan[1].cpu()), "plans differ"
    if not on1.plan.is_decode:
        assert torch.equal(on1.plan.plan_w.cpu(), on0.plan.plan_w.cpu()), "write plans differ"
    assert_same_result(on1, out1, on0, out0)


def test_checked_mode_reports_a_violation_on_the_second_gpu():
    """The status word lives on the tensors' device and is read back from there."""
    step = make_step("cuda:1", ratio=4, head_dim=512, decode=True)
    rows = decode_decode_plan(step.plan.plan_d.cpu())
    bad = encode_decode_plan(rows.seq_len, torch.full_like(rows.write_loc, 1 << 30), rows.read_page_0,
                             rows.read_page_1)
    plan = CompressorDecodePlan(4, bad.to("cuda:1"))
    dsv4jit.set_checks(True)
    try:
        with torch.cuda.device(0), pytest.raises(ValueError, match="write_loc"):
            compress_forward(step.state, step.x, step.ape, plan, head_dim=512, compress_ratio=4)
    finally:
        dsv4jit.set_checks(None)


def test_kernel_runs_on_the_current_stream_of_its_device():
    """Within torch.cuda.stream(s1) (s1 on cuda:1) and with cuda:0 current again, a compress on cuda:1
    tensors is ordered behind a long sleep queued on s1: a copy on cuda:1's default stream still sees
    the poisoned output, and after s1 drains the output is the eager result."""
    step = make_step("cuda:1", ratio=4, head_dim=512, decode=True, seed=3)
    expected = compress_forward(step.fresh().state, step.x, step.ape, step.plan, head_dim=512, compress_ratio=4)
    out = torch.full_like(expected, NAN)
    s1 = torch.cuda.Stream(device=1)
    torch.cuda.synchronize(1)
    with torch.cuda.stream(s1):  # s1 becomes cuda:1's current stream (and cuda:1 the current device)
        torch.cuda._sleep(1_000_000_000)  # about half a second
        with torch.cuda.device(0):
            compress_forward(step.state, step.x, step.ape, step.plan, head_dim=512, compress_ratio=4, out=out)
        assert not s1.query(), "the sleep ended too early for this test to mean anything"
        with torch.cuda.stream(torch.cuda.default_stream(1)):
            early = out.cpu()
    s1.synchronize()
    assert torch.isnan(early).all(), "the kernel did not wait for s1: it ran on another stream"
    assert torch.equal(out, expected)
