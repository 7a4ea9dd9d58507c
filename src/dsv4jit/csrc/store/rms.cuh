// RMSNorm of a row: its sum of squares, in the one canonical order every path that stores rows
// shares (so that they agree bit for bit), its RMS scale, and normalize().
//
// The order is defined on the 32-lane layout (lane l holds channels 128k + 4l .. +3 of chunk k):
// each chunk's 4 channels chain their squares (fma, channel order), a lane adds its chunks' partials
// in chunk order, and the 32 lanes add by a butterfly (distances 16 .. 1). A row held by fewer lanes
// runs the butterfly's larger distances inside the thread (the sums are commutative, so both sides
// of a pair agree).
#pragma once

#include "common/warp.cuh"
#include "layout.cuh"
#include "params.cuh"

namespace dsv4::store {

/// A lane's partial of chunk k: its 4 channels' squares, chained.
DSV4_DEV float chunk_partial(const float (&xk)[4]) {
  float q = 0.0f;
#pragma unroll
  for (int c = 0; c < 4; ++c) q = __fmaf_rn(xk[c], xk[c], q);
  return q;
}

/// The row's sum of squares from its lanes' sums of chunk partials (rows on kLanes lanes): `t[w]`
/// is this lane's sum for virtual lane j + kLanes·w of the 32-lane layout.
template <int kLanes>
DSV4_DEV float row_sum(float (&t)[RowLanes<kLanes>::kSpan]) {
  constexpr int kSpan = RowLanes<kLanes>::kSpan;
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
DSV4_DEV float row_sum(float lane_sum) {
  float t[1] = {lane_sum};
  return row_sum<kWarpSize>(t);
}

/// The row's sum of squares from a row on a block of warps, one per chunk (every thread of the block
/// calls it, once): the chunk partials meet in shared memory, and every warp adds lane l's in chunk
/// order and runs the butterfly, so each holds the canonical sum.
DSV4_DEV float block_row_sum(float chunk_partial) {
  constexpr int kChunks = kBlockRowLanes / kWarpSize;
  __shared__ float partials[kChunks][kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  partials[threadIdx.x / kWarpSize][lane] = chunk_partial;
  __syncthreads();
  float t = partials[0][lane];
#pragma unroll
  for (int k = 1; k < kChunks; ++k) t = __fadd_rn(t, partials[k][lane]);
  return row_sum(t);
}

/// The row's sum of squares from the groups of a row of `kLanes` lanes.
template <int kLanes, int G>
DSV4_DEV float sum_squares(const float (&x)[G][4]) {
  if constexpr (kLanes == kBlockRowLanes) {
    static_assert(G == 1, "a thread of a block row holds one group");
    return block_row_sum(chunk_partial(x[0]));
  } else {
    constexpr int kSpan = RowLanes<kLanes>::kSpan;
    float t[kSpan];
#pragma unroll
    for (int w = 0; w < kSpan; ++w) {
      t[w] = chunk_partial(x[w]);  // never -0, so the same as 0 + it
#pragma unroll
      for (int k = 1; k < G / kSpan; ++k) t[w] = __fadd_rn(t[w], chunk_partial(x[k * kSpan + w]));
    }
    return row_sum<kLanes>(t);
  }
}

/// 1 / RMS of a row of format F from its sum of squares.
template <Format F>
DSV4_DEV float rms_scale(const Params& p, float sum_squares) {
  return 1.0f / sqrtf(__fadd_rn(sum_squares / Layout<F>::kHeadDim, p.eps));
}

/// Normalizes N channels of a row with the row's RMS scale `r`, in the reference's order
/// (y = (x * r) * w, without fused multiply-adds).
template <int N>
DSV4_DEV void normalize(float (&x)[N], const float (&w)[N], float r) {
#pragma unroll
  for (int c = 0; c < N; ++c) x[c] = __fmul_rn(__fmul_rn(x[c], r), w[c]);
}

}  // namespace dsv4::store
