// The V4 latent row's codec: bf16 for bf16_store and the rope dims, e4m3 with one UE8M0 scale per
// 64-dim tile for the others (encode_v4), and its bytes in the cache slot (write_v4), in one page or
// in two pools.
#pragma once

#include <type_traits>

#include "common/quant.cuh"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "layout.cuh"
#include "rms.cuh"
#include "rope.cuh"

namespace dsv4::store {

/// N consecutive dims of a normalized V4 row as stored: bf16, and for the V4 latent's dims
/// without rope their e4m3 codes and the tile's UE8M0 exponent.
template <int N>
struct V4Dims {
  Vec<bf16_t, N> bf16;
  uint32_t codes;
  int e;
};

/// UE8M0 exponent of a V4 tile's scale (rounded up; amax floored at 1e-4), by amax's bits
/// (ue8m0_scale_exponent<448>) or through the division: the same exponents. The store kernel takes
/// the bits (no slow-path branch of the division); the fused kernels keep the division, where the
/// bits measured slower in the online decode, a latency chain whose code otherwise differs only in
/// instruction order (docs/design-notes.md).
template <bool kByBits>
DSV4_DEV int v4_exponent(float amax) {
  if constexpr (kByBits) return ue8m0_scale_exponent<448>(amax);
  return ue8m0_ceil(fmaxf(amax, 1e-4f) / 448.0f);
}

/// Encodes N consecutive dims (from `dim`) of a normalized V4 row of format F, N per lane over a
/// warp, so a 64-dim tile spans 64 / N lanes (every lane joins the tile's reduction): bf16_store and
/// the rope dims as bf16; the others as e4m3 of the bf16-rounded values with one UE8M0 scale per tile.
template <Format F, bool kExponentByBits = false, int N>
DSV4_DEV V4Dims<N> encode_v4(int dim, const float (&x)[N]) {
  static_assert(N % 2 == 0, "pairs of dims");
  V4Dims<N> out{};
#pragma unroll
  for (int c = 0; c < N; c += 2) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(x[c], x[c + 1]);
    out.bf16[c] = pair.x, out.bf16[c + 1] = pair.y;
  }
  if constexpr (F == Format::kV4Fp8 || F == Format::kV4TwoPool) {
    float q[N], amax = 0.0f;
#pragma unroll
    for (int c = 0; c < N; ++c) q[c] = __bfloat162float(out.bf16[c]), amax = fmaxf(amax, fabsf(q[c]));
    out.e = v4_exponent<kExponentByBits>(reduce_amax(amax, 64 / N));
    const float inv = exp2_int(127 - out.e);
#pragma unroll
    for (int c = 0; c < N; c += 2) out.codes |= uint32_t{e4m3x2_codes(q[c] * inv, q[c + 1] * inv)} << (8 * c);
  }
  return out;
}

/// Writes what encode_v4 made of the dims from `dim` into `slot`.
template <Format F, int N>
DSV4_DEV void write_v4(const Slot& slot, int dim, const V4Dims<N>& d) {
  constexpr int kNope = Layout<F>::kHeadDim - kRopeDim;
  if constexpr (F == Format::kV4Bf16) {
    store_vec(reinterpret_cast<bf16_t*>(slot.data) + dim, d.bf16);
  } else if constexpr (F == Format::kV4TwoPool) {
    if (dim >= kNope) {
      store_vec(reinterpret_cast<bf16_t*>(slot.rope) + (dim - kNope), d.bf16);
    } else {
      using Codes = std::conditional_t<N == 4, uint32_t, uint16_t>;
      *reinterpret_cast<Codes*>(slot.data + dim) = static_cast<Codes>(d.codes);
      // each exponent twice (a 16-bit word): the two-pool reader's scale layout
      if (dim % 64 == 0) *reinterpret_cast<uint16_t*>(slot.scales + 2 * (dim / 64)) = static_cast<uint16_t>(d.e * 0x101);
    }
  } else if (dim >= kNope) {
    store_vec(reinterpret_cast<bf16_t*>(slot.data + kNope) + (dim - kNope), d.bf16);
  } else {
    using Codes = std::conditional_t<N == 4, uint32_t, uint16_t>;
    *reinterpret_cast<Codes*>(slot.data + dim) = static_cast<Codes>(d.codes);
    if (dim % 64 == 0) slot.scales[dim / 64] = static_cast<uint8_t>(d.e);
  }
}

}  // namespace dsv4::store
