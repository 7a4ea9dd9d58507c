// The ring compressors' pooling units (contract §4: c4 and c128): softmax-pool each compress event's
// window and keep the state ring current. One kernel family for both ratios:
//
//   unit  = (plan row, slice of 32 lanes × kLaneChannels channels); a unit's warps split the
//           window 8 slots each (c4: 1 warp, c128: 16 warps whose partials merge in shared memory)
//   slot  = window position; its kv/score columns and its source (state ring or ragged input)
//           come from Window<...> and the plan row
//
// Prefill runs two passes in stream order: pool (reads the ring as it was before this step), then
// write (stores this step's tokens); writes may alias rows the pool pass still reads. Where no
// request of the step has a prefix, the pool pass reads no state row (the first c4 window's earlier
// slots are masked, and masked slots read no row), so one grid runs both passes side by side
// (prefill_one_grid): the host knows it from the plan (CompressorPrefillPlan.reads_state).
// Decode is one pass: each request's current token is written and, at a boundary, pooled from
// registers (it is the window's last slot), the other slots from the ring. A large c128 decode runs
// on a grid of resident blocks instead (ring_resident.cuh). The kernels and host entry points that
// launch these passes are in ring.cuh.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include "common/async_copy.cuh"
#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/plan_structs.h"
#include "common/status.cuh"
#include "common/tensor_check.h"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"

#include "output_rows.cuh"
#include "unit_lane.cuh"
#include "window_softmax.cuh"

namespace dsv4::compress {

/// Status bits for checked mode: plan entries that point outside the tensors (row skipped).
enum StatusBit : int32_t {
  kStatePageOutOfRange = 1,
  kRaggedRowOutOfRange = 2,
  kWriteLocOutOfRange = 4,
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kStatePageOutOfRange, "a plan row names a state page outside kv_score_buffer"},
                            {kRaggedRowOutOfRange, "a plan row names a ragged row outside kv_score_input"},
                            {kWriteLocOutOfRange, "a plan row names a state row (write_loc) outside kv_score_buffer"}});
}

/// Geometry of a ratio: token-row layout, window slots, and where each slot's columns live.
template <int kRatio, int kHeadDim>
struct Window {
  static_assert(kRatio == 4 || kRatio == 128, "the two compress ratios");
  static constexpr bool kOverlap = kRatio == 4;
  static constexpr int kSlots = kOverlap ? 8 : 128;                  // Wn
  static constexpr int kRowWidth = (kOverlap ? 4 : 2) * kHeadDim;    // kv_ov | kv | sc_ov | sc, or kv | sc
  static constexpr int kSlotsPerWarp = 8;
  static constexpr int kWarpsPerUnit = kSlots / kSlotsPerWarp;
  // c4: a warp holds all 8 slots of a row's 128-channel slice (16-byte lanes). c128: 16 warps
  // split the window, so 8-byte lanes keep each thread at 64 registers and two units per SM
  // resident: one unit's merge and store overlap the other's loads (measured faster than 16-byte
  // lanes at one unit per SM: docs/design-notes.md).
  static constexpr int kLaneChannels = kOverlap ? 4 : 2;
  static constexpr int kUnitChannels = kWarpSize * kLaneChannels;
  static constexpr int kSlices = kHeadDim / kUnitChannels;
  static constexpr int kGroups = kRowWidth / kHeadDim;               // column groups of a row
  static_assert(kHeadDim % 64 == 0 && (!kOverlap || kHeadDim % 128 == 0), "c4 needs hd % 128, c128 hd % 64");

  // c4 slots 0-3 take the overlap role of the previous block, 4-7 the current role.
  static DSV4_HD int kv_col(int s) { return kOverlap && s >= 4 ? kHeadDim : 0; }
  static DSV4_HD int score_col(int s) { return kOverlap ? (s >= 4 ? 3 : 2) * kHeadDim : kHeadDim; }
  /// State row of a buffered slot: c4 overlap slots on read_page_0, the others on read_page_1.
  static DSV4_HD int64_t state_row(int s, int32_t page_0, int32_t page_1) {
    return kOverlap ? int64_t{s < 4 ? page_0 : page_1} * kRatio + (s & 3) : int64_t{page_1} * kRatio + s;
  }
  /// The first c4 window (seq_len 4) has no previous block: its overlap slots are masked.
  static DSV4_HD bool masked(int s, uint32_t seq_len) { return kOverlap && seq_len == 4 && s < 4; }
};

struct Params {
  void* state;          // [num_pages, R, row width] BufferT
  const void* input;    // [num_input_rows, row width] InT
  const void* ape;      // [Wn, hd] InT
  void* out;            // [num_rows, hd] OutT
  const void* plan;     // CompressPlan rows (prefill pool pass) or DecodePlan rows
  const WritePlan* plan_w;
  int64_t num_pages;
  int64_t num_input_rows;
  uint32_t num_rows;    // rows of `plan` (pool pass / decode) or of plan_w (write pass)
  uint32_t ahead_rows;  // decode of several waves of blocks: the rows one wave ahead (prefetch_unit), else 0
  int32_t* status;      // checked mode: OR of StatusBit, else nullptr
  uint32_t write_rows;  // prefill in one grid (prefill_one_grid): the plan_w rows, else 0
  bool after_pool;      // write pass: a pool pass runs just before it (the pass loads before waiting)
};

/// Where the slots of one window come from (the plan row's view of the state ring and the input).
struct WindowSource {
  int64_t first_ragged;  // ragged row of slot 0 (slot s: first_ragged + s)
  int32_t page_0;        // c4 overlap slots' state page
  int32_t page_1;        // the other buffered slots' state page
  uint32_t buffer_len;   // slots below it come from the state ring
  uint32_t seq_len;      // closing position + 1 (masks the first c4 window)
};

template <int kRatio, int kHeadDim, typename BufferT, typename InT, typename OutT, bool kPDL>
struct Kernels {
  using W = Window<kRatio, kHeadDim>;
  static constexpr int C = W::kLaneChannels;
  static constexpr int kSlots = W::kSlotsPerWarp;
  static constexpr int kUnitsPerBlock = W::kWarpsPerUnit == 1 ? 4 : 1;
  static constexpr int kThreads = kUnitsPerBlock * W::kWarpsPerUnit * kWarpSize;
  // c4: a warp's whole window in flight (8 kv, 8 score and 8 ape vectors of 16 bytes) takes up to
  // 128 registers, 4 blocks per SM. c128: 64 registers, two 512-thread units per SM (the spills
  // this costs are bounded by the serving-set build test).
  static constexpr int kMinBlocks = W::kOverlap ? 4 : 2;

  /// Per-thread coordinates: which unit, which slots (warp_in_unit), which channels.
  using Lane = UnitLane<C, W::kSlices>;
  using Bias = Vec<InT, C>[kSlots];

  static DSV4_DEV int first_slot(const Lane& lane) { return lane.warp_in_unit * kSlots; }

  /// The ape rows of this warp's slots (read by every unit: cached loads, which the compiler may
  /// issue next to the window's).
  static DSV4_DEV void load_bias(const Params& p, const Lane& lane, Bias& bias) {
    const auto* ape = static_cast<const InT*>(p.ape) + lane.channel;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) bias[i] = load_vec<C>(ape + (first_slot(lane) + i) * kHeadDim);
  }

  /// kv and z = score + ape of slot s from the values of a token row (converted to InT first, as
  /// the reference does with state values).
  template <typename T>
  static DSV4_DEV void slot_values(const Vec<T, C>& k, const Vec<T, C>& sc, const Vec<InT, C>& bias, float (&kv)[C],
                                   float (&z)[C]) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      kv[c] = to_f32(convert<InT>(k[c]));
      z[c] = to_f32(convert<InT>(sc[c])) + to_f32(bias[c]);
    }
  }

  /// Loads kv and z of this warp's first N slots of the window `src` describes. Every load is
  /// independent of the others (no branch between them), so all are in flight at once. Masked
  /// slots never read their own rows (which may not exist) and weigh exactly 0.
  template <int N>
  static DSV4_DEV void load_window(const Params& p, const WindowSource& src, const Lane& lane, const Bias& bias,
                                   float (&kv)[kSlots][C], float (&z)[kSlots][C]) {
    const auto* state = static_cast<const BufferT*>(p.state) + lane.channel;
    const auto* input = static_cast<const InT*>(p.input) + lane.channel;
    const auto* anywhere = static_cast<const InT*>(p.ape) + lane.channel;  // readable at every column offset
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int s = first_slot(lane) + i;
      const bool masked = W::masked(s, src.seq_len);
      const bool buffered = static_cast<uint32_t>(s) < src.buffer_len;
      const BufferT* state_row = state + W::state_row(s, src.page_0, src.page_1) * W::kRowWidth;
      const InT* input_row = input + (src.first_ragged + s) * W::kRowWidth;
      if constexpr (std::is_same_v<BufferT, InT>) {
        // One row pointer per slot, no branch; a masked slot reads ape columns and discards them.
        const InT* row = masked ? anywhere : buffered ? state_row : input_row;
        slot_values(load_vec<C>(row + W::kv_col(s)), load_vec<C>(row + W::score_col(s)), bias[i], kv[i], z[i]);
      } else if (buffered && !masked) {
        slot_values(load_vec<C>(state_row + W::kv_col(s)), load_vec<C>(state_row + W::score_col(s)), bias[i], kv[i],
                    z[i]);
      } else if (!masked) {
        slot_values(load_vec<C>(input_row + W::kv_col(s)), load_vec<C>(input_row + W::score_col(s)), bias[i], kv[i],
                    z[i]);
      }
      if (masked) mask_slot(kv[i], z[i]);
    }
  }

  static DSV4_DEV void mask_slot(float (&kv)[C], float (&z)[C]) {
#pragma unroll
    for (int c = 0; c < C; ++c) kv[c] = 0.0f, z[c] = -INFINITY;
  }

  /// This thread's channels of the pooled row when kMergeWarps warps merge (pool_unit): those
  /// of the merging threads; the others hold nothing (their channel is not used).
  template <int kMergeWarps>
  static DSV4_DEV Lane merged_lane(const Lane& lane) {
    Lane at = lane;
    const int slice = lane.channel / W::kUnitChannels, l = threadIdx.x % kWarpSize;
    at.channel = slice * W::kUnitChannels + merged_channel<kMergeWarps, C>(lane.warp_in_unit * kWarpSize + l);
    return at;
  }

  /// Pools the unit's window (pool_unit: this warp holds kSlots of it) into the pooled values of
  /// the channels merged_lane() names; true in the threads that hold them.
  template <int kMergeWarps>
  static DSV4_DEV bool reduce_unit(const Lane& lane, const float (&kv)[kSlots][C], const float (&z)[kSlots][C],
                                   float (&v)[C / kMergeWarps]) {
    SoftmaxPartial<C / kMergeWarps> total;
    const int slice = lane.channel / W::kUnitChannels;
    if (!pool_unit<W::kWarpsPerUnit, false, kMergeWarps>(kv, z, lane.warp_in_unit, slice, total)) return false;
#pragma unroll
    for (int c = 0; c < C / kMergeWarps; ++c) v[c] = pooled_value(total, c);
    return true;
  }

  /// compress_forward's output rows; c128 spreads the merge over C warps there (the fused kernels
  /// keep one merging warp).
  using OutputRows = dsv4::OutputRows<Params, OutT, kHeadDim, (W::kWarpsPerUnit > 1 ? C : 1)>;

  /// Prefill pool pass: one unit per (plan_c row, slice); invalid rows leave their output untouched.
  template <typename Sink>
  static DSV4_DEV void prefill_pool(const Params& p, const Lane& lane, Sink& sink) {
    pdl_wait_upstream<kPDL>();  // the plan may come from the planner launched just before
    if (lane.row >= p.num_rows) return;
    Bias bias;
    load_bias(p, lane, bias);
    const CompressPlan plan = load_row(static_cast<const CompressPlan*>(p.plan), lane.row);
    if (plan.is_invalid()) return;
    const WindowSource src{int64_t{plan.ragged_id} - (W::kSlots - 1), plan.read_page_0, plan.read_page_1,
                           plan.buffer_len, plan.seq_len};
    const bool pages_ok = plan.buffer_len == 0 || pages_in_range(p, plan.read_page_0, plan.read_page_1);
    const bool ragged_ok = src.first_ragged + plan.buffer_len >= 0 && plan.ragged_id < p.num_input_rows;
    if (!pages_ok || !ragged_ok) {
      const int32_t bad = pages_ok ? kRaggedRowOutOfRange : kStatePageOutOfRange;
      if (lane.channel == 0 && lane.warp_in_unit == 0) report_status(p, bad);
      return;
    }
    sink.prepare(lane);
    float kv[kSlots][C], z[kSlots][C];
    load_window<kSlots>(p, src, lane, bias, kv, z);
    pdl_launch_dependents<kPDL>();
    constexpr int M = Sink::kMergeWarps;
    float v[C / M];
    const bool holds = reduce_unit<M>(lane, kv, z, v);
    sink.emit(merged_lane<M>(lane), holds, v);
  }

  /// Whether the state pages an event reads exist (c4 reads two, c128 one).
  static DSV4_DEV bool pages_in_range(const Params& p, int32_t page_0, int32_t page_1) {
    return (!W::kOverlap || (page_0 >= 0 && page_0 < p.num_pages)) && page_1 >= 0 && page_1 < p.num_pages;
  }

  /// Prefill write pass: copy each plan_w row's input token into its state row (cast to BufferT).
  /// The plan rows and tokens are inputs of the step, complete before the pool pass began (it waited
  /// for them) and written by no kernel running now: after a pool pass they load before this pass
  /// waits for it, and only the stores (which may overwrite rows it reads) follow it.
  static constexpr int kWriteUnitsPerBlock = 4;  // one warp per (row, slice) here

  /// `block`: this block's index in the pass (blockIdx.x, unless the grid runs two passes) of
  /// kUnits one-warp units.
  template <int kUnits = kWriteUnitsPerBlock>
  static DSV4_DEV void prefill_write(const Params& p, uint32_t block) {
    const Lane lane = Lane::of(kUnits, 1, block);
    WaitUpstreamOnExit<kPDL> wait_on_exit{p.after_pool};
    if (!p.after_pool) pdl_wait_upstream<kPDL>();
    if (lane.row >= p.num_rows) return;
    const WritePlan w = p.plan_w[lane.row];
    if (w.is_invalid()) return;
    if (w.ragged_id >= p.num_input_rows || w.write_loc < 0 || w.write_loc >= p.num_pages * kRatio) {
      if (lane.channel == 0) report_status(p, w.ragged_id >= p.num_input_rows ? kRaggedRowOutOfRange : kWriteLocOutOfRange);
      return;
    }
    Vec<InT, C> token[W::kGroups];
    load_token(static_cast<const InT*>(p.input) + int64_t{w.ragged_id} * W::kRowWidth, lane.channel, token);
    pdl_wait_upstream<kPDL>();  // the pool pass has read the ring
    store_state_row(p, token, w.write_loc, lane.channel);
    pdl_launch_dependents<kPDL>();
  }

  /// A prefill whose pool pass reads no state row, in one grid: blocks [0, pool_blocks) run the pool
  /// pass (pool_block(block)), the others the write pass over p.write_rows plan_w rows, a write unit
  /// per warp. Nothing orders the two: no unit reads a row that this step writes.
  template <typename PoolBlock>
  static DSV4_DEV void prefill_one_grid(const Params& p, uint32_t block, PoolBlock pool_block) {
    const uint32_t pool = pool_blocks(p.num_rows);
    if (block < pool) {
      pool_block(block);
      return;
    }
    Params w = p;
    w.num_rows = p.write_rows;
    w.after_pool = false;  // it waits for upstream itself
    prefill_write<kWarpsPerBlock>(w, block - pool);
  }
  static constexpr int kWarpsPerBlock = kThreads / kWarpSize;  // the write units of a pool-pass block

  /// Blocks of the pool pass over `rows` plan rows.
  static DSV4_HD uint32_t pool_blocks(uint64_t rows) {
    return static_cast<uint32_t>((rows * W::kSlices + kUnitsPerBlock - 1) / kUnitsPerBlock);
  }
  /// Blocks of `units` one-warp units that cover the write units (row, slice) of `rows` plan_w rows.
  static DSV4_HD uint32_t write_blocks(uint64_t rows, int units) {
    return static_cast<uint32_t>((rows * W::kSlices + units - 1) / units);
  }
  /// The grid of prefill_one_grid over `pool_rows` plan rows and `write_rows` plan_w rows (the
  /// device side splits it at pool_blocks(pool_rows)).
  static DSV4_HD uint32_t one_grid_blocks(uint64_t pool_rows, uint64_t write_rows) {
    return pool_blocks(pool_rows) + write_blocks(write_rows, kWarpsPerBlock);
  }

  /// This lane's channels of every column group of a token row.
  static DSV4_DEV void load_token(const InT* src, int channel, Vec<InT, C> (&v)[W::kGroups]) {
#pragma unroll
    for (int g = 0; g < W::kGroups; ++g) v[g] = load_vec<C>(src + g * kHeadDim + channel);
  }

  /// Stores a token's channels (load_token) into state row `row`, cast to BufferT.
  static DSV4_DEV void store_state_row(const Params& p, const Vec<InT, C> (&v)[W::kGroups], int64_t row, int channel) {
    BufferT* dst = static_cast<BufferT*>(p.state) + row * W::kRowWidth + channel;
#pragma unroll
    for (int g = 0; g < W::kGroups; ++g) store_vec(dst + g * kHeadDim, convert_vec<BufferT>(v[g]));
  }

  /// Stores this lane's channels of every column group of a token row into state row `row`.
  static DSV4_DEV void store_token(const Params& p, const InT* src, int64_t row, int channel) {
    Vec<InT, C> v[W::kGroups];
    load_token(src, channel, v);
    store_state_row(p, v, row, channel);
  }

  /// Decode, a block per unit (c4, and c128 batches of a few waves of blocks): write the current
  /// token; at a boundary pool the whole window from the ring (the last slot straight from
  /// registers: same values the ring now holds); else zero the output.
  /// Two dependent round trips: the plan row, with the token beside it; then the ape rows and every
  /// window slot at once, the token store behind them. The pooling comes after all of them. The
  /// first round trip finds its lines in L2 (prefetch_unit; a c128 unit only after the first wave of
  /// blocks).
  template <typename Sink>
  static DSV4_DEV void decode(const Params& p, const Lane& lane, Sink& sink) {
    if constexpr (kPrefetchesOwnUnit) prefetch_unit(p, lane, lane.row);
    if (p.ahead_rows != 0) prefetch_unit(p, lane, lane.row + p.ahead_rows);
    pdl_wait_upstream<kPDL>();
    if (lane.row >= p.num_rows) return;
    const bool last_warp = lane.warp_in_unit == W::kWarpsPerUnit - 1;
    Vec<InT, C> token[W::kGroups];
    if (last_warp) load_token(static_cast<const InT*>(p.input) + uint64_t{lane.row} * W::kRowWidth, lane.channel, token);
    const DecodePlan plan = load_row(static_cast<const DecodePlan*>(p.plan), lane.row);
    // Every field is needed before the first branch, so the row arrives in one round trip. The
    // masks equal the remainders for write_loc >= 0, the only rows that go on.
    const bool boundary = W::kOverlap ? plan.seq_len % kRatio == 0 : at_window_end(plan);
    const bool pooled = boundary && pages_in_range(p, plan.read_page_0, plan.read_page_1);
    constexpr int M = Sink::kMergeWarps;
    // Off boundary most of a c128 unit's warps have nothing to do: they leave at once rather than
    // hold the block's slot through the others' stores (the block's life is the plan round trip).
    if (Sink::kHoldersOnly && !pooled && !last_warp && lane.warp_in_unit >= M) return;
    // A sink that takes no row off a boundary (the store step: the row is not stored) leaves the
    // token's warp alone (the same for every block of a row).
    const bool idle = !Sink::kTakesIdleRows && !boundary && plan.seq_len % kRatio != 0;
    if (idle && !last_warp) return;
    if (!write_loc_ok(p, plan)) {
      if (lane.channel == 0 && lane.warp_in_unit == 0) report_status(p, kWriteLocOutOfRange);
      return;
    }
    if (idle) {
      store_state_row(p, token, plan.write_loc, lane.channel);
      return;
    }
    sink.prepare(lane);
    // A sink that stores the row from operands of its own (the ring c128 store step) starts their
    // copies here, beside the window loads.
    if constexpr (requires { sink.preload(lane, plan.seq_len); }) sink.preload(lane, plan.seq_len);
    // No load may move above a store (they might alias). Off boundary nothing is loaded, so the token
    // store goes at once; at a boundary it goes after the window loads, which then all leave together.
    if (last_warp && !pooled) store_state_row(p, token, plan.write_loc, lane.channel);
    float kv[kSlots][C], z[kSlots][C];
    if (pooled) {
      load_decode_window(p, plan, lane, token, last_warp, kv, z);
      if (last_warp) store_state_row(p, token, plan.write_loc, lane.channel);
    }
    pdl_launch_dependents<kPDL>();
    float v[C / M];
    bool holds;
    if (pooled) {
      holds = reduce_unit<M>(lane, kv, z, v);
    } else {  // non-boundary rows are zero-filled, never left uninitialised
      if (boundary && lane.channel == 0 && lane.warp_in_unit == 0) report_status(p, kStatePageOutOfRange);
#pragma unroll
      for (int c = 0; c < C / M; ++c) v[c] = 0.0f;
      holds = lane.warp_in_unit < M;
    }
    sink.emit(merged_lane<M>(lane), holds, v);
  }

  /// A c128 unit (a block of its own) prefetches only the unit a wave ahead: its own row's prefetch
  /// before the wait made multi-wave c128 decodes slower (docs/design-notes.md, "Ring decode: prefetch").
  static constexpr bool kPrefetchesOwnUnit = kRatio != 128;

  /// Brings a decode unit's plan row and token slice into L2 before the upstream wait: its own (while
  /// the kernel before it finishes; kPrefetchesOwnUnit), and those of the unit one wave of blocks
  /// ahead (`row` = lane.row + p.ahead_rows), whose block then finds them there instead of in DRAM.
  /// Allowed before the wait: a prefetch returns nothing, and L2 is coherent, so a line that a
  /// running kernel still writes is never read stale.
  static DSV4_DEV void prefetch_unit(const Params& p, const Lane& lane, uint32_t row) {
    if (row >= p.num_rows || threadIdx.x % kWarpSize != 0) return;
    if (lane.warp_in_unit == 0 && lane.channel == 0) {
      prefetch_l2(static_cast<const DecodePlan*>(p.plan) + row);
    }
    if (lane.warp_in_unit == W::kWarpsPerUnit - 1) {  // the token's warp (decode)
      const auto* token = static_cast<const InT*>(p.input) + uint64_t{row} * W::kRowWidth + lane.channel;
#pragma unroll
      for (int g = 0; g < W::kGroups; ++g) prefetch_l2_bulk(token + g * kHeadDim, W::kUnitChannels * sizeof(InT));
    }
  }

  /// This warp's slots of a decode window at a boundary, from the ring, but for the last slot in the
  /// token's warp (`token_warp`), which comes from this step's token (token_slot).
  static DSV4_DEV void load_decode_window(const Params& p, const DecodePlan& plan, const Lane& lane,
                                          const Vec<InT, C> (&token)[W::kGroups], bool token_warp,
                                          float (&kv)[kSlots][C], float (&z)[kSlots][C]) {
    const WindowSource src{0, plan.read_page_0, plan.read_page_1, W::kSlots, plan.seq_len};
    Bias bias;
    load_bias(p, lane, bias);
    if (token_warp) {
      load_window<kSlots - 1>(p, src, lane, bias, kv, z);
      token_slot(token, bias[kSlots - 1], kv[kSlots - 1], z[kSlots - 1]);
    } else {
      load_window<kSlots>(p, src, lane, bias, kv, z);
    }
  }

  static DSV4_DEV bool write_loc_ok(const Params& p, const DecodePlan& plan) {
    return plan.write_loc >= 0 && plan.write_loc < p.num_pages * kRatio;
  }

  /// The token goes to the window's last ring row (write_loc in range).
  static DSV4_DEV bool at_window_end(const DecodePlan& plan) { return (plan.write_loc & (kRatio - 1)) == kRatio - 1; }

  /// kv and z of the window's last slot from this step's token (its column groups, load_token),
  /// through BufferT exactly as a read-back of the ring would be.
  static DSV4_DEV void token_slot(const Vec<InT, C> (&token)[W::kGroups], const Vec<InT, C>& bias, float (&kv)[C],
                                  float (&z)[C]) {
    constexpr int s = W::kSlots - 1;
    slot_values(convert_vec<BufferT>(token[W::kv_col(s) / kHeadDim]),
                convert_vec<BufferT>(token[W::score_col(s) / kHeadDim]), bias, kv, z);
  }
};

}  // namespace dsv4::compress
