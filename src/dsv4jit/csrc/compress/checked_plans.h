// Checks of the plan tensors the compress kernels take (uint8 [rows, sizeof(row)]) and the checked
// parameters of a prefill or decode call, shared by the ring and the online compressors.
#pragma once

#include "common/plan_structs.h"
#include "common/tensor_check.h"

namespace dsv4 {

/// The plan tensor `arg` of `Row` rows: u8 [rows, sizeof(Row)], contiguous, aligned to a row.
template <typename Row>
const void* plan_rows(const char* op, const char* arg, Device& dev, const tvm::ffi::TensorView& plan, Size& rows) {
  Check(op, arg, plan).shape({rows, int64_t{sizeof(Row)}}).dtype(dl::kU8).cuda(dev).contiguous().aligned(alignof(Row));
  return plan.data_ptr();
}

/// The checked parameters of a compressor's prefill and decode calls. Derived (the compressor's
/// host struct) provides common(op, dev, state, input, ape, out, status, input_rows, out_rows),
/// which checks the state, input and ape tensors (and `out`, when the call has one); these add
/// the plan tensors: a prefill's plan[1] CompressPlan rows (the pool pass, num_rows) and
/// plan[2] `WriteRow` rows (the write pass, at most one per input row, in plan_w); a decode's
/// plan[1] DecodePlan rows, one per request.
template <typename Derived, typename WriteRow>
struct CheckedPlans {
  using TensorView = tvm::ffi::TensorView;

  static auto prefill_params(const char* op, Device& dev, const TensorView& state, const TensorView& input,
                             const TensorView& ape, const TensorView& plan_c, const TensorView& plan_w,
                             const TensorView* out, int32_t* status, Size& rows_c, Size& rows_w) {
    Size input_rows{"num_q_tokens"};
    auto p = Derived::common(op, dev, state, input, ape, out, status, input_rows, rows_c);
    p.plan = plan_rows<CompressPlan>(op, "plan[1]", dev, plan_c, rows_c);
    p.plan_w = static_cast<decltype(p.plan_w)>(plan_rows<WriteRow>(op, "plan[2]", dev, plan_w, rows_w));
    expect(rows_w.value <= input_rows.value, op, "plan[2]", "at most as many rows as kv_score_input (num_q_tokens)",
           rows_w.value);
    p.num_rows = static_cast<uint32_t>(rows_c.value);
    return p;
  }

  static auto decode_params(const char* op, Device& dev, const TensorView& state, const TensorView& input,
                            const TensorView& ape, const TensorView& plan_d, const TensorView* out, int32_t* status,
                            Size& batch) {
    auto p = Derived::common(op, dev, state, input, ape, out, status, batch, batch);
    p.plan = plan_rows<DecodePlan>(op, "plan[1]", dev, plan_d, batch);
    p.num_rows = static_cast<uint32_t>(batch.value);
    return p;
  }
};

}  // namespace dsv4
