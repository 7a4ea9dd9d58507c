// RMSNorm and RoPE of a row's channels: the normalization with the row's RMS scale, in the
// reference's order, and the rotation of the trailing 64 dims (interleaved (re, im) pairs).
#pragma once

#include "layout.cuh"

namespace dsv4::store {

/// RoPE of one interleaved (re, im) pair.
DSV4_DEV void rotate(float& re, float& im, float cs, float sn) {
  const float a = re, b = im;
  re = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
  im = __fadd_rn(__fmul_rn(a, sn), __fmul_rn(b, cs));
}

/// Normalizes N channels of a row with the row's RMS scale `r`, in the reference's order
/// (y = (x * r) * w, without fused multiply-adds), and rotates them as (re, im) pairs if they are
/// rope dims (`freq`: their (cos, sin) pairs).
template <int N>
DSV4_DEV void normalize(float (&x)[N], const float (&w)[N], float r, const float (&freq)[N], bool rope) {
#pragma unroll
  for (int c = 0; c < N; ++c) x[c] = __fmul_rn(__fmul_rn(x[c], r), w[c]);
  if (rope) {
#pragma unroll
    for (int pair = 0; pair < N / 2; ++pair) rotate(x[2 * pair], x[2 * pair + 1], freq[2 * pair], freq[2 * pair + 1]);
  }
}

/// The 4 channels of virtual lane v (channels 4v .. +3) of a row of format F: normalize(), rotated
/// if they lie in the trailing 64 dims.
template <Format F>
DSV4_DEV void normalize_group(int v, float (&x)[4], const float (&w)[4], float r, const float (&freq)[4]) {
  normalize(x, w, r, freq, v >= Layout<F>::kRopeLane);
}

}  // namespace dsv4::store
