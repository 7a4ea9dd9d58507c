// The online c128 compressor (contract §5): one running softmax state row per request instead of a
// 128-row ring. A state row is m | s | k (3·hd values, BufferT): running max of z = score + ape,
// running sum Σ exp(z − m), and the normalized average k = Σ kv·exp(z − m) / s. In registers the
// state is a SoftmaxPartial {max = m, sum = s, acc = k·s}, so every update of contract §5.2 (one token, a
// segment, a stored state) is merge_into of window_softmax.cuh.
//
//   decode : unit = (request, 128-channel slice), one warp, 16-byte lanes. Fold the token into the
//            stored state (reset at chunk offset 0); offset 127 emits k', others store the state and
//            zero their output row (contract §9.3).
//   prefill: unit = (segment row, 64-channel slice), kWarps warps splitting the segment's (up to
//            128) tokens 8 each; per-warp partials merge in shared memory, then into the stored
//            state when the segment continues a chunk. Two launches in stream order: the pool
//            pass (plan_c, emits output rows) reads stored states before the write pass (plan_w)
//            replaces them.
// Emitted rows go to a sink (prepare() once the row is known valid, emit() by every thread of the
// unit): the output rows here, the store step in the fused kernel (fused/fused.cuh).
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

#include "host_entry.h"
#include "output_rows.cuh"
#include "unit_lane.cuh"
#include "window_softmax.cuh"

namespace dsv4::compress::online {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

inline constexpr int kChunk = 128;  // tokens per compressed row: the state restarts every kChunk positions

/// Status bits for checked mode (the row is skipped).
enum StatusBit : int32_t {
  kStateRowOutOfRange = 1,
  kRaggedRowOutOfRange = 2,
  kBadSegment = 4,  // segment_len is 0 or reaches before its chunk
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kStateRowOutOfRange, "a plan row names a state row outside kv_score_buffer"},
                            {kRaggedRowOutOfRange, "a segment row names ragged rows outside kv_score_input"},
                            {kBadSegment, "a segment row's segment_len is 0 or reaches before its 128-token chunk"}});
}

struct Params {
  void* state;          // [num_state_rows, 1, 3·hd] BufferT
  const float* input;   // [num_input_rows, 2·hd]: kv | score
  const float* ape;     // [128, hd]
  float* out;           // [rows of plan_c or plan_d, hd]
  const void* plan;     // OnlinePlan segment rows (prefill passes) or DecodePlan rows
  const void* plan_w;   // prefill: the write pass's segment rows
  bool after_pool;      // write pass: a pool pass runs just before it (the pass loads before waiting)
  int64_t num_state_rows;
  int64_t num_input_rows;
  uint32_t num_rows;    // rows of `plan`
  int32_t* status;      // checked mode: OR of StatusBit, else nullptr
};

template <int kHeadDim, typename BufferT, bool kPDL>
struct Kernels {
  static_assert(kHeadDim % 128 == 0, "online c128 needs head_dim % 128 == 0");

  /// Per-thread coordinates of a unit covering 32·C channels.
  template <int C>
  using Lane = UnitLane<C, kHeadDim / (kWarpSize * C)>;

  static DSV4_DEV bool state_row_ok(const Params& p, int32_t row) { return row >= 0 && row < p.num_state_rows; }

  /// A stored state row as a partial: {m, s, k·s}. `P`: any parameters with the pool as `state`
  /// (this compressor's, or the speculative-decoding ops' of online_mtp.cuh).
  template <int C, typename P>
  static DSV4_DEV SoftmaxPartial<C> load_state(const P& p, int64_t row, int channel) {
    const BufferT* src = state_values(p, row, channel);
    return state_partial<C>(load_vec<C>(src), load_vec<C>(src + kHeadDim), load_vec<C>(src + 2 * kHeadDim));
  }

  /// Where a lane's channels of state row `row` begin (m; s and k follow a head dim apart each).
  template <typename P>
  static DSV4_DEV const BufferT* state_values(const P& p, int64_t row, int channel) {
    return static_cast<const BufferT*>(p.state) + row * 3 * kHeadDim + channel;
  }

  /// The partial {m, s, k·s} of a state row's values.
  template <int C>
  static DSV4_DEV SoftmaxPartial<C> state_partial(const Vec<BufferT, C>& m, const Vec<BufferT, C>& s,
                                                  const Vec<BufferT, C>& k) {
    SoftmaxPartial<C> part;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      part.max[c] = to_f32(m[c]);
      part.sum[c] = to_f32(s[c]);
      part.acc[c] = to_f32(k[c]) * part.sum[c];
    }
    return part;
  }

  template <int C, typename P>
  static DSV4_DEV void store_state(const P& p, int64_t row, int channel, const SoftmaxPartial<C>& part) {
    BufferT* dst = static_cast<BufferT*>(p.state) + row * 3 * kHeadDim + channel;
    Vec<BufferT, C> m, s, k;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      m[c] = from_f32<BufferT>(part.max[c]);
      s[c] = from_f32<BufferT>(part.sum[c]);
      k[c] = from_f32<BufferT>(pooled_value(part, c));
    }
    store_vec(dst, m);
    store_vec(dst + kHeadDim, s);
    store_vec(dst + 2 * kHeadDim, k);
  }

  using OutputRows = dsv4::OutputRows<Params, float, kHeadDim>;  // compress_forward's

  /// kv and z = score + ape[offset] of one input token (`P`: parameters with `input` and `ape`).
  template <int C, typename P>
  static DSV4_DEV void load_token(const P& p, int64_t ragged_row, int offset, int channel, float (&kv)[C],
                                  float (&z)[C]) {
    load_token_scores(p, ragged_row, channel, kv, z);
    add_ape(p, offset, channel, z);
  }

  /// kv and the score of one input token, before its ape row (whose offset may not be known yet).
  template <int C, typename P>
  static DSV4_DEV void load_token_scores(const P& p, int64_t ragged_row, int channel, float (&kv)[C],
                                         float (&score)[C]) {
    const float* row = token_values(p, ragged_row, channel);
    const Vec<float, C> k = load_vec<C>(row), sc = load_vec<C>(row + kHeadDim);
#pragma unroll
    for (int c = 0; c < C; ++c) kv[c] = k[c], score[c] = sc[c];
  }

  /// Where a lane's channels of input token `ragged_row` begin (kv; its score a head dim after).
  template <typename P>
  static DSV4_DEV const float* token_values(const P& p, int64_t ragged_row, int channel) {
    return p.input + ragged_row * 2 * kHeadDim + channel;
  }

  /// Where a lane's channels of ape row `offset` begin.
  template <typename P>
  static DSV4_DEV const float* ape_values(const P& p, int offset, int channel) {
    return p.ape + offset * kHeadDim + channel;
  }

  /// score -> z = score + ape[offset].
  template <int C, typename P>
  static DSV4_DEV void add_ape(const P& p, int offset, int channel, float (&z)[C]) {
    const Vec<float, C> bias = load_vec<C>(ape_values(p, offset, channel));
#pragma unroll
    for (int c = 0; c < C; ++c) z[c] += bias[c];
  }

  // ---- decode ---------------------------------------------------------------------------------
  static constexpr int kDecodeC = 4;  // 16-byte lanes: one warp covers 128 channels
  static constexpr int kDecodeUnitsPerBlock = 4;
  static constexpr int kDecodeThreads = kDecodeUnitsPerBlock * kWarpSize;
  using DecodeLane = Lane<kDecodeC>;

  /// A decode lane's operands, an entry per thread: its token (kv, score), the ape row at its chunk
  /// offset and the stored state. They are staged through shared memory so that they leave together:
  /// as plain loads the compiler issued the token's kv only after the state's sum and value had
  /// arrived, a second round trip after the plan's.
  struct DecodeOperands {
    Vec<float, kDecodeC> kv, score, ape;
    Vec<BufferT, kDecodeC> m, s, k;
  };

  template <typename Sink>
  static DSV4_DEV void decode(const Params& p, Sink& sink) {
    constexpr int C = kDecodeC;
    constexpr int kStateBytes = sizeof(Vec<BufferT, C>);
    __shared__ DecodeOperands staged[kDecodeThreads];
    const DecodeLane lane = DecodeLane::of(kDecodeUnitsPerBlock, 1);
    pdl_wait_upstream<kPDL>();  // plans and inputs may come from the kernels just before
    if (lane.row >= p.num_rows) return;
    const DecodePlan plan = load_row(static_cast<const DecodePlan*>(p.plan), lane.row);
    const int offset = static_cast<int>((plan.seq_len - 1) % kChunk);
    const bool load = offset != 0, emit = offset == kChunk - 1;
    const bool ok = (!load || state_row_ok(p, plan.read_page_0)) && (emit || state_row_ok(p, plan.write_loc));
    sink.prepare(lane);
    float out[C] = {};  // non-emitting rows are zero-filled
    if (ok) {
      DecodeOperands& op = staged[threadIdx.x];
      const float* token = token_values(p, lane.row, lane.channel);
      cp_async<16>(&op.kv, token);
      cp_async<16>(&op.score, token + kHeadDim);
      cp_async<16>(&op.ape, ape_values(p, offset, lane.channel));
      if (load) {
        const BufferT* src = state_values(p, plan.read_page_0, lane.channel);
        cp_async<kStateBytes>(&op.m, src);
        cp_async<kStateBytes>(&op.s, src + kHeadDim);
        cp_async<kStateBytes>(&op.k, src + 2 * kHeadDim);
      }
      cp_async_wait_all();  // each thread reads only its own entry
      pdl_launch_dependents<kPDL>();
      SoftmaxPartial<C> token_state;  // {m = z, s = 1, acc = kv}: the reset state
#pragma unroll
      for (int c = 0; c < C; ++c) {
        token_state.max[c] = op.score[c] + op.ape[c];
        token_state.sum[c] = 1.0f;
        token_state.acc[c] = op.kv[c];
      }
      SoftmaxPartial<C> state = token_state;
      if (load) {
        state = state_partial<C>(op.m, op.s, op.k);
        merge_into(state, token_state);
      }
      if (emit) {
#pragma unroll
        for (int c = 0; c < C; ++c) out[c] = pooled_value(state, c);
      } else {
        store_state(p, plan.write_loc, lane.channel, state);
      }
    } else if (lane.channel == 0) {
      report_status(p, kStateRowOutOfRange);
    }
    sink.emit(lane, true, out);
  }

  // ---- prefill --------------------------------------------------------------------------------
  // 8-byte lanes keep 8 tokens' loads in flight at 64 registers, two units resident per SM (the
  // same trade-off as the c128 ring kernel: one unit's merge overlaps the other's loads).
  static constexpr int kPrefillC = 2;
  static constexpr int kTokensPerWarp = 8;
  static constexpr int kPrefillWarps = kChunk / kTokensPerWarp;
  static constexpr int kPrefillThreads = kPrefillWarps * kWarpSize;
  static constexpr int kPrefillMinBlocks = 2;
  using PrefillLane = Lane<kPrefillC>;

  /// One segment row per unit; kStore: write pass (state -> store_slot), else pool pass (emits the
  /// pooled row to `sink`). Everything the write pass reads (plan rows, tokens, stored states) is an
  /// input of the step, complete before the pool pass began and written by no kernel running now:
  /// after a pool pass it loads and pools before waiting for it, and only the state store (a row the
  /// pool pass may read) follows it. kSlicesInTurn: the block pools the row's slices one after
  /// another (pool_unit), calling this once per slice.
  template <bool kStore, bool kSlicesInTurn = false, typename Sink>
  static DSV4_DEV void prefill(const Params& p, const PrefillLane& lane, Sink& sink) {
    constexpr int C = kPrefillC;
    const int slice = lane.channel / (kWarpSize * C);
    const bool early = kStore && p.after_pool;
    WaitUpstreamOnExit<kPDL> wait_on_exit{early};
    if (!early) pdl_wait_upstream<kPDL>();
    if (lane.row >= p.num_rows) return;
    const OnlinePlan plan = load_row(static_cast<const OnlinePlan*>(p.plan), lane.row);
    if (plan.is_invalid()) return;
    const int end = static_cast<int>((plan.seq_len - 1) % kChunk) + 1;  // chunk offsets [end - n, end)
    const int n = plan.segment_len;
    const int64_t first_ragged = int64_t{plan.ragged_id} - n + 1;
    const bool merge = end - n > 0;
    const int32_t stored_row = plan.merge_slot();
    int32_t bad = 0;
    if (n == 0 || n > end) bad |= kBadSegment;
    if (first_ragged < 0 || plan.ragged_id >= p.num_input_rows) bad |= kRaggedRowOutOfRange;
    if ((merge && !state_row_ok(p, stored_row)) || (kStore && !state_row_ok(p, plan.store_slot))) {
      bad |= kStateRowOutOfRange;
    }
    if (bad) {
      if (lane.channel == 0 && lane.warp_in_unit == 0) report_status(p, bad);
      return;
    }
    if constexpr (!kStore) sink.prepare(lane);
    const bool lead = lane.warp_in_unit == merging_warp<kPrefillWarps, kSlicesInTurn>(slice);
    SoftmaxPartial<C> stored;
    if (lead && merge) stored = load_state<C>(p, stored_row, lane.channel);  // in flight with the tokens
    float kv[kTokensPerWarp][C], z[kTokensPerWarp][C];
#pragma unroll
    for (int i = 0; i < kTokensPerWarp; ++i) {
      const int t = lane.warp_in_unit * kTokensPerWarp + i;
      if (t < n) {
        load_token<C>(p, first_ragged + t, end - n + t, lane.channel, kv[i], z[i]);
      } else {  // past the segment: weight exactly 0, never loaded
#pragma unroll
        for (int c = 0; c < C; ++c) kv[i][c] = 0.0f, z[i][c] = -INFINITY;
      }
    }
    pdl_launch_dependents<kPDL>();
    SoftmaxPartial<C> part;
    if (pool_unit<kPrefillWarps, kSlicesInTurn, 1>(kv, z, lane.warp_in_unit, slice, part) && merge) {
      merge_into(stored, part);  // the stored partial covers the chunk's earlier tokens
      part = stored;
    }
    if constexpr (kStore) {
      pdl_wait_upstream<kPDL>();  // the pool pass has read every stored state
      if (lead) store_state(p, plan.store_slot, lane.channel, part);
    } else {
      float out[C];
#pragma unroll
      for (int c = 0; c < C; ++c) out[c] = pooled_value(part, c);
      sink.emit(lane, lead, out);
    }
  }
};

template <typename K>
__global__ __launch_bounds__(K::kDecodeThreads) void decode_kernel(const __grid_constant__ Params p) {
  typename K::OutputRows sink{p};
  K::decode(p, sink);
}

template <typename K, bool kStore>
__global__ __launch_bounds__(K::kPrefillThreads, K::kPrefillMinBlocks) void prefill_kernel(const __grid_constant__ Params p) {
  typename K::OutputRows sink{p};  // the pool pass's (the write pass emits nothing)
  K::template prefill<kStore>(p, K::PrefillLane::of(1, K::kPrefillWarps), sink);
}

/// Host entry points of one instantiation (checks every tensor before any launch).
template <int kHeadDim, typename BufferT, bool kPDL>
struct OnlineEntry : CompressorEntryBase<OnlineEntry<kHeadDim, BufferT, kPDL>, OnlinePlan, OnlinePlan> {
  using K = Kernels<kHeadDim, BufferT, kPDL>;
  static constexpr const char* kOp = "compress_forward";
  static constexpr int kPrefillSlices = K::PrefillLane::kSlices;

  /// CompressorEntryBase's checks of the state rows [rows, 1, 3·hd], fp32 input and ape (and `out`);
  /// `input_rows` and `out_rows` bind the row counts.
  static Params common(const char* op, Device& dev, const TensorView& state, const TensorView& input,
                       const TensorView& ape, const TensorView* out, int32_t* status, Size& input_rows,
                       Size& out_rows) {
    Size state_rows{"num_state_rows"};
    Check(op, "kv_score_buffer", state).pool(state_rows, 1, 3 * kHeadDim).dtype(DTypeInfo<BufferT>::dtype)
        .cuda(dev).contiguous().aligned();
    Check(op, "kv_score_input", input).shape({input_rows, 2 * kHeadDim}).dtype(dl::kF32).cuda(dev).contiguous()
        .aligned();
    Check(op, "ape", ape).shape({kChunk, kHeadDim}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Params p{};
    p.out = static_cast<float*>(OnlineEntry::template output<float>(op, dev, out, kHeadDim, out_rows));
    p.state = state.data_ptr();
    p.input = static_cast<const float*>(input.data_ptr());
    p.ape = static_cast<const float*>(ape.data_ptr());
    p.num_state_rows = state_rows.value;
    p.num_input_rows = input_rows.value;
    p.status = status;
    return p;
  }

  static unsigned decode_blocks(uint32_t rows) {
    return div_ceil(uint64_t{rows} * K::DecodeLane::kSlices, K::kDecodeUnitsPerBlock);
  }

  static void launch_pool(const char* op, const Device& dev, const Params& p) {
    launch(op, dev.dev, {p.num_rows * kPrefillSlices, K::kPrefillThreads}, kPDL, prefill_kernel<K, false>, p);
  }

  /// The write pass reads its segment rows from plan_w.
  static void launch_write(const char* op, const Device& dev, Params p) {
    p.plan = p.plan_w;
    launch(op, dev.dev, {p.num_rows * kPrefillSlices, K::kPrefillThreads}, kPDL, prefill_kernel<K, true>, p);
  }

  static void launch_decode(const char* op, const Device& dev, const Params& p) {
    launch(op, dev.dev, {decode_blocks(p.num_rows), K::kDecodeThreads}, kPDL, decode_kernel<K>, p);
  }
};

}  // namespace dsv4::compress::online
