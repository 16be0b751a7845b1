// The way through a masked call: "tile" walks the key tiles the tile summary leaves active;
// "gather" computes only the keys some row of a query tile keeps, from per-tile key lists (sm80
// kernels; docs/architecture.md), in the forward and, where the gather backward runs, the
// backward. FLASH_DMATTN_SPARSE_PATH=auto (the default) takes the gather path for the passes whose
// prepared mask chose it and the tile path otherwise: only a preparation, made once per mask,
// may wait for the GPU to learn the lists' sizes (listed_work).
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
// where it is possible, tile forbids it, and auto follows the prepared mask's choice, for a
// backward the one for its kernel: heads_pair, whether its gather backward would take two query
// heads per CTA (PreparedMask::gather_backward, else gather_backward_unpaired).
bool gather_applies(const std::optional<TensorView>& mask, std::int64_t seqlen_q, const PreparedMask* prepared,
                    BackendImpl::Pass pass, bool heads_pair = false);

// The share of the tile path's work (the blocks of block_n keys that hold a listed key, which
// the tile path visits for the list's rows) up to which the key lists' keys (their union, in
// whole chunks of block_n) make the gather path the faster one, per pass and kernel family. For a
// scattered mask every block holds a key, and the tile path's work is the whole causal span.
//
// sm90a (measured on an H100 with the bench CLI's crossover suite: B2 H16/4 S8192 causal, top-W of
// a bias row, prepared masks held to each path; forward / backward gpu ms, gather against tile):
//   share   D128 fwd       D128 bwd       D64 fwd        D64 bwd
//   0.24    0.43 / 1.94    2.80 / 7.38    0.35 / 1.84    1.69 / 5.53
//   0.61    0.92 / 1.82    6.49 / 7.09    0.75 / 1.72    3.73 / 5.20
//   0.75    1.11 / 1.78    7.86 / 6.88    0.91 / 1.68    4.50 / 4.96
//   0.94    1.37 / 1.50    9.69 / 6.19    1.12 / 1.38    5.52 / 4.42
//   1.0     1.47 / 1.10   10.24 / 5.43    1.21 / 0.92    5.81 / 3.84
// The sm90a gather forward wins up to a share between 0.94 and 1; the gathered backward (sm80
// kernels) against the sm90a tile backward up to about 0.66 at D128 and 0.81 at D64 (lines
// through the two points around each crossing). The shares are gather_pays's: 0.617, 0.756 and
// 0.94 at W 3072, 4096 and 6144 with the D128 lists (64 x 64 chunks).
//
// A sliding window lists the keys of its visible tiles: one chunk per visible block, a share of
// 1.0 (query tiles start on a block), whatever its share of the span, where the tile path's tiles
// are full. On an H200 (bench CLI `--suite windows`, B2 H16/4 S8192 causal, gpu ms, gather / tile)
// D128: W 256 fwd 0.20 / 0.25, bwd 1.06 / 0.90; W 512 0.28 / 0.30, 1.66 / 1.19; W 1024 0.43 /
// 0.40, 2.80 / 1.72; W 4096 1.10 / 0.87, 7.95 / 4.25. D64 alike (W 256 bwd 0.73 / 0.64).
//
// sm80 (an H200 with the sm90a tile kernels, seed B1 H2/1 S16384 D32; fwd / bwd ms): at a share of
// 0.12 gathered 0.23 / 0.36 against tile 0.69 / 2.87; at 0.44 0.53 / 0.62 against 0.60 / 2.66; at
// 0.75 0.73 / 0.92 against 0.53 / 2.14; at 1.0 1.05 / 1.25 against 0.39 / 2.01. A line through
// the sm80 gathered forwards crosses the tile forward near 0.53; the gathered backward was then
// faster at every share (no longer: kD32GatherBackwardShare).
// At D32 the sm90a gather forward was only 1.2x the sm80 one (seed top-1024: 0.046 against 0.056
// gpu ms, one H100), against 1.7x at D128, and its crossover there is not measured: D32 keeps the
// sm80 threshold.
inline constexpr double kGatherForwardShare = 0.5;       // the sm80 gather forward, and D32
inline constexpr double kSm90aGatherForwardShare = 0.9;  // the sm90a gather forward, D > 32
// The gather backward's kernels, whose crossovers differ: the sm80 one with a query head per CTA,
// with two (BackwardParams::pair_heads; gather_backward_pairs in cuda_backend.cpp), and the sm90a
// one, which takes two always (sm90a_gather_backward there).
enum class GatherBackwardKernel { sm80, sm80_paired, sm90a_paired };
// sm80_paired: measured so on an H200 (2026-11-27, the crossover suite at D128, gpu ms,
// gathered / tile): share 0.44 3.58 / 7.40, 0.62 4.86 / 7.25, 0.76 5.89 / 6.99, 0.94 7.20 / 6.28,
// 1.0 7.54 / 5.33: the lines cross near 0.86.
inline constexpr double kPairedGatherBackwardShare = 0.8;
// sm90a_paired: the same suite on an H200 (2026-11-27): share 0.76 4.60 / 6.98, 0.94 5.66 /
// 6.28, 1.0 5.91 / 5.33: the lines cross near 0.97.
inline constexpr double kSm90aPairedGatherBackwardShare = 0.95;
// D32, every kernel. Since the tile backward shares a KV head's query heads among CTAs on small
// grids (head splits), a full mask's tile backward beats the gathered one. Measured on an H200
// (2026-11-29, bench CLI `--suite seed --modes bwd --impl ours_tile --impl ours_gather`, B1 H2/1
// S16384 D32 causal, prepared masks held to each path, gpu ms, gathered / tile): top-4096 (a share
// of 0.44) 0.492 / 1.019, top-8192 (0.75) 0.741 / 0.992, top-16384 (1.0, every tile full) 0.973 /
// 0.644. Scattered keys keep the tile backward near 1 ms at every share (its tiles stay partly
// visible), so only full tiles make it the faster one.
inline constexpr double kD32GatherBackwardShare = 0.9;
inline double gather_backward_share(std::int64_t head_dim, GatherBackwardKernel kernel) {
  if (head_dim <= 32) return kD32GatherBackwardShare;
  switch (kernel) {
    case GatherBackwardKernel::sm90a_paired: return kSm90aPairedGatherBackwardShare;
    case GatherBackwardKernel::sm80_paired: return kPairedGatherBackwardShare;
    case GatherBackwardKernel::sm80: break;
  }
  return head_dim <= 64 ? 0.8 : 0.65;  // D96: its tile backward is sm80's, slower than sm90a's
}
// A decode (one query row) pays less for its gathers: its kept keys are split across CTAs, each
// walking a few chunks one after the other, while the tile path streams the keys at memory speed.
// Measured on an H200 (bench CLI decode suite, B1 H32/8 D128, top-4096; prepared gather against
// unprepared tile, ms): share 0.5 (Sk 8192) 0.120 against 0.094; 0.125 (Sk 32768) 0.116 against
// 0.133; 0.031 (Sk 131072) 0.123 against 0.259. The threshold lies between the first two.
inline constexpr double kGatherDecodeShare = 0.25;
// sm90a: whether the gather forward would run the sm90a kernel (gather_forward_family).
inline double gather_forward_share(std::int64_t seqlen_q, std::int64_t head_dim, bool sm90a) {
  if (seqlen_q == 1) return kGatherDecodeShare;
  return sm90a && head_dim > 32 ? kSm90aGatherForwardShare : kGatherForwardShare;
}

// The largest share at which a deferred preparation's build (list_gate in cuda_backend.cpp) keeps
// lists that the estimate from the summary bounds (ListEstimate): below the sm90a paired
// backward's share. The estimate's lower bound on the listed keys counts the whole 64-key blocks
// that rows see (and a key for some others), so only masks made of whole blocks come near it:
// sliding windows, whose lists never pay (a share of 1.0, one chunk per visible block), and
// block-sparse masks, whose tile path runs full tiles, faster than on the scattered masks that set
// the crossovers above. With the 64 x 64 lists of head dims 65 to 128, a window of 1024 keys is
// estimated at 16/17 (0.94) of its visible blocks in long sequences (S 4096: 0.933, S 2048: 0.922,
// kept); with the 64 x 128 lists of D <= 64 at 8/9 and those of D > 128 near 0.88, kept. A
// scattered top-k mask has no whole blocks and keeps its lists.
inline constexpr double kDeferredListsShare = 0.93;

// Where the tile path's visible tiles are this small a share of the span, its fixed costs
// (a CTA per row or column of tiles, each scanning the summary; issue 26) outweigh the gather's:
// the gather path then runs whatever the share of the blocks. Measured on an H200 (bench CLI,
// seed B1 H2/1 S16384 D32, top-1024 smoothed by 64-key blocks, 1-2% of the span visible (estimated);
// gpu ms, prepared, gather / tile): forward 0.040 / 0.062, backward 0.088 / 0.449. A window of
// 256 keys at S 8192 (about 0.09) keeps the rule above.
inline constexpr double kSparseTilesShare = 0.05;

// Key indices (B|1, H|Hk|1, Sq|1, K) as the bits pass reads them: strides of 0 where they broadcast.
kernels::IndexRows index_rows(const TensorView& indices);

// The work a mask's key lists describe, in chunks of block_n keys summed over the lists: the
// listed keys, the blocks that hold them (the tile path's work) and the causal span. Not known
// where the lists' sizes could not be read.
struct ListedWork {
  std::int64_t listed = 0, visible = 0, span = 0;
  bool known = false;
};

// The work of lists just built on `stream` by build_key_lists: waits for them and reads their
// sizes back, the one synchronization of a preparation under FLASH_DMATTN_SPARSE_PATH=auto. A
// stream being captured into a CUDA graph cannot wait (docs/python.md): not known.
cudaError_t listed_work(const kernels::KeyListExtent& extent, const kernels::KeyLists& lists, cudaStream_t stream,
                        ListedWork* work);
// The same from a host copy of the lists' sizes (list_sizes_bytes of them): the counts, then the
// block counts (KeyLists::counts and ::blocks, which lie back to back).
ListedWork listed_work(const kernels::KeyListExtent& extent, const int* sizes);
inline std::size_t list_sizes_bytes(const kernels::KeyListExtent& extent) {
  return 2 * static_cast<std::size_t>(extent.lists()) * sizeof(int);
}

// Whether the gather path pays for a pass whose threshold is `share` (the shares above): where
// the visible tiles are at most kSparseTilesShare of the span, or the listed keys at most `share`
// of the visible tiles' keys (kernels::lists_pay, which a forward choosing on the device applies).
bool gather_pays(const ListedWork& work, double share);

}  // namespace flash_dmattn
