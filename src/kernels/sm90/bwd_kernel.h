// The sm90a backward kernel entries and their launch: one CTA of two warpgroups per (key tile, KV
// head, batch), or head_splits of them each walking a share of the KV head's query heads where the
// grid is small (BackwardParams::head_splits), or in deterministic mode key_splits CTAs per (KV
// head, batch) that share out the key tiles; where params.separate_dq, then the dQ kernel, one CTA
// per (query tile, query head, batch).
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/backward_grid.h"
#include "kernels/common/forward_grid.h"
#include "kernels/common/launch.h"
#include "kernels/common/sequences.h"
#include "kernels/params.h"
#include "kernels/sm90/bwd_dq_mainloop.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_q_do_loads.h"
#include "kernels/sm90/tma_operand.h"
#include "kernels/sm90/tma_rows.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Traits, Sequences kSequences>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    backward_kernel(const __grid_constant__ BackwardKernelParams<Traits> params) {
  // 1024-byte alignment: the period of the widest shared-memory swizzle that wgmma reads.
  extern __shared__ __align__(1024) char smem[];
  static_assert(kSequences == Sequences::batched || Traits::kSmemBytes + sizeof(BackwardParams) <= 227 * 1024,
                "a packed call's params (for_sequence_key_tile) and the tiles exceed a CTA's shared memory");
  QdOStages<Traits> q_do_stages(params, BackwardSmem<Traits>(smem).q_do_loaded);
  q_do_stages.init();  // the first key tile's barrier makes it visible before any load
  for_each_key_tile<Traits::kBlockN>(params.p, [&](int n_block, const WalkHeads& heads, int batch, int split) CUTLASS_LAMBDA_FUNC_INLINE {
    auto key_tile = [&](const BackwardParams& p) CUTLASS_LAMBDA_FUNC_INLINE {
      backward_key_tile<Traits>(p, q_do_stages, smem, n_block, heads, batch, split);
    };
    for_sequence_key_tile<kSequences, Traits::kBlockN>(params.p, batch, n_block, key_tile);
  });
}

template <typename Traits, Sequences kSequences>
__global__ void __launch_bounds__(Traits::kNThreads, 1) dq_kernel(const __grid_constant__ DqTmaParams<Traits> params) {
  extern __shared__ __align__(1024) char smem[];
  const ForwardCta cta = forward_cta(params.p.fwd, Traits::kBlockM);
  if constexpr (kSequences == Sequences::batched) {
    dq_tile<Traits>(params, params.p, smem, cta.m_block, cta.head, cta.batch);
  } else {
    // The grid covers the longest sequence's query tiles; a shorter one's CTAs past its rows return.
    const BackwardParams p = for_sequence(params.p, cta.batch);
    if (cta.m_block * Traits::kBlockM < p.fwd.seqlen_q) dq_tile<Traits>(params, p, smem, cta.m_block, cta.head, cta.batch);
  }
}

template <typename Element, int kHeadDim>
cudaError_t run_dq(const BackwardParams& params, cudaStream_t stream) {
  using Traits = DqTraits<Element, kHeadDim>;
  using SmemTile = decltype(cute::take<0, 2>(typename Traits::SmemLayoutK{}));
  const ForwardParams& f = params.fwd;
  const QkvOperands operands = qkv_operands(f);
  const TmaOperand dout = dout_operand(params);
  // The host plans separate_dq only where TMA can address all four (dq_in_own_kernel in cuda_backend.cpp).
  if (!operands.addressable() || !tma_addressable(dout)) return cudaErrorInvalidValue;
  const int batches = tma_batches(f);  // (packed sequences: one batch of all their rows)
  const DqTmaParams<Traits> args{
      params,
      make_tma_rows<Element, typename Traits::SmemLayoutQ, Traits::kBlockM, kHeadDim>(operands.q, f.head_dim, batches),
      make_tma_rows<Element, typename Traits::SmemLayoutQ, Traits::kBlockM, kHeadDim>(dout, f.head_dim, batches),
      make_tma_rows<Element, SmemTile, Traits::kBlockN, kHeadDim>(operands.k, f.head_dim, batches),
      make_tma_rows<Element, SmemTile, Traits::kBlockN, kHeadDim>(operands.v, f.head_dim, batches)};
  const auto kernel = f.cu_seqlens_q ? &dq_kernel<Traits, Sequences::packed> : &dq_kernel<Traits, Sequences::batched>;
  return launch_query_tiles<Traits::kSmemBytes>(kernel, args, f, Traits::kBlockM, Traits::kNThreads, stream);
}

// The key-tile kernel on the grid of one CTA per key tile (or key split).
template <typename Traits>
cudaError_t run_key_tiles(const BackwardParams& params, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  const ForwardParams& f = params.fwd;
  const TmaOperand q = qkv_operands(f).q, dout = dout_operand(params);
  BackwardKernelParams<Traits> args{params, {}, {}, tma_addressable(q) && tma_addressable(dout)};
  if (args.tma) {
    using SmemStage = decltype(cute::take<0, 2>(typename Traits::SmemLayoutQ{}));
    args.q = make_tma_rows<Element, SmemStage, Traits::kBlockM, kHeadDim>(q, f.head_dim, tma_batches(f));
    args.dout = make_tma_rows<Element, SmemStage, Traits::kBlockM, kHeadDim>(dout, f.head_dim, tma_batches(f));
  }
  const auto kernel = params.fwd.cu_seqlens_q ? &backward_kernel<Traits, Sequences::packed>
                                              : &backward_kernel<Traits, Sequences::batched>;
  return launch_backward<Traits>(kernel, args, params, stream);
}

template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  if constexpr (has_dq_kernel(kHeadDim)) {
    if (params.separate_dq) {
      const cudaError_t status = run_key_tiles<BackwardTraits<Element, kHeadDim, DqBy::dq_kernel>>(params, stream);
      if (status != cudaSuccess || params.fwd.seqlen_q == 0 || params.fwd.heads == 0) return status;
      return run_dq<Element, kHeadDim>(params, stream);
    }
  } else if (params.separate_dq) {
    return cudaErrorInvalidValue;  // the host plans separate_dq only where has_dq_kernel holds
  }
  return run_key_tiles<BackwardTraits<Element, kHeadDim>>(params, stream);
}

}  // namespace flash_dmattn::kernels::sm90
