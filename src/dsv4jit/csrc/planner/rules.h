// The planning rules of contract §3, written once for the host paths and the GPU kernels.
//
// Rows are emitted in CPU order (batch-major, position-ascending) by any number of threads at
// once: each token finds its compress row and write row from closed-form per-request counts and
// their prefix sums, so no atomics and no ordering races are involved (identical inputs give
// identical bytes on every path). A row is written once, final: its state rows and pages are looked
// up as it is emitted (contract §3.1, contract §3.4).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/macros.h"
#include "common/plan_structs.h"

namespace dsv4::plan {

/// How (request, position) maps to a state row (contract §3.1).
enum class Scheme : int32_t {
  kPagedSwa = 0,     // c4: a private ring per SWA page, through req_to_token and full_to_state
  kRequestRing = 1,  // c128, or c4 with use_req_ring: rid * ring_size + pos % ring_size
  kLegacy = 2,       // non-paged: c4 page 2*rid + (pos/4)%2, c128 page rid
  kOnline = 3,       // online c128 (contract §5): one running-state row per request, rid + slot_offset
};

/// Status bits of a planner call. Device-resident inputs report them to checked mode only; the
/// host planner raises on any of them.
enum StatusBit : int32_t {
  kTokensDropped = 1,       // more tokens or rows than the plan tensors hold
  kBadLengths = 2,          // extend_len <= 0, extend_len > seq_len, or seq_len < 1
  kReqToTokenOutOfRange = 4,  // a request slot outside req_to_token's rows, or a position beyond its columns
  kFullToStateOutOfRange = 8,
  kNegativeStateSlot = 16,
};

/// Where a violation was met: (batch id << 32 | position), so the lowest key is the first request's
/// first offending position. Kept with the status bits (the minimum over all threads) and used to
/// report the offending argument, index and value; kNoViolation when there is none.
inline constexpr uint64_t kNoViolation = ~uint64_t{0};

DSV4_HD uint64_t violation_key(uint32_t batch_id, int32_t pos) {
  return (uint64_t{batch_id} << 32) | static_cast<uint32_t>(pos);
}

struct Geometry {
  int32_t ratio;          // R: 4 or 128
  int32_t window;         // Wn: 8 (c4) or 128
  int32_t ring_size;
  int32_t swa_page_size;
  int32_t mtp_pad;        // trailing tokens kept resident for speculative rollback
  bool overlap;           // c4
  bool page_tail;         // paged c4: keep the last R tokens of every SWA page
  bool translate_all;     // legacy: translate compress rows even when buffer_len == 0
  Scheme scheme;
  int32_t slot_offset;    // online: state bank of this step's stores (rid + slot_offset)
};

inline Geometry make_geometry(int32_t ratio, int32_t swa_page_size, int32_t ring_size, bool use_req_ring,
                              bool legacy) {
  Geometry g{};
  g.ratio = ratio;
  g.overlap = ratio == 4;
  g.window = g.overlap ? 2 * ratio : ratio;
  g.ring_size = ring_size;
  g.swa_page_size = swa_page_size;
  g.mtp_pad = (!legacy && ring_size > g.window) ? ring_size - g.window + 2 : 0;
  g.scheme = legacy ? Scheme::kLegacy : (ratio == 128 || use_req_ring) ? Scheme::kRequestRing : Scheme::kPagedSwa;
  g.page_tail = g.overlap && g.scheme == Scheme::kPagedSwa;
  g.translate_all = legacy;
  return g;
}

/// Online c128 (contract §3.8): 128-token chunks, segment rows instead of windows and token writes.
inline Geometry make_online_geometry(int32_t slot_offset) {
  Geometry g = make_geometry(128, 1, 128, false, false);
  g.scheme = Scheme::kOnline;
  g.slot_offset = slot_offset;
  return g;
}

DSV4_HD int32_t imax(int32_t a, int32_t b) { return a > b ? a : b; }
DSV4_HD int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }

/// One request's extend range and write threshold.
struct Span {
  int32_t prefix_len;
  int32_t seq_len;
  int32_t first_write;  // positions >= first_write are always written

  DSV4_HD static Span of(const Geometry& g, int32_t seq_len, int32_t extend_len) {
    const int32_t last_c = seq_len / g.ratio * g.ratio;
    // Online: only the last token writes, as the end of the trailing partial segment (if any).
    const int32_t first_w = g.scheme == Scheme::kOnline ? seq_len - (seq_len != last_c)
                                                        : imin(last_c - (g.overlap ? g.ratio : 0), seq_len - g.mtp_pad);
    return {seq_len - extend_len, seq_len, first_w};
  }

  DSV4_HD bool is_event(const Geometry& g, int32_t pos) const { return (pos + 1) % g.ratio == 0; }

  DSV4_HD bool is_write(const Geometry& g, int32_t pos) const {
    return pos >= first_write || (g.page_tail && pos % g.swa_page_size >= g.swa_page_size - g.ratio);
  }

  /// Compress events at positions in [prefix_len, x).
  DSV4_HD int32_t events_before(const Geometry& g, int32_t x) const { return x / g.ratio - prefix_len / g.ratio; }

  /// Written positions in [prefix_len, x): page-tail positions below first_write, then a range.
  DSV4_HD int32_t writes_before(const Geometry& g, int32_t x) const {
    int32_t n = imax(0, x - imax(prefix_len, first_write));
    const int32_t tail_end = imin(x, first_write);
    if (g.page_tail && tail_end > prefix_len) n += tail_positions(g, tail_end) - tail_positions(g, prefix_len);
    return n;
  }

  DSV4_HD int32_t num_events(const Geometry& g) const { return events_before(g, seq_len); }
  DSV4_HD int32_t num_writes(const Geometry& g) const { return writes_before(g, seq_len); }

  /// Positions q in [0, y) in the last R slots of their SWA page.
  DSV4_HD static int32_t tail_positions(const Geometry& g, int32_t y) {
    const int32_t s = g.swa_page_size;
    return y / s * g.ratio + imax(0, y % s - (s - g.ratio));
  }
};

/// Per-request entry of the request table that every emitting thread reads.
struct RequestEntry {
  int32_t seq_len;
  uint32_t ragged_base;  // ragged id of the first extend token; entry B holds the total
  uint32_t row_c;        // first compress row of this request
  uint32_t row_w;        // first write row of this request
};

/// Lengths are valid for planning: 0 < extend_len <= seq_len, and seq_len fits the rows' int32 positions.
DSV4_HD bool valid_lengths(int64_t seq_len, int64_t extend_len) {
  return extend_len > 0 && extend_len <= seq_len && seq_len <= INT32_MAX;
}

/// State-row addressing. `Lookup` supplies rid = req_pool_indices[b] and, for the paged scheme,
/// the SWA slot of (rid, pos) (bounds-checked; -1 when out of range), reporting status bits.
template <typename Lookup>
DSV4_HD int32_t state_row(const Geometry& g, const Lookup& lookup, uint32_t batch_id, int64_t rid, int32_t pos) {
  switch (g.scheme) {
    case Scheme::kPagedSwa: {
      const int32_t swa = lookup.swa_slot(batch_id, rid, pos);  // narrowed to i32 (C-style, as the pools store it)
      return swa / g.swa_page_size * g.ring_size + swa % g.ring_size;
    }
    case Scheme::kRequestRing:
      return static_cast<int32_t>(rid * g.ring_size + pos % g.ring_size);
    default: {
      const int32_t r = static_cast<int32_t>(rid);
      const int32_t page = g.overlap ? r * 2 + ((pos / 4) & 1) : r;
      return page * g.ratio + pos % g.ratio;
    }
  }
}

template <typename Lookup>
DSV4_HD int32_t state_page(const Geometry& g, const Lookup& lookup, uint32_t batch_id, int64_t rid, int32_t pos) {
  return state_row(g, lookup, batch_id, rid, pos) / g.ratio;
}

/// The compress row of the event closing at `pos` (j = pos - prefix_len, rg its ragged id).
template <typename Lookup>
DSV4_HD CompressPlan compress_row(const Geometry& g, const Lookup& lookup, uint32_t batch_id, int32_t pos, int32_t j,
                                  uint32_t rg) {
  CompressPlan row;
  row.seq_len = static_cast<uint32_t>(pos + 1);
  row.ragged_id = static_cast<uint16_t>(rg);
  row.buffer_len = static_cast<uint16_t>(g.window - imin(j + 1, g.window));
  row.read_page_0 = -1;
  row.read_page_1 = static_cast<int32_t>(batch_id);
  // Without buffered slots the pages are never read, and the paged planners leave them as is.
  if (row.buffer_len > 0 || g.translate_all) {
    const int64_t rid = lookup.rid(batch_id);
    row.read_page_0 = state_page(g, lookup, batch_id, rid, imax(pos - g.ratio, 0));
    row.read_page_1 = state_page(g, lookup, batch_id, rid, pos);
  }
  return row;
}

/// Online (contract §3.8): the segment of the request's extend range that ends at `pos` (j = pos - prefix_len)
/// and starts at the later of the extend start and the 128-chunk start. It stores to the bank of
/// this step (rid + slot_offset) and merges with the committed one (rid).
template <typename Lookup>
DSV4_HD OnlinePlan segment_row(const Geometry& g, const Lookup& lookup, uint32_t batch_id, int32_t pos, int32_t j,
                               uint32_t rg) {
  const int64_t rid = lookup.rid(batch_id);
  return OnlinePlan{static_cast<uint32_t>(pos + 1), static_cast<uint16_t>(rg),
                    static_cast<uint16_t>(imin(j, pos % g.ratio) + 1), static_cast<int32_t>(rid + g.slot_offset),
                    static_cast<int32_t>(rid)};
}

/// The row types of a prefill plan (plan_c, plan_w): the ring planners' compress events and token
/// writes, or the online planner's segment rows in both (contract §2.5).
template <typename CompressRow, typename WriteRow>
struct PrefillRows {
  using Compress = CompressRow;
  using Write = WriteRow;
};
using RingPrefillRows = PrefillRows<CompressPlan, WritePlan>;
using OnlinePrefillRows = PrefillRows<OnlinePlan, OnlinePlan>;

/// Emit the rows of one extend token (ragged id rg, j-th token of request `batch_id`) into
/// plan_c / plan_w at their CPU-order indices; rows at or beyond the capacities are dropped.
/// OnlinePlan rows: online segments; CompressPlan and WritePlan rows: ring planners.
template <typename Lookup, typename CompressRow, typename WriteRow>
DSV4_HD int32_t emit_token(const Geometry& g, const Lookup& lookup, const Span& span, uint32_t batch_id,
                           const RequestEntry& req, int32_t j, CompressRow* plan_c, uint32_t cap_c,
                           WriteRow* plan_w, uint32_t cap_w) {
  constexpr bool kOnline = std::is_same_v<CompressRow, OnlinePlan>;
  static_assert(kOnline == std::is_same_v<WriteRow, OnlinePlan>, "online plans hold segment rows in both");
  const int32_t pos = span.prefix_len + j;
  const uint32_t rg = req.ragged_base + static_cast<uint32_t>(j);
  int32_t status = 0;
  if (span.is_event(g, pos)) {
    const uint32_t idx = req.row_c + static_cast<uint32_t>(span.events_before(g, pos + 1) - 1);
    if (idx < cap_c) {
      if constexpr (kOnline) {
        plan_c[idx] = segment_row(g, lookup, batch_id, pos, j, rg);
      } else {
        plan_c[idx] = compress_row(g, lookup, batch_id, pos, j, rg);
      }
    } else {
      status |= kTokensDropped;
    }
  }
  if (span.is_write(g, pos)) {
    const uint32_t idx = req.row_w + static_cast<uint32_t>(span.writes_before(g, pos));
    if (idx < cap_w) {
      if constexpr (kOnline) {
        plan_w[idx] = segment_row(g, lookup, batch_id, pos, j, rg);
      } else {
        plan_w[idx] = WritePlan{rg, state_row(g, lookup, batch_id, lookup.rid(batch_id), pos)};
      }
    } else {
      status |= kTokensDropped;
    }
  }
  return status;
}

/// The decode row of one request (contract §3.7).
template <typename Lookup>
DSV4_HD DecodePlan decode_row(const Geometry& g, const Lookup& lookup, uint32_t batch_id, int32_t seq_len) {
  const int64_t rid = lookup.rid(batch_id);
  if (g.scheme == Scheme::kOnline) {  // contract §3.8: the state row is loaded and stored in place
    const int32_t slot = static_cast<int32_t>(rid + g.slot_offset);
    return DecodePlan{static_cast<uint32_t>(seq_len), slot, slot, -1};
  }
  const int32_t p1 = seq_len - 1;
  const int32_t write_loc = state_row(g, lookup, batch_id, rid, p1);
  return DecodePlan{static_cast<uint32_t>(seq_len), write_loc,
                    state_page(g, lookup, batch_id, rid, imax(p1 - g.ratio, 0)), write_loc / g.ratio};
}

/// Table lookups shared by host and device: bounds-checked, reporting status bits and where.
struct Tables {
  const int64_t* req_pool_indices;
  const int32_t* req_to_token;  // [num_reqs, r2t_stride] (row stride in elements); may be null
  const int64_t* full_to_state;  // null where the scheme reads none
  int64_t r2t_rows;  // -1 without req_to_token: request slots must then only be >= 0
  int64_t r2t_cols;
  int64_t r2t_stride;
  int64_t f2s_len;
  int32_t* status;  // status bits (local to the calling thread; merged by the caller)
  uint64_t* first;  // lowest violation_key met among the `keyed` bits (likewise)
  int32_t keyed;    // the bits whose violations are reported (and so located)

  DSV4_HD void note(int32_t bit, uint32_t batch_id, int32_t pos) const {
    *status |= bit;
    const uint64_t key = violation_key(batch_id, pos);
    if ((bit & keyed) && key < *first) *first = key;
  }

  /// req_pool_indices[b], a row of req_to_token when there is one.
  DSV4_HD int64_t rid(uint32_t batch_id) const {
    const int64_t r = req_pool_indices[batch_id];
    if (r < 0 || (r2t_rows >= 0 && r >= r2t_rows)) note(kReqToTokenOutOfRange, batch_id, 0);
    return r;
  }

  DSV4_HD int32_t swa_slot(uint32_t batch_id, int64_t rid, int32_t pos) const {
    if (rid < 0 || rid >= r2t_rows || pos < 0 || pos >= r2t_cols) {
      note(kReqToTokenOutOfRange, batch_id, pos);
      return -1;
    }
    const int32_t full = req_to_token[rid * r2t_stride + pos];
    if (full < 0 || full >= f2s_len) {
      note(kFullToStateOutOfRange, batch_id, pos);
      return -1;
    }
    const int32_t swa = static_cast<int32_t>(full_to_state[full]);
    if (swa < 0) note(kNegativeStateSlot, batch_id, pos);
    return swa;
  }
};

}  // namespace dsv4::plan
