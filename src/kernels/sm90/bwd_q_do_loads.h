// How the sm90a backward's Q and dO tiles reach their two shared-memory stages when TMA can address
// both tensors: thread 0 issues one TMA load of each into a stage and every thread waits on that
// stage's mbarrier. Otherwise every thread copies its vectors with cp.async (bwd_mainloop.h).
// With cp.async the addresses and predicates of 16 vectors per thread and tile took about 190
// instructions per thread and tile, in a loop bound by issue slots (docs/architecture.md).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/params.h"

namespace flash_dmattn::kernels::sm90 {

// What the kernel takes: the plain parameters and, when `tma`, a descriptor each for Q and dO.
template <typename Traits>
struct BackwardKernelParams {
  BackwardParams p;
  typename Traits::TmaQdO q, dout;
  bool tma;
};

// The stages' mbarriers and the phase each waits for next; one per CTA, across all of its key
// tiles (deterministic mode walks several).
template <typename Traits>
class QdOStages {
 public:
  __device__ __forceinline__ QdOStages(const BackwardKernelParams<Traits>& params, std::uint64_t* loaded)
      : params_(params), loaded_(loaded) {}

  __device__ __forceinline__ bool tma() const { return params_.tma; }

  // Before the CTA's first barrier, which makes the initialization visible.
  __device__ __forceinline__ void init() const {
    if (!params_.tma || threadIdx.x != 0) return;
    for (int stage = 0; stage < Traits::kStages; ++stage) cutlass::arch::ClusterBarrier::init(&loaded_[stage], 1);
    cutlass::arch::fence_barrier_init();
  }

  // Q and dO of query tile m_block of head h into `stage`, whose previous contents every reader is
  // done with; `f` is the CTA's params (for packed sequences rebased to batch b's: for_sequence,
  // whose q_row0 offsets the tiles in the packed tensors, which TMA addresses as one batch).
  // Thread 0 only.
  __device__ __forceinline__ void load(const ForwardParams& f, int b, int h, int m_block, int stage,
                                       typename Traits::Element* q, typename Traits::Element* dout) const {
    using namespace cute;
    constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
    if (threadIdx.x != 0) return;
    std::uint64_t& barrier = loaded_[stage];
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&barrier, kTileBytes * 2);
    const bool packed = f.cu_seqlens_q != nullptr;
    auto issue = [&](const typename Traits::TmaQdO& tma, typename Traits::Element* smem) {
      Tensor m = tma.get_tma_tensor(
          make_shape(packed ? f.total_q : f.seqlen_q, f.head_dim, f.heads, packed ? 1 : f.batch));
      Tensor g = local_tile(domain_offset(make_coord(f.q_row0, _0{}), m(_, _, h, packed ? 0 : b)),
                            Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, _0{}));
      Tensor s = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
      auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
      copy(tma.with(barrier, 0), tg(_, m_block), ts(_, stage));
    };
    issue(params_.q, q);
    issue(params_.dout, dout);
  }

  // Every thread: until the last load into `stage` landed.
  __device__ __forceinline__ void wait(int stage) {
    cutlass::arch::ClusterBarrier::wait(&loaded_[stage], (phases_ >> stage) & 1u);
    phases_ ^= 1u << stage;
  }

 private:
  // TMA counts a tile's rows past Sq and columns past the head dim, which it fills with zeros.
  static constexpr std::uint32_t kTileBytes = Traits::kBlockM * Traits::kHeadDim * sizeof(typename Traits::Element);
  const BackwardKernelParams<Traits>& params_;
  std::uint64_t* loaded_;
  std::uint32_t phases_ = 0;
};

}  // namespace flash_dmattn::kernels::sm90
