// The sm80 forward kernel entry and its launch: one CTA per (query tile, head, batch, split).
// With GQA packing the head index is the KV head and a query tile holds packed rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/forward_grid.h"
#include "kernels/common/sequences.h"
#include "kernels/params.h"
#include "kernels/sm80/fwd_mainloop.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Traits, KeySource kSource, KvPipeline kPipeline = KvPipeline::two_phase>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kTile.ctas_per_sm) forward_kernel(const __grid_constant__ ForwardParams params) {
  extern __shared__ __align__(128) char smem[];
  // Launched early (StreamOrder::early): the mask summary or key lists before it, or the caller's
  // kernels, may still be writing what it reads.
  wait_for_previous_grid();
  let_next_grid_start();  // the split-KV combine
  if (!runs_chosen_path(params, kSource == KeySource::lists)) return;
  const ForwardCta cta = forward_cta(params, Traits::kBlockM);
  // The grid covers the longest sequence's query tiles; a shorter one's CTAs past its rows return.
  const ForwardParams p = for_sequence(params, cta.batch);
  if (cta.m_block * Traits::kBlockM >= p.seqlen_q * p.pack_group) return;
  forward_tile<Traits, kSource, kPipeline>(p, smem, cta.m_block, cta.head, cta.batch, cta.split);
}

template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream) {
  using Traits = ForwardTraits<Element, kHeadDim>;
  // The sm80 loop packs a KV head's whole group or nothing (fwd_mainloop.h's kv_h).
  if (params.pack_group != 1 && params.pack_group != params.heads / params.kv_heads) return cudaErrorInvalidValue;
  // The gather path is a kernel of its own, so that its code does not weigh on the tile path's.
  if (!params.lists.keys) {
    // A decode's packed rows fill one warp's 16-row slab at most: the ring keeps its loads ahead.
    // KV caches run it at every Sq: only it reads pages (the host sets kv_pipeline, plan_forward).
    // Benchmark serving suite, D128 decodes with mask and bias, gpu ms, two-phase -> ring (H200s,
    // one run each): B1 H32/8 Sk 65536 0.091 -> 0.084, B64 Sk 4096 0.294 -> 0.253, B64 of 4k to
    // 32k keys 1.701 -> 1.403; Sk 1024 to 16384 unchanged (0.018 to 0.036).
    if constexpr (Traits::kHasSplitKeysRing) {
      if (params.kv_pipeline == KvPipeline::ring_split_keys) {
        // Its warps hold the one slab of packed rows (one warp's rows of the tile).
        constexpr int kSlabRows = Traits::kBlockM / Traits::kNWarps;
        if (std::int64_t(params.seqlen_q) * params.pack_group > kSlabRows) return cudaErrorInvalidValue;
        return launch_query_tiles<Traits::kRingSmemBytes>(
            &forward_kernel<Traits, KeySource::tiles, KvPipeline::ring_split_keys>, params, params, Traits::kBlockM,
            Traits::kNThreads, stream, StreamOrder::early);
      }
    }
    if constexpr (Traits::kHasRing) {
      if (params.kv_pipeline == KvPipeline::ring) {
        return launch_query_tiles<Traits::kRingSmemBytes>(&forward_kernel<Traits, KeySource::tiles, KvPipeline::ring>,
                                                          params, params, Traits::kBlockM, Traits::kNThreads, stream,
                                                          StreamOrder::early);
      }
    }
    if (params.kv_pipeline != KvPipeline::two_phase || params.seqlens_k != nullptr) return cudaErrorInvalidValue;
    return launch_forward<Traits>(&forward_kernel<Traits, KeySource::tiles>, params, stream, StreamOrder::early);
  }
  // Lists built for another tile would have their row bits read at the wrong places (and past
  // their end): the plan and this instantiation must agree.
  if (params.lists.block_m != Traits::kBlockM || params.lists.block_n != Traits::kBlockN) return cudaErrorInvalidValue;
  return launch_query_tiles<gather_smem_bytes<Traits>()>(&forward_kernel<Traits, KeySource::lists>, params, params,
                                                         Traits::kBlockM, Traits::kNThreads, stream, StreamOrder::early);
}

}  // namespace flash_dmattn::kernels::sm80
