// c2_decode_pool (contract §10.5): ratio-2 decode pair pooling alone, as sglang's non-fused decode
// path runs it (the norm, RoPE and store follow as other ops). A block per row; per row, with its
// partner state row r:
//   ring_size > 0   r = pad_row for a padded row (raw_out_loc 0) or position 0, else
//                   req · ring_size + (position - 1) mod ring_size; then every non-padded row writes its
//                   own kv and score to req · ring_size + position mod ring_size
//   ring_size = 0   one state row per request: r = pad_row for a padded row, else req; an even row
//                   writes its own kv and score there, an odd one writes back what it read
// pooled = kv_o · (e_o / (e_o + e_n)) + kv_n · (e_n / (e_o + e_n)), e = exp(score - max) (fp64, rounded
// once), each operation rounded once: bitwise the torch pair pooling. group_pos = position - 1 for an
// odd position, else position; slots = out_loc where >= 0, else 0.
#pragma once

#include "common/exact.cuh"
#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/status_text.h"
#include "common/tensor_check.h"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "params.cuh"

namespace dsv4::lowratio {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

struct PoolParams {
  const float* kv;           // [rows, 512]
  const float* score;        // [rows, 512]
  const int64_t* positions;  // [rows]
  const void* raw_out_loc;   // [rows] int32 / int64
  const void* out_loc;       // [rows] int32 / int64
  const int64_t* req;        // [rows]
  float* state_kv;           // [state_rows, >= 512], row stride kv_stride
  float* state_score;        // [state_rows, >= 512], row stride score_stride
  float* pooled;             // [rows, 512]
  int64_t* group_pos;        // [rows]
  void* slots;               // [rows], out_loc's dtype
  int32_t* status;
  int64_t kv_stride, score_stride, state_rows, pad_row;
  uint32_t rows;
  int32_t ring_size;
  bool raw64, loc64;
};

inline constexpr int kPoolDim = 512;
inline constexpr int kPoolThreads = kPoolDim / 4;  // a block per row, 4 dims a thread

enum PoolStatusBit : int32_t {
  kStateRowOutOfRange = 1,  // a state row (read or written) lies outside state_kv / state_score
};

inline tvm::ffi::String describe_pool_status(int64_t word) {
  return status_text(word, {{kStateRowOutOfRange,
                             "a state row (pad_row, req, or req * ring_size + position mod ring_size) lies outside "
                             "state_kv"}});
}

template <bool kPDL>
__global__ __launch_bounds__(kPoolThreads) void c2_pool_kernel(const __grid_constant__ PoolParams p) {
  const int c0 = 4 * threadIdx.x;  // this thread's dims
  const uint32_t row = blockIdx.x;
  pdl_wait_upstream<kPDL>();
  const int64_t position = p.positions[row], rid = p.req[row];
  const int64_t raw = entry(p.raw_out_loc, p.raw64, row), loc = entry(p.out_loc, p.loc64, row);
  const Vec<float, 4> kv = load_vec<4>(p.kv + uint64_t{row} * kPoolDim + c0);
  const Vec<float, 4> sc = load_vec<4>(p.score + uint64_t{row} * kPoolDim + c0);
  const bool odd = position % 2 != 0;
  if (threadIdx.x == 0) {
    p.group_pos[row] = odd ? position - 1 : position;
    const int64_t slot = loc >= 0 ? loc : 0;
    if (p.loc64) {
      static_cast<int64_t*>(p.slots)[row] = slot;
    } else {
      static_cast<int32_t*>(p.slots)[row] = static_cast<int32_t>(slot);
    }
  }
  const int64_t r = p.ring_size > 0 ? (raw == 0 || position == 0 ? p.pad_row
                                                                  : rid * p.ring_size + ring_slot(position - 1, p.ring_size))
                                    : (raw == 0 ? p.pad_row : rid);
  const int64_t w = p.ring_size > 0 ? (raw == 0 ? -1 : rid * p.ring_size + ring_slot(position, p.ring_size)) : r;
  if (r < 0 || r >= p.state_rows || w >= p.state_rows || (p.ring_size > 0 && raw != 0 && w < 0)) {
    if (p.status != nullptr && threadIdx.x == 0) atomicOr(p.status, kStateRowOutOfRange);
    return;
  }
  const Vec<float, 4> kv_o = load_vec<4>(p.state_kv + r * p.kv_stride + c0);
  const Vec<float, 4> sc_o = load_vec<4>(p.state_score + r * p.score_stride + c0);
  pdl_launch_dependents<kPDL>();
  if (w >= 0) {  // after this thread's reads of the same dims: the row it read may be the one it writes
    const bool keep = p.ring_size == 0 && odd;
    store_vec(p.state_kv + w * p.kv_stride + c0, keep ? kv_o : kv);
    store_vec(p.state_score + w * p.score_stride + c0, keep ? sc_o : sc);
  }
  float x[8], e[8], e_o[4], e_n[4], denom[4], w_o[4], w_n[4];  // the 4 dims side by side (exact.cuh)
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float m = fmaxf(sc_o[c], sc[c]);
    x[c] = __fsub_rn(sc_o[c], m), x[4 + c] = __fsub_rn(sc[c], m);
  }
  exp_nonpositive(e, x);  // the 8 exps in one pass: their chains overlap
#pragma unroll
  for (int c = 0; c < 4; ++c) e_o[c] = e[c], e_n[c] = e[4 + c], denom[c] = __fadd_rn(e_o[c], e_n[c]);
  unit_quotients(w_o, e_o, denom);
  unit_quotients(w_n, e_n, denom);
  Vec<float, 4> out;
#pragma unroll
  for (int c = 0; c < 4; ++c) out[c] = __fadd_rn(__fmul_rn(kv_o[c], w_o[c]), __fmul_rn(kv[c], w_n[c]));
  store_vec(p.pooled + uint64_t{row} * kPoolDim + c0, out);
}

template <bool kPDL>
struct C2PoolEntry {
  /// kv, score [N, 512] fp32 contiguous; pos, req [N] int64; raw_out_loc, out_loc [N] int32 or int64;
  /// state_kv, state_score [state rows, >= 512] fp32 with contiguous rows (a ring's halves, or one row
  /// per request); pooled [N, 512] fp32, group_pos [N] int64, slots [N] of out_loc's dtype.
  static void run(TensorView kv, TensorView score, TensorView pos, TensorView raw_out_loc, TensorView out_loc,
                  TensorView req, TensorView state_kv, TensorView state_score, TensorView pooled,
                  TensorView group_pos, TensorView slots, Optional<TensorView> status, int64_t pad_row,
                  int64_t ring_size) {
    const char* op = "c2_decode_pool";
    Device dev;
    Size rows{"num_tokens"}, state_rows{"state_rows"};
    Check(op, "kv", kv).shape({rows, kPoolDim}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Check(op, "score", score).shape({rows, kPoolDim}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Check(op, "pos", pos).shape({rows}).dtype(dl::kI64).cuda(dev).contiguous();
    Check(op, "raw_out_loc", raw_out_loc).shape({rows}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
    Check(op, "out_loc", out_loc).shape({rows}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
    Check(op, "req", req).shape({rows}).dtype(dl::kI64).cuda(dev).contiguous();
    Check(op, "state_kv", state_kv).shape({state_rows, Dim::any()}).dtype(dl::kF32).cuda(dev).contiguous_rows()
        .aligned();
    Check(op, "state_score", state_score).shape({state_rows, Dim::any()}).dtype(dl::kF32).cuda(dev)
        .contiguous_rows().aligned();
    expect(state_kv.size(1) >= kPoolDim && state_kv.stride(0) % 4 == 0, op, "state_kv",
           "rows of at least 512 values, a row stride of a multiple of 4", state_kv.size(1));
    expect(state_score.size(1) >= kPoolDim && state_score.stride(0) % 4 == 0, op, "state_score",
           "rows of at least 512 values, a row stride of a multiple of 4", state_score.size(1));
    Check(op, "pooled", pooled).shape({rows, kPoolDim}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Check(op, "group_pos", group_pos).shape({rows}).dtype(dl::kI64).cuda(dev).contiguous();
    Check(op, "slots", slots).shape({rows}).dtype(out_loc.dtype()).cuda(dev).contiguous();
    expect(ring_size >= 0, op, "ring_size", ">= 0", ring_size);
    expect(pad_row >= 0 && pad_row < state_rows.value, op, "pad_row",
           [&] { return "a row of state_kv (< " + std::to_string(state_rows.value) + ")"; }, pad_row);
    PoolParams p{};
    p.kv = static_cast<const float*>(kv.data_ptr());
    p.score = static_cast<const float*>(score.data_ptr());
    p.positions = static_cast<const int64_t*>(pos.data_ptr());
    p.raw_out_loc = raw_out_loc.data_ptr();
    p.out_loc = out_loc.data_ptr();
    p.req = static_cast<const int64_t*>(req.data_ptr());
    p.state_kv = static_cast<float*>(state_kv.data_ptr());
    p.state_score = static_cast<float*>(state_score.data_ptr());
    p.pooled = static_cast<float*>(pooled.data_ptr());
    p.group_pos = static_cast<int64_t*>(group_pos.data_ptr());
    p.slots = slots.data_ptr();
    p.status = status_words(op, dev, status);
    p.kv_stride = state_kv.stride(0);
    p.score_stride = state_score.stride(0);
    p.state_rows = state_rows.value;
    p.pad_row = pad_row;
    p.rows = static_cast<uint32_t>(rows.value);
    p.ring_size = static_cast<int32_t>(ring_size);
    p.raw64 = same_dtype(raw_out_loc.dtype(), dl::kI64);
    p.loc64 = same_dtype(out_loc.dtype(), dl::kI64);
    if (p.rows == 0) return;
    launch(op, dev.dev, {p.rows, kPoolThreads}, kPDL, c2_pool_kernel<kPDL>, p);
  }
};

}  // namespace dsv4::lowratio
