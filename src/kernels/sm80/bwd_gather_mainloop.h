// The sm80 backward on the gather path, for one (query tile, query heads, batch): the CTA walks its
// key list (key_lists.cu) in chunks of kBlockN keys with dQ in registers throughout, and adds each
// chunk's dK, dV and dBias at the gathered keys by fp32 reductions into the workspace, which
// reduce_dk_dv() and reduce_bias_grad() write out. Its cost follows the kept keys, where the
// key-tile backward (bwd_mainloop.h) pays for every tile a scattered mask leaves partly visible.
// With Traits::kPackedHeads > 1 the tile's rows are those of several query heads of one KV head
// that read one list (RowMap packing: packed row r is query r / heads of head r % heads): the dK
// and dV GEMMs then sum the heads, and each reduction serves all of them: at the training shape
// (ncu) 3.3 GB of reductions into L2 instead of the 6.5 GB that bound the one-head kernel.
// The loop body is that kernel's algorithm with the roles of the tiles swapped:
//   S = Q·Kᵀ, dP = dO·Vᵀ  ->  P, dZ (-> dBias), dS  ->  dQ += dS·K,  dV[keys] += Pᵀ·dO,  dK[keys] += dSᵀ·Q
// K and V of the next chunk are gathered while this one computes (two buffers); the list's keys
// and row bits are staged two chunks ahead (three buffers: chunk c's keys address its reductions
// while chunk c + 1's K and V are gathered and chunk c + 2's keys land).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/backward_scores.h"
#include "kernels/common/bias_grad.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/gathered_backward.h"
#include "kernels/common/gathered_keys.h"
#include "kernels/common/gradient_stores.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm80/bwd_mainloop.h"
#include "kernels/sm80/bwd_fragments.h"
#include "kernels/sm80/bwd_traits.h"
#include "kernels/sm80/gemm.h"

namespace flash_dmattn::kernels::sm80 {

// Shared memory of the gather backward: Q and dO once, K and V twice, P and dS, the dbias column
// reduction, the list's staging.
template <typename Traits>
struct GatherBackwardSmem {
  // Lists are built per query tile of kListRows rows; a packed tile holds that many of each head.
  static constexpr int kListRows = Traits::kBlockM / Traits::kPackedHeads;
  using List = GatheredKeys<kListRows, Traits::kBlockN, 3>;
  static constexpr int kKVBuffer = 2 * Traits::kKVElems;  // K then V, per buffer
  static constexpr int kElems = 2 * Traits::kQElems + 2 * kKVBuffer + 2 * Traits::kPdSElems;
  static constexpr int kBytes = kElems * static_cast<int>(sizeof(typename Traits::Element)) +
                                Traits::kReduceFloats * static_cast<int>(sizeof(float)) + List::kSmemBytes;
};

// m_block: the query tile of the list; h: the first of the tile's query heads.
template <typename Traits>
__device__ __forceinline__ void backward_gathered_query_tile(const BackwardParams& p, char* smem, int m_block, int h,
                                                             int b) {
  using namespace cute;
  using Element = typename Traits::Element;
  using Smem = GatherBackwardSmem<Traits>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kQElems = Traits::kQElems, kKVElems = Traits::kKVElems, kPdSElems = Traits::kPdSElems;
  constexpr int kKVBuffer = Smem::kKVBuffer;
  constexpr int kPacked = Traits::kPackedHeads;
  const ForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
  const int kv_h = h / (f.heads / f.kv_heads);
  const RowMap rows{kPacked, h, f.seqlen_q * kPacked};
  const int query0 = m_block * Smem::kListRows;
  const int row0 = m_block * kBlockM;               // in packed rows
  const int valid_rows = (f.seqlen_q - query0) * kPacked;  // packed rows before Sq

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(sQ.data() + kQElems, typename Traits::SmemLayoutQ{});
  // K and V of buffer 0; buffer 1 is kKVBuffer elements on (at_stage).
  Tensor sK = make_tensor(sdO.data() + kQElems, typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + kKVElems, typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sK.data() + 2 * kKVBuffer, typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + kPdSElems, typename Traits::SmemLayoutPdS{});
  float* reduce = reinterpret_cast<float*>(raw_pointer_cast(sdS.data() + kPdSElems));
  typename Smem::List list(f.lists, b, h, query0, reinterpret_cast<char*>(reduce + Traits::kReduceFloats));
  list.stagger(m_block);

  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVsV = gmem_thr.partition_D(sV);

  // The three GEMMs' fragments and the shared -> register copies that feed them.
  auto fragments = backward_fragments<Traits>(tid, sQ, sdO, sK, sV, sP, sdS);
  FDMA_NAME_BACKWARD_FRAGMENTS(fragments);

  Tensor tScS_rc = make_tensor(tScS.data(), accumulator_as_rows_cols(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  const MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols> policy(f, b, rows, row0, tScS);
  BiasGradTile<kBlockM, kBlockN, Traits::kNThreads, RegisterColumnSums<kBlockN, kCols, Traits::kSdpWarpsM>> dbias(
      p, b, kv_h);
  BackwardRowStats<kRows> stats;
  stats.load(p, b, rows, row0, tScS_rc);
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);

  const GatheredRows<Element> gathered(p, b, kv_h);
  auto gather_k_v = [&](int c) {
    auto k_buffer = at_stage(tKsK, c % 2, kKVBuffer);
    auto v_buffer = at_stage(tVsV, c % 2, kKVBuffer);
    list.load(k_buffer, tKVcKV, c, gathered.k, f.k_row_stride, f.head_dim);
    list.load(v_buffer, tKVcKV, c, gathered.v, f.v_row_stride, f.head_dim);
  };
  const int chunks = list.chunks();
  start_gathered_chunks<Element>(p, b, rows, row0, valid_rows, gmem_thr.partition_D(sQ), gmem_thr.partition_D(sdO),
                                 tQcQ, list, Traits::kNThreads, gather_k_v);

  for (int c = 0; c < chunks; ++c) {
    const int buffer = c % 2;
    const int* const keys = list.staged_keys(c);
    const int valid = list.valid(c);
    cp_async_wait<0>();
    __syncthreads();  // chunk c's K and V and chunk c + 1's keys have landed; every warp is done with chunk c - 1
    if (c + 1 < chunks) gather_k_v(c + 1);
    if (c + 2 < chunks) list.stage(c + 2, tid, Traits::kNThreads);
    cp_async_fence();

    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, at_stage(tSsK, buffer, kKVBuffer), mma_sdp, copy_sdp_a, copy_sdp_b,
                   thr_sdp_a, thr_sdp_b);
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_dp);
    gemm_smem_smem(acc_dp, tdPrdO, tdPrV, tdPsdO, at_stage(tdPsV, buffer, kKVBuffer), mma_sdp, copy_sdp_a,
                   copy_sdp_b, thr_sdp_a, thr_sdp_b);

    // P = exp(z - LSE) replaces S, dZ = P∘(dP - Δ) replaces dP (dBias reads it), then dS.
    Tensor s = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
    Tensor dz = make_tensor(acc_dp.data(), accumulator_as_rows_cols(acc_dp.layout()));
    SoftcapGrads<kRows, kCols> cap;
    float lse_log2[kRows];
    stats.lse_log2(lse_log2);
    policy.with_logit_kind([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE {
      list.apply(kind, policy, acc_s, tScS, c, [&](int r, int col, float z, float dcap) {
        const float prob = exp2f(fmaf(z, kLog2e, -lse_log2[r]));
        s(r, col) = prob;
        dz(r, col) = prob * (dz(r, col) - stats.dsum[r]);
        cap.dcap[r][col] = dcap;
      });
    });
    dbias.add_gathered(dz, tScS_rc, h, policy.row_index, keys, valid, f.seqlen_q);
    apply_softcap_grads(f.softcap, acc_dp, cap);
    Tensor p_values = convert_fragment<Element>(acc_s);
    Tensor ds_values = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_pds.retile_S(p_values), tPsP);
    copy(copy_pds, thr_pds.retile_S(ds_values), tdSsdS);
    dbias.deposit_columns(tScS_rc, reduce);
    __syncthreads();  // P, dS and the column sums are in shared memory
    dbias.flush_gathered_columns(reduce, h, keys, valid);

    gemm_smem_smem(acc_dq, tdQrdS, tdQrKt, tdQsdS, at_stage(tdQsKt, buffer, kKVBuffer), mma_dq, copy_dq_a, copy_dq_b,
                   thr_dq_a, thr_dq_b);
    {
      Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      clear(acc_dv);
      gemm_smem_smem(acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt, mma_dkv, copy_dkv_a, copy_dkv_b, thr_dkv_a, thr_dkv_b);
      accumulate_gathered_rows(acc_dv, tdKVcdKV, gathered.dv, keys, valid, f.head_dim);
    }
    {
      Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
      clear(acc_dk);
      gemm_smem_smem(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, mma_dkv, copy_dkv_a, copy_dkv_b, thr_dkv_a, thr_dkv_b);
      accumulate_gathered_rows(acc_dk, tdKVcdKV, gathered.dk, keys, valid, f.head_dim);
    }
  }
  cp_async_wait<0>();  // nothing is left in flight when the list is empty

  store_gathered_dq<Element>(acc_dq, tdQcdQ, p, b, rows, row0, valid_rows);
}

}  // namespace flash_dmattn::kernels::sm80
