// What the store kernels receive (Params) and what checked mode reports of them (StatusBit).
#pragma once

#include <cstdint>

#include "common/status_text.h"

namespace dsv4::store {

struct Params {
  const void* kv;           // [rows, hd] DType
  const void* plan;         // CompressPlan or OnlinePlan (prefill) or DecodePlan rows
  const void* norm_weight;  // [hd] DType
  const float* freq;        // [max_pos, 64]: (cos, sin) interleaved per pair
  const void* out_loc;      // int32 or int64
  uint8_t* cache;           // [num_pages, page_bytes]
  int32_t* status;
  int64_t page_bytes;
  int64_t num_locs;         // pages * page_size
  int64_t out_loc_len;
  int64_t max_pos;
  uint32_t rows;
  int32_t log2_page_size;
  int32_t ratio;
  float eps;
  bool loc64;
  bool is_decode;
  uint8_t* rope_cache;      // two pools (Format::kV4TwoPool): [num_pages · page_size, 128], else nullptr
};

enum StatusBit : int32_t {
  kLocOutOfRange = 1,       // out_loc entry outside the cache
  kPositionOutOfRange = 2,  // seq_len - R outside the freq table
  kRaggedOutOfRange = 4,    // prefill ragged id beyond out_loc
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kLocOutOfRange, "an out_loc entry of a stored row lies outside kvcache"},
                            {kPositionOutOfRange, "a rope position (seq_len - compress_ratio) lies outside freq_cis"},
                            {kRaggedOutOfRange, "a plan row's ragged id lies beyond out_loc"}});
}

}  // namespace dsv4::store
