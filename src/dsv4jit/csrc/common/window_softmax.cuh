// The window softmax of the compressor (contract §4.1), one primitive for every kernel that pools:
// out[c] = Σ_s kv[s][c]·exp(z[s][c] − m) / Σ_s exp(z[s][c] − m), z = score + ape, in fp32.
// A thread pools the slots it holds into a partial (max, sum, weighted sum); partials of other
// slot groups merge exactly (max-rescaling), so any split of the window gives the same function.
#pragma once

#include <cmath>

#include "types.cuh"
#include "warp.cuh"

namespace dsv4 {

template <int C>
struct SoftmaxPartial {
  float max[C];
  float sum[C];
  float acc[C];
};

DSV4_DEV float exp_shifted(float z, float m) {
  // A masked slot has z = -inf (kv = 0): its weight is exactly 0. m is finite unless every slot
  // of this partial is masked, which only an empty partial is (then it contributes nothing).
  return m == -INFINITY ? 0.0f : __expf(z - m);
}

/// Two-pass pooling of N slots held in registers: the max first, then one exp per slot.
template <int N, int C>
DSV4_DEV SoftmaxPartial<C> pool_slots(const float (&kv)[N][C], const float (&z)[N][C]) {
  SoftmaxPartial<C> p;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float m = z[0][c];
#pragma unroll
    for (int s = 1; s < N; ++s) m = fmaxf(m, z[s][c]);
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const float e = exp_shifted(z[s][c], m);
      sum += e;
      acc += kv[s][c] * e;
    }
    p.max[c] = m;
    p.sum[c] = sum;
    p.acc[c] = acc;
  }
  return p;
}

/// a := a ∪ b (partials over disjoint slot sets).
template <int C>
DSV4_DEV void merge_into(SoftmaxPartial<C>& a, const SoftmaxPartial<C>& b) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const float m = fmaxf(a.max[c], b.max[c]);
    const float wa = exp_shifted(a.max[c], m), wb = exp_shifted(b.max[c], m);
    a.sum[c] = a.sum[c] * wa + b.sum[c] * wb;
    a.acc[c] = a.acc[c] * wa + b.acc[c] * wb;
    a.max[c] = m;
  }
}

/// The warp of a unit that merges its partials (merge_warps): warp 0, or with slices in turn (the
/// block pools a row's slices one after another) warp s % kWarps for slice s, so no warp waits on
/// a merge before it loads the next slice.
template <int kWarps, bool kSlicesInTurn>
DSV4_DEV constexpr int merging_warp(int slice) {
  return kSlicesInTurn ? slice % kWarps : 0;
}

/// Merges the partials of a unit's kWarps warps (one block's warps, through shared memory) into
/// `part` of the merging warp, warp 0's first and the others in warp order; true in that warp.
/// With slices in turn, slice s uses buffer s % 2 (the previous slice's may still be read).
template <int kWarps, bool kSlicesInTurn, int C>
DSV4_DEV bool merge_warps(SoftmaxPartial<C>& part, int warp_in_unit, int slice) {
  __shared__ SoftmaxPartial<C> parts[kSlicesInTurn ? 2 : 1][kWarps][kWarpSize];
  const int buffer = kSlicesInTurn ? slice % 2 : 0;
  const int lane_id = threadIdx.x % kWarpSize;
  parts[buffer][warp_in_unit][lane_id] = part;
  __syncthreads();
  if (warp_in_unit != merging_warp<kWarps, kSlicesInTurn>(slice)) return false;
  if constexpr (kSlicesInTurn) part = parts[buffer][0][lane_id];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) merge_into(part, parts[buffer][w][lane_id]);
  return true;
}

template <int C>
DSV4_DEV float pooled_value(const SoftmaxPartial<C>& p, int c) {
  return p.acc[c] / p.sum[c];
}

}  // namespace dsv4
