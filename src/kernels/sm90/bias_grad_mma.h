// The per-key dBias sums of a bias shared by the query rows (query dim 1, the common (B, Hk, 1,
// Sk) case) on the tensor cores: Σ over a tile's query rows of dZ, for each key, is dZᵀ·1, a
// wgmma of the warpgroup's dZᵀ tile (keys x query rows) by a column of ones in shared memory.
// Without softcap dS = dZ, and the dS tile that dQ and dK read is the operand; under softcap dZ
// is staged in a tile of its own.
//
// Kept in registers by the threads that hold the elements (RegisterColumnSums), the sums took 16
// registers per thread across the loop at D = 128 and were spilled and reloaded at every tile, and
// their adds sat on the path from dP to dS. The MMA's accumulator is 4 registers. H200, D = 128,
// bias alone, backward with dbias against without: 6.13 against 5.89 ms before, 5.95 against 5.89
// after (docs/architecture.md, the sm90a backward).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/sm90/wgmma.h"

namespace flash_dmattn::kernels::sm90 {

// The ColumnSums policy of BiasGradTile (common/bias_grad.h) for the sm90a backward.
template <typename Traits>
struct MmaColumnSums {
  using Element = typename Traits::Element;
  using Mma = typename Traits::TiledMmadBias;
  static constexpr int kBlockN = Traits::kBlockN;
  // A warpgroup sums the 64 keys and 64 query rows of S it computed: its own keys (keys split),
  // or every key over its own rows (query-rows split), whose partials are added at the end.
  static constexpr int kPartials = Traits::kColumnPartials;
  using Acc = decltype(cute::partition_fragment_C(Mma{}, cute::Shape<cute::_64, cute::_8>{}));
  Acc acc;
  // acc holds no sum yet: the next MMA overwrites it. Clearing it with ordinary instructions
  // instead made ptxas serialize every wgmma of the kernel (C7515): 0.5 ms at D = 128.
  bool fresh = true;

  // The ones issue() multiplies by, into `ones` (Traits::kOnesElems elements) by the CTA's
  // threads; visible to wgmma after the writers' fence and a barrier.
  __device__ __forceinline__ static void fill_ones(Element* ones) {
    for (int i = threadIdx.x; i < Traits::kOnesElems; i += Traits::kNThreads) ones[i] = Element(1.f);
  }

  // Nothing from registers: issue() does the work.
  template <typename TensorZ>
  __device__ __forceinline__ void add(const TensorZ&) {}

  // acc += dZᵀ·1 for this warpgroup's 64 x 64 part of the tile. dzt: dZ (or dS) stored as the
  // (kBlockN, kBlockM) MN-major A operand, visible to wgmma; ones: Traits::SmemLayoutOnes.
  __device__ __forceinline__ void issue(const Element* dzt, const Element* ones) {
    using namespace cute;
    const int warpgroup = threadIdx.x / 128;
    Mma mma;
    auto thr = mma.get_thread_slice(threadIdx.x % 128);
    Tensor all = make_tensor(make_smem_ptr(dzt), typename Traits::SmemLayoutPdSt{});
    Tensor mine = local_tile(all, Shape<_64, _64>{},
                             Traits::kSplitKeys ? make_coord(warpgroup, 0) : make_coord(0, warpgroup));
    Tensor b = make_tensor(make_smem_ptr(ones), typename Traits::SmemLayoutOnes{});
    wgmma_issue(mma, thr.partition_fragment_A(mine), thr.partition_fragment_B(b), acc,
                fresh ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
    fresh = false;
  }

  // f(key, sum) for each key of the tile whose sum over this warpgroup's rows the thread holds (0
  // if no tile added to it), then starts over; every wgmma that adds to acc has completed. All
  // eight columns of the product are equal: column 0 is read.
  template <typename F>
  __device__ __forceinline__ void for_each_sum(F&& f) {
    using namespace cute;
    const int warpgroup = threadIdx.x / 128;
    Mma mma;
    Tensor coords = mma.get_thread_slice(threadIdx.x % 128).partition_C(make_identity_tensor(Shape<_64, _8>{}));
    const int key0 = Traits::kSplitKeys ? 64 * warpgroup : 0;
    warpgroup_fence_operand(acc);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      if (get<1>(coords(e)) == 0) f(key0 + get<0>(coords(e)), fresh ? 0.f : acc(e));
    }
    fresh = true;
  }

  // Writes partial w of key j to reduce[w * kBlockN + j] and starts over.
  template <typename TensorC>
  __device__ __forceinline__ void deposit(const TensorC&, float* reduce) {
    const int partial = Traits::kSplitKeys ? 0 : threadIdx.x / 128;
    for_each_sum([&](int key, float x) { reduce[partial * kBlockN + key] = x; });
  }
};

}  // namespace flash_dmattn::kernels::sm90
