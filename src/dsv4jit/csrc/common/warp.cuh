// Warp-level reductions and scans (32 lanes, full mask).
#pragma once

#include "types.cuh"

namespace dsv4 {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
DSV4_DEV T warp_sum(T x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
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
