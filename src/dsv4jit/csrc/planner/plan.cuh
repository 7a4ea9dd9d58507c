// The planner on the GPU (contract §3): prefill plans from device-resident lengths (CUDA-graph
// capturable, no host sync) or host-resident lengths, and decode plans. One kernel emits final
// rows in CPU order; see planner/rules.h for why that needs no atomics.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <algorithm>
#include <vector>

#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/scan.cuh"
#include "common/types.cuh"
#include "args.h"
#include "online.h"

namespace dsv4::plan {

inline constexpr int kThreads = 256;
inline constexpr int kTokensPerBlock = kThreads;  // one token per thread: latency over table reuse

/// Host-built request tables travel as kernel parameters (no staging copy): size classes.
template <int kMaxRequests>
struct RequestTable {
  RequestEntry entries[kMaxRequests + 1];
};
template <>
struct RequestTable<0> {};  // device lengths: the kernel builds the table itself

/// Rows: RingPrefillRows or OnlinePrefillRows (rules.h), the row types of plan_c and plan_w.
template <typename Rows>
struct PrefillParamsOf {
  Geometry g;
  Tables tables;
  typename Rows::Compress* plan_c;
  typename Rows::Write* plan_w;
  uint32_t cap_c, cap_w;          // rows the plan tensors hold
  uint32_t max_tokens;            // ragged ids must stay below num_q_tokens
  uint32_t num_requests;          // requests in this launch's table
  uint32_t batch_offset;          // batch id of table entry 0
  uint32_t token_begin;           // ragged id of this launch's index 0
  uint32_t index_count;           // indices covered by the grid (tokens and padding rows)
  bool pad;                       // write invalid rows from the totals up to the capacities
  const int64_t* seq_lens;        // device lengths (RequestTable<0> only)
  const int64_t* extend_lens;
  int32_t* status;                // checked mode: status words (see plan_status), else nullptr
};
using PrefillParams = PrefillParamsOf<RingPrefillRows>;

struct DecodeParams {
  Geometry g;
  Tables tables;
  DecodePlan* plan_d;
  const int64_t* seq_lens;
  uint32_t batch_size;
  int32_t* status;
};

/// Checked mode's status words: [0] the OR of StatusBit, [2..3] the lowest violation_key (u64,
/// 8-byte aligned; kNoViolation initially), merged once per thread that met a violation.
DSV4_DEV void report(int32_t* words, int32_t status, uint64_t first) {
  if (status == 0 || words == nullptr) return;
  atomicOr(words, status);
  atomicMin(reinterpret_cast<unsigned long long*>(words + 2), static_cast<unsigned long long>(first));
}

DSV4_DEV void note_request(int32_t& status, uint64_t& first, int32_t bit, uint32_t batch_id) {
  status |= bit;
  first = min(first, violation_key(batch_id, 0));
}

/// Shared-memory request table plus the facts every emitting thread needs.
struct SharedTable {
  RequestEntry entries[kMaxDeviceBatch + 1];
  uint32_t scratch[kThreads / kWarpSize + 1];
  uint32_t uniform_extend;  // E when every request extends by E tokens, else 0
};

/// Builds the table from device lengths: closed-form counts per request, block-wide prefix sums.
template <typename Params>
DSV4_DEV int32_t build_table_on_device(const Params& p, SharedTable& s, uint64_t& first_violation) {
  constexpr int kPerThread = (kMaxDeviceBatch + kThreads - 1) / kThreads;
  const uint32_t first = threadIdx.x * kPerThread;
  uint32_t ext[kPerThread], cnt_c[kPerThread], cnt_w[kPerThread];
  int32_t seq[kPerThread];
  uint32_t sum_e = 0, sum_c = 0, sum_w = 0;
  int32_t status = 0;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const uint32_t b = first + i;
    ext[i] = cnt_c[i] = cnt_w[i] = 0;
    seq[i] = 0;
    if (b < p.num_requests) {
      const int64_t sl = p.seq_lens[b], el = p.extend_lens[b];
      if (valid_lengths(sl, el)) {
        const Span span = Span::of(p.g, static_cast<int32_t>(sl), static_cast<int32_t>(el));
        seq[i] = span.seq_len;
        ext[i] = static_cast<uint32_t>(el);
        cnt_c[i] = span.num_events(p.g);
        cnt_w[i] = span.num_writes(p.g);
        if (p.tables.r2t_rows >= 0 && sl > p.tables.r2t_cols) {
          note_request(status, first_violation, kReqToTokenOutOfRange, b);
        }
      } else {
        note_request(status, first_violation, kBadLengths, b);  // contributes no tokens and no rows
      }
    }
    sum_e += ext[i];
    sum_c += cnt_c[i];
    sum_w += cnt_w[i];
  }
  uint32_t total_e, total_c, total_w;
  uint32_t base_e = block_exclusive_scan<kThreads>(sum_e, s.scratch, total_e);
  uint32_t base_c = block_exclusive_scan<kThreads>(sum_c, s.scratch, total_c);
  uint32_t base_w = block_exclusive_scan<kThreads>(sum_w, s.scratch, total_w);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const uint32_t b = first + i;
    if (b < p.num_requests) s.entries[b] = {seq[i], base_e, base_c, base_w};
    base_e += ext[i];
    base_c += cnt_c[i];
    base_w += cnt_w[i];
  }
  if (threadIdx.x == 0) s.entries[p.num_requests] = {0, total_e, total_c, total_w};
  __syncthreads();
  // MTP verify batches extend every request by the same E: then token k belongs to request k / E.
  const uint32_t e0 = p.num_requests > 0 ? s.entries[1].ragged_base - s.entries[0].ragged_base : 0;
  bool same = true;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) same &= first + i >= p.num_requests || ext[i] == e0;
  const bool uniform = __syncthreads_and(same) && e0 > 0;
  if (threadIdx.x == 0) s.uniform_extend = uniform ? e0 : 0;
  __syncthreads();
  return status;
}

template <int kMaxRequests>
DSV4_DEV void copy_table(const RequestTable<kMaxRequests>& table, uint32_t n, SharedTable& s) {
  for (uint32_t b = threadIdx.x; b <= n; b += kThreads) s.entries[b] = table.entries[b];
  if (threadIdx.x == 0) s.uniform_extend = 0;
  __syncthreads();
}

/// Index of the request holding token k (largest b with ragged_base <= k).
DSV4_DEV uint32_t find_request(const SharedTable& s, uint32_t n, uint32_t k) {
  if (s.uniform_extend) return (k - s.entries[0].ragged_base) / s.uniform_extend;
  uint32_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (s.entries[mid].ragged_base <= k) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <bool kPDL, int kMaxRequests, typename Rows = RingPrefillRows>
__global__ __launch_bounds__(kThreads) void prefill_kernel(const __grid_constant__ PrefillParamsOf<Rows> p,
                                                           const __grid_constant__ RequestTable<kMaxRequests> table) {
  __shared__ SharedTable s;
  pdl_wait_upstream<kPDL>();  // lengths and lookup tables may come from the previous kernel
  int32_t status = 0;
  uint64_t first = kNoViolation;
  if constexpr (kMaxRequests == 0) {
    status |= build_table_on_device(p, s, first);
  } else {
    copy_table(table, p.num_requests, s);
  }
  const uint32_t n = p.num_requests;
  const RequestEntry totals = s.entries[n];
  Tables tables = p.tables;
  tables.status = &status;
  tables.first = &first;
  const uint32_t token_end = min(totals.ragged_base, p.max_tokens);
  uint32_t pad_c = totals.row_c, pad_w = totals.row_w;
  if (totals.ragged_base > p.max_tokens && n > 0) {
    // Tokens past the bucket are dropped, and so are the rows they would own: padding starts there.
    const uint32_t b = find_request(s, n, p.max_tokens);
    const RequestEntry req = s.entries[b];
    const Span span = Span::of(p.g, req.seq_len, static_cast<int32_t>(s.entries[b + 1].ragged_base - req.ragged_base));
    const int32_t pos = span.prefix_len + static_cast<int32_t>(p.max_tokens - req.ragged_base);
    pad_c = req.row_c + span.events_before(p.g, pos);
    pad_w = req.row_w + span.writes_before(p.g, pos);
    if (threadIdx.x == 0 && blockIdx.x == 0) status |= kTokensDropped;
  }
  const uint32_t begin = blockIdx.x * kTokensPerBlock;
  const uint32_t end = min(begin + kTokensPerBlock, p.index_count);
  for (uint32_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const uint32_t k = p.token_begin + i;
    if (n > 0 && k >= s.entries[0].ragged_base && k < token_end) {
      const uint32_t b = find_request(s, n, k);
      const RequestEntry req = s.entries[b];
      const int32_t extend = static_cast<int32_t>(s.entries[b + 1].ragged_base - req.ragged_base);
      const Span span = Span::of(p.g, req.seq_len, extend);
      status |= emit_token(p.g, tables, span, p.batch_offset + b, req, static_cast<int32_t>(k - req.ragged_base),
                           p.plan_c, p.cap_c, p.plan_w, p.cap_w);
    }
    if (p.pad) {
      if (i >= pad_c && i < p.cap_c) p.plan_c[i] = Rows::Compress::invalid();
      if (i >= pad_w && i < p.cap_w) p.plan_w[i] = Rows::Write::invalid();
    }
  }
  report(p.status, status, first);
  pdl_launch_dependents<kPDL>();
}

template <bool kPDL>
__global__ __launch_bounds__(kThreads) void decode_kernel(const __grid_constant__ DecodeParams p) {
  pdl_wait_upstream<kPDL>();
  const uint32_t b = blockIdx.x * kThreads + threadIdx.x;
  int32_t status = 0;
  uint64_t first = kNoViolation;
  if (b < p.batch_size) {
    Tables tables = p.tables;
    tables.status = &status;
    tables.first = &first;
    const int64_t seq_len = p.seq_lens[b];
    if (seq_len < 1 || seq_len > INT32_MAX) {
      note_request(status, first, kBadLengths, b);
    } else if (p.tables.r2t_rows >= 0 && seq_len > p.tables.r2t_cols) {
      note_request(status, first, kReqToTokenOutOfRange, b);
    }
    p.plan_d[b] = decode_row(p.g, tables, b, static_cast<int32_t>(seq_len));
  }
  report(p.status, status, first);
  pdl_launch_dependents<kPDL>();
}

/// Checked mode's status words of a planner launch (see report), or nullptr.
inline int32_t* plan_status(const char* op, Device& dev, const Optional<TensorView>& status) {
  if (status.has_value()) Check(op, "status", status.value()).aligned(8);
  return status_words(op, dev, status, 4);
}

/// One element of a planner input, on the device or the host (checked mode's error path only).
struct CopyOne {
  template <typename T>
  T operator()(const T* p) const {
    T value;
    check_cuda("describe_status", cudaMemcpy(&value, p, sizeof value, cudaMemcpyDefault), "copy");
    return value;
  }
};

/// Checked mode's message for a planner call's status words (a CPU copy, int32[4]): the first
/// violation by argument, index and value (read from the call's inputs), then the other findings.
inline tvm::ffi::String describe_status(TensorView status, TensorView req_pool_indices,
                                        Optional<TensorView> req_to_token, Optional<TensorView> full_to_state,
                                        TensorView seq_lens, Optional<TensorView> extend_lens) {
  Check("describe_status", "status", status).shape({4}).dtype(dl::kI32).cpu().contiguous();
  const auto* ext = extend_lens.has_value() ? static_cast<const int64_t*>(extend_lens.value().data_ptr()) : nullptr;
  return tvm::ffi::String(describe_status_words(static_cast<const int32_t*>(status.data_ptr()),
                                                tables_of(req_pool_indices, req_to_token, full_to_state),
                                                static_cast<const int64_t*>(seq_lens.data_ptr()), ext, CopyOne{}));
}

template <bool kPDL>
struct PlannerEntry {
  /// GPU-input prefill: lengths on the device; plans are [num_q_tokens, ...], rows past the
  /// totals invalid. No host sync; data-dependent violations are dropped and reported in status.
  static void prefill_device(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                             Optional<TensorView> full_to_state, TensorView seq_lens, TensorView extend_lens,
                             TensorView plan_c, TensorView plan_w, Optional<TensorView> status, int64_t compress_ratio,
                             int64_t swa_page_size, int64_t ring_size, bool use_req_ring, bool legacy) {
    const char* op = prefill_op(legacy);
    const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
    Size batch{"batch_size"};
    Device dev;
    const Tables tables = checked_tables(op, g, req_pool_indices, req_to_token, full_to_state, batch, dev, true);
    launch_device_lengths<RingPrefillRows>(op, g, tables, batch, dev, seq_lens, extend_lens, plan_c, plan_w, status);
  }

  /// Online c128 (contract §3.8) from device lengths: both plans [num_q_tokens, 16], invalid past the counts.
  static void prefill_online_device(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                    TensorView seq_lens, TensorView extend_lens, TensorView plan_c, TensorView plan_w,
                                    Optional<TensorView> status, int64_t state_slot_offset) {
    const char* op = kPrefillOnlineOp;
    const Geometry g = checked_online_geometry(op, state_slot_offset);
    Size batch{"batch_size"};
    Device dev;
    const Tables tables = checked_online_tables(op, g, req_pool_indices, req_to_token, batch, dev, true);
    launch_device_lengths<OnlinePrefillRows>(op, g, tables, batch, dev, seq_lens, extend_lens, plan_c, plan_w, status);
  }

  template <typename Rows>
  static void launch_device_lengths(const char* op, const Geometry& g, const Tables& tables, Size& batch,
                                    Device& dev, const TensorView& seq_lens, const TensorView& extend_lens,
                                    const TensorView& plan_c, const TensorView& plan_w,
                                    const Optional<TensorView>& status) {
    Size num_q{"num_q_tokens"};
    PrefillParamsOf<Rows> p{};
    p.tables = tables;
    Check(op, "seq_lens", seq_lens).shape({batch}).dtype(dl::kI64).cuda(dev).contiguous();
    Check(op, "extend_lens", extend_lens).shape({batch}).dtype(dl::kI64).cuda(dev).contiguous();
    check_plan_tensor(op, "plan_c", plan_c, num_q, sizeof(typename Rows::Compress), dev, true);
    check_plan_tensor(op, "plan_w", plan_w, num_q, sizeof(typename Rows::Write), dev, true);
    expect(batch.value <= kMaxDeviceBatch, op, "seq_lens",
           [&] { return "at most " + std::to_string(kMaxDeviceBatch) + " requests on the GPU-input path"; }, batch.value);
    expect(num_q.value <= kMaxTokens, op, "num_q_tokens", [&] { return "at most " + std::to_string(kMaxTokens); }, num_q.value);
    expect(batch.value <= num_q.value, op, "num_q_tokens", "at least the batch size", num_q.value);
    p.g = g;
    p.plan_c = static_cast<typename Rows::Compress*>(plan_c.data_ptr());
    p.plan_w = static_cast<typename Rows::Write*>(plan_w.data_ptr());
    p.cap_c = p.cap_w = p.max_tokens = p.index_count = static_cast<uint32_t>(num_q.value);
    p.num_requests = static_cast<uint32_t>(batch.value);
    p.pad = true;
    p.seq_lens = static_cast<const int64_t*>(seq_lens.data_ptr());
    p.extend_lens = static_cast<const int64_t*>(extend_lens.data_ptr());
    p.status = plan_status(op, dev, status);
    launch(op, dev.dev, {div_ceil(p.index_count, kTokensPerBlock), kThreads}, kPDL, prefill_kernel<kPDL, 0, Rows>,
           p, RequestTable<0>{});
  }

  /// CPU-input prefill: lengths on the host, plans on the device with room for the rows (see
  /// prefill_counts); with use_cuda_graph the plans have num_q_tokens rows, invalid past the counts.
  /// Request tables ride in kernel parameters (no staging copy), chunked by size class.
  static void prefill_host_lengths(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                   Optional<TensorView> full_to_state, TensorView seq_lens, TensorView extend_lens,
                                   TensorView plan_c, TensorView plan_w, Optional<TensorView> status,
                                   int64_t num_q_tokens, int64_t compress_ratio, int64_t swa_page_size,
                                   int64_t ring_size, bool use_req_ring, bool legacy, bool use_cuda_graph) {
    const char* op = prefill_op(legacy);
    HostPrefill h = checked_host_prefill(op, req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens,
                                         plan_c, plan_w, num_q_tokens, compress_ratio, swa_page_size, ring_size,
                                         use_req_ring, legacy, use_cuda_graph, true);
    launch_host_lengths(op, h, status, num_q_tokens, use_cuda_graph);
  }

  /// Online c128 (contract §3.8) from host lengths: exact-size plans (num_q_tokens rows with use_cuda_graph).
  static void prefill_online_host_lengths(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                          TensorView seq_lens, TensorView extend_lens, TensorView plan_c,
                                          TensorView plan_w, Optional<TensorView> status, int64_t num_q_tokens,
                                          int64_t state_slot_offset, bool use_cuda_graph) {
    const char* op = kPrefillOnlineOp;
    HostPrefillOf<OnlinePrefillRows> h = checked_online_host_prefill(op, req_pool_indices, req_to_token, seq_lens,
                                                                     extend_lens, plan_c, plan_w, num_q_tokens,
                                                                     state_slot_offset, use_cuda_graph, true);
    launch_host_lengths(op, h, status, num_q_tokens, use_cuda_graph);
  }

  template <typename Rows>
  static void launch_host_lengths(const char* op, HostPrefillOf<Rows>& h, const Optional<TensorView>& status,
                                  int64_t num_q_tokens, bool use_cuda_graph) {
    PrefillParamsOf<Rows> p{};
    p.g = h.g;
    p.tables = h.tables;
    p.plan_c = h.plan_c;
    p.plan_w = h.plan_w;
    p.cap_c = h.cap_c;
    p.cap_w = h.cap_w;
    p.max_tokens = static_cast<uint32_t>(num_q_tokens);
    p.status = plan_status(op, h.dev, status);
    uint32_t b0 = 0;
    do {  // at least once, so that padding happens even for an empty batch
      const uint32_t n = std::min<uint32_t>(h.batch - b0, kMaxDeviceBatch);
      p.num_requests = n;
      p.batch_offset = b0;
      p.pad = use_cuda_graph && b0 + n == h.batch;
      if (p.pad) {  // the last chunk also covers every padding row (indices are rows and tokens)
        p.token_begin = 0;
        p.index_count = static_cast<uint32_t>(num_q_tokens);
      } else {
        p.token_begin = h.table[b0].ragged_base;
        p.index_count = h.table[b0 + n].ragged_base - p.token_begin;
      }
      launch_with_table(op, h.dev, p, h.table.data() + b0, n);
      b0 += n;
    } while (b0 < h.batch);
  }

  template <int kMax, typename Rows>
  static void launch_sized(const char* op, Device& dev, const PrefillParamsOf<Rows>& p,
                           const RequestEntry* entries, uint32_t n) {
    RequestTable<kMax> t{};
    // Entries keep absolute row and ragged bases, so chunks compose without rebasing.
    std::copy(entries, entries + n + 1, t.entries);
    launch(op, dev.dev, {div_ceil(p.index_count, kTokensPerBlock), kThreads}, kPDL,
           prefill_kernel<kPDL, kMax, Rows>, p, t);
  }

  template <typename Rows>
  static void launch_with_table(const char* op, Device& dev, PrefillParamsOf<Rows> p,
                                const RequestEntry* entries, uint32_t n) {
    if (n <= 16) return launch_sized<16>(op, dev, p, entries, n);
    if (n <= 128) return launch_sized<128>(op, dev, p, entries, n);
    return launch_sized<kMaxDeviceBatch>(op, dev, p, entries, n);
  }

  /// Fills plan_d [batch, 16]; with plan_d None, allocates it and returns it (PlanOutput).
  static Optional<Tensor> decode(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                 Optional<TensorView> full_to_state, TensorView seq_lens, Optional<TensorView> plan_d,
                                 Optional<TensorView> status, int64_t compress_ratio, int64_t swa_page_size,
                                 int64_t ring_size, bool use_req_ring, bool legacy) {
    const char* op = decode_op(legacy);
    const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
    Size batch{"batch_size"};
    Device dev;
    const Tables tables = checked_tables(op, g, req_pool_indices, req_to_token, full_to_state, batch, dev, true);
    return launch_decode(op, g, tables, batch, dev, seq_lens, plan_d, status);
  }

  /// Online c128 (contract §3.8): {seq_len, rid + offset, rid + offset, -1} per request (plan_d as decode).
  static Optional<Tensor> decode_online(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                        TensorView seq_lens, Optional<TensorView> plan_d, Optional<TensorView> status,
                                        int64_t state_slot_offset) {
    const char* op = kDecodeOnlineOp;
    const Geometry g = checked_online_geometry(op, state_slot_offset);
    Size batch{"batch_size"};
    Device dev;
    const Tables tables = checked_online_tables(op, g, req_pool_indices, req_to_token, batch, dev, true);
    return launch_decode(op, g, tables, batch, dev, seq_lens, plan_d, status);
  }

  static Optional<Tensor> launch_decode(const char* op, const Geometry& g, const Tables& tables, Size& batch,
                                        Device& dev, const TensorView& seq_lens, const Optional<TensorView>& plan_d,
                                        const Optional<TensorView>& status) {
    Check(op, "seq_lens", seq_lens).shape({batch}).dtype(dl::kI64).cuda(dev).contiguous();
    PlanOutput out = PlanOutput::of(op, "plan_d", plan_d, batch, sizeof(DecodePlan), dev, true);
    DecodeParams p{};
    p.tables = tables;
    p.g = g;
    p.plan_d = static_cast<DecodePlan*>(out.data);
    p.seq_lens = static_cast<const int64_t*>(seq_lens.data_ptr());
    p.batch_size = static_cast<uint32_t>(batch.value);
    p.status = plan_status(op, dev, status);
    launch(op, dev.dev, {div_ceil(p.batch_size, kThreads), kThreads}, kPDL, decode_kernel<kPDL>, p);
    return out.owned;
  }
};

}  // namespace dsv4::plan
