// Checked mode's message for a kernel family's status word. Each family keeps the text of its
// status bits next to its StatusBit enum and exports describe_status, so that the Python side
// raises the kernel's own words instead of a copy of them. Host-only: no CUDA headers.
#pragma once

#include <tvm/ffi/string.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace dsv4 {

/// One status bit and what it means for the caller.
struct StatusText {
  int32_t bit;
  const char* text;
};

/// The texts of the bits set in `word`, in the order given, joined by "; " (empty when none is set;
/// bits without a text are ignored).
inline tvm::ffi::String status_text(int64_t word, std::initializer_list<StatusText> texts) {
  std::string out;
  for (const StatusText& t : texts) {
    if (word & t.bit) out += (out.empty() ? "" : "; ") + std::string(t.text);
  }
  return tvm::ffi::String(out);
}

}  // namespace dsv4
