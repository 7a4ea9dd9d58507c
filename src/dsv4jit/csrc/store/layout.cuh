// Where the store puts a row: the byte layout of each cache format (Layout, Slot, slot_at) and how a
// row's channels are spread over the lanes that hold it (RowLanes).
//
// A row is held by kLanes lanes (a warp for the 512-dim latent rows, a block of 4 warps for the fp4
// layouts' rows in small batches; 4, 8 or 16 for the 128-dim indexer rows, so a warp keeps several
// rows' loads in flight). Lane j of a row holds 4-channel group g = 0, 1, ..: the channels
// 4(j + kLanes·g) .. +3, its "virtual lane" j + kLanes·g of the 32-lane layout (lane l, chunk k:
// channels 128k + 4l ..). Every global access is a coalesced 16-byte (or 4/8-byte packed) vector,
// the 64-dim scale tiles of the V4 layout are half-warps, the fp4 32-dim groups are 8 virtual
// lanes, and the rope dims are the trailing 16 virtual lanes.
#pragma once

#include <cstdint>

#include "common/warp.cuh"
#include "params.cuh"

namespace dsv4::store {

/// The cache formats: V4's latent (fp8, or bf16 rows) and indexer (fp8, fp4) formats, then the
/// DeepSeek-V4.1 layouts of a 512-dim latent (contract §10: KVLayout v41, v41_fp4, uniform_fp8 and the
/// interleaved v41_new, v41_fp4_new) and the V4 latent in two pools (fp8_2buff: e4m3 rows beside a
/// pool of bf16 rope rows).
enum class Format : int {
  kV4Fp8 = 0, kV4Bf16 = 1, kIndexerFp8 = 2, kIndexerFp4 = 3,
  kV41 = 4, kV41Fp4 = 5, kUniformFp8 = 6, kV41New = 7, kV41Fp4New = 8, kV4TwoPool = 9,
};

inline constexpr int kRopeDim = 64;

/// Byte layout of one format: page size in bytes and where a token's data and scales go.
///
///   block-split   page = P data rows, then P scale rows, padded to kPageAlign (V4, indexer, v41,
///                 v41_fp4, uniform_fp8)
///   interleaved   page = P tokens of kDataBytes + kScaleBytes each: data, then its scales (v41_new,
///                 v41_fp4_new; no padding)
///   two pools     token loc: a 512-byte row at loc·512 (448 e4m3 codes, the 7 exponents each written
///                 twice at 448 + 2t), and its 64 rope values as bf16 at rope_cache + loc·128
template <Format F>
struct Layout {
  static constexpr bool kIndexer = F == Format::kIndexerFp8 || F == Format::kIndexerFp4;
  static constexpr bool kV41 = F == Format::kV41 || F == Format::kV41Fp4 || F == Format::kUniformFp8 ||
                               F == Format::kV41New || F == Format::kV41Fp4New;
  static constexpr bool kFp4Values = F == Format::kV41Fp4 || F == Format::kV41Fp4New;  // e2m1, e4m3 scales
  static constexpr bool kInterleaved = F == Format::kV41New || F == Format::kV41Fp4New;
  static constexpr int kHeadDim = kIndexer ? 128 : 512;
  static constexpr int kChunks = kHeadDim / 128;
  static constexpr int kRopeLane = (kHeadDim - kRopeDim) / 4;  // first virtual lane of the rope dims
  // bytes per token of the data rows (the region before the scale rows of a page)
  static constexpr int kDataBytes = F == Format::kV4Fp8 ? 576 : F == Format::kV4Bf16 ? 1024
                                    : F == Format::kIndexerFp8 ? 128 : F == Format::kIndexerFp4 ? 64
                                    : kFp4Values ? 256 : 512;
  static constexpr int kScaleBytes = F == Format::kV4Fp8 ? 8 : F == Format::kV4Bf16 ? 0 : kIndexer ? 4
                                     : kFp4Values ? 32 : F == Format::kV41 || F == Format::kV41New ? 16 : 0;
  static constexpr int kTokenBytes = kDataBytes + kScaleBytes;
  // the unit a page is padded to: V4 pages to 576 B, V4.1 block-split pages to their data row
  static constexpr int kPageAlign = F == Format::kV4Fp8 ? 576 : kInterleaved ? kTokenBytes
                                    : kV41 ? kDataBytes : kTokenBytes;

  static int64_t page_bytes(int64_t page_size) {
    return (kTokenBytes * page_size + kPageAlign - 1) / kPageAlign * kPageAlign;
  }
};

/// Lanes of a row held by a block of warps, one per 128-channel chunk of a 512-dim latent row: thread
/// t holds virtual lane t alone (lane t % 32 of chunk t / 32), so each thread's chain is a quarter of
/// a warp row's (small batches, where that chain is the kernel's time).
inline constexpr int kBlockRowLanes = 4 * kWarpSize;

/// A row held by kLanes lanes (see the top of the file).
template <int kLanes>
struct RowLanes {
  static_assert(kLanes == 4 || kLanes == 8 || kLanes == 16 || kLanes == kWarpSize || kLanes == kBlockRowLanes,
                "4, 8, 16 or 32 lanes a row, or a block of 4 warps");
  // a lane's 4-channel groups within one 128-channel chunk
  static constexpr int kSpan = kLanes <= kWarpSize ? kWarpSize / kLanes : 1;
  // fp4 (indexer rows): the 32-dim groups (8 virtual lanes) a lane holds values of, and how many of
  // its 4-channel groups fall in each (two neighbouring ones on 4 lanes)
  static constexpr int kFp4Groups = kSpan < 4 ? kSpan : 4;
  static constexpr int kFold = kSpan / kFp4Groups;

  /// The virtual lane of lane j's group g.
  static constexpr int vlane(int j, int g) { return j + kLanes * g; }
};

/// Where a token's bytes go in its page: the data row and the scale row (and, in two pools, the row
/// of the rope pool).
struct Slot {
  uint8_t* data;
  uint8_t* scales;
  uint8_t* rope = nullptr;
};

template <Format F>
DSV4_DEV Slot slot_at(const Params& p, int64_t loc) {
  using L = Layout<F>;
  if constexpr (F == Format::kV4TwoPool) {
    uint8_t* row = p.cache + loc * L::kDataBytes;  // pages of page_size 512-byte rows: no padding
    return {row, row + 448, p.rope_cache + loc * 2 * kRopeDim};
  } else if constexpr (L::kInterleaved) {
    uint8_t* token = p.cache + (loc >> p.log2_page_size) * p.page_bytes +
                     (loc & ((int64_t{1} << p.log2_page_size) - 1)) * L::kTokenBytes;
    return {token, token + L::kDataBytes};
  } else if constexpr (L::kIndexer) {
    // Unpadded pages: a page starts at its first location times the token bytes, so the data
    // row is at loc·kD + first·kS and the scale row at loc·kS + first·kD + kD·page_size (no
    // 64-bit multiply by the page bytes: faster, docs/design-notes.md).
    const int64_t first = loc & ~((int64_t{1} << p.log2_page_size) - 1);
    return {p.cache + loc * L::kDataBytes + first * L::kScaleBytes,
            p.cache + loc * L::kScaleBytes + first * L::kDataBytes + (int64_t{L::kDataBytes} << p.log2_page_size)};
  }
  uint8_t* page = p.cache + (loc >> p.log2_page_size) * p.page_bytes;
  const int64_t slot = loc & ((int64_t{1} << p.log2_page_size) - 1);
  return {page + slot * L::kDataBytes, page + (int64_t{L::kDataBytes} << p.log2_page_size) + slot * L::kScaleBytes};
}

}  // namespace dsv4::store
