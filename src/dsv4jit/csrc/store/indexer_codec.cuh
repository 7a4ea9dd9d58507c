// The indexer row's codecs, after its Hadamard transform: fp8 (e4m3, one fp32 scale a row) or fp4
// (e2m1, one UE8M0 scale per 32-dim group), for rows on kLanes lanes, and their bytes in the cache
// slot. fp4 codes come from a codec argument: the rule (Fp4ByRule) or its table (Fp4WarpTable).
#pragma once

#include <algorithm>

#include "common/async_copy.cuh"
#include "common/quant.cuh"
#include "common/warp.cuh"
#include "hadamard.cuh"
#include "layout.cuh"

namespace dsv4::store {

/// fp4_code() as a codec argument (the alternative to the table; stateless).
struct Fp4ByRule {
  DSV4_DEV void fill() {}
  DSV4_DEV void wait() const {}
  DSV4_DEV uint32_t pair(float lo, float hi) const { return fp4_code_pair(lo, hi); }
};

/// The fp4 code table as a codec argument: the warp's own copy in shared memory, filled by
/// cp.async when the warp starts (fill()) and waited for when it first codes (wait()), so the row
/// loads go out at once and no block barrier holds warps back (a block's copy behind a barrier
/// measured slower: docs/design-notes.md).
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

/// An indexer row as stored, per lane (rows on kLanes lanes): the codes of its groups (fp8: 4 e4m3
/// bytes; fp4: 4 e2m1 nibbles) and their scales (fp8: the row's fp32 scale; fp4: the UE8M0 exponent
/// of the group's 32 dims). fp4 rows on 8 lanes or fewer hold them as written instead (see
/// deal_fp4_words).
template <int kLanes>
struct IndexerCodes {
  uint32_t codes[RowLanes<kLanes>::kSpan];
  uint32_t scales[RowLanes<kLanes>::kSpan];
};

/// Indexer fp8: one fp32 scale (not a power of two) over all 128 values of the transform.
template <int kLanes>
DSV4_DEV IndexerCodes<kLanes> encode_indexer_fp8(float (&v)[RowLanes<kLanes>::kSpan][4]) {
  constexpr int kSpan = RowLanes<kLanes>::kSpan;
  float amax = 0.0f;
#pragma unroll
  for (int w = 0; w < kSpan; ++w) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[w][i] *= kHadamardScale;
    amax = fmaxf(amax, amax4(v[w]));
  }
  const float s = fmaxf(reduce_amax(amax, kLanes), 1e-4f) / 448.0f;
  const float inv = 1.0f / s;
  IndexerCodes<kLanes> out;
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
template <int kLanes>
DSV4_DEV void group_exponents(const float (&lane_max)[RowLanes<kLanes>::kSpan], int j,
                              int (&e)[RowLanes<kLanes>::kFp4Groups]) {
  using R = RowLanes<kLanes>;
  float a[R::kFp4Groups];  // this lane's maximum in each 32-dim group it holds values of
#pragma unroll
  for (int q = 0; q < R::kFp4Groups; ++q) {
    a[q] = lane_max[R::kFold * q];
#pragma unroll
    for (int f = 1; f < R::kFold; ++f) a[q] = fmaxf(a[q], lane_max[R::kFold * q + f]);
  }
#pragma unroll
  for (int n = R::kFp4Groups / 2, m = std::min(4, kLanes / 2); n >= 1; n /= 2, m /= 2) {  // keep n of 2n maxima
    const bool upper = j & m;
#pragma unroll
    for (int i = 0; i < n; ++i) {
      const float give = upper ? a[i] : a[i + n], keep = upper ? a[i + n] : a[i];
      a[i] = fmaxf(keep, __shfl_xor_sync(kFullMask, give, m));
    }
  }
  const int own = ue8m0_scale_exponent<6>(reduce_amax(a[0], 8 / R::kSpan) * kHadamardScale);
  // group g's maximum is at lane g << kShift of the 8 (of the row's 4 on 4 lanes)
  constexpr int kShift = 3 - log2_floor(R::kSpan);
#pragma unroll
  for (int g = 0; g < R::kFp4Groups; ++g) {
    e[g] = R::kSpan == 1 ? own : __shfl_sync(kFullMask, own, g << kShift, std::min(8, kLanes));
  }
}

/// Indexer fp4: e2m1 codes (even dim in the low nibble), one UE8M0 scale per 32-dim group
/// (8 virtual lanes). `h` is the transform before its 128^-1/2 scale: that factor and the
/// group's power-of-two scale are one multiply, which rounds as the two in turn did (scaling by
/// a power of two is exact while the constant stays normal: group maxima up to 6·2^122), and the
/// group maximum is scaled once (rounding is monotone).
template <int kLanes, typename Fp4Codec>
DSV4_DEV IndexerCodes<kLanes> encode_indexer_fp4(const float (&h)[RowLanes<kLanes>::kSpan][4], int j,
                                                 const Fp4Codec& code) {
  using R = RowLanes<kLanes>;
  float a[R::kSpan];
#pragma unroll
  for (int g = 0; g < R::kSpan; ++g) a[g] = amax4(h[g]);
  int e[R::kFp4Groups];
  group_exponents<kLanes>(a, j, e);
  code.wait();  // the table copy, if any: first needed here
  float scale[R::kFp4Groups];
#pragma unroll
  for (int q = 0; q < R::kFp4Groups; ++q) scale[q] = kHadamardScale * exp2_int(127 - e[q]);
  IndexerCodes<kLanes> out;
#pragma unroll
  for (int g = 0; g < R::kSpan; ++g) {
    const float c = scale[g / R::kFold];
    // the low 16 bits: bits above them are not stored
    out.codes[g] = __byte_perm(code.pair(h[g][0] * c, h[g][1] * c), code.pair(h[g][2] * c, h[g][3] * c), 0x40);
    out.scales[g] = static_cast<uint32_t>(e[g / R::kFold]);
  }
  return out;
}

/// fp4 rows on 8 lanes: a lane's 2-byte code words would make half-sector stores (16 bytes of a
/// row per store instruction), so the lanes deal them out again: lane j takes virtual lanes 2j,
/// 2j + 1 (4 bytes at 4j) and 2j + 16, 2j + 17 (at 32 + 4j); every lane has the 4 group
/// exponents, packed as the row's 4 scale bytes. On 4 lanes, lane j takes virtual lanes 4j .. 4j + 3
/// (8 bytes at 8j) and 16 + 4j .. 19 + 4j (at 32 + 8j).
template <int kLanes>
DSV4_DEV IndexerCodes<kLanes> deal_fp4_words(const IndexerCodes<kLanes>& c, int j) {
  IndexerCodes<kLanes> out{};
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
  constexpr int kStep = RowLanes<kLanes>::kSpan / 4;  // the groups of the 4 scales
  out.scales[0] = c.scales[0] | c.scales[kStep] << 8 | c.scales[2 * kStep] << 16 | c.scales[3 * kStep] << 24;
  return out;
}

/// Hadamard transform and quantization of a normalized indexer row of format F held by `kLanes`
/// lanes (lane j, group w: virtual lane j + kLanes·w); `fp4`: the e2m1 codec (fp4_code, or its table).
template <Format F, int kLanes, typename Fp4Codec>
DSV4_DEV IndexerCodes<kLanes> encode_indexer(float (&v)[RowLanes<kLanes>::kSpan][4], int j, const Fp4Codec& fp4) {
  hadamard128<kLanes>(v, j);
  if constexpr (F == Format::kIndexerFp8) {
    return encode_indexer_fp8<kLanes>(v);
  } else if constexpr (kLanes <= 8) {
    return deal_fp4_words<kLanes>(encode_indexer_fp4<kLanes>(v, j, fp4), j);
  } else {
    return encode_indexer_fp4<kLanes>(v, j, fp4);
  }
}

/// Writes lane j's part of an encoded indexer row of format F into `slot`.
template <Format F, int kLanes>
DSV4_DEV void write_indexer(const Slot& slot, int j, const IndexerCodes<kLanes>& c) {
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
    for (int w = 0; w < RowLanes<kLanes>::kSpan; ++w) {
      const int lane = RowLanes<kLanes>::vlane(j, w);
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

}  // namespace dsv4::store
