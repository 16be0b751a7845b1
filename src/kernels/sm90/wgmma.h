// Issuing a warpgroup GEMM (wgmma) over the K mode of its operands, asynchronously, and making
// shared-memory tiles that threads wrote visible to it. After an issue the caller waits with
// cute::warpgroup_wait<N>() (N = wgmma batches that may still run) and only then touches the
// accumulator, or the registers of an A operand, again.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>

namespace flash_dmattn::kernels::sm90 {

// c = a·b (first = ScaleOut::Zero) or c += a·b (ScaleOut::One); `first` may be decided at run
// time. The operand fences keep the compiler from moving reads or writes of c, or of a register A,
// across the asynchronous MMA.
template <typename TiledMma, typename TensorA, typename TensorB, typename TensorC>
__device__ __forceinline__ void wgmma_issue(TiledMma& mma, TensorA&& a, const TensorB& b, TensorC& c,
                                            cute::GMMA::ScaleOut first) {
  using namespace cute;
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegisterA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = first;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) warpgroup_fence_operand(a);
}

// c = a·b (kZeroInit) or c += a·b.
template <bool kZeroInit, typename TiledMma, typename TensorA, typename TensorB, typename TensorC>
__device__ __forceinline__ void wgmma_issue(TiledMma& mma, TensorA&& a, const TensorB& b, TensorC& c) {
  wgmma_issue(mma, static_cast<TensorA&&>(a), b, c, kZeroInit ? cute::GMMA::ScaleOut::Zero : cute::GMMA::ScaleOut::One);
}

// Tiles written by cp.async become visible to every warp, and to the wgmma's reads of shared
// memory (the async proxy), once each thread's copies landed, each thread fenced, and the CTA met.
__device__ __forceinline__ void await_tiles() {
  cute::cp_async_wait<0>();
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
}

}  // namespace flash_dmattn::kernels::sm90
