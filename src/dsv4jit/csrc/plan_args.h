// Host-side argument handling shared by the GPU planner entry points and the host-only
// (CPU-resident) planner: scalar limits, lookup tables, and the request table built from
// host-resident lengths. Host-only: compiles without CUDA headers.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/tensor_check.h"
#include "plan_rules.h"

namespace dsv4::plan {

using tvm::ffi::Optional;
using tvm::ffi::Tensor;
using tvm::ffi::TensorView;

inline constexpr int64_t kMaxTokens = 65536;         // ragged ids are u16
inline constexpr int64_t kMaxBatch = 65535;          // pack(65535, 65535) would alias the sentinel
inline constexpr int64_t kMaxDeviceBatch = 1024;     // GPU-input prefill: one request table per block

/// Validates the planner scalars (contract §8.2) and derives the geometry.
inline Geometry checked_geometry(const char* op, int64_t ratio, int64_t swa_page_size, int64_t ring_size,
                                 bool use_req_ring, bool legacy) {
  expect(ratio == 4 || ratio == 128, op, "compress_ratio", "4 or 128", ratio);
  expect(!use_req_ring || ratio == 4, op, "use_req_ring", "False when compress_ratio is 128", "True");
  if (!legacy) {
    expect(ring_size > 0 && ring_size % ratio == 0, op, "ring_size",
           [&] { return "a positive multiple of compress_ratio (" + std::to_string(ratio) + ")"; }, ring_size);
    expect(swa_page_size > 0 && swa_page_size % ring_size == 0, op, "swa_page_size",
           [&] { return "a positive multiple of ring_size (" + std::to_string(ring_size) + ")"; }, swa_page_size);
    expect(ring_size <= INT32_MAX && swa_page_size <= INT32_MAX, op, "ring_size", "< 2^31", ring_size);
  }
  return make_geometry(static_cast<int32_t>(ratio), legacy ? 1 : static_cast<int32_t>(swa_page_size),
                       legacy ? ratio * (ratio == 4 ? 2 : 1) : static_cast<int32_t>(ring_size), use_req_ring,
                       legacy);
}

/// Checks req_pool_indices [B] i64, and (paged scheme) req_to_token [R, C] i32 with unit column
/// stride and full_to_state [N] i64; all on `dev`. Returns the lookup tables (status unset).
inline Tables checked_tables(const char* op, const Geometry& g, const TensorView& req_pool_indices,
                             const Optional<TensorView>& req_to_token, const Optional<TensorView>& full_to_state,
                             Size& batch, Device& dev, bool on_cuda) {
  auto place = [&](Check& c) -> Check& { return on_cuda ? c.cuda(dev) : c.cpu().same_device(dev); };
  {
    Check c(op, "req_pool_indices", req_pool_indices);
    place(c.shape({batch}).dtype(dl::kI64)).contiguous();
  }
  Tables t{};
  t.req_pool_indices = static_cast<const int64_t*>(req_pool_indices.data_ptr());
  if (g.scheme == Scheme::kLegacy || g.scheme == Scheme::kOnline) return t;
  if (!req_to_token.has_value() || !full_to_state.has_value()) {
    TVM_FFI_THROW(ValueError) << "dsv4jit." << op << ": req_to_token and full_to_state are required (got None)";
  }
  const TensorView& r2t = req_to_token.value();
  const TensorView& f2s = full_to_state.value();
  {
    Check c(op, "req_to_token", r2t);
    place(c.shape({Dim::any(), Dim::any()}).dtype(dl::kI32));
  }
  expect(r2t.stride(1) == 1, op, "req_to_token", "rows with unit column stride (stride(1) == 1)", r2t.stride(1));
  {
    Check c(op, "full_to_state", f2s);
    place(c.shape({Dim::any()}).dtype(dl::kI64)).contiguous();
  }
  t.req_to_token = static_cast<const int32_t*>(r2t.data_ptr());
  t.full_to_state = static_cast<const int64_t*>(f2s.data_ptr());
  t.r2t_rows = r2t.size(0);
  t.r2t_cols = r2t.size(1);
  t.r2t_stride = r2t.stride(0);
  t.f2s_len = f2s.size(0);
  return t;
}

/// A plan tensor [rows, row_bytes] u8, contiguous, 16-byte aligned.
inline void check_plan_tensor(const char* op, const char* name, const TensorView& t, Size& rows, int64_t row_bytes,
                              Device& dev, bool on_cuda) {
  Check c(op, name, t);
  c.shape({rows, row_bytes}).dtype(dl::kU8).contiguous().aligned(16);
  if (on_cuda) {
    c.cuda(dev);
  } else {
    c.cpu().same_device(dev);
  }
}

/// The plan tensor [rows, row_bytes] u8 a call fills: the caller's (checked), or, when the caller
/// passes None, a new one from torch's caching allocator (tvm-ffi's environment allocator: torch's,
/// on its current stream), returned to the caller in `owned`. Allocating in the call that fills
/// the plan saves a Python-side torch.empty (a few µs of host time) on the decode path; callers
/// pass their own where torch lacks the DLPack exchange API that the environment allocator needs.
struct PlanOutput {
  Optional<Tensor> owned;
  void* data;

  static PlanOutput of(const char* op, const char* name, const Optional<TensorView>& given, Size& rows,
                       int64_t row_bytes, Device& dev, bool on_cuda) {
    if (given.has_value()) {
      check_plan_tensor(op, name, given.value(), rows, row_bytes, dev, on_cuda);
      return {std::nullopt, given.value().data_ptr()};
    }
    Tensor t = Tensor::FromEnvAlloc(TVMFFIEnvTensorAlloc, {rows.value, row_bytes}, DLDataType{kDLUInt, 8, 1}, dev.dev);
    void* data = t.data_ptr();
    return {std::move(t), data};
  }
};

struct Totals {
  uint32_t num_c = 0;
  uint32_t num_w = 0;

  /// Both counts in one integer (num_c << 32 | num_w): a scalar return crosses tvm-ffi much
  /// faster than a tuple, and this call sits on the host path of every CPU-length prefill plan.
  int64_t packed() const { return static_cast<int64_t>((uint64_t{num_c} << 32) | num_w); }
};

/// Request table from host-resident lengths (entry B holds the totals), validating every request.
inline Totals build_request_table(const char* op, const Geometry& g, const TensorView& seq_lens,
                                  const TensorView& extend_lens, Size& batch, int64_t num_q_tokens,
                                  std::vector<RequestEntry>& table) {
  Check(op, "seq_lens", seq_lens).shape({batch}).dtype(dl::kI64).cpu().contiguous();
  Check(op, "extend_lens", extend_lens).shape({batch}).dtype(dl::kI64).cpu().contiguous();
  const int64_t B = batch.value;
  expect(B <= kMaxBatch, op, "seq_lens", [&] { return "at most " + std::to_string(kMaxBatch) + " requests"; }, B);
  expect(num_q_tokens >= 0 && num_q_tokens <= kMaxTokens, op, "num_q_tokens",
         [&] { return "in [0, " + std::to_string(kMaxTokens) + "]"; }, num_q_tokens);
  expect(B <= num_q_tokens, op, "num_q_tokens", [&] { return "at least the batch size (" + std::to_string(B) + ")"; }, num_q_tokens);
  const auto* seq = static_cast<const int64_t*>(seq_lens.data_ptr());
  const auto* ext = static_cast<const int64_t*>(extend_lens.data_ptr());
  table.resize(B + 1);
  uint64_t tokens = 0;
  Totals totals;
  for (int64_t b = 0; b < B; ++b) {
    if (!valid_lengths(seq[b], ext[b])) {
      TVM_FFI_THROW(ValueError) << "dsv4jit." << op << ": request " << b << " must have 0 < extend_len <= seq_len, got "
                                << "extend_lens[" << b << "] = " << ext[b] << ", seq_lens[" << b << "] = " << seq[b];
    }
    const Span span = Span::of(g, static_cast<int32_t>(seq[b]), static_cast<int32_t>(ext[b]));
    table[b] = {span.seq_len, static_cast<uint32_t>(tokens), totals.num_c, totals.num_w};
    tokens += static_cast<uint64_t>(ext[b]);
    totals.num_c += span.num_events(g);
    totals.num_w += span.num_writes(g);
    if (tokens > static_cast<uint64_t>(num_q_tokens)) break;
  }
  expect(tokens == static_cast<uint64_t>(num_q_tokens), op, "num_q_tokens",
         [&] { return "the sum of extend_lens (" + std::to_string(tokens) + (tokens > static_cast<uint64_t>(num_q_tokens) ? "+" : "") +
             ")"; },
         num_q_tokens);
  table[B] = {0, static_cast<uint32_t>(tokens), totals.num_c, totals.num_w};
  return totals;
}

/// Everything a prefill from host-resident lengths needs, checked: the request table (entry B holds
/// the totals) and plan tensors with room for the rows (all num_q_tokens rows with use_cuda_graph).
/// WriteRow: WritePlan (ring planners) or CompressPlan (online segments).
template <typename WriteRow>
struct HostPrefillOf {
  Geometry g;
  Tables tables;
  Device dev;
  std::vector<RequestEntry> table;
  uint32_t batch = 0;
  uint32_t cap_c = 0, cap_w = 0;  // rows to fill: the counts, or num_q_tokens with use_cuda_graph
  CompressPlan* plan_c = nullptr;
  WriteRow* plan_w = nullptr;
};
using HostPrefill = HostPrefillOf<WritePlan>;

/// The lengths and plan tensors of a host-lengths prefill, once h.g, h.tables and h.dev are set.
template <typename WriteRow>
inline void check_host_lengths(const char* op, HostPrefillOf<WriteRow>& h, Size& batch, const TensorView& seq_lens,
                               const TensorView& extend_lens, const TensorView& plan_c, const TensorView& plan_w,
                               int64_t num_q_tokens, bool use_cuda_graph, bool on_cuda) {
  Size rows_c{"plan_c_rows"}, rows_w{"plan_w_rows"};
  const Totals totals = build_request_table(op, h.g, seq_lens, extend_lens, batch, num_q_tokens, h.table);
  check_plan_tensor(op, "plan_c", plan_c, rows_c, sizeof(CompressPlan), h.dev, on_cuda);
  check_plan_tensor(op, "plan_w", plan_w, rows_w, sizeof(WriteRow), h.dev, on_cuda);
  const int64_t cap_c = use_cuda_graph ? num_q_tokens : totals.num_c;
  const int64_t cap_w = use_cuda_graph ? num_q_tokens : totals.num_w;
  expect(rows_c.value >= cap_c, op, "plan_c", [&] { return "at least " + std::to_string(cap_c) + " rows"; },
         rows_c.value);
  expect(rows_w.value >= cap_w, op, "plan_w", [&] { return "at least " + std::to_string(cap_w) + " rows"; },
         rows_w.value);
  h.batch = static_cast<uint32_t>(batch.value);
  h.cap_c = static_cast<uint32_t>(cap_c);
  h.cap_w = static_cast<uint32_t>(cap_w);
  h.plan_c = static_cast<CompressPlan*>(plan_c.data_ptr());
  h.plan_w = static_cast<WriteRow*>(plan_w.data_ptr());
}

inline HostPrefill checked_host_prefill(const char* op, const TensorView& req_pool_indices,
                                        const Optional<TensorView>& req_to_token,
                                        const Optional<TensorView>& full_to_state, const TensorView& seq_lens,
                                        const TensorView& extend_lens, const TensorView& plan_c,
                                        const TensorView& plan_w, int64_t num_q_tokens, int64_t compress_ratio,
                                        int64_t swa_page_size, int64_t ring_size, bool use_req_ring, bool legacy,
                                        bool use_cuda_graph, bool on_cuda) {
  HostPrefill h;
  h.g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
  Size batch{"batch_size"};
  h.tables = checked_tables(op, h.g, req_pool_indices, req_to_token, full_to_state, batch, h.dev, on_cuda);
  check_host_lengths(op, h, batch, seq_lens, extend_lens, plan_c, plan_w, num_q_tokens, use_cuda_graph, on_cuda);
  return h;
}

/// Row counts of a prefill plan from host-resident lengths (Totals::packed), validating them; lets
/// the caller allocate exactly-sized plans before planning.
inline int64_t prefill_counts(TensorView seq_lens, TensorView extend_lens, int64_t num_q_tokens,
                              int64_t compress_ratio, int64_t swa_page_size, int64_t ring_size, bool use_req_ring,
                              bool legacy) {
  const char* op = "plan_prefill";
  const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
  Size batch{"batch_size"};
  std::vector<RequestEntry> table;
  const Totals totals = build_request_table(op, g, seq_lens, extend_lens, batch, num_q_tokens, table);
  return totals.packed();
}

/// Message for checked mode (status bits reported by the planner).
inline tvm::ffi::String describe_status(int64_t status) {
  std::string s;
  auto add = [&](int32_t bit, const char* what) {
    if (status & bit) s += (s.empty() ? "" : "; ") + std::string(what);
  };
  add(kTokensDropped, "more tokens or rows than the plan tensors hold (sum of extend_lens > num_q_tokens?)");
  add(kBadLengths, "a request has extend_len <= 0, extend_len > seq_len, or seq_len < 1");
  add(kReqToTokenOutOfRange, "a req_to_token lookup is out of range (req_pool_indices or position)");
  add(kFullToStateOutOfRange, "a full_to_state lookup is out of range (req_to_token holds a bad slot)");
  add(kNegativeStateSlot, "full_to_state maps a needed token to a negative state slot (evicted?)");
  return tvm::ffi::String(s);
}

}  // namespace dsv4::plan
