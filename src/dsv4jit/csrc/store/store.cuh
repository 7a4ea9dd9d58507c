// compress_norm_rope_store (contract §6): RMSNorm -> RoPE on the trailing 64 dims (interleaved pairs,
// position seq_len - R) -> 128-point Hadamard (indexer) -> quantize -> paged cache store.
//
// The steps are the primitives of this folder, shared with the fused kernels (fused/fused.cuh):
// rows.cuh (which rows, where), rms.cuh (the canonical sum of squares, RMSNorm), rope.cuh,
// hadamard.cuh, v4_codec.cuh and indexer_codec.cuh (quantize and write), over the layouts of
// layout.cuh. Here one row store (load, select, normalize, rotate, check) runs the V4 or the
// indexer codec.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <type_traits>

#include "common/launch.cuh"
#include "common/pdl.cuh"
#include "common/tensor_check.h"
#include "common/types.cuh"
#include "common/vec.cuh"
#include "common/warp.cuh"
#include "indexer_codec.cuh"
#include "latent_codec.cuh"
#include "layout.cuh"
#include "params.cuh"
#include "rms.cuh"
#include "rope.cuh"
#include "rows.cuh"

namespace dsv4::store {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

/// Where a row store takes the norm weight, the rope row and the location from: the tensors and the
/// plan (FromGlobal), or copies in shared memory (PreloadedOperands) that a fused kernel brought in
/// while it pooled the row, with the selection and position that select() would find.
template <typename DType>
struct FromGlobal {
  DSV4_DEV const DType* weight(const Params& p) const { return static_cast<const DType*>(p.norm_weight); }
  DSV4_DEV const float* rope_row(const Params& p, int64_t position) const { return p.freq + position * kRopeDim; }
  template <int kLanes>
  DSV4_DEV bool select(const Params& p, uint32_t row, int64_t& loc, int64_t& position) const {
    return row < p.rows && store::select<kLanes>(p, row, loc, position);
  }
};

template <typename DType>
struct PreloadedOperands {
  const DType* weight_row;  // [hd]
  const float* freq;        // the position's rope row [kRopeDim], filled where position_ok()
  int64_t loc, position;
  bool selected;

  DSV4_DEV const DType* weight(const Params&) const { return weight_row; }
  DSV4_DEV const float* rope_row(const Params&, int64_t) const { return freq; }
  template <int kLanes>
  DSV4_DEV bool select(const Params&, uint32_t, int64_t& loc_out, int64_t& position_out) const {
    loc_out = loc, position_out = position;
    return selected;
  }
};

/// The store kernel for rows of format F on kLanes lanes each.
template <typename DType, Format F, bool kPDL, int kLanes>
struct Kernel {
  using L = Layout<F>;
  using R = RowLanes<kLanes>;
  static_assert(L::kIndexer ? kLanes == 4 || kLanes == 8 || kLanes == 16 || kLanes == kWarpSize
                            : kLanes == kWarpSize || kLanes == kBlockRowLanes,
                "latent rows take a warp (64-dim scale tiles are half-warps) or a block of 4; indexer rows 4, 8 or "
                "16 lanes");
  // Large batches: 8-lane rows in blocks of 8 warps (faster than 4 warps, and than 16 for fp8 and
  // fp4 decode); 4-lane rows in blocks of 4 (faster than 2, 3, 5, 6 or 8 warps): docs/design-notes.md.
  static constexpr int kWarps = kLanes == 8 ? 8 : kLanes == kBlockRowLanes ? kBlockRowLanes / kWarpSize : 4;
  // Rows on 16 lanes or more (indexer batches up to 2048 rows, latent rows) let the next kernel launch as
  // soon as this one has waited for its own predecessor: its blocks take free slots and wait there.
  // The 4- and 8-lane kernels (large indexer batches) let it launch before their writes: launched
  // early, the next kernel's blocks and table copies slowed the fp4 store down (docs/design-notes.md).
  static constexpr bool kEarlyDependents = kLanes >= 16;
  // fp4 rows on 8 lanes or fewer (large batches) code by table (Fp4CodeTable) in shared memory,
  // several instructions a value fewer than fp4_code() once the table is in (copying it in costs a
  // round trip, which small batches do not win back: docs/design-notes.md)
  static constexpr bool kFp4Table = F == Format::kIndexerFp4 && kLanes <= 8;
  static constexpr int kRowsPerBlock = kWarps * kWarpSize / kLanes;
  static constexpr int kGroups = L::kHeadDim / (4 * kLanes);  // 4-channel groups per lane

  /// Whether group g of some lane holds rope dims.
  static constexpr bool may_rope(int g) { return R::vlane(kLanes - 1, g) >= L::kRopeLane; }

  /// The store of lane j's part of plan row `row` (its kLanes lanes call it together), the steps
  /// every format shares around its codec: loads, selection, RMS scale, normalize and rotate, then
  /// `encode(x, j)` of the lane's normalized groups and, once the location is checked,
  /// `write(slot, j, codes)`. The weight, rope row and location come from `operands` (FromGlobal,
  /// or PreloadedOperands). The caller has waited for the kernels upstream.
  template <typename Operands, typename Encode, typename Write>
  static DSV4_DEV void store_row(const Params& p, uint32_t row, int j, const Operands& operands, Encode&& encode,
                                 Write&& write) {
    // The row and the weight do not depend on the plan: their loads go out first, in parallel
    // with the plan -> out_loc -> rope-table chain. Whole warps stay together to the end (their
    // reductions shuffle over the full mask): a row that is not stored runs along (rows past the
    // end on the last one) and skips its stores.
    const DType* x_row = static_cast<const DType*>(p.kv) + uint64_t{min(row, p.rows - 1)} * L::kHeadDim;
    const DType* w_row = operands.weight(p);
    Vec<DType, 4> xv[kGroups], wv[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      xv[g] = load_vec<4>(x_row + 4 * R::vlane(j, g));
      wv[g] = load_vec<4>(w_row + 4 * R::vlane(j, g));
    }
    // The location and the rope-table row depend on the plan row only: both loads go out as soon
    // as it is in, and the RMS scale runs while they are in flight.
    int64_t loc = 0, position = 0;
    const bool selected = operands.template select<kLanes>(p, row, loc, position);
    if (!__any_sync(kFullMask, selected)) return;
    const float* rope_row = operands.rope_row(p, position);
    float f[kGroups][4] = {};
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int v = R::vlane(j, g);
      if (may_rope(g) && v >= L::kRopeLane && selected && position_ok(p, position)) {
        const Vec<float, 4> fv = load_vec<4>(rope_row + 4 * (v - L::kRopeLane));
#pragma unroll
        for (int c = 0; c < 4; ++c) f[g][c] = fv[c];
      }
    }
    float x[kGroups][4], w[kGroups][4];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int c = 0; c < 4; ++c) x[g][c] = to_f32(xv[g][c]), w[g][c] = to_f32(wv[g][c]);
    }
    const float r = rms_scale<F>(p, sum_squares<kLanes>(x));
#pragma unroll
    for (int g = 0; g < kGroups; ++g) normalize_group<F, DType>(R::vlane(j, g), x[g], w[g], r, f[g]);
    const auto codes = encode(x, j);
    // Only the writes need the location: the check waits for it last.
    if constexpr (kLanes >= kWarpSize) {  // a row per warp or block: selected, as the warp is still here
      if (check<kLanes>(p, loc, position)) write(slot_at<F>(p, loc), j, codes);
    } else {
      const bool stored = selected && check<kLanes>(p, loc, position);
      if (!__any_sync(kFullMask, stored)) return;
      if constexpr (!kEarlyDependents) pdl_launch_dependents<kPDL>();
      if (stored) write(slot_at<F>(p, loc), j, codes);
    }
  }

  /// A latent row's codes: its 128-channel chunks, encoded.
  struct LatentChunks {
    decltype(encode_latent<F, true>(0, std::declval<const float (&)[4]>())) chunk[kGroups];
  };

  /// A latent row (lane j of a warp, or thread j of a block row): each 128-channel chunk coded by its
  /// format (latent_codec.cuh), a chunk being a warp's. Also the ring c128 fused kernels' store of a
  /// row (fused/sinks.cuh), with operands they preloaded.
  template <typename Operands = FromGlobal<DType>>
  static DSV4_DEV void store_latent_row(const Params& p, uint32_t row, int j, const Operands& operands = {}) {
    store_row(
        p, row, j, operands,
        [](float (&x)[kGroups][4], int j) {
          LatentChunks out;
#pragma unroll
          for (int g = 0; g < kGroups; ++g) out.chunk[g] = encode_latent<F, true>(4 * R::vlane(j, g), x[g]);
          return out;
        },
        [](const Slot& slot, int j, const LatentChunks& codes) {
#pragma unroll
          for (int g = 0; g < kGroups; ++g) write_latent<F>(slot, 4 * R::vlane(j, g), codes.chunk[g]);
        });
  }

  /// An indexer row (several a warp): its Hadamard transform, coded (`fp4`: the e2m1 codec).
  template <typename Fp4Codec>
  static DSV4_DEV void store_indexer_row(const Params& p, uint32_t row, int j, const Fp4Codec& fp4) {
    store_row(
        p, row, j, FromGlobal<DType>{},
        [&](float (&x)[kGroups][4], int j) { return encode_indexer<F, kLanes>(x, j, fp4); },
        [](const Slot& slot, int j, const IndexerCodes<kLanes>& codes) { write_indexer<F, kLanes>(slot, j, codes); });
  }

  /// Lane threadIdx.x % kLanes of row blockIdx.x·kRowsPerBlock + threadIdx.x / kLanes.
  static DSV4_DEV void run(const Params& p) {
    const int j = threadIdx.x % kLanes;
    const uint32_t row = blockIdx.x * kRowsPerBlock + threadIdx.x / kLanes;
    if constexpr (L::kIndexer) {
      __shared__ std::conditional_t<kFp4Table, Fp4WarpTable, Fp4ByRule> fp4_codecs[kFp4Table ? kWarps : 1];
      auto& fp4 = fp4_codecs[kFp4Table ? threadIdx.x / kWarpSize : 0];
      fp4.fill();  // the table copy overlaps the wait for upstream
      wait_upstream();
      store_indexer_row(p, row, j, fp4);
      fp4.wait();  // no copy lands after its warp has left, also when the warp coded nothing
    } else {
      wait_upstream();
      store_latent_row(p, row, j);
    }
  }

  static DSV4_DEV void wait_upstream() {
    pdl_wait_upstream<kPDL>();
    if constexpr (kEarlyDependents) pdl_launch_dependents<kPDL>();
  }
};

template <typename K>
__global__ __launch_bounds__(K::kWarps * kWarpSize) void store_kernel(const __grid_constant__ Params p) {
  K::run(p);
}

template <typename DType, Format F, bool kPDL>
struct NormRopeStoreEntry {
  using L = Layout<F>;

  /// Large indexer batches: rows on fewer lanes (each row's scalar work — plan, location, RMS
  /// scale — and its cross-lane steps shared by fewer threads): fp8 on 8 (4 measured slower: its
  /// 4-byte code words make half-sector stores), fp4 on 4 with codes by table (faster than 8, with
  /// fewer instructions a row). Below, 16 lanes keep per-thread chains short (measured faster
  /// there). The figures: docs/design-notes.md.
  static constexpr uint32_t kLargeBatchRows = 2048;
  /// Rows of the V4.1 fp4 layouts, up to this many, take a block each (a warp per chunk): a small
  /// batch leaves most of the GPU idle and its time is one row's chain, whose fp4 coding is a quarter
  /// as long there (0.6-0.8 µs faster at 16 and 256 rows). The fp8 formats' shorter chain gained
  /// nothing, and larger batches keep a row per warp, whose plan, location and scalar steps are not
  /// repeated by 4 warps (docs/design-notes.md).
  static constexpr uint32_t kBlockRowsMax = 1024;

  template <int kLanes>
  static void launch_rows(const char* op, const Device& dev, const Params& p) {
    using K = Kernel<DType, F, kPDL, kLanes>;
    launch(op, dev.dev, {div_ceil(p.rows, K::kRowsPerBlock), K::kWarps * kWarpSize}, kPDL, store_kernel<K>, p);
  }

  /// Checks the plan rows (`rows` of them) and every store operand, and fills the parameters
  /// (kv excluded): the fused compress-and-store kernel shares this with run().
  static Params checked(const char* op, Size& rows, Device& dev, TensorView plan, TensorView norm_weight,
                        TensorView freq, TensorView out_loc, TensorView kvcache, const Optional<TensorView>& kvcache_rope,
                        int32_t* status, int64_t page_size, int64_t compress_ratio, bool is_decode, double eps,
                        int64_t num_q_tokens) {
    Size pages{"num_pages"}, max_pos{"max_pos"}, locs{"out_loc_len"};
    expect(compress_ratio == 4 || compress_ratio == 128, op, "compress_ratio", "4 or 128", compress_ratio);
    expect(page_size > 0 && (page_size & (page_size - 1)) == 0, op, "page_size", "a power of two", page_size);
    const int64_t page_bytes = L::page_bytes(page_size);
    Check(op, "plan[1]", plan).shape({rows, 16}).dtype(dl::kU8).cuda(dev).contiguous().aligned();
    Check(op, "norm_weight", norm_weight).shape({L::kHeadDim}).dtype(DTypeInfo<DType>::dtype).cuda(dev).contiguous()
        .aligned();
    // torch's complex64 freqs_cis [max_pos, 32], or its fp32 view [max_pos, 64] of interleaved (cos, sin)
    const bool complex = same_dtype(freq.dtype(), dl::kC64);
    Check(op, "freq_cis", freq).dtype_in({dl::kC64, dl::kF32}).shape({max_pos, complex ? kRopeDim / 2 : kRopeDim})
        .cuda(dev).contiguous().aligned();
    Check(op, "out_loc", out_loc).shape({locs}).dtype_in({dl::kI32, dl::kI64}).cuda(dev).contiguous();
    Check(op, "kvcache", kvcache).shape({pages, page_bytes}).dtype(dl::kU8).cuda(dev).contiguous().aligned();
    if (is_decode) {
      expect(locs.value == rows.value, op, "out_loc", [&] { return "one entry per decode row (" +
                                                                   std::to_string(rows.value) + ")"; }, locs.value);
    } else if (num_q_tokens >= 0) {
      expect(locs.value >= num_q_tokens, op, "out_loc", [&] { return "at least num_q_tokens (" +
                                                                     std::to_string(num_q_tokens) + ") entries"; },
             locs.value);
    }
    Params p{};
    if constexpr (F == Format::kV4TwoPool) {
      expect(kvcache_rope.has_value(), op, "kvcache_rope", "a uint8 [num_pages * page_size, 128] pool of bf16 rope rows",
             "None");
      Size rope_rows{"rope_rows"};
      Check(op, "kvcache_rope", kvcache_rope.value()).shape({rope_rows, 2 * kRopeDim}).dtype(dl::kU8).cuda(dev)
          .contiguous().aligned();
      expect(rope_rows.value == pages.value * page_size, op, "kvcache_rope",
             [&] { return "one row per cache slot (num_pages * page_size = " + std::to_string(pages.value * page_size) +
                          ")"; }, rope_rows.value);
      p.rope_cache = static_cast<uint8_t*>(kvcache_rope.value().data_ptr());
    } else {
      expect(!kvcache_rope.has_value(), op, "kvcache_rope", "None (a rope pool is fp8_2buff's only)", "a tensor");
    }
    p.plan = plan.data_ptr();
    p.norm_weight = norm_weight.data_ptr();
    p.freq = static_cast<const float*>(freq.data_ptr());
    p.out_loc = out_loc.data_ptr();
    p.cache = static_cast<uint8_t*>(kvcache.data_ptr());
    p.status = status;
    p.page_bytes = page_bytes;
    p.num_locs = pages.value * page_size;
    p.out_loc_len = locs.value;
    p.max_pos = max_pos.value;
    p.rows = static_cast<uint32_t>(rows.value);
    p.log2_page_size = __builtin_ctzll(static_cast<uint64_t>(page_size));
    p.ratio = static_cast<int32_t>(compress_ratio);
    p.eps = static_cast<float>(eps);
    p.loc64 = same_dtype(out_loc.dtype(), dl::kI64);
    p.is_decode = is_decode;
    return p;
  }

  /// kv [rows, hd]; plan rows (CompressPlan in prefill, DecodePlan in decode); freq complex64 [max_pos, 32]
  /// or fp32 [max_pos, 64];
  /// out_loc int32/int64 (prefill: >= num_q_tokens entries, indexed by ragged id; decode: one per row);
  /// kvcache u8 [num_pages, page_bytes]; kvcache_rope (two pools only) u8 [num_pages · page_size, 128].
  static void run(TensorView kv, TensorView plan_rows, TensorView norm_weight, TensorView freq, TensorView out_loc,
                  TensorView kvcache, Optional<TensorView> kvcache_rope, Optional<TensorView> status,
                  int64_t page_size, int64_t compress_ratio, bool is_decode, double norm_eps, int64_t num_q_tokens) {
    const char* op = "compress_norm_rope_store";
    Size rows{"rows"};
    Device dev;
    Check(op, "kv", kv).shape({rows, L::kHeadDim}).dtype(DTypeInfo<DType>::dtype).cuda(dev).contiguous().aligned();
    Params p = checked(op, rows, dev, plan_rows, norm_weight, freq, out_loc, kvcache, kvcache_rope,
                       status_words(op, dev, status), page_size, compress_ratio, is_decode, norm_eps, num_q_tokens);
    p.kv = kv.data_ptr();
    launch_store(op, dev, p);
  }

  /// The store kernel over checked parameters (checked(), then p.kv).
  static void launch_store(const char* op, const Device& dev, const Params& p) {
    if constexpr (!L::kIndexer) {
      if constexpr (L::kFp4Values) {
        if (p.rows <= kBlockRowsMax) return launch_rows<kBlockRowLanes>(op, dev, p);
      }
      launch_rows<kWarpSize>(op, dev, p);
    } else {
      if (p.rows > kLargeBatchRows) {
        if constexpr (F == Format::kIndexerFp4) {
          // rows on 4 lanes store 8-byte words: pages of 2+ tokens keep them aligned
          if (p.log2_page_size > 0) return launch_rows<4>(op, dev, p);
        }
        return launch_rows<8>(op, dev, p);
      }
      launch_rows<16>(op, dev, p);
    }
  }
};

}  // namespace dsv4::store
