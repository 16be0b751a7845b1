// The sm90a backward kernel entry and its launch: one CTA of two warpgroups per (key tile, KV
// head, batch), or in deterministic mode key_splits CTAs per (KV head, batch) that share out the
// key tiles.
#pragma once

#include <cuda_runtime.h>

#include "kernels/common/backward_grid.h"
#include "kernels/params.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_q_do_loads.h"
#include "kernels/sm90/tma_rows.h"

namespace flash_dmattn::kernels::sm90 {

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    backward_kernel(const __grid_constant__ BackwardKernelParams<Traits> params) {
  // 1024-byte alignment: the period of the widest shared-memory swizzle that wgmma reads.
  extern __shared__ __align__(1024) char smem[];
  QdOStages<Traits> q_do_stages(params, BackwardSmem<Traits>(smem).q_do_loaded);
  q_do_stages.init();  // the first key tile's barrier makes it visible before any load
  for_each_key_tile<Traits::kBlockN>(params.p, [&](int n_block, int kv_head, int batch, int split) CUTLASS_LAMBDA_FUNC_INLINE {
    backward_key_tile<Traits>(params.p, q_do_stages, smem, n_block, kv_head, batch, split);
  });
}

template <typename Element, int kHeadDim>
cudaError_t run_backward(const BackwardParams& params, cudaStream_t stream) {
  using Traits = BackwardTraits<Element, kHeadDim>;
  const ForwardParams& f = params.fwd;
  TmaOperand q{f.q, f.seqlen_q, f.heads, f.q_row_stride, f.q_head_stride, f.q_batch_stride};
  TmaOperand dout{params.dout, f.seqlen_q, f.heads, params.dout_row_stride, params.dout_head_stride,
                  params.dout_batch_stride};
  for (TmaOperand* t : {&q, &dout}) pack_unit_strides(*t, f.head_dim, f.batch);
  BackwardKernelParams<Traits> args{params, {}, {}, tma_addressable(q) && tma_addressable(dout)};
  if (args.tma) {
    using SmemStage = decltype(cute::take<0, 2>(typename Traits::SmemLayoutQ{}));
    args.q = make_tma_rows<Element, SmemStage, Traits::kBlockM, kHeadDim>(q, f.head_dim, f.batch);
    args.dout = make_tma_rows<Element, SmemStage, Traits::kBlockM, kHeadDim>(dout, f.head_dim, f.batch);
  }
  return launch_backward<Traits>(&backward_kernel<Traits>, args, params, stream);
}

}  // namespace flash_dmattn::kernels::sm90
