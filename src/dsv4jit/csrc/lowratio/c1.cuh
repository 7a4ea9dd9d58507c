// c1_decode_norm_rope_store (contract §10.4): the ratio-1 compressor. Every row (decode and extend
// alike) is its own compressed token: its RMSNorm is the bf16 latent, written to `out` for every
// row (padded rows too), and stored at the row's full slot out_loc (page 256 in serving) with RoPE
// at the row's position, unless out_loc <= 0 (a padded row). One launch, a block per row.
#pragma once

#include "common/pdl.cuh"
#include "entry.h"
#include "row.cuh"

namespace dsv4::lowratio {

template <store::Format F, bool kPDL>
__global__ __launch_bounds__(kThreads) void c1_kernel(const __grid_constant__ Params p) {
  __shared__ double partials[kChunks];
  const RowLane t = RowLane::of_thread();
  const uint32_t row = blockIdx.x;
  const bf16_t* input = static_cast<const bf16_t*>(p.kv) + uint64_t{row} * kHeadDim;
  prefetch_row<kPDL>(p, row, {input}, kHeadDim * sizeof(bf16_t));
  Dims w;
  load_weight(p, t, w);
  pdl_wait_upstream<kPDL>();
  const Vec<bf16_t, 4> kv = load_vec<4>(input + t.dim);
  // An ordering point (no instruction): without it the compiler issues kv after the test of the
  // position that guards the rope row, so kv waited a round trip for the position
  __syncwarp();
  const int64_t position = entry(p.positions, p.pos64, row), loc = entry(p.locs, p.loc64, row);
  const Vec<float, 4> rope = load_rope(p, t, position);
  pdl_launch_dependents<kPDL>();
  Dims x;
#pragma unroll
  for (int c = 0; c < 4; ++c) x[c] = to_f32(kv[c]);
  normalize_latent(p, t, x, w, partials);
  write_out(p, row, t, x);
  if (loc <= 0 || !storable(p, loc, position)) return;
  store_latent<F>(p, t, loc, rope, x);
}

template <store::Format F, bool kPDL>
struct C1Entry {
  static_assert(!store::Layout<F>::kIndexer && F != store::Format::kV4Bf16 && F != store::Format::kV4TwoPool,
                "a latent cache: v4 (fp8) or a V4.1 layout");

  /// kv_input [N, 512] bf16 (the raw wkv rows); norm_weight [512] bf16; positions, out_loc [N] int32 or
  /// int64; freqs_cis fp32 [max_pos, 64] (or complex64 [max_pos, 32]); k_cache u8 [pages, page_bytes];
  /// out [N, 512] bf16.
  static void run(TensorView kv_input, TensorView norm_weight, TensorView positions, TensorView out_loc,
                  TensorView freqs_cis, TensorView k_cache, TensorView out, Optional<TensorView> status,
                  int64_t page_size, double eps) {
    const char* op = "c1_decode_norm_rope_store";
    Device dev;
    Size rows{"num_tokens"};
    Check(op, "kv_input", kv_input).shape({rows, kHeadDim}).dtype(dl::kBF16).cuda(dev).contiguous().aligned();
    Params p = checked<F>(op, dev, rows, norm_weight, positions, out_loc, "out_loc", freqs_cis, k_cache, out, status,
                          page_size, eps);
    p.kv = kv_input.data_ptr();
    if (p.rows == 0) return;
    launch(op, dev.dev, {p.rows, kThreads}, kPDL, c1_kernel<F, kPDL>, p);
  }
};

}  // namespace dsv4::lowratio
