// The sm90a forward kernel entries and their launch: one CTA per (query tile, query head, batch,
// split). Q, K and V that TMA can address go to the warp-specialized kernel; any others (strides
// or bases off 16 bytes) to the one whose threads load with cp.async. The gather path (key
// lists) has a warp-specialized kernel of its own (fwd_gather_warp_specialized.h), in
// translation units of its own (fwd_gather_instantiation.cu.in).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "kernels/common/forward_grid.h"
#include "kernels/common/launch.h"
#include "kernels/common/sequences.h"
#include "kernels/params.h"
#include "kernels/sm90/fwd_gather_warp_specialized.h"
#include "kernels/sm90/fwd_mainloop.h"
#include "kernels/sm90/fwd_warp_specialized.h"
#include "kernels/sm90/tma_rows.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) forward_kernel(const __grid_constant__ ForwardParams params) {
  // 1024-byte alignment: the period of the widest shared-memory swizzle that wgmma reads.
  extern __shared__ __align__(1024) char smem[];
  wait_for_previous_grid();  // launched early (StreamOrder::early): the summary or lists before it
  if (!runs_chosen_path(params, false)) return;
  const ForwardCta cta = forward_cta(params, Traits::kBlockM);
  // The grid covers the longest sequence's query tiles; a shorter one's CTAs past its rows return.
  const ForwardParams p = for_sequence(params, cta.batch);
  if (cta.m_block * Traits::kBlockM >= p.seqlen_q * p.pack_group) return;
  forward_tile<Traits>(p, smem, cta.m_block, cta.head, cta.batch, cta.split);
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    forward_tma_kernel(const __grid_constant__ ForwardTmaParams<Traits> params) {
  extern __shared__ __align__(1024) char smem[];
  wait_for_previous_grid();  // as forward_kernel
  if (!runs_chosen_path(params.p, false)) return;
  const ForwardCta cta = forward_cta(params.p, Traits::kBlockM);
  // As forward_kernel; TMA reads the sequence's rows from p.q_row0 and p.k_row0.
  const ForwardParams p = for_sequence(params.p, cta.batch);
  if (cta.m_block * Traits::kBlockM >= p.seqlen_q * p.pack_group) return;
  forward_tile_warp_specialized<Traits>(params, p, smem, cta.m_block, cta.head, cta.batch, cta.split);
}

// Whether the producer can bulk-copy a tile's bias values (see ForwardTmaParams::stage_bias): 16-bit
// values, one row shared by the query rows, every row and tile starting on 16 bytes.
inline bool stageable_bias(const BroadcastOperand& bias, int seqlen_k) {
  return bias.ptr && bias.type != ElementType::float32 && bias.row_stride == 0 && bias.col_stride == 1 &&
         reinterpret_cast<std::uintptr_t>(bias.ptr) % 16 == 0 && bias.head_stride % kTmaVector == 0 &&
         bias.batch_stride % kTmaVector == 0 && seqlen_k % kTmaVector == 0;
}

template <typename Element, int kHeadDim>
cudaError_t run_forward(const ForwardParams& params, cudaStream_t stream) {
  using namespace cute;
  const QkvOperands operands = qkv_operands(params);
  const bool tma = params.pack_group == 1 && operands.addressable();
  if (!tma) {
    using Traits = ForwardTraits<Element, kHeadDim, KvLoads::cp_async>;
    return launch_forward<Traits>(&forward_kernel<Traits>, params, stream, StreamOrder::early);
  }

  using Traits = ForwardTraits<Element, kHeadDim, KvLoads::tma_producer>;
  const ForwardTmaParams<Traits> tma_params{
      params,
      make_tma_rows<Element, typename Traits::SmemLayoutQ, Traits::kBlockM, kHeadDim>(operands.q, params.head_dim,
                                                                                      tma_batches(params)),
      make_tma_rows<Element, decltype(take<0, 2>(typename Traits::SmemLayoutK{})), Traits::kBlockN, kHeadDim>(
          operands.k, params.head_dim, tma_batches(params)),
      make_tma_rows<Element, decltype(take<0, 2>(typename Traits::SmemLayoutV{})), Traits::kBlockN, kHeadDim>(
          operands.v, params.head_dim, tma_batches(params)),
      stageable_bias(params.bias, params.seqlen_k)};
  return launch_query_tiles<Traits::kSmemBytes>(&forward_tma_kernel<Traits>, tma_params, params, Traits::kBlockM,
                                                 Traits::kNThreads, stream, StreamOrder::early);
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    forward_gather_kernel(const __grid_constant__ ForwardParams params) {
  extern __shared__ __align__(1024) char smem[];
  wait_for_previous_grid();  // as forward_kernel
  if (!runs_chosen_path(params, true)) return;
  const ForwardCta cta = forward_cta(params, Traits::kBlockM);
  forward_tile_gathered<Traits>(params, smem, cta.m_block, cta.head, cta.batch, cta.split);
}

// The gather path: params.lists holds the key lists of the kernel's tile; pack_group 2 runs two
// query heads per CTA (their lists of 64 rows), 1 one.
template <typename Traits>
cudaError_t launch_gather_forward(const ForwardParams& params, cudaStream_t stream) {
  // Lists built for another tile would have their row bits read at the wrong places.
  if (params.lists.block_m != Traits::kListRows || params.lists.block_n != Traits::kBlockN) return cudaErrorInvalidValue;
  if (Traits::kPackedHeads == 2 && !pairs_share_operands(params.lists, params.bias)) return cudaErrorInvalidValue;
  return launch_query_tiles<Traits::kSmemBytes>(&forward_gather_kernel<Traits>, params, params, Traits::kBlockM,
                                                Traits::kNThreads, stream, StreamOrder::early);
}

template <typename Element, int kHeadDim>
cudaError_t run_gather_forward(const ForwardParams& params, cudaStream_t stream) {
  if (params.pack_group == 1) return launch_gather_forward<GatherForwardTraits<Element, kHeadDim>>(params, stream);
  if (params.pack_group == 2) return launch_gather_forward<GatherForwardTraits<Element, kHeadDim, 2>>(params, stream);
  return cudaErrorInvalidValue;
}

}  // namespace flash_dmattn::kernels::sm90
