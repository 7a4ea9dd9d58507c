"""dsv4jit.compat on CPU tensors: the torch reference of the older c4 entry points (contract §7).

* Hand-computed cases: equal scores make an event the plain mean of its 8 (or, in the first window,
  4) kv values, so each test names by hand which ring row / page row / ragged row every slot reads.
* ``Sim`` (helpers/compat_sim.py): a pool of requests driven step by step (prefill chunks, decodes)
  in ring or paged mode, with the plans and page bundles built by the test from each request's
  block -> page table. Every event is checked against the fp64 history oracle of contract §3.11
  (main reference's ``event_window_reference``); the state is checked bit for bit against the rows
  the test knows were written (the pool starts all-NaN); outputs are NaN-poisoned. With
  ``cross_check`` every step also runs the main reference (dsv4jit.reference.compress) on equivalent
  CompressPlan / WritePlan / DecodePlan rows and an equivalent state, and both must agree.
* Argument checks of the CPU path (shapes, dtypes, alignment of extra and plans) and the reference's
  data checks raise ValueError / TypeError naming the argument, and leave the state untouched.

tests/ops/test_compat.py drives ``Sim`` on a GPU to check the kernels against this reference.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4jit.compat import flash_c4_decode, flash_c4_prefill
from dsv4jit.reference.compat import decode_legacy_plan
from helpers.compat_sim import INVALID, NAN, Sim, i32, legacy_plan, run_schedule

MODES = [pytest.param(False, id="ring"), pytest.param(True, id="paged")]


# ------------------------------------------------------------------------------------------------
# 1. hand-computed cases (hd 128, equal scores: an event is the mean of its unmasked kv values)
# ------------------------------------------------------------------------------------------------

HD = 128


def token(kv_overlap: float, kv: float, *, score_overlap=0.0, score=0.0) -> torch.Tensor:
    return torch.tensor([kv_overlap] * HD + [kv] * HD + [score_overlap] * HD + [score] * HD)


def state_of(rows_per: int, pages: int, fill: dict[int, torch.Tensor]) -> torch.Tensor:
    """All-NaN state with the given flat rows filled (a NaN read would poison the result)."""
    state = torch.full((pages, rows_per, 4 * HD), NAN)
    for row, value in fill.items():
        state.view(-1, 4 * HD)[row] = value
    return state


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality of fp32 tensors (NaN included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


ZERO_APE = torch.zeros(8, HD)
UNREAD = 1e6  # a value a window must not read (it would move the mean far off), in an input row it stores


def test_decode_ring_hand():
    # Ring 1, seq_len 12: the token (position 11) goes to ring row 3; slot s reads ring row
    # (12 + s) % 8 = 4 5 6 7 | 0 1 2 3: overlap kv of rows 4-7, current kv of rows 0-2 and the token.
    state = state_of(8, 3, {8 + r: token(10 + r, 20 + r) for r in range(8) if r != 3})
    out = torch.full((1, HD), NAN)
    flash_c4_decode(state, token(100, 200)[None], out, ZERO_APE, i32(1), i32(12))
    assert torch.allclose(out, torch.full((1, HD), (14 + 15 + 16 + 17 + 20 + 21 + 22 + 200) / 8))
    assert torch.equal(state[1, 3], token(100, 200))


def test_decode_first_window_never_reads_the_overlap():
    # seq_len 4: slots 0-3 masked (their ring rows 4-7 hold NaN); the mean of rows 0-2 and the token.
    # The token's overlap half is UNREAD, not NaN: it is stored for the next window, and an input
    # that is not finite is refused.
    state = state_of(8, 1, {r: token(NAN, 20 + r) for r in range(3)})
    out = torch.full((1, HD), NAN)
    flash_c4_decode(state, token(UNREAD, 200)[None], out, ZERO_APE, i32(0), i32(4))
    assert torch.allclose(out, torch.full((1, HD), (20 + 21 + 22 + 200) / 4))


def test_decode_paged_hand():
    # Two requests: b0 seq_len 8 (event: overlap page 2 rows 0-3, current page 0 rows 0-2 + token at
    # row 3), b1 seq_len 6 (no event: token at row 1 of page 1, output row zeroed).
    fill = {2 * 4 + r: token(30 + r, NAN) for r in range(4)}
    fill.update({0 * 4 + r: token(NAN, 40 + r) for r in range(3)})
    state = state_of(4, 3, fill)
    out = torch.full((2, HD), NAN)
    x = torch.stack([token(UNREAD, 400), token(7, 8)])
    flash_c4_decode(state, x, out, ZERO_APE, i32(0, 1), i32(8, 6), i32(2, -1).view(2, 1))
    assert torch.allclose(out[0], torch.full((HD,), (30 + 31 + 32 + 33 + 40 + 41 + 42 + 400) / 8), equal_nan=False)
    assert torch.equal(out[1], torch.zeros(HD))
    assert same(state[0, 3], x[0]) and same(state[1, 1], x[1])


def test_prefill_paged_hand():
    # One request, prefix 5, extend 8 (positions 5-12, ragged 0-7): events at p = 7 (ragged 2,
    # window_len 5) and p = 11 (ragged 6, window_len 1).
    # p = 7: slots 0-3 = positions 0-3 from load_first_page (9), slot 4 = position 4 from
    #        load_second_page (4) row 0, slots 5-7 = ragged 0-2.
    # p = 11: window_len 1 <= 4, so slot 0 (position 4) comes from load_second_page row 0 (overlap
    #        columns), slots 1-7 = ragged 0-6.
    # Writes (positions >= last_c - 4 = 8): 8-11 to write_first_page (6, position < last_position 12),
    # 12 to page indices[0] = 5.
    fill = {9 * 4 + r: token(r, NAN) for r in range(4)}
    fill[4 * 4 + 0] = token(4, 50)
    state = state_of(4, 10, fill)
    x = torch.stack([token(100 + i, 200 + i) for i in range(8)])
    plan_c = legacy_plan((2, 0, 7, 5), (6, 0, 11, 1), (INVALID, 0, 0, 0))
    plan_w = legacy_plan(*[(j, 0, 5 + j, 0) for j in range(3, 8)])
    out = torch.full((8, HD), NAN)
    flash_c4_prefill(state, x, out, ZERO_APE, i32(5), plan_c, plan_w, i32(9, 4, 6, 12).view(1, 4))
    assert torch.allclose(out[2], torch.full((HD,), (0 + 1 + 2 + 3 + 50 + 200 + 201 + 202) / 8))
    assert torch.allclose(out[6], torch.full((HD,), (4 + 100 + 101 + 102 + 203 + 204 + 205 + 206) / 8))
    assert bool(out[[0, 1, 3, 4, 5, 7]].isnan().all())
    for j, pos in zip(range(3, 7), range(8, 12)):
        assert same(state[6, pos % 4], x[j])
    assert same(state[5, 0], x[7])


def test_prefill_ring_hand():
    # Ring 0 of request b1 (indices[1] = 0), prefix 6, extend 3 (positions 6-8, ragged 2-4 after b0's
    # two tokens): event at p = 7 (ragged 3, window_len 6): slot s < 6 reads ring row (8 + s) % 8 = s,
    # slots 6-7 = ragged 2, 3. b0 (ring 2, positions 0-1) has no event.
    state = state_of(8, 3, {r: token(10 + r, 20 + r) for r in range(6)})
    x = torch.stack([token(100 + i, 200 + i) for i in range(5)])
    plan_c = legacy_plan((3, 1, 7, 6))
    plan_w = legacy_plan((0, 0, 0, 0), (1, 0, 1, 0), (2, 1, 6, 0), (3, 1, 7, 0), (4, 1, 8, 0))
    out = torch.full((5, HD), NAN)
    flash_c4_prefill(state, x, out, ZERO_APE, i32(2, 0), plan_c, plan_w)
    assert torch.allclose(out[3], torch.full((HD,), (10 + 11 + 12 + 13 + 24 + 25 + 202 + 203) / 8))
    assert bool(out[[0, 1, 2, 4]].isnan().all())
    assert same(state[2, 0], x[0]) and same(state[2, 1], x[1])
    assert same(state[0, 6], x[2]) and same(state[0, 7], x[3]) and same(state[0, 0], x[4])


@pytest.mark.parametrize("paged", MODES)
def test_prefill_first_window_reads_no_row_before_the_input(paged):
    # The first request's first window (ragged 3, position 3, window_len 0): slots 0-3 would be
    # ragged rows -4..-1. They are masked and never read; slots 4-7 = ragged 0-3.
    state = state_of(4 if paged else 8, 2, {})
    x = torch.stack([token(NAN, 200 + i) for i in range(4)])
    out = torch.full((4, HD), NAN)
    extra = i32(-1, -1, -1, 4).view(1, 4) if paged else None
    flash_c4_prefill(state, x, out, ZERO_APE, i32(1), legacy_plan((3, 0, 3, 0)), legacy_plan(), extra)
    assert torch.allclose(out[3], torch.full((HD,), (200 + 201 + 202 + 203) / 4))


def test_dominant_score_selects_its_slot():
    # Slot 6 (current role, ragged row 1) scores +60 over the others: the output is its kv.
    x = torch.stack([token(1, 2), token(3, 1234.5, score=60.0), token(5, 6)])
    out = torch.full((3, HD), NAN)
    state = state_of(8, 1, {r: token(r, r) for r in range(6)})
    flash_c4_prefill(state, x, out, ZERO_APE, i32(0), legacy_plan((2, 0, 7, 5)), legacy_plan())
    # window_len 5: slots 0-4 from ring rows (8 + s) % 8, slots 5-7 = ragged 0-2
    assert torch.allclose(out[2], torch.full((HD,), 1234.5))


# ------------------------------------------------------------------------------------------------
# 2. multi-step schedules against the history oracle and the main reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("paged", MODES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
def test_schedule_matches_history_and_main_reference(paged, state_dtype):
    sim = Sim("cpu", paged, state_dtype=state_dtype, num_reqs=4, max_ctx=64, seed=3, cross_check=True,
              reference_check=state_dtype == torch.bfloat16)
    run_schedule(sim, random.Random(7), 24)
    assert sim.events > 20


@pytest.mark.parametrize("paged", MODES)
def test_bf16_input_and_output(paged):
    sim = Sim("cpu", paged, state_dtype=torch.bfloat16, in_dtype=torch.bfloat16, num_reqs=3, seed=5,
              cross_check=True)
    run_schedule(sim, random.Random(11), 16)
    sim2 = Sim("cpu", paged, in_dtype=torch.float16, out_dtype=torch.float32, num_reqs=2, seed=6)
    run_schedule(sim2, random.Random(12), 10)
    assert sim.events > 5 and sim2.events > 5


def test_legacy_plan_codec_round_trip():
    rows = [(0, 1, 3, 0), (INVALID, 0, 0, 0), (65536 + 5, 70000, 2**31 + 3, 7)]
    plan = legacy_plan(*rows)
    assert plan.dtype == torch.uint8 and plan.shape == (3, 16)
    back = decode_legacy_plan(plan)
    assert [tuple(int(f[i]) for f in back) for i in range(3)] == rows
    assert back.valid.tolist() == [True, False, True]


# ------------------------------------------------------------------------------------------------
# 3. argument errors (CPU path)
# ------------------------------------------------------------------------------------------------

def _decode_args(paged: bool) -> dict:
    state = torch.zeros(4, 4 if paged else 8, 4 * HD)
    return {"kv_score_buffer": state, "kv_score_input": torch.zeros(2, 4 * HD),
            "kv_compressed_output": torch.zeros(2, HD), "ape": torch.zeros(8, HD), "indices": i32(0, 1),
            "seq_lens": i32(4, 9), "extra": i32(2, 3).view(2, 1) if paged else None}


def _prefill_args(paged: bool) -> dict:
    state = torch.zeros(4, 4 if paged else 8, 4 * HD)
    return {"kv_score_buffer": state, "kv_score_input": torch.zeros(5, 4 * HD),
            "kv_compressed_output": torch.zeros(5, HD), "ape": torch.zeros(8, HD), "indices": i32(0, 1),
            "compress_plan": legacy_plan((3, 0, 3, 0)), "write_plan": legacy_plan((4, 1, 0, 0)),
            "extra": i32(0, 1, 2, 4, 0, 1, 2, 4).view(2, 4) if paged else None}


def misaligned(t: torch.Tensor, elements: int = 1) -> torch.Tensor:
    """Same values, data pointer moved by `elements` elements (contiguous, not 16-byte aligned)."""
    flat = torch.zeros(t.numel() + elements, dtype=t.dtype)
    out = flat[elements:].view(t.shape)
    out.copy_(t)
    return out


DECODE_ERRORS = {
    "extra_1d": (True, {"extra": i32(2, 3)}, ValueError, "'extra'.*2 dimensions"),
    "extra_two_cols": (True, {"extra": i32(2, 3, 0, 0).view(2, 2)}, ValueError, "'extra'.*dim 1 must be 1"),
    "extra_rows": (True, {"extra": i32(2).view(1, 1)}, ValueError, "'extra'.*batch_size"),
    "extra_int64": (True, {"extra": torch.tensor([[2], [3]])}, TypeError, "'extra'.*int32"),
    "ring_buffer_with_extra": (True, {"kv_score_buffer": torch.zeros(4, 8, 4 * HD)}, ValueError,
                               "'kv_score_buffer'.*dim 1 must be 4"),
    "page_buffer_without_extra": (False, {"kv_score_buffer": torch.zeros(4, 4, 4 * HD)}, ValueError,
                                  "'kv_score_buffer'.*dim 1 must be 8"),
    "buffer_fp16": (False, {"kv_score_buffer": torch.zeros(4, 8, 4 * HD, dtype=torch.float16)}, TypeError,
                    "'kv_score_buffer'.*dtype"),
    "indices_int64": (False, {"indices": torch.tensor([0, 1])}, TypeError, "'indices'.*int32"),
    "seq_lens_int64": (False, {"seq_lens": torch.tensor([4, 9])}, TypeError, "'seq_lens'.*int32"),
    "seq_lens_rows": (False, {"seq_lens": i32(4)}, ValueError, "'seq_lens'.*batch_size"),
    "ape_dtype": (False, {"ape": torch.zeros(8, HD, dtype=torch.bfloat16)}, TypeError, "'ape'.*dtype"),
    "ape_rows": (False, {"ape": torch.zeros(4, HD)}, ValueError, "'ape'"),
    "input_rows": (False, {"kv_score_input": torch.zeros(3, 4 * HD)}, ValueError, "'kv_score_input'"),
    "input_cols": (False, {"kv_score_input": torch.zeros(2, 2 * HD)}, ValueError, "'kv_score_input'"),
    "input_not_contiguous": (False, {"kv_score_input": torch.zeros(4 * HD, 2).t()}, ValueError,
                             "'kv_score_input'.*contiguous"),
    "out_head_dim": (False, {"kv_compressed_output": torch.zeros(2, 256)}, ValueError, "'kv_compressed_output'"),
    "out_int": (False, {"kv_compressed_output": torch.zeros(2, HD, dtype=torch.int32)}, TypeError,
                "'kv_compressed_output'"),
    "indices_not_tensor": (False, {"indices": [0, 1]}, TypeError, "'indices'"),
    # data checks of the reference
    "indices_out_of_range": (False, {"indices": i32(0, 4)}, ValueError, "indices"),
    "negative_index": (True, {"indices": i32(-1, 1)}, ValueError, "indices"),
    "seq_len_zero": (False, {"seq_lens": i32(0, 9)}, ValueError, "seq_lens"),
    "overlap_page_out_of_range": (True, {"seq_lens": i32(8, 9), "extra": i32(4, 0).view(2, 1)}, ValueError, "extra"),
}


def _assert_rejected(op, args: dict, case: tuple) -> None:
    """`op` on `args` with the case's overrides raises the case's error and leaves the state as it was."""
    _, overrides, exc, match = case
    args.update(overrides)
    before = args["kv_score_buffer"].clone()
    with pytest.raises(exc, match=match):
        op(**args)
    assert torch.equal(args["kv_score_buffer"], before), "a rejected call changed the state"


@pytest.mark.parametrize("name", list(DECODE_ERRORS))
def test_decode_argument_errors(name):
    _assert_rejected(flash_c4_decode, _decode_args(DECODE_ERRORS[name][0]), DECODE_ERRORS[name])


PREFILL_ERRORS = {
    "extra_three_cols": (True, {"extra": i32(0, 1, 2, 0, 1, 2).view(2, 3)}, ValueError, "'extra'.*dim 1 must be 4"),
    "extra_rows": (True, {"extra": i32(0, 1, 2, 4).view(1, 4)}, ValueError, "'extra'.*batch_size"),
    "extra_misaligned": (True, {"extra": misaligned(i32(0, 1, 2, 4, 0, 1, 2, 4).view(2, 4))}, ValueError,
                         "'extra'.*16-byte aligned"),
    "extra_not_contiguous": (True, {"extra": i32(*range(16)).view(4, 4)[:, :4][::2]}, ValueError,
                             "'extra'.*contiguous"),
    "extra_uint8": (True, {"extra": torch.zeros(2, 4, dtype=torch.uint8)}, TypeError, "'extra'.*int32"),
    "plan_int32_rows": (False, {"compress_plan": legacy_plan((3, 0, 3, 0)).view(torch.int32)}, ValueError,
                        "'compress_plan'.*dim 1 must be 16"),
    "plan_dtype": (False, {"write_plan": torch.zeros(1, 16, dtype=torch.int8)}, TypeError, "'write_plan'.*uint8"),
    "plan_misaligned": (False, {"compress_plan": misaligned(legacy_plan((3, 0, 3, 0)), 8)}, ValueError,
                        "'compress_plan'.*aligned"),
    "out_rows": (False, {"kv_compressed_output": torch.zeros(4, HD)}, ValueError, "'kv_compressed_output'"),
    "fewer_tokens_than_requests": (False, {"kv_score_input": torch.zeros(1, 4 * HD),
                                               "kv_compressed_output": torch.zeros(1, HD),
                                               "compress_plan": legacy_plan(), "write_plan": legacy_plan()},
                                   ValueError, "'kv_score_input'.*batch_size"),
    "plan_longer_than_tokens": (False, {"write_plan": legacy_plan(*[(0, 0, 0, 0)] * 6)}, ValueError,
                                "'write_plan'.*num_q_tokens"),
    # data checks of the reference
    "window_len_8": (False, {"compress_plan": legacy_plan((4, 0, 7, 8))}, ValueError, "window_len"),
    "position_not_closing": (False, {"compress_plan": legacy_plan((4, 0, 6, 1))}, ValueError, "position"),
    "batch_id": (False, {"write_plan": legacy_plan((4, 2, 0, 0))}, ValueError, "batch_id"),
    "ragged_id": (False, {"compress_plan": legacy_plan((5, 0, 3, 0))}, ValueError, "ragged_id"),
    "ragged_rows_before_the_input": (False, {"compress_plan": legacy_plan((2, 0, 7, 0))}, ValueError,
                                     "argument 'kv_score_input' rows read"),
    "load_page_out_of_range": (True, {"compress_plan": legacy_plan((3, 0, 7, 6)),
                                          "extra": i32(9, 1, 2, 4, 0, 1, 2, 4).view(2, 4)}, ValueError, "rows read"),
    "write_page_out_of_range": (True, {"write_plan": legacy_plan((4, 1, 5, 0)),
                                       "extra": i32(0, 1, 2, 4, 0, 1, -1, 8).view(2, 4)}, ValueError,
                                "rows written"),
    "colliding_writes": (False, {"write_plan": legacy_plan((4, 1, 0, 0), (3, 1, 8, 0))}, ValueError,
                         "same state row"),
}


@pytest.mark.parametrize("name", list(PREFILL_ERRORS))
def test_prefill_argument_errors(name):
    _assert_rejected(flash_c4_prefill, _prefill_args(PREFILL_ERRORS[name][0]), PREFILL_ERRORS[name])


@pytest.mark.parametrize("paged", MODES)
def test_good_arguments_pass(paged):
    """The baselines of the error tables are valid calls (so each error case tests one defect)."""
    flash_c4_decode(**_decode_args(paged))
    flash_c4_prefill(**_prefill_args(paged))
