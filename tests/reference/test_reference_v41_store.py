"""The paged V4.1 layouts (reference/layouts.py) and the V4.1 / two-pool paths of
compress_norm_rope_store (reference/store.py) against the rules of sglang 0.5.23.

Expected bytes come from the scalar oracles of tests/helpers/v41_oracles.py at addresses computed here
from those rules; caches start poisoned, so a stray or missing write shows."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4jit.kv_layout import KVLayout
from dsv4jit.plan_layout import encode_compress_plan, encode_decode_plan, invalid_compress_rows
from dsv4jit.reference import layouts, store
from helpers.v41_oracles import E2M1_GRID, e4m3_value, interleave, uniform_fp8_row, v41_fp4_row, v41_row

POISON = 0xAB
V41_LAYOUTS = [layout for layout in KVLayout if layout is not KVLayout.V4]
ORACLES = {
    KVLayout.V41: v41_row,
    KVLayout.V41_FP4: v41_fp4_row,
    KVLayout.UNIFORM_FP8: lambda row: (uniform_fp8_row(row), []),
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    return torch.randn(n, 512, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)][:, None]


def poisoned(layout: KVLayout, pages: int, page_size: int, poison: int = POISON) -> torch.Tensor:
    return torch.full((pages, layout.page_bytes(page_size)), poison, dtype=torch.uint8)


def oracle_bytes(layout: KVLayout, row: torch.Tensor) -> tuple[list[int], list[int]]:
    return ORACLES[layout.encoding](row.tolist())


def token_spans(layout: KVLayout, loc: int, page_size: int) -> tuple[int, int]:
    """Flat byte offsets of a token's data and scales, written out per arrangement."""
    page, slot = divmod(loc, page_size)
    base = page * layout.page_bytes(page_size)
    bpt = layout.data_bytes + layout.scale_bytes
    if layout.is_interleaved:
        return base + slot * bpt, base + slot * bpt + layout.data_bytes
    return base + slot * layout.data_bytes, base + page_size * layout.data_bytes + slot * layout.scale_bytes


def check_token(cache: torch.Tensor, layout: KVLayout, loc: int, page_size: int, row: torch.Tensor) -> None:
    flat = cache.flatten()
    data_at, scales_at = token_spans(layout, loc, page_size)
    data, scales = oracle_bytes(layout, row)
    assert flat[data_at:data_at + len(data)].tolist() == data
    assert flat[scales_at:scales_at + len(scales)].tolist() == scales


# ------------------------------------------------------------------------------------ paged writers

@pytest.mark.parametrize("layout,data_at,scales_at", [
    (KVLayout.V41, 5 * 67584 + 512, 5 * 67584 + 65536 + 16),
    (KVLayout.V41_FP4_NEW, 5 * 36864 + 288, 5 * 36864 + 288 + 256),
])
def test_the_spec_address_example(layout, data_at, scales_at):
    """The address example: loc 641 at page size 128 is page 5, slot 1."""
    row = random_rows(1, 1)
    cache = poisoned(layout, 7, 128)
    layouts.write_layout(cache, torch.tensor([641]), row, 128, layout)
    data, scales = oracle_bytes(layout, row[0])
    flat = cache.flatten()
    assert flat[data_at:data_at + len(data)].tolist() == data
    assert flat[scales_at:scales_at + len(scales)].tolist() == scales
    changed = set(torch.nonzero(flat != POISON).flatten().tolist())
    assert changed <= set(range(data_at, data_at + len(data))) | set(range(scales_at, scales_at + len(scales)))


@pytest.mark.parametrize("layout", list(KVLayout))
def test_a_writer_touches_exactly_its_tokens_bytes(layout):
    """Whatever the values, only the token's data and scale bytes change (the 8th v4 scale byte and the
    page padding never)."""
    page_size, loc = 4, 6
    changed = set()
    for poison in (0x00, 0xFF):
        cache = poisoned(layout, 3, page_size, poison)
        layouts.write_layout(cache, torch.tensor([loc]), random_rows(1, 2), page_size, layout)
        changed |= set(torch.nonzero(cache.flatten() != poison).flatten().tolist())
    data_at, scales_at = token_spans(layout, loc, page_size)
    written_scales = 7 if layout is KVLayout.V4 else layout.scale_bytes
    expected = set(range(data_at, data_at + layout.data_bytes)) | set(range(scales_at, scales_at + written_scales))
    assert changed == expected


@pytest.mark.parametrize("layout", V41_LAYOUTS)
def test_write_layout_bytes(layout):
    page_size = 8
    rows = random_rows(6, 3)
    rows[0] = 0.0
    locs = [9, 10, 17, 31, 8, 20]
    cache = poisoned(layout, 4, page_size)
    layouts.write_layout(cache, torch.tensor(locs, dtype=torch.int32), rows, page_size, layout.value.upper())
    for loc, row in zip(locs, rows):
        check_token(cache, layout, loc, page_size, row)
    assert bool((cache[0] == POISON).all())


@pytest.mark.parametrize("new,old", [(KVLayout.V41_NEW, KVLayout.V41), (KVLayout.V41_FP4_NEW, KVLayout.V41_FP4)])
def test_interleaved_bytes_are_the_block_split_bytes_interleaved(new, old):
    page_size = 8
    rows, locs = random_rows(10, 4), torch.tensor([8, 9, 15, 16, 17, 21, 24, 30, 31, 2])
    block, inter = poisoned(old, 4, page_size), poisoned(new, 4, page_size)
    layouts.write_layout(block, locs, rows, page_size, old)
    layouts.write_layout(inter, locs, rows, page_size, new)
    for page in range(4):
        assert torch.equal(interleave(block[page], page_size, old.data_bytes, old.scale_bytes), inter[page])


def test_read_layout_dequantizes_each_code():
    page_size, rows, locs = 8, random_rows(5, 5), torch.tensor([3, 12, 13, 20, 31])
    for layout in V41_LAYOUTS:
        cache = poisoned(layout, 4, page_size)
        layouts.write_layout(cache, locs, rows, page_size, layout)
        got = layouts.read_layout(cache, locs, page_size, layout)
        for i, row in enumerate(rows):
            data, scales = oracle_bytes(layout, row)
            if layout.encoding is KVLayout.V41:
                expected = [math.ldexp(e4m3_value(c), scales[j // 32] - 127) for j, c in enumerate(data)]
            elif layout.is_fp4:
                codes = [(data[j // 2] >> (4 * (j % 2))) & 0xF for j in range(512)]
                expected = [(-1 if c & 8 else 1) * E2M1_GRID[c & 7] * e4m3_value(scales[j // 16])
                            for j, c in enumerate(codes)]
            else:
                expected = [e4m3_value(c) for c in data]
            assert got[i].tolist() == expected


# ------------------------------------------------------------------------------------- two-pool store

@pytest.mark.parametrize("page_size", [1, 4])
def test_two_pool_store_is_the_v4_latent_split_in_two(page_size):
    """A 512-byte row per slot (448 nope codes, the 7 exponents each twice, bytes 462-511
    untouched) and a 128-byte bf16 rope row per slot, with the V4 latent's codes."""
    pages, rows, locs = 12 // page_size, random_rows(5, 6), [1, 3, 4, 7, 10]
    v4 = poisoned(KVLayout.V4, pages, page_size)
    layouts.write_v4(v4, torch.tensor(locs), rows, page_size)
    fp8 = torch.full((pages, 512 * page_size), POISON, dtype=torch.uint8)
    rope = torch.full((pages * page_size, 128), POISON, dtype=torch.uint8)
    layouts.write_v4_2buff(fp8, rope, torch.tensor(locs), rows, page_size)
    fp8_rows, v4_flat = fp8.reshape(-1, 512), v4.flatten()
    for loc in range(pages * page_size):
        if loc not in locs:
            assert bool((fp8_rows[loc] == POISON).all()) and bool((rope[loc] == POISON).all())
            continue
        data_at, scales_at = token_spans(KVLayout.V4, loc, page_size)
        assert torch.equal(fp8_rows[loc, :448], v4_flat[data_at:data_at + 448])
        exponents = v4_flat[scales_at:scales_at + 7]
        assert torch.equal(fp8_rows[loc, 448:462:2], exponents) and torch.equal(fp8_rows[loc, 449:462:2], exponents)
        assert bool((fp8_rows[loc, 462:] == POISON).all())
        assert torch.equal(rope[loc], v4_flat[data_at + 448:data_at + 576])
    read = layouts.read_v4_2buff(fp8, rope, torch.tensor(locs), page_size)
    assert torch.equal(read, layouts.read_v4(v4, torch.tensor(locs), page_size))


# ---------------------------------------------------------------------------- compress_norm_rope_store

def freq_cis_table(max_pos: int, seed: int) -> torch.Tensor:
    angles = torch.rand(max_pos, 32, generator=gen(seed), dtype=torch.float64) * 6.3
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def decode_case(n: int, ratio: int, seed: int):
    """A decode plan whose rows all store: (kv fp32, plan, positions, out_loc)."""
    g = gen(seed)
    seq_len = ratio * torch.randint(1, 6, (n,), generator=g)
    zeros = torch.zeros(n, dtype=torch.int64)
    plan = encode_decode_plan(seq_len, zeros, zeros, zeros)
    out_loc = torch.randperm(40, generator=g)[:n] + 1
    kv = torch.randn(n, 512, generator=g) * 3
    return kv, plan, seq_len - ratio, out_loc


def expected_v41_rows(kv: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, freq_cis: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """The V4.1 path's values: RMSNorm, rounded to kv's dtype, rope dims rotated in fp32 and rounded again."""
    def to_d(x):
        return x.to(dtype).float()

    y = to_d(store.rms_norm(kv.to(dtype), w.to(dtype), 1e-6))
    table = torch.view_as_real(freq_cis)[positions].float()
    cos, sin = table[..., 0], table[..., 1]
    re, im = y[:, 448::2], y[:, 449::2]
    out = y.clone()
    out[:, 448::2], out[:, 449::2] = re * cos - im * sin, re * sin + im * cos
    return to_d(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", V41_LAYOUTS)
def test_v41_path_bytes(layout, dtype):
    page_size, ratio = 8, 4
    kv, plan, positions, out_loc = decode_case(5, ratio, 7)
    w, freq_cis = 0.5 + torch.rand(512, generator=gen(8)), freq_cis_table(32, 9)
    cache = poisoned(layout, 6, page_size)
    store.compress_norm_rope_store(kv.to(dtype), plan, is_decode=True, compress_ratio=ratio, norm_weight=w,
                                   norm_eps=1e-6, freq_cis=freq_cis, out_loc=out_loc, kvcache=cache,
                                   page_size=page_size, layout=layout.value.upper())
    rows = expected_v41_rows(kv, w, positions, freq_cis, dtype)
    for loc, row in zip(out_loc.tolist(), rows):
        check_token(cache, layout, loc, page_size, row)
    written = sum(layout.data_bytes + layout.scale_bytes for _ in out_loc)
    assert int((cache != POISON).sum()) <= written
    if dtype == torch.float32:  # no bf16 rounding of the rows on this path
        assert oracle_bytes(layout, rows[0]) != oracle_bytes(layout, rows[0].bfloat16().float())


def test_v41_path_prefill_rows_and_skipped_rows():
    """Prefill: only valid CompressPlan rows store, at out_loc[ragged_id] (as for v4)."""
    layout, page_size, ratio = KVLayout.V41_FP4_NEW, 2, 128
    seq_len = torch.tensor([128, 256, 384])
    plan = encode_compress_plan(seq_len, torch.tensor([0, 3, 5]), torch.zeros(3, dtype=torch.int64),
                                torch.full((3,), -1), torch.full((3,), -1))
    plan[1] = invalid_compress_rows(1)[0]
    out_loc = torch.tensor([7, 0, 0, 2, 0, 4])
    kv, w, freq_cis = random_rows(3, 10), 0.5 + torch.rand(512, generator=gen(11)), freq_cis_table(300, 12)
    cache = poisoned(layout, 4, page_size)
    store.compress_norm_rope_store(kv, plan, is_decode=False, compress_ratio=ratio, norm_weight=w, norm_eps=1e-6,
                                   freq_cis=freq_cis, out_loc=out_loc, kvcache=cache, page_size=page_size,
                                   layout=layout)
    rows = expected_v41_rows(kv, w, seq_len - ratio, freq_cis, torch.float32)
    check_token(cache, layout, 7, page_size, rows[0])
    check_token(cache, layout, 4, page_size, rows[2])
    assert bool((cache.flatten()[:2 * layout.page_bytes(page_size)] == POISON).all())  # pages 0, 1: loc 2 unused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_2buff_path_stores_the_v4_latent(dtype):
    """fp8_2buff (page size 1, as served): the v4 latent of the same rows, split into the two pools."""
    kv, plan, _, out_loc = decode_case(6, 4, 13)
    kv = kv.to(dtype)
    w, freq_cis = 0.5 + torch.rand(512, generator=gen(14)), freq_cis_table(32, 15)
    common = dict(is_decode=True, compress_ratio=4, norm_weight=w, norm_eps=1e-6, freq_cis=freq_cis,
                  out_loc=out_loc, page_size=1)
    v4 = poisoned(KVLayout.V4, 48, 1)
    store.compress_norm_rope_store(kv, plan, kvcache=v4, **common)
    fp8 = torch.full((48, 512), POISON, dtype=torch.uint8)
    rope = torch.full((48, 128), POISON, dtype=torch.uint8)
    store.compress_norm_rope_store(kv, plan, kvcache=fp8, fp8_2buff=True, kvcache_rope=rope, **common)
    expected_fp8 = torch.full_like(fp8, POISON)
    expected_rope = torch.full_like(rope, POISON)
    for loc in out_loc.tolist():
        data, scales = v4[loc, :576], v4[loc, 576:583]
        expected_fp8[loc, :448], expected_rope[loc] = data[:448], data[448:]
        expected_fp8[loc, 448:462:2] = expected_fp8[loc, 449:462:2] = scales
    assert torch.equal(fp8, expected_fp8) and torch.equal(rope, expected_rope)


def test_layout_v4_by_name_is_the_v4_store():
    kv, plan, _, out_loc = decode_case(4, 4, 16)
    w, freq_cis = 0.5 + torch.rand(512, generator=gen(17)), freq_cis_table(32, 18)
    caches = []
    for extra in ({}, {"layout": "V4"}, {"layout": KVLayout.V4}):
        cache = poisoned(KVLayout.V4, 6, 8)
        store.compress_norm_rope_store(kv, plan, is_decode=True, compress_ratio=4, norm_weight=w, norm_eps=1e-6,
                                       freq_cis=freq_cis, out_loc=out_loc, kvcache=cache, page_size=8, **extra)
        caches.append(cache)
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2])
    assert not torch.equal(caches[0], poisoned(KVLayout.V4, 6, 8))


def test_empty_batch_writes_nothing():
    cache = poisoned(KVLayout.V41, 2, 2)
    store.compress_norm_rope_store(torch.zeros(0, 512), invalid_compress_rows(0), is_decode=False, compress_ratio=128,
                                   norm_weight=torch.ones(512), norm_eps=1e-6, freq_cis=freq_cis_table(4, 1),
                                   out_loc=torch.zeros(0, dtype=torch.int64), kvcache=cache, page_size=2,
                                   layout="v41")
    assert bool((cache == POISON).all())


def bad_store_calls():
    """(name, kwargs overriding a good v41 call, exception, argument named, text in the message)."""
    good_2buff = dict(layout="v4", fp8_2buff=True, page_size=1)
    return [
        ("unknown layout", dict(layout="v5"), ValueError, "layout", "'v41_fp4_new'"),
        ("layout with use_fp4", dict(kv_dim=128, use_fp4=True), ValueError, "layout", "use_fp4"),
        ("layout with bf16_store", dict(bf16_store=True), ValueError, "layout", "bf16_store"),
        ("layout with head_dim 128", dict(kv_dim=128), ValueError, "layout", "head_dim 128"),
        ("layout with fp8_2buff", dict(fp8_2buff=True, rope=True), ValueError, "layout", "fp8_2buff"),
        ("2buff with use_fp4", dict(good_2buff, kv_dim=128, use_fp4=True, rope=True), ValueError, "fp8_2buff",
         "use_fp4"),
        ("2buff with bf16_store", dict(good_2buff, bf16_store=True, rope=True), ValueError, "fp8_2buff",
         "bf16_store"),
        ("2buff with head_dim 128", dict(good_2buff, kv_dim=128, rope=True), ValueError, "fp8_2buff", "head_dim 128"),
        ("2buff without kvcache_rope", dict(good_2buff), ValueError, "fp8_2buff", "kvcache_rope"),
        ("kvcache_rope rows", dict(good_2buff, rope=True, rope_rows=47), ValueError, "kvcache_rope", "47 rows"),
        ("kvcache_rope width", dict(good_2buff, rope=True, rope_width=64), ValueError, "kvcache_rope", "128"),
        ("2buff cache width", dict(good_2buff, rope=True, cache_width=584), ValueError, "kvcache", "= 512 bytes"),
        ("kvcache_rope without fp8_2buff", dict(rope=True), ValueError, "kvcache_rope", "fp8_2buff"),
        ("cache width", dict(cache_width=5000), ValueError, "kvcache",
         "page_bytes('v41', 8) = 4608 bytes, got 5000"),
        ("v4 width for a v41 cache", dict(cache_width=KVLayout.V4.page_bytes(8)), ValueError, "kvcache", "4608"),
        ("loc beyond the cache", dict(big_loc=True), ValueError, "out_loc", "locations"),
    ]


@pytest.mark.parametrize("case", bad_store_calls(), ids=lambda c: c[0])
def test_bad_v41_arguments_are_named_and_nothing_is_written(case):
    _, over, exc, name, text = case
    kv_dim = over.pop("kv_dim", 512)
    page_size = over.get("page_size", 8)
    kv, plan, _, out_loc = decode_case(4, 4, 19)
    if over.pop("big_loc", False):
        out_loc[2] = 6 * page_size
    kv = torch.randn(4, kv_dim, generator=gen(20))
    width = over.pop("cache_width", None)
    pages = 48 // page_size
    cache = torch.full((pages, width or KVLayout.V41.page_bytes(page_size)), POISON, dtype=torch.uint8)
    if over.get("fp8_2buff") and width is None:
        cache = torch.full((pages, 512 * page_size), POISON, dtype=torch.uint8)
    rope = None
    if over.pop("rope", False):
        rope = torch.full((over.pop("rope_rows", pages * page_size), over.pop("rope_width", 128)), POISON,
                          dtype=torch.uint8)
    kwargs = dict(is_decode=True, compress_ratio=4, norm_weight=torch.ones(kv_dim), norm_eps=1e-6,
                  freq_cis=freq_cis_table(32, 21), out_loc=out_loc, kvcache=cache, page_size=page_size,
                  layout="v41", kvcache_rope=rope)
    kwargs.update(over)
    with pytest.raises(exc) as err:
        store.compress_norm_rope_store(kv, plan, **kwargs)
    assert str(err.value).startswith(name), str(err.value)
    assert text in str(err.value), str(err.value)
    assert bool((cache == POISON).all())
    assert rope is None or bool((rope == POISON).all())
