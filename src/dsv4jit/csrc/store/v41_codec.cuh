// The DeepSeek-V4.1 codecs of a 512-dim latent row (contract §10), on the store's warp layout: lane j
// of a row's warp holds the 4 dims 128k + 4j .. +3 of each 128-dim chunk k, so a v41 tile (32 dims)
// is 8 lanes and a v41_fp4 tile (16 dims) 4 lanes of one chunk.
//
//   v41          data byte i = e4m3(v_i · 2^(127 - e_t)), t = i / 32; scale byte t = e_t (UE8M0)
//   v41_fp4      data byte j = e2m1(v_2j / s_t) | e2m1(v_2j+1 / s_t) << 4, t = 2j / 16; scale byte t
//                = the e4m3 code of s_t (IEEE divisions, ties to even, -0 kept)
//   uniform_fp8  data byte i = e4m3(clamp(v_i, ±448)); no scales (the reader's scale is 1)
//
// The interleaved layouts (v41_new, v41_fp4_new) code as v41 and v41_fp4; only the slot differs
// (layout.cuh). Also the ratio-1/2 compressors' fp4 fake quant (16-dim tiles, fp4_fake_quant).
#pragma once

#include <cstdint>

#include "common/quant.cuh"
#include "common/warp.cuh"
#include "layout.cuh"

namespace dsv4::store {

/// A lane's 4 dims of a chunk, coded: 4 e4m3 bytes, or 4 e2m1 nibbles in the low 16 bits; and its
/// tile's scale code (the same in every lane of the tile).
struct V41Codes {
  uint32_t codes;
  uint32_t scale;
};

/// The e2m1 codes of a lane's 4 dims divided by the tile scale `s`, an e4m3 value (two bytes, even
/// dims low).
DSV4_DEV uint32_t e2m1_codes_over(const float (&x)[4], float s) {
  float q[4];
  short_quotients(q, x, s);
  return e2m1_rn_pair(q[0], q[1]) | e2m1_rn_pair(q[2], q[3]) << 8;
}

template <Format F>
DSV4_DEV V41Codes encode_v41(const float (&x)[4]) {
  static_assert(Layout<F>::kV41, "a V4.1 layout");
  V41Codes out{};
  if constexpr (F == Format::kUniformFp8) {
    out.codes = e4m3x2_codes(x[0], x[1]) | uint32_t{e4m3x2_codes(x[2], x[3])} << 16;
  } else if constexpr (Layout<F>::kFp4Values) {
    out.scale = v41_fp4_scale_code(reduce_amax(amax4(x), 4));
    out.codes = e2m1_codes_over(x, e4m3_value(out.scale));
  } else {
    const int e = v41_tile_exponent(reduce_amax(amax4(x), 8));
    const float m = exp2_int(127 - e);  // exact: e >= 114
    out.scale = static_cast<uint32_t>(e);
    out.codes = e4m3x2_codes(__fmul_rn(x[0], m), __fmul_rn(x[1], m)) |
                uint32_t{e4m3x2_codes(__fmul_rn(x[2], m), __fmul_rn(x[3], m))} << 16;
  }
  return out;
}

/// The scale bytes of lanes `first`, first + step, first + 2·step, first + 3·step as one word (every
/// lane calls it: shuffles).
DSV4_DEV uint32_t scale_word(uint32_t scale, int first, int step) {
  uint32_t word = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) word |= (__shfl_sync(kFullMask, scale, first + b * step) & 0xFFu) << (8 * b);
  return word;
}

/// Writes lane j's codes of chunk k into `slot`, and the chunk's tile scales (every lane of the warp
/// calls it: the scales are gathered by shuffles and stored as words by the first lanes).
template <Format F>
DSV4_DEV void write_v41(const Slot& slot, int k, int j, const V41Codes& c) {
  using L = Layout<F>;
  if constexpr (L::kFp4Values) {
    *reinterpret_cast<uint16_t*>(slot.data + 64 * k + 2 * j) = static_cast<uint16_t>(c.codes);
    // 8 tiles a chunk (lanes 0, 4, .., 28): lane 0 stores the first 4 scales, lane 1 the others
    const uint32_t word = scale_word(c.scale, 16 * (j & 1), 4);
    if (j < 2) *reinterpret_cast<uint32_t*>(slot.scales + 8 * k + 4 * j) = word;
  } else {
    *reinterpret_cast<uint32_t*>(slot.data + 128 * k + 4 * j) = c.codes;
    if constexpr (L::kScaleBytes > 0) {  // 4 tiles a chunk (lanes 0, 8, 16, 24)
      const uint32_t word = scale_word(c.scale, 0, 8);
      if (j == 0) *reinterpret_cast<uint32_t*>(slot.scales + 4 * k) = word;
    }
  }
}

/// e2m1_rn_pair's code of one value.
DSV4_DEV uint32_t e2m1_rn(float u) { return e2m1_rn_pair(u, 0.0f) & 0xFu; }

/// The compressed-KV fp4 fake quant of a lane's 4 dims, in place (16-dim tiles on 4 lanes; every
/// lane calls it): s = e4m3(clamp(amax · fl(1/6), 2^-9, 448)), v -> grid(e2m1(v / s + 0)) · s, exact
/// (the + 0 turns an exact -0 quotient into +0; a tiny negative one still gives -0).
DSV4_DEV void fp4_fake_quant(float (&x)[4]) {
  const float s = e4m3_value(fp4_fake_quant_scale_code(reduce_amax(amax4(x), 4)));
  float q[4];
  short_quotients(q, x, s);
#pragma unroll
  for (int c = 0; c < 4; ++c) x[c] = __fmul_rn(e2m1_value(e2m1_rn(__fadd_rn(q[c], 0.0f))), s);
}

}  // namespace dsv4::store
