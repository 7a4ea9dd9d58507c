// The codec of a 512-dim latent row, whichever its format: a lane's 4 dims of a 128-dim chunk
// (dims `dim` .. +3, a warp holding the chunk) coded by the V4 codec (v4_codec.cuh: fp8 with 64-dim
// tiles, bf16 rows, two pools) or a V4.1 one (v41_codec.cuh), and written into the token's slot.
#pragma once

#include "layout.cuh"
#include "v41_codec.cuh"
#include "v4_codec.cuh"

namespace dsv4::store {

/// `kExponentByBits`: how the V4 fp8 exponent is computed (v4_exponent; the same exponents).
template <Format F, bool kExponentByBits = false>
DSV4_DEV auto encode_latent(int dim, const float (&x)[4]) {
  static_assert(!Layout<F>::kIndexer, "a 512-dim latent format");
  if constexpr (Layout<F>::kV41) {
    return encode_v41<F>(x);
  } else {
    return encode_v4<F, kExponentByBits>(dim, x);
  }
}

/// Writes what encode_latent made of the dims from `dim` (every lane of the warp calls it).
template <Format F, typename Codes>
DSV4_DEV void write_latent(const Slot& slot, int dim, const Codes& codes) {
  if constexpr (Layout<F>::kV41) {
    write_v41<F>(slot, dim / 128, dim % 128 / 4, codes);
  } else {
    write_v4<F>(slot, dim, codes);
  }
}

}  // namespace dsv4::store
