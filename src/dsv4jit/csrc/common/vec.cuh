// 16-byte vectors: the unit of every global load and store in our kernels.
#pragma once

#include "types.cuh"

namespace dsv4 {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
  DSV4_HD T& operator[](int i) { return v[i]; }
  DSV4_HD const T& operator[](int i) const { return v[i]; }
};

/// Elements of T per 16-byte access.
template <typename T>
inline constexpr int kVec16 = 16 / sizeof(T);

template <int N, typename T>
DSV4_DEV Vec<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, N>*>(ptr);
}

/// Read-once data (inputs streamed through): skip L1 allocation.
template <int N, typename T>
DSV4_DEV Vec<T, N> load_vec_stream(const T* ptr) {
  static_assert(sizeof(Vec<T, N>) == 16 || sizeof(Vec<T, N>) == 8 || sizeof(Vec<T, N>) == 4);
  Vec<T, N> out;
  if constexpr (sizeof(Vec<T, N>) == 16) {
    int4 raw;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
                 : "l"(ptr));
    out = *reinterpret_cast<Vec<T, N>*>(&raw);
  } else {
    out = load_vec<N>(ptr);
  }
  return out;
}

template <int N, typename T>
DSV4_DEV void store_vec(T* ptr, const Vec<T, N>& value) {
  *reinterpret_cast<Vec<T, N>*>(ptr) = value;
}

/// Element-wise conversion of a vector (through fp32).
template <typename To, typename From, int N>
DSV4_DEV Vec<To, N> convert_vec(const Vec<From, N>& in) {
  Vec<To, N> out;
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = convert<To>(in[i]);
  return out;
}

}  // namespace dsv4
