// The host checks the ratio-1 and ratio-2 entry points share: the latent cache of a layout, the rope
// table, the norm weight, positions and locations (int32 or int64). Every check runs before any launch.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include <string>

#include "common/launch.cuh"
#include "common/tensor_check.h"
#include "params.cuh"
#include "store/layout.cuh"

namespace dsv4::lowratio {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

/// Checks what every c1 / c2 call takes beside its rows, and fills those parameters: `rows` is bound by
/// the caller's first tensor.
template <store::Format F>
Params checked(const char* op, Device& dev, Size& rows, const TensorView& norm_weight, const TensorView& positions,
               const TensorView& locs, const char* locs_name, const TensorView& freqs_cis, const TensorView& k_cache,
               const TensorView& out, const Optional<TensorView>& status, int64_t page_size, double eps) {
  using L = store::Layout<F>;
  Size pages{"num_pages"}, max_pos{"max_pos"};
  expect(page_size > 0 && (page_size & (page_size - 1)) == 0, op, "page_size", "a power of two", page_size);
  Check(op, "norm_weight", norm_weight).shape({kHeadDim}).dtype(dl::kBF16).cuda(dev).contiguous().aligned();
  Check(op, "positions", positions).shape({rows}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
  Check(op, locs_name, locs).shape({rows}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
  // fp32 [max_pos, 64] of interleaved (cos, sin), or torch's complex64 [max_pos, 32]
  const bool complex = same_dtype(freqs_cis.dtype(), dl::kC64);
  Check(op, "freqs_cis", freqs_cis).dtype_in({dl::kF32, dl::kC64})
      .shape({max_pos, complex ? store::kRopeDim / 2 : store::kRopeDim}).cuda(dev).contiguous().aligned();
  Check(op, "k_cache", k_cache).shape({pages, L::page_bytes(page_size)}).dtype(dl::kU8)
      .cuda(dev).contiguous().aligned();
  Check(op, "out", out).shape({rows, kHeadDim}).dtype(dl::kBF16).cuda(dev).contiguous().aligned();
  Params p{};
  p.norm_weight = static_cast<const bf16_t*>(norm_weight.data_ptr());
  p.positions = positions.data_ptr();
  p.locs = locs.data_ptr();
  p.out = static_cast<bf16_t*>(out.data_ptr());
  p.pos64 = same_dtype(positions.dtype(), dl::kI64);
  p.loc64 = same_dtype(locs.dtype(), dl::kI64);
  p.rows = static_cast<uint32_t>(rows.value);
  p.eps = static_cast<float>(eps);
  p.s.freq = static_cast<const float*>(freqs_cis.data_ptr());
  p.s.max_pos = max_pos.value;
  p.s.cache = static_cast<uint8_t*>(k_cache.data_ptr());
  p.s.page_bytes = L::page_bytes(page_size);
  p.s.log2_page_size = __builtin_ctzll(static_cast<uint64_t>(page_size));
  p.s.num_locs = pages.value * page_size;
  p.s.status = status_words(op, dev, status);
  return p;
}

}  // namespace dsv4::lowratio
