// The 128-point Walsh–Hadamard transform of an indexer row, held by the lanes of its row.
#pragma once

#include "common/warp.cuh"
#include "layout.cuh"

namespace dsv4::store {

/// Butterfly step of the Hadamard transform on one pair: (lo, hi) -> (lo + hi, lo - hi).
DSV4_DEV void hadamard_pair(float& lo, float& hi) {
  const float sum = lo + hi, diff = lo - hi;
  lo = sum, hi = diff;
}

/// 128^-1/2, the Hadamard transform's normalization.
inline constexpr float kHadamardScale = 0.08838834764831845f;

/// Walsh–Hadamard butterflies over a row's 128 values (natural order), before the 128^-1/2
/// scale, held by `kLanes` lanes (lane j, group w: channels 4(j + kLanes·w) .. +3). Distances in
/// increasing order: 1, 2 inside a group, then across lanes, then across this lane's groups.
template <int kLanes>
DSV4_DEV void hadamard128(float (&v)[RowLanes<kLanes>::kSpan][4], int j) {
  constexpr int kSpan = RowLanes<kLanes>::kSpan;
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

}  // namespace dsv4::store
