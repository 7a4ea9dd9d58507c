// The steps of a latent row that the ratio-1 and ratio-2 compressors share (contract §10.4), on a
// warp per row: lane j holds dims 128k + 4j .. +3 of each 128-dim chunk k, as the store family's
// latent rows, so the store's codecs code it as they do there.
//
//   RMSNorm   L = bf((x · r) · w), r = 1 / sqrt(S / 512 + eps): the sum of squares S in fp64 and
//             rounded once, the root and quotient in fp64 (as the torch reference: bit-exact with it)
//   store     RoPE of L's rope dims at the row's position, rounded to bf16; the fp4 layouts code
//             that, the others its fp4 fake quant (16-dim tiles) with the layout's codec
#pragma once

#include <cstdint>

#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "params.cuh"
#include "store/latent_codec.cuh"
#include "store/layout.cuh"
#include "store/rope.cuh"

namespace dsv4::lowratio {

inline constexpr int kChunks = kHeadDim / 128;
inline constexpr int kRopeLane = (kHeadDim - store::kRopeDim) / 4 - 3 * kWarpSize;  // lane of dim 448 in chunk 3

/// A lane's dims of a row: chunk k, dims 128k + 4j .. +3.
using Lanes = float[kChunks][4];

/// Lane j's norm weights (not written by any kernel: loaded before the upstream wait).
DSV4_DEV void load_weight(const Params& p, int j, Lanes& w) {
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const Vec<bf16_t, 4> v = load_vec<4>(p.norm_weight + 128 * k + 4 * j);
#pragma unroll
    for (int c = 0; c < 4; ++c) w[k][c] = to_f32(v[c]);
  }
}

/// Lane j's (cos, sin) pairs of the rope dims at `position` (lanes of the rope dims only; zeros
/// elsewhere and for a position outside the table, whose row is not stored).
DSV4_DEV Vec<float, 4> load_rope(const Params& p, int j, int64_t position) {
  Vec<float, 4> f{};
  if (j >= kRopeLane && position >= 0 && position < p.s.max_pos) {
    f = load_vec<4>(p.s.freq + position * store::kRopeDim + 4 * (j - kRopeLane));
  }
  return f;
}

/// The row's latent, in place: RMSNorm with the weights `w`, each value rounded to bf16 (exact in x).
DSV4_DEV void normalize_latent(const Params& p, Lanes& x, const Lanes& w) {
  double s = 0.0;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s = __fma_rn(static_cast<double>(x[k][c]), static_cast<double>(x[k][c]), s);
  }
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) s += __shfl_xor_sync(kFullMask, s, m);
  const float mean = __fadd_rn(static_cast<float>(s) / kHeadDim, p.eps);
  const float r = static_cast<float>(1.0 / sqrt(static_cast<double>(mean)));
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) x[k][c] = to_f32(from_f32<bf16_t>(__fmul_rn(__fmul_rn(x[k][c], r), w[k][c])));
  }
}

/// Writes lane j's dims of the latent to out[row].
DSV4_DEV void write_out(const Params& p, uint32_t row, int j, const Lanes& x) {
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    Vec<bf16_t, 4> v;
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = from_f32<bf16_t>(x[k][c]);
    store_vec(p.out + uint64_t{row} * kHeadDim + 128 * k + 4 * j, v);
  }
}

/// Whether a row's location and RoPE position are in range: else reported and not stored.
DSV4_DEV bool storable(const Params& p, int64_t loc, int64_t position) {
  const int32_t bad = static_cast<uint64_t>(loc) >= static_cast<uint64_t>(p.s.num_locs) ? kLocOutOfRange
                      : position < 0 || position >= p.s.max_pos                       ? kPositionOutOfRange
                                                                                      : 0;
  if (bad != 0) report(p, bad);
  return bad == 0;
}

/// Stores the latent `x` (consumed) at `loc` of a cache of format F, its rope dims rotated by `rope`
/// (load_rope of the row's RoPE position). Every lane of the warp calls it.
template <store::Format F>
DSV4_DEV void store_latent(const Params& p, int j, int64_t loc, const Vec<float, 4>& rope, Lanes& x) {
  if (j >= kRopeLane) {
    const float f[4] = {rope[0], rope[1], rope[2], rope[3]};
    store::rotate_pairs(x[kChunks - 1], f);
    store::round_to<bf16_t>(x[kChunks - 1]);
  }
  const store::Slot slot = store::slot_at<F>(p.s, loc);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if constexpr (!store::Layout<F>::kFp4Values) store::fp4_fake_quant(x[k]);
    store::write_latent<F>(slot, 128 * k + 4 * j, store::encode_latent<F>(128 * k + 4 * j, x[k]));
  }
}

}  // namespace dsv4::lowratio
