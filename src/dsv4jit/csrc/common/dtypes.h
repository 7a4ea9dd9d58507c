// DLPack dtype constants and names shared by host-only and CUDA code.
#pragma once

#include <dlpack/dlpack.h>

#include <string>

namespace dsv4 {

namespace dl {
inline constexpr DLDataType kF32{kDLFloat, 32, 1};
inline constexpr DLDataType kBF16{kDLBfloat, 16, 1};
inline constexpr DLDataType kF16{kDLFloat, 16, 1};
inline constexpr DLDataType kU8{kDLUInt, 8, 1};
inline constexpr DLDataType kI32{kDLInt, 32, 1};
inline constexpr DLDataType kI64{kDLInt, 64, 1};
inline constexpr DLDataType kC64{kDLComplex, 64, 1};
}  // namespace dl

inline bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

inline std::string dtype_str(DLDataType t) {
  const char* base = t.code == kDLFloat ? "float" : t.code == kDLBfloat ? "bfloat" : t.code == kDLInt ? "int"
                     : t.code == kDLUInt ? "uint" : t.code == kDLBool ? "bool" : t.code == kDLComplex ? "complex"
                     : "dtype";
  std::string s = base + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

}  // namespace dsv4
