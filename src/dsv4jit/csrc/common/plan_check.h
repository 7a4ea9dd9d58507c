// Checks of the plan tensors the compress kernels take (uint8 [rows, sizeof(row)]), shared by the
// ring and the online compressors.
#pragma once

#include "plan_structs.h"
#include "tensor_check.h"

namespace dsv4 {

/// The plan tensor `arg` of `Row` rows: u8 [rows, sizeof(Row)], contiguous, aligned to a row.
template <typename Row>
const void* plan_rows(const char* op, const char* arg, Device& dev, const tvm::ffi::TensorView& plan, Size& rows) {
  Check(op, arg, plan).shape({rows, int64_t{sizeof(Row)}}).dtype(dl::kU8).cuda(dev).contiguous().aligned(alignof(Row));
  return plan.data_ptr();
}

/// Fills the plan fields of a prefill call's parameters `p` (plan, plan_w, num_rows, as every
/// compressor's Params names them): plan[1] CompressPlan rows (the pool pass) and plan[2]
/// `WriteRow` rows (the write pass, at most one per input row).
template <typename WriteRow, typename P>
void set_prefill_plans(P& p, const char* op, Device& dev, const tvm::ffi::TensorView& plan_c,
                       const tvm::ffi::TensorView& plan_w, Size& rows_c, Size& rows_w, int64_t input_rows) {
  p.plan = plan_rows<CompressPlan>(op, "plan[1]", dev, plan_c, rows_c);
  p.plan_w = static_cast<decltype(p.plan_w)>(plan_rows<WriteRow>(op, "plan[2]", dev, plan_w, rows_w));
  expect(rows_w.value <= input_rows, op, "plan[2]", "at most as many rows as kv_score_input (num_q_tokens)",
         rows_w.value);
  p.num_rows = static_cast<uint32_t>(rows_c.value);
}

/// Fills the plan fields of a decode call's parameters `p`: plan[1] DecodePlan rows, one per request.
template <typename P>
void set_decode_plan(P& p, const char* op, Device& dev, const tvm::ffi::TensorView& plan_d, Size& batch) {
  p.plan = plan_rows<DecodePlan>(op, "plan[1]", dev, plan_d, batch);
  p.num_rows = static_cast<uint32_t>(batch.value);
}

}  // namespace dsv4
