// The ring compressors' kernels and host entry points (contract §4: c4 and c128): compress_forward's
// prefill (the pool pass and the write pass, or both in one grid: ring_units.cuh) and decode (a block
// per unit, or for large c128 batches the grid of resident blocks: ring_resident.cuh). Every tensor
// is checked before any launch (host_entry.h).
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>

#include "common/launch.cuh"
#include "common/tensor_check.h"
#include "host_entry.h"
#include "ring_resident.cuh"
#include "ring_units.cuh"

namespace dsv4::compress {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

/// A decode pass's grid: the resident blocks (ResidentDecode) or a block per unit, and the rows one
/// wave of blocks covers where a block-per-unit grid prefetches a wave ahead (else 0).
struct DecodeLaunch {
  bool resident;
  unsigned blocks;
  uint32_t ahead_rows;
};

template <typename K>
__global__ __launch_bounds__(K::kThreads, K::kMinBlocks) void prefill_pool_kernel(const __grid_constant__ Params p) {
  typename K::OutputRows sink{p};
  K::prefill_pool(p, K::Lane::of(K::kUnitsPerBlock, K::W::kWarpsPerUnit), sink);
}

template <typename K>
__global__ __launch_bounds__(K::kWriteUnitsPerBlock * kWarpSize) void prefill_write_kernel(const __grid_constant__ Params p) {
  K::prefill_write(p, blockIdx.x);
}

/// Both prefill passes in one grid, where the pool pass reads no state row (Kernels::prefill_one_grid).
template <typename K>
__global__ __launch_bounds__(K::kThreads, K::kMinBlocks) void prefill_one_grid_kernel(const __grid_constant__ Params p) {
  K::prefill_one_grid(p, blockIdx.x, [&](uint32_t block) {
    typename K::OutputRows sink{p};
    K::prefill_pool(p, K::Lane::of(K::kUnitsPerBlock, K::W::kWarpsPerUnit, block), sink);
  });
}

template <typename K>
__global__ __launch_bounds__(K::kThreads, K::kMinBlocks) void decode_kernel(const __grid_constant__ Params p) {
  typename K::OutputRows sink{p};
  K::decode(p, K::Lane::of(K::kUnitsPerBlock, K::W::kWarpsPerUnit), sink);
}

/// A kernel of its own: the two decode paths' registers never meet.
template <typename D>
__global__ __launch_bounds__(D::K::kThreads, D::K::kMinBlocks) void decode_resident_kernel(const __grid_constant__ Params p) {
  typename D::K::OutputRows sink{p};
  D::run(p, sink);
}

/// Host entry points of one instantiation (checks every tensor before any launch).
template <int kRatio, int kHeadDim, typename BufferT, typename InT, typename OutT, bool kPDL>
struct CompressEntry : CompressorEntryBase<CompressEntry<kRatio, kHeadDim, BufferT, InT, OutT, kPDL>, WritePlan> {
  using K = Kernels<kRatio, kHeadDim, BufferT, InT, OutT, kPDL>;
  using Resident = ResidentDecode<kRatio, kHeadDim, BufferT, InT, OutT, kPDL>;
  using W = typename K::W;
  static constexpr const char* kOp = "compress_forward";

  /// CompressorEntryBase's checks of the state ring [pages, R, row width], input and ape (and `out`);
  /// `input_rows` and `out_rows` bind the row counts.
  static Params common(const char* op, Device& dev, const TensorView& state, const TensorView& input,
                       const TensorView& ape, const TensorView* out, int32_t* status, Size& input_rows,
                       Size& out_rows) {
    Params p{};
    Size pages{"num_pages"};
    Check(op, "kv_score_buffer", state).pool(pages, kRatio, W::kRowWidth).dtype(DTypeInfo<BufferT>::dtype)
        .cuda(dev).contiguous().aligned();
    Check(op, "kv_score_input", input).shape({input_rows, W::kRowWidth}).dtype(DTypeInfo<InT>::dtype).cuda(dev)
        .contiguous().aligned();
    Check(op, "ape", ape).shape({W::kSlots, kHeadDim}).dtype(DTypeInfo<InT>::dtype).cuda(dev).contiguous().aligned();
    p.out = CompressEntry::template output<OutT>(op, dev, out, kHeadDim, out_rows);
    p.state = state.data_ptr();
    p.input = input.data_ptr();
    p.ape = ape.data_ptr();
    p.num_pages = pages.value;
    p.num_input_rows = input_rows.value;
    p.status = status;
    return p;
  }

  static unsigned blocks(uint64_t rows, int units_per_block) { return div_ceil(rows * W::kSlices, units_per_block); }

  static void launch_pool(const char* op, const Device& dev, const Params& p) {
    launch(op, dev.dev, {blocks(p.num_rows, K::kUnitsPerBlock), K::kThreads}, kPDL, prefill_pool_kernel<K>, p);
  }

  static void launch_write(const char* op, const Device& dev, const Params& p) {
    launch(op, dev.dev, {write_blocks(p.num_rows), K::kWriteUnitsPerBlock * kWarpSize}, kPDL, prefill_write_kernel<K>,
           p);
  }

  static unsigned write_blocks(uint64_t rows) { return K::write_blocks(rows, K::kWriteUnitsPerBlock); }

  /// compress_forward's prefill entry point: the pool pass and the write pass; one grid where the
  /// plan says that the pool pass reads no state row (`reads_state` false) and the call is not
  /// captured into a CUDA graph (a graph replays whatever plan its buffers hold later).
  static void prefill(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_rows,
                      TensorView plan_w, TensorView out, Optional<TensorView> status, bool reads_state) {
    Device dev;
    Size rows_c{"plan_c_rows"}, rows_w{"plan_w_rows"};
    auto p = CompressEntry::prefill_params(kOp, dev, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, &out,
                                           nullptr, rows_c, rows_w);
    p.status = status_words(kOp, dev, status);
    launch_prefill(kOp, dev, p, rows_w.value, reads_state);
  }

  /// The two passes of a checked prefill (`rows_w` plan_w rows): one grid when the pool pass reads
  /// no state row and no graph captures the launch, else two launches in stream order.
  static void launch_prefill(const char* op, const Device& dev, Params p, int64_t rows_w, bool reads_state) {
    if (reads_state || capturing(op, dev.dev)) {
      CompressEntry::CompressorEntryBase::launch_prefill(op, dev, p, rows_w);
      return;
    }
    p.write_rows = static_cast<uint32_t>(rows_w);
    launch(op, dev.dev, {K::one_grid_blocks(p.num_rows, rows_w), K::kThreads}, kPDL, prefill_one_grid_kernel<K>, p);
  }

  /// How a decode of `rows` rows launches: c128 rows that a block per unit would take more than
  /// kMaxDecodeWaves waves of blocks to cover run on the grid of resident blocks (ResidentDecode: at
  /// least its kMinDecodeGrid, at most a block per unit). Up to it the block-per-unit grid measured
  /// faster (a whole model step of 128 requests, where a boundary row's chain sets a layer's time;
  /// requests all at a boundary); beyond it each wave of blocks costs a plan round trip (256
  /// requests: docs/design-notes.md). A block-per-unit grid of more than one wave prefetches for the
  /// unit a wave ahead (ahead_rows: the rows one wave covers).
  static DecodeLaunch decode_launch(const char* op, DLDevice dev, uint64_t rows) {
    const uint64_t wave = static_cast<uint64_t>(multiprocessors(op, dev)) * K::kMinBlocks;
    if (W::kWarpsPerUnit > 1 && rows * W::kSlices > kMaxDecodeWaves * wave) {
      return {true, static_cast<unsigned>(std::min(rows * W::kSlices, std::max<uint64_t>(wave, Resident::kMinDecodeGrid))),
              0};
    }
    const bool waves = rows * W::kSlices > wave * K::kUnitsPerBlock;
    return {false, blocks(rows, K::kUnitsPerBlock),
            waves ? static_cast<uint32_t>(wave * K::kUnitsPerBlock / W::kSlices) : 0u};
  }
  static constexpr uint64_t kMaxDecodeWaves = 4;

  static void launch_decode(const char* op, const Device& dev, Params p) {
    const DecodeLaunch grid = decode_launch(op, dev.dev, p.num_rows);
    if constexpr (W::kWarpsPerUnit > 1) {
      if (grid.resident) {
        launch(op, dev.dev, {grid.blocks, K::kThreads}, kPDL, decode_resident_kernel<Resident>, p);
        return;
      }
    }
    p.ahead_rows = grid.ahead_rows;
    launch(op, dev.dev, {grid.blocks, K::kThreads}, kPDL, decode_kernel<K>, p);
  }
};

}  // namespace dsv4::compress
