"""dsv4jit.kv_layout against the facts of sglang 0.5.23's layouts (the tables written out here by hand)."""

from __future__ import annotations

import pytest

from dsv4jit.kv_layout import KVLayout, is_valid_kv_layout_pair

# value -> (data B, scale B, values per scale, page_align, encoding, interleaved)
FACTS = {
    "v4": (576, 8, 64, 576, "v4", False),
    "v41": (512, 16, 32, 512, "v41", False),
    "v41_fp4": (256, 32, 16, 256, "v41_fp4", False),
    "uniform_fp8": (512, 0, 512, 512, "uniform_fp8", False),
    "v41_new": (512, 16, 32, 528, "v41", True),
    "v41_fp4_new": (256, 32, 16, 288, "v41_fp4", True),
}

# page_bytes for P = 2, 64, 128, 256
PAGE_BYTES = {
    "v4": (1728, 37440, 74880, 149760),
    "v41": (1536, 33792, 67584, 135168),
    "v41_fp4": (768, 18432, 36864, 73728),
    "uniform_fp8": (1024, 32768, 65536, 131072),
    "v41_new": (1056, 33792, 67584, 135168),
    "v41_fp4_new": (576, 18432, 36864, 73728),
}


def test_the_six_layouts_with_sglangs_names_and_values():
    assert [(layout.name, layout.value) for layout in KVLayout] == [
        ("V4", "v4"), ("V41", "v41"), ("V41_FP4", "v41_fp4"), ("UNIFORM_FP8", "uniform_fp8"),
        ("V41_NEW", "v41_new"), ("V41_FP4_NEW", "v41_fp4_new")]
    assert KVLayout.V41 == "v41"  # a str


@pytest.mark.parametrize("value", FACTS)
def test_per_token_facts(value):
    layout = KVLayout(value)
    data, scale, tile, align, encoding, interleaved = FACTS[value]
    assert (layout.data_bytes, layout.scale_bytes, layout.tile_size, layout.page_align) == (data, scale, tile, align)
    assert layout.bytes_per_token == data + scale
    assert layout.encoding is KVLayout(encoding)
    assert layout.is_interleaved is interleaved
    assert layout.is_fp4 is (encoding == "v41_fp4")


@pytest.mark.parametrize("value", PAGE_BYTES)
def test_page_bytes_table(value):
    assert tuple(KVLayout(value).page_bytes(p) for p in (2, 64, 128, 256)) == PAGE_BYTES[value]


def test_cpp_names():
    assert [layout.cpp_name for layout in KVLayout] == ["kV4", "kV41", "kV41Fp4", "kUniformFp8", "kV41New",
                                                        "kV41Fp4New"]


def test_row_addressing_of_the_spec_example():
    """loc 641 at P = 128 is page 5, slot 1."""
    v41 = KVLayout.V41.row_addressing(128)
    assert (1 * v41[0], v41[1] + 1 * v41[2]) == (512, 65536 + 16)
    fp4_new = KVLayout.V41_FP4_NEW.row_addressing(128)
    assert (1 * fp4_new[0], fp4_new[1] + 1 * fp4_new[2]) == (288, 288 + 256)


def test_with_interleaved():
    assert KVLayout.V41.with_interleaved(True) is KVLayout.V41_NEW
    assert KVLayout.V41_NEW.with_interleaved(True) is KVLayout.V41_NEW
    assert KVLayout.V41_FP4_NEW.with_interleaved(False) is KVLayout.V41_FP4
    assert KVLayout.V41_FP4.with_interleaved(True) is KVLayout.V41_FP4_NEW
    assert KVLayout.V4.with_interleaved(False) is KVLayout.V4
    for layout in (KVLayout.V4, KVLayout.UNIFORM_FP8):
        with pytest.raises(ValueError, match="no interleaved arrangement"):
            layout.with_interleaved(True)


def test_parse():
    assert KVLayout.parse("V41") is KVLayout.V41
    assert KVLayout.parse("v41_Fp4_NEW") is KVLayout.V41_FP4_NEW
    assert KVLayout.parse(KVLayout.UNIFORM_FP8) is KVLayout.UNIFORM_FP8
    for bad in ("v5", "", "V41 ", 1, None, 4.1):
        with pytest.raises(ValueError) as err:
            KVLayout.parse(bad)
        assert str(err.value).startswith("layout must be")
        for value in FACTS:
            assert repr(value) in str(err.value)


@pytest.mark.parametrize("kv,extra,ok", [
    ("v4", "v4", True), ("v41", "v41", True), ("v41_fp4_new", "v41_fp4_new", True),
    ("v41", "v41_fp4", True), ("v41_new", "v41_fp4_new", True), ("V41", "V41_FP4", True),
    ("v41", "v41_fp4_new", False), ("v41_new", "v41_fp4", False), ("v41_fp4", "v41", False),
    ("v4", "v41_fp4", False), ("uniform_fp8", "v41_fp4", False), ("v41", "v41_new", False),
    ("v4", "v41", False),
])
def test_valid_layout_pairs(kv, extra, ok):
    assert is_valid_kv_layout_pair(kv, extra) is ok
