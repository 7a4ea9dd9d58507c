// The store step as the sink of a pool pass (compress/ring_units.cuh, compress/online.cuh): the pooled
// values of a unit go through RMSNorm, RoPE, quantization and the paged store without reaching
// global memory.
//
//   StoreStep        one-warp units (c4, online decode): a warp holds one 128-channel chunk of the
//                    store layout (lane l: channels 128k + 4l..) and stores it; the row's warps (4
//                    for hd512, 1 for hd128) share the chunk partials of the row's sum of squares
//                    (store/rms.cuh's canonical order) through shared memory. The norm weight and
//                    rope values are prefetched with cp.async as soon as the plan row is read,
//                    overlapping the window loads.
//   LastSliceStores  block units (ring c128 decode): a block pools one 64-channel slice of a row and
//                    writes it to the row's line of a scratch buffer; the last of the row's 8 blocks
//                    to finish (a counter per row) stores the row with the store kernel's own row
//                    step, from the norm weight, rope row and location each block copied into
//                    shared memory while its window loaded. No block waits for another.
//   SliceGather      slices in turn (online prefill): one block pools a row's 8 slices one after
//                    another, gathers the row in shared memory and hands it to a StoreStep as
//                    one-warp chunks.
#pragma once

#include "common/async_copy.cuh"
#include "store/indexer_codec.cuh"
#include "store/layout.cuh"
#include "store/params.cuh"
#include "store/rms.cuh"
#include "store/rope.cuh"
#include "store/rows.cuh"
#include "store/store.cuh"
#include "store/latent_codec.cuh"

namespace dsv4::fused {

template <typename CompressParams>
struct Params {
  CompressParams c;
  store::Params s;
  void* rows;            // block units: [rows, hd] scratch of the pooled rows (s.kv reads it back)
  int32_t* row_counts;   // block units: the slices counted per row, zero between calls
};

/// The store step behind a pool pass whose units hold C channels per lane, kWarpsPerUnit warps
/// each, kUnitsPerBlock units per block: its shared memory and the sink the pass emits rows into.
template <typename InT, store::Format F, int C, int kWarpsPerUnit, int kUnitsPerBlock>
struct StoreStep {
  using L = store::Layout<F>;
  static constexpr int kHeadDim = L::kHeadDim;
  static constexpr int kUnitChannels = kWarpSize * C;
  static constexpr int kSlices = kHeadDim / kUnitChannels;
  static constexpr int kRowsPerBlock = kUnitsPerBlock / kSlices;
  static constexpr int kChunks = L::kChunks;
  static_assert(kWarpsPerUnit == 1 && kUnitChannels == 128 && kUnitsPerBlock % kSlices == 0,
                "a one-warp unit holds a store chunk");
  static_assert(kSlices == 1 || kRowsPerBlock == 1, "rows spread over warps own their block (uniform exits)");

  struct Shared {
    float partials[kRowsPerBlock][kChunks][kWarpSize];  // [chunk][lane of the store layout]
    alignas(16) InT weight[kRowsPerBlock][kHeadDim];
    alignas(16) float freq[kRowsPerBlock][store::kRopeDim];
  };

  /// The sink the pool passes hand pooled rows to: every unit stores its own slice of the row.
  /// A unit's warp holds its pooled values (a lane's C channels, the store layout), and every
  /// thread reaches emit(): the row's warps exchange partials there.
  struct Sink {
    static constexpr int kMergeWarps = 1;
    static constexpr bool kHoldersOnly = false;
    static constexpr bool kTakesIdleRows = false;  // a decode row off a boundary is not stored
    const store::Params& p;
    Shared& sh;
    int64_t loc = 0, position = 0;
    bool stores = false;  // in the slice's first warp: this row goes to the cache

    DSV4_DEV int row_in_block() const { return kRowsPerBlock == 1 ? 0 : threadIdx.x / kWarpSize; }

    template <typename Lane>
    DSV4_DEV void prepare(const Lane& lane) {
      if (lane.warp_in_unit != 0) return;
      // Branch on plan values only: the out_loc load stays in flight, next to the window loads.
      stores = store::select<kWarpSize>(p, lane.row, loc, position);
      if (!stores) return;
      const int r = row_in_block();
      const InT* weight = static_cast<const InT*>(p.norm_weight);
      cp_async<C * sizeof(InT)>(&sh.weight[r][lane.channel], weight + lane.channel);
      if (rope_channel(lane) >= 0 && store::position_ok(p, position)) {
        cp_async<C * sizeof(float)>(&sh.freq[r][rope_channel(lane)],
                                    p.freq + position * store::kRopeDim + rope_channel(lane));
      }
    }

    /// Offset of this lane's channels in the trailing rope dims (negative: not a rope lane).
    template <typename Lane>
    DSV4_DEV static int rope_channel(const Lane& lane) { return lane.channel - (kHeadDim - store::kRopeDim); }

    template <typename Lane>
    DSV4_DEV void emit(const Lane& lane, bool holds, const float (&v)[C]) {
      const int l = threadIdx.x % kWarpSize, r = row_in_block();
      const int slice = lane.channel / kUnitChannels;
      float x[C];
#pragma unroll
      for (int c = 0; c < C; ++c) x[c] = to_f32(from_f32<InT>(v[c]));  // as the two-step path reads it back
      if constexpr (kSlices > 1) {
        if (holds) sh.partials[r][slice][l] = store::chunk_partial(x);
        __syncthreads();
        if (!stores) return;
      } else {
        if (!stores) return;
        sh.partials[r][0][l] = store::chunk_partial(x);  // read back by this lane only
      }
      float lane_sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) lane_sum = __fadd_rn(lane_sum, sh.partials[r][k][l]);
      const float total = store::row_sum(lane_sum);
      if (!store::check<kWarpSize>(p, loc, position)) return;
      cp_async_wait_all();  // each lane reads only what its own cp.async brought
      float w[C], f[C];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        w[c] = to_f32(sh.weight[r][lane.channel + c]);
        f[c] = rope_channel(lane) >= 0 ? sh.freq[r][rope_channel(lane) + c] : 0.0f;
      }
      const float scale = store::rms_scale<F>(p, total);
      store::normalize_group<F, InT>(l + kWarpSize * slice, x, w, scale, f);
      store_chunk(store::slot_at<F>(p, loc), slice, x, l);
    }

    /// Quantizes a normalized chunk k of the 32-lane layout and stores it (with its scales) in `slot`.
    DSV4_DEV static void store_chunk(const store::Slot& slot, int k, float (&x)[4], int lane) {
      if constexpr (L::kIndexer) {
        float(&v)[1][4] = reinterpret_cast<float(&)[1][4]>(x);
        const auto codes = store::encode_indexer<F, kWarpSize>(v, lane, store::Fp4ByRule{});
        store::write_indexer<F, kWarpSize>(slot, lane, codes);
      } else {
        store::write_latent<F>(slot, 128 * k + 4 * lane, store::encode_latent<F>(128 * k + 4 * lane, x));
      }
    }
  };

  template <typename P>
  static DSV4_DEV Sink sink(const P& p, Shared& sh) {
    return {p.s, sh};
  }
};

/// The store step behind the ring c128 decode passes, whose units are blocks that each pool one 64-channel
/// slice of a row (merged by one warp). A slice block writes its values, as the two-step path
/// stores them (InT), to the row's line of the scratch buffer and counts itself in the row's
/// counter; the block that completes the count reads the row back and stores it with the store
/// kernel's row step (store/store.cuh), so the cache bytes are the two-step path's by construction.
/// Every block of a row counts itself or none does (they all read the same plan row), and the last
/// one zeroes the count, so the counters are zero between calls; the next call on them (and on the
/// scratch) waits for this one (pdl_wait_upstream before any access).
template <typename InT, store::Format F, bool kPDL, int kSlices>
struct LastSliceStores {
  using RowStore = store::Kernel<InT, F, kPDL, kWarpSize>;
  static constexpr int kHeadDim = store::Layout<F>::kHeadDim;
  static_assert(!store::Layout<F>::kIndexer, "ring c128 rows are latent rows");
  /// The row store's operands, brought in while a decode row pools (Sink::preload).
  struct Shared {
    alignas(16) InT weight[kHeadDim];
    alignas(16) float freq[store::kRopeDim];
    alignas(8) int64_t loc;  // the row's out_loc entry (int32 or int64: store::loc_entry reads it)
    uint32_t seq_len;
  };

  struct Sink {
    static constexpr int kMergeWarps = 1;
    static constexpr bool kHoldersOnly = true;
    static constexpr bool kTakesIdleRows = false;  // a decode row off a boundary is not stored
    const store::Params& p;
    Shared& sh;
    InT* rows;
    int32_t* row_counts;

    template <typename Lane>
    DSV4_DEV void prepare(const Lane&) {}

    /// A decode row the store step takes (`seq_len`: its plan row's): the merging warp of each of
    /// its blocks copies the norm weight, the rope row and the location into shared memory while
    /// the window loads, so that the block which stores the row waits only for the other slices
    /// (store::PreloadedOperands), not for the weight and the plan -> location -> rope chain.
    template <typename Lane>
    DSV4_DEV void preload(const Lane& lane, uint32_t seq_len) {
      if (lane.warp_in_unit != 0) return;
      const int l = threadIdx.x % kWarpSize;
      constexpr int kWeightCopies = kHeadDim * sizeof(InT) / 16;
      static_assert(kWeightCopies % kWarpSize == 0 && store::kRopeDim * sizeof(float) / 16 <= kWarpSize - 1);
#pragma unroll
      for (int i = l; i < kWeightCopies; i += kWarpSize) {
        cp_async<16>(reinterpret_cast<char*>(sh.weight) + 16 * i, static_cast<const char*>(p.norm_weight) + 16 * i);
      }
      const int64_t position = store::rope_position(p, seq_len);
      if (l < store::kRopeDim / 4 && store::position_ok(p, position)) {
        cp_async<16>(&sh.freq[4 * l], p.freq + position * store::kRopeDim + 4 * l);
      }
      if (l == 0) sh.seq_len = seq_len;
      if (l == kWarpSize - 1) {
        if (p.loc64) {
          cp_async<8>(&sh.loc, static_cast<const int64_t*>(p.out_loc) + lane.row);
        } else {
          cp_async<4>(&sh.loc, static_cast<const int32_t*>(p.out_loc) + lane.row);
        }
      }
    }

    /// The operands preload() brought in, once every lane's copies are waited for and the warp has
    /// met (each lane reads what others copied); the selection is store::select()'s.
    DSV4_DEV store::PreloadedOperands<InT> preloaded_operands() const {
      return {sh.weight, sh.freq, store::loc_entry(p, &sh.loc, 0), store::rope_position(p, sh.seq_len),
              store::closes_window(p, sh.seq_len)};
    }

    template <typename Lane, int C>
    DSV4_DEV void emit(const Lane& lane, bool holds, const float (&v)[C]) {
      if (!holds) return;  // all of the merging warp holds its slice
      const int l = threadIdx.x % kWarpSize;
      Vec<InT, C> out;
#pragma unroll
      for (int c = 0; c < C; ++c) out[c] = from_f32<InT>(v[c]);
      store_vec(rows + uint64_t{lane.row} * kHeadDim + lane.channel, out);
      __threadfence();  // the slice is visible before it is counted
      __syncwarp();
      int before = 0;
      if (l == 0) before = fetch_add_acquire(row_counts + lane.row);
      before = __shfl_sync(kFullMask, before, 0);
      // Every row that reaches here was preloaded: the decode passes call preload() for each row
      // they hand over, and ring c128 prefills run as two steps (no fused pass).
      cp_async_wait_all();  // no copy lands after the block has left
      if (before != kSlices - 1) return;
      __syncwarp();  // lane 0's acquire orders every lane's reads of the other slices (and of sh)
      if (l == 0) row_counts[lane.row] = 0;  // the row's blocks are done with it: zero for the next call
      RowStore::store_latent_row(p, lane.row, l, preloaded_operands());
    }

    /// The count before this one, with acquire semantics: what the blocks counted before wrote
    /// (each fenced its slice before counting) is visible to the loads that follow.
    DSV4_DEV static int fetch_add_acquire(int32_t* count) {
      int before;
      asm volatile("atom.acquire.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
      return before;
    }
  };

  template <typename P>
  static DSV4_DEV Sink sink(const P& p, Shared& sh) {
    return {p.s, sh, static_cast<InT*>(p.rows), p.row_counts};
  }
};

/// Slices in turn: a block pools one row's slices one after another (the compress kernels' units
/// with the block as every slice's unit) and gathers them in shared memory; after the last slice
/// its first warps hand the row to the store step as one-warp 128-channel chunks.
template <typename Lane, typename StoreSink, int kHeadDim, int kSliceChannels, int C>
struct SliceGather {
  static constexpr int kChunks = kHeadDim / 128;
  StoreSink& sink;
  float (&row)[kHeadDim];

  /// This thread as a lane of the store step: warps 0..kChunks-1 hold chunk `warp`.
  DSV4_DEV static Lane store_lane(uint32_t row) {
    const int warp = threadIdx.x / kWarpSize;
    return {row, warp < kChunks ? 0 : 1, 128 * warp + 4 * static_cast<int>(threadIdx.x % kWarpSize)};
  }
  DSV4_DEV void prepare(const Lane& lane) {
    if (lane.channel < kSliceChannels) sink.prepare(store_lane(lane.row));  // once, on the first slice
  }
  DSV4_DEV void emit(const Lane& lane, bool holds, const float (&v)[C]) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (holds) row[lane.channel + c] = v[c];
    }
    if (lane.channel / kSliceChannels != kHeadDim / kSliceChannels - 1) return;
    __syncthreads();  // every slice is in `row`
    const Lane s = store_lane(lane.row);
    const bool chunk_warp = s.warp_in_unit == 0;
    float x[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = chunk_warp ? row[s.channel + c] : 0.0f;
    sink.emit(s, chunk_warp, x);
  }
};

/// Pools a row's slices in turn in one block (pool_slice(lane, sink) pools one slice as a unit of
/// the whole block) and gathers them for the store step.
template <typename Lane, int kHeadDim, int C, typename Sink, typename PoolSlice>
DSV4_DEV void pool_slices_in_turn(Sink& sink, PoolSlice pool_slice) {
  __shared__ float row[kHeadDim];
  SliceGather<Lane, Sink, kHeadDim, kWarpSize * C, C> gather{sink, row};
#pragma unroll 1
  for (int slice = 0; slice < Lane::kSlices; ++slice) pool_slice(Lane::of_slice(slice), gather);
}

}  // namespace dsv4::fused
