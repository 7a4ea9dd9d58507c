"""The ratio-1 / ratio-2 references refuse bad arguments by name before writing anything (caches, rings
and outputs are poisoned and compared after the call), and do nothing for an empty batch."""

from __future__ import annotations

import pytest
import torch

from dsv4jit.kv_layout import KVLayout
from dsv4jit.reference import low_ratio

POISON = 0xAB
LAYOUT = KVLayout.V41_FP4


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def freq_table(max_pos: int) -> torch.Tensor:
    angles = torch.rand(max_pos, 32, generator=gen(1), dtype=torch.float64)
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles).to(torch.complex64)).flatten(1)


def cache(pages: int, page_size: int) -> torch.Tensor:
    return torch.full((pages, LAYOUT.page_bytes(page_size)), POISON, dtype=torch.uint8)


def c1_args() -> dict:
    return dict(kv_input=torch.randn(2, 512, generator=gen(2)).bfloat16(), norm_weight=torch.ones(512).bfloat16(),
                positions=torch.tensor([3, 4]), out_loc=torch.tensor([259, 260]), eps=1e-6, freqs_cis=freq_table(8),
                k_cache=cache(2, 256), page_size=256, layout=LAYOUT, out=torch.full((2, 512), 3.0).bfloat16())


def c2_decode_args() -> dict:
    return dict(kv_input=torch.randn(2, 1024, generator=gen(3)), kv_state=torch.randn(6, 1024, generator=gen(4)),
                norm_weight=torch.ones(512).bfloat16(), positions=torch.tensor([5, 6]), req=torch.tensor([0, 1]),
                raw_out_loc=torch.tensor([256 + 5, 256 + 6]), eps=1e-6, freqs_cis=freq_table(8),
                k_cache=cache(3, 128), page_size=128, ring_size=2, layout=LAYOUT,
                out=torch.full((2, 512), 3.0).bfloat16())


def c2_prefill_args() -> dict:
    pos = torch.arange(4)
    return dict(kv_input=torch.randn(4, 1024, generator=gen(5)), kv_state=torch.randn(6, 1024, generator=gen(6)),
                norm_weight=torch.ones(512).bfloat16(), positions=pos, req=torch.ones(4, dtype=torch.int64),
                raw_out_loc=256 + pos, eps=1e-6, freqs_cis=freq_table(8), k_cache=cache(3, 128),
                extend_start_loc=torch.tensor([0], dtype=torch.int32),
                extend_seq_lens=torch.tensor([4], dtype=torch.int32), page_size=128, ring_size=2, layout=LAYOUT,
                out=torch.full((4, 512), 3.0).bfloat16())


def pool_args() -> dict:
    buf = torch.randn(8, 1024, generator=gen(7))
    return dict(kv=torch.randn(2, 512, generator=gen(8)), score=torch.randn(2, 512, generator=gen(9)),
                pos=torch.tensor([5, 6]), raw_out_loc=torch.tensor([261, 262]), out_loc=torch.tensor([130, -1]),
                req=torch.tensor([0, 1]), state_kv=buf[:, :512], state_score=buf[:, 512:], pad_row=7, ring_size=2)


OPS = {"c1": (low_ratio.c1_decode_norm_rope_store, c1_args),
       "c2 decode": (low_ratio.c2_decode_norm_rope_store, c2_decode_args),
       "c2 prefill": (low_ratio.c2_prefill_norm_rope_store, c2_prefill_args),
       "pool": (low_ratio.c2_decode_pool, pool_args)}

C2 = ("c2 decode", "c2 prefill")
# (op(s), override, exception, argument named)
BAD = [
    (("c1",), dict(kv_input=torch.zeros(2, 512)), TypeError, "kv_input"),
    (("c1",), dict(kv_input=torch.zeros(2, 256).bfloat16()), ValueError, "kv_input"),
    (("c1",), dict(kv_input=[[0.0] * 512] * 2), TypeError, "kv_input"),
    (("c1",) + C2, dict(norm_weight=torch.ones(512)), TypeError, "norm_weight"),
    (("c1",) + C2, dict(norm_weight=torch.ones(256).bfloat16()), ValueError, "norm_weight"),
    (("c1", "c2 decode"), dict(positions=torch.tensor([3.0, 4.0])), TypeError, "positions"),
    (("c1", "c2 decode"), dict(positions=torch.tensor([3])), ValueError, "positions"),
    (("c1", "c2 decode"), dict(positions=torch.tensor([-1, 4])), ValueError, "positions"),
    (("c1",), dict(positions=torch.tensor([3, 8])), ValueError, "positions"),      # beyond freqs_cis
    (("c2 decode",), dict(positions=torch.tensor([9, 6])), ValueError, "positions"),  # RoPE row 8
    (("c1",), dict(out_loc=torch.tensor([259.0, 260.0])), TypeError, "out_loc"),
    (("c1",), dict(out_loc=torch.tensor([259, 512])), ValueError, "out_loc"),
    (("c1",), dict(out_loc=torch.tensor([259, 259])), ValueError, "out_loc"),
    (("c1",), dict(out_loc=torch.tensor([259, 1 << 31])), ValueError, "out_loc"),
    (("c1",) + C2, dict(eps=0.0), ValueError, "eps"),
    (("c1",) + C2, dict(eps="1e-6"), TypeError, "eps"),
    (("c1",) + C2, dict(freqs_cis=torch.zeros(8, 32)), ValueError, "freqs_cis"),
    (("c1",), dict(k_cache=torch.zeros(2, 1000, dtype=torch.uint8)), ValueError, "k_cache"),
    (("c1",) + C2, dict(k_cache=torch.zeros(2, 4, dtype=torch.int32)), TypeError, "k_cache"),
    (("c1",) + C2, dict(page_size=3), ValueError, "page_size"),
    (("c1",) + C2, dict(page_size="256"), TypeError, "page_size"),
    (("c1",) + C2, dict(layout="v5"), ValueError, "layout"),
    (("c1",) + C2, dict(out=torch.zeros(4, 512)), TypeError, "out"),
    (("c1",), dict(out=torch.zeros(2, 256).bfloat16()), ValueError, "out"),
    (C2, dict(kv_input=torch.zeros(2, 1024).bfloat16()), TypeError, "kv_input"),
    (C2, dict(kv_input=torch.zeros(2, 512)), ValueError, "kv_input"),
    (C2, dict(kv_state=torch.zeros(6, 1024).bfloat16()), TypeError, "kv_state"),
    (C2, dict(kv_state=torch.zeros(6, 512)), ValueError, "kv_state"),
    (("c2 decode",), dict(req=torch.tensor([0, 1], dtype=torch.int32)), TypeError, "req"),
    (("c2 decode",), dict(req=torch.tensor([0, 3])), ValueError, "req"),             # ring row 6 of 6
    (("c2 decode",), dict(raw_out_loc=torch.tensor([-261, 262])), ValueError, "raw_out_loc"),
    (("c2 decode",), dict(raw_out_loc=torch.tensor([1 << 31, 262])), ValueError, "raw_out_loc"),
    (("c2 decode",), dict(raw_out_loc=torch.tensor([769, 262])), ValueError, "raw_out_loc"),  # loc 384 of 384
    (("c2 decode",), dict(positions=torch.tensor([5, 7]), raw_out_loc=torch.tensor([261, 260])), ValueError,
     "raw_out_loc"),                                                                    # both at loc 130
    (C2, dict(ring_size=0), ValueError, "ring_size"),
    (C2, dict(ring_size=2.0), TypeError, "ring_size"),
    (("c2 decode",), dict(draft_len=0), ValueError, "draft_len"),
    (("c2 decode",), dict(draft_len=3), ValueError, "draft_len"),                     # N = 2
    (("c2 decode",), dict(draft_len=2), ValueError, "ring_size"),                     # ring 2 <= draft_len 2
    (("c2 prefill",), dict(extend_start_loc=torch.tensor([0])), TypeError, "extend_start_loc"),
    (("c2 prefill",), dict(extend_seq_lens=torch.tensor([4])), TypeError, "extend_seq_lens"),
    (("c2 prefill",), dict(extend_seq_lens=torch.tensor([5], dtype=torch.int32)), ValueError, "extend_seq_lens"),
    (("c2 prefill",), dict(extend_seq_lens=torch.tensor([-1], dtype=torch.int32)), ValueError, "extend_seq_lens"),
    (("c2 prefill",), dict(extend_seq_lens=torch.tensor([2, 2], dtype=torch.int32)), ValueError, "extend_seq_lens"),
    (("c2 prefill",), dict(extend_start_loc=torch.tensor([5], dtype=torch.int32)), ValueError, "extend_start_loc"),
    (("c2 prefill",), dict(req=torch.full((4,), 3)), ValueError, "req"),               # write-back row 6 of 6
    (("pool",), dict(pos=torch.tensor([5, 6], dtype=torch.int32)), TypeError, "pos"),
    (("pool",), dict(pos=torch.tensor([-5, 6])), ValueError, "pos"),
    (("pool",), dict(req=torch.tensor([0, 1], dtype=torch.int32)), TypeError, "req"),
    (("pool",), dict(req=torch.tensor([0, 4])), ValueError, "req"),
    (("pool",), dict(kv=torch.zeros(2, 512, dtype=torch.float64)), TypeError, "kv"),
    (("pool",), dict(score=torch.zeros(2, 256)), ValueError, "score"),
    (("pool",), dict(raw_out_loc=torch.tensor([261.0, 262.0])), TypeError, "raw_out_loc"),
    (("pool",), dict(out_loc=torch.tensor([130])), ValueError, "out_loc"),
    (("pool",), dict(state_kv=torch.zeros(8, 256)), ValueError, "state_kv"),
    (("pool",), dict(state_score=torch.zeros(8, 512).bfloat16()), TypeError, "state_score"),
    (("pool",), dict(pad_row=8), ValueError, "pad_row"),
    (("pool",), dict(ring_size=-1), ValueError, "ring_size"),
]


def cases():
    for i, (ops, over, exc, name) in enumerate(BAD):
        for op in ops:
            yield pytest.param(op, over, exc, name, id=f"{op}-{name}-{i}")


def mutable(args: dict) -> list:
    return [t for t in args.values() if isinstance(t, torch.Tensor) and t.dtype in (torch.uint8, torch.float32,
                                                                                   torch.bfloat16)]


@pytest.mark.parametrize("op,over,exc,name", list(cases()))
def test_bad_arguments_are_named_and_nothing_is_written(op, over, exc, name):
    fn, make = OPS[op]
    args = make()
    args.update(over)
    before = [t.clone() for t in mutable(args)]
    with pytest.raises(exc) as err:
        fn(**args)
    text = str(err.value)
    assert text.startswith(f"{name}:") or text.startswith(f"{name} ") or f"argument '{name}'" in text, text
    for t, old in zip(mutable(args), before):
        assert torch.equal(t, old)


def test_messages_say_what_was_expected_and_what_came():
    args = c1_args()
    args["k_cache"] = torch.zeros(2, 1000, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"k_cache rows must be page_bytes\('v41_fp4', 256\) = 73728 bytes, got 1000"):
        low_ratio.c1_decode_norm_rope_store(**args)
    args = c2_decode_args()
    args["req"] = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="req: expected dtype int64, got torch.int32"):
        low_ratio.c2_decode_norm_rope_store(**args)


@pytest.mark.parametrize("op", list(OPS))
def test_an_empty_batch_writes_nothing(op):
    fn, make = OPS[op]
    args = make()
    rows = {"kv_input", "positions", "out_loc", "req", "raw_out_loc", "out", "kv", "score", "pos"}
    for key in rows & args.keys():
        args[key] = args[key][:0]
    if op == "c2 prefill":
        args["extend_seq_lens"] = torch.tensor([0], dtype=torch.int32)
    before = [t.clone() for t in mutable(args)]
    result = fn(**args)
    for t, old in zip(mutable(args), before):
        assert torch.equal(t, old)
    first = result[0] if op == "pool" else result
    assert first.shape == (0, 512)


def test_prefill_with_no_request_writes_nothing():
    args = c2_prefill_args()
    args.update(extend_start_loc=torch.zeros(0, dtype=torch.int32), extend_seq_lens=torch.zeros(0, dtype=torch.int32),
                raw_out_loc=torch.zeros(4, dtype=torch.int64))
    before = [t.clone() for t in mutable(args)]
    low_ratio.c2_prefill_norm_rope_store(**args)
    for t, old in zip(mutable(args), before):
        assert torch.equal(t, old)
