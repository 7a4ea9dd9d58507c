// Checked mode's status word: kernels OR the bits of the violations they skip into one int32 word
// (report_status), and the host turns a word into the family's text (status_text.h). Unchecked
// calls pass no word (nullptr) and report nothing.
#pragma once

#include <cstdint>

#include "macros.h"
#include "status_text.h"

namespace dsv4 {

/// ORs `bit` into the word of a family's parameters `p` (p.status), if the call is checked.
template <typename Params>
DSV4_DEV void report_status(const Params& p, int32_t bit) {
  if (p.status != nullptr) atomicOr(p.status, bit);
}

}  // namespace dsv4
