// The sm90a (wgmma) backward on the gather path, for one (query tile, two query heads of one KV
// head, batch): the sm80 gather backward with two heads per CTA (sm80/bwd_gather_mainloop.h) on
// the sm90a key-tile backward's D128 configuration (bwd_traits.h: 128 x 64, two warpgroups split
// by query rows), with the roles of the operands swapped. The CTA's 128 packed rows (RowMap: packed
// row r is query r / 2 of head r % 2; warpgroup w holds rows 64w..64w+63) keep Q, dO and dQ; per
// chunk of 64 keys of the list, K and V are gathered and dK and dV of the chunk go out by fp32
// reductions (dV's while dK's and dQ's wgmma run, dK's during the next chunk's S and dP):
//   S = Q·Kᵀ, dP = dO·Vᵀ  ->  P, dZ (-> dBias), dS  ->  dQ += dS·K,  dV[keys] += Pᵀ·dO,  dK[keys] += dSᵀ·Q
// dV and dK sum the 128 rows, both heads, inside the wgmma; each warpgroup computes half of their
// head-dim columns. All 256 threads gather the next chunk's K and V rows by cp.async while this
// one computes (two buffers), with a CTA barrier per chunk; the list's keys and row bits are
// staged two chunks ahead, as in the sm80 kernel, and a shared bias row's values one chunk ahead.
// The per-key dBias sums of such a bias come from the tensor cores (bias_grad_mma.h) and go out
// by reductions from the threads that hold them. Δ = rowsum(dO∘O) of the CTA's rows comes from
// its prologue (RowDeltas), not from a pass before the kernel.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/common/backward_scores.h"
#include "kernels/common/bias_grad.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/gathered_backward.h"
#include "kernels/common/gathered_keys.h"
#include "kernels/common/gradient_stores.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"
#include "kernels/sm90/bias_grad_mma.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// The key-tile backward's MMAs and K, V, P and dS layouts; Q and dO in one stage (they load once),
// K and V in two buffers.
template <typename Element_, int kHeadDim_>
struct GatherBackwardTraits : BackwardTraits<Element_, kHeadDim_> {
  using Base = BackwardTraits<Element_, kHeadDim_>;
  static_assert(!Base::kSplitKeys && Base::kBlockM == 128 && Base::kBlockN == 64,
                "two warpgroups of 64 query rows over 64-key chunks");
  static constexpr int kPackedHeads = 2;
  static constexpr int kListRows = Base::kBlockM / kPackedHeads;  // the sm80 backward's lists
  using List = GatheredKeys<kListRows, Base::kBlockN, 3, /*kStagesBias=*/true>;

  using SmemLayoutQ = decltype(cute::tile_to_shape(
      smem_atom<Element_, Base::kDkvCols, cute::GMMA::Major::K>(), cute::Shape<cute::Int<Base::kBlockM>, cute::Int<kHeadDim_>>{}));
  using SmemLayoutQt = decltype(cute::composition(
      SmemLayoutQ{}, cute::make_layout(cute::Shape<cute::Int<kHeadDim_>, cute::Int<Base::kBlockM>>{},
                                       cute::make_stride(cute::Int<Base::kBlockM>{}, cute::_1{}))));

  struct SharedStorage {
    alignas(1024) cute::array<Element_, cute::cosize_v<SmemLayoutQ>> q;
    alignas(1024) cute::array<Element_, cute::cosize_v<SmemLayoutQ>> dout;
    alignas(1024) cute::array<Element_, 2 * Base::kKElems> k;  // buffer i at i · kKElems
    alignas(1024) cute::array<Element_, 2 * Base::kVElems> v;
    alignas(1024) cute::array<Element_, Base::kPdSElems> p;
    alignas(1024) cute::array<Element_, Base::kPdSElems> ds;
    alignas(1024) cute::array<Element_, Base::kPdSElems> dz;  // what the dbias MMA reads under softcap
    alignas(1024) cute::array<Element_, Base::kOnesElems> ones;
    alignas(16) cute::array<std::uint32_t, List::kSmemBytes / 4> staging;
    alignas(16) cute::array<float, Base::kBlockM> delta;  // Δ of the CTA's packed rows (RowDeltas)
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "more shared memory than an SM offers a CTA");
};

// m_block: the query tile of the list; h: the first of the pair's query heads.
template <typename Traits>
__device__ __forceinline__ void backward_gathered_query_tile(const BackwardParams& p, char* smem, int m_block, int h,
                                                             int b) {
  using namespace cute;
  using Element = typename Traits::Element;
  using Storage = typename Traits::SharedStorage;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kThreads = Traits::kNThreads;
  const ForwardParams& f = p.fwd;
  const int tid = threadIdx.x;
  const int kv_h = h / (f.heads / f.kv_heads);
  const RowMap rows{Traits::kPackedHeads, h, f.seqlen_q * Traits::kPackedHeads};
  const int query0 = m_block * Traits::kListRows;
  const int row0 = m_block * kBlockM;                                // in packed rows
  const int valid_rows = (f.seqlen_q - query0) * Traits::kPackedHeads;  // packed rows before Sq
  Storage& storage = *reinterpret_cast<Storage*>(smem);
  typename Traits::List list(f.lists, b, h, query0, reinterpret_cast<char*>(storage.staging.data()));
  list.stagger(m_block);
  list.stage_bias_row(f, b, h);  // the pair of heads shares its bias head (the host's condition)

  // Global -> shared copies, by every thread, through the swizzled layouts wgmma reads.
  typename Traits::GmemTiledCopy gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tid);
  auto swizzled = [](Element* ptr, auto layout) CUTLASS_LAMBDA_FUNC_INLINE {
    return as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(ptr), layout));
  };
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  const GatheredRows<Element> gathered(p, b, kv_h);
  auto gather_k_v = [&](int c) CUTLASS_LAMBDA_FUNC_INLINE {
    Storage& at = *reinterpret_cast<Storage*>(opaque(smem));
    const int buffer = c % 2;
    list.load(gmem_thr.partition_D(swizzled(at.k.data() + buffer * Traits::kKElems, typename Traits::SmemLayoutK{})),
              tKVcKV, c, gathered.k, f.k_row_stride, f.head_dim);
    list.load(gmem_thr.partition_D(swizzled(at.v.data() + buffer * Traits::kVElems, typename Traits::SmemLayoutV{})),
              tKVcKV, c, gathered.v, f.v_row_stride, f.head_dim);
  };

  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  auto view = [](Element* ptr, auto layout) CUTLASS_LAMBDA_FUNC_INLINE { return make_tensor(make_smem_ptr(ptr), layout); };
  // P and dS, register -> shared by stmatrix.
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
  auto thr_pds = copy_pds.get_thread_slice(tid);

  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), accumulator_as_rows_cols(tScS.layout()));
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tdKVcdKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;
  constexpr int kCols = decltype(size<1>(tScS_rc))::value;

  const MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols> policy(f, b, rows, row0, tScS);
  BiasGradTile<kBlockM, kBlockN, kThreads, MmaColumnSums<Traits>> dbias(p, b, kv_h);
  const bool dbias_columns = dbias.g.kind == BiasGradKind::columns;
  const bool softcap = f.softcap > 0.f;
  // Read by the dbias MMA after the loop's first fence and barrier.
  MmaColumnSums<Traits>::fill_ones(storage.ones.data());
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);

  // Δ here (the host runs no compute_dsum before this kernel): its loads land while the
  // prologue waits for Q, dO and the first keys.
  const RowDeltas<Element, kHeadDim, kBlockM, kThreads> deltas(p, b, rows, row0, valid_rows);
  const int chunks = list.chunks();
  start_gathered_chunks<Element>(p, b, rows, row0, valid_rows,
                                 gmem_thr.partition_D(swizzled(storage.q.data(), typename Traits::SmemLayoutQ{})),
                                 gmem_thr.partition_D(swizzled(storage.dout.data(), typename Traits::SmemLayoutQ{})),
                                 tQcQ, list, kThreads, gather_k_v);
  deltas.store(storage.delta.data(), view(storage.dout.data(), typename Traits::SmemLayoutQ{}));
  __syncthreads();
  BackwardRowStats<kRows> stats;
  stats.load(p, b, rows, row0, tScS_rc, storage.delta.data());
  // A shared bias row's values at each chunk's keys, staged as floats beside the keys: thread j
  // loads key j's value of chunk c + 1 (whose keys have landed) at the top of chunk c and stores
  // it at the end, so that the load hides behind chunk c's math; read from global memory by
  // the logits instead, the values' loads waited between S and P. Chunk 0's are staged here.
  auto bias_staged_by_me = [&](int c) CUTLASS_LAMBDA_FUNC_INLINE {
    return list.bias_row != nullptr && c < chunks && tid < min(kBlockN, list.valid(c));
  };
  if (bias_staged_by_me(0)) list.put_bias(0, tid, list.bias_at(list.staged_keys(0)[tid]));
  // A chunk's dK goes out during the next chunk, while its S and dP run on the tensor cores: sent
  // right after its wgmma, the reductions were the chunk's last step, with the tensor pipe idle
  // (ncu: 40% of the warps' samples waited in the dK and dV reductions). Its rows' keys are read
  // before the next barrier, after which chunk c + 3's keys reuse the slot.
  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  auto dk_rows = gathered_row_keys(tdKVcdKV);  // none before chunk 0

  for (int c = 0; c < chunks; ++c) {
    const int buffer = c % 2;
    const int* const keys = list.staged_keys(c);
    const int valid = list.valid(c);
    // Chunk c's K and V and chunk c + 1's keys have landed and are visible to wgmma; every
    // warpgroup's GEMMs of chunk c - 1, which read the other buffer, P and dS, have completed
    // (the wait<0> at the end of the loop). Every write of this chunk waits for this barrier:
    // chunk c + 1's rows into the other buffer, chunk c + 2's keys into chunk c - 1's slot, P,
    // dS and dZ.
    await_tiles();
    Storage& at = *reinterpret_cast<Storage*>(opaque(smem));
    Element* const k = at.k.data() + buffer * Traits::kKElems;
    Element* const v = at.v.data() + buffer * Traits::kVElems;
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    wgmma_issue<true>(mma_sdp, thr_sdp.partition_fragment_A(view(at.q.data(), typename Traits::SmemLayoutQ{})),
                      thr_sdp.partition_fragment_B(view(k, typename Traits::SmemLayoutK{})), acc_s);
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    wgmma_issue<true>(mma_sdp, thr_sdp.partition_fragment_A(view(at.dout.data(), typename Traits::SmemLayoutQ{})),
                      thr_sdp.partition_fragment_B(view(v, typename Traits::SmemLayoutV{})), acc_dp);
    // The next chunk's gathers are issued behind S and dP (they fill the other buffer), so that
    // the tensor cores start right after the barrier.
    const bool stages_bias = bias_staged_by_me(c + 1);
    const std::uint32_t next_bias = stages_bias ? list.bias_bits_at(list.staged_keys(c + 1)[tid]) : 0u;
    if (c + 1 < chunks) gather_k_v(c + 1);
    if (c + 2 < chunks) list.stage(c + 2, tid, kThreads);
    cp_async_fence();
    accumulate_gathered_rows(acc_dk, tdKVcdKV, gathered.dk, dk_rows, f.head_dim);  // chunk c - 1's
    warpgroup_wait<1>();  // S; dP may still run
    warpgroup_fence_operand(acc_s);

    // P = exp(z - LSE) replaces S, to shared memory while dP finishes; then dZ = P∘(dP - Δ)
    // replaces dP (dBias reads it), then dS.
    Tensor s = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
    // The softcap factors (a register per element of S) are held across dP's wait only where
    // softcap is on: the pass is compiled for both.
    auto scores = [&](auto softcapped) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr bool kCap = decltype(softcapped)::value;
      SoftcapGrads<kCap ? kRows : 1, kCap ? kCols : 1> cap;
      float lse_log2[kRows];
      stats.lse_log2(lse_log2);
      policy.template with_logit_kind<BiasStaging::as_float>([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE {
        list.apply(kind, policy, acc_s, tScS, c, [&](int r, int col, float z, float dcap) {
          s(r, col) = exp2f(fmaf(z, kLog2e, -lse_log2[r]));
          if constexpr (kCap) cap.dcap[r][col] = dcap;
        });
      }, list.bias_row != nullptr);
      Tensor p_values = convert_fragment<Element>(acc_s);
      copy(copy_pds, thr_pds.retile_S(p_values),
           thr_pds.partition_D(swizzled(at.p.data(), typename Traits::SmemLayoutPdS{})));
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dp);
      logit_gradients(stats, acc_s, acc_dp);
      Tensor dz = make_tensor(acc_dp.data(), accumulator_as_rows_cols(acc_dp.layout()));
      dbias.add_gathered(dz, tScS_rc, h, policy.row_index, keys, valid, f.seqlen_q);
      if constexpr (kCap) {
        if (dbias_columns) {  // the dbias MMA reads dZ, which dS is not here
          Tensor dz_values = convert_fragment<Element>(acc_dp);
          copy(copy_pds, thr_pds.retile_S(dz_values),
               thr_pds.partition_D(swizzled(at.dz.data(), typename Traits::SmemLayoutPdS{})));
        }
        apply_softcap_grads(f.softcap, acc_dp, cap);
      }
    };
    if (softcap) {
      scores(cute::true_type{});
    } else {
      scores(cute::false_type{});
    }
    Tensor ds_values = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_pds.retile_S(ds_values),
         thr_pds.partition_D(swizzled(at.ds.data(), typename Traits::SmemLayoutPdS{})));
    // dK and dV read what both warpgroups wrote: all of P and dS must be visible to wgmma.
    cutlass::arch::fence_view_async_shared();
    __syncthreads();

    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    wgmma_issue<true>(mma_dkv, thr_dkv.partition_fragment_A(view(at.p.data(), typename Traits::SmemLayoutPdSt{})),
                      thr_dkv.partition_fragment_B(view(at.dout.data(), typename Traits::SmemLayoutQt{})), acc_dv);
    if (dbias_columns) dbias.columns.issue(softcap ? at.dz.data() : at.ds.data(), at.ones.data());
    wgmma_issue<true>(mma_dkv, thr_dkv.partition_fragment_A(view(at.ds.data(), typename Traits::SmemLayoutPdSt{})),
                      thr_dkv.partition_fragment_B(view(at.q.data(), typename Traits::SmemLayoutQt{})), acc_dk);
    wgmma_issue<false>(mma_dq, thr_dq.partition_fragment_A(view(at.ds.data(), typename Traits::SmemLayoutPdS{})),
                       thr_dq.partition_fragment_B(view(k, typename Traits::SmemLayoutKt{})), acc_dq);
    warpgroup_wait<2>();  // dV and dbias; dV's reductions go out while dK and dQ run
    warpgroup_fence_operand(acc_dv);
    dk_rows = gathered_row_keys(tdKVcdKV, keys, valid);  // dV's rows, and dK's at the next chunk's top
    accumulate_gathered_rows(acc_dv, tdKVcdKV, gathered.dv, dk_rows, f.head_dim);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(acc_dq);
    // Read after every wgmma has completed: these registers of a completed wgmma, read under
    // branches while others ran, made ptxas serialize the kernel's wgmma (C7518,
    // docs/architecture.md). The deferred dK reductions at the chunk's top do not (no C7518).
    dbias.add_gathered_sums(h, keys, valid);
    // Chunk c + 1's slot was last read by chunk c - 2; the next barrier publishes the value.
    if (stages_bias) list.put_bias(c + 1, tid, list.bias_from_bits(next_bias));
  }
  cp_async_wait<0>();  // nothing is left in flight when the list is empty
  accumulate_gathered_rows(acc_dk, tdKVcdKV, gathered.dk, dk_rows, f.head_dim);  // the last chunk's

  store_gathered_dq<Element>(acc_dq, tdQcdQ, p, b, rows, row0, valid_rows);
}

}  // namespace flash_dmattn::kernels::sm90
