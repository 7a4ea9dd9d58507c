// Quantization codecs of the compressed KV cache (contract §6.6): UE8M0 power-of-two scales rounded
// up, e4m3 with round-to-nearest-even, and the e2m1 (fp4) threshold code.
#pragma once

#include <cuda_fp8.h>

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

}  // namespace dsv4
