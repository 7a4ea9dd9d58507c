"""low_ratio_metadata (contract §10.6): the per-token metadata of the ratio-1 and ratio-2 ops, against
a per-request loop over decode, verify and ragged-extend batches with padded rows; an empty batch;
bad input named before anything is built; on the GPU, the same tensors and a CUDA-graph capture (which
fails on a host sync).
"""

from __future__ import annotations

import pytest
import torch

import dsv4jit
from dsv4jit.errors import ArgumentError, ArgumentTypeError

HAS_CUDA = torch.cuda.is_available()
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
SLOTS, CONTEXT = 12, 300


def batch(seed: int, kind: str, padding: int):
    """A step of a random batch: distinct slots, lengths after the step, this step's tokens per request
    (1 in decode, 3 in a verify, 0–40 in an extend), a random table (slots never 0 for a real token)."""
    g = torch.Generator().manual_seed(seed)
    b = int(torch.randint(1, 8, (1,), generator=g))
    rpi = torch.randperm(SLOTS, generator=g)[:b]
    ext = {"decode": torch.ones(b, dtype=torch.int64), "verify": torch.full((b,), 3),
           "extend": torch.randint(0, 41, (b,), generator=g)}[kind]
    seq = ext + torch.randint(0, CONTEXT - 40, (b,), generator=g)
    table = torch.randint(256, 1 << 20, (SLOTS, CONTEXT), generator=g, dtype=torch.int32)
    return rpi, seq, ext, table, int(ext.sum()) + padding


def expected(rpi, seq, ext, table, n: int) -> list[tuple]:
    """Row by row: (position, req, raw_out_loc, c1_out_loc, c2_out_loc); padding rows all 0."""
    out = []
    for b in range(rpi.numel()):
        for k in range(int(ext[b])):
            pos, req = int(seq[b]) - int(ext[b]) + k, int(rpi[b])
            raw = int(table[req, pos])
            out.append((pos, req, raw, raw, raw // 2 if pos % 2 else -1))
    return out + [(0, 0, 0, 0, 0)] * (n - len(out))


def as_rows(m) -> list[tuple]:
    return list(zip(*(t.tolist() for t in (m.positions, m.req, m.raw_out_loc, m.c1_out_loc, m.c2_out_loc))))


@pytest.mark.parametrize("kind", ["decode", "verify", "extend"])
@pytest.mark.parametrize("padding", [0, 5])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("int32", [False, True])
def test_matches_a_loop_over_the_requests(kind, padding, seed, int32):
    rpi, seq, ext, table, n = batch(seed, kind, padding)
    if int32:
        rpi, seq, ext = rpi.int(), seq.int(), ext.int()
    m = dsv4jit.low_ratio_metadata(rpi, seq, ext, table, n)
    assert as_rows(m) == expected(rpi, seq, ext, table, n)
    for t in (m.positions, m.req, m.raw_out_loc, m.c1_out_loc, m.c2_out_loc):
        assert t.dtype == torch.int64 and t.shape == (n,)
    assert m.extend_start_loc.dtype == m.extend_seq_lens.dtype == torch.int32
    assert m.extend_start_loc.tolist() == (torch.cumsum(ext, 0) - ext).tolist()
    assert m.extend_seq_lens.tolist() == ext.tolist()


def test_an_empty_batch_is_all_padding():
    e = torch.zeros(0, dtype=torch.int64)
    m = dsv4jit.low_ratio_metadata(e, e, e, torch.zeros(2, 8, dtype=torch.int32), 3)
    assert as_rows(m) == [(0, 0, 0, 0, 0)] * 3
    assert m.extend_start_loc.numel() == m.extend_seq_lens.numel() == 0
    assert all(t.numel() == 0 for t in dsv4jit.low_ratio_metadata(e, e, e, torch.zeros(2, 8, dtype=torch.int32), 0))


def _spoil(name, value):
    def call():
        rpi, seq, ext, table, n = batch(0, "extend", 2)
        kw = dict(req_pool_indices=rpi, seq_lens=seq, extend_lens=ext, req_to_token=table, num_tokens=n)
        kw[name] = value(kw) if callable(value) else value
        return kw
    return call


BAD = [
    ("num_tokens", lambda kw: int(kw["extend_lens"].sum()) - 1, ArgumentError, "'extend_lens': entries must sum to"),
    ("num_tokens", -1, ArgumentError, "'num_tokens' must be >= 0"),
    ("num_tokens", 2.0, ArgumentTypeError, "'num_tokens' must be an int"),
    ("extend_lens", lambda kw: -kw["extend_lens"], ArgumentError, "'extend_lens': entries must be >= 0"),
    ("seq_lens", lambda kw: kw["extend_lens"] - 1, ArgumentError, "'seq_lens': entries must be >= extend_lens"),
    ("seq_lens", lambda kw: kw["seq_lens"] + CONTEXT, ArgumentError, "'seq_lens': entries must be <= req_to_token's"),
    ("req_pool_indices", lambda kw: kw["req_pool_indices"] + SLOTS, ArgumentError,
     "'req_pool_indices': entries must lie in [0, 12)"),
    ("req_pool_indices", lambda kw: kw["req_pool_indices"].float(), ArgumentTypeError,
     "'req_pool_indices': dtype must be torch.int32 or torch.int64"),
    ("seq_lens", lambda kw: kw["seq_lens"][:-1], ArgumentError, "'seq_lens' must have shape"),
    ("req_to_token", lambda kw: kw["req_to_token"].long(), ArgumentTypeError, "'req_to_token': dtype must be torch.int32"),
    ("req_to_token", lambda kw: kw["req_to_token"][0], ArgumentError, "'req_to_token' must have 2 dimensions"),
    ("extend_lens", lambda kw: kw["extend_lens"].tolist(), ArgumentTypeError, "'extend_lens' must be a torch.Tensor"),
]


@pytest.mark.parametrize("name, value, exc, words", BAD, ids=[f"{b[0]}-{b[3][:30]}" for b in BAD])
def test_bad_input_is_named(name, value, exc, words):
    with pytest.raises(exc) as err:
        dsv4jit.low_ratio_metadata(**_spoil(name, value)())
    assert type(err.value) is exc and str(err.value).startswith("dsv4jit.low_ratio_metadata: argument ")
    assert words in str(err.value), err.value


@pytest.mark.parametrize("kind", ["decode", "verify", "extend"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_on_the_gpu_it_matches_and_captures_in_a_graph(kind, device):
    rpi, seq, ext, table, n = batch(1, kind, 3)
    want = dsv4jit.low_ratio_metadata(rpi, seq, ext, table, n)
    args = [t.to(device) for t in (rpi, seq, ext, table)]
    got = dsv4jit.low_ratio_metadata(*args, n)
    assert as_rows(got) == as_rows(want)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dsv4jit.low_ratio_metadata(*args, n)  # warm up off the default stream, as capture requires
        with torch.cuda.graph(graph, stream=stream):
            captured = dsv4jit.low_ratio_metadata(*args, n)
    args[1].add_(1)  # the next step: one token longer each
    graph.replay()
    torch.cuda.synchronize()
    assert as_rows(captured) == as_rows(dsv4jit.low_ratio_metadata(rpi, seq + 1, ext, table, n))
