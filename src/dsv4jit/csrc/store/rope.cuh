// RoPE of a row's channels: the rotation of the trailing 64 dims (interleaved (re, im) pairs), and a
// lane group's RMSNorm (rms.cuh) followed by that rotation, as the store steps apply them.
#pragma once

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

/// The 4 channels of virtual lane v (channels 4v .. +3) of a row of format F: normalize(), then
/// rotate_pairs() if they lie in the trailing 64 dims.
template <Format F>
DSV4_DEV void normalize_group(int v, float (&x)[4], const float (&w)[4], float r, const float (&freq)[4]) {
  normalize(x, w, r);
  if (v >= Layout<F>::kRopeLane) rotate_pairs(x, freq);
}

}  // namespace dsv4::store
