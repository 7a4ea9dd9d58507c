// Quantization codecs of the compressed KV cache (contract §6.6): UE8M0 power-of-two scales rounded
// up, e4m3 with round-to-nearest-even, and the e2m1 (fp4) threshold code; and the DeepSeek-V4.1
// codes (contract §10): the V4.1 tile exponent, the fp4 layouts' e4m3 tile scale, and e2m1 with
// round-to-nearest-even (the hardware conversion's rule).
#pragma once

#include <cuda_fp8.h>

#include "exact.cuh"
#include "types.cuh"

namespace dsv4 {

/// Biased UE8M0 exponent of a positive scale, rounded up to a power of two: 2^(e-127) >= scale.
DSV4_DEV int ue8m0_ceil(float scale) {
  const uint32_t bits = __float_as_uint(scale);
  return static_cast<int>((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0);
}

constexpr int log2_floor(int v) { return v < 2 ? 0 : 1 + log2_floor(v / 2); }

/// Biased UE8M0 exponent of the scale max(amax, 1e-4) / D rounded up to a power of two (e with
/// 2^(e-127) >= the fp32 quotient), D the code's largest value. No division: amax = 2^E·M and
/// D = 2^d·m (M, m in [1, 2)) give E - d, plus one when M > m. The fp32 quotient agrees: from the
/// amax just above D·2^k, amax / D exceeds 2^k by more than half an ulp (m < 2), so it rounds above.
template <int D>
DSV4_DEV int ue8m0_scale_exponent(float amax) {
  constexpr int d = log2_floor(D);
  constexpr uint32_t m_bits = (static_cast<uint32_t>(D) << (23 - d)) & 0x7FFFFFu;
  const uint32_t bits = __float_as_uint(fmaxf(amax, 1e-4f));  // NaN -> the floor
  if (bits >= 0x7F800000u) return 255;                          // inf / D
  return static_cast<int>((bits + (0x7FFFFFu - m_bits)) >> 23) - d;
}

/// 2^k as an fp32 (normal range), so that scaling by it is exact.
DSV4_DEV float exp2_int(int k) { return __uint_as_float(static_cast<uint32_t>(k + 127) << 23); }

/// e4m3 codes of a pair (round to nearest even, saturated to ±448; `lo` in the low byte).
DSV4_DEV uint16_t e4m3x2_codes(float lo, float hi) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

/// e2m1 code by thresholds: magnitude index = #{t : |u| > t} for t in 0.25, 0.75, 1.25, 1.75, 2.5,
/// 3.5, 5 (ties round toward the smaller magnitude; NaN: none), sign bit only for a nonzero
/// magnitude (no -0). From 1 up, e2m1 is fp32 with one mantissa bit: rounding the mantissa to that
/// bit with ties down (add just under half of it, truncate) gives exponent and bit, and 1.0 (2^0,
/// bit 0) is index 2.
DSV4_DEV uint32_t fp4_code(float u) {
  const float a = fabsf(u);
  // both sides computed, then selected: a branch per value diverges within the warp
  const uint32_t from_one = ((__float_as_uint(fminf(a, 6.0f)) + 0x1FFFFFu) >> 22) - (127u << 1) + 2u;
  const uint32_t below_one = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a > 0.75f);
  const uint32_t idx = a >= 1.0f ? from_one : below_one;
  return (u < 0.0f && idx != 0) ? (idx | 8u) : idx;
}

/// Two e2m1 codes as one byte, `lo` in the low nibble (the stored order: even dim low).
DSV4_DEV uint32_t fp4_code_pair(float lo, float hi) { return fp4_code(lo) | fp4_code(hi) << 4; }

/// The e2m1 codes of fp4_code() by table, for kernels that code many values per row: every
/// threshold has at most two mantissa bits, so |u| > t exactly when the bucket
/// (bits(|u|) + 2^21 - 1) >> 21 (exponent and two mantissa bits, rounded up) exceeds t's. The
/// bucket of the signed bits, (bits(u) + 2^21 - 1) >> 21 mod 2^11, carries the sign in bit 10 and
/// wraps only NaNs, so one 2048-entry table gives the whole code. An entry holds its code in both
/// nibbles, so a pair's byte is one bitwise select of two entries.
struct alignas(16) Fp4CodeTable {
  static constexpr uint32_t kShift = 21;
  static constexpr uint32_t kRound = (1u << kShift) - 1;
  static constexpr int kEntries = 2048;
  uint8_t code[kEntries];

  static constexpr uint32_t bucket_of(uint32_t bits) { return (bits + kRound) >> kShift; }

  static constexpr uint8_t code_of_bucket(uint32_t bucket) {
    constexpr uint32_t kThresholdBits[] = {0x3E800000u, 0x3F400000u, 0x3FA00000u, 0x3FE00000u,  // 0.25 .. 1.75
                                           0x40200000u, 0x40600000u, 0x40A00000u};              // 2.5, 3.5, 5
    const uint32_t magnitude = bucket % 1024;
    if (magnitude > bucket_of(0x7F800000u)) return 0;  // NaN
    uint32_t idx = 0;
    for (const uint32_t t : kThresholdBits) idx += magnitude > bucket_of(t);
    return static_cast<uint8_t>(bucket >= 1024 && idx != 0 ? idx | 8u : idx);
  }

  static constexpr Fp4CodeTable make() {
    Fp4CodeTable t{};
    for (uint32_t b = 0; b < kEntries; ++b) t.code[b] = static_cast<uint8_t>(code_of_bucket(b) * 0x11u);
    return t;
  }

  DSV4_DEV uint32_t entry(float u) const { return code[bucket_of(__float_as_uint(u))]; }

  /// fp4_code_pair() by table.
  DSV4_DEV uint32_t pair(float lo, float hi) const {
    // (lo & 0x0F) | (hi & ~0x0F) as one lop3 (the compiler masks each side apart)
    uint32_t byte;
    asm("lop3.b32 %0, %1, 0x0F, %2, 0xE2;" : "=r"(byte) : "r"(entry(lo)), "r"(entry(hi)));
    return byte;
  }
};

__device__ constexpr Fp4CodeTable kFp4Codes = Fp4CodeTable::make();

// ---- DeepSeek-V4.1 -------------------------------------------------------------------------------

/// Whether the target has the hardware e2m1 conversion (cvt.rn.satfinite.e2m1x2.f32): Blackwell's
/// arch- and family-specific targets (sm_100a, sm_120a). Elsewhere (sm_90a) e2m1_rn computes the same
/// codes in software.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#define DSV4_HW_E2M1 1
#else
#define DSV4_HW_E2M1 0
#endif

/// The e2m1 code of `u` by the hardware conversion's rule: the magnitude rounded to the nearest of
/// {0, 0.5, 1, 1.5, 2, 3, 4, 6} with ties to the even code, saturated at 6 (+inf too); the sign bit
/// kept (also for -0 and for negatives that round to 0); NaN gives 0x7 (+6), as CUDA's conversion
/// does. From 1 up, e2m1 is fp32 with one mantissa bit: rounding the fp32 bits at bit 22 to nearest
/// even (add 2^21 - 1 plus bit 22, truncate) gives exponent and bit, and 1.0 is code 2; below 1 the
/// codes 0, 1, 2 split at the ties 0.25 (to 0) and 0.75 (to 1.0).
DSV4_DEV uint32_t e2m1_rn_soft(float u) {
  const uint32_t bits = __float_as_uint(u), mag = bits & 0x7FFFFFFFu;
  const float a = __uint_as_float(mag);
  const uint32_t from_one = min(((mag + 0x1FFFFFu + ((mag >> 22) & 1u)) >> 22) - (127u << 1) + 2u, 7u);
  const uint32_t below_one = static_cast<uint32_t>(a > 0.25f) + static_cast<uint32_t>(a >= 0.75f);
  const uint32_t code = (a >= 1.0f ? from_one : below_one) | ((bits >> 28) & 8u);
  return mag > 0x7F800000u ? 7u : code;  // NaN: a select, so that a thread's codes need no branch each
}

/// Two e2m1 codes (e2m1_rn_soft's rule) as one byte, `lo` in the low nibble.
DSV4_DEV uint32_t e2m1_rn_pair(float lo, float hi) {
#if DSV4_HW_E2M1
  uint16_t byte;
  asm("{ .reg .b8 t; cvt.rn.satfinite.e2m1x2.f32 t, %1, %2; mov.b16 %0, {t, 0}; }" : "=h"(byte) : "f"(hi), "f"(lo));
  return byte;
#else
  return e2m1_rn_soft(lo) | e2m1_rn_soft(hi) << 4;
#endif
}

/// The e2m1 grid value of a code (the fake quant's dequantization: exact). The grid's magnitudes
/// {0, 0.5, 1, 1.5, 2, 3, 4, 6}, doubled, are the nibbles of one constant: an array indexed at run time
/// would be a per-thread stack frame in local memory.
DSV4_DEV float e2m1_value(uint32_t code) {
  constexpr uint32_t kDoubledGrid = 0xC8643210u;
  const float v = 0.5f * static_cast<float>((kDoubledGrid >> (4u * (code & 7u))) & 0xFu);
  return (code & 8u) ? -v : v;
}

/// The e4m3 code of one value (round to nearest even, saturated to ±448).
DSV4_DEV uint32_t e4m3_code(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }

/// The value of an e4m3 code (exact in fp32).
DSV4_DEV float e4m3_value(uint32_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
}

/// The UE8M0 exponent of a V4.1 fp8 tile of largest magnitude `amax`: 127 + ceil(log2(max(amax / 448,
/// 2^-13))) evaluated on amax's bits (448 = 1.75·2^8: one more where the mantissa exceeds 0.75), so
/// no quotient is rounded; at least 114 (an all-zero tile too). The codes e4m3(v·2^(127-e)) never
/// saturate.
DSV4_DEV int v41_tile_exponent(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  return max(static_cast<int>(bits >> 23) - 8 + static_cast<int>((bits & 0x7FFFFFu) > 0x600000u), 114);
}

/// The 4 quotients x[c] / d (__fdiv_rn's bits) by a positive e4m3 value d (codes 1 to 126: 2^-9 to
/// 448), with one branch for the 4 and none of the division's: __fdiv_rn only where a value is not
/// short_divisible (tiny, huge, inf or NaN). The reciprocal is RN(1 / d), __frcp_rn's bits: its
/// relative error before rounding, about 2^-46, is less than the distance from 1 / d, of a 4-bit
/// significand, to every rounding midpoint. store_probes checks the quotients against __fdiv_rn on every
/// fp32 significand of x, and the 126 reciprocals against __frcp_rn.
DSV4_DEV void short_quotients(float (&q)[4], const float (&x)[4], float d) {
  const float y = newton_reciprocal(d);
  if (short_divisible(x[0]) && short_divisible(x[1]) && short_divisible(x[2]) && short_divisible(x[3])) {
#pragma unroll
    for (int c = 0; c < 4; ++c) q[c] = corrected_quotient(x[c], d, y);
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) q[c] = __fdiv_rn(x[c], d);
  }
}

/// The e4m3 scale code of a V4.1 fp4 tile: e4m3(clamp(amax / 6, 2^-9, 448)), an IEEE division (the
/// layout's encoder; the fake quant multiplies by fl(1/6) instead: fp4_fake_quant_scale). The quotient
/// by corrected_quotient (6 is an e4m3 value) up to 2^60, where the clamp takes whatever is smaller; above
/// (inf too) and for NaN, amax itself clamps as amax / 6 does.
DSV4_DEV uint32_t v41_fp4_scale_code(float amax) {
  const float q = amax <= 0x1p60f ? corrected_quotient(amax, 6.0f, 1.0f / 6.0f) : amax;
  return e4m3_code(fminf(fmaxf(q, 0x1p-9f), 448.0f));
}

/// The fake quant's tile scale code: e4m3(clamp(amax · fl(1/6), 2^-9, 448)).
DSV4_DEV uint32_t fp4_fake_quant_scale_code(float amax) {
  return e4m3_code(fminf(fmaxf(__fmul_rn(amax, 1.0f / 6.0f), 0x1p-9f), 448.0f));
}

}  // namespace dsv4
