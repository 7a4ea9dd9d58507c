// Warp-level reductions and scans (32 lanes, full mask), with the in-thread step that precedes one.
#pragma once

#include "types.cuh"

namespace dsv4 {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

/// Largest value over `lanes` neighbouring lanes (a power of two, aligned): every lane of the
/// group ends with it (a butterfly, so the whole warp must take part).
DSV4_DEV float reduce_amax(float a, int lanes) {
  for (int m = lanes / 2; m > 0; m /= 2) a = fmaxf(a, __shfl_xor_sync(kFullMask, a, m));
  return a;
}

/// Largest magnitude of 4 values (within the thread).
DSV4_DEV float amax4(const float (&v)[4]) {
  return fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
}

/// Inclusive prefix sum across the warp.
template <typename T>
DSV4_DEV T warp_inclusive_scan(T x) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const T y = __shfl_up_sync(kFullMask, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

}  // namespace dsv4
