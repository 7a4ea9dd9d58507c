// compress_norm_rope_store (contract §6): RMSNorm -> RoPE on the trailing 64 dims (interleaved pairs,
// position seq_len - R) -> 128-point Hadamard (indexer) -> quantize -> paged cache store.
//
// A row is held by kLanes lanes (a warp for the 512-dim V4 rows; 4, 8 or 16 for the 128-dim
// indexer rows, so a warp keeps several rows' loads in flight). Lane j of a row holds 4-channel group
// g = 0, 1, ..: the channels 4(j + kLanes·g) .. +3, its "virtual lane" j + kLanes·g of the
// 32-lane layout (lane l, chunk k: channels 128k + 4l ..). Every global access is a coalesced
// 16-byte (or 4/8-byte packed) vector, the 64-dim scale tiles of the V4 layout are half-warps, the
// fp4 32-dim groups are 8 virtual lanes, and the rope dims are the trailing 16 virtual lanes.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/plan_structs.h"
#include "common/quant.cuh"
#include "common/status.cuh"
#include "common/tensor_check.h"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"

namespace dsv4::store {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

enum class Format : int { kV4Fp8 = 0, kV4Bf16 = 1, kIndexerFp8 = 2, kIndexerFp4 = 3 };

enum StatusBit : int32_t {
  kLocOutOfRange = 1,       // out_loc entry outside the cache
  kPositionOutOfRange = 2,  // seq_len - R outside the freq table
  kRaggedOutOfRange = 4,    // prefill ragged id beyond out_loc
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kLocOutOfRange, "an out_loc entry of a stored row lies outside kvcache"},
                            {kPositionOutOfRange, "a rope position (seq_len - compress_ratio) lies outside freq_cis"},
                            {kRaggedOutOfRange, "a plan row's ragged id lies beyond out_loc"}});
}

inline constexpr int kRopeDim = 64;

/// Byte layout of one format: page size in bytes and where a token's data and scales go.
template <Format F>
struct Layout {
  static constexpr bool kIndexer = F == Format::kIndexerFp8 || F == Format::kIndexerFp4;
  static constexpr int kHeadDim = kIndexer ? 128 : 512;
  static constexpr int kChunks = kHeadDim / 128;
  // bytes per token of the data rows (the region before the scale rows of a page)
  static constexpr int kDataBytes = F == Format::kV4Fp8 ? 576 : F == Format::kV4Bf16 ? 1024
                                    : F == Format::kIndexerFp8 ? 128 : 64;
  static constexpr int kScaleBytes = F == Format::kV4Fp8 ? 8 : F == Format::kV4Bf16 ? 0 : 4;

  static int64_t page_bytes(int64_t page_size) {
    const int64_t raw = (kDataBytes + kScaleBytes) * page_size;
    return F == Format::kV4Fp8 ? (raw + 575) / 576 * 576 : raw;  // V4 pages are padded to 576 B
  }
};

struct Params {
  const void* kv;           // [rows, hd] DType
  const void* plan;         // CompressPlan (prefill) or DecodePlan rows
  const void* norm_weight;  // [hd] DType
  const float* freq;        // [max_pos, 64]: (cos, sin) interleaved per pair
  const void* out_loc;      // int32 or int64
  uint8_t* cache;           // [num_pages, page_bytes]
  int32_t* status;
  int64_t page_bytes;
  int64_t num_locs;         // pages * page_size
  int64_t out_loc_len;
  int64_t max_pos;
  uint32_t rows;
  int32_t log2_page_size;
  int32_t ratio;
  float eps;
  bool loc64;
  bool is_decode;
};

/// kLanes: lanes per row.
template <typename DType, Format F, bool kPDL, int kLanes = kWarpSize>
struct Kernel {
  using L = Layout<F>;
  static_assert(kLanes == kWarpSize || (L::kIndexer && (kLanes == 4 || kLanes == 8 || kLanes == 16)),
                "V4 rows take a warp (64-dim scale tiles are half-warps); indexer rows 4, 8 or 16 lanes");
  // Large batches: 8-lane rows in blocks of 8 warps (at 16 384 rows 0.05-0.1 us faster than 4 warps,
  // and than 16 for fp8 and fp4 decode); 4-lane rows in blocks of 4 (0.15-0.5 us faster than 2, 3,
  // 5, 6 or 8 warps).
  static constexpr int kWarps = kLanes == 8 ? 8 : 4;
  // Rows on 16 or 32 lanes (indexer batches up to 2048 rows, V4 rows) let the next kernel launch as
  // soon as this one has waited for its own predecessor: its blocks take free slots and wait there
  // (indexer 16 and 256 rows 0.04-0.3 us faster). The 4- and 8-lane kernels (large indexer batches)
  // let it launch before their writes: launched early, the next kernel's blocks and table copies
  // made fp4 at 16 384 rows 10 % slower.
  static constexpr bool kEarlyDependents = kLanes >= 16;
  // fp4 rows on 8 lanes or fewer (large batches) code by table (Fp4CodeTable) in shared memory,
  // several instructions a value fewer than fp4_code() once the table is in (copying it in costs a
  // round trip, measured 0.2 us more than fp4_code() for 16 rows)
  static constexpr bool kFp4Table = F == Format::kIndexerFp4 && kLanes <= 8;
  static constexpr int C = L::kChunks;
  static constexpr int kRowsPerBlock = kWarps * kWarpSize / kLanes;
  static constexpr int kGroups = L::kHeadDim / (4 * kLanes);      // 4-channel groups per lane
  static constexpr int kSpan = kWarpSize / kLanes;                // of them within one 128-channel chunk
  // fp4 (indexer rows): the 32-dim groups (8 virtual lanes) a lane holds values of, and how many of
  // its 4-channel groups fall in each (two neighbouring ones on 4 lanes)
  static constexpr int kFp4Groups = kSpan < 4 ? kSpan : 4;
  static constexpr int kFold = kSpan / kFp4Groups;
  static constexpr int kRopeLane = (L::kHeadDim - kRopeDim) / 4;  // first virtual lane of the rope dims

  /// fp4_code() as a codec argument (the alternative to the table; stateless).
  struct Fp4ByRule {
    DSV4_DEV void fill() {}
    DSV4_DEV void wait() const {}
    DSV4_DEV uint32_t pair(float lo, float hi) const { return fp4_code_pair(lo, hi); }
  };

  /// The fp4 code table as a codec argument: the warp's own copy in shared memory, filled by
  /// cp.async when the warp starts (fill()) and waited for when it first codes (wait()), so the row
  /// loads go out at once and no block barrier holds warps back (a block's copy behind a barrier
  /// measured 0.1 us slower at 16 384 rows).
  struct Fp4WarpTable {
    Fp4CodeTable table;

    DSV4_DEV void fill() {
      constexpr int kPieces = sizeof(Fp4CodeTable) / (16 * kWarpSize);  // 16-byte pieces per lane
      static_assert(kPieces * 16 * kWarpSize == sizeof(Fp4CodeTable), "whole pieces");
      const int lane = threadIdx.x % kWarpSize;
#pragma unroll
      for (int i = 0; i < kPieces; ++i) {
        cp_async<16>(table.code + 16 * (lane + kWarpSize * i), kFp4Codes.code + 16 * (lane + kWarpSize * i));
      }
    }
    DSV4_DEV void wait() const {
      cp_async_wait_all();  // this lane's pieces, then the warp's
      __syncwarp();
    }
    DSV4_DEV uint32_t pair(float lo, float hi) const { return table.pair(lo, hi); }
  };

  /// The virtual lane of lane j's group g (see the top of the file).
  static constexpr int vlane(int j, int g) { return j + kLanes * g; }

  /// Whether group g of some lane holds rope dims.
  static constexpr bool may_rope(int g) { return vlane(kLanes - 1, g) >= kRopeLane; }

  /// A row's violations are reported by its first lane.
  static DSV4_DEV void report(const Params& p, int32_t bit) {
    if (threadIdx.x % kLanes == 0) report_status(p, bit);
  }

  static DSV4_DEV int64_t load_loc(const Params& p, int64_t i) {
    return p.loc64 ? static_cast<const int64_t*>(p.out_loc)[i] : static_cast<const int32_t*>(p.out_loc)[i];
  }

  /// The plan side of which rows are stored: whether `row` is, its rope position and its cache
  /// location. The location load is only issued here (first used by check()), so callers can
  /// overlap it.
  static DSV4_DEV bool select(const Params& p, uint32_t row, int64_t& loc, int64_t& position) {
    uint32_t seq_len;
    if (p.is_decode) {
      seq_len = static_cast<const DecodePlan*>(p.plan)[row].seq_len;
      loc = load_loc(p, row);  // decode locations do not depend on the plan: load in parallel
      if ((seq_len & (p.ratio - 1)) != 0) return false;  // no compress event this step (R: 4 or 128)
    } else {
      const CompressPlan c = load_row(static_cast<const CompressPlan*>(p.plan), row);
      if (c.is_invalid()) return false;
      if (c.ragged_id >= p.out_loc_len) {
        report(p, kRaggedOutOfRange);
        return false;
      }
      seq_len = c.seq_len;
      loc = load_loc(p, c.ragged_id);  // out_loc is indexed by ragged token id in prefill
    }
    position = int64_t{seq_len} - p.ratio;
    return true;
  }

  static DSV4_DEV bool position_ok(const Params& p, int64_t position) { return position >= 0 && position < p.max_pos; }

  /// False (and reported) when the location or the rope position lies outside the cache or the
  /// freq table: the row is skipped, nothing is written out of bounds.
  static DSV4_DEV bool check(const Params& p, int64_t loc, int64_t position) {
    const int32_t bad = static_cast<uint64_t>(loc) >= static_cast<uint64_t>(p.num_locs) ? kLocOutOfRange
                        : !position_ok(p, position)                                     ? kPositionOutOfRange
                                                                                        : 0;
    if (bad != 0) report(p, bad);
    return bad == 0;
  }

  /// Where a token's bytes go in its page: the data row and the scale row.
  struct Slot {
    uint8_t* data;
    uint8_t* scales;
  };

  static DSV4_DEV Slot slot_at(const Params& p, int64_t loc) {
    if constexpr (L::kIndexer) {
      // Unpadded pages: a page starts at its first location times the token bytes, so the data
      // row is at loc·kD + first·kS and the scale row at loc·kS + first·kD + kD·page_size (no
      // 64-bit multiply by the page bytes: 1-2 % faster at 16 384 rows).
      const int64_t first = loc & ~((int64_t{1} << p.log2_page_size) - 1);
      return {p.cache + loc * L::kDataBytes + first * L::kScaleBytes,
              p.cache + loc * L::kScaleBytes + first * L::kDataBytes + (int64_t{L::kDataBytes} << p.log2_page_size)};
    }
    uint8_t* page = p.cache + (loc >> p.log2_page_size) * p.page_bytes;
    const int64_t slot = loc & ((int64_t{1} << p.log2_page_size) - 1);
    return {page + slot * L::kDataBytes, page + (int64_t{L::kDataBytes} << p.log2_page_size) + slot * L::kScaleBytes};
  }

  static DSV4_DEV void run(const Params& p) {
    __shared__ std::conditional_t<kFp4Table, Fp4WarpTable, Fp4ByRule> fp4_codecs[kFp4Table ? kWarps : 1];
    auto& fp4 = fp4_codecs[kFp4Table ? threadIdx.x / kWarpSize : 0];
    fp4.fill();
    store_row(p, fp4);
    fp4.wait();  // no copy lands after its warp has left, also when the warp coded nothing
  }

  /// This thread's part of its row: lane threadIdx.x % kLanes of row blockIdx.x·kRowsPerBlock +
  /// threadIdx.x / kLanes (`fp4`: the e2m1 codec).
  template <typename Fp4Codec>
  static DSV4_DEV void store_row(const Params& p, const Fp4Codec& fp4) {
    const int j = threadIdx.x % kLanes;
    const uint32_t row = blockIdx.x * kRowsPerBlock + threadIdx.x / kLanes;
    pdl_wait_upstream<kPDL>();
    if constexpr (kEarlyDependents) pdl_launch_dependents<kPDL>();
    // The row and the weight do not depend on the plan: their loads go out first, in parallel
    // with the plan -> out_loc -> rope-table chain. Whole warps stay together to the end (their
    // reductions shuffle over the full mask): a row that is not stored runs along (rows past the
    // end on the last one) and skips its stores.
    const DType* x_row = static_cast<const DType*>(p.kv) + uint64_t{min(row, p.rows - 1)} * L::kHeadDim;
    const DType* w_row = static_cast<const DType*>(p.norm_weight);
    Vec<DType, 4> xv[kGroups], wv[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      xv[g] = load_vec<4>(x_row + 4 * vlane(j, g));
      wv[g] = load_vec<4>(w_row + 4 * vlane(j, g));
    }
    // The location and the rope-table row depend on the plan row only: both loads go out as soon
    // as it is in, and the RMS scale runs while they are in flight.
    int64_t loc = 0, position = 0;
    const bool selected = row < p.rows && select(p, row, loc, position);
    if (!__any_sync(kFullMask, selected)) return;
    float f[kGroups][4] = {};
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int v = vlane(j, g);
      if (may_rope(g) && v >= kRopeLane && selected && position_ok(p, position)) {
        const Vec<float, 4> fv = load_vec<4>(p.freq + position * kRopeDim + 4 * (v - kRopeLane));
#pragma unroll
        for (int c = 0; c < 4; ++c) f[g][c] = fv[c];
      }
    }
    float x[kGroups][4], w[kGroups][4];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int c = 0; c < 4; ++c) x[g][c] = to_f32(xv[g][c]), w[g][c] = to_f32(wv[g][c]);
    }
    const float r = rms_scale(p, sum_squares(x));
#pragma unroll
    for (int g = 0; g < kGroups; ++g) normalize_group(vlane(j, g), x[g], w[g], r, f[g]);
    // Only the writes need the location: the check waits for it last.
    if constexpr (L::kIndexer) {
      const IndexerCodes codes = encode_indexer(x, j, fp4);
      const bool stored = selected && check(p, loc, position);
      if (!__any_sync(kFullMask, stored)) return;
      if constexpr (!kEarlyDependents) pdl_launch_dependents<kPDL>();
      if (stored) write_indexer(slot_at(p, loc), j, codes);
    } else {
      V4Dims<4> encoded[kGroups];
#pragma unroll
      for (int g = 0; g < kGroups; ++g) encoded[g] = encode_v4<true>(128 * g + 4 * j, x[g]);
      if (!check(p, loc, position)) return;  // a row per warp: selected, as the warp is still here
      if constexpr (!kEarlyDependents) pdl_launch_dependents<kPDL>();
      const Slot slot = slot_at(p, loc);
#pragma unroll
      for (int g = 0; g < kGroups; ++g) write_v4(slot, 128 * g + 4 * j, encoded[g]);
    }
  }

  // The sum of squares of a row has one canonical order, shared by every path that stores rows
  // (so they agree bit for bit), defined on the 32-lane layout (lane l holds channels
  // 128k + 4l .. +3 of chunk k): each chunk's 4 channels chain their squares (fma, channel order),
  // a lane adds its chunks' partials in chunk order, and the 32 lanes add by a butterfly
  // (distances 16 .. 1). A row held by fewer lanes runs the butterfly's larger distances inside
  // the thread (the sums are commutative, so both sides of a pair agree).

  /// A lane's partial of chunk k: its 4 channels' squares, chained.
  static DSV4_DEV float chunk_partial(const float (&xk)[4]) {
    float q = 0.0f;
#pragma unroll
    for (int c = 0; c < 4; ++c) q = __fmaf_rn(xk[c], xk[c], q);
    return q;
  }

  /// The row's sum of squares from its lanes' sums of chunk partials: `t[w]` is this lane's sum
  /// for virtual lane j + kLanes·w of the 32-lane layout.
  static DSV4_DEV float row_sum(float (&t)[kSpan]) {
#pragma unroll
    for (int m = kSpan / 2; m > 0; m /= 2) {  // distances 16 .. kLanes: inside the thread
#pragma unroll
      for (int w = 0; w < kSpan; ++w) {
        if (!(w & m)) t[w] = t[w | m] = __fadd_rn(t[w], t[w | m]);
      }
    }
    float s = t[0];
#pragma unroll
    for (int m = kLanes / 2; m > 0; m /= 2) s = __fadd_rn(s, __shfl_xor_sync(kFullMask, s, m));
    return s;
  }

  /// A row held by a warp: each lane's sum of its chunk partials.
  static DSV4_DEV float row_sum(float lane_sum) {
    static_assert(kLanes == kWarpSize, "rows held by a warp");
    float t[1] = {lane_sum};
    return row_sum(t);
  }

  /// The row's sum of squares from the groups of a row of `kLanes` lanes.
  template <int G>
  static DSV4_DEV float sum_squares(const float (&x)[G][4]) {
    float t[kSpan];
#pragma unroll
    for (int w = 0; w < kSpan; ++w) {
      t[w] = chunk_partial(x[w]);  // never -0, so the same as 0 + it
#pragma unroll
      for (int k = 1; k < G / kSpan; ++k) t[w] = __fadd_rn(t[w], chunk_partial(x[k * kSpan + w]));
    }
    return row_sum(t);
  }

  static DSV4_DEV float rms_scale(const Params& p, float sum_squares) {
    return 1.0f / sqrtf(__fadd_rn(sum_squares / L::kHeadDim, p.eps));
  }

  /// RoPE of one interleaved (re, im) pair.
  static DSV4_DEV void rotate(float& re, float& im, float cs, float sn) {
    const float a = re, b = im;
    re = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    im = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
  }

  /// Normalizes the 4 channels of virtual lane v (channels 4v .. +3) with the row's RMS scale `r`
  /// and rotates them if they are rope dims (`freq`: their (cos, sin) pairs).
  static DSV4_DEV void normalize_group(int v, float (&x)[4], const float (&w)[4], float r, const float (&freq)[4]) {
    // RMSNorm, in the reference's order: y = (x * r) * w, without fused multiply-adds.
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = __fmul_rn(__fmul_rn(x[c], r), w[c]);
    if (v >= kRopeLane) {  // the trailing 64 dims: interleaved (re, im) pairs
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) rotate(x[2 * pair], x[2 * pair + 1], freq[2 * pair], freq[2 * pair + 1]);
    }
  }

  /// Quantizes a normalized chunk k of the 32-lane layout and stores it (with its scales) in `slot`.
  static DSV4_DEV void store_chunk(const Slot& slot, int k, float (&x)[4], int lane) {
    static_assert(kLanes == kWarpSize, "rows held by a warp");
    if constexpr (L::kIndexer) {
      float(&v)[1][4] = reinterpret_cast<float(&)[1][4]>(x);
      write_indexer(slot, lane, encode_indexer(v, lane, Fp4ByRule{}));
    } else {
      write_v4(slot, 128 * k + 4 * lane, encode_v4(128 * k + 4 * lane, x));
    }
  }

  /// N consecutive dims of a normalized V4 row as stored: bf16, and for the V4 latent's dims
  /// without rope their e4m3 codes and the tile's UE8M0 exponent.
  template <int N>
  struct V4Dims {
    Vec<bf16_t, N> bf16;
    uint32_t codes;
    int e;
  };

  /// Encodes N consecutive dims (from `dim`) of a normalized V4 row, N per lane over a warp, so a
  /// 64-dim tile spans 64 / N lanes (every lane joins the tile's reduction): bf16_store and the
  /// rope dims as bf16; the others as e4m3 of the bf16-rounded values with one UE8M0 scale per tile.
  template <bool kExponentByBits = false, int N>
  static DSV4_DEV V4Dims<N> encode_v4(int dim, const float (&x)[N]) {
    static_assert(N % 2 == 0, "pairs of dims");
    V4Dims<N> out{};
#pragma unroll
    for (int c = 0; c < N; c += 2) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(x[c], x[c + 1]);
      out.bf16[c] = pair.x, out.bf16[c + 1] = pair.y;
    }
    if constexpr (F == Format::kV4Fp8) {
      float q[N], amax = 0.0f;
#pragma unroll
      for (int c = 0; c < N; ++c) q[c] = __bfloat162float(out.bf16[c]), amax = fmaxf(amax, fabsf(q[c]));
      out.e = v4_exponent<kExponentByBits>(reduce_amax(amax, 64 / N));
      const float inv = exp2_int(127 - out.e);
#pragma unroll
      for (int c = 0; c < N; c += 2) out.codes |= uint32_t{e4m3x2_codes(q[c] * inv, q[c + 1] * inv)} << (8 * c);
    }
    return out;
  }

  /// Writes what encode_v4 made of the dims from `dim` into `slot`.
  template <int N>
  static DSV4_DEV void write_v4(const Slot& slot, int dim, const V4Dims<N>& d) {
    constexpr int kNope = L::kHeadDim - kRopeDim;
    if constexpr (F == Format::kV4Bf16) {
      store_vec(reinterpret_cast<bf16_t*>(slot.data) + dim, d.bf16);
    } else if (dim >= kNope) {
      store_vec(reinterpret_cast<bf16_t*>(slot.data + kNope) + (dim - kNope), d.bf16);
    } else {
      using Codes = std::conditional_t<N == 4, uint32_t, uint16_t>;
      *reinterpret_cast<Codes*>(slot.data + dim) = static_cast<Codes>(d.codes);
      if (dim % 64 == 0) slot.scales[dim / 64] = static_cast<uint8_t>(d.e);
    }
  }

  /// An indexer row as stored, per lane: the codes of its groups (fp8: 4 e4m3 bytes; fp4: 4 e2m1
  /// nibbles) and their scales (fp8: the row's fp32 scale; fp4: the UE8M0 exponent of the group's
  /// 32 dims). fp4 rows on 8 lanes hold them as written instead (see deal_fp4_words).
  struct IndexerCodes {
    uint32_t codes[kSpan];
    uint32_t scales[kSpan];
  };

  /// fp4 rows on 8 lanes: a lane's 2-byte code words would make half-sector stores (16 bytes of a
  /// row per store instruction), so the lanes deal them out again: lane j takes virtual lanes 2j,
  /// 2j + 1 (4 bytes at 4j) and 2j + 16, 2j + 17 (at 32 + 4j); every lane has the 4 group
  /// exponents, packed as the row's 4 scale bytes. On 4 lanes, lane j takes virtual lanes 4j .. 4j + 3
  /// (8 bytes at 8j) and 16 + 4j .. 19 + 4j (at 32 + 8j).
  static DSV4_DEV IndexerCodes deal_fp4_words(const IndexerCodes& c, int j) {
    IndexerCodes out{};
    if constexpr (kLanes == 8) {
      // virtual lane 2j + 16h + i: lane (2j + i) % 8, group 2h + (j >= 4); a shuffle moves two groups
      const uint32_t halves = j >= 4 ? 0x7632u : 0x5410u;  // the upper or the lower 16 bits of each
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t both = __byte_perm(c.codes[2 * h], c.codes[2 * h + 1], 0x5410);
        const uint32_t even = __shfl_sync(kFullMask, both, (2 * j) % 8, kLanes);
        const uint32_t odd = __shfl_sync(kFullMask, both, (2 * j + 1) % 8, kLanes);
        out.codes[h] = __byte_perm(even, odd, halves);
      }
    } else {
      static_assert(kLanes == 4, "4 or 8 lanes a row");
      // virtual lanes 4j + i and 16 + 4j + i are lane i's groups j and j + 4: the 4 lanes transpose
      // their words d[k] (groups k and k + 4) by two butterfly steps, each swapping the words whose
      // index bit differs from the lane's, so that lane j ends with d[i] = lane i's word j
      uint32_t d[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) d[k] = __byte_perm(c.codes[k], c.codes[k + 4], 0x5410);
#pragma unroll
      for (int m = 2; m >= 1; m /= 2) {
        const bool upper = j & m;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (k & m) continue;
          const uint32_t got = __shfl_xor_sync(kFullMask, upper ? d[k] : d[k | m], m);
          if (upper) {
            d[k] = got;
          } else {
            d[k | m] = got;
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t halves = h == 0 ? 0x5410u : 0x7632u;
        out.codes[2 * h] = __byte_perm(d[0], d[1], halves);
        out.codes[2 * h + 1] = __byte_perm(d[2], d[3], halves);
      }
    }
    constexpr int kStep = kSpan / 4;  // the groups of the 4 scales
    out.scales[0] = c.scales[0] | c.scales[kStep] << 8 | c.scales[2 * kStep] << 16 | c.scales[3 * kStep] << 24;
    return out;
  }

  /// Hadamard transform and quantization of a normalized indexer row held by `kLanes` lanes
  /// (lane j, group w: virtual lane j + kLanes·w); `fp4`: the e2m1 codec (fp4_code, or its table).
  template <typename Fp4Codec>
  static DSV4_DEV IndexerCodes encode_indexer(float (&v)[kSpan][4], int j, const Fp4Codec& fp4) {
    hadamard128(v, j);
    if constexpr (F == Format::kIndexerFp8) {
      return encode_indexer_fp8(v);
    } else if constexpr (kLanes <= 8) {
      return deal_fp4_words(encode_indexer_fp4(v, j, fp4), j);
    } else {
      return encode_indexer_fp4(v, j, fp4);
    }
  }

  /// Writes lane j's part of an encoded indexer row into `slot`.
  static DSV4_DEV void write_indexer(const Slot& slot, int j, const IndexerCodes& c) {
    if constexpr (F == Format::kIndexerFp4 && kLanes == 8) {  // dealt by deal_fp4_words
#pragma unroll
      for (int h = 0; h < 2; ++h) *reinterpret_cast<uint32_t*>(slot.data + 32 * h + 4 * j) = c.codes[h];
      if (j == 0) *reinterpret_cast<uint32_t*>(slot.scales) = c.scales[0];
    } else if constexpr (F == Format::kIndexerFp4 && kLanes == 4) {  // dealt; 8-byte aligned (pages of 2+)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<uint2*>(slot.data + 32 * h + 8 * j) = make_uint2(c.codes[2 * h], c.codes[2 * h + 1]);
      }
      if (j == 0) *reinterpret_cast<uint32_t*>(slot.scales) = c.scales[0];
    } else {
#pragma unroll
      for (int w = 0; w < kSpan; ++w) {
        const int lane = vlane(j, w);
        if constexpr (F == Format::kIndexerFp8) {
          *reinterpret_cast<uint32_t*>(slot.data + 4 * lane) = c.codes[w];
          if (lane == 0) *reinterpret_cast<uint32_t*>(slot.scales) = c.scales[w];
        } else {
          *reinterpret_cast<uint16_t*>(slot.data + 2 * lane) = static_cast<uint16_t>(c.codes[w]);
          if (lane % 8 == 0) slot.scales[lane / 8] = static_cast<uint8_t>(c.scales[w]);
        }
      }
    }
  }

  /// One 64-dim tile of a V4 row, held by 32 lanes x 2 channels (lane l: dims 64·tile + 2l, +1):
  /// the bytes run() writes for that tile, given the row's RMS scale `r` (c128 fused path).
  static DSV4_DEV void store_tile(const Slot& slot, int tile, float (&x)[2], const float (&w)[2], float r,
                                  const float (&freq)[2], int lane) {
    static_assert(!L::kIndexer, "indexer rows need the whole row in one warp (Hadamard)");
#pragma unroll
    for (int c = 0; c < 2; ++c) x[c] = __fmul_rn(__fmul_rn(x[c], r), w[c]);
    if (tile == L::kHeadDim / 64 - 1) rotate(x[0], x[1], freq[0], freq[1]);
    write_v4(slot, 64 * tile + 2 * lane, encode_v4(64 * tile + 2 * lane, x));
  }

  /// UE8M0 exponent of a V4 tile's scale (rounded up; amax floored at 1e-4), by amax's bits
  /// (ue8m0_scale_exponent<448>) or through the division: the same exponents. run() takes the bits
  /// (without the division's slow-path branch, 0.3 us faster for 16 and 256 rows, 6 % at 16 384); the
  /// fused kernels keep the division, as the bits measured 0.2 us slower in the fused online decode
  /// (a latency chain whose code otherwise differs only in instruction order).
  template <bool kByBits>
  static DSV4_DEV int v4_exponent(float amax) {
    if constexpr (kByBits) return ue8m0_scale_exponent<448>(amax);
    return ue8m0_ceil(fmaxf(amax, 1e-4f) / 448.0f);
  }

  /// Butterfly step of the Hadamard transform on one pair: (lo, hi) -> (lo + hi, lo - hi).
  static DSV4_DEV void hadamard_pair(float& lo, float& hi) {
    const float sum = lo + hi, diff = lo - hi;
    lo = sum, hi = diff;
  }

  /// 128^-1/2, the Hadamard transform's normalization.
  static constexpr float kHadamardScale = 0.08838834764831845f;

  /// Walsh–Hadamard butterflies over a row's 128 values (natural order), before the 128^-1/2
  /// scale, held by `kLanes` lanes (lane j, group w: channels 4(j + kLanes·w) .. +3). Distances in
  /// increasing order: 1, 2 inside a group, then across lanes, then across this lane's groups.
  static DSV4_DEV void hadamard128(float (&v)[kSpan][4], int j) {
#pragma unroll
    for (int w = 0; w < kSpan; ++w) {
      hadamard_pair(v[w][0], v[w][1]), hadamard_pair(v[w][2], v[w][3]);
      hadamard_pair(v[w][0], v[w][2]), hadamard_pair(v[w][1], v[w][3]);
    }
#pragma unroll
    for (int m = 1; m < kLanes; m *= 2) {  // distances 4 .. 2·kLanes pair lane j with lane j ^ m
      // upper lanes take other - own, lower ones own + other: one fma with an exact ±1 factor
      // rounds the same sum once
      const float sign = (j & m) ? -1.0f : 1.0f;
#pragma unroll
      for (int w = 0; w < kSpan; ++w) {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[w][i] = __fmaf_rn(sign, v[w][i], __shfl_xor_sync(kFullMask, v[w][i], m));
      }
    }
#pragma unroll
    for (int m = 1; m < kSpan; m *= 2) {  // distances 4·kLanes .. 64 pair group w with group w ^ m
#pragma unroll
      for (int w = 0; w < kSpan; ++w) {
        if (!(w & m)) {
#pragma unroll
          for (int i = 0; i < 4; ++i) hadamard_pair(v[w][i], v[w | m][i]);
        }
      }
    }
  }

  /// Largest value over `lanes` neighbouring lanes (a power of two, aligned).
  static DSV4_DEV float reduce_amax(float a, int lanes) {
    for (int m = lanes / 2; m > 0; m /= 2) a = fmaxf(a, __shfl_xor_sync(kFullMask, a, m));
    return a;
  }

  static DSV4_DEV float amax4(const float (&v)[4]) {
    return fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  }

  /// Indexer fp8: one fp32 scale (not a power of two) over all 128 values of the transform.
  static DSV4_DEV IndexerCodes encode_indexer_fp8(float (&v)[kSpan][4]) {
    float amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kSpan; ++w) {
#pragma unroll
      for (int i = 0; i < 4; ++i) v[w][i] *= kHadamardScale;
      amax = fmaxf(amax, amax4(v[w]));
    }
    const float s = fmaxf(reduce_amax(amax, kLanes), 1e-4f) / 448.0f;
    const float inv = 1.0f / s;
    IndexerCodes out;
#pragma unroll
    for (int w = 0; w < kSpan; ++w) {
      out.codes[w] = e4m3x2_codes(v[w][0] * inv, v[w][1] * inv) | uint32_t{e4m3x2_codes(v[w][2] * inv, v[w][3] * inv)} << 16;
      out.scales[w] = __float_as_uint(s);
    }
    return out;
  }

  /// UE8M0 exponents of the 32-dim groups that lane j's groups belong to (`lane_max`: their
  /// maxima; a 32-dim group is 8 virtual lanes, one group of each of 8 neighbouring lanes, or two
  /// neighbouring groups of each of 4). The maxima are reduced and scattered over those lanes, so
  /// lane j ends with the maximum of its group g whose bits are j's bits 2, 1 (1, 0 on 4 lanes; high
  /// first); each lane takes one exponent and the lanes gather them (exponents rise with the
  /// maximum, so each is the exponent of its group's maximum).
  static DSV4_DEV void group_exponents(const float (&lane_max)[kSpan], int j, int (&e)[kFp4Groups]) {
    float a[kFp4Groups];  // this lane's maximum in each 32-dim group it holds values of
#pragma unroll
    for (int q = 0; q < kFp4Groups; ++q) {
      a[q] = lane_max[kFold * q];
#pragma unroll
      for (int f = 1; f < kFold; ++f) a[q] = fmaxf(a[q], lane_max[kFold * q + f]);
    }
#pragma unroll
    for (int n = kFp4Groups / 2, m = std::min(4, kLanes / 2); n >= 1; n /= 2, m /= 2) {  // keep n of 2n maxima
      const bool upper = j & m;
#pragma unroll
      for (int i = 0; i < n; ++i) {
        const float give = upper ? a[i] : a[i + n], keep = upper ? a[i + n] : a[i];
        a[i] = fmaxf(keep, __shfl_xor_sync(kFullMask, give, m));
      }
    }
    const int own = ue8m0_scale_exponent<6>(reduce_amax(a[0], 8 / kSpan) * kHadamardScale);
    // group g's maximum is at lane g << kShift of the 8 (of the row's 4 on 4 lanes)
    constexpr int kShift = 3 - log2_floor(kSpan);
#pragma unroll
    for (int g = 0; g < kFp4Groups; ++g) {
      e[g] = kSpan == 1 ? own : __shfl_sync(kFullMask, own, g << kShift, std::min(8, kLanes));
    }
  }

  /// Indexer fp4: e2m1 codes (even dim in the low nibble), one UE8M0 scale per 32-dim group
  /// (8 virtual lanes). `h` is the transform before its 128^-1/2 scale: that factor and the
  /// group's power-of-two scale are one multiply, which rounds as the two in turn did (scaling by
  /// a power of two is exact while the constant stays normal: group maxima up to 6·2^122), and the
  /// group maximum is scaled once (rounding is monotone).
  template <typename Fp4Codec>
  static DSV4_DEV IndexerCodes encode_indexer_fp4(const float (&h)[kSpan][4], int j, const Fp4Codec& code) {
    float a[kSpan];
#pragma unroll
    for (int g = 0; g < kSpan; ++g) a[g] = amax4(h[g]);
    int e[kFp4Groups];
    group_exponents(a, j, e);
    code.wait();  // the table copy, if any: first needed here
    float scale[kFp4Groups];
#pragma unroll
    for (int q = 0; q < kFp4Groups; ++q) scale[q] = kHadamardScale * exp2_int(127 - e[q]);
    IndexerCodes out;
#pragma unroll
    for (int g = 0; g < kSpan; ++g) {
      const float c = scale[g / kFold];
      // the low 16 bits: bits above them are not stored
      out.codes[g] = __byte_perm(code.pair(h[g][0] * c, h[g][1] * c), code.pair(h[g][2] * c, h[g][3] * c), 0x40);
      out.scales[g] = static_cast<uint32_t>(e[g / kFold]);
    }
    return out;
  }
};

template <typename K>
__global__ __launch_bounds__(K::kWarps * kWarpSize) void store_kernel(const __grid_constant__ Params p) {
  K::run(p);
}

/// Codec probes for the tests: each maps an fp32 value to two outputs.
template <typename Probe, typename Out>
__global__ void probe_kernel(const float* __restrict__ x, Out* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    Probe::apply(x[i], out + 2 * i);
  }
}

/// Runs Probe over x fp32 [n] into out [n, 2] (`x_name`: the input's name in errors).
template <typename Probe, typename Out>
void run_probe(const char* op, const char* x_name, TensorView x, TensorView out) {
  Size n{"n"};
  Device dev;
  Check(op, x_name, x).shape({n}).dtype(dl::kF32).cuda(dev).contiguous();
  Check(op, "out", out).shape({n, 2}).dtype(DTypeInfo<Out>::dtype).cuda(dev).contiguous();
  launch(op, dev.dev, {std::min(div_ceil(n.value, 256), 4096u), 256}, false, probe_kernel<Probe, Out>,
         static_cast<const float*>(x.data_ptr()), static_cast<Out*>(out.data_ptr()), n.value);
}

/// The e2m1 code pair (x, x) the fp4 stores write for already-scaled values: by fp4_code, by its
/// table.
struct Fp4CodesProbe {
  static DSV4_DEV void apply(float x, uint8_t* out) {
    out[0] = static_cast<uint8_t>(fp4_code_pair(x, x));
    out[1] = static_cast<uint8_t>(kFp4Codes.pair(x, x));
  }
};

/// UE8M0 exponents by the division-free rule for a group's largest magnitude: amax / 6 (the fp4
/// groups' scale) and amax / 448 (the V4 tiles' divisor, which the fused kernels keep as a division).
struct ScaleExponentsProbe {
  static DSV4_DEV void apply(float amax, int32_t* out) {
    out[0] = ue8m0_scale_exponent<6>(amax);
    out[1] = ue8m0_scale_exponent<448>(amax);
  }
};

/// x fp32 [n] -> out u8 [n, 2]: Fp4CodesProbe, for checking both codecs against the reference rule.
inline void fp4_codes(TensorView x, TensorView out) { run_probe<Fp4CodesProbe, uint8_t>("store.fp4_codes", "x", x, out); }

/// amax fp32 [n] -> out int32 [n, 2]: ScaleExponentsProbe, for checking the rule against the
/// reference's division.
inline void scale_exponents(TensorView amax, TensorView out) {
  run_probe<ScaleExponentsProbe, int32_t>("store.scale_exponents", "amax", amax, out);
}

template <typename DType, Format F, bool kPDL>
struct NormRopeStore {
  using L = Layout<F>;

  /// Large indexer batches: rows on fewer lanes (each row's scalar work — plan, location, RMS
  /// scale — and its cross-lane steps shared by fewer threads): fp8 on 8 (4 measured slower: its
  /// 4-byte code words make half-sector stores), fp4 on 4 with codes by table (3 % faster than 8 at
  /// 16 384 rows; 27 % fewer instructions a row). Below, 16 lanes keep per-thread chains short
  /// (measured faster there).
  static constexpr uint32_t kLargeBatchRows = 2048;

  template <int kLanes>
  static void launch_rows(const char* op, const Device& dev, const Params& p) {
    using K = Kernel<DType, F, kPDL, kLanes>;
    launch(op, dev.dev, {div_ceil(p.rows, K::kRowsPerBlock), K::kWarps * kWarpSize}, kPDL, store_kernel<K>, p);
  }

  /// Checks the plan rows (`rows` of them) and every store operand, and fills the parameters
  /// (kv excluded): the fused compress-and-store kernel shares this with run().
  static Params checked(const char* op, Size& rows, Device& dev, TensorView plan, TensorView norm_weight,
                        TensorView freq, TensorView out_loc, TensorView kvcache, int32_t* status, int64_t page_size,
                        int64_t compress_ratio, bool is_decode, double eps, int64_t num_q_tokens) {
    Size pages{"num_pages"}, max_pos{"max_pos"}, locs{"out_loc_len"};
    expect(compress_ratio == 4 || compress_ratio == 128, op, "compress_ratio", "4 or 128", compress_ratio);
    expect(page_size > 0 && (page_size & (page_size - 1)) == 0, op, "page_size", "a power of two", page_size);
    const int64_t page_bytes = L::page_bytes(page_size);
    Check(op, "plan[1]", plan).shape({rows, 16}).dtype(dl::kU8).cuda(dev).contiguous().aligned();
    Check(op, "norm_weight", norm_weight).shape({L::kHeadDim}).dtype(DTypeInfo<DType>::dtype).cuda(dev).contiguous()
        .aligned();
    Check(op, "freq_cis", freq).shape({max_pos, kRopeDim}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Check(op, "out_loc", out_loc).shape({locs}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
    Check(op, "kvcache", kvcache).shape({pages, page_bytes}).dtype(dl::kU8).cuda(dev).contiguous().aligned();
    if (is_decode) {
      expect(locs.value == rows.value, op, "out_loc", [&] { return "one entry per decode row (" +
                                                                   std::to_string(rows.value) + ")"; }, locs.value);
    } else if (num_q_tokens >= 0) {
      expect(locs.value >= num_q_tokens, op, "out_loc", [&] { return "at least num_q_tokens (" +
                                                                     std::to_string(num_q_tokens) + ") entries"; },
             locs.value);
    }
    Params p{};
    p.plan = plan.data_ptr();
    p.norm_weight = norm_weight.data_ptr();
    p.freq = static_cast<const float*>(freq.data_ptr());
    p.out_loc = out_loc.data_ptr();
    p.cache = static_cast<uint8_t*>(kvcache.data_ptr());
    p.status = status;
    p.page_bytes = page_bytes;
    p.num_locs = pages.value * page_size;
    p.out_loc_len = locs.value;
    p.max_pos = max_pos.value;
    p.rows = static_cast<uint32_t>(rows.value);
    p.log2_page_size = __builtin_ctzll(static_cast<uint64_t>(page_size));
    p.ratio = static_cast<int32_t>(compress_ratio);
    p.eps = static_cast<float>(eps);
    p.loc64 = same_dtype(out_loc.dtype(), dl::kI64);
    p.is_decode = is_decode;
    return p;
  }

  /// kv [rows, hd]; plan rows (CompressPlan in prefill, DecodePlan in decode); freq fp32 [max_pos, 64];
  /// out_loc int32/int64 (prefill: >= num_q_tokens entries, indexed by ragged id; decode: one per row);
  /// kvcache u8 [num_pages, page_bytes].
  static void run(TensorView kv, TensorView plan, TensorView norm_weight, TensorView freq, TensorView out_loc,
                  TensorView kvcache, Optional<TensorView> status, int64_t page_size, int64_t compress_ratio,
                  bool is_decode, double eps, int64_t num_q_tokens) {
    const char* op = "compress_norm_rope_store";
    Size rows{"rows"};
    Device dev;
    Check(op, "kv", kv).shape({rows, L::kHeadDim}).dtype(DTypeInfo<DType>::dtype).cuda(dev).contiguous().aligned();
    Params p = checked(op, rows, dev, plan, norm_weight, freq, out_loc, kvcache, status_words(op, dev, status), page_size,
                       compress_ratio, is_decode, eps, num_q_tokens);
    p.kv = kv.data_ptr();
    launch_store(op, dev, p);
  }

  /// The store kernel over checked parameters (checked(), then p.kv).
  static void launch_store(const char* op, const Device& dev, const Params& p) {
    if constexpr (!L::kIndexer) {
      launch_rows<kWarpSize>(op, dev, p);
    } else {
      if (p.rows > kLargeBatchRows) {
        if constexpr (F == Format::kIndexerFp4) {
          // rows on 4 lanes store 8-byte words: pages of 2+ tokens keep them aligned
          if (p.log2_page_size > 0) return launch_rows<4>(op, dev, p);
        }
        return launch_rows<8>(op, dev, p);
      }
      launch_rows<16>(op, dev, p);
    }
  }
};

}  // namespace dsv4::store
