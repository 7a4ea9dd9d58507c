// Online c128 with speculative decoding (contract §5.6): the draft-state ops a serving stack calls
// around a verify step. The pool holds banks of `stride` state rows: bank 0 the requests' main
// states, bank k the state after the first k draft tokens.
//
//   write_prefix_states: unit = (request, 32-channel slice), one warp, a channel a lane. Continue
//                        the request's main state (reset at chunk offset 0) with its V draft
//                        tokens, storing the state after token k in bank k + 1 unless that prefix
//                        closes a 128-token chunk.
//   mark_pending       : one launch: each block resets its range of pending lengths, then records
//                        the batch's lengths that fall in its range (no grid-wide ordering needed).
//   commit_pending     : unit = one request, one warp: copy the accepted prefix's draft state into
//                        the main slot, 16 bytes a lane.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/status.cuh"
#include "common/tensor_check.h"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"

#include "online.cuh"
#include "window_softmax.cuh"

namespace dsv4::compress::online_mtp {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

inline constexpr int kChunk = online::kChunk;
inline constexpr int kMaxVerifyTokens = 8;  // the draft tokens a unit holds in registers

/// Status bits for checked mode (the request is skipped).
enum StatusBit : int32_t {
  kBadRequest = 1,  // write_prefix_states: a negative length, or a request slot outside the main bank
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kBadRequest, "a request has a negative seq_lens entry or a req_pool_indices entry "
                                          "outside [0, state_slot_stride)"}});
}

/// A length or slot array of int32 or int64 entries (the dtype is the caller's, read per element).
struct IndexArray {
  const void* data;
  bool wide;
  DSV4_DEV int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(data)[i] : int64_t{static_cast<const int32_t*>(data)[i]};
  }
};

struct Params {
  void* state;               // [rows, 1, 3·hd] BufferT: bank k at rows [k·stride, (k + 1)·stride)
  const float* input;        // write_prefix_states: [batch·V, 2·hd] kv | score, request-major
  const float* ape;          // [128, hd]
  IndexArray seq_lens;       // write_prefix_states, mark_pending: before the verify; commit: after it
  IndexArray req_pool_indices;
  int64_t* pending;          // [≥ num_req_slots] lengths recorded by mark_pending (−1: none)
  int64_t stride;            // state_slot_stride
  int64_t num_req_slots;
  uint32_t batch;
  int32_t num_verify_tokens;
  int32_t* status;           // checked mode: OR of StatusBit, else nullptr
};

template <int kHeadDim, typename BufferT, bool kPDL>
struct Kernels {
  using K = online::Kernels<kHeadDim, BufferT, kPDL>;
  // One channel a lane: a request's V steps of merges and stores run in a warp per 32 channels, so
  // a small verify batch spreads its serial chain over as many threads as it has channels.
  static constexpr int C = 1;
  static constexpr int kUnitsPerBlock = 4;
  static constexpr int kThreads = kUnitsPerBlock * kWarpSize;
  using Lane = typename K::template Lane<C>;

  static DSV4_DEV void write_prefix(const Params& p) {
    const Lane lane = Lane::of(kUnitsPerBlock, 1);
    pdl_wait_upstream<kPDL>();  // lengths, tokens and states may come from the kernels just before
    if (lane.row >= p.batch) return;
    // The draft tokens' rows do not depend on the lengths: they load beside them, and only the state
    // and the ape rows wait for the length (two round trips, the second one small).
    float kv[kMaxVerifyTokens][C], z[kMaxVerifyTokens][C];
#pragma unroll
    for (int i = 0; i < kMaxVerifyTokens; ++i) {
      if (i < p.num_verify_tokens) {
        K::template load_token_scores<C>(p, int64_t{lane.row} * p.num_verify_tokens + i, lane.channel, kv[i], z[i]);
      }
    }
    const int64_t seq = p.seq_lens[lane.row], slot = p.req_pool_indices[lane.row];
    if (seq < 0 || slot < 0 || slot >= p.stride) {
      if (lane.channel == 0) report_status(p, kBadRequest);
      return;
    }
    const int start = static_cast<int>(seq % kChunk);
    SoftmaxPartial<C> run{};
    if (start != 0) run = K::template load_state<C>(p, slot, lane.channel);  // continues its chunk
#pragma unroll
    for (int i = 0; i < kMaxVerifyTokens; ++i) {
      if (i < p.num_verify_tokens) K::template add_ape<C>(p, (start + i) % kChunk, lane.channel, z[i]);
    }
    pdl_launch_dependents<kPDL>();
#pragma unroll
    for (int i = 0; i < kMaxVerifyTokens; ++i) {
      if (i >= p.num_verify_tokens) break;
      SoftmaxPartial<C> token;  // {m = z, s = 1, acc = kv}: the state of this token alone
#pragma unroll
      for (int c = 0; c < C; ++c) token.max[c] = z[i][c], token.sum[c] = 1.0f, token.acc[c] = kv[i][c];
      if ((start + i) % kChunk == 0) {
        run = token;  // a chunk starts: the state resets
      } else {
        merge_into(run, token);
      }
      // a prefix that closes its chunk leaves no state: the next token starts a new one
      if ((seq + i + 1) % kChunk != 0) K::store_state(p, slot + (i + 1) * p.stride, lane.channel, run);
    }
  }

  static constexpr int kMarkThreads = 256;

  /// Block b owns pending rows [b·kMarkThreads, (b + 1)·kMarkThreads): it resets them, then records
  /// the batch's lengths whose slot it owns, so every record follows the reset of its row.
  static DSV4_DEV void mark_pending(const Params& p) {
    const int64_t first = int64_t{blockIdx.x} * kMarkThreads;
    pdl_wait_upstream<kPDL>();
    pdl_launch_dependents<kPDL>();
    if (first + threadIdx.x < p.num_req_slots) p.pending[first + threadIdx.x] = -1;
    __syncthreads();
    for (uint32_t b = threadIdx.x; b < p.batch; b += kMarkThreads) {
      const int64_t slot = p.req_pool_indices[b];
      if (slot >= first && slot < first + kMarkThreads && slot < p.num_req_slots) p.pending[slot] = p.seq_lens[b];
    }
  }

  static constexpr int kRowVectors = 3 * kHeadDim * sizeof(BufferT) / 16;  // 16-byte vectors of a state row

  static DSV4_DEV void commit_pending(const Params& p) {
    const uint32_t row = blockIdx.x * kUnitsPerBlock + threadIdx.x / kWarpSize;
    const int lane = threadIdx.x % kWarpSize;
    pdl_wait_upstream<kPDL>();
    pdl_launch_dependents<kPDL>();
    if (row >= p.batch) return;
    const int64_t slot = p.req_pool_indices[row];
    if (slot < 0 || slot >= p.num_req_slots) return;  // not a request of the pending verify
    const int64_t before = p.pending[slot];
    if (before < 0) return;
    const int64_t accepted = min(max(p.seq_lens[row] - before, int64_t{0}), int64_t{p.num_verify_tokens});
    // nothing accepted keeps the main state; a prefix that closes its chunk leaves none to keep
    if (accepted == 0 || (before + accepted) % kChunk == 0) return;
    const uint4* src = static_cast<const uint4*>(p.state) + (slot + accepted * p.stride) * kRowVectors;
    uint4* dst = static_cast<uint4*>(p.state) + slot * kRowVectors;
    uint4 v[div_ceil_const(kRowVectors, kWarpSize)];
#pragma unroll
    for (int i = 0; i < div_ceil_const(kRowVectors, kWarpSize); ++i) {
      if (lane + i * kWarpSize < kRowVectors) v[i] = src[lane + i * kWarpSize];
    }
#pragma unroll
    for (int i = 0; i < div_ceil_const(kRowVectors, kWarpSize); ++i) {
      if (lane + i * kWarpSize < kRowVectors) dst[lane + i * kWarpSize] = v[i];
    }
  }

  static constexpr int div_ceil_const(int a, int b) { return (a + b - 1) / b; }
};

template <typename K>
__global__ __launch_bounds__(K::kThreads) void write_prefix_kernel(const __grid_constant__ Params p) {
  K::write_prefix(p);
}

template <typename K>
__global__ __launch_bounds__(K::kMarkThreads) void mark_pending_kernel(const __grid_constant__ Params p) {
  K::mark_pending(p);
}

template <typename K>
__global__ __launch_bounds__(K::kThreads) void commit_pending_kernel(const __grid_constant__ Params p) {
  K::commit_pending(p);
}

/// Host entry points of one instantiation: every tensor and scalar checked before any launch, so a
/// rejected call writes nothing. Argument names are the public ops'.
template <int kHeadDim, typename BufferT, bool kPDL>
struct DraftStatesEntry {
  using K = Kernels<kHeadDim, BufferT, kPDL>;

  /// An int32 or int64 vector of at least `batch` entries.
  static IndexArray indices(const char* op, const char* arg, Device& dev, const TensorView& t, int64_t batch) {
    Check(op, arg, t).shape({Dim::any()}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
    expect(t.size(0) >= batch, op, arg, [&] { return "at least batch_size = " + std::to_string(batch) + " entries"; },
           t.size(0));
    return {t.data_ptr(), t.dtype().bits == 64};
  }

  static void verify_tokens(const char* op, int64_t num_verify_tokens) {
    expect(num_verify_tokens >= 1 && num_verify_tokens <= kMaxVerifyTokens, op, "num_verify_tokens",
           "in [1, 8]", num_verify_tokens);
  }

  static void nonnegative(const char* op, const char* arg, int64_t value) { expect(value >= 0, op, arg, ">= 0", value); }

  /// The pool [rows, 1, 3·hd] with a main bank and a draft bank per verify token of `stride` rows.
  static void* state(const char* op, Device& dev, const TensorView& state, int64_t num_verify_tokens, int64_t stride) {
    expect(stride >= 1, op, "state_slot_stride", ">= 1", stride);
    Size rows{"num_state_rows"};
    Check(op, "state", state).pool(rows, 1, 3 * kHeadDim).dtype(DTypeInfo<BufferT>::dtype).cuda(dev)
        .contiguous().aligned();
    expect(rows.value >= (num_verify_tokens + 1) * stride, op, "state_slot_stride",
           [&] {
             return "at most num_state_rows / (num_verify_tokens + 1) = " + std::to_string(rows.value) + " / " +
                    std::to_string(num_verify_tokens + 1) + " (a main bank and a draft bank per verify token)";
           },
           stride);
    return state.data_ptr();
  }

  static int64_t* pending(const char* op, Device& dev, const TensorView& pending, int64_t num_req_slots) {
    nonnegative(op, "num_req_slots", num_req_slots);
    Check(op, "pending_seq_lens", pending).shape({Dim::any()}).dtype(dl::kI64).cuda(dev).contiguous();
    expect(pending.size(0) >= num_req_slots, op, "num_req_slots",
           [&] { return "at most the " + std::to_string(pending.size(0)) + " entries of pending_seq_lens"; },
           num_req_slots);
    return static_cast<int64_t*>(pending.data_ptr());
  }

  static void write_prefix_states(TensorView kv_score_input, TensorView seq_lens, TensorView req_pool_indices,
                                  TensorView req_to_token, TensorView ape, TensorView state, int64_t batch_size,
                                  int64_t num_verify_tokens, int64_t state_slot_stride, Optional<TensorView> status) {
    const char* op = "online_c128_mtp_write_prefix_states";
    nonnegative(op, "batch_size", batch_size);
    verify_tokens(op, num_verify_tokens);
    Device dev;
    Params p{};
    p.state = DraftStatesEntry::state(op, dev, state, num_verify_tokens, state_slot_stride);
    Size input_rows{"num_input_rows"};
    Check(op, "kv_score_input", kv_score_input).shape({input_rows, 2 * kHeadDim}).dtype(dl::kF32).cuda(dev)
        .contiguous().aligned();
    expect(input_rows.value >= batch_size * num_verify_tokens, op, "kv_score_input",
           [&] { return "at least batch_size · num_verify_tokens = " + std::to_string(batch_size * num_verify_tokens) +
                        " rows"; },
           input_rows.value);
    Check(op, "ape", ape).shape({kChunk, kHeadDim}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Check(op, "req_to_token", req_to_token).shape({Dim::any(), Dim::any()}).dtype(dl::kI32).cuda(dev);
    p.seq_lens = indices(op, "seq_lens", dev, seq_lens, batch_size);
    p.req_pool_indices = indices(op, "req_pool_indices", dev, req_pool_indices, batch_size);
    p.input = static_cast<const float*>(kv_score_input.data_ptr());
    p.ape = static_cast<const float*>(ape.data_ptr());
    p.stride = state_slot_stride;
    p.batch = static_cast<uint32_t>(batch_size);
    p.num_verify_tokens = static_cast<int32_t>(num_verify_tokens);
    p.status = status_words(op, dev, status);
    launch(op, dev.dev, {div_ceil(uint64_t{p.batch} * K::Lane::kSlices, K::kUnitsPerBlock), K::kThreads}, kPDL,
           write_prefix_kernel<K>, p);
  }

  static void mark_pending(TensorView seq_lens, TensorView req_pool_indices, TensorView pending_seq_lens,
                           int64_t batch_size, int64_t num_req_slots) {
    const char* op = "online_c128_mtp_mark_pending";
    nonnegative(op, "batch_size", batch_size);
    Device dev;
    Params p{};
    p.pending = pending(op, dev, pending_seq_lens, num_req_slots);
    p.seq_lens = indices(op, "seq_lens", dev, seq_lens, batch_size);
    p.req_pool_indices = indices(op, "req_pool_indices", dev, req_pool_indices, batch_size);
    p.num_req_slots = num_req_slots;
    p.batch = static_cast<uint32_t>(batch_size);
    if (batch_size == 0) return;  // an empty verify records nothing (and resets nothing)
    launch(op, dev.dev, {div_ceil(num_req_slots, K::kMarkThreads), K::kMarkThreads}, kPDL, mark_pending_kernel<K>, p);
  }

  static void commit_pending(TensorView seq_lens, TensorView req_pool_indices, TensorView req_to_token,
                             TensorView pending_seq_lens, TensorView state, int64_t batch_size,
                             int64_t num_verify_tokens, int64_t state_slot_stride, int64_t num_req_slots) {
    const char* op = "online_c128_mtp_commit_pending";
    nonnegative(op, "batch_size", batch_size);
    verify_tokens(op, num_verify_tokens);
    Device dev;
    Params p{};
    p.state = DraftStatesEntry::state(op, dev, state, num_verify_tokens, state_slot_stride);
    p.pending = pending(op, dev, pending_seq_lens, num_req_slots);
    expect(num_req_slots <= state_slot_stride, op, "state_slot_stride",
           [&] { return "at least num_req_slots = " + std::to_string(num_req_slots) +
                        " (a draft bank must not reach into the main one)"; },
           state_slot_stride);
    Check(op, "req_to_token", req_to_token).shape({Dim::any(), Dim::any()}).dtype(dl::kI32).cuda(dev);
    p.seq_lens = indices(op, "seq_lens", dev, seq_lens, batch_size);
    p.req_pool_indices = indices(op, "req_pool_indices", dev, req_pool_indices, batch_size);
    p.stride = state_slot_stride;
    p.num_req_slots = num_req_slots;
    p.batch = static_cast<uint32_t>(batch_size);
    p.num_verify_tokens = static_cast<int32_t>(num_verify_tokens);
    launch(op, dev.dev, {div_ceil(p.batch, K::kUnitsPerBlock), K::kThreads}, kPDL, commit_pending_kernel<K>, p);
  }
};

}  // namespace dsv4::compress::online_mtp
