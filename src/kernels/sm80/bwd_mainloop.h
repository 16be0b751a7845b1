// The sm80 backward for one (key tile, KV head, batch): dK and dV of the tile stay in registers
// while the CTA walks, for each query head of the GQA group (or of its head split's share of
// it: WalkHeads), the query tiles that see a key of the tile. The loop body is the algorithm:
//   dP = dO·Vᵀ,  S = Q·Kᵀ  ->  z = softcap(scale·S) + bias, -inf where hidden  ->  P = exp(z - LSE)
//   dZ = P∘(dP - Δ) (-> dBias),  dS = dZ·(1 - tanh²)  ->  dV += Pᵀ·dO,  dQ += dS·K,  dK += dSᵀ·Q
// with P and dS passed through shared memory in the input dtype, and the next query tile's Q and
// dO loaded by cp.async behind the math. scale is applied to dQ and dK once, at the end.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/backward_grid.h"
#include "kernels/common/backward_loads.h"
#include "kernels/common/backward_scores.h"
#include "kernels/common/bias_grad.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/gradient_stores.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm80/bwd_fragments.h"
#include "kernels/sm80/bwd_traits.h"
#include "kernels/sm80/gemm.h"

namespace flash_dmattn::kernels::sm80 {

template <typename Traits>
__device__ __forceinline__ void backward_key_tile(const BackwardParams& p, char* smem, int n_block,
                                                  const WalkHeads& heads, int b, int split) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kQElems = Traits::kQElems, kKVElems = Traits::kKVElems, kPdSElems = Traits::kPdSElems;
  constexpr int kStages = Traits::kStages;
  const ForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
  const int n_begin = n_block * kBlockN, kv_h = heads.kv_head;

  // Shared memory: Q and dO (kStages each), K, V, P, dS, the dbias reduction buffer, dQ staging.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + kStages * kQElems, typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + kStages * kQElems, typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + kKVElems, typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + kKVElems, typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + kPdSElems, typename Traits::SmemLayoutPdS{});
  float* reduce = reinterpret_cast<float*>(raw_pointer_cast(sdS.data() + kPdSElems));
  constexpr bool kBulkDq = Traits::kStagedDq && kHasBulkReductions;
  StagedDqReduction<kBlockM, kHeadDim> staged_dq(reduce + Traits::kReduceFloats);

  // Global -> shared copies, with the (row, column) of every vector for predication.
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tdOsdO = gmem_thr.partition_D(sdO);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto load_q_do = [&](int head, int m_block, int stage) {
    copy_q_do_async<Element, kBlockM, kHeadDim>(p, b, head, m_block, gmem_thr,
                                                 at_stage(tQsQ, stage, kQElems), at_stage(tdOsdO, stage, kQElems), tQcQ);
  };

  // The three GEMMs' fragments and the shared -> register copies that feed them.
  auto fragments = backward_fragments<Traits>(tid, sQ, sdO, sK, sV, sP, sdS);
  FDMA_NAME_BACKWARD_FRAGMENTS(fragments);

  // The (row, col) of the thread's elements of S, as the accumulator's rows and columns.
  Tensor tScS_rc = make_tensor(tScS.data(), accumulator_as_rows_cols(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  BiasGradTile<kBlockM, kBlockN, Traits::kNThreads, RegisterColumnSums<kBlockN, kCols, Traits::kSdpWarpsM>> dbias(
      p, b, kv_h);

  // K and V of this tile, once. The barrier frees their buffers from a previous tile's readers.
  __syncthreads();
  copy_k_v_async<Element, kBlockN, kHeadDim>(p, b, kv_h, n_block, gmem_thr, gmem_thr.partition_D(sK),
                                             gmem_thr.partition_D(sV), tKVcKV);

  // With two stages, a query head's first tile loads into the stage its predecessor did not read last.
  int stage = 0;
  auto load_first = [&](int h, int m_block) CUTLASS_LAMBDA_FUNC_INLINE {
    load_q_do(h, m_block, stage);
    cp_async_fence();
  };
  for_each_query_tile<kBlockM, kBlockN>(p, b, heads, n_block, dbias, tScS_rc, reduce, load_first,
                                        [&](int h, int m_block, int next, bool elementwise) CUTLASS_LAMBDA_FUNC_INLINE {
    const int row0 = m_block * kBlockM;
    BackwardRowStats<kRows> stats;
    stats.load(p, b, h, row0, tScS_rc);

    cp_async_wait<0>();
    __syncthreads();  // Q and dO (and K, V) have landed; every warp is done with the last tile's buffers
    if constexpr (kBulkDq) staged_dq.issue();  // the last tile's dQ, staged before this barrier
    if constexpr (Traits::kStages == 2) {
      if (next >= 0) load_q_do(h, next, stage ^ 1);
      cp_async_fence();
    }

    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_smem_smem(acc_dp, tdPrdO, tdPrV, at_stage(tdPsdO, stage, kQElems), tdPsV, mma_sdp, copy_sdp_a, copy_sdp_b,
                   thr_sdp_a, thr_sdp_b);
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem_smem(acc_s, tSrQ, tSrK, at_stage(tSsQ, stage, kQElems), tSsK, mma_sdp, copy_sdp_a, copy_sdp_b, thr_sdp_a,
                   thr_sdp_b);

    // P = exp(z - LSE) replaces S, dS replaces dP; dBias reads dZ on the way.
    score_gradients<kBlockM, kBlockN>(p, b, h, row0, n_block, elementwise, stats, acc_s, acc_dp, tScS, dbias);
    Tensor p_values = convert_fragment<Element>(acc_s);
    Tensor ds_values = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_pds.retile_S(p_values), tPsP);
    copy(copy_pds, thr_pds.retile_S(ds_values), tdSsdS);
    if constexpr (kBulkDq) staged_dq.await_staging_read();
    __syncthreads();  // P and dS are in shared memory (and the dQ staging buffer is free)

    gemm_smem_smem(acc_dv, tdVrPt, tdVrdOt, tdVsPt, at_stage(tdVsdOt, stage, kQElems), mma_dkv, copy_dkv_a, copy_dkv_b,
                   thr_dkv_a, thr_dkv_b);

    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_dq);
    gemm_smem_smem(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_dq_a, copy_dq_b, thr_dq_a, thr_dq_b);
    if constexpr (kBulkDq) {
      staged_dq.stage(acc_dq, tdQcdQ, dq_accum_rows(p, b, h, split), row0, f.seqlen_q, f.head_dim);
    } else {
      accumulate_dq(acc_dq, tdQcdQ, dq_accum_rows(p, b, h, split), row0, f.seqlen_q, f.head_dim);
    }

    gemm_smem_smem(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, at_stage(tdKsQt, stage, kQElems), mma_dkv, copy_dkv_a, copy_dkv_b,
                   thr_dkv_a, thr_dkv_b);

    if constexpr (Traits::kStages == 1) {
      __syncthreads();  // every warp is done reading Q and dO
      if (next >= 0) load_q_do(h, next, 0);
      cp_async_fence();
    } else {
      stage ^= 1;
    }
  });

  cp_async_wait<0>();
  if constexpr (kBulkDq) {
    __syncthreads();  // the last tile's dQ is staged
    staged_dq.issue();
    staged_dq.drain();
  }
  store_dk_dv<Element>(p, b, heads, n_begin, acc_dk, acc_dv, tdKVcdKV);
}

}  // namespace flash_dmattn::kernels::sm80
