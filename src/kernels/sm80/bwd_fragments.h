// The mma.sync state of a thread of the sm80 backward, shared by both main loops (bwd_mainloop.h,
// bwd_gather_mainloop.h), which differ in where their tiles come from, not in their GEMMs.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/sm80/bwd_traits.h"

namespace flash_dmattn::kernels::sm80 {

// q, dout, k, v, p, ds: the shared-memory tiles (stage 0 of Q and dO, the first buffer of K and
// V). Returns, in the order FDMA_NAME_BACKWARD_FRAGMENTS names them: the three tiled MMAs (S and
// dP; dK and dV; dQ); their register fragments; per GEMM the shared -> register copies of its A
// and B operands, their thread slices and the shared-memory partitions they read (transposed
// where the GEMM reads a tile as its transpose); the register -> shared copy of P and dS; the
// (row, col) in the tile of each element of S, dQ and dK/dV the thread holds.
template <typename Traits, typename TensorQ, typename TensorK, typename TensorP>
__device__ __forceinline__ auto backward_fragments(int tid, const TensorQ& q, const TensorQ& dout, const TensorK& k,
                                                   const TensorK& v, const TensorP& p, const TensorP& ds) {
  using namespace cute;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  Tensor qt = make_tensor(q.data(), typename Traits::SmemLayoutQt{});
  Tensor doutt = make_tensor(dout.data(), typename Traits::SmemLayoutQt{});
  Tensor kt = make_tensor(k.data(), typename Traits::SmemLayoutKt{});
  Tensor pt = make_tensor(p.data(), typename Traits::SmemLayoutPdSt{});
  Tensor dst = make_tensor(ds.data(), typename Traits::SmemLayoutPdSt{});

  typename Traits::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  typename Traits::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_sdp_a = copy_sdp_a.get_thread_slice(tid);
  auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
  auto thr_sdp_b = copy_sdp_b.get_thread_slice(tid);
  auto copy_dkv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_dkv_a = copy_dkv_a.get_thread_slice(tid);
  auto copy_dkv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dkv);
  auto thr_dkv_b = copy_dkv_b.get_thread_slice(tid);
  auto copy_dq_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
  auto thr_dq_a = copy_dq_a.get_thread_slice(tid);
  auto copy_dq_b = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, mma_dq);
  auto thr_dq_b = copy_dq_b.get_thread_slice(tid);
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
  auto thr_pds = copy_pds.get_thread_slice(tid);
  // The dK/dV and dQ GEMMs read their transposed operands through layouts without the swizzle.
  auto unswizzled = [](const auto& tile, auto layout) { return make_tensor(tile.data().get(), layout); };
  return make_tuple(
      mma_sdp, mma_dkv, mma_dq,
      thr_sdp.partition_fragment_A(q), thr_sdp.partition_fragment_B(k), thr_sdp.partition_fragment_A(dout),
      thr_sdp.partition_fragment_B(v),
      thr_dkv.partition_fragment_A(unswizzled(p, typename Traits::SmemLayoutPdStNoSwizzle{})),
      thr_dkv.partition_fragment_B(unswizzled(dout, typename Traits::SmemLayoutQtNoSwizzle{})),
      thr_dkv.partition_fragment_A(unswizzled(ds, typename Traits::SmemLayoutPdStNoSwizzle{})),
      thr_dkv.partition_fragment_B(unswizzled(q, typename Traits::SmemLayoutQtNoSwizzle{})),
      thr_dq.partition_fragment_A(ds), thr_dq.partition_fragment_B(unswizzled(k, typename Traits::SmemLayoutKtNoSwizzle{})),
      copy_sdp_a, thr_sdp_a, thr_sdp_a.partition_S(q), thr_sdp_a.partition_S(dout),
      copy_sdp_b, thr_sdp_b, thr_sdp_b.partition_S(k), thr_sdp_b.partition_S(v),
      copy_dkv_a, thr_dkv_a, thr_dkv_a.partition_S(pt), thr_dkv_a.partition_S(dst),
      copy_dkv_b, thr_dkv_b, thr_dkv_b.partition_S(doutt), thr_dkv_b.partition_S(qt),
      copy_dq_a, thr_dq_a, thr_dq_a.partition_S(ds),
      copy_dq_b, thr_dq_b, thr_dq_b.partition_S(kt),
      copy_pds, thr_pds, thr_pds.partition_D(p), thr_pds.partition_D(ds),
      thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})),
      thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})),
      thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{})));
}

}  // namespace flash_dmattn::kernels::sm80

// Declares a named reference to each part of backward_fragments' tuple `fragments`, in its order
// (the main loops' lambdas cannot capture structured bindings in C++17). auto&&: the tuple hands
// out its empty members (the tiled MMAs and copies) by value.
#define FDMA_NAME_BACKWARD_FRAGMENTS(fragments) \
  auto&& mma_sdp = cute::get<0>(fragments);      \
  auto&& mma_dkv = cute::get<1>(fragments);      \
  auto&& mma_dq = cute::get<2>(fragments);       \
  auto&& tSrQ = cute::get<3>(fragments);         \
  auto&& tSrK = cute::get<4>(fragments);         \
  auto&& tdPrdO = cute::get<5>(fragments);       \
  auto&& tdPrV = cute::get<6>(fragments);        \
  auto&& tdVrPt = cute::get<7>(fragments);       \
  auto&& tdVrdOt = cute::get<8>(fragments);      \
  auto&& tdKrdSt = cute::get<9>(fragments);      \
  auto&& tdKrQt = cute::get<10>(fragments);      \
  auto&& tdQrdS = cute::get<11>(fragments);      \
  auto&& tdQrKt = cute::get<12>(fragments);      \
  auto&& copy_sdp_a = cute::get<13>(fragments);  \
  auto&& thr_sdp_a = cute::get<14>(fragments);   \
  auto&& tSsQ = cute::get<15>(fragments);        \
  auto&& tdPsdO = cute::get<16>(fragments);      \
  auto&& copy_sdp_b = cute::get<17>(fragments);  \
  auto&& thr_sdp_b = cute::get<18>(fragments);   \
  auto&& tSsK = cute::get<19>(fragments);        \
  auto&& tdPsV = cute::get<20>(fragments);       \
  auto&& copy_dkv_a = cute::get<21>(fragments);  \
  auto&& thr_dkv_a = cute::get<22>(fragments);   \
  auto&& tdVsPt = cute::get<23>(fragments);      \
  auto&& tdKsdSt = cute::get<24>(fragments);     \
  auto&& copy_dkv_b = cute::get<25>(fragments);  \
  auto&& thr_dkv_b = cute::get<26>(fragments);   \
  auto&& tdVsdOt = cute::get<27>(fragments);     \
  auto&& tdKsQt = cute::get<28>(fragments);      \
  auto&& copy_dq_a = cute::get<29>(fragments);   \
  auto&& thr_dq_a = cute::get<30>(fragments);    \
  auto&& tdQsdS = cute::get<31>(fragments);      \
  auto&& copy_dq_b = cute::get<32>(fragments);   \
  auto&& thr_dq_b = cute::get<33>(fragments);    \
  auto&& tdQsKt = cute::get<34>(fragments);      \
  auto&& copy_pds = cute::get<35>(fragments);    \
  auto&& thr_pds = cute::get<36>(fragments);     \
  auto&& tPsP = cute::get<37>(fragments);        \
  auto&& tdSsdS = cute::get<38>(fragments);      \
  auto&& tScS = cute::get<39>(fragments);        \
  auto&& tdQcdQ = cute::get<40>(fragments);      \
  auto&& tdKVcdKV = cute::get<41>(fragments)
