// compress_and_store: the compress kernels' window pooling with the norm/rope/quantize/store step
// applied to each pooled row inside the same kernel, so compressed rows never reach global memory.
// Same arithmetic as compress_forward (output dtype = input dtype) followed by
// compress_norm_rope_store: the caches and states are byte-identical to the two-step path. How a
// pooled row reaches the cache from the units of its channel slices: sinks.cuh.
//
// Prefill is the fused pool pass followed by the compressor's write pass in stream order: this
// step's state writes may alias rows that the pooling still reads (a request ring, an online state
// row). Where the plan says that the pool pass reads no state row (no request has a prefix), one
// grid runs both passes (Grid::kPoolAndWrite; the ring compressors only).
// Where one kernel measured slower than the two steps (ring c128 prefills, online prefills of few
// rows: ops/fused.py), the op asks for the two steps (one_kernel false) and passes a buffer for the
// compressed rows: the same checks, then the compressor's kernels and the store kernel. Ring c128
// prefills have no fused pass.
#pragma once

#include "compress/online.cuh"
#include "compress/ring.cuh"
#include "sinks.cuh"

namespace dsv4::fused {

using tvm::ffi::Optional;
using tvm::ffi::TensorView;

/// How a pool pass's grid covers its work: a block per unit (or per units_per_block units); the grid
/// of resident blocks (ring c128 decode: compress::ResidentDecode), a kernel of its own; or the pool
/// pass's blocks followed by the write pass's, for a prefill whose pool pass reads no state row.
enum class Grid { kPerUnit, kResident, kPoolAndWrite };

/// A pool pass with the store step as its sink. Pass: the compressor's parameters (Params),
/// the launch bounds and shape, the store step (Step) and pool(), the pass itself.
template <typename Pass, Grid kGrid = Grid::kPerUnit>
__global__ __launch_bounds__(Pass::kThreads, Pass::kMinBlocks) void pool_and_store_kernel(
    const __grid_constant__ Params<typename Pass::Params> p) {
  __shared__ typename Pass::Step::Shared sh;
  auto sink = Pass::Step::sink(p, sh);
  if constexpr (kGrid == Grid::kResident) {
    Pass::Compressor::Resident::run(p.c, sink);
  } else if constexpr (kGrid == Grid::kPoolAndWrite) {
    Pass::K::prefill_one_grid(p.c, blockIdx.x, [&](uint32_t block) { Pass::pool_block(p.c, sink, block); });
  } else {
    Pass::pool(p.c, sink);
  }
}

/// The ring compressor's passes (compress/ring.cuh): c4 and c128, prefill pool or decode. A c128 row
/// spans 8 slice units, blocks of their own (LastSliceStores).
template <int kRatio, typename BufferT, typename InT, store::Format F, bool kPDL, bool kDecode>
struct RingPass {
  static constexpr int kHeadDim = store::Layout<F>::kHeadDim;
  using Compressor = compress::CompressEntry<kRatio, kHeadDim, BufferT, InT, InT, kPDL>;
  using K = typename Compressor::K;
  using W = typename K::W;
  using Params = compress::Params;
  static constexpr bool kBlockUnits = W::kWarpsPerUnit > 1;
  static constexpr bool kDecodePass = kDecode;
  static constexpr bool kOneGridPrefill = true;  // the compressor's prefill_one_grid
  using Step = std::conditional_t<kBlockUnits, LastSliceStores<InT, F, kPDL, W::kSlices>,
                                  StoreStep<InT, F, K::C, W::kWarpsPerUnit, K::kUnitsPerBlock>>;
  static constexpr int kThreads = K::kThreads;
  // A c4 prefill warp's store tail holds its registers with no load in flight. For V4 rows (4
  // warps that exchange partials) 6 blocks per SM (80 registers, a few bytes of spills that the
  // serving-set build test bounds) keep more loads in flight than the compiler's 5 (86 registers),
  // which made large prefills faster; indexer rows (one warp each) measured slower with it.
  static constexpr int kMinBlocks = kRatio == 4 && !kDecode && kHeadDim == 512 ? 6 : K::kMinBlocks;

  /// The pass's grid: a decode's by the compressor's policy (CompressEntry::decode_launch), a block
  /// per kUnitsPerBlock units in prefill.
  static compress::DecodeLaunch grid(const char* op, DLDevice dev, uint32_t rows) {
    if constexpr (kDecode) return Compressor::decode_launch(op, dev, rows);
    return {false, Compressor::blocks(rows, K::kUnitsPerBlock), 0};
  }
  /// `p` as a block-per-unit grid takes it: with the compressor's prefetch a wave of blocks ahead
  /// (K::prefetch_unit) where the grid has one.
  template <typename P>
  static P ahead(P p, const compress::DecodeLaunch& grid) {
    p.c.ahead_rows = grid.ahead_rows;
    return p;
  }
  template <typename Sink>
  static DSV4_DEV void pool(const Params& c, Sink& sink) {
    pool_block(c, sink, blockIdx.x);
  }
  /// As block `block` of the pass (fused/layer.cuh runs two passes in one grid).
  template <typename Sink>
  static DSV4_DEV void pool_block(const Params& c, Sink& sink, uint32_t block) {
    const auto lane = K::Lane::of(K::kUnitsPerBlock, W::kWarpsPerUnit, block);
    if constexpr (kDecode) {
      K::decode(c, lane, sink);
    } else {
      K::prefill_pool(c, lane, sink);
    }
  }
};

/// Launches a pool pass over p.c.num_rows rows.
template <typename Pass>
struct PoolLaunch {
  using Compressor = typename Pass::Compressor;
  using Params = typename Pass::Params;
  static constexpr bool kBlockUnits = Pass::kBlockUnits;
  static constexpr bool kOneGridPrefill = Pass::kOneGridPrefill;
  template <typename P>
  static void run(const char* op, DLDevice dev, bool pdl, const P& p) {
    const compress::DecodeLaunch grid = Pass::grid(op, dev, p.c.num_rows);
    if constexpr (Pass::kBlockUnits && Pass::kDecodePass) {  // ring c128 decode
      if (grid.resident) {
        launch(op, dev, {grid.blocks, Pass::kThreads}, pdl, pool_and_store_kernel<Pass, Grid::kResident>, p);
        return;
      }
    }
    launch(op, dev, {grid.blocks, Pass::kThreads}, pdl, pool_and_store_kernel<Pass>, Pass::ahead(p, grid));
  }

  /// A prefill: the pool pass, then the compressor's write pass over `rows_w` plan_w rows; one grid
  /// where the pass has one (kOneGridPrefill: one-warp units), the plan's pool pass reads no state
  /// row and no graph captures the launch.
  template <typename P>
  static void run_prefill(const char* op, const Device& dev, bool pdl, P p, int64_t rows_w, bool reads_state) {
    if constexpr (Pass::kOneGridPrefill && !Pass::kBlockUnits) {
      if (!reads_state && !capturing(op, dev.dev)) {
        p.c.write_rows = static_cast<uint32_t>(rows_w);
        launch(op, dev.dev, {Compressor::K::one_grid_blocks(p.c.num_rows, rows_w), Pass::kThreads}, pdl,
               pool_and_store_kernel<Pass, Grid::kPoolAndWrite>, p);
        return;
      }
    }
    run(op, dev.dev, pdl, p);
    Compressor::launch_write(op, dev, Compressor::write_pass(p.c, rows_w));
  }
};

/// The online c128 compressor's passes (compress/online.cuh), head_dim 512: prefill pool or decode. A
/// prefill segment row spans 8 slice units, which one block pools in turn (below 129 rows the two
/// steps are faster: ops/fused.py).
template <typename BufferT, store::Format F, bool kPDL, bool kDecode>
struct OnlinePass {
  static constexpr int kHeadDim = 512;
  using Compressor = compress::online::OnlineEntry<kHeadDim, BufferT, kPDL>;
  using K = typename Compressor::K;
  using Params = compress::online::Params;
  static constexpr bool kBlockUnits = false;
  static constexpr bool kDecodePass = kDecode;
  static constexpr bool kOneGridPrefill = false;  // online prefills keep their two launches
  using Step = std::conditional_t<kDecode, StoreStep<float, F, K::kDecodeC, 1, K::kDecodeUnitsPerBlock>,
                                  StoreStep<float, F, 4, 1, kHeadDim / 128>>;
  static constexpr int kThreads = kDecode ? K::kDecodeThreads : K::kPrefillThreads;
  static constexpr int kMinBlocks = kDecode ? 0 : K::kPrefillMinBlocks;

  static compress::DecodeLaunch grid(const char*, DLDevice, uint32_t rows) {
    return {false, kDecode ? Compressor::decode_blocks(rows) : rows, 0};
  }
  template <typename P>
  static P ahead(P p, const compress::DecodeLaunch&) {
    return p;  // the online kernels prefetch nothing ahead
  }
  template <typename Sink>
  static DSV4_DEV void pool(const Params& c, Sink& sink) {
    using Lane = typename K::PrefillLane;
    if constexpr (kDecode) {
      K::decode(c, sink);
    } else {
      pool_slices_in_turn<Lane, kHeadDim, K::kPrefillC>(
          sink, [&](const Lane& lane, auto& gather) { K::template prefill<false, true>(c, lane, gather); });
    }
  }
};

/// The host entry point over a compressor's prefill and decode pass launchers: every tensor of both
/// steps is checked before any launch. The compressed rows take the store's dtype (InT). The op
/// chooses one fused kernel or the two steps (`one_kernel`; the rule: ops/fused.py), and passes the
/// buffers that path takes: the two steps a `rows` buffer [plan rows, hd] for the compressed rows (the
/// compressor's own kernels write it, then the store kernel reads it); one kernel of block units
/// (ring c128 decode) `rows` as the scratch of its slices and `row_counts`; other fused kernels
/// neither. Ring c128 prefills have no fused pass (the two steps measured faster).
template <typename PrefillPass, typename DecodePass, typename InT, store::Format F, bool kPDL, int kRatio>
struct EntryBase {
  using Compressor = typename PrefillPass::Compressor;
  using Store = store::NormRopeStoreEntry<InT, F, kPDL>;
  static constexpr const char* kOp = "compress_and_store";
  static constexpr bool kFusedPrefill = !PrefillPass::kBlockUnits;

  /// Fills the store half of `p` for the plan rows (`rows` of them).
  template <typename P>
  static void add_store(const char* op, P& p, Device& dev, Size& rows, const TensorView& plan,
                        const TensorView& norm_weight, const TensorView& freq, const TensorView& out_loc,
                        const TensorView& kvcache, const Optional<TensorView>& kvcache_rope, int64_t page_size,
                        bool is_decode, double eps, int64_t num_q_tokens) {
    p.s = Store::checked(op, rows, dev, plan, norm_weight, freq, out_loc, kvcache, kvcache_rope, nullptr, page_size,
                         kRatio, is_decode, eps, num_q_tokens);
  }

  /// Checks the buffers of the path `one_kernel` names (`rows` is checked as the compressor's output
  /// by the *_params functions) and fills the block units' scratch.
  template <typename P>
  static void check_path(const char* op, Device& dev, P& p, bool one_kernel, const TensorView* rows,
                         const Optional<TensorView>& row_counts) {
    constexpr bool kBlockUnits = DecodePass::kBlockUnits;
    if (!one_kernel || !kBlockUnits) {
      const char* why = one_kernel ? "None (a fused kernel writes no compressed rows)"
                                   : "a [plan rows, head_dim] buffer for the compressed rows (two steps)";
      expect((rows != nullptr) != one_kernel, op, "rows", why, rows != nullptr ? "a tensor" : "None");
      expect(!row_counts.has_value(), op, "row_counts", "None (ring c128 decodes in one kernel count rows)",
             "a tensor");
      return;
    }
    expect(rows != nullptr, op, "rows", "a [plan rows, head_dim] scratch buffer (ring c128 decode)", "None");
    expect(row_counts.has_value(), op, "row_counts", "one int32 counter per plan row (ring c128 decode)", "None");
    const TensorView& counts = row_counts.value();
    Check(op, "row_counts", counts).shape({Dim::any()}).dtype(dl::kI32).cuda(dev).contiguous();
    expect(counts.size(0) >= p.s.rows, op, "row_counts",
           [&] { return "one entry per plan row (" + std::to_string(p.s.rows) + ")"; }, counts.size(0));
    p.rows = rows->data_ptr();
    p.row_counts = static_cast<int32_t*>(counts.data_ptr());
  }

  /// Checked mode: the compress violations go to words[0], the store violations to words[1].
  template <typename P>
  static void attach_status(P& p, int32_t* words) {
    p.c.status = words;
    p.s.status = words ? words + 1 : nullptr;
  }

  /// Checks both steps of a prefill (`rows`: the compressed rows, or nullptr when fused), naming `op`.
  static Params<typename PrefillPass::Params> prefill_params(
      const char* op, Device& dev, Size& rows_w, const TensorView& kv_score_buffer, const TensorView& kv_score_input,
      const TensorView& ape, const TensorView& plan_c, const TensorView& plan_w, const TensorView* rows,
      const TensorView& norm_weight, const TensorView& freq, const TensorView& out_loc, const TensorView& kvcache,
      const Optional<TensorView>& kvcache_rope, int64_t page_size, double eps, int64_t num_q_tokens) {
    Size rows_c{"plan_c_rows"};
    Params<typename PrefillPass::Params> p{};
    p.c = Compressor::prefill_params(op, dev, kv_score_buffer, kv_score_input, ape, plan_c, plan_w, rows, nullptr,
                                     rows_c, rows_w);
    add_store(op, p, dev, rows_c, plan_c, norm_weight, freq, out_loc, kvcache, kvcache_rope, page_size, false, eps,
              num_q_tokens);
    if (rows != nullptr) p.s.kv = rows->data_ptr();
    return p;
  }

  /// Checks both steps of a decode (`rows` as in prefill_params).
  static Params<typename DecodePass::Params> decode_params(
      const char* op, Device& dev, const TensorView& kv_score_buffer, const TensorView& kv_score_input,
      const TensorView& ape, const TensorView& plan_d, const TensorView* rows, const TensorView& norm_weight,
      const TensorView& freq, const TensorView& out_loc, const TensorView& kvcache,
      const Optional<TensorView>& kvcache_rope, int64_t page_size, double eps) {
    Size batch{"batch_size"};
    Params<typename DecodePass::Params> p{};
    p.c = Compressor::decode_params(op, dev, kv_score_buffer, kv_score_input, ape, plan_d, rows, nullptr, batch);
    add_store(op, p, dev, batch, plan_d, norm_weight, freq, out_loc, kvcache, kvcache_rope, page_size, true, eps, -1);
    if (rows != nullptr) p.s.kv = rows->data_ptr();
    return p;
  }

  /// Whether plan_w is present as the phase says (a prefill's write rows; none in decode).
  static void check_phase(const char* op, bool is_decode, const Optional<TensorView>& plan_w) {
    expect(plan_w.has_value() != is_decode, op, "plan_w", is_decode ? "None in decode" : "a prefill's write rows",
           plan_w.has_value() ? "a tensor" : "None");
  }

  /// The one entry point of every fused module (bindings by name on the Python side). `reads_state`
  /// false: the plan's pool pass reads no state row, so a prefill's write pass may share its grid.
  static void run(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView plan_rows,
                  Optional<TensorView> plan_w, TensorView norm_weight, TensorView freq, TensorView out_loc,
                  TensorView kvcache, Optional<TensorView> kvcache_rope, Optional<TensorView> status, int64_t page_size,
                  double norm_eps,
                  int64_t num_q_tokens, bool is_decode, bool reads_state, bool one_kernel, Optional<TensorView> rows,
                  Optional<TensorView> row_counts) {
    Device dev;
    check_phase(kOp, is_decode, plan_w);
    const TensorView* buffer = rows.has_value() ? &rows.value() : nullptr;
    if (is_decode) {
      auto p = decode_params(kOp, dev, kv_score_buffer, kv_score_input, ape, plan_rows, buffer, norm_weight, freq,
                             out_loc, kvcache, kvcache_rope, page_size, norm_eps);
      check_path(kOp, dev, p, one_kernel, buffer, row_counts);
      attach_status(p, status_words(kOp, dev, status, 2));
      if (one_kernel) {
        DecodePass::run(kOp, dev.dev, kPDL, p);
      } else {
        Compressor::launch_decode(kOp, dev, p.c);
        Store::launch_store(kOp, dev, p.s);
      }
      return;
    }
    expect(kFusedPrefill || !one_kernel, kOp, "one_kernel", "false (ring c128 prefills run as two steps)", "true");
    Size rows_w{"plan_w_rows"};
    auto p = prefill_params(kOp, dev, rows_w, kv_score_buffer, kv_score_input, ape, plan_rows, plan_w.value(), buffer,
                            norm_weight, freq, out_loc, kvcache, kvcache_rope, page_size, norm_eps, num_q_tokens);
    check_path(kOp, dev, p, one_kernel, buffer, row_counts);
    attach_status(p, status_words(kOp, dev, status, 2));
    if constexpr (kFusedPrefill) {
      if (one_kernel) {
        PrefillPass::run_prefill(kOp, dev, kPDL, p, rows_w.value, reads_state);
        return;
      }
    }
    if constexpr (PrefillPass::kOneGridPrefill) {
      Compressor::launch_prefill(kOp, dev, p.c, rows_w.value, reads_state);
    } else {
      Compressor::launch_prefill(kOp, dev, p.c, rows_w.value);
    }
    Store::launch_store(kOp, dev, p.s);
  }
};

/// compress_and_store on the state ring (c4, c128).
template <int kRatio, typename BufferT, typename InT, store::Format F, bool kPDL>
struct CompressAndStoreEntry : EntryBase<PoolLaunch<RingPass<kRatio, BufferT, InT, F, kPDL, false>>,
                                         PoolLaunch<RingPass<kRatio, BufferT, InT, F, kPDL, true>>, InT, F, kPDL, kRatio> {};

/// compress_and_store(is_online=True): the online c128 state rows, fp32 rows, V4 formats.
template <typename BufferT, store::Format F, bool kPDL>
struct OnlineCompressAndStoreEntry : EntryBase<PoolLaunch<OnlinePass<BufferT, F, kPDL, false>>,
                                               PoolLaunch<OnlinePass<BufferT, F, kPDL, true>>, float, F, kPDL, 128> {};

}  // namespace dsv4::fused
