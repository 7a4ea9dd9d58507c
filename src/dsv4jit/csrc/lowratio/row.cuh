// The steps of a latent row that the ratio-1 and ratio-2 compressors share (contract §10.4), on a block
// per row: warp k holds the 128-dim chunk k and its lane j the dims 128k + 4j .. +3 (as a warp holds
// one chunk of a latent row in the fused store step), so the store family's codecs code each chunk as
// they do there, and a thread holds 4 dims (short chains: these kernels are latency-bound).
//
//   RMSNorm   L = bf((x · r) · w), r = 1 / sqrt(S / 512 + eps): the sum of squares S in fp64 and
//             rounded once, the root and quotient in fp64 (as the torch reference: bit-exact with it)
//   store     RoPE of L's rope dims at the row's position, rounded to bf16; the fp4 layouts code
//             that, the others its fp4 fake quant (16-dim tiles) with the layout's codec
#pragma once

#include <cstdint>

#include "common/async_copy.cuh"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "params.cuh"
#include "store/latent_codec.cuh"
#include "store/layout.cuh"
#include "store/rope.cuh"

namespace dsv4::lowratio {

inline constexpr int kChunks = kHeadDim / 128;
inline constexpr int kThreads = kChunks * kWarpSize;  // a block per row
inline constexpr int kRopeLane = (kHeadDim - store::kRopeDim - 128 * (kChunks - 1)) / 4;  // lane of dim 448

/// This thread's place in its row: chunk (its warp), lane, and its first dim.
struct RowLane {
  int chunk, lane, dim;
  DSV4_DEV static RowLane of_thread() {
    const int chunk = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    return {chunk, lane, 128 * chunk + 4 * lane};
  }
  DSV4_DEV bool rope() const { return chunk == kChunks - 1 && lane >= kRopeLane; }
};

/// This thread's 4 dims of a row.
using Dims = float[4];

/// Before the upstream wait: brings into L2 what a row's first round trip after the wait reads, its
/// metadata entries (positions, locations and, for ratio 2, requests) and input rows (`rows`, `bytes`
/// each, null ones skipped), so that the trip finds them there once the kernel before this one is
/// done. Allowed before the wait: a prefetch returns nothing, and L2 is coherent, so a line that a
/// running kernel still writes is never read stale. The block's first thread issues them.
template <bool kPDL, int kRows>
DSV4_DEV void prefetch_row(const Params& p, uint32_t row, const void* const (&rows)[kRows], uint32_t bytes) {
  if (!kPDL || threadIdx.x != 0) return;
  prefetch_l2(static_cast<const char*>(p.positions) + uint64_t{row} * (p.pos64 ? 8 : 4));
  prefetch_l2(static_cast<const char*>(p.locs) + uint64_t{row} * (p.loc64 ? 8 : 4));
  if (p.req != nullptr) prefetch_l2(p.req + row);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if (rows[i] != nullptr) prefetch_l2_bulk(rows[i], bytes);
  }
}

/// The norm weights of the thread's dims (not written by any kernel: loaded before the upstream wait).
DSV4_DEV void load_weight(const Params& p, const RowLane& t, Dims& w) {
  const Vec<bf16_t, 4> v = load_vec<4>(p.norm_weight + t.dim);
#pragma unroll
  for (int c = 0; c < 4; ++c) w[c] = to_f32(v[c]);
}

/// The thread's (cos, sin) pairs of the RoPE row at `position`, or null for a thread without rope dims
/// and for a position outside the table (whose row is not stored).
DSV4_DEV const float* rope_pairs(const Params& p, const RowLane& t, int64_t position) {
  if (!t.rope() || position < 0 || position >= p.s.max_pos) return nullptr;
  return p.s.freq + position * store::kRopeDim + 4 * (t.lane - kRopeLane);
}

/// rope_pairs' values (zeros where it gives none).
DSV4_DEV Vec<float, 4> load_rope(const Params& p, const RowLane& t, int64_t position) {
  const float* f = rope_pairs(p, t, position);
  return f != nullptr ? load_vec<4>(f) : Vec<float, 4>{};
}

/// The row's latent, in place: RMSNorm with the weights `w`, each value rounded to bf16 (exact in x).
/// Every thread of the block calls it (`partials`: the block's shared chunk sums).
DSV4_DEV void normalize_latent(const Params& p, const RowLane& t, Dims& x, const Dims& w, double (&partials)[kChunks]) {
  double s = 0.0;
#pragma unroll
  for (int c = 0; c < 4; ++c) s = __fma_rn(static_cast<double>(x[c]), static_cast<double>(x[c]), s);
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) s += __shfl_xor_sync(kFullMask, s, m);
  if (t.lane == 0) partials[t.chunk] = s;
  __syncthreads();
  double total = partials[0];
#pragma unroll
  for (int k = 1; k < kChunks; ++k) total += partials[k];
  const float mean = __fadd_rn(static_cast<float>(total) / kHeadDim, p.eps);
  const float r = static_cast<float>(1.0 / sqrt(static_cast<double>(mean)));
#pragma unroll
  for (int c = 0; c < 4; ++c) x[c] = to_f32(from_f32<bf16_t>(__fmul_rn(__fmul_rn(x[c], r), w[c])));
}

/// Writes the thread's dims of the latent to out[row].
DSV4_DEV void write_out(const Params& p, uint32_t row, const RowLane& t, const Dims& x) {
  Vec<bf16_t, 4> v;
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = from_f32<bf16_t>(x[c]);
  store_vec(p.out + uint64_t{row} * kHeadDim + t.dim, v);
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
/// (load_rope of the row's RoPE position). Every thread of the block calls it.
template <store::Format F>
DSV4_DEV void store_latent(const Params& p, const RowLane& t, int64_t loc, const Vec<float, 4>& rope, Dims& x) {
  if (t.rope()) {
    const float f[4] = {rope[0], rope[1], rope[2], rope[3]};
    store::rotate_pairs(x, f);
    store::round_to<bf16_t>(x);
  }
  if constexpr (!store::Layout<F>::kFp4Values) store::fp4_fake_quant(x);
  store::write_latent<F>(store::slot_at<F>(p.s, loc), t.dim, store::encode_latent<F>(t.dim, x));
}

}  // namespace dsv4::lowratio
