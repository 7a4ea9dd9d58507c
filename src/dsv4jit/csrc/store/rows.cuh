// Which rows are stored and where: a plan row's selection, its rope position and cache location, and
// the bounds checks that skip (and report) a row instead of writing out of bounds.
#pragma once

#include <cstdint>

#include "common/plan_structs.h"
#include "common/vec.cuh"
#include "params.cuh"

namespace dsv4::store {

/// A row's violations are reported by its first lane (rows on kLanes lanes). The status test comes
/// first, so that unchecked calls skip the lane test too.
template <int kLanes>
DSV4_DEV void report(const Params& p, int32_t bit) {
  if (p.status != nullptr && threadIdx.x % kLanes == 0) atomicOr(p.status, bit);
}

/// Entry i of an out_loc array at `entries` (p.out_loc, or a copy of its entries), int64 or int32.
DSV4_DEV int64_t loc_entry(const Params& p, const void* entries, int64_t i) {
  return p.loc64 ? static_cast<const int64_t*>(entries)[i] : static_cast<const int32_t*>(entries)[i];
}

DSV4_DEV int64_t load_loc(const Params& p, int64_t i) { return loc_entry(p, p.out_loc, i); }

/// Whether a decode row whose plan says `seq_len` compresses a row this step (R: 4 or 128).
DSV4_DEV bool closes_window(const Params& p, uint32_t seq_len) { return (seq_len & (p.ratio - 1)) == 0; }

/// The rope position of the row that a plan row's `seq_len` closes: the first token of its block of R.
DSV4_DEV int64_t rope_position(const Params& p, uint32_t seq_len) { return int64_t{seq_len} - p.ratio; }

/// The plan side of which rows are stored: whether `row` is, its rope position and its cache
/// location. The location load is only issued here (first used by check()), so callers can
/// overlap it.
template <int kLanes>
DSV4_DEV bool select(const Params& p, uint32_t row, int64_t& loc, int64_t& position) {
  uint32_t seq_len;
  if (p.is_decode) {
    seq_len = static_cast<const DecodePlan*>(p.plan)[row].seq_len;
    loc = load_loc(p, row);  // decode locations do not depend on the plan: load in parallel
    if (!closes_window(p, seq_len)) return false;  // no compress event this step
  } else {
    // an online segment row (OnlinePlan) has seq_len and ragged_id where CompressPlan has them
    const CompressPlan c = load_row(static_cast<const CompressPlan*>(p.plan), row);
    if (c.is_invalid()) return false;
    if (c.ragged_id >= p.out_loc_len) {
      report<kLanes>(p, kRaggedOutOfRange);
      return false;
    }
    seq_len = c.seq_len;
    loc = load_loc(p, c.ragged_id);  // out_loc is indexed by ragged token id in prefill
  }
  position = rope_position(p, seq_len);
  return true;
}

DSV4_DEV bool position_ok(const Params& p, int64_t position) { return position >= 0 && position < p.max_pos; }

/// False (and reported) when the location or the rope position lies outside the cache or the
/// freq table: the row is skipped, nothing is written out of bounds.
template <int kLanes>
DSV4_DEV bool check(const Params& p, int64_t loc, int64_t position) {
  const int32_t bad = static_cast<uint64_t>(loc) >= static_cast<uint64_t>(p.num_locs) ? kLocOutOfRange
                      : !position_ok(p, position)                                     ? kPositionOutOfRange
                                                                                      : 0;
  if (bad != 0) report<kLanes>(p, bad);
  return bad == 0;
}

}  // namespace dsv4::store
