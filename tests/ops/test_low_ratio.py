"""The DeepSeek-V4.1 ratio-1 and ratio-2 compressors through the public API (contract §10.4, contract §10.5): each
op on the GPU against the torch reference on the same inputs (pair rings, caches and outputs start
random, so a stray or missing write shows), over every layout, decode, verify and ragged extends with
padded rows; an empty batch; the CUDA-graph capture of a decode step; bad input named on the CPU.

The kernels compute the latent as the reference does (the sum of squares, the root and the exp in fp64,
each rounded once: contract §10.7), so outputs, rings and caches are compared bit for bit; a rare
rounding case is tolerated on at most RARE of the values, each one step apart.
"""

from __future__ import annotations

import pytest
import torch

import dsv4jit
from dsv4jit.geometry import page_bytes
from dsv4jit.kv_layout import KVLayout
from helpers.low_ratio_rows import Rows, ring_rows, rows

HAS_CUDA = torch.cuda.is_available()
CUDA = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
LAYOUTS = [layout.value for layout in KVLayout]
EPS = 1e-6
RARE = 1e-3


def fmt_of(layout: str) -> str:
    return "v4_fp8" if layout == "v4" else layout


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


def freq_table(max_pos: int, seed: int) -> torch.Tensor:
    """fp32 [max_pos, 64] of interleaved (cos, sin), as the model passes it to these ops."""
    angles = torch.rand(max_pos, 32, generator=gen(seed)) * 6.3
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles)).flatten(1)


def max_pos(r: Rows) -> int:
    """Rows of a freq table that covers every position of `r`."""
    return int(r.pos.max()) + 2 if r.n else 4


def random_bytes(shape, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen(seed), dtype=torch.uint8)


def assert_close(what: str, got: torch.Tensor, expect: torch.Tensor) -> None:
    """Equal, but for at most RARE of the values (a rounding case, contract §10.7)."""
    got, expect = got.cpu(), expect.cpu()
    assert got.shape == expect.shape and got.dtype == expect.dtype, what
    differ = int((got.view(torch.uint8) != expect.view(torch.uint8)).sum()) if got.dtype == torch.uint8 else \
        int((got != expect).sum())
    assert differ <= RARE * got.numel(), f"{what}: {differ} of {got.numel()} values differ"


def both(call, tensors: dict) -> tuple[dict, dict]:
    """`call(**tensors)` on CPU copies (the reference) and on CUDA copies (the kernel); the tensors each
    wrote, back on the CPU."""
    results = []
    for device in ("cpu", "cuda"):
        mine = {k: (v.clone().to(device) if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}
        returned = call(**mine)
        if HAS_CUDA:
            torch.cuda.synchronize()
        mine["returned"] = returned
        results.append(mine)
    return results[0], results[1]


def c1_inputs(layout: str, r: Rows, seed: int) -> dict:
    n = r.n
    return dict(kv_input=randn((n, 512), seed).bfloat16(), norm_weight=(0.5 + torch.rand(512, generator=gen(seed + 1)))
                .bfloat16(), positions=r.pos, out_loc=r.raw, eps=EPS, freqs_cis=freq_table(max_pos(r), seed + 2),
                k_cache=random_bytes((r.num_pages, page_bytes(fmt_of(layout), 256)), seed + 3), page_size=256,
                layout=layout, out=torch.full((n, 512), -7.0).bfloat16())


def c2_inputs(layout: str, r: Rows, ring: int, seed: int) -> dict:
    n = r.n
    return dict(kv_input=randn((n, 1024), seed), kv_state=randn((ring_rows(r.num_slots, ring), 1024), seed + 4),
                norm_weight=(0.5 + torch.rand(512, generator=gen(seed + 1))).bfloat16(), positions=r.pos, req=r.req,
                raw_out_loc=r.raw, eps=EPS, freqs_cis=freq_table(max_pos(r), seed + 2),
                k_cache=random_bytes((r.num_pages, page_bytes(fmt_of(layout), 128)), seed + 3), page_size=128,
                ring_size=ring, layout=layout, out=torch.full((n, 512), -7.0).bfloat16())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_c1_matches_the_reference(layout, loc_dtype, device):
    r = rows([300, 5, 511, 1024, 77], [1, 40, 3, 1, 20], pad=7, seed=1)
    kw = c1_inputs(layout, r, seed=10)
    kw["positions"], kw["out_loc"] = kw["positions"].to(loc_dtype), kw["out_loc"].to(loc_dtype)
    ref, dev = both(dsv4jit.c1_decode_norm_rope_store, kw)
    assert_close("out", dev["out"], ref["out"])
    assert_close("k_cache", dev["k_cache"], ref["k_cache"])
    assert dev["returned"].data_ptr() == dev["out"].data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("draft_len", [1, 4])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_c2_decode_and_verify_match_the_reference(layout, draft_len, device):
    ring = 2 if draft_len == 1 else 8
    starts = [300, 5, 511, 1023, 77, 2048, 18, 901]
    r = rows(starts, [draft_len] * len(starts), pad=draft_len * 2, seed=2)
    kw = c2_inputs(layout, r, ring, seed=20)
    ref, dev = both(lambda **k: dsv4jit.c2_decode_norm_rope_store(**k, draft_len=draft_len), kw)
    closing = (r.pos % 2 == 1) & (r.raw != 0)
    assert_close("out", dev["out"][closing], ref["out"][closing])
    assert torch.equal(dev["kv_state"].cpu(), ref["kv_state"]), "pair rings differ"
    assert_close("k_cache", dev["k_cache"], ref["k_cache"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ring", [2, 4])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_c2_prefill_matches_the_reference(layout, ring, device):
    """Ragged extends starting at even and odd positions (an odd start pools with the ring, whose row
    the same request's write-back then overwrites: the read must come first), one-row and long
    requests, and padded rows past the last request."""
    r = rows([0, 7, 300, 1023, 64, 5], [33, 1, 130, 2, 7, 4], pad=5, seed=3)
    kw = c2_inputs(layout, r, ring, seed=30)
    kw.update(extend_start_loc=r.starts, extend_seq_lens=r.lens)
    ref, dev = both(dsv4jit.c2_prefill_norm_rope_store, kw)
    closing = (r.pos % 2 == 1) & (r.raw != 0)
    assert_close("out", dev["out"][closing], ref["out"][closing])
    assert torch.equal(dev["kv_state"].cpu(), ref["kv_state"]), "pair rings differ"
    assert_close("k_cache", dev["k_cache"], ref["k_cache"])


@pytest.mark.parametrize("ring", [0, 2, 8])
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_c2_decode_pool_matches_the_reference(ring, loc_dtype, device):
    r = rows([300, 5, 511, 1024, 77, 2047], [1] * 6, pad=3, seed=4)
    n = r.n
    out_loc = torch.where(r.raw != 0, torch.where(r.pos % 2 == 1, r.raw // 2, -1), 0)
    if ring:
        state = randn((ring_rows(r.num_slots, ring), 1024), 41)
        halves = lambda s: (s[:, :512], s[:, 512:])  # noqa: E731
        pad_row = state.shape[0] - 1
    else:
        state = randn((2, r.num_slots + 1, 512), 41)
        halves = lambda s: (s[0], s[1])  # noqa: E731
        pad_row = r.num_slots
    results = []
    for device_ in ("cpu", "cuda"):
        s = state.clone().to(device_)
        kv_state, score_state = halves(s)
        got = dsv4jit.c2_decode_pool(randn((n, 512), 42).to(device_), randn((n, 512), 43).to(device_),
                                     r.pos.to(device_), r.raw.to(loc_dtype).to(device_), out_loc.to(loc_dtype).to(device_),
                                     r.req.to(device_), kv_state, score_state, pad_row, ring_size=ring)
        results.append((s.cpu(), [t.cpu() for t in got]))
    (s_ref, (p_ref, g_ref, sl_ref)), (s_dev, (p_dev, g_dev, sl_dev)) = results
    live = r.raw != 0  # padded rows' pooling reads the pad row, which other padded rows may write
    assert torch.equal(p_dev[live], p_ref[live]), "pooled rows differ"
    assert torch.equal(g_dev, g_ref) and torch.equal(sl_dev, sl_ref) and sl_dev.dtype == loc_dtype
    if ring == 0:
        s_dev, s_ref = s_dev[:, :-1], s_ref[:, :-1]
    assert torch.equal(s_dev, s_ref), "states differ"


def rare_pair_rows(rows_: torch.Tensor, partner: bool) -> torch.Tensor:
    """| kv | score | rows whose pooling takes the rare paths (contract §10.7's arithmetic unchanged):
    scores 40 times wider, so that exp(-|d|) spans 1 down to fp32 subnormals and 0; kv tiny (2^-70) on
    dims 0-15, zero on 16-31 and 2^61-sized on 32-47, where a quotient leaves the division's fast
    range; and on a partner row, scores of -inf (a cleared ring row) on dims 48-63."""
    out = rows_.clone()
    out[:, 512:] *= 40.0
    out[:, :16] *= 2.0 ** -70
    out[:, 16:32] = 0.0
    out[:, 32:48] *= 2.0 ** 61
    if partner:
        out[:, 512 + 48:512 + 64] = float("-inf")
    return out


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_pair_pooling_of_rare_operands_matches_the_reference(device):
    """Both pair poolings (c2 decode's, c2_decode_pool's) on scores and kv that leave the branch-free
    exp's and quotients' common range (rare_pair_rows) give the references' bits."""
    r = rows([301, 5, 511, 1023, 77, 2047], [1] * 6, pad=2, seed=5)
    kw = c2_inputs("v41_fp4", r, 2, seed=50)
    kw["kv_input"], kw["kv_state"] = rare_pair_rows(kw["kv_input"], False), rare_pair_rows(kw["kv_state"], True)
    ref, dev = both(lambda **k: dsv4jit.c2_decode_norm_rope_store(**k, draft_len=1), kw)
    closing = (r.pos % 2 == 1) & (r.raw != 0)
    assert_close("out", dev["out"][closing], ref["out"][closing])
    assert_close("k_cache", dev["k_cache"], ref["k_cache"])
    out_loc = torch.where(r.raw != 0, torch.where(r.pos % 2 == 1, r.raw // 2, -1), 0)
    pooled = []
    for device_ in ("cpu", "cuda"):
        state = kw["kv_state"].clone().to(device_)
        own = kw["kv_input"].to(device_)
        pooled.append(dsv4jit.c2_decode_pool(own[:, :512].contiguous(), own[:, 512:].contiguous(), r.pos.to(device_),
                                             r.raw.to(device_), out_loc.to(device_), r.req.to(device_),
                                             state[:, :512], state[:, 512:], state.shape[0] - 1,
                                             ring_size=2)[0].cpu())
    live = r.raw != 0
    assert torch.equal(pooled[1][live], pooled[0][live]), "pooled rows differ"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_an_empty_batch_writes_nothing(device):
    r = rows([4], [0], seed=5)
    kw = c2_inputs("v41_fp4", r, 2, seed=50)
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    ring, cache = kw["kv_state"].clone(), kw["k_cache"].clone()
    out = dsv4jit.c2_decode_norm_rope_store(**kw)
    assert out.shape == (0, 512) and torch.equal(kw["kv_state"], ring) and torch.equal(kw["k_cache"], cache)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=CUDA)])
def test_a_decode_step_replays_from_a_cuda_graph(device):
    """c1 and c2 decode captured in one CUDA graph: the replay writes what eager calls write."""
    r = rows([300, 5, 511, 77], [1] * 4, pad=4, seed=6)
    c1 = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c1_inputs("v41_fp4", r, 60).items()}
    c2 = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in c2_inputs("v41_fp4", r, 2, 61).items()}
    eager_c1, eager_c2 = ({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()} for d in (c1, c2))
    dsv4jit.c1_decode_norm_rope_store(**eager_c1)
    dsv4jit.c2_decode_norm_rope_store(**eager_c2)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm: loads the kernels outside the capture
        dsv4jit.c1_decode_norm_rope_store(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c1.items()})
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        dsv4jit.c1_decode_norm_rope_store(**c1)
        dsv4jit.c2_decode_norm_rope_store(**c2)
    graph.replay()
    torch.cuda.synchronize()
    for name in ("out", "k_cache"):
        assert torch.equal(c1[name], eager_c1[name]), f"c1 {name}"
    for name in ("out", "k_cache", "kv_state"):
        closing = ((r.pos % 2 == 1) & (r.raw != 0)).cuda() if name == "out" else slice(None)
        assert torch.equal(c2[name][closing], eager_c2[name][closing]), f"c2 {name}"


@pytest.mark.parametrize("spoil, name, pattern", [
    (lambda kw: kw.update(req=kw["req"].to(torch.int32)), "req", "int64"),
    (lambda kw: kw.update(norm_weight=kw["norm_weight"].float()), "norm_weight", "bfloat16"),
    (lambda kw: kw.update(layout="v5"), "layout", "KVLayout"),
    (lambda kw: kw.update(ring_size=0), "ring_size", "> 0"),
    (lambda kw: kw.update(k_cache=kw["k_cache"][:, :-16]), "k_cache", "67584"),
])
def test_bad_input_is_named_and_writes_nothing(spoil, name, pattern):
    r = rows([3, 10], [1, 1], seed=7)
    kw = c2_inputs("v41", r, 2, seed=70)
    spoil(kw)
    ring, cache = kw["kv_state"].clone(), kw["k_cache"].clone()
    with pytest.raises((ValueError, TypeError), match=rf"dsv4jit\.c2_decode_norm_rope_store: argument '{name}'.*{pattern}"):
        dsv4jit.c2_decode_norm_rope_store(**kw)
    assert torch.equal(kw["kv_state"], ring) and torch.equal(kw["k_cache"][:, :cache.shape[1]], cache[:, :kw["k_cache"].shape[1]])
