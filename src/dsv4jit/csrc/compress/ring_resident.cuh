// Ring c128 decode of large batches: a grid of resident blocks shares the batch.
//
// A c128 window spans 8 slice units of a whole block each, but in a real batch about one request
// in 128 closes a window: a block per (request, slice) would spend most of its life reading a plan
// row that says "store your token and leave", wave after wave. For batches beyond a few such waves
// (CompressEntry::decode_launch) a grid of the blocks the SMs hold shares the work instead, in one
// round trip for the tokens: every block loads its share of the token rows (with their plan rows)
// beside its row of the first plan chunk, and stores the tokens. Then every block ranks the rows
// that have pool units (a block-wide count over all plan rows, the same in every block) and pools
// the units (row, slice) numbered 8·rank + slice ≡ blockIdx.x (mod grid), from block 0 up. The pool
// reads the window's last slot from the input, never from the ring row the token went to, so the
// token stores need not wait for it. A unit pools with the per-unit decode's steps (ring_units.cuh).
#pragma once

#include "ring_units.cuh"

namespace dsv4::compress {

template <int kRatio, int kHeadDim, typename BufferT, typename InT, typename OutT, bool kPDL>
struct ResidentDecode {
  using K = Kernels<kRatio, kHeadDim, BufferT, InT, OutT, kPDL>;
  using W = typename K::W;
  using Lane = typename K::Lane;
  static constexpr int C = K::C;
  static constexpr int kSlots = K::kSlots;
  static constexpr int kThreads = K::kThreads;
  static constexpr int kTokenParts = W::kGroups * W::kSlices;  // a warp's share of a token row
  static constexpr int kTokensInFlight = 4;                     // token parts a warp loads at once
  static constexpr int kQueue = 32;                             // pool units of a block per chunk
  static constexpr int kChunkRows = kThreads;                   // plan rows a block ranks at once
  /// The grid's lower bound: no block then takes more than kQueue units of a chunk.
  static constexpr unsigned kMinDecodeGrid = W::kSlices * kChunkRows / kQueue;

  /// Whether a row has pool units: at a boundary, or (a sink that takes no idle rows: the store
  /// step, which stores every row whose seq_len closes a window) any row the store step stores.
  template <typename Sink>
  static DSV4_DEV bool takes_units(const DecodePlan& plan) {
    return K::at_window_end(plan) || (!Sink::kTakesIdleRows && plan.seq_len % kRatio == 0);
  }

  /// The pass: the tokens first, then the pool units (the plan's first chunk loaded beside them).
  template <typename Sink>
  static DSV4_DEV void run(const Params& p, Sink& sink) {
    static_assert(K::kUnitsPerBlock == 1 && W::kWarpsPerUnit * kWarpSize == kThreads, "a block per c128 unit");
    pdl_wait_upstream<kPDL>();
    DecodePlan first{};
    if (threadIdx.x < p.num_rows) first = load_row(static_cast<const DecodePlan*>(p.plan), threadIdx.x);
    pdl_launch_dependents<kPDL>();
    store_tokens(p, sink);
    pool_units(p, sink, first);
  }

  /// Every row's token into its ring row (and, for compress_forward, a zero output row for each
  /// row without pool units): items (row, part) over every warp of the grid, kTokensInFlight loaded
  /// at once (no branch between the loads: a warp past the last item loads row 0, stores nothing).
  template <typename Sink>
  static DSV4_DEV void store_tokens(const Params& p, Sink& sink) {
    const uint64_t items = uint64_t{p.num_rows} * kTokenParts, warps = uint64_t{gridDim.x} * W::kWarpsPerUnit;
    const auto* plans = static_cast<const DecodePlan*>(p.plan);
    const auto* input = static_cast<const InT*>(p.input);
    for (uint64_t first = uint64_t{blockIdx.x} * W::kWarpsPerUnit + threadIdx.x / kWarpSize; first < items;
         first += kTokensInFlight * warps) {
      DecodePlan plan[kTokensInFlight];
      Vec<InT, C> token[kTokensInFlight];
#pragma unroll
      for (int i = 0; i < kTokensInFlight; ++i) {
        const uint64_t item = first + i * warps < items ? first + i * warps : 0;
        const uint64_t row = item / kTokenParts;
        const int part = static_cast<int>(item % kTokenParts);
        plan[i] = load_row(plans, row);
        token[i] = load_vec<C>(input + row * W::kRowWidth + part / W::kSlices * kHeadDim +
                               Lane::first_channel(part % W::kSlices));
      }
#pragma unroll
      for (int i = 0; i < kTokensInFlight; ++i) {
        const uint64_t item = first + i * warps;
        const uint32_t row = static_cast<uint32_t>(item / kTokenParts);
        const int part = static_cast<int>(item % kTokenParts), group = part / W::kSlices;
        const int channel = Lane::first_channel(part % W::kSlices);
        if (item < items && K::write_loc_ok(p, plan[i])) {
          store_vec(static_cast<BufferT*>(p.state) + int64_t{plan[i].write_loc} * W::kRowWidth + group * kHeadDim +
                        channel,
                    convert_vec<BufferT>(token[i]));
          if constexpr (Sink::kTakesIdleRows) {
            if (group == 0 && !takes_units<Sink>(plan[i])) {
              const float zero[C] = {};
              sink.emit(Lane{row, 0, channel}, true, zero);  // rows off a boundary are zero-filled
            }
          }
        } else if (item < items && part == 0 && threadIdx.x % kWarpSize == 0) {
          report_status(p, kWriteLocOutOfRange);
        }
      }
    }
  }

  /// The block's pool units: plan rows ranked a chunk at a time (`plan`: this thread's row of the
  /// first chunk, loaded). Little lives in registers across a unit (the pool takes all 64).
  template <typename Sink>
  static DSV4_DEV void pool_units(const Params& p, Sink& sink, DecodePlan plan) {
    struct Unit {
      DecodePlan plan;
      uint32_t row;
      int slice;
    };
    __shared__ Unit queue[kQueue];
    __shared__ uint32_t warp_counts[W::kWarpsPerUnit];
    __shared__ uint32_t queued, ranked;  // this chunk's units of the block; rows with units before it
    if (threadIdx.x == 0) ranked = 0;
    for (uint32_t base = 0; base < p.num_rows; base += kChunkRows) {
      const uint32_t row = base + threadIdx.x;
      if (base > 0 && row < p.num_rows) plan = load_row(static_cast<const DecodePlan*>(p.plan), row);
      const bool takes = row < p.num_rows && K::write_loc_ok(p, plan) && takes_units<Sink>(plan);
      const int warp = threadIdx.x / kWarpSize, l = threadIdx.x % kWarpSize;
      const uint32_t ballot = __ballot_sync(kFullMask, takes);
      if (l == 0) warp_counts[warp] = __popc(ballot);
      if (threadIdx.x == 0) queued = 0;
      __syncthreads();
      uint32_t rank = ranked + __popc(ballot & ((1u << l) - 1)), chunk = 0;
#pragma unroll
      for (int w = 0; w < W::kWarpsPerUnit; ++w) {
        const uint32_t n = warp_counts[w];
        if (w < warp) rank += n;
        chunk += n;
      }
      if (takes) {  // the one slice of this row whose unit number is blockIdx.x modulo the grid (>= 8 blocks)
        const uint32_t slice = (blockIdx.x + gridDim.x - uint64_t{rank} * W::kSlices % gridDim.x) % gridDim.x;
        if (slice < W::kSlices) queue[atomicAdd(&queued, 1u)] = {plan, row, static_cast<int>(slice)};
      }
      __syncthreads();  // the queue is complete, and every thread has read `ranked`
      if (threadIdx.x == 0) ranked += chunk;
      for (uint32_t i = 0; i < queued; ++i) {
        const Unit u = queue[i];
        const Lane lane{u.row, static_cast<int>(threadIdx.x / kWarpSize), Lane::first_channel(u.slice)};
        float v[C / Sink::kMergeWarps];
        const bool holds = pool_unit_of_row(p, u.plan, lane, sink, v);
        // The merge has read the exchange buffer: the next unit may write it while the holders hand
        // this one to the sink (the store step's row store overlaps the next unit's loads).
        __syncthreads();
        sink.emit(K::template merged_lane<Sink::kMergeWarps>(lane), holds, v);
      }
    }
  }

  /// One pool unit (row, slice) of a row with units, its pooled values in `v` (true in the threads
  /// that hold them). Every thread of the block calls it.
  template <typename Sink>
  static DSV4_DEV bool pool_unit_of_row(const Params& p, const DecodePlan& plan, const Lane& lane, Sink& sink,
                                        float (&v)[C / Sink::kMergeWarps]) {
    constexpr int M = Sink::kMergeWarps;
    const bool boundary = K::at_window_end(plan);
    const bool pooled = boundary && K::pages_in_range(p, plan.read_page_0, plan.read_page_1);
    const bool last_warp = lane.warp_in_unit == W::kWarpsPerUnit - 1;
    Vec<InT, C> token[W::kGroups];
    if (last_warp) K::load_token(static_cast<const InT*>(p.input) + uint64_t{lane.row} * W::kRowWidth, lane.channel, token);
    sink.prepare(lane);
    if constexpr (requires { sink.preload(lane, plan.seq_len); }) sink.preload(lane, plan.seq_len);
    if (!pooled) {  // a boundary row whose page is out of range (or a row the store step takes) gets zeros
      if (boundary && lane.channel == 0 && lane.warp_in_unit == 0) report_status(p, kStatePageOutOfRange);
#pragma unroll
      for (int c = 0; c < C / M; ++c) v[c] = 0.0f;
      return lane.warp_in_unit < M;
    }
    float kv[kSlots][C], z[kSlots][C];
    K::load_decode_window(p, plan, lane, token, last_warp, kv, z);
    return K::template reduce_unit<M>(lane, kv, z, v);
  }
};

}  // namespace dsv4::compress
