// RoPE of a row's channels: the rotation of the trailing 64 dims (interleaved (re, im) pairs), and a
// lane group's RMSNorm (rms.cuh) followed by that rotation, as the store steps apply them.
#pragma once

#include <type_traits>

#include "common/types.cuh"
#include "layout.cuh"
#include "rms.cuh"

namespace dsv4::store {

/// RoPE of one interleaved (re, im) pair.
DSV4_DEV void rotate(float& re, float& im, float cs, float sn) {
  const float a = re, b = im;
  re = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
  im = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
}

/// RoPE of N channels as (re, im) pairs (`freq`: their (cos, sin) pairs).
template <int N>
DSV4_DEV void rotate_pairs(float (&x)[N], const float (&freq)[N]) {
#pragma unroll
  for (int pair = 0; pair < N / 2; ++pair) rotate(x[2 * pair], x[2 * pair + 1], freq[2 * pair], freq[2 * pair + 1]);
}

/// Each value as its nearest DType value (round to nearest even), in fp32.
template <typename DType, int N>
DSV4_DEV void round_to(float (&x)[N]) {
#pragma unroll
  for (int c = 0; c < N; ++c) x[c] = to_f32(from_f32<DType>(x[c]));
}

/// The 4 channels of virtual lane v (channels 4v .. +3) of a row of format F and rows of DType:
/// normalize(), then rotate_pairs() if they lie in the trailing 64 dims. A V4.1 layout rounds to
/// DType after each (no-ops for fp32 rows), where the V4 codecs round the rows to bf16 themselves.
template <Format F, typename DType>
DSV4_DEV void normalize_group(int v, float (&x)[4], const float (&w)[4], float r, const float (&freq)[4]) {
  constexpr bool kRound = Layout<F>::kV41 && !std::is_same_v<DType, float>;
  normalize(x, w, r);
  if constexpr (kRound) round_to<DType>(x);
  if (v >= Layout<F>::kRopeLane) {
    rotate_pairs(x, freq);
    if constexpr (kRound) round_to<DType>(x);
  }
}

}  // namespace dsv4::store
