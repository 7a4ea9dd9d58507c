// Thread coordinates of the pooling kernels: a unit is (row, channel slice), one or more warps of
// one block; lane l of a unit holds the C channels from (slice·32 + l)·C.
#pragma once

#include "common/types.cuh"
#include "common/warp.cuh"

namespace dsv4 {

template <int C, int kSlicesPerRow>
struct UnitLane {
  static constexpr int kSlices = kSlicesPerRow;
  uint32_t row;
  int warp_in_unit;
  int channel;  // first of this lane's C channels

  /// Units of `warps_per_unit` warps, `units_per_block` to a block, numbered over (row, slice).
  DSV4_DEV static UnitLane of(int units_per_block, int warps_per_unit) {
    return of(units_per_block, warps_per_unit, blockIdx.x);
  }

  /// As the lane of block `block` of the pass's grid (a grid that runs two passes, fused/layer.cuh).
  DSV4_DEV static UnitLane of(int units_per_block, int warps_per_unit, uint32_t block) {
    const int warp = threadIdx.x / kWarpSize;
    const uint64_t unit = uint64_t{block} * units_per_block + warp / warps_per_unit;
    const int slice = static_cast<int>(unit % kSlices);
    return {static_cast<uint32_t>(unit / kSlices), warp % warps_per_unit, first_channel(slice)};
  }

  /// Slices in turn: the block is row blockIdx.x's unit for every slice.
  DSV4_DEV static UnitLane of_slice(int slice) {
    return {blockIdx.x, static_cast<int>(threadIdx.x / kWarpSize), first_channel(slice)};
  }

  DSV4_DEV static int first_channel(int slice) {
    return (slice * kWarpSize + static_cast<int>(threadIdx.x % kWarpSize)) * C;
  }
};

}  // namespace dsv4
