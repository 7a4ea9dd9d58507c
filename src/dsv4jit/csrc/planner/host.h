// The planner on the host (contract §9.9): every input on the CPU, CPU plan tensors out, with
// exactly the bytes the GPU paths produce (same rules, same emission order). Host-resident inputs
// cost nothing to check, so violations raise, naming the argument, index and value, in default
// mode too (negative state slots in checked mode only: host_reported); the GPU paths report
// device-resident ones in checked mode only. Host-only module.
#pragma once

#include <tvm/ffi/function.h>

#include <vector>

#include "args.h"
#include "online.h"

namespace dsv4::plan {

struct HostPlannerEntry {
  /// Plans have room for the rows (see prefill_counts; num_q_tokens rows with use_cuda_graph).
  static void prefill(TensorView req_pool_indices, Optional<TensorView> req_to_token, Optional<TensorView> full_to_state,
                      TensorView seq_lens, TensorView extend_lens, TensorView plan_c, TensorView plan_w,
                      int64_t num_q_tokens, int64_t compress_ratio, int64_t swa_page_size, int64_t ring_size,
                      bool use_req_ring, bool legacy, bool use_cuda_graph, bool checked) {
    const char* op = prefill_op(legacy);
    HostPrefill h = checked_host_prefill(op, req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens,
                                         plan_c, plan_w, num_q_tokens, compress_ratio, swa_page_size, ring_size,
                                         use_req_ring, legacy, use_cuda_graph, false);
    emit_all(op, h, seq_lens, extend_lens, checked);
  }

  /// Online c128 (contract §3.8): segment rows in plan_c (closing a chunk) and plan_w (trailing partial).
  static void prefill_online(TensorView req_pool_indices, Optional<TensorView> req_to_token, TensorView seq_lens,
                             TensorView extend_lens, TensorView plan_c, TensorView plan_w, int64_t num_q_tokens,
                             int64_t state_slot_offset, bool use_cuda_graph, bool checked) {
    const char* op = kPrefillOnlineOp;
    HostPrefillOf<OnlinePrefillRows> h = checked_online_host_prefill(op, req_pool_indices, req_to_token, seq_lens,
                                                                     extend_lens, plan_c, plan_w, num_q_tokens,
                                                                     state_slot_offset, use_cuda_graph, false);
    emit_all(op, h, seq_lens, extend_lens, checked);
  }

  /// Every request's rows in batch order, then invalid rows up to the capacities.
  template <typename Rows>
  static void emit_all(const char* op, HostPrefillOf<Rows>& h, const TensorView& seq_lens,
                       const TensorView& extend_lens, bool checked) {
    int32_t status = 0;
    uint64_t first = kNoViolation;
    h.tables.status = &status;
    h.tables.first = &first;
    h.tables.keyed = host_reported(checked);
    for (uint32_t b = 0; b < h.batch; ++b) {
      const RequestEntry& req = h.table[b];
      const int32_t extend = static_cast<int32_t>(h.table[b + 1].ragged_base - req.ragged_base);
      const Span span = Span::of(h.g, req.seq_len, extend);
      for (int32_t j = 0; j < extend; ++j) {
        status |= emit_token(h.g, h.tables, span, b, req, j, h.plan_c, h.cap_c, h.plan_w, h.cap_w);
      }
    }
    const RequestEntry& totals = h.table[h.batch];
    for (uint32_t i = totals.row_c; i < h.cap_c; ++i) h.plan_c[i] = Rows::Compress::invalid();
    for (uint32_t i = totals.row_w; i < h.cap_w; ++i) h.plan_w[i] = Rows::Write::invalid();
    raise_host_violation(op, status, first, h.tables, static_cast<const int64_t*>(seq_lens.data_ptr()),
                         static_cast<const int64_t*>(extend_lens.data_ptr()));
  }

  /// Fills plan_d [batch, 16] on the CPU; with plan_d None, allocates it and returns it (PlanOutput).
  static Optional<Tensor> decode(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                 Optional<TensorView> full_to_state, TensorView seq_lens, Optional<TensorView> plan_d,
                                 int64_t compress_ratio, int64_t swa_page_size, int64_t ring_size, bool use_req_ring,
                                 bool legacy, bool checked) {
    const char* op = decode_op(legacy);
    const Geometry g = checked_geometry(op, compress_ratio, swa_page_size, ring_size, use_req_ring, legacy);
    Size batch{"batch_size"};
    Device dev;
    Tables tables = checked_tables(op, g, req_pool_indices, req_to_token, full_to_state, batch, dev, false);
    return decode_rows(op, g, tables, batch, dev, seq_lens, plan_d, checked);
  }

  /// Online c128 (contract §3.8): {seq_len, rid + offset, rid + offset, -1} per request (plan_d as decode).
  static Optional<Tensor> decode_online(TensorView req_pool_indices, Optional<TensorView> req_to_token,
                                        TensorView seq_lens, Optional<TensorView> plan_d, int64_t state_slot_offset,
                                        bool checked) {
    const char* op = kDecodeOnlineOp;
    const Geometry g = checked_online_geometry(op, state_slot_offset);
    Size batch{"batch_size"};
    Device dev;
    Tables tables = checked_online_tables(op, g, req_pool_indices, req_to_token, batch, dev, false);
    return decode_rows(op, g, tables, batch, dev, seq_lens, plan_d, checked);
  }

  static Optional<Tensor> decode_rows(const char* op, const Geometry& g, Tables tables, Size& batch, Device& dev,
                                      const TensorView& seq_lens, const Optional<TensorView>& plan_d, bool checked) {
    int32_t status = 0;
    uint64_t first = kNoViolation;
    tables.status = &status;
    tables.first = &first;
    tables.keyed = host_reported(checked);
    Check(op, "seq_lens", seq_lens).shape({batch}).dtype(dl::kI64).cpu().contiguous();
    const auto* seq = static_cast<const int64_t*>(seq_lens.data_ptr());
    for (int64_t b = 0; b < batch.value; ++b) {  // validate before writing: nothing half-built on error
      if (seq[b] < 1 || seq[b] > INT32_MAX) bad_entry(op, "seq_lens", std::to_string(b), "in [1, 2^31)", seq[b]);
      check_seq_len_fits(op, b, seq[b], max_seq_len(tables));
    }
    PlanOutput out = PlanOutput::of(op, "plan_d", plan_d, batch, sizeof(DecodePlan), dev, false);
    auto* rows = static_cast<DecodePlan*>(out.data);
    for (int64_t b = 0; b < batch.value; ++b) {
      rows[b] = decode_row(g, tables, static_cast<uint32_t>(b), static_cast<int32_t>(seq[b]));
    }
    raise_host_violation(op, status, first, tables, seq, nullptr);
    return out.owned;
  }
};

}  // namespace dsv4::plan
