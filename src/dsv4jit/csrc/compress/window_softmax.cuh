// The window softmax of the compressor (contract §4.1), one primitive for every kernel that pools:
// out[c] = Σ_s kv[s][c]·exp(z[s][c] − m) / Σ_s exp(z[s][c] − m), z = score + ape, in fp32.
// A thread pools the slots it holds into a partial (max, sum, weighted sum); partials of other
// slot groups merge exactly (max-rescaling), so any split of the window gives the same function.
#pragma once

#include <cmath>

#include "common/types.cuh"
#include "common/warp.cuh"

namespace dsv4 {

template <int C>
struct SoftmaxPartial {
  float max[C];
  float sum[C];
  float acc[C];
};

inline constexpr float kLog2e = 1.4426950408889634f;

/// The shift of a partial whose largest z is m: m itself, or 0 when every slot is masked (m = -inf,
/// every z = -inf), so that each weight below is exp(-inf) = 0 instead of exp(NaN).
DSV4_DEV float softmax_shift(float m) { return m == -INFINITY ? 0.0f : m; }

/// exp(z - shift) on the SFU (ex2.approx). Results below 2^-126 flush to 0: the window's largest
/// slot weighs 1, so a flushed weight changes no sum by more than one part in 2^126.
DSV4_DEV float softmax_weight(float z, float shift) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"((z - shift) * kLog2e));
  return e;
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
    const float shift = softmax_shift(m);
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int s = 0; s < N; ++s) {
      const float e = softmax_weight(z[s][c], shift);
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
    const float m = fmaxf(a.max[c], b.max[c]), shift = softmax_shift(m);
    const float wa = softmax_weight(a.max[c], shift), wb = softmax_weight(b.max[c], shift);
    a.sum[c] = a.sum[c] * wa + b.sum[c] * wb;
    a.acc[c] = a.acc[c] * wa + b.acc[c] * wb;
    a.max[c] = m;
  }
}

/// The warp of a unit that holds its pooled partial (pool_unit): warp 0, or with slices in turn
/// (the block pools a row's slices one after another) warp s % kWarps for slice s, so no warp
/// waits on a sum before it loads the next slice.
template <int kWarps, bool kSlicesInTurn>
DSV4_DEV constexpr int merging_warp(int slice) {
  return kSlicesInTurn ? slice % kWarps : 0;
}

/// The unit channel of the first of the C / kMergeWarps channels that merging thread
/// `merge_thread` (warp_in_unit · 32 + lane, below 32 · kMergeWarps) holds after pool_unit.
template <int kMergeWarps, int C>
DSV4_DEV constexpr int merged_channel(int merge_thread) {
  return merge_thread * (C / kMergeWarps);
}

/// Pools a unit's window, N slots per warp in registers, kWarps warps of one block; true in the
/// threads that then hold the unit's partial. Each warp pools its slots; after one barrier the
/// merging threads take the window's max over the warps' partials first, so every partial's
/// rescaling weight is independent of the others (no chain of exps). kMergeWarps warps merge,
/// C / kMergeWarps channels per thread (merged_channel): spreading the merge over C warps halves
/// the serial tail that holds the block after its last load. With kSlicesInTurn (the block pools
/// a row's slices one after another) one warp merges, merging_warp(slice), and slice s uses
/// buffer s % 2, as the previous slice's may still be read. Every thread of the block calls it.
template <int kWarps, bool kSlicesInTurn, int kMergeWarps, int N, int C>
DSV4_DEV bool pool_unit(const float (&kv)[N][C], const float (&z)[N][C], int warp_in_unit, int slice,
                        SoftmaxPartial<C / kMergeWarps>& part) {
  static_assert(C % kMergeWarps == 0 && (kMergeWarps == 1 || (!kSlicesInTurn && kMergeWarps <= kWarps)));
  constexpr int M = C / kMergeWarps;  // channels per merging thread
  const SoftmaxPartial<C> mine = pool_slots(kv, z);
  if constexpr (kWarps == 1) {
    static_assert(kMergeWarps == 1);
    part = mine;
  } else {
    struct Exchange {  // one array per field, channel-major: conflict-free for either merge width
      float max[kWarps][kWarpSize * C];
      float sum[kWarps][kWarpSize * C];
      float acc[kWarps][kWarpSize * C];
    };
    __shared__ Exchange buffers[kSlicesInTurn ? 2 : 1];
    Exchange& x = buffers[kSlicesInTurn ? slice % 2 : 0];
    const int lane_id = threadIdx.x % kWarpSize;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      x.max[warp_in_unit][lane_id * C + c] = mine.max[c];
      x.sum[warp_in_unit][lane_id * C + c] = mine.sum[c];
      x.acc[warp_in_unit][lane_id * C + c] = mine.acc[c];
    }
    __syncthreads();
    if constexpr (kSlicesInTurn) {
      if (warp_in_unit != merging_warp<kWarps, true>(slice)) return false;
    } else if (warp_in_unit >= kMergeWarps) {
      return false;
    }
    const int first = merged_channel<kMergeWarps, C>(kSlicesInTurn ? lane_id : warp_in_unit * kWarpSize + lane_id);
#pragma unroll
    for (int c = 0; c < M; ++c) {
      float m = x.max[0][first + c];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) m = fmaxf(m, x.max[w][first + c]);
      const float shift = softmax_shift(m);
      float sum = 0.0f, acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float e = softmax_weight(x.max[w][first + c], shift);
        sum += x.sum[w][first + c] * e;
        acc += x.acc[w][first + c] * e;
      }
      part.max[c] = m;
      part.sum[c] = sum;
      part.acc[c] = acc;
    }
  }
  return true;
}

/// The pooled value of channel c: Σ kv·weight / Σ weight (sum >= 1: its largest weight is 1).
template <int C>
DSV4_DEV float pooled_value(const SoftmaxPartial<C>& p, int c) {
  return __fdividef(p.acc[c], p.sum[c]);
}

}  // namespace dsv4
