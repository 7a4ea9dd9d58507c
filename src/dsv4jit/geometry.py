"""Geometry of the compressor, in one place for Python: compress ratios, windows, state and input
row widths, and the store formats with their byte layout (contract §1.2, contract §4, contract §5.1,
contract §6.5 and the format sections after it).

The ops, the references, warmup and the benchmarks read these; the kernels hold the same numbers
as template constants (``compress/ring.cuh``'s ``Window``, ``store/store.cuh``'s ``Layout``). Pure Python:
importing it costs nothing.
"""

from __future__ import annotations

from .errors import ArgumentError


#: The compress ratios R: c4 (overlapping 8-token windows) and c128.
RATIOS = (4, 128)
#: Tokens of one online c128 chunk: the running state restarts every CHUNK positions.
CHUNK = 128
#: Dims RoPE rotates: the last ROPE_DIM of each compressed row, as ROPE_DIM / 2 (cos, sin) pairs.
ROPE_DIM = 64

#: Cache formats of compress_norm_rope_store, in the kernels' enum order (store::Format): V4's latent
#: and indexer formats, then a DeepSeek-V4.1 layout's (contract §10: named as its KVLayout) and the V4
#: latent in two pools (fp8_2buff).
FORMATS = ("v4_fp8", "v4_bf16", "indexer_fp8", "indexer_fp4", "v41", "v41_fp4", "uniform_fp8", "v41_new", "v41_fp4_new",
           "v4_fp8_2buff")
#: The formats of a 512-dim latent row in a V4.1 layout.
V41_FORMATS = FORMATS[4:9]

V4_HEAD_DIM = 512
V4_NOPE_DIM = 448             # dims 0..447: e4m3; dims 448..511: bf16 rope
V4_TILE = 64                  # one UE8M0 scale per 64 nope dims -> 7 scales
V4_DATA_BYTES = 576           # 448 e4m3 + 64 bf16
V4_SCALE_BYTES = 8            # 7 exponents + 1 padding byte that is never written
BF16_TOKEN_BYTES = 2 * V4_HEAD_DIM

INDEXER_HEAD_DIM = 128
INDEXER_FP8_DATA_BYTES = 128
INDEXER_FP8_SCALE_BYTES = 4   # one little-endian fp32
INDEXER_FP4_DATA_BYTES = 64   # two dims per byte, even dim in the low nibble
INDEXER_FP4_GROUP = 32        # one UE8M0 scale per 32 dims -> 4 scale bytes
INDEXER_FP4_SCALE_BYTES = INDEXER_HEAD_DIM // INDEXER_FP4_GROUP


def check_ratio(compress_ratio: int) -> None:
    if compress_ratio not in RATIOS:
        raise ArgumentError(f"compress_ratio must be 4 or 128, got {compress_ratio}")


def window_size(compress_ratio: int) -> int:
    """Wn: 8 for c4 (overlapping windows of two 4-token blocks), 128 for c128."""
    return 2 * compress_ratio if compress_ratio == 4 else compress_ratio


def row_width(head_dim: int, compress_ratio: int) -> int:
    """Values per state/input row of the ring compressor: kv_ov | kv | sc_ov | sc (c4, 4·hd) or
    kv | sc (c128, 2·hd)."""
    return (4 if compress_ratio == 4 else 2) * head_dim


def head_dim_multiple(compress_ratio: int) -> int:
    """What head_dim must be a multiple of: the kernels' channel tiling (contract §8.3)."""
    return 128 if compress_ratio == 4 else 64


def online_state_width(head_dim: int) -> int:
    """Values per online state row: m | s | k (contract §5.1)."""
    return 3 * head_dim


def online_input_width(head_dim: int) -> int:
    """Values per online input row: kv | score."""
    return 2 * head_dim


def store_format(head_dim: int, *, use_fp4: bool = False, bf16_store: bool = False, layout: str = "v4",
                 fp8_2buff: bool = False, head_dim_arg: str = "head_dim") -> str:
    """The cache format the options select for rows of `head_dim` (contract §6.5, contract §10.3): 512 the
    V4 latent (fp8, bf16 rows, or two pools), 128 the indexer, or a DeepSeek-V4.1 layout (`layout`, a
    KVLayout value other than "v4": 512-dim rows and none of the V4 options). `head_dim_arg` says
    where head_dim came from, for the message."""
    if layout != "v4":
        if head_dim != V4_HEAD_DIM:
            raise ArgumentError(f"layout is {layout!r}, which stores 512-dim latent rows, "
                                f"got {head_dim_arg} {head_dim}")
        for name, on in (("use_fp4", use_fp4), ("bf16_store", bf16_store), ("fp8_2buff", fp8_2buff)):
            if on:
                raise ArgumentError(f"{name} is an option of the v4 layout, got layout {layout!r}")
        return layout
    if head_dim == V4_HEAD_DIM:
        if use_fp4:
            raise ArgumentError("use_fp4 needs the indexer head_dim 128, got head_dim 512")
        if fp8_2buff and bf16_store:
            raise ArgumentError("fp8_2buff stores fp8 rows, not bf16_store's")
        return "v4_fp8_2buff" if fp8_2buff else "v4_bf16" if bf16_store else "v4_fp8"
    if head_dim == INDEXER_HEAD_DIM:
        for name, on in (("bf16_store", bf16_store), ("fp8_2buff", fp8_2buff)):
            if on:
                raise ArgumentError(f"{name} needs head_dim 512, got head_dim 128")
        return "indexer_fp4" if use_fp4 else "indexer_fp8"
    raise ArgumentError(f"{head_dim_arg} must be 512 or 128, got {head_dim}")


def format_options(fmt: str) -> dict:
    """The store options that select format `fmt` (store_format's inverse): use_fp4, bf16_store,
    layout, fp8_2buff."""
    _check_format(fmt)
    return {"use_fp4": fmt == "indexer_fp4", "bf16_store": fmt == "v4_bf16",
            "layout": fmt if fmt in V41_FORMATS else "v4", "fp8_2buff": fmt == "v4_fp8_2buff"}


def format_head_dim(fmt: str) -> int:
    """The head_dim of the rows a format stores."""
    return INDEXER_HEAD_DIM if fmt.startswith("indexer") else V4_HEAD_DIM


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ArgumentError(f"unknown store format {fmt!r}; expected one of {FORMATS}")


#: (data bytes, scale bytes, page alignment) of a token of each format: a page holds page_size data
#: rows, then their scale rows (the interleaved V4.1 layouts: each token's data, then its scales),
#: padded to whole multiples of the alignment; two pools: 512-byte rows (448 e4m3 codes, the 7
#: exponents twice, 50 bytes unwritten) beside a pool of 128-byte bf16 rope rows.
_TOKEN_LAYOUT = {
    "v4_fp8": (V4_DATA_BYTES, V4_SCALE_BYTES, V4_DATA_BYTES), "v4_bf16": (BF16_TOKEN_BYTES, 0, BF16_TOKEN_BYTES),
    "indexer_fp8": (INDEXER_FP8_DATA_BYTES, INDEXER_FP8_SCALE_BYTES, INDEXER_FP8_DATA_BYTES + INDEXER_FP8_SCALE_BYTES),
    "indexer_fp4": (INDEXER_FP4_DATA_BYTES, INDEXER_FP4_SCALE_BYTES, INDEXER_FP4_DATA_BYTES + INDEXER_FP4_SCALE_BYTES),
    "v41": (512, 16, 512), "v41_fp4": (256, 32, 256), "uniform_fp8": (512, 0, 512), "v41_new": (512, 16, 528),
    "v41_fp4_new": (256, 32, 288), "v4_fp8_2buff": (512, 0, 512),
}
#: Bytes of a two-pool format's rope row: the 64 rope dims as bf16.
ROPE_ROW_BYTES = 2 * ROPE_DIM


def token_bytes(fmt: str) -> tuple[int, int]:
    """(data bytes, scale bytes) one token occupies in a page of format `fmt`."""
    _check_format(fmt)
    return _TOKEN_LAYOUT[fmt][:2]


def written_bytes(fmt: str) -> int:
    """Cache bytes the store writes per stored token (the V4 scale row's padding byte is never written;
    two pools: 462 bytes of the row and the rope row)."""
    data, scales = token_bytes(fmt)
    if fmt == "v4_fp8_2buff":
        return V4_NOPE_DIM + 2 * (V4_NOPE_DIM // V4_TILE) + ROPE_ROW_BYTES
    return data + (V4_NOPE_DIM // V4_TILE if fmt == "v4_fp8" else scales)


def check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
        raise ArgumentError(f"page_size must be a power of two >= 1, got {page_size!r}")


def page_bytes(fmt: str, page_size: int) -> int:
    """Bytes of one cache page (= row stride of the 2-D cache view) for a store format: its tokens'
    bytes, padded to whole multiples of the format's alignment (V4 fp8 pages to 576-byte rows)."""
    check_page_size(page_size)
    data, scales = token_bytes(fmt)
    align = _TOKEN_LAYOUT[fmt][2]
    return -(-(data + scales) * page_size // align) * align
