// Aligned vectors (up to 16 bytes): the unit of every global load and store in our kernels.
#pragma once

#include "types.cuh"

namespace dsv4 {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
  DSV4_HD T& operator[](int i) { return v[i]; }
  DSV4_HD const T& operator[](int i) const { return v[i]; }
};

template <int N, typename T>
DSV4_DEV Vec<T, N> load_vec(const T* ptr) {
  return *reinterpret_cast<const Vec<T, N>*>(ptr);
}

/// A 16-byte row (a plan row) in one load: a struct copy may become several loads that the
/// compiler places on both sides of the first branch on a field, one round trip each.
template <typename Row>
DSV4_DEV Row load_row(const Row* rows, uint64_t i) {
  static_assert(sizeof(Row) == 16 && alignof(Row) == 16, "one 16-byte load");
  const uint4 raw = reinterpret_cast<const uint4*>(rows)[i];
  Row row;
  memcpy(&row, &raw, sizeof(Row));
  return row;
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
