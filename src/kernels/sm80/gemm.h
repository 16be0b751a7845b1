// Building blocks shared by the sm80 forward and backward main loops: predicated cp.async tile
// copies and the two GEMM shapes (both operands in shared memory, or A already in registers),
// each loading the next k-slice from shared memory while the MMAs of the current one run.
#pragma once

#include <cute/tensor.hpp>

namespace flash_dmattn::kernels::sm80 {

// Copies a (rows, head dim) tile from global to shared memory with cp.async. Rows at or past
// `valid_rows` and head-dim columns at or past `head_dim` are zero-filled instead: zero K rows
// and columns add nothing to Q·Kᵀ, and zero V rows keep P·V finite where P is 0.
template <typename TiledCopy, typename TensorS, typename TensorD, typename TensorC>
__device__ __forceinline__ void copy_rows_async(const TiledCopy& tiled_copy, const TensorS& src, TensorD&& dst, const TensorC& coords,
                                int valid_rows, int head_dim) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = get<0>(coords(0, m, 0)) < valid_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (row_ok && get<1>(coords(0, m, k)) < head_dim) {
        copy(tiled_copy, src(_, m, k), dst(_, m, k));
      } else {
        clear(dst(_, m, k));
      }
    }
  }
}

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
