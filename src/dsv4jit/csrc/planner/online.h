// Argument handling of the online c128 planner (contract §3.8), shared by its GPU entry points and the
// host-only planner. The rules themselves live in planner/rules.h (Scheme::kOnline): segment rows are
// emitted by the same per-token machinery as the ring planners. Host-only: no CUDA headers.
#pragma once

#include <string>

#include "args.h"

namespace dsv4::plan {

inline Geometry checked_online_geometry(const char* op, int64_t state_slot_offset) {
  expect(state_slot_offset >= 0 && state_slot_offset <= INT32_MAX, op, "state_slot_offset", "in [0, 2^31)",
         state_slot_offset);
  return make_online_geometry(static_cast<int32_t>(state_slot_offset));
}

/// req_pool_indices [B] i64 (the only lookup online plans use) and, when given, req_to_token as a
/// 2-D i32 table on the same device (the serving stack passes it; the state rows do not need it).
inline Tables checked_online_tables(const char* op, const Geometry& g, const TensorView& req_pool_indices,
                                    const Optional<TensorView>& req_to_token, Size& batch, Device& dev, bool on_cuda) {
  Tables t = checked_tables(op, g, req_pool_indices, Optional<TensorView>(), Optional<TensorView>(), batch, dev,
                            on_cuda);
  if (req_to_token.has_value()) {
    Check c(op, "req_to_token", req_to_token.value());
    c.shape({Dim::any(), Dim::any()}).dtype(dl::kI32);
    if (on_cuda) {
      c.cuda(dev);
    } else {
      c.cpu().same_device(dev);
    }
  }
  return t;
}

/// A checked host-lengths online prefill: plan_c and plan_w both hold 16-byte segment rows.
inline HostPrefillOf<OnlinePrefillRows> checked_online_host_prefill(const char* op, const TensorView& req_pool_indices,
                                                                    const Optional<TensorView>& req_to_token,
                                                                    const TensorView& seq_lens,
                                                                    const TensorView& extend_lens,
                                                                    const TensorView& plan_c, const TensorView& plan_w,
                                                                    int64_t num_q_tokens, int64_t state_slot_offset,
                                                                    bool use_cuda_graph, bool on_cuda) {
  HostPrefillOf<OnlinePrefillRows> h;
  h.g = checked_online_geometry(op, state_slot_offset);
  Size batch{"batch_size"};
  h.tables = checked_online_tables(op, h.g, req_pool_indices, req_to_token, batch, h.dev, on_cuda);
  check_host_lengths(op, h, batch, seq_lens, extend_lens, plan_c, plan_w, num_q_tokens, use_cuda_graph, on_cuda);
  return h;
}

/// Row counts (segments closing a chunk, trailing partial segments) of an online prefill
/// (Totals::packed).
inline int64_t prefill_online_counts(TensorView seq_lens, TensorView extend_lens, int64_t num_q_tokens,
                                     int64_t state_slot_offset) {
  const char* op = kPrefillOnlineOp;
  const Geometry g = checked_online_geometry(op, state_slot_offset);
  Size batch{"batch_size"};
  std::vector<RequestEntry> table;
  const Totals totals = build_request_table(op, g, seq_lens, extend_lens, batch, num_q_tokens, table);
  return totals.packed();
}

}  // namespace dsv4::plan
