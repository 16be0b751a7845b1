// The way through a masked call: "tile" walks the key tiles the tile summary leaves active;
// "gather" computes only the keys some row of a query tile keeps, from per-tile key lists (sm80
// kernels; docs/architecture.md), in the forward and, where the gather backward runs, the
// backward. FLASH_DMATTN_SPARSE_PATH=auto (the default) takes the gather path for the passes whose
// prepared mask chose it and the tile path otherwise: only a preparation, made once per mask,
// may wait for the GPU to learn the lists' sizes (listed_share).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "backend.h"
#include "kernels/common/index_bits.h"
#include "kernels/common/key_lists.h"
#include "kernels/params.h"

namespace flash_dmattn {

inline constexpr const char* kSparsePathVariable = "FLASH_DMATTN_SPARSE_PATH";
enum class SparsePath { automatic, tile, gather };

// The path FLASH_DMATTN_SPARSE_PATH asks for; a value it does not know sets *error.
SparsePath sparse_path(std::string* error = nullptr);

// The gather path needs keys to choose and rows that choose them: a mask with a key dim and a row
// per query. (A mask with one row for every query would give every query tile the same list, yet
// each tile gets Sk keys of room: 8 GB for 8 x 131072 keys.) With one query (decode) its one row
// is that row.
bool gather_possible(const std::optional<TensorView>& mask, std::int64_t seqlen_q);

// Whether a pass of a call takes the gather path: FLASH_DMATTN_SPARSE_PATH=gather forces it
// where it is possible, tile forbids it, and auto follows the prepared mask's choice.
bool gather_applies(const std::optional<TensorView>& mask, std::int64_t seqlen_q, const PreparedMask* prepared,
                    BackendImpl::Pass pass);

// The share of the key span (the keys the causal limit leaves each query tile, in whole chunks)
// up to which the key lists' keys (their union, in whole chunks) make the gather path the faster
// one, per pass. Measured on an H200 with the bench CLI (seed: B1 H2/1 S16384 D32, causal, top-W
// of a bias row; sm90a tile kernels, prepared masks), fwd / bwd ms: at a share of 0.12 (W 1024)
// gathered 0.23 / 0.36 against tile 0.69 / 2.87; at 0.44 (W 4096) 0.53 / 0.62 against 0.60 /
// 2.66; at 0.75 (W 8192) 0.73 / 0.92 against 0.53 / 2.14; at 1.0 (W 16384) 1.05 / 1.25 against
// 0.39 / 2.01. A line through the gathered forwards crosses the tile forward near 0.53; the
// gathered backward stays faster at every share. At D128 (B2 H16/4 S8192, 2048 scattered keys,
// a share of about 0.45) the gather path is 2.4x (fwd) and 2.6x (bwd) faster; its crossover
// there, and anything at D64, is not measured: those backwards keep the forward's threshold.
inline constexpr double kGatherForwardShare = 0.5;
inline double gather_backward_share(std::int64_t head_dim) { return head_dim <= 32 ? 1.0 : kGatherForwardShare; }
// A decode (one query row) pays less for its gathers: its kept keys are split across CTAs, each
// walking a few chunks one after the other, while the tile path streams the keys at memory speed.
// Measured on an H200 (bench CLI decode suite, B1 H32/8 D128, top-4096; prepared gather against
// unprepared tile, ms): share 0.5 (Sk 8192) 0.120 against 0.094; 0.125 (Sk 32768) 0.116 against
// 0.133; 0.031 (Sk 131072) 0.123 against 0.259. The threshold lies between the first two.
inline constexpr double kGatherDecodeShare = 0.25;
inline double gather_forward_share(std::int64_t seqlen_q) {
  return seqlen_q == 1 ? kGatherDecodeShare : kGatherForwardShare;
}

// Key indices (B|1, H|Hk|1, Sq|1, K) as the bits pass reads them: strides of 0 where they broadcast.
kernels::IndexRows index_rows(const TensorView& indices);

// The share of the key span that lists just built on `stream` hold, or -1 where it cannot be
// known: waits for the lists and reads their sizes back, the one synchronization of a
// preparation under FLASH_DMATTN_SPARSE_PATH=auto. A stream being captured into a CUDA graph
// cannot wait (docs/python.md): -1.
cudaError_t listed_share(const kernels::KeyListExtent& extent, const kernels::KeyLists& lists, cudaStream_t stream,
                         double* share);

}  // namespace flash_dmattn
