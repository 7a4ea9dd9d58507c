// compress_and_store_c4_layer: a c4 layer's two compressors — the core latent (head_dim 512, V4 cache)
// and the indexer keys (head_dim 128, indexer cache) — in one launch, over the layer's one plan.
// Each compressor is exactly its compress_and_store (fused/fused.cuh): same checks, same passes,
// same bytes; a grid runs both passes, blocks [0, blocks_core) the core's and the rest the
// indexer's, so a decode step is one launch per layer instead of two, and a prefill two (the
// fused pool-and-store passes, then the state-ring write passes) instead of four; one where the
// plan's pool passes read no state row (no request has a prefix): the write passes' blocks then
// follow the pool passes' in the same grid.
#pragma once

#include "fused.cuh"

namespace dsv4::fused {

/// Two passes of one grid: blocks [0, blocks_a) run pass A on `a`, the others pass B on `b`.
template <typename A, typename B>
struct PairParams {
  A a;
  B b;
  uint32_t blocks_a;
};

/// kWrites: a prefill whose pool passes read no state row; the blocks after both pool passes' run
/// pass B's write pass over p.b.c.write_rows rows, then pass A's, a write unit per warp.
template <typename PassA, typename PassB, bool kWrites = false>
__global__ __launch_bounds__(PassA::kThreads, PassA::kMinBlocks) void pair_pool_and_store_kernel(
    const __grid_constant__ PairParams<Params<typename PassA::Params>, Params<typename PassB::Params>> p) {
  static_assert(PassA::kThreads == PassB::kThreads && !PassA::kBlockUnits && !PassB::kBlockUnits,
                "the two passes share the block shape, one-warp units");
  __shared__ union {
    typename PassA::Step::Shared a;
    typename PassB::Step::Shared b;
  } sh;
  if (blockIdx.x < p.blocks_a) {
    typename PassA::Step::Sink sink{p.a.s, sh.a};
    PassA::pool_block(p.a.c, sink, blockIdx.x);
  } else if constexpr (kWrites) {
    // pass B's pool blocks, then its write blocks (prefill_one_grid), then pass A's write blocks
    using KB = typename PassB::K;
    const uint32_t block = blockIdx.x - p.blocks_a;
    const uint32_t b_blocks = KB::one_grid_blocks(p.b.c.num_rows, p.b.c.write_rows);
    if (block < b_blocks) {
      typename PassB::Step::Sink sink{p.b.s, sh.b};
      KB::prefill_one_grid(p.b.c, block, [&](uint32_t b) { PassB::pool_block(p.b.c, sink, b); });
    } else {
      using KA = typename PassA::K;
      auto w = p.a.c;
      w.num_rows = w.write_rows;
      KA::template prefill_write<KA::kWarpsPerBlock>(w, block - b_blocks);
    }
  } else {
    typename PassB::Step::Sink sink{p.b.s, sh.b};
    PassB::pool_block(p.b.c, sink, blockIdx.x - p.blocks_a);
  }
}

template <typename KA, typename KB>
__global__ __launch_bounds__(KA::kWriteUnitsPerBlock * kWarpSize) void pair_write_kernel(
    const __grid_constant__ PairParams<compress::Params, compress::Params> p) {
  static_assert(KA::kWriteUnitsPerBlock == KB::kWriteUnitsPerBlock, "the two passes share the block shape");
  if (blockIdx.x < p.blocks_a) {
    KA::prefill_write(p.a, blockIdx.x);
  } else {
    KB::prefill_write(p.b, blockIdx.x - p.blocks_a);
  }
}

/// The host entry point: the core's arguments, then the indexer's, then what the layer shares (the
/// plan, the rope table, the norm epsilon). Every tensor of both compressors is checked before any
/// launch; errors name the op as `compress_and_store_c4_layer[core]` or `[indexer]`.
template <typename BufferT, typename InT, store::Format FCore, store::Format FIndexer, bool kPDL>
struct C4LayerEntry {
  using Core = CompressAndStoreEntry<4, BufferT, InT, FCore, kPDL>;
  using Indexer = CompressAndStoreEntry<4, BufferT, InT, FIndexer, kPDL>;
  using CoreDecode = RingPass<4, BufferT, InT, FCore, kPDL, true>;
  using IndexerDecode = RingPass<4, BufferT, InT, FIndexer, kPDL, true>;
  using CorePrefill = RingPass<4, BufferT, InT, FCore, kPDL, false>;
  using IndexerPrefill = RingPass<4, BufferT, InT, FIndexer, kPDL, false>;
  static_assert(store::Layout<FCore>::kHeadDim == 512 && store::Layout<FIndexer>::kIndexer,
                "the core stores V4 rows, the indexer indexer rows");
  static constexpr const char* kOp = "compress_and_store_c4_layer";
  static constexpr const char* kCoreOp = "compress_and_store_c4_layer[core]";
  static constexpr const char* kIndexerOp = "compress_and_store_c4_layer[indexer]";

  static void run(TensorView kv_score_buffer, TensorView kv_score_input, TensorView ape, TensorView norm_weight,
                  TensorView out_loc, TensorView kvcache, Optional<TensorView> kvcache_rope, int64_t page_size,
                  TensorView indexer_kv_score_buffer,
                  TensorView indexer_kv_score_input, TensorView indexer_ape, TensorView indexer_norm_weight,
                  TensorView indexer_out_loc, TensorView indexer_kvcache, int64_t indexer_page_size,
                  TensorView plan_rows, Optional<TensorView> plan_w, TensorView freq, double norm_eps, int64_t num_q_tokens,
                  Optional<TensorView> status, bool is_decode, bool reads_state) {
    Device dev;
    Core::check_phase(kOp, is_decode, plan_w);
    if (is_decode) {
      auto core = Core::decode_params(kCoreOp, dev, kv_score_buffer, kv_score_input, ape, plan_rows, nullptr,
                                      norm_weight, freq, out_loc, kvcache, kvcache_rope, page_size, norm_eps);
      auto indexer = Indexer::decode_params(kIndexerOp, dev, indexer_kv_score_buffer, indexer_kv_score_input,
                                            indexer_ape, plan_rows, nullptr, indexer_norm_weight, freq,
                                            indexer_out_loc, indexer_kvcache, Optional<TensorView>(),
                                            indexer_page_size, norm_eps);
      attach(core, indexer, status_words(kOp, dev, status, 4));
      launch_pair<CoreDecode, IndexerDecode>(dev, core, indexer);
      return;
    }
    Size core_rows_w{"plan_w_rows"}, indexer_rows_w{"plan_w_rows"};
    auto core = Core::prefill_params(kCoreOp, dev, core_rows_w, kv_score_buffer, kv_score_input, ape, plan_rows,
                                     plan_w.value(), nullptr, norm_weight, freq, out_loc, kvcache, kvcache_rope,
                                     page_size, norm_eps, num_q_tokens);
    auto indexer = Indexer::prefill_params(kIndexerOp, dev, indexer_rows_w, indexer_kv_score_buffer,
                                           indexer_kv_score_input, indexer_ape, plan_rows, plan_w.value(), nullptr,
                                           indexer_norm_weight, freq, indexer_out_loc, indexer_kvcache,
                                           Optional<TensorView>(), indexer_page_size, norm_eps, num_q_tokens);
    attach(core, indexer, status_words(kOp, dev, status, 4));
    if (!reads_state && !capturing(kOp, dev.dev)) {
      launch_one_grid(dev, core, indexer, core_rows_w.value, indexer_rows_w.value);
      return;
    }
    launch_pair<CorePrefill, IndexerPrefill>(dev, core, indexer);
    // the write passes follow both pool passes: this step's ring writes may alias rows they read
    using KA = typename Core::Compressor::K;
    using KB = typename Indexer::Compressor::K;
    const PairParams<compress::Params, compress::Params> writes{
        Core::Compressor::write_pass(core.c, core_rows_w.value),
        Indexer::Compressor::write_pass(indexer.c, indexer_rows_w.value),
        Core::Compressor::write_blocks(core_rows_w.value)};
    launch(kOp, dev.dev,
           {writes.blocks_a + Indexer::Compressor::write_blocks(indexer_rows_w.value), KA::kWriteUnitsPerBlock * kWarpSize},
           kPDL, pair_write_kernel<KA, KB>, writes);
  }

  /// Checked mode: int32[4], the core's two words (compress, store), then the indexer's.
  template <typename P, typename Q>
  static void attach(P& core, Q& indexer, int32_t* words) {
    Core::attach_status(core, words);
    Indexer::attach_status(indexer, words ? words + 2 : nullptr);
  }

  /// A prefill whose pool passes read no state row: both pool passes and both write passes in one grid.
  template <typename P, typename Q>
  static void launch_one_grid(const Device& dev, P core, Q indexer, int64_t core_rows_w, int64_t indexer_rows_w) {
    using KA = typename CorePrefill::K;
    using KB = typename IndexerPrefill::K;
    core.c.write_rows = static_cast<uint32_t>(core_rows_w);
    indexer.c.write_rows = static_cast<uint32_t>(indexer_rows_w);
    const PairParams<P, Q> pair{core, indexer, KA::pool_blocks(core.c.num_rows)};
    // the core's pool blocks, the indexer's one grid (pool and write blocks), the core's write blocks
    const uint32_t blocks = KA::one_grid_blocks(core.c.num_rows, core_rows_w) +
                            KB::one_grid_blocks(indexer.c.num_rows, indexer_rows_w);
    launch(kOp, dev.dev, {blocks, CorePrefill::kThreads}, kPDL,
           pair_pool_and_store_kernel<CorePrefill, IndexerPrefill, true>, pair);
  }

  template <typename PassA, typename PassB, typename P, typename Q>
  static void launch_pair(const Device& dev, const P& a, const Q& b) {
    const compress::DecodeLaunch grid_a = PassA::grid(kOp, dev.dev, a.c.num_rows);
    const compress::DecodeLaunch grid_b = PassB::grid(kOp, dev.dev, b.c.num_rows);
    const PairParams<P, Q> pair{PassA::ahead(a, grid_a), PassB::ahead(b, grid_b), grid_a.blocks};
    launch(kOp, dev.dev, {grid_a.blocks + grid_b.blocks, PassA::kThreads}, kPDL,
           pair_pool_and_store_kernel<PassA, PassB>, pair);
  }
};

}  // namespace dsv4::fused
