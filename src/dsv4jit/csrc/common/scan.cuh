// Block-wide exclusive prefix sum of one value per thread.
#pragma once

#include "warp.cuh"

namespace dsv4 {

/// Exclusive scan across a block of kThreads threads; `total` receives the block sum.
/// `scratch` holds kThreads / 32 + 1 words of shared memory; every thread must call it.
template <int kThreads>
DSV4_DEV uint32_t block_exclusive_scan(uint32_t value, uint32_t* scratch, uint32_t& total) {
  static_assert(kThreads % kWarpSize == 0 && kThreads / kWarpSize <= kWarpSize);
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const uint32_t inclusive = warp_inclusive_scan(value);
  if (lane == kWarpSize - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = lane < kWarps ? scratch[lane] : 0;
    const uint32_t w_inclusive = warp_inclusive_scan(w);
    if (lane < kWarps) scratch[lane] = w_inclusive - w;
    if (lane == kWarps - 1) scratch[kWarps] = w_inclusive;
  }
  __syncthreads();
  const uint32_t result = scratch[warp] + inclusive - value;
  total = scratch[kWarps];
  __syncthreads();  // scratch is reused by the next call
  return result;
}

}  // namespace dsv4
