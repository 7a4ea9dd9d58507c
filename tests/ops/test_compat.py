"""The compat_c4 kernels (dsv4jit.compat on CUDA tensors): contract §7, with the checks, precision and
dtypes of contract §9.2, contract §9.6 and contract §9.10.

Each schedule drives ``Sim`` (helpers/compat_sim.py) on the GPU: random prefill chunks (any
alignment, first windows, windows that read the state, plans in shuffled order with invalid and
padding rows) and decode runs, in ring and in paged mode. After every step, on every element:
* outputs (NaN-poisoned before the call) match the fp64 history oracle (5e-3 for bf16 outputs,
  2e-5 for fp32) and the torch reference run in fp64 on CPU copies (rows it leaves NaN stay NaN;
  decode rows without an event are exactly 0);
* the state equals, bit for bit, both the reference's state and the rows the test knows were written.
Malformed rows are skipped by the kernels (never read or written out of bounds) and reported as
ValueError in checked mode.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4jit import runtime
from dsv4jit.compat import flash_c4_decode, flash_c4_prefill
from dsv4jit.reference import compat as ref_compat
from helpers.compat_sim import NAN, Sim, assert_same_bits, i32, legacy_plan, run_schedule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

F32, BF16 = torch.float32, torch.bfloat16
# (head_dim, state, input/output): the serving pair plus bf16 state (contract §9.10) and bf16 I/O.
CONFIGS = [(512, F32, F32), (128, F32, F32), (512, BF16, F32), (128, BF16, BF16)]


def config_id(c) -> str:
    names = {F32: "fp32", BF16: "bf16"}
    return f"hd{c[0]}-state_{names[c[1]]}-io_{names[c[2]]}"


@pytest.mark.parametrize("paged", [False, True], ids=["ring", "paged"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_schedule(paged, config):
    hd, state_dtype, io_dtype = config
    sim = Sim("cuda", paged, hd=hd, state_dtype=state_dtype, in_dtype=io_dtype, num_reqs=5, max_ctx=256,
              seed=hd + paged, reference_check=True)
    runtime.set_checks(True)  # every step also proves no row was skipped
    try:
        run_schedule(sim, random.Random(hd * 2 + paged), 18)
        sim.prefill([0, 1, 2, 3, 4], [1, 2, 3, 4, 5])  # every request at once, windows across chunk borders
        sim.decode([4, 2, 0, 1, 3])
    finally:
        runtime.set_checks(None)
    assert sim.events > 20


@pytest.mark.parametrize("paged", [False, True], ids=["ring", "paged"])
def test_first_windows_and_long_prefill(paged):
    """First windows of every request in one step (the first one's masked slots lie before the
    input's first row), then long chunks whose windows come entirely from the input."""
    sim = Sim("cuda", paged, hd=512, num_reqs=4, max_ctx=128, seed=9, reference_check=True)
    sim.prefill([2, 0, 3, 1], [4, 5, 7, 3])
    sim.prefill([1, 2], [40, 33], pad_rows=3, invalid_rows=5)
    for _ in range(5):
        sim.decode([0, 1, 2, 3])
    sim.prefill([3, 0], [60, 1])
    assert sim.events > 25


@pytest.mark.parametrize("paged", [False, True], ids=["ring", "paged"])
def test_first_window_without_buffered_slots(paged):
    """A first window with window_len 0 (allowed by the older plan): its masked slots would be ragged
    rows -4..-1 of the input; the kernel masks them before loading (the older kernel read them)."""
    dev = torch.device("cuda")
    hd = 512
    gen = torch.Generator().manual_seed(4)
    state = torch.full((2, 4 if paged else 8, 4 * hd), NAN, device=dev)
    x = torch.randn(6, 4 * hd, generator=gen)
    ape = torch.randn(8, hd, generator=gen)
    # Request 1's first window buffers slots 4-5 (positions 0-1): ring 1 rows 0-1, or page 1 rows 0-1.
    plan_c = legacy_plan((3, 0, 3, 0), (5, 1, 3, 6))
    extra = i32(-1, -1, -1, 4, -1, 1, -1, 4).view(2, 4) if paged else None
    base = 4 if paged else 8
    state.view(-1, 4 * hd)[base:base + 2] = torch.randn(2, 4 * hd, generator=gen).to(dev)
    ref_state = state.cpu()
    out = torch.full((6, hd), NAN, device=dev)
    indices = i32(0, 1)
    flash_c4_prefill(state, x.to(dev), out, ape.to(dev), indices.to(dev), plan_c.to(dev), legacy_plan().to(dev),
                     None if extra is None else extra.to(dev))
    expected = torch.full((6, hd), NAN, dtype=torch.float64)
    ref_compat.c4_prefill(ref_state, x, expected, ape, indices, plan_c, legacy_plan(), extra,
                          compute_dtype=torch.float64)
    assert not bool(expected[[3, 5]].isnan().any())
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("paged", [False, True], ids=["ring", "paged"])
def test_empty_batch(paged):
    sim = Sim("cuda", paged, hd=128, num_reqs=2, seed=1)
    dev = sim.device
    before = sim.state.clone()
    out = torch.empty(0, 128, device=dev)
    x = torch.empty(0, 512, device=dev)
    none = torch.empty(0, dtype=torch.int32, device=dev)
    flash_c4_decode(sim.state, x, out, sim.ape.to(dev), none, none,
                    torch.empty(0, 1, dtype=torch.int32, device=dev) if paged else None)
    plan = legacy_plan().to(dev)
    flash_c4_prefill(sim.state, x, out, sim.ape.to(dev), none, plan, plan,
                     torch.empty(0, 4, dtype=torch.int32, device=dev) if paged else None)
    torch.cuda.synchronize()
    assert_same_bits(sim.state, before, "state after an empty step")


def _bad_prefill_rows():
    """One good request (ring 0, prefix 0, extend 8) and malformed rows the kernel must skip."""
    good = [(3, 0, 3, 0), (7, 0, 7, 0)]
    bad = {"window_len": (6, 0, 7, 8), "position": (5, 0, 6, 1), "batch_id": (4, 1, 7, 0),
           "ragged_before_input": (2, 0, 7, 0)}
    return good, bad


@pytest.mark.parametrize("bad_row", ["window_len", "position", "batch_id", "ragged_before_input"])
def test_malformed_prefill_row_is_skipped_and_reported(bad_row):
    dev = torch.device("cuda")
    hd = 128
    good, bad = _bad_prefill_rows()
    state = torch.full((2, 8, 4 * hd), NAN, device=dev)
    x = torch.randn(8, 4 * hd, device=dev)
    ape = torch.randn(8, hd, device=dev)
    plan_c = legacy_plan(*good, bad[bad_row]).to(dev)
    out = torch.full((8, hd), NAN, device=dev)
    runtime.set_checks(False)
    try:
        flash_c4_prefill(state, x, out, ape, i32(0).to(dev), plan_c, legacy_plan().to(dev))
    finally:
        runtime.set_checks(None)
    torch.cuda.synchronize()
    expected = torch.full((8, hd), NAN, dtype=torch.float64)
    ref_compat.c4_prefill(torch.full((2, 8, 4 * hd), NAN), x.cpu(), expected, ape.cpu(), i32(0), legacy_plan(*good),
                          legacy_plan(), compute_dtype=torch.float64)
    torch.testing.assert_close(out.cpu().double(), expected, atol=2e-5, rtol=2e-5, equal_nan=True)
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match="checked mode"):
            flash_c4_prefill(state, x, out, ape, i32(0).to(dev), plan_c, legacy_plan().to(dev))
    finally:
        runtime.set_checks(None)


@pytest.mark.parametrize("paged", [False, True], ids=["ring", "paged"])
def test_decode_out_of_range_index_is_skipped_and_reported(paged):
    dev = torch.device("cuda")
    hd = 128
    state = torch.full((3, 4 if paged else 8, 4 * hd), NAN, device=dev)
    before = state.clone()
    x = torch.randn(2, 4 * hd, device=dev)
    out = torch.full((2, hd), NAN, device=dev)
    args = (state, x, out, torch.randn(8, hd, device=dev), i32(3, -1).to(dev), i32(5, 6).to(dev),
            i32(0, 0).view(2, 1).to(dev) if paged else None)
    runtime.set_checks(False)
    try:
        flash_c4_decode(*args)
    finally:
        runtime.set_checks(None)
    torch.cuda.synchronize()
    assert_same_bits(state, before, "state after skipped rows")
    assert bool((out == 0).all()), "skipped decode rows are zero-filled"
    runtime.set_checks(True)
    try:
        with pytest.raises(ValueError, match="page outside kv_score_buffer"):
            flash_c4_decode(*args)
    finally:
        runtime.set_checks(None)


def test_mixed_devices_name_the_cpu_tensor():
    dev = torch.device("cuda")
    hd = 128
    state = torch.zeros(2, 8, 4 * hd, device=dev)
    x = torch.zeros(1, 4 * hd, device=dev)
    out = torch.zeros(1, hd, device=dev)
    ape = torch.zeros(8, hd, device=dev)
    with pytest.raises(TypeError, match="'seq_lens'.*CUDA"):
        flash_c4_decode(state, x, out, ape, i32(0).to(dev), i32(4))
    with pytest.raises(TypeError, match="'indices'.*CUDA"):
        flash_c4_prefill(state, x, out, ape, i32(0), legacy_plan().to(dev), legacy_plan().to(dev))
    misaligned = torch.zeros(9, dtype=torch.int32, device=dev)[1:].view(2, 4)
    with pytest.raises(ValueError, match="'extra'.*16-byte aligned"):
        flash_c4_prefill(torch.zeros(2, 4, 4 * hd, device=dev), torch.zeros(2, 4 * hd, device=dev),
                         torch.zeros(2, hd, device=dev), ape, i32(0, 1).to(dev), legacy_plan().to(dev),
                         legacy_plan().to(dev), misaligned)
    with pytest.raises(ValueError, match="'extra'"):
        flash_c4_decode(state.view(4, 4, 4 * hd), x, out, ape, i32(0).to(dev), i32(4).to(dev),
                        i32(0).to(dev))
