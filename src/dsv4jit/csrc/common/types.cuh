// Element types of our kernels and conversions through fp32 (round to nearest on narrowing).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "dtypes.h"
#include "macros.h"

namespace dsv4 {

using bf16_t = __nv_bfloat16;
using fp16_t = __half;

template <typename T>
struct DTypeInfo;
template <>
struct DTypeInfo<float> {
  static constexpr DLDataType dtype = dl::kF32;
};
template <>
struct DTypeInfo<bf16_t> {
  static constexpr DLDataType dtype = dl::kBF16;
};
template <>
struct DTypeInfo<fp16_t> {
  static constexpr DLDataType dtype = dl::kF16;
};
template <>
struct DTypeInfo<uint8_t> {
  static constexpr DLDataType dtype = dl::kU8;
};
template <>
struct DTypeInfo<int32_t> {
  static constexpr DLDataType dtype = dl::kI32;
};
template <>
struct DTypeInfo<int64_t> {
  static constexpr DLDataType dtype = dl::kI64;
};

DSV4_DEV float to_f32(float x) { return x; }
DSV4_DEV float to_f32(bf16_t x) { return __bfloat162float(x); }
DSV4_DEV float to_f32(fp16_t x) { return __half2float(x); }

template <typename T>
DSV4_DEV T from_f32(float x);
template <>
DSV4_DEV float from_f32<float>(float x) { return x; }
template <>
DSV4_DEV bf16_t from_f32<bf16_t>(float x) { return __float2bfloat16_rn(x); }
template <>
DSV4_DEV fp16_t from_f32<fp16_t>(float x) { return __float2half_rn(x); }

/// Value conversion between element types, through fp32 (exact when widening).
template <typename To, typename From>
DSV4_DEV To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else {
    return from_f32<To>(to_f32(x));
  }
}

}  // namespace dsv4
