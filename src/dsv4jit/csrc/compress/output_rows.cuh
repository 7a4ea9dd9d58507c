// Where compress_forward's pooled rows go: row lane.row of `out` [rows, head_dim]. The pool passes
// hand every unit's result to a sink: prepare() once the row is known valid, emit() by every thread
// of the unit, `holds` in the threads with the values. The fused kernels' sink stores the rows in
// the cache instead (fused/fused.cuh).
#pragma once

#include <cstdint>

#include "common/types.cuh"
#include "common/vec.cuh"

namespace dsv4 {

/// Params: the compressor's parameters (its `out`); kMergeWarpsOfUnit: how many warps of a unit
/// merge its partials (1, or C for one channel per thread); emit() needs only the threads that hold
/// values (kHoldersOnly), so the others may leave as soon as the plan row shows they hold none.
template <typename Params, typename OutT, int kHeadDim, int kMergeWarpsOfUnit = 1>
struct OutputRows {
  static constexpr int kMergeWarps = kMergeWarpsOfUnit;
  static constexpr bool kHoldersOnly = true;
  static constexpr bool kTakesIdleRows = true;  // decode rows off a boundary are zero-filled
  const Params& p;

  template <typename Lane>
  DSV4_DEV void prepare(const Lane&) {}

  template <typename Lane, int N>
  DSV4_DEV void emit(const Lane& lane, bool holds, const float (&v)[N]) {
    if (!holds) return;
    Vec<OutT, N> out;
#pragma unroll
    for (int c = 0; c < N; ++c) out[c] = from_f32<OutT>(v[c]);
    store_vec(static_cast<OutT*>(p.out) + uint64_t{lane.row} * kHeadDim + lane.channel, out);
  }
};

}  // namespace dsv4
