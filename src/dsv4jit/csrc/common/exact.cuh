// fp32 results with the bits of CUDA's correctly rounded division and of its fp64 exp rounded once,
// without the branch each of those takes per call. A branch to a slow path fences the scheduler, so a
// thread's 4 values would run one after the other on chains that are latency-bound; here the 4 run
// side by side, with at most one branch for the 4 where an operand is rare (tiny, huge, inf or NaN).
#pragma once

#include <cstdint>

#include "types.cuh"

namespace dsv4 {

/// Whether a quotient of `x` needs no slow path below: 0, or a magnitude in [2^-60, 2^60], where the
/// quotient and the remainder by a divisor in [2^-9, 448] stay in fp32's normal range (not inf or NaN).
DSV4_DEV bool short_divisible(float x) {
  const float a = fabsf(x);
  return a == 0.0f || (a >= 0x1p-60f && a <= 0x1p60f);
}

/// __fdiv_rn's reciprocal of a normal d: the approximate reciprocal refined by one Newton step
/// (relative error about 2^-46 before its rounding).
DSV4_DEV float newton_reciprocal(float d) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d));
  return __fmaf_rn(__fmaf_rn(-d, y, 1.0f), y, y);
}

/// x / d from y = newton_reciprocal(d), as __fdiv_rn's fast path computes it: q = RN(x·y) is within an
/// ulp of x / d, so the remainder x - q·d is exact in an fma, and one correction step rounds (Markstein:
/// exact wherever y = RN(1 / d)); a zero remainder leaves q, which keeps a zero x's sign. Where
/// short_divisible(x) and d lies in [2^-9, 448], no step leaves fp32's normal range and, x scaled by
/// 2^k, every step scales exactly.
DSV4_DEV float corrected_quotient(float x, float d, float y) {
  const float q = __fmul_rn(x, y);
  const float r = __fmaf_rn(-q, d, x);
  return r == 0.0f ? q : __fmaf_rn(r, y, q);
}

/// The 4 quotients x[c] / d[c] with __fdiv_rn's bits for divisors in [1, 2] (the pair poolings' 1 + e
/// and e_o + e_n): __fdiv_rn's fast path where every x is short_divisible and every d in [1, 2] (a range
/// its hardware check never sends to the slow path), else __fdiv_rn; one branch for the 4. The
/// store_probes module checks them against __fdiv_rn on every fp32 significand of x.
DSV4_DEV void unit_quotients(float (&q)[4], const float (&x)[4], const float (&d)[4]) {
  bool fast = true;  // & not &&: one test, not a branch per operand
#pragma unroll
  for (int c = 0; c < 4; ++c) fast &= short_divisible(x[c]) & (d[c] >= 1.0f) & (d[c] <= 2.0f);
  if (fast) {
#pragma unroll
    for (int c = 0; c < 4; ++c) q[c] = corrected_quotient(x[c], d[c], newton_reciprocal(d[c]));
  } else {
#pragma unroll
    for (int c = 0; c < 4; ++c) q[c] = __fdiv_rn(x[c], d[c]);
  }
}

/// RN(exp(x[i])) for x[i] <= 0 or NaN: the bits of (float)exp((double)x[i]), CUDA's fp64 exp operation
/// by operation (x·log2(e) rounded to an integer k by the 1.5·2^52 shift, r = x - k·ln2 in two parts, a
/// degree-11 polynomial, 2^k added to the exponent) without its branch for |x| >= 708: x clamps at
/// -110, whose exp rounds to 0 in fp32 as that of any smaller x does (e^-103.98 is below 2^-150, half
/// the smallest subnormal). NaN gives NaN. The N values go step by step together, so that their
/// polynomial chains overlap. The store_probes module checks every x <= 0.
template <int N>
DSV4_DEV void exp_nonpositive(float (&e)[N], const float (&x)[N]) {
  constexpr double kShift = 0x1.8p52, kLog2e = 0x1.71547652b82fep+0;
  constexpr double kLn2Hi = 0x1.62e42fefa39efp-1, kLn2Lo = 0x1.abc9e3b39803fp-56;
  constexpr double kPoly[] = {0x1.ade1569ce2bdfp-26, 0x1.28af3fca213eap-22, 0x1.71dee62401315p-19,
                              0x1.a01997c89eb71p-16, 0x1.a01a014761f65p-13, 0x1.6c16c1852b7afp-10,
                              0x1.1111111122322p-7,  0x1.55555555502a1p-5,  0x1.5555555555511p-3,
                              0x1.000000000000bp-1,  1.0,                   1.0};
  double t[N], r[N], p[N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const double a = static_cast<double>(fmaxf(x[i], -110.0f));  // NaN -> -110: restored below
    t[i] = __fma_rn(a, kLog2e, kShift);
    const double k = __dsub_rn(t[i], kShift);
    r[i] = __fma_rn(k, -kLn2Lo, __fma_rn(k, -kLn2Hi, a));
    p[i] = __fma_rn(r[i], kPoly[0], kPoly[1]);
  }
#pragma unroll
  for (int j = 2; j < 12; ++j) {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = __fma_rn(r[i], p[i], kPoly[j]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    // k sits in t's low word (two's complement): 2^k times p, whose result is normal for x >= -110
    const uint32_t hi =
        static_cast<uint32_t>(__double2hiint(p[i])) + (static_cast<uint32_t>(__double2loint(t[i])) << 20);
    const float v = static_cast<float>(__hiloint2double(static_cast<int>(hi), __double2loint(p[i])));
    e[i] = isnan(x[i]) ? x[i] : v;
  }
}

}  // namespace dsv4
