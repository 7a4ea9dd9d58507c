// Test-only probes of the store's codecs (the store_probes module, outside the serving set): the
// e2m1 codes of both fp4 codecs, the division-free UE8M0 exponents, the DeepSeek-V4.1 codes (e2m1
// with ties to even, the tile exponent and the two fp4 tile scales) and the fp4 codecs' quotients
// by a tile scale, over any fp32 inputs, for checking them against the reference rules on every bit
// pattern; and the ratio-2 pair poolings' branch-free exp and quotients (common/exact.cuh) against
// the library's.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>

#include "common/exact.cuh"
#include "common/launch.cuh"
#include "common/quant.cuh"
#include "common/tensor_check.h"
#include "common/types.cuh"

namespace dsv4::store {

using tvm::ffi::TensorView;

/// Codec probes for the tests: each maps an fp32 value to two outputs.
template <typename Probe, typename Out>
__global__ void probe_kernel(const float* __restrict__ x, Out* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    Probe::apply(x[i], out + Probe::kOutputs * i);
  }
}

/// Runs Probe over x fp32 [n] into out [n, Probe::kOutputs] (`x_name`: the input's name in errors).
template <typename Probe, typename Out>
void run_probe(const char* op, const char* x_name, TensorView x, TensorView out) {
  Size n{"n"};
  Device dev;
  Check(op, x_name, x).shape({n}).dtype(dl::kF32).cuda(dev).contiguous();
  Check(op, "out", out).shape({n, Probe::kOutputs}).dtype(DTypeInfo<Out>::dtype).cuda(dev).contiguous();
  launch(op, dev.dev, {std::min(div_ceil(n.value, 256), 4096u), 256}, false, probe_kernel<Probe, Out>,
         static_cast<const float*>(x.data_ptr()), static_cast<Out*>(out.data_ptr()), n.value);
}

/// The e2m1 code pair (x, x) the fp4 stores write for already-scaled values: by fp4_code, by its
/// table.
struct Fp4CodesProbe {
  static constexpr int kOutputs = 2;
  static DSV4_DEV void apply(float x, uint8_t* out) {
    out[0] = static_cast<uint8_t>(fp4_code_pair(x, x));
    out[1] = static_cast<uint8_t>(kFp4Codes.pair(x, x));
  }
};

/// UE8M0 exponents by the division-free rule for a group's largest magnitude: amax / 6 (the fp4
/// groups' scale) and amax / 448 (the V4 tiles' divisor, which the fused kernels keep as a division).
struct ScaleExponentsProbe {
  static constexpr int kOutputs = 2;
  static DSV4_DEV void apply(float amax, int32_t* out) {
    out[0] = ue8m0_scale_exponent<6>(amax);
    out[1] = ue8m0_scale_exponent<448>(amax);
  }
};

/// The V4.1 codes of x (contract §10.2): the e2m1 code pair (x, x) with ties to even (the target's
/// conversion: in software on sm_90a), and for |x| as a tile's largest magnitude the v41 tile exponent,
/// the v41_fp4 scale code and the fake quant's scale code.
struct V41CodesProbe {
  static constexpr int kOutputs = 4;
  static DSV4_DEV void apply(float x, int32_t* out) {
    const float amax = fabsf(x);
    out[0] = static_cast<int32_t>(e2m1_rn_pair(x, x));
    out[1] = v41_tile_exponent(amax);
    out[2] = static_cast<int32_t>(v41_fp4_scale_code(amax));
    out[3] = static_cast<int32_t>(fp4_fake_quant_scale_code(amax));
  }
};

/// The fp4 codecs' quotients by a tile scale against __fdiv_rn, bit for bit, for every positive e4m3
/// value d (codes 1 to 126: 2^-9 to 448, 6 among them): how many of short_quotients' quotients of x by
/// the 126 differ, and the first such code (-1: none); plus, for every x, whether each newton_reciprocal
/// equals __frcp_rn (a count, the same in every row).
struct ShortQuotientsProbe {
  static constexpr int kOutputs = 3;
  static DSV4_DEV void apply(float x, int32_t* out) {
    int32_t differ = 0, first = -1, reciprocals = 0;
    for (uint32_t code = 1; code <= 126; ++code) {
      const float d = e4m3_value(code);
      const float xs[4] = {x, x, x, x};
      float q[4];
      short_quotients(q, xs, d);
      if (__float_as_uint(q[0]) != __float_as_uint(__fdiv_rn(x, d)) && differ++ == 0) first = static_cast<int32_t>(code);
      reciprocals += __float_as_uint(newton_reciprocal(d)) != __float_as_uint(__frcp_rn(d));
    }
    out[0] = differ;
    out[1] = first;
    out[2] = reciprocals;
  }
};

/// The pair poolings' branch-free steps against the library's (common/exact.cuh), bit for bit: 1 where
/// exp_nonpositive(x) equals (float)exp((double)x) (both NaN counts as equal), for x <= 0 or NaN.
struct ExpNonpositiveProbe {
  static constexpr int kOutputs = 1;
  static DSV4_DEV void apply(float x, int32_t* out) {
    const float xs[1] = {x};
    float got[1];
    exp_nonpositive(got, xs);
    const float want = static_cast<float>(exp(static_cast<double>(x)));
    out[0] = __float_as_uint(got[0]) == __float_as_uint(want) || (isnan(got[0]) && isnan(want));
  }
};

/// unit_quotients of x by 128 divisors in [1, 2] against __fdiv_rn, bit for bit: 1, 2, their
/// neighbours 1 + 2^-23 and 2 - 2^-23, and 124 significands spread over the binade by a multiplicative
/// hash; how many quotients differ, and the first such divisor's index (-1: none).
struct UnitQuotientsProbe {
  static constexpr int kOutputs = 2;
  static constexpr uint32_t kDivisors = 128;
  static DSV4_DEV float divisor(uint32_t i) {
    switch (i) {
      case 0: return 1.0f;
      case 1: return 2.0f;
      case 2: return __uint_as_float(0x3F800001u);
      case 3: return __uint_as_float(0x3FFFFFFFu);
      default: return __uint_as_float(0x3F800000u | ((i * 2654435761u) & 0x7FFFFFu));
    }
  }
  static DSV4_DEV void apply(float x, int32_t* out) {
    int32_t differ = 0, first = -1;
    for (uint32_t i = 0; i < kDivisors; i += 4) {
      const float xs[4] = {x, x, x, x};
      const float d[4] = {divisor(i), divisor(i + 1), divisor(i + 2), divisor(i + 3)};
      float q[4];
      unit_quotients(q, xs, d);
      for (int c = 0; c < 4; ++c) {
        if (__float_as_uint(q[c]) != __float_as_uint(__fdiv_rn(x, d[c])) && differ++ == 0) {
          first = static_cast<int32_t>(i) + c;
        }
      }
    }
    out[0] = differ;
    out[1] = first;
  }
};

/// x fp32 [n] -> out int32 [n, 1]: ExpNonpositiveProbe.
inline void exp_nonpositive(TensorView x, TensorView out) {
  run_probe<ExpNonpositiveProbe, int32_t>("store_probes.exp_nonpositive", "x", x, out);
}

/// x fp32 [n] -> out int32 [n, 2]: UnitQuotientsProbe.
inline void unit_quotients(TensorView x, TensorView out) {
  run_probe<UnitQuotientsProbe, int32_t>("store_probes.unit_quotients", "x", x, out);
}

/// x fp32 [n] -> out int32 [n, 3]: ShortQuotientsProbe.
inline void short_quotients(TensorView x, TensorView out) {
  run_probe<ShortQuotientsProbe, int32_t>("store_probes.short_quotients", "x", x, out);
}

/// x fp32 [n] -> out int32 [n, 4]: V41CodesProbe.
inline void v41_codes(TensorView x, TensorView out) {
  run_probe<V41CodesProbe, int32_t>("store_probes.v41_codes", "x", x, out);
}

/// x fp32 [n] -> out u8 [n, 2]: Fp4CodesProbe, for checking both codecs against the reference rule.
inline void fp4_codes(TensorView x, TensorView out) {
  run_probe<Fp4CodesProbe, uint8_t>("store_probes.fp4_codes", "x", x, out);
}

/// amax fp32 [n] -> out int32 [n, 2]: ScaleExponentsProbe, for checking the rule against the
/// reference's division.
inline void scale_exponents(TensorView amax, TensorView out) {
  run_probe<ScaleExponentsProbe, int32_t>("store_probes.scale_exponents", "amax", amax, out);
}

}  // namespace dsv4::store
