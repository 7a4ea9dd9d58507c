// compress_and_store: the compress kernels' window pooling with the norm/rope/quantize/store step
// applied to each pooled row inside the same kernel, so compressed rows never reach global memory.
// Same arithmetic as compress_forward (output dtype = input dtype) followed by
// compress_norm_rope_store: the caches and states are byte-identical to the two-step path.
//
// A pooled row is spread over the units of its channel slices (compress/ring.cuh, compress/online.cuh):
//   one-warp units (c4, online decode): a warp holds one 128-channel chunk of the store layout
//             (lane l: channels 128k + 4l..) and stores it; the row's warps (4 for hd512, 1 for
//             hd128) share the chunk partials of the row's sum of squares (store/rms.cuh's
//             canonical order, 32 x chunks values) through shared memory. The norm weight and
//             rope values are prefetched with cp.async as soon as the plan row is read,
//             overlapping the window loads.
//   block units (ring c128): a block pools one 64-channel slice of a row and writes it to the
//             row's line of a scratch buffer; the last of the row's 8 blocks to finish (a counter
//             per row) stores the row with the store kernel's own row step, in decode from the
//             norm weight, rope row and location each block copied into shared memory while its
//             window loaded. No block waits for another.
//   slices in turn (online prefill): one block pools a row's 8 slices one after another, gathers
//             the row in shared memory and stores it as one-warp chunks
//
// Prefill is this kernel followed by the compressor's write pass in stream order: this step's
// state writes may alias rows that the pooling still reads (a request ring, an online state row).
// Where the plan says that the pool pass reads no state row (no request has a prefix), one grid
// runs both passes (Grid::kPoolAndWrite; the ring compressors only).
// Where one kernel measured slower than the two steps (online prefills of few rows: ops/fused.py),
// the op passes a buffer for the compressed rows and the entry runs the two steps instead: the
// same checks, then the compressor's kernels and the store kernel.
#pragma once

#include "common/async_copy.cuh"
#include "compress/ring.cuh"
#include "compress/online.cuh"
#include "store/indexer_codec.cuh"
#include "store/layout.cuh"
#include "store/params.cuh"
#include "store/rms.cuh"
#include "store/rope.cuh"
#include "store/rows.cuh"
#include "store/store.cuh"
#include "store/v4_codec.cuh"

namespace dsv4::fused {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

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
      store::normalize_group<F>(l + kWarpSize * slice, x, w, scale, f);
      store_chunk(store::slot_at<F>(p, loc), slice, x, l);
    }

    /// Quantizes a normalized chunk k of the 32-lane layout and stores it (with its scales) in `slot`.
    DSV4_DEV static void store_chunk(const store::Slot& slot, int k, float (&x)[4], int lane) {
      if constexpr (L::kIndexer) {
        float(&v)[1][4] = reinterpret_cast<float(&)[1][4]>(x);
        const auto codes = store::encode_indexer<F, kWarpSize>(v, lane, store::Fp4ByRule{});
        store::write_indexer<F, kWarpSize>(slot, lane, codes);
      } else {
        store::write_v4<F>(slot, 128 * k + 4 * lane, store::encode_v4<F>(128 * k + 4 * lane, x));
      }
    }
  };

  template <typename P>
  static DSV4_DEV Sink sink(const P& p, Shared& sh) {
    return {p.s, sh};
  }
};

/// The store step behind the ring c128 passes, whose units are blocks that each pool one 64-channel
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
  static_assert(!store::Layout<F>::kIndexer, "ring c128 rows are V4 rows");
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
      // Every decode row that reaches here was preloaded (the decode passes call preload() for
      // each row they hand over); prefill rows never are.
      const bool preloaded = p.is_decode;
      if (preloaded) cp_async_wait_all();  // no copy lands after the block has left
      if (before != kSlices - 1) return;
      __syncwarp();  // lane 0's acquire orders every lane's reads of the other slices (and of sh)
      if (l == 0) row_counts[lane.row] = 0;  // the row's blocks are done with it: zero for the next call
      if (preloaded) {
        RowStore::store_v4_row(p, lane.row, l, preloaded_operands());
      } else {
        RowStore::store_v4_row(p, lane.row, l);
      }
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

/// How a pool pass's grid covers its work: a block per unit (or per units_per_block units); the grid
/// of resident blocks (ring c128 decode: Pass::pool_resident), a kernel of its own; or the pool
/// pass's blocks followed by the write pass's, for a prefill whose pool pass reads no state row.
enum class Grid { kPerUnit, kResident, kPoolAndWrite };

/// A pool pass with the store step as its sink. Pass: the compressor's parameters (Params),
/// the launch bounds and shape, the store step (Step) and pool(), the pass itself.
template <typename Pass, Grid kGrid = Grid::kPerUnit>
__global__ __launch_bounds__(Pass::kThreads, Pass::kMinBlocks) void pool_and_store_kernel(
    const __grid_constant__ Params<typename Pass::Params> p) {
  __shared__ typename Pass::Step::Shared sh;
  auto sink = Pass::Step::sink(p, sh);
  if constexpr (kGrid == Grid::kResident) {
    Pass::pool_resident(p.c, sink);
  } else if constexpr (kGrid == Grid::kPoolAndWrite) {
    Pass::K::prefill_one_grid(p.c, blockIdx.x, [&](uint32_t block) { Pass::pool_block(p.c, sink, block); });
  } else {
    Pass::pool(p.c, sink);
  }
}

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

/// The ring compressor's passes (compress/ring.cuh): c4 and c128, prefill pool or decode. A c128 row
/// spans 8 slice units, blocks of their own (LastSliceStores).
template <int kRatio, typename BufferT, typename InT, store::Format F, bool kPDL, bool kDecode>
struct RingPass {
  static constexpr int kHeadDim = store::Layout<F>::kHeadDim;
  using Compressor = compress::CompressEntry<kRatio, kHeadDim, BufferT, InT, InT, kPDL>;
  using K = typename Compressor::K;
  using W = typename K::W;
  using Params = compress::Params;
  static constexpr bool kBlockUnits = W::kWarpsPerUnit > 1;
  static constexpr bool kDecodePass = kDecode;
  static constexpr bool kOneGridPrefill = true;  // the compressor's prefill_one_grid
  using Step = std::conditional_t<kBlockUnits, LastSliceStores<InT, F, kPDL, W::kSlices>,
                                  StoreStep<InT, F, K::C, W::kWarpsPerUnit, K::kUnitsPerBlock>>;
  static constexpr int kThreads = K::kThreads;
  // A c4 prefill warp's store tail holds its registers with no load in flight. For V4 rows (4
  // warps that exchange partials) 6 blocks per SM (80 registers, 48 bytes of spills) keep more
  // loads in flight than the compiler's 5 (86 registers), which made large prefills faster;
  // indexer rows (one warp each) measured slower with it (docs/performance.md).
  static constexpr int kMinBlocks = kRatio == 4 && !kDecode && kHeadDim == 512 ? 6 : K::kMinBlocks;

  static LaunchShape shape(uint32_t rows) {
    return {Compressor::blocks(rows, K::kUnitsPerBlock), kThreads};
  }
  /// A decode's parameters with the compressor's prefetch a wave of blocks ahead (K::prefetch_unit).
  template <typename P>
  static P lookahead(const char* op, DLDevice dev, P p) {
    if constexpr (kDecode) p.c = Compressor::with_lookahead(op, dev, p.c);
    return p;
  }
  template <typename Sink>
  static DSV4_DEV void pool(const Params& c, Sink& sink) {
    pool_block(c, sink, blockIdx.x);
  }
  /// A large ring c128 decode on the grid of resident blocks (PoolLaunch).
  template <typename Sink>
  static DSV4_DEV void pool_resident(const Params& c, Sink& sink) {
    K::decode_resident(c, sink);
  }
  /// As block `block` of the pass (fused/layer.cuh runs two passes in one grid).
  template <typename Sink>
  static DSV4_DEV void pool_block(const Params& c, Sink& sink, uint32_t block) {
    const auto lane = K::Lane::of(K::kUnitsPerBlock, W::kWarpsPerUnit, block);
    if constexpr (kDecode) {
      K::decode(c, lane, sink);
    } else {
      K::prefill_pool(c, lane, sink);
    }
  }
};

/// Launches a pool pass over p.c.num_rows rows.
template <typename Pass>
struct PoolLaunch {
  using Compressor = typename Pass::Compressor;
  using Params = typename Pass::Params;
  static constexpr bool kBlockUnits = Pass::kBlockUnits;
  static constexpr bool kOneGridPrefill = Pass::kOneGridPrefill;
  template <typename P>
  static void run(const char* op, DLDevice dev, bool pdl, const P& p) {
    if constexpr (Pass::kBlockUnits) {  // ring c128 (a RingPass)
      if constexpr (Pass::kDecodePass) {
        if (Compressor::resident_decode(op, dev, p.c.num_rows)) {  // a large decode
          launch(op, dev, {Compressor::decode_grid(op, dev, p.c.num_rows, true), Pass::kThreads}, pdl,
                 pool_and_store_kernel<Pass, Grid::kResident>, p);
          return;
        }
      }
    }
    launch(op, dev, Pass::shape(p.c.num_rows), pdl, pool_and_store_kernel<Pass>, Pass::lookahead(op, dev, p));
  }

  /// A prefill: the pool pass, then the compressor's write pass over `rows_w` plan_w rows; one grid
  /// where the pass has one (kOneGridPrefill: one-warp units), the plan's pool pass reads no state
  /// row and no graph captures the launch.
  template <typename P>
  static void run_prefill(const char* op, const Device& dev, bool pdl, P p, int64_t rows_w, bool reads_state) {
    if constexpr (Pass::kOneGridPrefill && !Pass::kBlockUnits) {
      if (!reads_state && !capturing(op, dev.dev)) {
        using K = typename Compressor::K;
        p.c.write_rows = static_cast<uint32_t>(rows_w);
        launch(op, dev.dev, {K::pool_blocks(p.c.num_rows) + K::write_blocks(rows_w, K::kWarpsPerBlock), Pass::kThreads},
               pdl, pool_and_store_kernel<Pass, Grid::kPoolAndWrite>, p);
        return;
      }
    }
    run(op, dev.dev, pdl, p);
    Compressor::launch_write(op, dev, Compressor::write_pass(p.c, rows_w));
  }
};

/// The online c128 compressor's passes (compress/online.cuh), head_dim 512: prefill pool or decode. A
/// prefill segment row spans 8 slice units, which one block pools in turn (below 129 rows the two
/// steps are faster: ops/fused.py).
template <typename BufferT, store::Format F, bool kPDL, bool kDecode>
struct OnlinePass {
  static constexpr int kHeadDim = 512;
  using Compressor = compress::online::OnlineEntry<kHeadDim, BufferT, kPDL>;
  using K = typename Compressor::K;
  using Params = compress::online::Params;
  static constexpr bool kBlockUnits = false;
  static constexpr bool kOneGridPrefill = false;  // online prefills keep their two launches
  using Step = std::conditional_t<kDecode, StoreStep<float, F, K::kDecodeC, 1, K::kDecodeUnitsPerBlock>,
                                  StoreStep<float, F, 4, 1, kHeadDim / 128>>;
  static constexpr int kThreads = kDecode ? K::kDecodeThreads : K::kPrefillThreads;
  static constexpr int kMinBlocks = kDecode ? 0 : K::kPrefillMinBlocks;

  static LaunchShape shape(uint32_t rows) { return {kDecode ? Compressor::decode_blocks(rows) : rows, kThreads}; }
  template <typename P>
  static P lookahead(const char*, DLDevice, P p) {
    return p;  // the online kernels prefetch nothing ahead
  }
  template <typename Sink>
  static DSV4_DEV void pool(const Params& c, Sink& sink) {
    using Lane = typename K::PrefillLane;
    if constexpr (kDecode) {
      K::decode(c, sink);
    } else {
      pool_slices_in_turn<Lane, kHeadDim, K::kPrefillC>(
          sink, [&](const Lane& lane, auto& gather) { K::template prefill<false, true>(c, lane, gather); });
    }
  }
};

/// The host entry point over a compressor's prefill and decode pass launchers: every tensor of both
/// steps is checked before any launch. The compressed rows take the store's dtype (InT). A `rows`
/// buffer alone asks for the two steps (the compressor's own kernels into it, then the store
/// kernel), for the calls where that measured faster than one fused kernel (the rule: ops/fused.py);
/// block-unit passes (ring c128) run one kernel with `rows` as their scratch and `row_counts`.
template <typename PrefillPass, typename DecodePass, typename InT, store::Format F, bool kPDL, int kRatio>
struct EntryBase {
  using Compressor = typename PrefillPass::Compressor;
  using Store = store::NormRopeStoreEntry<InT, F, kPDL>;
  static constexpr const char* kOp = "compress_and_store";

  /// Fills the store half of `p` for the plan rows (`rows` of them).
  template <typename P>
  static void add_store(const char* op, P& p, Device& dev, Size& rows, const TensorView& plan,
                        const TensorView& norm_weight, const TensorView& freq, const TensorView& out_loc,
                        const TensorView& kvcache, int64_t page_size, bool is_decode, double eps,
                        int64_t num_q_tokens) {
    p.s = Store::checked(op, rows, dev, plan, norm_weight, freq, out_loc, kvcache, nullptr, page_size, kRatio,
                         is_decode, eps, num_q_tokens);
  }

  /// Whether one kernel runs (else the two steps into `rows`); fills the block units' scratch.
  template <typename P>
  static bool one_kernel(const char* op, Device& dev, P& p, const TensorView* rows,
                         const Optional<TensorView>& row_counts) {
    if constexpr (PrefillPass::kBlockUnits) {
      if (!row_counts.has_value()) return false;
      expect(rows != nullptr, op, "rows", "a [plan rows, head_dim] scratch buffer beside row_counts", "None");
      const TensorView& counts = row_counts.value();
      Check(op, "row_counts", counts).shape({Dim::any()}).dtype(dl::kI32).cuda(dev).contiguous();
      expect(counts.size(0) >= p.s.rows, op, "row_counts",
             [&] { return "one entry per plan row (" + std::to_string(p.s.rows) + ")"; }, counts.size(0));
      p.rows = rows->data_ptr();
      p.row_counts = static_cast<int32_t*>(counts.data_ptr());
      return true;
    } else {
      expect(!row_counts.has_value(), op, "row_counts", "None (only ring c128 rows are counted)", "a tensor");
      return rows == nullptr;
    }
  }

  /// Checked mode: the compress violations go to words[0], the store violations to words[1].
  template <typename P>
  static void attach_status(P& p, int32_t* words) {
    p.c.status = words;
    p.s.status = words ? words + 1 : nullptr;
  }

  /// Checks both steps of a prefill (`rows`: the compressed rows, or nullptr when fused), naming `op`.
  static Params<typename PrefillPass::Params> prefill_params(
      const char* op, Device& dev, Size& rows_w, const TensorView& kv_score_buffer, const TensorView& kv_score_input,
      const TensorView& ape, const TensorView& plan_c, const TensorView& plan_w, const TensorView* rows,
      const TensorView& norm_weight, const TensorView& freq, const TensorView& out_loc, const TensorView& kvcache,
      int64_t page_size, double eps, int64_t num_q_tokens) {
    Size rows_c{"plan_c_rows"};
    Params<typename PrefillPass::Params> p{};
    p.c = Compressor::prefill_params(op, dev, kv_score_buffer, kv_score_input, ape, plan_c, plan_w, rows, nullptr,
                                     rows_c, rows_w);
    add_store(op, p, dev, rows_c, plan_c, norm_weight, freq, out_loc, kvcache, page_size, false, eps, num_q_tokens);
    if (rows != nullptr) p.s.kv = rows->data_ptr();
    return p;
  }

  /// Checks both steps of a decode (`rows` as in prefill_params).
  static Params<typename DecodePass::Params> decode_params(
      const char* op, Device& dev, const TensorView& kv_score_buffer, const TensorView& kv_score_input,
      const TensorView& ape, const TensorView& plan_d, const TensorView* rows, const TensorView& norm_weight,
      const TensorView& freq, const TensorView& out_loc, const TensorView& kvcache, int64_t page_size, double eps) {
    Size batch{"batch_size"};
    Params<typename DecodePass::Params> p{};
    p.c = Compressor::decode_params(op, dev, kv_score_buffer, kv_score_input, ape, plan_d, rows, nullptr, batch);
    add_store(op, p, dev, batch, plan_d, norm_weight, freq, out_loc, kvcache, page_size, true, eps, -1);
    if (rows != nullptr) p.s.kv = rows->data_ptr();
    return p;
  }

  /// The one entry point of every fused module (bindings by name on the Python side): decode when
  /// plan_w is absent, prefill otherwise; one fused kernel, or with a `rows` buffer [plan rows, hd]
  /// of InT and no `row_counts` the two steps (the compressor's kernels into `rows`, then the store
  /// kernel). Ring c128 runs one kernel with both (one_kernel). `reads_state` false: the plan's pool
  /// pass reads no state row, so a prefill's write pass may share its grid.
  static void run(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_rows,
                  Optional<TensorView> plan_w, Optional<TensorView> rows, Optional<TensorView> row_counts,
                  TensorView norm_weight, TensorView freq, TensorView out_loc, TensorView kvcache,
                  Optional<TensorView> status, int64_t page_size, double eps, int64_t num_q_tokens,
                  bool reads_state) {
    Device dev;
    const TensorView* buffer = rows.has_value() ? &rows.value() : nullptr;
    if (!plan_w.has_value()) {
      auto p = decode_params(kOp, dev, kv_score_buffer, kv_score_input, ape, plan_rows, buffer, norm_weight, freq,
                             out_loc, kvcache, page_size, eps);
      const bool fused = one_kernel(kOp, dev, p, buffer, row_counts);
      attach_status(p, status_words(kOp, dev, status, 2));
      if (fused) {
        DecodePass::run(kOp, dev.dev, kPDL, p);
      } else {
        Compressor::launch_decode(kOp, dev, p.c);
        Store::launch_store(kOp, dev, p.s);
      }
      return;
    }
    Size rows_w{"plan_w_rows"};
    auto p = prefill_params(kOp, dev, rows_w, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w.value(), buffer,
                            norm_weight, freq, out_loc, kvcache, page_size, eps, num_q_tokens);
    const bool fused = one_kernel(kOp, dev, p, buffer, row_counts);
    attach_status(p, status_words(kOp, dev, status, 2));
    if (fused) {
      PrefillPass::run_prefill(kOp, dev, kPDL, p, rows_w.value, reads_state);
      return;
    }
    if constexpr (PrefillPass::kOneGridPrefill) {
      Compressor::launch_prefill(kOp, dev, p.c, rows_w.value, reads_state);
    } else {
      Compressor::launch_prefill(kOp, dev, p.c, rows_w.value);
    }
    Store::launch_store(kOp, dev, p.s);
  }
};

/// compress_and_store on the state ring (c4, c128).
template <int kRatio, typename BufferT, typename InT, store::Format F, bool kPDL>
struct CompressAndStoreEntry : EntryBase<PoolLaunch<RingPass<kRatio, BufferT, InT, F, kPDL, false>>,
                                         PoolLaunch<RingPass<kRatio, BufferT, InT, F, kPDL, true>>, InT, F, kPDL, kRatio> {};

/// compress_and_store(is_online=True): the online c128 state rows, fp32 rows, V4 formats.
template <typename BufferT, store::Format F, bool kPDL>
struct OnlineCompressAndStoreEntry : EntryBase<PoolLaunch<OnlinePass<BufferT, F, kPDL, false>>,
                                               PoolLaunch<OnlinePass<BufferT, F, kPDL, true>>, float, F, kPDL, 128> {};

}  // namespace dsv4::fused
