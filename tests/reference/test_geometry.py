"""dsv4jit.geometry against independent facts: the bytes the reference writers touch, the window
and row layouts of the contract, and the format rules the ops and the references share."""

from __future__ import annotations

import pytest
import torch

from dsv4jit import geometry
from dsv4jit.reference import layouts, store

PAGE_SIZE = 4


def _write(fmt: str, cache: torch.Tensor, rope: torch.Tensor, loc: int, values: torch.Tensor) -> None:
    """The reference writer of `fmt` (rope: the two-pool format's rope pool)."""
    if fmt == "v4_fp8_2buff":
        layouts.write_v4_2buff(cache, rope, torch.tensor([loc]), values, PAGE_SIZE)
    elif fmt in geometry.V41_FORMATS:
        layouts.write_layout(cache, torch.tensor([loc]), values, PAGE_SIZE, fmt)
    else:
        store.WRITERS[fmt](cache, torch.tensor([loc]), values, PAGE_SIZE)


def written_positions(fmt: str, loc: int) -> set[int]:
    """Flat positions the reference writer changes for one token at `loc` (the two-pool format's rope
    pool after the cache's): a byte it writes differs from at least one of two poisons, whatever value
    it writes."""
    values = torch.randn(1, geometry.format_head_dim(fmt), generator=torch.Generator().manual_seed(3))
    changed = set()
    for poison in (0x00, 0xFF):
        cache = torch.full((2, geometry.page_bytes(fmt, PAGE_SIZE)), poison, dtype=torch.uint8)
        rope = torch.full((2 * PAGE_SIZE, geometry.ROPE_ROW_BYTES), poison, dtype=torch.uint8)
        _write(fmt, cache, rope, loc, values)
        changed |= set(torch.nonzero(torch.cat([cache.flatten(), rope.flatten()]) != poison).flatten().tolist())
    return changed


@pytest.mark.parametrize("fmt", geometry.FORMATS)
def test_written_bytes_are_what_the_writer_touches(fmt):
    assert len(written_positions(fmt, PAGE_SIZE + 1)) == geometry.written_bytes(fmt)


@pytest.mark.parametrize("fmt", [f for f in geometry.FORMATS if f != "v4_fp8_2buff"])
def test_a_token_lies_in_its_data_row_and_scale_row(fmt):
    """Token `slot` of a page: block-split, data at slot·data bytes and scales after the page's data
    rows (contract §6.5); interleaved, the token's bytes at slot·(data + scale bytes) (contract §10.1)."""
    data, scales = geometry.token_bytes(fmt)
    slot = 3
    page = geometry.page_bytes(fmt, PAGE_SIZE)
    if fmt.endswith("_new"):
        expected = {page + slot * (data + scales) + i for i in range(data + scales)}
    else:
        expected = {page + slot * data + i for i in range(data)}
        expected |= {page + PAGE_SIZE * data + slot * scales + i for i in range(scales)}
    assert written_positions(fmt, PAGE_SIZE + slot) <= expected
    assert page >= PAGE_SIZE * (data + scales)


def test_two_pools_hold_a_token_in_its_row_and_its_rope_row():
    """fp8_2buff: token loc's 512-byte row at loc·512 (448 codes, the 7 exponents twice) and its bf16
    rope row at loc·128 of the rope pool (contract §10.3)."""
    loc = PAGE_SIZE + 3
    rope_base = 2 * geometry.page_bytes("v4_fp8_2buff", PAGE_SIZE)
    expected = {loc * 512 + i for i in range(448 + 14)} | {rope_base + loc * 128 + i for i in range(128)}
    assert written_positions("v4_fp8_2buff", loc) == expected


def test_written_bytes_of_the_formats():
    # V4: 448 e4m3 + 64 bf16 rope dims + 7 UE8M0 scales; indexer fp8: 128 e4m3 + an fp32 scale;
    # fp4: 128 dims in 64 bytes + 4 UE8M0 scales; bf16 rows: 512 bf16.
    # V4.1: v41 512 e4m3 + 16 UE8M0; v41_fp4 512 dims in 256 bytes + 32 e4m3 scales; uniform fp8 512
    # e4m3; two pools 448 e4m3 + 7 exponents twice, and a 64-dim bf16 rope row.
    assert {f: geometry.written_bytes(f) for f in geometry.FORMATS} == {
        "v4_fp8": 448 + 2 * 64 + 7, "v4_bf16": 2 * 512, "indexer_fp8": 128 + 4, "indexer_fp4": 64 + 4,
        "v41": 512 + 16, "v41_fp4": 256 + 32, "uniform_fp8": 512, "v41_new": 512 + 16, "v41_fp4_new": 256 + 32,
        "v4_fp8_2buff": 448 + 14 + 128}


def test_windows_and_rows():
    assert [geometry.window_size(r) for r in geometry.RATIOS] == [8, 128]
    assert [geometry.row_width(512, r) for r in geometry.RATIOS] == [4 * 512, 2 * 512]
    assert (geometry.online_state_width(512), geometry.online_input_width(512)) == (3 * 512, 2 * 512)
    with pytest.raises(ValueError, match="compress_ratio must be 4 or 128, got 8"):
        geometry.check_ratio(8)


@pytest.mark.parametrize("head_dim, flags, fmt", [
    (512, {}, "v4_fp8"), (512, {"bf16_store": True}, "v4_bf16"), (128, {}, "indexer_fp8"),
    (128, {"use_fp4": True}, "indexer_fp4")])
def test_store_format_by_head_dim_and_flags(head_dim, flags, fmt):
    assert geometry.store_format(head_dim, **flags) == fmt
    assert geometry.format_head_dim(fmt) == head_dim


@pytest.mark.parametrize("head_dim, flags, message", [
    (512, {"use_fp4": True}, "use_fp4 needs the indexer head_dim 128, got head_dim 512"),
    (128, {"bf16_store": True}, "bf16_store needs head_dim 512, got head_dim 128"),
    (256, {"head_dim_arg": "head_dims"}, "head_dims must be 512 or 128, got 256")])
def test_store_format_rejects_what_no_format_stores(head_dim, flags, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        geometry.store_format(head_dim, **flags)
