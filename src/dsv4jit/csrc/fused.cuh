// compress_and_store: the compress kernels' window pooling with the norm/rope/quantize/store step
// applied to each pooled row inside the same kernel, so compressed rows never reach global memory.
// Same arithmetic as compress_forward (output dtype = input dtype) followed by
// compress_norm_rope_store: the caches and states are byte-identical to the two-step path.
//
// A pooled row is spread over the units of its channel slices (compress.cuh), and each unit
// stores its own slice; the units of a row share only the chunk partials of the row's sum of
// squares (store.cuh's canonical order, 32 x chunks values):
//   c4        a warp holds one 128-channel chunk of the store layout (lane l: channels 128k + 4l..);
//             the row's warps (4 for hd512, 1 for hd128) share partials through shared memory
//   c128      a block holds one 64-dim tile (lane l: 2 channels); the row's 8 blocks form a
//             thread-block cluster and share partials through distributed shared memory
// The norm weight and rope values are prefetched with cp.async as soon as the plan row is read,
// overlapping the window loads.
//
// Prefill is this kernel followed by the compress write pass in stream order: with a request
// ring, this step's state writes may alias ring rows that the pooling still reads.
#pragma once

#include <cooperative_groups.h>

#include "common/async_copy.cuh"
#include "common/cluster.cuh"
#include "compress.cuh"
#include "store.cuh"

namespace dsv4::fused {

namespace cg = cooperative_groups;
using tvm::ffi::Optional;
using tvm::ffi::TensorView;

struct Params {
  compress::Params c;
  store::Params s;
};

template <int kRatio, typename BufferT, typename InT, store::Format F, bool kPDL>
struct Kernels {
  using L = store::Layout<F>;
  static constexpr int kHeadDim = L::kHeadDim;
  using K = compress::Kernels<kRatio, kHeadDim, BufferT, InT, InT, kPDL>;
  using S = store::Kernel<InT, F, kPDL>;
  using W = typename K::W;
  using Lane = typename K::Lane;
  static constexpr int C = W::kLaneChannels;
  static constexpr bool kCluster = W::kWarpsPerUnit > 1;  // c128: a row's slices are separate blocks
  static constexpr int kRowsPerBlock = kCluster ? 1 : K::kUnitsPerBlock / W::kSlices;
  static constexpr int kChunks = L::kChunks;
  static_assert(kCluster ? W::kUnitChannels == 64 && W::kSlices <= 8
                         : W::kUnitChannels == 128 && K::kUnitsPerBlock % W::kSlices == 0,
                "a c4 unit holds a store chunk; a c128 unit a tile, and a row fits a portable cluster");
  static_assert(W::kSlices == 1 || kRowsPerBlock == 1, "rows spread over warps own their block (uniform exits)");
  static_assert(!kCluster || !L::kIndexer, "indexer rows need the whole row in one warp (Hadamard)");

  struct Shared {
    float partials[kRowsPerBlock][kChunks][kWarpSize];  // [chunk][lane of the store layout]
    alignas(16) InT weight[kRowsPerBlock][kHeadDim];
    alignas(16) float freq[kRowsPerBlock][store::kRopeDim];
  };

  /// The sink compress.cuh hands pooled rows to: every unit stores its own slice of the row.
  struct StoreSink {
    const Params& p;
    Shared& sh;
    int64_t loc = 0, position = 0;
    bool stores = false;  // in the slice's first warp: this row goes to the cache

    DSV4_DEV int row_in_block() const { return kRowsPerBlock == 1 ? 0 : threadIdx.x / kWarpSize; }

    DSV4_DEV void prepare(const Lane& lane) {
      if constexpr (kCluster) cluster_arrive_relaxed();  // phase 0: this block has started
      if (lane.warp_in_unit != 0) return;
      // Branch on plan values only: the out_loc load stays in flight, next to the window loads.
      stores = S::select(p.s, lane.row, loc, position);
      if (!stores) return;
      const int r = row_in_block();
      const InT* weight = static_cast<const InT*>(p.s.norm_weight);
      cp_async<C * sizeof(InT)>(&sh.weight[r][lane.channel], weight + lane.channel);
      if (rope_channel(lane) >= 0 && S::position_ok(p.s, position)) {
        cp_async<C * sizeof(float)>(&sh.freq[r][rope_channel(lane)],
                                    p.s.freq + position * store::kRopeDim + rope_channel(lane));
      }
    }

    /// Offset of this lane's channels in the trailing rope dims (negative: not a rope lane).
    DSV4_DEV static int rope_channel(const Lane& lane) { return lane.channel - (kHeadDim - store::kRopeDim); }

    DSV4_DEV void emit(const Lane& lane, bool holds, const float (&v)[C]) {
      const int l = threadIdx.x % kWarpSize, r = row_in_block();
      const int slice = lane.channel / W::kUnitChannels;
      float x[C];
#pragma unroll
      for (int c = 0; c < C; ++c) x[c] = to_f32(from_f32<InT>(v[c]));  // as the two-step path reads it back
      if constexpr (kCluster) {
        // Chunk k's partial for store lane 16·(slice % 2) + j spans lanes 2j and 2j+1 here: lane
        // 2j+1 continues lane 2j's fma chain, then publishes it to every block of the cluster.
        const float pair = __fmaf_rn(x[1], x[1], __fmaf_rn(x[0], x[0], 0.0f));
        const float carried = __shfl_up_sync(kFullMask, pair, 1);
        const float partial = __fmaf_rn(x[1], x[1], __fmaf_rn(x[0], x[0], carried));
        cluster_wait();  // phase 0: every block of the cluster has started
        if (holds && stores && (l & 1)) {
          float* dst = &sh.partials[0][slice / 2][16 * (slice % 2) + l / 2];
#pragma unroll
          for (int q = 0; q < W::kSlices; ++q) *cg::this_cluster().map_shared_rank(dst, q) = partial;
        }
        cluster_arrive_release();
        if (!holds || !stores) return;  // uniform over the cluster: nobody writes into a block that left
        cluster_wait();  // phase 1: every partial has landed
      } else if constexpr (W::kSlices > 1) {
        if (holds) sh.partials[r][slice][l] = S::chunk_partial(x);
        __syncthreads();
        if (!stores) return;
      } else {
        if (!stores) return;
        sh.partials[r][0][l] = S::chunk_partial(x);  // read back by this lane only
      }
      float lane_sum = 0.0f;
#pragma unroll
      for (int k = 0; k < kChunks; ++k) lane_sum = __fadd_rn(lane_sum, sh.partials[r][k][l]);
      const float total = S::row_sum(lane_sum);
      if (!S::check(p.s, loc, position)) return;
      cp_async_wait_all();  // each lane reads only what its own cp.async brought
      float w[C], f[C];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        w[c] = to_f32(sh.weight[r][lane.channel + c]);
        f[c] = rope_channel(lane) >= 0 ? sh.freq[r][rope_channel(lane) + c] : 0.0f;
      }
      const float scale = S::rms_scale(p.s, total);
      if constexpr (kCluster) {
        S::store_tile(p.s, slice, x, w, scale, f, loc, l);
      } else {
        S::normalize_group(l + kWarpSize * slice, x, w, scale, f);
        S::store_chunk(p.s, slice, x, loc, l);
      }
    }
  };
};

template <typename FK>
__global__ __launch_bounds__(FK::K::kThreads, FK::K::kMinBlocks) void prefill_kernel(const __grid_constant__ Params p) {
  __shared__ typename FK::Shared sh;
  typename FK::StoreSink sink{p, sh};
  FK::K::prefill_pool(p.c, sink);
}

template <typename FK>
__global__ __launch_bounds__(FK::K::kThreads, FK::K::kMinBlocks) void decode_kernel(const __grid_constant__ Params p) {
  __shared__ typename FK::Shared sh;
  typename FK::StoreSink sink{p, sh};
  FK::K::decode(p.c, sink);
}

/// Host entry points: every tensor of both steps checked before any launch.
template <int kRatio, typename BufferT, typename InT, store::Format F, bool kPDL>
struct CompressAndStore {
  using FK = Kernels<kRatio, BufferT, InT, F, kPDL>;
  using Compress = compress::Compress<kRatio, FK::kHeadDim, BufferT, InT, InT, kPDL>;
  using Store = store::NormRopeStore<InT, F, kPDL>;
  static constexpr const char* kOp = "compress_and_store";

  static LaunchShape shape(uint32_t rows) {
    return {Compress::blocks(rows, FK::K::kUnitsPerBlock), FK::K::kThreads, 0,
            FK::kCluster ? static_cast<unsigned>(FK::W::kSlices) : 1u};
  }

  /// status (checked mode): int32[2], compress violations in word 0, store violations in word 1.
  static void prefill(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_c,
                      TensorView plan_w, TensorView norm_weight, TensorView freq, TensorView out_loc,
                      TensorView kvcache, Optional<TensorView> status, int64_t page_size, double eps,
                      int64_t num_q_tokens) {
    Device dev;
    Size rows_c{"plan_c_rows"}, rows_w{"plan_w_rows"};
    Params p{};
    p.c = Compress::prefill_params(kOp, dev, kv_score_buffer, kv_score_input, ape, plan_c, plan_w, nullptr, nullptr,
                                   rows_c, rows_w);
    int32_t* words = status_words(kOp, dev, status, 2);
    p.c.status = words;
    p.s = Store::checked(kOp, rows_c, dev, plan_c, norm_weight, freq, out_loc, kvcache, words ? words + 1 : nullptr,
                         page_size, kRatio, false, eps, num_q_tokens);
    launch(kOp, dev.dev, shape(p.c.num_rows), kPDL, prefill_kernel<FK>, p);
    Compress::launch_write(kOp, dev, p.c, rows_w.value);
  }

  static void decode(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_d,
                     TensorView norm_weight, TensorView freq, TensorView out_loc, TensorView kvcache,
                     Optional<TensorView> status, int64_t page_size, double eps) {
    Device dev;
    Size batch{"batch_size"};
    Params p{};
    p.c = Compress::decode_params(kOp, dev, kv_score_buffer, kv_score_input, ape, plan_d, nullptr, nullptr, batch);
    int32_t* words = status_words(kOp, dev, status, 2);
    p.c.status = words;
    p.s = Store::checked(kOp, batch, dev, plan_d, norm_weight, freq, out_loc, kvcache, words ? words + 1 : nullptr,
                         page_size, kRatio, true, eps, -1);
    launch(kOp, dev.dev, shape(p.c.num_rows), kPDL, decode_kernel<FK>, p);
  }
};

}  // namespace dsv4::fused
