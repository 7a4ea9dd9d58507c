// The planner on the host (Decision 9): every input on the CPU, CPU plan tensors out, with
// exactly the bytes the GPU paths produce (same rules, same emission order). Host-only module.
#pragma once

#include <tvm/ffi/container/tuple.h>
#include <tvm/ffi/function.h>

#include <vector>

#include "plan_args.h"

namespace dsv4::plan {

struct HostPlanner {
  using Pair = tvm::ffi::Tuple<int64_t, int64_t>;

  static void raise_status(const char* op, int32_t status) {
    if (status != 0) TVM_FFI_THROW(ValueError) << "dsv4jit." << op << " (checked mode): " << describe_status(status);
  }

  /// Plans have at least the needed rows (all of num_q_tokens with use_cuda_graph); returns (num_c, num_w).
  static Pair prefill(TensorView req_pool_indices, Optional<TensorView> req_to_token, Optional<TensorView> full_to_state,
                      TensorView seq_lens, TensorView extend_lens, TensorView plan_c, TensorView plan_w,
                      int64_t num_q_tokens, int64_t compress_ratio, int64_t swa_page_size, int64_t ring_size,
                      bool use_req_ring, bool legacy, bool use_cuda_graph, bool checked) {
    const char* op = "plan_prefill";
    const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
    Size batch{"batch_size"}, rows_c{"plan_c_rows"}, rows_w{"plan_w_rows"};
    Device dev;
    int32_t status = 0;
    Tables tables = checked_tables(op, g, req_pool_indices, req_to_token, full_to_state, batch, dev, false);
    tables.status = &status;
    std::vector<RequestEntry> table;
    const Totals totals = build_request_table(op, g, seq_lens, extend_lens, batch, num_q_tokens, table);
    check_plan_tensor(op, "plan_c", plan_c, rows_c, sizeof(CompressPlan), dev, false);
    check_plan_tensor(op, "plan_w", plan_w, rows_w, sizeof(WritePlan), dev, false);
    const int64_t cap_c = use_cuda_graph ? num_q_tokens : totals.num_c;
    const int64_t cap_w = use_cuda_graph ? num_q_tokens : totals.num_w;
    expect(rows_c.value >= cap_c, op, "plan_c", [&] { return "at least " + std::to_string(cap_c) + " rows"; }, rows_c.value);
    expect(rows_w.value >= cap_w, op, "plan_w", [&] { return "at least " + std::to_string(cap_w) + " rows"; }, rows_w.value);
    auto* out_c = static_cast<CompressPlan*>(plan_c.data_ptr());
    auto* out_w = static_cast<WritePlan*>(plan_w.data_ptr());
    for (int64_t b = 0; b < batch.value; ++b) {
      const RequestEntry& req = table[b];
      const int32_t extend = static_cast<int32_t>(table[b + 1].ragged_base - req.ragged_base);
      const Span span = Span::of(g, req.seq_len, extend);
      for (int32_t j = 0; j < extend; ++j) {
        status |= emit_token(g, tables, span, static_cast<uint32_t>(b), req, j, out_c, static_cast<uint32_t>(cap_c),
                             out_w, static_cast<uint32_t>(cap_w));
      }
    }
    for (int64_t i = totals.num_c; i < cap_c; ++i) out_c[i] = CompressPlan::invalid();
    for (int64_t i = totals.num_w; i < cap_w; ++i) out_w[i] = WritePlan::invalid();
    if (checked) raise_status(op, status);
    return Pair(totals.num_c, totals.num_w);
  }

  static void decode(TensorView req_pool_indices, Optional<TensorView> req_to_token, Optional<TensorView> full_to_state,
                     TensorView seq_lens, TensorView plan_d, int64_t compress_ratio, int64_t swa_page_size,
                     int64_t ring_size, bool use_req_ring, bool legacy, bool checked) {
    const char* op = "plan_decode";
    const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
    Size batch{"batch_size"};
    Device dev;
    int32_t status = 0;
    Tables tables = checked_tables(op, g, req_pool_indices, req_to_token, full_to_state, batch, dev, false);
    tables.status = &status;
    Check(op, "seq_lens", seq_lens).shape({batch}).dtype(dl::kI64).cpu().contiguous();
    check_plan_tensor(op, "plan_d", plan_d, batch, sizeof(DecodePlan), dev, false);
    const auto* seq = static_cast<const int64_t*>(seq_lens.data_ptr());
    auto* out = static_cast<DecodePlan*>(plan_d.data_ptr());
    for (int64_t b = 0; b < batch.value; ++b) {
      expect(seq[b] >= 1 && seq[b] <= INT32_MAX, op, "seq_lens", "in [1, 2^31) for every request", seq[b]);
      out[b] = decode_row(g, tables, static_cast<uint32_t>(b), static_cast<int32_t>(seq[b]));
    }
    if (checked) raise_status(op, status);
  }
};

}  // namespace dsv4::plan
