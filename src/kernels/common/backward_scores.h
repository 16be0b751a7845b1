// The element-wise middle of a backward (query tile, key tile) pair, shared by the kernel
// families: from S = Q·Kᵀ and dP = dO·Vᵀ in the accumulators to P = exp(z - LSE) in S's registers
// and dS in dP's, adding dZ = P∘(dP - Δ) to dBias on the way:
//   z = softcap(scale·S) + bias, -inf where hidden;  dZ = P∘(dP - Δ);  dS = dZ·(1 - tanh²).
// In one pass over the elements when S and dP are both at hand (score_gradients), or in steps,
// so that a main loop may compute dP after P and act between dZ and dS (probabilities, then
// logit_gradients_from_p, then apply_softcap_grads).
#pragma once

#include <cute/tensor.hpp>
#include <cmath>
#include <cstdint>

#include "kernels/common/bias_grad.h"
#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/softmax.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// LSE and Δ = rowsum(dO∘O) of the query rows a thread holds, loaded before the GEMMs that need
// them to hide the latency. Rows past Sq read the last row (always in bounds) and are marked:
// their LSE counts as +inf, so their P is 0. The values stay raw until used: scaling the LSE
// right after its load made the thread wait for the load there (ncu, sm90a backward at D = 128).
template <int kRows>
struct BackwardRowStats {
  float lse[kRows], dsum[kRows];
  bool exists[kRows];

  template <typename CoordsRC>
  __device__ __forceinline__ void load(const BackwardParams& p, int b, int h, int row0, const CoordsRC& coords_rc) {
    load(p, b, RowMap{1, h, p.fwd.seqlen_q}, row0, coords_rc);
  }

  // Packed rows (several query heads in one tile): row0 and coords_rc count packed rows. delta:
  // where the kernel computed Δ itself (RowDeltas), the tile's rows' values by local row, in
  // shared memory; else Δ comes from p.dsum.
  template <typename CoordsRC>
  __device__ __forceinline__ void load(const BackwardParams& p, int b, const RowMap& rows, int row0,
                                       const CoordsRC& coords_rc, const float* delta = nullptr) {
    const ForwardParams& f = p.fwd;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int packed = row0 + cute::get<0>(coords_rc(r, 0));
      const int i = rows.query(packed), h = rows.head(packed);
      const int existing = min(i, f.seqlen_q - 1);
      exists[r] = i < f.seqlen_q;
      lse[r] = f.lse[b * f.lse_batch_stride + h * f.lse_head_stride + existing];
      dsum[r] = delta ? delta[cute::get<0>(coords_rc(r, 0))]
                      : p.dsum[(std::int64_t(b) * f.heads + h) * p.accum_rows + existing];
    }
  }

  // The LSE in base 2, +inf past Sq; once the loads are needed anyway.
  __device__ __forceinline__ void lse_log2(float (&out)[kRows]) const {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) out[r] = exists[r] ? lse[r] * kLog2e : INFINITY;
  }
};

// Under softcap, dz/d(scale·S) / scale = 1 - tanh² per element: found with z, used for dS.
template <int kRows, int kCols>
struct SoftcapGrads {
  float dcap[kRows][kCols];
};

// dS = dZ·dcap in the registers of dz, an MMA accumulator, under softcap (dS = dZ without).
template <int kRows, int kCols, typename TensorZ>
__device__ __forceinline__ void apply_softcap_grads(float softcap, TensorZ& dz, const SoftcapGrads<kRows, kCols>& cap) {
  using namespace cute;
  if (softcap > 0.f) {
    Tensor rc = make_tensor(dz.data(), accumulator_as_rows_cols(dz.layout()));
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) rc(r, c) *= cap.dcap[r][c];
    }
  }
}

// acc_s, acc_dp: S and dP of query tile row0 / kBlockM and key tile n_block for query head h,
// replaced by P and dS; coords: the (row, col) in the tile of every accumulator element this
// thread holds. dZ is formed as each P is, so no second fragment stays live.
template <int kBlockM, int kBlockN, int kRows, typename AccS, typename Coords, typename DBias>
__device__ __forceinline__ void score_gradients(const BackwardParams& p, int b, int h, int row0, int n_block,
                                                bool elementwise, const BackwardRowStats<kRows>& stats, AccS& acc_s,
                                                AccS& acc_dp, const Coords& coords, DBias& dbias) {
  using namespace cute;
  const ForwardParams& f = p.fwd;
  Tensor coords_rc = make_tensor(coords.data(), accumulator_as_rows_cols(coords.layout()));
  constexpr int kCols = decltype(size<1>(coords_rc))::value;
  const MaskBiasPolicy<kBlockM, kBlockN, kRows, kCols> policy(f, b, RowMap{1, h, f.seqlen_q}, row0, coords);
  Tensor s = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
  Tensor dz = make_tensor(acc_dp.data(), accumulator_as_rows_cols(acc_dp.layout()));
  SoftcapGrads<kRows, kCols> cap;
  float lse_log2[kRows];
  stats.lse_log2(lse_log2);
  policy.apply(acc_s, coords, n_block, elementwise, [&](int r, int c, float z, float dcap) {
    const float prob = exp2f(fmaf(z, kLog2e, -lse_log2[r]));
    s(r, c) = prob;
    dz(r, c) = prob * (dz(r, c) - stats.dsum[r]);
    cap.dcap[r][c] = dcap;
  });
  dbias.add_tile(dz, coords_rc, h, row0, n_block * kBlockN, f.seqlen_q, f.seqlen_k);
  apply_softcap_grads(f.softcap, acc_dp, cap);
}

// The first of the two steps. acc_s: S of key tile n_block and the query tile that `policy` was
// built for, replaced by P; in: that tile's load_inputs(), which a main loop issues ahead of the
// S GEMM.
template <int kRows, int kCols, typename Policy, typename AccS, typename Coords>
__device__ __forceinline__ void probabilities(const Policy& policy, const typename Policy::TileInputs& in, int n_block,
                                              bool elementwise, const BackwardRowStats<kRows>& stats, AccS& acc_s,
                                              const Coords& coords, SoftcapGrads<kRows, kCols>& cap) {
  using namespace cute;
  Tensor s = make_tensor(acc_s.data(), accumulator_as_rows_cols(acc_s.layout()));
  const bool capped = policy.softcap > 0.f;
  float lse_log2[kRows];
  stats.lse_log2(lse_log2);
  policy.apply(acc_s, coords, n_block, elementwise, in, [&](int r, int c, float z, float dcap) {
    s(r, c) = exp2f(fmaf(z, kLog2e, -lse_log2[r]));
    if (capped) cap.dcap[r][c] = dcap;
  });
}

// The second: acc_p: P from probabilities(); acc_dp: dP of the same tile, replaced by dZ.
// apply_softcap_grads() then makes it dS.
template <int kRows, typename AccS>
__device__ __forceinline__ void logit_gradients(const BackwardRowStats<kRows>& stats, const AccS& acc_p, AccS& acc_dp) {
  using namespace cute;
  Tensor prob = make_tensor(acc_p.data(), accumulator_as_rows_cols(acc_p.layout()));
  Tensor dz = make_tensor(acc_dp.data(), accumulator_as_rows_cols(acc_dp.layout()));
  constexpr int kCols = decltype(size<1>(dz))::value;
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) dz(r, c) = prob(r, c) * (dz(r, c) - stats.dsum[r]);
  }
}

// The same, adding dZ to dBias.
template <int kBlockN, int kRows, typename AccS, typename Coords, typename DBias>
__device__ __forceinline__ void logit_gradients_from_p(const BackwardParams& p, int h, int row0, int n_block,
                                                       const BackwardRowStats<kRows>& stats, const AccS& acc_p,
                                                       AccS& acc_dp, const Coords& coords, DBias& dbias) {
  using namespace cute;
  logit_gradients(stats, acc_p, acc_dp);
  Tensor coords_rc = make_tensor(coords.data(), accumulator_as_rows_cols(coords.layout()));
  Tensor dz = make_tensor(acc_dp.data(), accumulator_as_rows_cols(acc_dp.layout()));
  dbias.add_tile(dz, coords_rc, h, row0, n_block * kBlockN, p.fwd.seqlen_q, p.fwd.seqlen_k);
}

}  // namespace flash_dmattn::kernels
