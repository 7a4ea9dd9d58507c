// The host entry pattern of the compressors (ring and online): every tensor is checked and every
// parameter filled before any launch, and the launches take checked parameters only, so that the
// fused op (fused/fused.cuh) checks its store step too before it calls them. Derived (the
// compressor's host struct) provides
//   kOp                                   the op named in errors
//   common(op, dev, state, input, ape, out, status, input_rows, out_rows)
//                                         checks the state, input and ape tensors (and `out`, when
//                                         the call has one) and fills the parameters they determine
//   launch_pool(op, dev, p)               the prefill pool pass over p.num_rows plan_c rows
//   launch_write(op, dev, p)              the prefill write pass (p from write_pass())
//   launch_decode(op, dev, p)
// and this adds the plan checks and the two entry points compress_forward calls.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include "common/plan_structs.h"
#include "common/tensor_check.h"
#include "common/types.cuh"

namespace dsv4 {

/// The plan tensor `arg` of `Row` rows: u8 [rows, sizeof(Row)], contiguous, aligned to a row.
template <typename Row>
const void* plan_rows(const char* op, const char* arg, Device& dev, const tvm::ffi::TensorView& plan, Size& rows) {
  Check(op, arg, plan).shape({rows, int64_t{sizeof(Row)}}).dtype(dl::kU8).cuda(dev).contiguous().aligned(alignof(Row));
  return plan.data_ptr();
}

/// A prefill's plan[1] holds `PoolRow` rows (the pool pass, num_rows: CompressPlan, or the online
/// compressor's OnlinePlan) and plan[2] `WriteRow` rows (the write pass, at most one per input row,
/// in plan_w); a decode's plan[1] DecodePlan rows, one per request.
template <typename Derived, typename WriteRow, typename PoolRow = CompressPlan>
struct CompressorEntryBase {
  using TensorView = tvm::ffi::TensorView;

  static auto prefill_params(const char* op, Device& dev, const TensorView& state, const TensorView& input,
                             const TensorView& ape, const TensorView& plan_c, const TensorView& plan_w,
                             const TensorView* out, int32_t* status, Size& rows_c, Size& rows_w) {
    Size input_rows{"num_q_tokens"};
    auto p = Derived::common(op, dev, state, input, ape, out, status, input_rows, rows_c);
    p.plan = plan_rows<PoolRow>(op, "plan[1]", dev, plan_c, rows_c);
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

  /// The data of `out` [out_rows, head_dim] of OutT, checked, when the call has one (nullptr
  /// without: the fused op's pool passes write no rows).
  template <typename OutT>
  static void* output(const char* op, Device& dev, const TensorView* out, int64_t head_dim, Size& out_rows) {
    if (out == nullptr) return nullptr;
    Check(op, "out", *out).shape({out_rows, head_dim}).dtype(DTypeInfo<OutT>::dtype).cuda(dev).contiguous().aligned();
    return out->data_ptr();
  }

  /// The write pass's parameters over `rows_w` plan_w rows, after a pool pass over p.num_rows rows
  /// in stream order.
  template <typename Params>
  static Params write_pass(Params p, int64_t rows_w) {
    p.after_pool = p.num_rows > 0;  // else no launch: the write pass follows whatever came before
    p.num_rows = static_cast<uint32_t>(rows_w);
    return p;
  }

  /// The pool pass, then the write pass over `rows_w` plan_w rows, of checked parameters.
  template <typename Params>
  static void launch_prefill(const char* op, const Device& dev, const Params& p, int64_t rows_w) {
    Derived::launch_pool(op, dev, p);
    Derived::launch_write(op, dev, write_pass(p, rows_w));
  }

  static void prefill(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_rows,
                      TensorView plan_w, TensorView out, tvm::ffi::Optional<TensorView> status) {
    Device dev;
    Size rows_c{"plan_c_rows"}, rows_w{"plan_w_rows"};
    auto p = prefill_params(Derived::kOp, dev, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w, &out, nullptr,
                            rows_c, rows_w);
    p.status = status_words(Derived::kOp, dev, status);
    launch_prefill(Derived::kOp, dev, p, rows_w.value);
  }

  static void decode(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_rows,
                     TensorView out, tvm::ffi::Optional<TensorView> status) {
    Device dev;
    Size batch{"batch_size"};
    auto p = decode_params(Derived::kOp, dev, kv_score_buffer, kv_score_input, ape, plan_rows, &out, nullptr, batch);
    p.status = status_words(Derived::kOp, dev, status);
    Derived::launch_decode(Derived::kOp, dev, p);
  }
};

}  // namespace dsv4
