"""dsv4jit.geometry against independent facts: the bytes the reference writers touch, the window
and row layouts of the contract, and the format rules the ops and the references share."""

from __future__ import annotations

import pytest
import torch

from dsv4jit import geometry
from dsv4jit.reference import store

PAGE_SIZE = 4


def written_positions(fmt: str, loc: int) -> set[int]:
    """Flat cache positions the reference writer changes for one token at `loc`: a byte it writes
    differs from at least one of two poisons, whatever value it writes."""
    values = torch.randn(1, geometry.format_head_dim(fmt), generator=torch.Generator().manual_seed(3))
    changed = set()
    for poison in (0x00, 0xFF):
        cache = torch.full((2, geometry.page_bytes(fmt, PAGE_SIZE)), poison, dtype=torch.uint8)
        store.WRITERS[fmt](cache, torch.tensor([loc]), values, PAGE_SIZE)
        changed |= set(torch.nonzero(cache.flatten() != poison).flatten().tolist())
    return changed


@pytest.mark.parametrize("fmt", geometry.FORMATS)
def test_written_bytes_are_what_the_writer_touches(fmt):
    assert len(written_positions(fmt, PAGE_SIZE + 1)) == geometry.written_bytes(fmt)


@pytest.mark.parametrize("fmt", geometry.FORMATS)
def test_a_token_lies_in_its_data_row_and_scale_row(fmt):
    """Token `slot` of a page: data at slot·data bytes, scales after the page's data rows (contract §6.5)."""
    data, scales = geometry.token_bytes(fmt)
    slot = 3
    page = geometry.page_bytes(fmt, PAGE_SIZE)
    expected = {page + slot * data + i for i in range(data)}
    expected |= {page + PAGE_SIZE * data + slot * scales + i for i in range(scales)}
    assert written_positions(fmt, PAGE_SIZE + slot) <= expected
    assert page >= PAGE_SIZE * (data + scales)


def test_written_bytes_of_the_formats():
    # V4: 448 e4m3 + 64 bf16 rope dims + 7 UE8M0 scales; indexer fp8: 128 e4m3 + an fp32 scale;
    # fp4: 128 dims in 64 bytes + 4 UE8M0 scales; bf16 rows: 512 bf16.
    assert {f: geometry.written_bytes(f) for f in geometry.FORMATS} == {
        "v4_fp8": 448 + 2 * 64 + 7, "v4_bf16": 2 * 512, "indexer_fp8": 128 + 4, "indexer_fp4": 64 + 4}


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
