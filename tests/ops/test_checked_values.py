"""Non-finite values in checked mode on the GPU: ops/checked.py, the checks the GPU paths make before
the launch (the CPU paths' references make the same ones, tests/ops/test_bad_input.py).

The helpers are plain torch, so they are run here on CPU tensors too; with a GPU, the ops in checked
mode name a NaN before writing anything, and in default mode never call the helpers (the default
path does no more work than before).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4jit import compress_and_store, compress_forward, compress_norm_rope_store, runtime
from dsv4jit.ops import checked
from dsv4jit.ops.common import freq_table
from helpers.compressor_step import EPS, PAGE_SIZE, make_step

NAN, INF = float("nan"), float("inf")
FINITE = r"must hold finite values only \(no NaN or infinity\), got "
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _compressor(step, x=None, ape=None) -> None:
    plan = step.plan
    plan_w = None if plan.is_decode else plan.plan_w
    checked.compressor("op", step.x if x is None else x, step.ape if ape is None else ape, plan[1], plan_w,
                       step.head_dim, step.ratio)


@pytest.mark.parametrize("ratio", [4, 128])
def test_the_compressor_check_names_a_value_the_plan_uses(ratio):
    step = make_step("cpu", ratio=ratio, head_dim=128, seed=2)
    _compressor(step)  # all finite
    for spoiled, name in ((step.x, "kv_score_input"), (step.ape, "ape")):
        bad = spoiled.clone()
        bad[1, 3] = INF
        with pytest.raises(ValueError, match=rf"^dsv4jit\.op: argument '{name}': {FINITE}inf at \[1, 3\]$"):
            _compressor(step, **{"x" if name == "kv_score_input" else "ape": bad})


def test_the_compressor_check_leaves_out_what_no_plan_row_uses():
    """Rows past the step's tokens (CUDA-graph padding) may hold anything."""
    step = make_step("cpu", ratio=4, head_dim=128, seed=2)
    padded = torch.cat([step.x, torch.full((5, step.x.shape[1]), NAN)])
    _compressor(step, x=padded)


def test_the_store_check_names_stored_rows_only():
    step = make_step("cpu", ratio=4, head_dim=128, seed=3)
    plan = step.plan
    kv = torch.full((plan[1].shape[0], 128), NAN)
    kept = plan.rows()[0].valid.nonzero().flatten()
    args = (plan[1], step.weight, freq_table(step.freq_cis), step.out_loc, 4, False)
    with pytest.raises(ValueError, match=rf"^dsv4jit\.op: argument 'kv': {FINITE}nan at \[{int(kept[0])}, 0\]$"):
        checked.store("op", kv, *args)
    kv[kept] = 1.0  # the rows of invalid plan rows (compress_forward leaves them as they were) are never read
    checked.store("op", kv, *args)
    freq = freq_table(step.freq_cis).clone()
    freq[:] = INF
    with pytest.raises(ValueError, match=rf"argument 'freq_cis': {FINITE}inf at \[\d+, 0\]$"):
        checked.store("op", kv, plan[1], step.weight, freq, step.out_loc, 4, False)


def test_the_layer_check_names_the_step():
    """The layer op turns ``[indexer]`` into its ``indexer_`` names (tests/ops/test_c4_layer.py)."""
    core, indexer = make_step("cpu", ratio=4, head_dim=512, seed=4), make_step("cpu", ratio=4, head_dim=128, seed=4)
    bad_ape = indexer.ape.clone()
    bad_ape[0, 0] = NAN
    with pytest.raises(ValueError, match=rf"^dsv4jit\.layer\[indexer\]: argument 'ape': {FINITE}nan at \[0, 0\]$"):
        checked.layer("layer", core.plan[1], core.plan.plan_w, freq_table(core.freq_cis), 4,
                      (core.x, core.ape, core.weight, core.out_loc), (indexer.x, bad_ape, indexer.weight, core.out_loc))


# ---- on a GPU --------------------------------------------------------------------------------------

def _fused_call(step, **change):
    args = dict(kv_score_buffer=step.state, kv_score_input=step.x, ape=step.ape, plan=step.plan,
                head_dim=step.head_dim, compress_ratio=step.ratio, norm_weight=step.weight, norm_eps=EPS,
                freq_cis=step.freq_cis, out_loc=step.out_loc, kvcache=step.kvcache, page_size=PAGE_SIZE[step.ratio])
    compress_and_store(**(args | change))


def _forward_call(step, **change):
    args = dict(kv_score_buffer=step.state, kv_score_input=step.x, ape=step.ape, plan=step.plan,
                head_dim=step.head_dim, compress_ratio=step.ratio)
    compress_forward(**(args | change))


def _store_call(step, **change):
    kv = torch.ones(step.plan[1].shape[0], step.head_dim, device=step.x.device)
    args = dict(kv=kv, plan=step.plan, norm_weight=step.weight, norm_eps=EPS, freq_cis=step.freq_cis,
                out_loc=step.out_loc, kvcache=step.kvcache, page_size=PAGE_SIZE[step.ratio])
    compress_norm_rope_store(**(args | change))


CALLS = {"compress_forward": (_forward_call, "kv_score_input"), "compress_and_store": (_fused_call, "kv_score_input"),
         "compress_norm_rope_store": (_store_call, "norm_weight")}


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("op", CALLS)
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.usefixtures("cuda_checks")
def test_checked_mode_on_the_gpu_names_a_non_finite_input_before_writing(op, decode, ratio):
    step = make_step("cuda", ratio=ratio, head_dim=512, decode=decode, seed=6)
    call, name = CALLS[op]
    bad = getattr(step, {"kv_score_input": "x", "norm_weight": "weight"}[name]).clone()
    bad[0] = NAN
    before = (step.state.clone(), step.kvcache.clone())
    with pytest.raises(ValueError, match=rf"^dsv4jit\.{op}: argument '{name}': {FINITE}nan at \[0"):
        call(step, **{name: bad})
    assert torch.equal(step.state, before[0]) and torch.equal(step.kvcache, before[1])


@pytest.fixture
def cuda_checks():
    runtime.set_checks(True)
    yield
    runtime.set_checks(None)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("op", CALLS)
def test_default_mode_on_the_gpu_makes_no_value_check(op, monkeypatch):
    runtime.set_checks(False)
    try:
        for helper in ("compressor", "store", "fused", "layer"):
            monkeypatch.setattr(checked, helper, lambda *a, **k: pytest.fail("a value check in default mode"))
        step = make_step("cuda", ratio=4, head_dim=512, seed=7)
        call, _ = CALLS[op]
        call(step)
        call(dataclasses.replace(step))  # the fast path too
    finally:
        runtime.set_checks(None)
