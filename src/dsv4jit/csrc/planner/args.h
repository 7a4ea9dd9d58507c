// Host-side argument handling shared by the GPU planner entry points and the host-only
// (CPU-resident) planner: scalar limits, lookup tables, the request table built from
// host-resident lengths, and the description of a violation by argument, index and value.
// Host-only: compiles without CUDA headers.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "common/tensor_check.h"
#include "rules.h"

namespace dsv4::plan {

using tvm::ffi::Optional;
using tvm::ffi::Tensor;
using tvm::ffi::TensorView;

inline constexpr int64_t kMaxTokens = 65536;         // ragged ids are u16
inline constexpr int64_t kMaxBatch = 65535;          // pack(65535, 65535) would alias the sentinel
inline constexpr int64_t kMaxDeviceBatch = 1024;     // GPU-input prefill: one request table per block

/// The public function a planner entry point serves (errors name it, not the entry point).
inline const char* prefill_op(bool legacy) {
  return legacy ? "CompressorPrefillPlan.generate_legacy" : "CompressorPrefillPlan.generate";
}
inline const char* decode_op(bool legacy) {
  return legacy ? "CompressorDecodePlan.generate_legacy" : "CompressorDecodePlan.generate";
}
inline constexpr const char* kPrefillOnlineOp = "CompressorPrefillPlan.generate_online";
inline constexpr const char* kDecodeOnlineOp = "CompressorDecodePlan.generate_online";

/// ValueError "dsv4jit.<op>: argument '<name>': entry <index> must be <expectation>, got <actual>".
template <typename T>
[[noreturn]] inline void bad_entry(const char* op, const char* name, const std::string& index,
                                   const std::string& expectation, const T& actual) {
  TVM_FFI_THROW(DSV4JITArgumentError) << "dsv4jit." << op << ": argument '" << name << "': entry " << index << " must be "
                            << expectation << ", got " << actual;
  __builtin_unreachable();
}

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

/// The lookup tables of already checked tensors (status unset); no req_to_token: r2t_rows = -1.
inline Tables tables_of(const TensorView& req_pool_indices, const Optional<TensorView>& req_to_token,
                        const Optional<TensorView>& full_to_state) {
  Tables t{};
  t.req_pool_indices = static_cast<const int64_t*>(req_pool_indices.data_ptr());
  t.r2t_rows = -1;
  t.keyed = ~0;
  if (req_to_token.has_value()) {
    const TensorView& r2t = req_to_token.value();
    t.req_to_token = static_cast<const int32_t*>(r2t.data_ptr());
    t.r2t_rows = r2t.size(0);
    t.r2t_cols = r2t.size(1);
    t.r2t_stride = r2t.stride(0);
  }
  if (full_to_state.has_value()) {
    t.full_to_state = static_cast<const int64_t*>(full_to_state.value().data_ptr());
    t.f2s_len = full_to_state.value().size(0);
  }
  return t;
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
  if (g.scheme == Scheme::kLegacy || g.scheme == Scheme::kOnline) {
    return tables_of(req_pool_indices, Optional<TensorView>(), Optional<TensorView>());
  }
  if (!req_to_token.has_value() || !full_to_state.has_value()) {
    TVM_FFI_THROW(DSV4JITArgumentError) << "dsv4jit." << op << ": req_to_token and full_to_state are required (got None)";
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
  return tables_of(req_pool_indices, req_to_token, full_to_state);
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

/// Lengths that fail valid_lengths: which of the two is wrong, and how.
[[noreturn]] inline void bad_lengths(const char* op, int64_t b, int64_t seq_len, int64_t extend_len) {
  const std::string bs = std::to_string(b);
  if (seq_len > INT32_MAX) bad_entry(op, "seq_lens", bs, "below 2^31", seq_len);
  if (seq_len < 1) bad_entry(op, "seq_lens", bs, ">= 1", seq_len);  // no extend length could fit
  bad_entry(op, "extend_lens", bs, "in [1, seq_lens[" + bs + "] = " + std::to_string(seq_len) + "]", extend_len);
}

/// The limit req_to_token puts on seq_lens: its columns (-1: no req_to_token).
inline int64_t max_seq_len(const Tables& t) { return t.r2t_rows >= 0 ? t.r2t_cols : -1; }

/// Host-resident seq_lens[b] against req_to_token's columns (positions 0 .. seq_len - 1 are its).
inline void check_seq_len_fits(const char* op, int64_t b, int64_t seq_len, int64_t max_seq) {
  if (max_seq >= 0 && seq_len > max_seq) {
    bad_entry(op, "seq_lens", std::to_string(b), "at most " + std::to_string(max_seq) + " (the columns of req_to_token)",
              seq_len);
  }
}

/// Request table from host-resident lengths (entry B holds the totals), validating every request
/// (`max_seq`: see max_seq_len).
inline Totals build_request_table(const char* op, const Geometry& g, const TensorView& seq_lens,
                                  const TensorView& extend_lens, Size& batch, int64_t num_q_tokens,
                                  std::vector<RequestEntry>& table, int64_t max_seq = -1) {
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
    if (!valid_lengths(seq[b], ext[b])) bad_lengths(op, b, seq[b], ext[b]);
    check_seq_len_fits(op, b, seq[b], max_seq);
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
/// Rows: RingPrefillRows or OnlinePrefillRows (rules.h), the row types of plan_c and plan_w.
template <typename Rows>
struct HostPrefillOf {
  Geometry g;
  Tables tables;
  Device dev;
  std::vector<RequestEntry> table;
  uint32_t batch = 0;
  uint32_t cap_c = 0, cap_w = 0;  // rows to fill: the counts, or num_q_tokens with use_cuda_graph
  typename Rows::Compress* plan_c = nullptr;
  typename Rows::Write* plan_w = nullptr;
};
using HostPrefill = HostPrefillOf<RingPrefillRows>;

/// The lengths and plan tensors of a host-lengths prefill, once h.g, h.tables and h.dev are set.
template <typename Rows>
inline void check_host_lengths(const char* op, HostPrefillOf<Rows>& h, Size& batch, const TensorView& seq_lens,
                               const TensorView& extend_lens, const TensorView& plan_c, const TensorView& plan_w,
                               int64_t num_q_tokens, bool use_cuda_graph, bool on_cuda) {
  Size rows_c{"plan_c_rows"}, rows_w{"plan_w_rows"};
  const Totals totals =
      build_request_table(op, h.g, seq_lens, extend_lens, batch, num_q_tokens, h.table, max_seq_len(h.tables));
  check_plan_tensor(op, "plan_c", plan_c, rows_c, sizeof(typename Rows::Compress), h.dev, on_cuda);
  check_plan_tensor(op, "plan_w", plan_w, rows_w, sizeof(typename Rows::Write), h.dev, on_cuda);
  const int64_t cap_c = use_cuda_graph ? num_q_tokens : totals.num_c;
  const int64_t cap_w = use_cuda_graph ? num_q_tokens : totals.num_w;
  expect(rows_c.value >= cap_c, op, "plan_c", [&] { return "at least " + std::to_string(cap_c) + " rows"; },
         rows_c.value);
  expect(rows_w.value >= cap_w, op, "plan_w", [&] { return "at least " + std::to_string(cap_w) + " rows"; },
         rows_w.value);
  h.batch = static_cast<uint32_t>(batch.value);
  h.cap_c = static_cast<uint32_t>(cap_c);
  h.cap_w = static_cast<uint32_t>(cap_w);
  h.plan_c = static_cast<typename Rows::Compress*>(plan_c.data_ptr());
  h.plan_w = static_cast<typename Rows::Write*>(plan_w.data_ptr());
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
  const char* op = prefill_op(legacy);
  const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
  Size batch{"batch_size"};
  std::vector<RequestEntry> table;
  const Totals totals = build_request_table(op, g, seq_lens, extend_lens, batch, num_q_tokens, table);
  return totals.packed();
}

/// Text of the status bits (those a violation description does not cover, or all of them).
inline std::string describe_bits(int32_t status) {
  std::string s;
  auto add = [&](int32_t bit, const char* what) {
    if (status & bit) s += (s.empty() ? "" : "; ") + std::string(what);
  };
  add(kTokensDropped, "more tokens or rows than the plan tensors hold (sum of extend_lens > num_q_tokens?)");
  add(kBadLengths, "a request has extend_len <= 0, extend_len > seq_len, or seq_len < 1");
  add(kReqToTokenOutOfRange, "a req_to_token lookup is out of range (req_pool_indices or position)");
  add(kFullToStateOutOfRange, "a full_to_state lookup is out of range (req_to_token holds a bad slot)");
  add(kNegativeStateSlot, "full_to_state maps a needed token to a negative state slot (evicted?)");
  return s;
}

/// The violation at `key` (violation_key: request b, position) by argument, index and value, found
/// by examining the inputs there in the order the planner uses them. `read(p)` loads the element
/// at p (host memory, or a copy from the device); `extend_lens` is null for decode plans.
template <typename Read>
std::string describe_violation(const Tables& t, const int64_t* seq_lens, const int64_t* extend_lens, uint64_t key,
                               const Read& read) {
  const uint32_t b = static_cast<uint32_t>(key >> 32);
  const int32_t pos = static_cast<int32_t>(static_cast<uint32_t>(key));
  std::ostringstream os;
  auto entry = [&](const char* name, const std::string& index, const std::string& expectation, auto actual) {
    os << "argument '" << name << "': entry " << index << " must be " << expectation << ", got " << actual;
    return os.str();
  };
  const std::string bs = std::to_string(b);
  const int64_t rid = read(t.req_pool_indices + b);
  if (rid < 0 || (t.r2t_rows >= 0 && rid >= t.r2t_rows)) {
    return entry("req_pool_indices", bs,
                 t.r2t_rows >= 0 ? "a row of req_to_token (in [0, " + std::to_string(t.r2t_rows) + "))" : ">= 0", rid);
  }
  const int64_t seq = read(seq_lens + b);
  if (extend_lens != nullptr) {
    const int64_t ext = read(extend_lens + b);
    if (seq > INT32_MAX) return entry("seq_lens", bs, "below 2^31", seq);
    if (!valid_lengths(seq, ext)) {
      return entry("extend_lens", bs, "in [1, seq_lens[" + bs + "] = " + std::to_string(seq) + "]", ext);
    }
  } else if (seq < 1 || seq > INT32_MAX) {
    return entry("seq_lens", bs, "in [1, 2^31)", seq);
  }
  if (t.r2t_rows >= 0 && seq > t.r2t_cols) {
    return entry("seq_lens", bs, "at most " + std::to_string(t.r2t_cols) + " (the columns of req_to_token)", seq);
  }
  if (t.full_to_state == nullptr || pos < 0 || pos >= t.r2t_cols) return "";
  const std::string at = "[" + std::to_string(rid) + ", " + std::to_string(pos) + "]";
  const int32_t full = read(t.req_to_token + rid * t.r2t_stride + pos);
  if (full < 0 || full >= t.f2s_len) {
    return entry("req_to_token", at + " (request " + bs + ", position " + std::to_string(pos) + ")",
                 "an index of full_to_state (in [0, " + std::to_string(t.f2s_len) + "))", full);
  }
  const int64_t swa = read(t.full_to_state + full);
  if (static_cast<int32_t>(swa) < 0) {
    return entry("full_to_state", std::to_string(full) + " (req_to_token" + at + ", request " + bs + ")",
                 "a state slot (>= 0): the plan reads or writes that token", swa);
  }
  return "";
}

/// The message of a planner call's status: the first violation by argument, index and value, then
/// what the bits report beyond it. `words`: the status bits and, at words + 2, the first key.
template <typename Read>
std::string describe_status_words(const int32_t* words, const Tables& t, const int64_t* seq_lens,
                                  const int64_t* extend_lens, const Read& read) {
  uint64_t key;
  std::memcpy(&key, words + 2, sizeof key);
  const std::string first = key == kNoViolation ? "" : describe_violation(t, seq_lens, extend_lens, key, read);
  const int32_t rest = first.empty() ? words[0] : words[0] & kTokensDropped;
  const std::string bits = describe_bits(rest);
  return first + (first.empty() || bits.empty() ? "" : "; ") + bits;
}

/// The violations the host planner raises on: every one, except a negative state slot outside
/// checked mode (full_to_state marks evicted slots -1, and C-style arithmetic then gives row -1,
/// which the consumers skip: contract §9.11). Set as Tables::keyed before emitting.
inline int32_t host_reported(bool checked) { return checked ? ~0 : ~kNegativeStateSlot; }

/// The host planner's check after emitting: the violations of host-resident inputs it reports raise.
inline void raise_host_violation(const char* op, int32_t status, uint64_t first, const Tables& t,
                                 const int64_t* seq_lens, const int64_t* extend_lens) {
  status &= t.keyed;
  if (status == 0) return;
  const int32_t words[4] = {status, 0, static_cast<int32_t>(first), static_cast<int32_t>(first >> 32)};
  TVM_FFI_THROW(DSV4JITArgumentError) << "dsv4jit." << op << ": "
                            << describe_status_words(words, t, seq_lens, extend_lens, [](const auto* p) { return *p; });
}

}  // namespace dsv4::plan
