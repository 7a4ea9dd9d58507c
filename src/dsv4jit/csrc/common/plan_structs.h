// The plan rows kernels exchange (byte layouts of contract §2; Python twin: dsv4jit/plan_layout.py).
// Host and device code share these structs; plans travel as uint8 tensors [rows, sizeof(row)].
#pragma once

#include <cstddef>
#include <cstdint>

#include "macros.h"

namespace dsv4 {

inline constexpr uint32_t kInvalidU32 = 0xFFFFFFFFu;

/// One compress event (prefill): the window closing at position seq_len - 1.
struct alignas(16) CompressPlan {
  uint32_t seq_len;     // p + 1, a multiple of the ratio; kInvalidU32 marks an invalid row
  uint16_t ragged_id;   // ragged id of the closing token
  uint16_t buffer_len;  // leading window slots read from the state buffer (rest: ragged input)
  int32_t read_page_0;  // state page of max(p - R, 0) (c4 overlap half)
  int32_t read_page_1;  // state page of p; meaningful iff buffer_len > 0 (paged planners)

  DSV4_HD static CompressPlan invalid() { return {kInvalidU32, 0, 0, -1, -1}; }
  DSV4_HD bool is_invalid() const { return seq_len == kInvalidU32; }
};

/// One segment of an online c128 prefill (contract §2.5): tokens of one 128-token chunk, pooled
/// into a partial state. CompressPlan's layout with fields of their own: seq_len and ragged_id are
/// where CompressPlan has them, so the store step (store/rows.cuh) reads either row.
struct alignas(16) OnlinePlan {
  uint32_t seq_len;      // last position of the segment + 1; kInvalidU32 marks an invalid row
  uint16_t ragged_id;    // ragged id of the segment's last token
  uint16_t segment_len;  // tokens of the segment (1-128)
  int32_t store_slot;    // state row the segment's state is stored to (rid + state_slot_offset)
  int32_t load_slot;     // state row a continued chunk's state is loaded from (rid); < 0: store_slot

  DSV4_HD static OnlinePlan invalid() { return {kInvalidU32, 0, 0, -1, -1}; }
  DSV4_HD bool is_invalid() const { return seq_len == kInvalidU32; }
  DSV4_HD int32_t merge_slot() const { return load_slot >= 0 ? load_slot : store_slot; }
};

/// One token to store into the state ring (prefill).
struct alignas(8) WritePlan {
  uint32_t ragged_id;  // kInvalidU32 marks an invalid row
  int32_t write_loc;   // state row

  DSV4_HD static WritePlan invalid() { return {kInvalidU32, -1}; }
  DSV4_HD bool is_invalid() const { return ragged_id == kInvalidU32; }
};

/// One request of a decode step (every row is processed).
struct alignas(16) DecodePlan {
  uint32_t seq_len;  // including the token being decoded
  int32_t write_loc;
  int32_t read_page_0;
  int32_t read_page_1;
};

static_assert(sizeof(CompressPlan) == 16 && sizeof(WritePlan) == 8 && sizeof(DecodePlan) == 16);
// An online segment row is a CompressPlan row byte for byte (contract §2.5): same size, alignment
// and field offsets (the invalid row too).
static_assert(sizeof(OnlinePlan) == sizeof(CompressPlan) && alignof(OnlinePlan) == alignof(CompressPlan));
static_assert(offsetof(OnlinePlan, seq_len) == offsetof(CompressPlan, seq_len) &&
              offsetof(OnlinePlan, ragged_id) == offsetof(CompressPlan, ragged_id) &&
              offsetof(OnlinePlan, segment_len) == offsetof(CompressPlan, buffer_len) &&
              offsetof(OnlinePlan, store_slot) == offsetof(CompressPlan, read_page_0) &&
              offsetof(OnlinePlan, load_slot) == offsetof(CompressPlan, read_page_1));

}  // namespace dsv4
