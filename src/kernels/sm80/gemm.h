// The GEMM steps shared by the sm80 forward and backward main loops: both operands in shared
// memory, or A already in registers, each loading the next k-slice from shared memory while the
// MMAs of the current one run. (Their tile copies are in kernels/common/tile_copy.h.)
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/tile_copy.h"

namespace flash_dmattn::kernels::sm80 {

// acc += A·Bᵀ with both operands in shared memory, loading the next k-slice while the MMAs of
// the current one run.
template <typename Acc, typename RegA, typename RegB, typename SmemA, typename SmemB, typename TiledMma,
          typename CopyA, typename CopyB, typename ThrCopyA, typename ThrCopyB>
__device__ __forceinline__ void gemm_smem_smem(Acc& acc, RegA& rA, RegB& rB, const SmemA& sA, const SmemB& sB, const TiledMma& mma,
                               const CopyA& copy_a, const CopyB& copy_b, const ThrCopyA& thr_a, const ThrCopyB& thr_b) {
  using namespace cute;
  auto rA_view = thr_a.retile_D(rA);
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A·Bᵀ with A already in registers (P) and B in shared memory (Vᵀ).
template <typename Acc, typename RegA, typename RegB, typename SmemB, typename TiledMma, typename CopyB,
          typename ThrCopyB>
__device__ __forceinline__ void gemm_reg_smem(Acc& acc, const RegA& rA, RegB& rB, const SmemB& sB, const TiledMma& mma,
                              const CopyB& copy_b, const ThrCopyB& thr_b) {
  using namespace cute;
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace flash_dmattn::kernels::sm80
