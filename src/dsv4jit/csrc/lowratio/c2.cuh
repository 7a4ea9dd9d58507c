// c2_decode_norm_rope_store and c2_prefill_norm_rope_store (contract §10.4): the ratio-2 compressor.
// Positions pair as (2k, 2k + 1); the odd row closes its pair: it pools with its partner (position
// p - 1), and the pair's latent is stored at raw_out_loc >> 1 (page 128 in serving) with RoPE at
// p - 1. A partner that is not the row before it in the batch comes from the pair ring kv_state, one
// | kv | score | row per (request slot, position mod ring_size). Rows with raw_out_loc 0 are padding.
//
//   decode / verify   a block per row; an even row parks its input row in the ring; an odd row's
//                     partner is the row before it inside its block of draft_len rows, else the
//                     ring (ring_size > draft_len: no even row of a block overwrites a partner that
//                     the block's first row reads)
//   prefill           a block per row pools the odd rows whose partner is the row before them, and a
//                     block per request pools its first row if that row's partner is in the ring, then
//                     writes back the request's last min(len, ring_size) rows into the ring: after the
//                     one read this step makes of them, by the same threads (so one launch)
//
// Pooling, per channel: d = s_o - s_n, e = exp(-|d|) (fp64, rounded once), (w_o, w_n) = d > 0 ? (1, e)
// : (e, 1), pooled = (kv_o · w_o + kv_n · w_n) / (1 + e), each operation rounded once; the latent is
// the RMSNorm of bf(pooled) (row.cuh).
#pragma once

#include "common/async_copy.cuh"
#include "common/exact.cuh"
#include "common/pdl.cuh"
#include "entry.h"
#include "row.cuh"

namespace dsv4::lowratio {

/// The thread's kv and score dims of a | kv | score | row.
struct PairDims {
  Dims kv, score;
};

DSV4_DEV void load_pair(const float* row, const RowLane& t, PairDims& v) {
  const Vec<float, 4> kv = load_vec<4>(row + t.dim), sc = load_vec<4>(row + kHeadDim + t.dim);
#pragma unroll
  for (int c = 0; c < 4; ++c) v.kv[c] = kv[c], v.score[c] = sc[c];
}

/// Stores the thread's dims of a | kv | score | row (the same dims as load_pair: a thread that read a
/// ring row before writing it reads what was there).
DSV4_DEV void store_pair(float* row, const RowLane& t, const PairDims& v) {
  Vec<float, 4> kv, sc;
#pragma unroll
  for (int c = 0; c < 4; ++c) kv[c] = v.kv[c], sc[c] = v.score[c];
  store_vec(row + t.dim, kv);
  store_vec(row + kHeadDim + t.dim, sc);
}

/// The pooled pair (partner `o`, own `n`), in o.kv, rounded to bf16 (the latent's input). The 4 dims
/// run side by side: exp and the quotients without a branch each (common/exact.cuh).
DSV4_DEV void pool_pair(PairDims& o, const PairDims& n) {
  float d[4], neg[4], e[4], num[4], den[4], pooled[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) d[c] = __fsub_rn(o.score[c], n.score[c]), neg[c] = -fabsf(d[c]);
  exp_nonpositive(e, neg);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float w_o = d[c] > 0.0f ? 1.0f : e[c], w_n = d[c] > 0.0f ? e[c] : 1.0f;
    num[c] = __fadd_rn(__fmul_rn(o.kv[c], w_o), __fmul_rn(n.kv[c], w_n));
    den[c] = __fadd_rn(1.0f, e[c]);
  }
  unit_quotients(pooled, num, den);
#pragma unroll
  for (int c = 0; c < 4; ++c) o.kv[c] = to_f32(from_f32<bf16_t>(pooled[c]));
}

/// A row's request slot, position and full slot (raw_out_loc).
struct RowMeta {
  int64_t rid, position, raw;
};

DSV4_DEV RowMeta meta(const Params& p, uint64_t row) {
  return {p.req[row], entry(p.positions, p.pos64, row), entry(p.locs, p.loc64, row)};
}

/// The ring row of (rid, position), or -1 (reported) outside kv_state or for a negative position.
DSV4_DEV int64_t ring_row(const Params& p, int64_t rid, int64_t position) {
  if (position < 0) {
    report(p, kPositionOutOfRange);
    return -1;
  }
  const int64_t r = rid * p.ring_size + ring_slot(position, p.ring_size);
  if (rid < 0 || r >= p.ring_rows) {
    report(p, kRingRowOutOfRange);
    return -1;
  }
  return r;
}

DSV4_DEV const float* input_row(const Params& p, uint64_t row) { return static_cast<const float*>(p.kv) + row * kPairRow; }

/// Where a closing row's operands land, an entry per thread: its partner's dims and its RoPE pairs.
struct ClosingStage {
  Vec<float, 4> kv[kThreads], score[kThreads], rope[kThreads];
};

/// Pools odd row `row` (meta `m`, its own dims `n`) with its partner (at `partner`, or null: its dims
/// in `o`), writes its latent to out and stores it. Every thread of the block calls it. The operands
/// that the metadata locates (the partner's dims, the RoPE pairs) come as asynchronous copies that leave
/// together: as plain loads the compiler issued the partner's kv half and the RoPE row only after the
/// pooling's exp had waited for the score half, two more round trips. The pooling waits for the
/// partner; only the store waits for the RoPE pairs.
template <store::Format F>
DSV4_DEV void close_pair(const Params& p, uint32_t row, const RowLane& t, const RowMeta& m, const PairDims& n,
                         const float* partner, PairDims& o, const Dims& w, ClosingStage& stage,
                         double (&partials)[kChunks]) {
  const int i = threadIdx.x;  // each thread reads only the entries its own copies fill
  if (partner != nullptr) {
    cp_async<16>(&stage.kv[i], partner + t.dim);
    cp_async<16>(&stage.score[i], partner + kHeadDim + t.dim);
  }
  const float* rope = rope_pairs(p, t, m.position - 1);
  if (rope != nullptr) cp_async<16>(&stage.rope[i], rope);
  if (partner != nullptr) {
    cp_async_wait_all();
#pragma unroll
    for (int c = 0; c < 4; ++c) o.kv[c] = stage.kv[i][c], o.score[c] = stage.score[i][c];
  }
  pool_pair(o, n);
  normalize_latent(p, t, o.kv, w, partials);
  write_out(p, row, t, o.kv);
  const int64_t loc = m.raw >> 1;
  cp_async_wait_all();  // before any exit too: no copy lands after the block has left
  if (!storable(p, loc, m.position - 1)) return;
  store_latent<F>(p, t, loc, rope != nullptr ? stage.rope[i] : Vec<float, 4>{}, o.kv);
}

/// close_pair with the partner row at `partner` (its dims copied into a local).
template <store::Format F>
DSV4_DEV void close_pair_at(const Params& p, uint32_t row, const RowLane& t, const RowMeta& m, const PairDims& n,
                            const float* partner, const Dims& w, ClosingStage& stage, double (&partials)[kChunks]) {
  PairDims o;
  close_pair<F>(p, row, t, m, n, partner, o, w, stage, partials);
}

/// Before the upstream wait, after prefetch_row: the block's last thread reads the row's position (and
/// request) as hints and brings into L2 what the round trip after the metadata's reads for an odd row:
/// its RoPE row (position - 1) and, with `ring_partner`, its partner's ring row. A hint is a volatile
/// read, so that it is read again after the wait (never reused); a value the kernel before this one
/// is still writing costs a prefetch of the wrong lines, nothing else. (In c1 the same hint made single
/// decodes slower: its RoPE row is only needed by the store.)
template <bool kPDL>
DSV4_DEV void prefetch_closing(const Params& p, uint32_t row, bool ring_partner) {
  if (!kPDL || threadIdx.x != kThreads - 1) return;
  const int64_t position = p.pos64 ? static_cast<const volatile int64_t*>(p.positions)[row]
                                   : static_cast<const volatile int32_t*>(p.positions)[row];
  const int64_t rid = ring_partner ? static_cast<const volatile int64_t*>(p.req)[row] : 0;
  if (position % 2 == 0) return;  // an even row stores nothing and reads no ring row
  if (position - 1 >= 0 && position - 1 < p.s.max_pos) {
    prefetch_l2_bulk(p.s.freq + (position - 1) * store::kRopeDim, store::kRopeDim * sizeof(float));
  }
  if (ring_partner && position - 1 >= 0 && rid >= 0 && rid < p.ring_rows) {
    const int64_t r = rid * p.ring_size + ring_slot(position - 1, p.ring_size);  // ring_row, unreported
    if (r < p.ring_rows) prefetch_l2_bulk(p.ring + r * kPairRow, kPairRow * sizeof(float));
  }
}

/// Decode and target verify: a block per row.
template <store::Format F, bool kPDL>
__global__ __launch_bounds__(kThreads) void c2_decode_kernel(const __grid_constant__ Params p) {
  __shared__ double partials[kChunks];
  __shared__ ClosingStage stage;
  const RowLane t = RowLane::of_thread();
  const uint32_t row = blockIdx.x;
  const bool in_block = p.draft_len > 1 && row % p.draft_len != 0;
  prefetch_row<kPDL>(p, row, {input_row(p, row), in_block ? input_row(p, row - 1) : nullptr}, kPairRow * sizeof(float));
  prefetch_closing<kPDL>(p, row, !in_block);
  Dims w;
  load_weight(p, t, w);
  pdl_wait_upstream<kPDL>();
  const RowMeta m = meta(p, row);
  // Loaded beside the row's metadata: its own row (every row but a padded one needs it) and, inside a
  // verify block, the row before it, an odd row's partner, whose address needs no metadata (an even
  // row's load of it is spent)
  PairDims own, partner;
  load_pair(input_row(p, row), t, own);
  if (in_block) load_pair(input_row(p, row - 1), t, partner);
  pdl_launch_dependents<kPDL>();
  if (m.raw == 0) return;  // a padded row
  if (m.position % 2 == 0) {  // parks its row for the odd row of a later step (or of its block)
    const int64_t r = ring_row(p, m.rid, m.position);
    if (r >= 0) store_pair(p.ring + r * kPairRow, t, own);
    return;
  }
  if (in_block) {
    close_pair<F>(p, row, t, m, own, nullptr, partner, w, stage, partials);
    return;
  }
  const int64_t r = ring_row(p, m.rid, m.position - 1);
  // the ring partner's dims land in `partner`, unused on this path (close_pair_at's local compiles this
  // kernel to other code)
  if (r >= 0) close_pair<F>(p, row, t, m, own, p.ring + r * kPairRow, partner, w, stage, partials);
}

/// Whether the row before a row (`m`) is its partner: the same request, position - 1, not padding.
DSV4_DEV bool is_partner(const RowMeta& before, const RowMeta& m) {
  return before.raw != 0 && before.rid == m.rid && before.position == m.position - 1;
}

/// Whether some request's rows start at `row` (every thread of the block calls it).
DSV4_DEV bool starts_a_request(const Params& p, uint32_t row) {
  bool found = false;
  for (uint32_t i = threadIdx.x; i < p.num_reqs; i += kThreads) {
    found |= p.extend_len[i] > 0 && static_cast<uint32_t>(p.extend_start[i]) == row;
  }
  return __syncthreads_or(found) != 0;
}

/// Prefill: blocks [0, rows) a row each, then a block per request.
template <store::Format F, bool kPDL>
__global__ __launch_bounds__(kThreads) void c2_prefill_kernel(const __grid_constant__ Params p) {
  __shared__ double partials[kChunks];
  __shared__ ClosingStage stage;
  const RowLane t = RowLane::of_thread();
  Dims w;
  load_weight(p, t, w);
  pdl_wait_upstream<kPDL>();
  pdl_launch_dependents<kPDL>();
  if (blockIdx.x < p.rows) {
    const uint32_t row = blockIdx.x;
    const RowMeta m = meta(p, row);
    const RowMeta before = row > 0 ? meta(p, row - 1) : RowMeta{0, -1, 0};
    if (m.raw == 0 || m.position % 2 == 0) return;
    PairDims own;
    load_pair(input_row(p, row), t, own);
    if (is_partner(before, m)) {
      close_pair_at<F>(p, row, t, m, own, input_row(p, row - 1), w, stage, partials);
      return;
    }
    if (starts_a_request(p, row)) return;  // its request's block pools it before the write-back
    const int64_t r = ring_row(p, m.rid, m.position - 1);
    if (r >= 0) close_pair_at<F>(p, row, t, m, own, p.ring + r * kPairRow, w, stage, partials);
    return;
  }
  const uint32_t i = blockIdx.x - p.rows;
  const int64_t start = p.extend_start[i], len = p.extend_len[i];
  if (len <= 0 || start < 0 || start + len > p.rows) return;
  const RowMeta first = meta(p, start);
  const RowMeta before = start > 0 ? meta(p, start - 1) : RowMeta{0, -1, 0};
  if (first.raw != 0 && first.position % 2 == 1 && !is_partner(before, first)) {
    const int64_t r = ring_row(p, first.rid, first.position - 1);
    PairDims own;
    load_pair(input_row(p, start), t, own);
    if (r >= 0) close_pair_at<F>(p, start, t, first, own, p.ring + r * kPairRow, w, stage, partials);
  }
  for (int64_t k = len > p.ring_size ? len - p.ring_size : 0; k < len; ++k) {  // the write-back
    const RowMeta m = meta(p, start + k);
    if (m.raw == 0) continue;
    const int64_t r = ring_row(p, m.rid, m.position);
    if (r < 0) continue;
    PairDims v;
    load_pair(input_row(p, start + k), t, v);
    store_pair(p.ring + r * kPairRow, t, v);
  }
}

template <store::Format F, bool kPDL>
struct C2Entry {
  static_assert(!store::Layout<F>::kIndexer && F != store::Format::kV4Bf16 && F != store::Format::kV4TwoPool,
                "a latent cache: v4 (fp8) or a V4.1 layout");

  /// The checks decode and prefill share: kv_input [N, 1024] fp32, kv_state [ring rows, 1024] fp32, req
  /// [N] int64, ring_size > 0, and those of checked().
  static Params common(const char* op, Device& dev, const TensorView& kv_input, const TensorView& kv_state,
                       const TensorView& norm_weight, const TensorView& positions, const TensorView& req,
                       const TensorView& raw_out_loc, const TensorView& freqs_cis, const TensorView& k_cache,
                       const TensorView& out, const Optional<TensorView>& status, int64_t page_size,
                       int64_t ring_size, double eps) {
    Size rows{"num_tokens"}, ring_rows{"ring_rows"};
    Check(op, "kv_input", kv_input).shape({rows, kPairRow}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Params p = checked<F>(op, dev, rows, norm_weight, positions, raw_out_loc, "raw_out_loc", freqs_cis, k_cache, out,
                          status, page_size, eps);
    Check(op, "kv_state", kv_state).shape({ring_rows, kPairRow}).dtype(dl::kF32).cuda(dev).contiguous().aligned();
    Check(op, "req", req).shape({rows}).dtype(dl::kI64).cuda(dev).contiguous();
    expect(ring_size > 0, op, "ring_size", "> 0", ring_size);
    p.kv = kv_input.data_ptr();
    p.ring = static_cast<float*>(kv_state.data_ptr());
    p.req = static_cast<const int64_t*>(req.data_ptr());
    p.ring_rows = ring_rows.value;
    p.ring_size = static_cast<int32_t>(ring_size);
    return p;
  }

  static void decode(TensorView kv_input, TensorView kv_state, TensorView norm_weight, TensorView positions,
                     TensorView req, TensorView raw_out_loc, TensorView freqs_cis, TensorView k_cache, TensorView out,
                     Optional<TensorView> status, int64_t page_size, int64_t ring_size, int64_t draft_len, double eps) {
    const char* op = "c2_decode_norm_rope_store";
    Device dev;
    Params p = common(op, dev, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, out,
                      status, page_size, ring_size, eps);
    expect(draft_len >= 1, op, "draft_len", ">= 1", draft_len);
    if (draft_len > 1) {
      expect(p.rows % draft_len == 0, op, "kv_input", [&] {
        return "a whole number of blocks of draft_len (" + std::to_string(draft_len) + ") rows";
      }, p.rows);
      expect(ring_size > draft_len, op, "ring_size", [&] { return "> draft_len (" + std::to_string(draft_len) + ")"; },
             ring_size);
    }
    p.draft_len = static_cast<int32_t>(draft_len);
    if (p.rows == 0) return;
    launch(op, dev.dev, {p.rows, kThreads}, kPDL, c2_decode_kernel<F, kPDL>, p);
  }

  static void prefill(TensorView kv_input, TensorView kv_state, TensorView norm_weight, TensorView positions,
                      TensorView req, TensorView raw_out_loc, TensorView freqs_cis, TensorView k_cache,
                      TensorView extend_start_loc, TensorView extend_seq_lens, TensorView out,
                      Optional<TensorView> status, int64_t page_size, int64_t ring_size, double eps) {
    const char* op = "c2_prefill_norm_rope_store";
    Device dev;
    Params p = common(op, dev, kv_input, kv_state, norm_weight, positions, req, raw_out_loc, freqs_cis, k_cache, out,
                      status, page_size, ring_size, eps);
    Size reqs{"num_reqs"};
    Check(op, "extend_start_loc", extend_start_loc).shape({reqs}).dtype(dl::kI32).cuda(dev).contiguous();
    Check(op, "extend_seq_lens", extend_seq_lens).shape({reqs}).dtype(dl::kI32).cuda(dev).contiguous();
    p.extend_start = static_cast<const int32_t*>(extend_start_loc.data_ptr());
    p.extend_len = static_cast<const int32_t*>(extend_seq_lens.data_ptr());
    p.num_reqs = static_cast<uint32_t>(reqs.value);
    p.draft_len = 1;
    if (p.rows == 0) return;
    launch(op, dev.dev, {p.rows + p.num_reqs, kThreads}, kPDL, c2_prefill_kernel<F, kPDL>, p);
  }
};

}  // namespace dsv4::lowratio
