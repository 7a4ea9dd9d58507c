// What the ratio-1 and ratio-2 compressor kernels receive (Params) and what checked mode reports of them
// (StatusBit). The latent cache is addressed as the store family addresses it (store::Params: cache,
// page bytes, page size); positions and locations are int32 or int64.
#pragma once

#include <cstdint>

#include "common/status_text.h"
#include "common/types.cuh"
#include "common/warp.cuh"
#include "store/params.cuh"

namespace dsv4::lowratio {

inline constexpr int kHeadDim = 512;      // the latent: 448 nope + 64 rope dims
inline constexpr int kPairRow = 2 * kHeadDim;  // a ratio-2 input or ring row: | kv | score |

struct Params {
  const void* kv;             // c1: [rows, 512] bf16; c2: [rows, 1024] fp32
  bf16_t* out;                // [rows, 512] bf16: the pre-RoPE latent
  const bf16_t* norm_weight;  // [512]
  const void* positions;      // [rows] int32 / int64
  const void* locs;           // [rows] int32 / int64: c1 out_loc, c2 raw_out_loc (0: a padded row)
  const int64_t* req;         // c2: [rows] request slots
  float* ring;                // c2: [ring_rows, 1024] the pair ring, rid * ring_size + position mod ring_size
  const int32_t* extend_start;  // c2 prefill: [num_reqs]
  const int32_t* extend_len;    // c2 prefill: [num_reqs]
  store::Params s;            // the cache (cache, page_bytes, log2_page_size, num_locs), freq, max_pos, status
  int64_t ring_rows;
  uint32_t rows;
  uint32_t num_reqs;
  int32_t ring_size;
  int32_t draft_len;          // c2 decode: rows come in request-major blocks of draft_len positions
  float eps;
  bool pos64;
  bool loc64;
};

enum StatusBit : int32_t {
  kLocOutOfRange = 1,       // a stored row's location lies outside k_cache
  kPositionOutOfRange = 2,  // a RoPE position lies outside freqs_cis, or a position is negative
  kRingRowOutOfRange = 4,   // a ring row lies outside kv_state
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kLocOutOfRange, "a stored row's location (out_loc, raw_out_loc >> 1) lies outside k_cache"},
                            {kPositionOutOfRange, "a position is negative or its RoPE row lies outside freqs_cis"},
                            {kRingRowOutOfRange,
                             "a ring row (req * ring_size + position mod ring_size) lies outside kv_state"}});
}

DSV4_DEV int64_t entry(const void* values, bool wide, uint64_t i) {
  return wide ? static_cast<const int64_t*>(values)[i] : static_cast<const int32_t*>(values)[i];
}

/// position mod ring_size (C++'s remainder): a mask where ring_size is a power of two and position is
/// not negative (every serving ring), not a 64-bit division on the chain to the ring row's load.
DSV4_DEV int64_t ring_slot(int64_t position, int32_t ring_size) {
  if ((ring_size & (ring_size - 1)) == 0 && position >= 0) return position & (ring_size - 1);
  return position % ring_size;
}

/// Reports a row's violation (a block holds the row: its first thread reports).
DSV4_DEV void report(const Params& p, int32_t bit) {
  if (p.s.status != nullptr && threadIdx.x == 0) atomicOr(p.s.status, bit);
}

}  // namespace dsv4::lowratio
