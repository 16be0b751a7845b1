// The wgmma state of a thread in a computing warpgroup of the sm90a forward, shared by both main
// loops (fwd_mainloop.h, fwd_warp_specialized.h).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/fragment_layouts.h"
#include "kernels/sm90/fwd_traits.h"

namespace flash_dmattn::kernels::sm90 {

// tid: the thread's index among the computing warpgroups; q, k, v: the shared-memory tiles (K and
// V with their stages). Returns, in this order: the MMAs of S = Q·Kᵀ and O += P·V; the operands Q,
// K and V (K and V with a stage mode); the accumulators of S and of O (cleared); the registers of
// P, S converted into the A operand of P·V; the (row, col) in the tile of each element of S and
// of O the thread holds.
template <typename Traits>
__device__ __forceinline__ auto forward_fragments(int tid, typename Traits::Element* q, typename Traits::Element* k,
                                                  typename Traits::Element* v) {
  using namespace cute;
  using TileS = Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>;
  using TileO = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  typename Traits::TiledMmaS mma_s;
  typename Traits::TiledMmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor acc_s = partition_fragment_C(mma_s, TileS{});
  Tensor acc_o = partition_fragment_C(mma_o, TileO{});
  clear(acc_o);
  Tensor coords_s = thr_s.partition_C(make_identity_tensor(TileS{}));
  using RowsCols = decltype(accumulator_as_rows_cols(coords_s.layout()));
  static_assert(decltype(size<0>(RowsCols{}))::value == Traits::kRows &&
                    decltype(size<1>(RowsCols{}))::value == Traits::kCols,
                "Traits::kRows and kCols describe a thread's part of the S accumulator");
  return make_tuple(mma_s, mma_o, thr_s.partition_fragment_A(make_tensor(make_smem_ptr(q), typename Traits::SmemLayoutQ{})),
                    thr_s.partition_fragment_B(make_tensor(make_smem_ptr(k), typename Traits::SmemLayoutK{})),
                    thr_o.partition_fragment_B(make_tensor(make_smem_ptr(v), typename Traits::SmemLayoutVt{})), acc_s,
                    acc_o, make_tensor<typename Traits::Element>(accumulator_as_a_operand(acc_s.layout())), coords_s,
                    thr_o.partition_C(make_identity_tensor(TileO{})));
}

}  // namespace flash_dmattn::kernels::sm90

// Declares a named reference to each part of forward_fragments' tuple `fragments`, in its order:
// both main loops are lambdas, and C++17 lambdas cannot capture a structured binding.
#define FDMA_NAME_FORWARD_FRAGMENTS(fragments) \
  auto& mma_s = cute::get<0>(fragments); \
  auto& mma_o = cute::get<1>(fragments); \
  auto& tSrQ = cute::get<2>(fragments); \
  auto& tSrK = cute::get<3>(fragments); \
  auto& tOrV = cute::get<4>(fragments); \
  auto& acc_s = cute::get<5>(fragments); \
  auto& acc_o = cute::get<6>(fragments); \
  auto& tOrP = cute::get<7>(fragments); \
  auto& tScS = cute::get<8>(fragments); \
  auto& tOcO = cute::get<9>(fragments)
