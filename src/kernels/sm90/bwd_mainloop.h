// The sm90a backward for one (key tile, KV head, batch): the sm80 algorithm with wgmma. dK and dV
// of the key tile stay in the registers of two warpgroups (split by key or by head-dim column,
// tile_size.h) while the CTA walks, for each query head of the GQA group (or of its head split's
// share of it: WalkHeads), the query tiles that see one of its keys:
//   S = Q·Kᵀ, dP = dO·Vᵀ  ->  P = exp(z - LSE), dZ = P∘(dP - Δ) (-> dBias), dS = dZ·(1 - tanh²)
//   ->  dV += Pᵀ·dO,  dK += dSᵀ·Q,  dQ = dS·K (reduced into the workspace, unless the dQ kernel
//       computes it: DqBy in tile_size.h)
// Every GEMM reads its operands from shared memory; P and dS get there in the input dtype. The
// next query tile's Q and dO load behind the math (TMA or cp.async, bwd_q_do_loads.h), into the
// other of two stages.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/backward_grid.h"
#include "kernels/common/backward_loads.h"
#include "kernels/common/backward_scores.h"
#include "kernels/common/bias_grad.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/gradient_stores.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm90/bias_grad_mma.h"
#include "kernels/sm90/bwd_q_do_loads.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// The shared-memory buffers, carved from `base` in this order: Q and dO (two stages each), K, V,
// P, dS, dZ (softcap with per-key dbias sums), the ones of the dbias MMA, the dbias reduction
// buffer, then the Q/dO stages' mbarriers. Every operand starts on a multiple of 1 KB, as its
// swizzle needs.
template <typename Traits>
struct BackwardSmem {
  using Element = typename Traits::Element;
  Element *q, *dout, *k, *v, *p, *ds, *dz, *ones;
  float* reduce;
  std::uint64_t* q_do_loaded;
  __device__ __forceinline__ explicit BackwardSmem(char* base)
      : q(reinterpret_cast<Element*>(base)), dout(q + Traits::kQElems), k(dout + Traits::kQElems),
        v(k + Traits::kKElems), p(v + Traits::kVElems), ds(p + Traits::kPdSElems), dz(ds + Traits::kPdSElems),
        ones(dz + Traits::kPdSElems), reduce(reinterpret_cast<float*>(ones + Traits::kOnesElems)),
        q_do_loaded(reinterpret_cast<std::uint64_t*>(base + Traits::kBarrierOffset)) {}
};

// `base` as something the compiler must take as new, so that the shared-memory addresses and
// wgmma descriptors derived from it are rebuilt (a few integer operations) where they are used.
// Built once before the loop, the descriptors of every operand and k-block stayed live across it
// and pushed dK and dV out of registers: 7.0 KB of spill stores at D = 128 (ptxas), 4.9 KB this way.
__device__ __forceinline__ char* opaque(char* base) {
  asm volatile("" : "+l"(base));
  return base;
}

template <typename Traits>
__device__ __forceinline__ void backward_key_tile(const BackwardParams& p, QdOStages<Traits>& q_do_stages, char* smem,
                                                  int n_block, const WalkHeads& heads, int b, int split) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const ForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
  const int n_begin = n_block * kBlockN, kv_h = heads.kv_head;

  const BackwardSmem<Traits> buffers(smem);
  float* reduce = buffers.reduce;

  // Global -> shared copies, with the (row, column) of every vector for predication.
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  auto load_q_do = [&](int head, int m_block, int stage) CUTLASS_LAMBDA_FUNC_INLINE {
    const BackwardSmem<Traits> at(opaque(smem));
    if (q_do_stages.tma()) {
      q_do_stages.load(f, b, head, m_block, stage, at.q, at.dout);
      return;
    }
    Tensor tQsQ = gmem_thr.partition_D(as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(at.q), typename Traits::SmemLayoutQ{})));  // (CPY, rows, cols, stage)
    Tensor tdOsdO = gmem_thr.partition_D(as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(at.dout), typename Traits::SmemLayoutQ{})));
    copy_q_do_async<Element, kBlockM, kHeadDim>(p, b, head, m_block, gmem_thr, tQsQ(_, _, _, stage),
                                                 tdOsdO(_, _, _, stage), tQcQ);
    cp_async_fence();
  };

  // wgmma operands: shared-memory descriptors throughout, built where they are used (opaque()).
  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  auto operands = [&](const BackwardSmem<Traits>& at) CUTLASS_LAMBDA_FUNC_INLINE {
    auto view = [](Element* ptr, auto layout) { return make_tensor(make_smem_ptr(ptr), layout); };
    return make_tuple(thr_sdp.partition_fragment_A(view(at.q, typename Traits::SmemLayoutQ{})),        // Q (stage)
                      thr_sdp.partition_fragment_B(view(at.k, typename Traits::SmemLayoutK{})),        // K
                      thr_sdp.partition_fragment_A(view(at.dout, typename Traits::SmemLayoutQ{})),     // dO (stage)
                      thr_sdp.partition_fragment_B(view(at.v, typename Traits::SmemLayoutV{})),        // V
                      thr_dkv.partition_fragment_A(view(at.p, typename Traits::SmemLayoutPdSt{})),     // Pᵀ
                      thr_dkv.partition_fragment_B(view(at.dout, typename Traits::SmemLayoutQt{})),    // dOᵀ (stage)
                      thr_dkv.partition_fragment_A(view(at.ds, typename Traits::SmemLayoutPdSt{})),    // dSᵀ
                      thr_dkv.partition_fragment_B(view(at.q, typename Traits::SmemLayoutQt{})),       // Qᵀ (stage)
                      thr_dq.partition_fragment_A(view(at.ds, typename Traits::SmemLayoutPdS{})),      // dS
                      thr_dq.partition_fragment_B(view(at.k, typename Traits::SmemLayoutKt{})));       // Kᵀ
  };

  // P and dS, register -> shared, pairs of neighbouring keys per store.
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
  auto thr_pds = copy_pds.get_thread_slice(tid);

  // (row, col) inside the tile of every element of S, dQ and dK/dV this thread holds.
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), accumulator_as_rows_cols(tScS.layout()));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tdKVcdKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;
  using Policy = MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols>;

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);
  BiasGradTile<kBlockM, kBlockN, Traits::kNThreads, MmaColumnSums<Traits>> dbias(p, b, kv_h);
  const bool dbias_columns = dbias.g.kind == BiasGradKind::columns;
  const bool softcap = f.softcap > 0.f;
  constexpr bool with_dq = Traits::kDqBy == DqBy::key_tiles;  // else the dQ kernel computes it

  // K and V of this tile, once. The barrier frees their buffers from a previous tile's readers.
  __syncthreads();
  MmaColumnSums<Traits>::fill_ones(buffers.ones);
  copy_k_v_async<Element, kBlockN, kHeadDim>(
      p, b, kv_h, n_block, gmem_thr,
      gmem_thr.partition_D(as_position_independent_swizzle_tensor(
          make_tensor(make_smem_ptr(buffers.k), typename Traits::SmemLayoutK{}))),
      gmem_thr.partition_D(as_position_independent_swizzle_tensor(
          make_tensor(make_smem_ptr(buffers.v), typename Traits::SmemLayoutV{}))),
      tKVcKV);

  // A query head's first tile loads into the stage its predecessor did not read last.
  int stage = 0;
  auto load_first = [&](int h, int m_block) CUTLASS_LAMBDA_FUNC_INLINE { load_q_do(h, m_block, stage); };
  for_each_query_tile<kBlockM, kBlockN>(p, b, heads, n_block, dbias, tScS_rc, reduce, load_first,
                                        [&](int h, int m_block, int next, bool elementwise) CUTLASS_LAMBDA_FUNC_INLINE {
    const int row0 = m_block * kBlockM;
    // What the tile reads besides Q, dO, K and V (bias values, mask bits, LSE and Δ), issued
    // before the barrier and the S GEMM, which hide its latency: one CTA per SM has no other warps
    // to do so. Against loading the bias and mask after S (H200, one run): D = 128 dense-equivalent
    // 7.85 -> 7.79 ms, bias alone 7.70 -> 7.58, neither 6.68 -> 6.59; D = 64 4.94 -> 4.92.
    const Policy policy(f, b, RowMap{1, h, f.seqlen_q}, row0, tScS);
    typename Policy::TileInputs inputs;
    policy.load_inputs(inputs, tScS, n_block, elementwise);
    BackwardRowStats<kRows> stats;
    stats.load(p, b, h, row0, tScS_rc);
    const BackwardSmem<Traits> at(opaque(smem));
    auto [tSrQ, tSrK, tdPrdO, tdPrV, tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdQrdS, tdQrKt] = operands(at);
    Tensor tPsP = thr_pds.partition_D(as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(at.p), typename Traits::SmemLayoutPdS{})));
    Tensor tdSsdS = thr_pds.partition_D(as_position_independent_swizzle_tensor(
        make_tensor(make_smem_ptr(at.ds), typename Traits::SmemLayoutPdS{})));
    // Q and dO (and K, V) landed; every warpgroup's GEMMs of the last tile, which read the other
    // stage, P and dS, completed.
    if (q_do_stages.tma()) q_do_stages.wait(stage);
    await_tiles();
    if (next >= 0) load_q_do(h, next, stage ^ 1);

    // S, then P = exp(z - LSE) in its registers, then dP. (In the query-rows split the registers
    // would allow dP to compute beside the softmax, but that measured slower there: D = 128
    // dense-equivalent 8.15 against 7.90 ms, single runs on two H200s.)
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    wgmma_issue<true>(mma_sdp, tSrQ(_, _, _, stage), tSrK, acc_s);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_s);
    SoftcapGrads<kRows, kCols> cap;
    probabilities(policy, inputs, n_block, elementwise, stats, acc_s, tScS, cap);

    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    wgmma_issue<true>(mma_sdp, tdPrdO(_, _, _, stage), tdPrV, acc_dp);
    Tensor p_values = convert_fragment<Element>(acc_s);
    copy(copy_pds, thr_pds.retile_S(p_values), tPsP);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dp);
    // dS replaces dP; dBias reads dZ on the way.
    logit_gradients_from_p<kBlockN>(p, h, row0, n_block, stats, acc_s, acc_dp, tScS, dbias);
    if (dbias_columns && softcap) {
      // The dbias MMA reads dZ, which dS is not here.
      Tensor dz_values = convert_fragment<Element>(acc_dp);
      copy(copy_pds, thr_pds.retile_S(dz_values), thr_pds.partition_D(as_position_independent_swizzle_tensor(
                                                      make_tensor(make_smem_ptr(at.dz), typename Traits::SmemLayoutPdS{}))));
    }
    apply_softcap_grads(f.softcap, acc_dp, cap);
    Tensor ds_values = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_pds.retile_S(ds_values), tdSsdS);
    // dQ (keys split) or dK and dV (query-rows split) read what both warpgroups wrote: all of P
    // and dS must be in shared memory, visible to wgmma.
    cutlass::arch::fence_view_async_shared();
    __syncthreads();

    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    if constexpr (with_dq) wgmma_issue<true>(mma_dq, tdQrdS, tdQrKt, acc_dq);
    if (dbias_columns) dbias.columns.issue(softcap ? at.dz : at.ds, at.ones);
    wgmma_issue<false>(mma_dkv, tdVrPt, tdVrdOt(_, _, _, stage), acc_dv);
    wgmma_issue<false>(mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage), acc_dk);
    if constexpr (with_dq) {
      warpgroup_wait<2>();  // dQ (and dbias); dV and dK may still run while dQ is reduced
      warpgroup_fence_operand(acc_dq);
      accumulate_dq(acc_dq, tdQcdQ, dq_accum_rows(p, b, h, split), row0, f.seqlen_q, f.head_dim);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    stage ^= 1;
  });

  cp_async_wait<0>();
  store_dk_dv<Element>(p, b, heads, n_begin, acc_dk, acc_dv, tdKVcdKV);
}

}  // namespace flash_dmattn::kernels::sm90
