// The older c4 entry points (contract §7) on the device code of the main c4 kernel: the same
// Window<4, hd> geometry and the same Kernels<4, hd, ...> slot loads, masking, reduction, output
// sink and state stores, and the same pooling; only the addressing differs. Two page modes, chosen
// by the presence of `extra`:
//
//   ring   (no extra): kv_score_buffer [num_indices, 8, 4·hd]; request indices[b] owns one 8-row
//          ring, position q at ring row q mod 8. Viewed as 4-row pages, the ring is the pair
//          2·index + {0, 1} and q lives on page 2·index + (q div 4) mod 2 (the legacy layout, contract §3.1).
//   paged  (extra):    kv_score_buffer [num_pages, 4, 4·hd]; explicit 4-row pages per request.
//          decode: indices[b] = page of the current block, extra[b] = page of the previous one;
//          prefill: extra[b] = PageBundle, indices[b] = the second write page.
//
// Prefill rows are the 16-byte PrefillPlan of contract §2.6 (compress rows and write rows alike) and the
// compressed row of an event goes to output row ragged_id. Unlike the older kernel, the masked
// overlap half of the first window (seq_len 4) is never loaded, every plan/page/index entry is
// range-checked before use (a bad row is skipped and reported in checked mode), and decode rows
// without a compress event are zero-filled (contract §9.3).
#pragma once

#include "common/status.cuh"
#include "compress/ring.cuh"

namespace dsv4::compat {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

/// One row of the older prefill plan (contract §2.6): a compress row or a write row.
struct alignas(16) LegacyPlanRow {
  uint32_t ragged_id;   // kInvalidU32 marks an invalid row
  uint32_t batch_id;
  uint32_t position;    // 0-based position of the token (compress: the window's closing token)
  uint32_t window_len;  // compress rows: leading window slots read from the state (< 8)

  DSV4_HD bool is_invalid() const { return ragged_id == kInvalidU32; }
};

/// Per-request pages of a paged prefill (contract §7.2), extra[b].
struct alignas(16) PageBundle {
  int32_t load_first_page;   // overlap half of a window that reads more than 4 buffered slots
  int32_t load_second_page;  // current half; also the overlap half when at most 4 slots are buffered
  int32_t write_first_page;  // writes at positions < last_position
  int32_t last_position;     // compared as an unsigned value, as the older kernel did
};

static_assert(sizeof(LegacyPlanRow) == 16 && sizeof(PageBundle) == 16);

/// Status bits for checked mode (the row is skipped).
enum StatusBit : int32_t {
  kPageOutOfRange = 1,       // an index / page entry outside kv_score_buffer
  kRaggedRowOutOfRange = 2,  // a ragged row outside kv_score_input
  kBatchOutOfRange = 4,      // a plan row's batch_id >= batch size
  kMalformedRow = 8,         // compress row with position % 4 != 3 or window_len >= 8; decode seq_len < 1
};

/// Checked mode's text of a status word (host only: the op raises it as ValueError).
inline tvm::ffi::String describe_status(int64_t word) {
  return status_text(word, {{kPageOutOfRange, "an indices / extra entry names a page outside kv_score_buffer"},
                            {kRaggedRowOutOfRange, "a plan row names a ragged row outside kv_score_input"},
                            {kBatchOutOfRange, "a plan row's batch_id is not below the batch size"},
                            {kMalformedRow, "a malformed row (compress position % 4 != 3 or window_len >= 8; "
                                            "decode seq_len < 1)"}});
}

struct Params {
  compress::Params base;  // state, input, ape, out, num_pages (4-row pages), num_input_rows, num_rows, status
  const int32_t* indices;
  const int32_t* seq_lens;    // decode
  const void* extra;          // decode: int32 [B] overlap pages; prefill: PageBundle [B]; ring mode: nullptr
  const LegacyPlanRow* plan;  // prefill: compress rows (pool pass) or write rows (write pass)
  uint32_t batch_size;
};

template <int kHeadDim, typename BufferT, typename InT, typename OutT, bool kPDL>
struct Kernels {
  using K = compress::Kernels<4, kHeadDim, BufferT, InT, OutT, kPDL>;
  using W = typename K::W;
  using Lane = typename K::Lane;
  static constexpr int C = W::kLaneChannels;
  static constexpr int kUnitsPerBlock = K::kUnitsPerBlock;
  static_assert(W::kSlotsPerWarp == W::kSlots, "one warp holds a whole c4 window");

  /// The 4-row pages of an event's window: slots 0-3 (overlap role) and 4-7 (current role).
  struct Pages {
    int64_t overlap;
    int64_t current;
  };

  /// Ring mode: the window closing at seq_len L (a multiple of 4) has its overlap block at ring
  /// rows (L mod 8) + 0..3 and its current block at the other half.
  static DSV4_DEV Pages ring_pages(int32_t index, uint32_t seq_len) {
    const int64_t base = int64_t{index} * 2;
    return {base + (seq_len / 4) % 2, base + (seq_len / 4 + 1) % 2};
  }

  static DSV4_DEV bool page_ok(const Params& p, int64_t page) { return page >= 0 && page < p.base.num_pages; }

  static DSV4_DEV void report(const Params& p, const Lane& lane, int32_t bit) {
    if (lane.channel == 0) report_status(p.base, bit);
  }

  /// Pools the window closing at seq_len into output row out_row: slots below buffer_len from the
  /// pages, the others from ragged rows first_ragged + s. Callers have range-checked every source.
  static DSV4_DEV void pool_window(const Params& p, const Lane& lane, uint32_t seq_len, uint32_t buffer_len,
                                   Pages pages, int64_t first_ragged, uint32_t out_row) {
    const compress::WindowSource src{first_ragged, static_cast<int32_t>(pages.overlap),
                                     static_cast<int32_t>(pages.current), buffer_len, seq_len};
    typename K::Bias bias;
    K::load_bias(p.base, lane, bias);
    float kv[W::kSlots][C], z[W::kSlots][C];
    K::template load_window<W::kSlots>(p.base, src, lane, bias, kv, z);
    pdl_launch_dependents<kPDL>();
    float v[C];
    const bool holds = K::template reduce_unit<1>(lane, kv, z, v);
    emit(p, lane, out_row, holds, v);
  }

  /// Stores this lane's channels of output row out_row through the main kernel's output sink.
  static DSV4_DEV void emit(const Params& p, const Lane& lane, uint32_t out_row, bool holds, const float (&v)[C]) {
    Lane at = lane;
    at.row = out_row;
    typename K::OutputRows sink{p.base};
    sink.emit(at, holds, v);
  }

  static DSV4_DEV void store_zero(const Params& p, const Lane& lane, uint32_t out_row) {
    float zero[C];
#pragma unroll
    for (int c = 0; c < C; ++c) zero[c] = 0.0f;
    emit(p, lane, out_row, true, zero);
  }

  /// Decode: store the current token at position seq_len - 1; at a boundary pool all 8 slots from
  /// the state (the token just stored included: this thread's own store, so its reload sees it).
  template <bool kPaged>
  static DSV4_DEV void decode(const Params& p) {
    const Lane lane = Lane::of(kUnitsPerBlock, 1);
    pdl_wait_upstream<kPDL>();  // indices / seq_lens / extra may come from the preceding kernel
    if (lane.row >= p.batch_size) return;
    const int32_t index = p.indices[lane.row];
    const int32_t seq_len = p.seq_lens[lane.row];
    const bool boundary = seq_len % 4 == 0;
    const uint32_t last = static_cast<uint32_t>(seq_len) - 1;  // position of the current token
    const int64_t write_page = kPaged ? int64_t{index} : int64_t{index} * 2 + (last / 4) % 2;
    Pages pages{0, write_page};
    if (boundary && seq_len > 4) {
      pages.overlap = kPaged ? int64_t{static_cast<const int32_t*>(p.extra)[lane.row]}
                             : ring_pages(index, static_cast<uint32_t>(seq_len)).overlap;
    }
    const int32_t bad = seq_len < 1 ? kMalformedRow
                        : !page_ok(p, write_page) || !page_ok(p, pages.overlap) ? kPageOutOfRange : 0;
    if (bad == 0) {
      K::store_token(p.base, static_cast<const InT*>(p.base.input) + uint64_t{lane.row} * W::kRowWidth,
                     write_page * 4 + last % 4, lane.channel);
      if (boundary) return pool_window(p, lane, static_cast<uint32_t>(seq_len), W::kSlots, pages, 0, lane.row);
    } else {
      report(p, lane, bad);
    }
    pdl_launch_dependents<kPDL>();
    store_zero(p, lane, lane.row);  // no event (or a skipped row): never leave the row uninitialised
  }

  /// Prefill pool pass: one unit per (compress row, 128-channel slice); reads the state as it was
  /// before this step's writes (the write pass is the next launch).
  template <bool kPaged>
  static DSV4_DEV void prefill_pool(const Params& p) {
    const Lane lane = Lane::of(kUnitsPerBlock, 1);
    pdl_wait_upstream<kPDL>();
    if (lane.row >= p.base.num_rows) return;
    const LegacyPlanRow row = p.plan[lane.row];
    if (row.is_invalid()) return;
    const uint32_t seq_len = row.position + 1;
    const bool first_window = seq_len == 4;
    // Slots [buffered_from, window_len) come from the state, [input_from, 8) from the input.
    const uint32_t buffered_from = first_window ? 4 : 0;
    const uint32_t input_from = row.window_len > buffered_from ? row.window_len : buffered_from;
    const int64_t first_ragged = int64_t{row.ragged_id} - (W::kSlots - 1);
    Pages pages{0, 0};
    int32_t bad = 0;
    if (row.batch_id >= p.batch_size) {
      bad = kBatchOutOfRange;
    } else if (row.window_len >= static_cast<uint32_t>(W::kSlots) || seq_len % 4 != 0) {
      bad = kMalformedRow;
    } else if (row.ragged_id >= p.base.num_input_rows || first_ragged + input_from < 0) {
      bad = kRaggedRowOutOfRange;
    } else {
      if constexpr (kPaged) {
        const PageBundle bundle = static_cast<const PageBundle*>(p.extra)[row.batch_id];
        pages.overlap = row.window_len <= 4 ? bundle.load_second_page : bundle.load_first_page;
        pages.current = bundle.load_second_page;
      } else {
        pages = ring_pages(p.indices[row.batch_id], seq_len);
      }
      const bool reads_overlap = !first_window && row.window_len > 0, reads_current = row.window_len > 4;
      if ((reads_overlap && !page_ok(p, pages.overlap)) || (reads_current && !page_ok(p, pages.current))) {
        bad = kPageOutOfRange;
      }
    }
    if (bad != 0) return report(p, lane, bad);
    pool_window(p, lane, seq_len, row.window_len, pages, first_ragged, row.ragged_id);
  }

  /// Prefill write pass: copy input row ragged_id into the state row of `position`.
  template <bool kPaged>
  static DSV4_DEV void prefill_write(const Params& p) {
    const Lane lane = Lane::of(kUnitsPerBlock, 1);
    pdl_wait_upstream<kPDL>();  // the pool pass must have read the state first
    if (lane.row >= p.base.num_rows) return;
    const LegacyPlanRow row = p.plan[lane.row];
    if (row.is_invalid()) return;
    if (row.batch_id >= p.batch_size) return report(p, lane, kBatchOutOfRange);
    if (row.ragged_id >= p.base.num_input_rows) return report(p, lane, kRaggedRowOutOfRange);
    const int32_t index = p.indices[row.batch_id];
    int64_t page;
    if constexpr (kPaged) {
      const PageBundle bundle = static_cast<const PageBundle*>(p.extra)[row.batch_id];
      page = row.position < static_cast<uint32_t>(bundle.last_position) ? bundle.write_first_page : index;
    } else {
      page = int64_t{index} * 2 + (row.position / 4) % 2;
    }
    if (!page_ok(p, page)) return report(p, lane, kPageOutOfRange);
    K::store_token(p.base, static_cast<const InT*>(p.base.input) + int64_t{row.ragged_id} * W::kRowWidth,
                   page * 4 + row.position % 4, lane.channel);
    pdl_launch_dependents<kPDL>();
  }
};

template <typename X, bool kPaged>
__global__ __launch_bounds__(X::K::kThreads) void decode_kernel(const __grid_constant__ Params p) {
  X::template decode<kPaged>(p);
}

template <typename X, bool kPaged>
__global__ __launch_bounds__(X::K::kThreads) void prefill_pool_kernel(const __grid_constant__ Params p) {
  X::template prefill_pool<kPaged>(p);
}

template <typename X, bool kPaged>
__global__ __launch_bounds__(X::K::kThreads) void prefill_write_kernel(const __grid_constant__ Params p) {
  X::template prefill_write<kPaged>(p);
}

/// Host entry points (the older run_decode / run_prefill argument order, plus the checked-mode
/// status word). Every tensor is checked before any launch.
template <int kHeadDim, typename BufferT, typename InT, typename OutT, bool kPDL>
struct CompatC4Entry {
  using X = Kernels<kHeadDim, BufferT, InT, OutT, kPDL>;
  using W = typename X::W;

  struct Checked {
    Params p{};
    Device dev;
  };

  /// The tensors both entry points share; `rows` binds the input/output rows (B or num_q_tokens).
  static Checked common(const char* op, const TensorView& state, const TensorView& input, const TensorView& out,
                        const TensorView& ape, const TensorView& indices, bool paged, Size& rows, Size& batch) {
    Checked c;
    Size slots{paged ? "num_pages" : "num_indices"};
    Check(op, "kv_score_buffer", state).shape({slots, paged ? 4 : 8, W::kRowWidth})
        .dtype(DTypeInfo<BufferT>::dtype).cuda(c.dev).contiguous().aligned();
    Check(op, "kv_score_input", input).shape({rows, W::kRowWidth}).dtype(DTypeInfo<InT>::dtype).cuda(c.dev)
        .contiguous().aligned();
    Check(op, "kv_compressed_output", out).shape({rows, kHeadDim}).dtype(DTypeInfo<OutT>::dtype).cuda(c.dev)
        .contiguous().aligned();
    Check(op, "ape", ape).shape({W::kSlots, kHeadDim}).dtype(DTypeInfo<InT>::dtype).cuda(c.dev).contiguous()
        .aligned();
    Check(op, "indices", indices).shape({batch}).dtype(dl::kI32).cuda(c.dev).contiguous().aligned(4);
    c.p.base.state = state.data_ptr();
    c.p.base.input = input.data_ptr();
    c.p.base.ape = ape.data_ptr();
    c.p.base.out = out.data_ptr();
    c.p.base.num_pages = slots.value * (paged ? 1 : 2);
    c.p.base.num_input_rows = rows.value;
    c.p.indices = static_cast<const int32_t*>(indices.data_ptr());
    c.p.batch_size = static_cast<uint32_t>(batch.value);
    return c;
  }

  static unsigned blocks(uint64_t rows) { return div_ceil(rows * W::kSlices, X::kUnitsPerBlock); }

  static void decode(TensorView kv_score_buffer, TensorView kv_score_input, TensorView kv_compressed_output,
                     TensorView ape, TensorView indices, TensorView seq_lens, Optional<TensorView> extra,
                     Optional<TensorView> status) {
    const char* op = "flash_c4_decode";
    const bool paged = extra.has_value();
    Size batch{"batch_size"};
    Checked c = common(op, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, paged, batch, batch);
    Check(op, "seq_lens", seq_lens).shape({batch}).dtype(dl::kI32).cuda(c.dev).contiguous().aligned(4);
    if (paged) {
      Check(op, "extra", extra.value()).shape({batch, 1}).dtype(dl::kI32).cuda(c.dev).contiguous().aligned(4);
      c.p.extra = extra.value().data_ptr();
    }
    c.p.base.status = status_words(op, c.dev, status);
    c.p.seq_lens = static_cast<const int32_t*>(seq_lens.data_ptr());
    c.p.base.num_rows = c.p.batch_size;
    const LaunchShape shape{blocks(c.p.batch_size), X::K::kThreads};
    launch(op, c.dev.dev, shape, kPDL, paged ? decode_kernel<X, true> : decode_kernel<X, false>, c.p);
  }

  static void prefill(TensorView kv_score_buffer, TensorView kv_score_input, TensorView kv_compressed_output,
                      TensorView ape, TensorView indices, TensorView compress_plan, TensorView write_plan,
                      Optional<TensorView> extra, Optional<TensorView> status) {
    const char* op = "flash_c4_prefill";
    const bool paged = extra.has_value();
    Size tokens{"num_q_tokens"}, batch{"batch_size"}, rows_c{"compress_rows"}, rows_w{"write_rows"};
    Checked c = common(op, kv_score_buffer, kv_score_input, kv_compressed_output, ape, indices, paged, tokens,
                       batch);
    constexpr int64_t kRowBytes = sizeof(LegacyPlanRow);
    Check(op, "compress_plan", compress_plan).shape({rows_c, kRowBytes}).dtype(dl::kU8).cuda(c.dev).contiguous()
        .aligned();
    Check(op, "write_plan", write_plan).shape({rows_w, kRowBytes}).dtype(dl::kU8).cuda(c.dev).contiguous()
        .aligned();
    if (paged) {
      Check(op, "extra", extra.value()).shape({batch, 4}).dtype(dl::kI32).cuda(c.dev).contiguous().aligned();
      c.p.extra = extra.value().data_ptr();
    }
    c.p.base.status = status_words(op, c.dev, status);
    expect(tokens.value >= batch.value, op, "kv_score_input",
           [&] { return "at least one row per request (batch_size " + std::to_string(batch.value) + ") rows"; },
           tokens.value);
    const auto at_most_tokens = [&] { return "at most num_q_tokens (" + std::to_string(tokens.value) + ") rows"; };
    expect(rows_c.value <= tokens.value, op, "compress_plan", at_most_tokens, rows_c.value);
    expect(rows_w.value <= tokens.value, op, "write_plan", at_most_tokens, rows_w.value);
    Params p = c.p;
    p.plan = static_cast<const LegacyPlanRow*>(compress_plan.data_ptr());
    p.base.num_rows = static_cast<uint32_t>(rows_c.value);
    launch(op, c.dev.dev, {blocks(p.base.num_rows), X::K::kThreads}, kPDL,
           paged ? prefill_pool_kernel<X, true> : prefill_pool_kernel<X, false>, p);
    p.plan = static_cast<const LegacyPlanRow*>(write_plan.data_ptr());
    p.base.num_rows = static_cast<uint32_t>(rows_w.value);
    launch(op, c.dev.dev, {blocks(p.base.num_rows), X::K::kThreads}, kPDL,
           paged ? prefill_write_kernel<X, true> : prefill_write_kernel<X, false>, p);
  }
};

}  // namespace dsv4::compat
