// A CTA per row block (kSummaryBlock rows) and kCtaStrips strips of kStripBlocks summary blocks
// along the keys: per block, the OR of "some key visible" and "some key hidden" over its elements
// inside the mask, one byte out; and the strip's elements as bits, written as whole words. Every
// thread has a 16-byte load of each of its warp's rows in flight, and the next strip's loads fly
// while a strip is summarized: the mask's read (as large as the attention's K and V on long
// sequences) needs many bytes in flight to run at memory bandwidth. A mask with a single row gets a
// kernel of its own (below).
// Measured under Nsight Compute on an H200, the all-true causal masks of the D32 benchmark
// (16384 x 16384, 134 MB read) and of the D128 one (2 x 4 x 8192 x 8192, 268 MB read):
//  - a CTA per strip, the bytes tested one by one: 66.6 us for the D32 mask (47% of DRAM bandwidth);
//  - the bytes tested four to a word (nonzero_nibble): 59.0 and 112 us;
//  - four strips per CTA, the next one's loads in flight: 55.6 and 108 us, at 109 registers;
//  - the same capped at 80 registers for three CTAs per SM: 49.1 us (63%) and 90.3 us (70%).
//    Two strips per CTA measured 45.7 and 94.1, eight 57.6 and 94.1; four CTAs per SM (64
//    registers, 144 bytes of spills) 67.4 and 125.
#include "kernels/common/tile_summary.h"

#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kStripBlocks = 8;
constexpr int kCtaStrips = 4;  // strips per CTA, one row block
constexpr int kStripCols = kStripBlocks * kSummaryBlock;
constexpr int kStripWords = kStripCols / 32;
constexpr int kVectorsPerBlock = kSummaryBlock / 16;  // 16-byte vectors per row of a block
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kSummaryBlock / kWarps;
static_assert(kStripCols == 32 * 16, "the vectorized path gives a lane one 16-byte vector of each row");
static_assert(kStripBlocks <= 8, "a block's flags are one byte of a 64-bit word");

__host__ __device__ std::int64_t blocks_of(std::int64_t n) { return (n + kSummaryBlock - 1) / kSummaryBlock; }
__host__ __device__ std::int64_t words_of(std::int64_t cols) { return (cols + 31) / 32; }
std::size_t classes_bytes(const MaskExtent& mask) {
  return static_cast<std::size_t>(mask.batches * mask.heads * blocks_of(mask.rows) * blocks_of(mask.cols));
}
// The bits start 16-byte aligned after the classes.
std::size_t bits_offset(const MaskExtent& mask) { return (classes_bytes(mask) + 15) / 16 * 16; }

// The grid (folded into grid.x, launch.h): x the CTAs along the keys, y the row blocks, z the
// mask's (batch, head).
__host__ __device__ GridShape summary_grid_shape(const MaskExtent& mask) {
  const std::int64_t cta_blocks = std::int64_t(kStripBlocks) * kCtaStrips;
  return {(blocks_of(mask.cols) + cta_blocks - 1) / cta_blocks, blocks_of(mask.rows), mask.batches * mask.heads};
}

// Bit i set where byte i of the word is nonzero, for i < 4: (b & 0x7f) + 0x7f has its top bit
// set iff the low seven bits are not all zero, and cannot carry into the next byte (at most
// 0xfe); or-ed with b, the top bit says b != 0. The multiply moves the four top bits (7, 15, 23,
// 31) to bits 28-31; its other partial products land on distinct lower bits, so nothing carries.
// Five instructions a word; testing the 16 bytes one by one left the build issue-bound (above).
__device__ __forceinline__ std::uint32_t nonzero_nibble(std::uint32_t word) {
  const std::uint32_t top = (((word & 0x7f7f7f7fu) + 0x7f7f7f7fu) | word) & 0x80808080u;
  return (top * 0x00204081u) >> 28;
}

// Bit i set where byte i of the 16 is nonzero.
__device__ __forceinline__ std::uint32_t nonzero_bytes(const uint4& v) {
  return nonzero_nibble(v.x) | nonzero_nibble(v.y) << 4 | nonzero_nibble(v.z) << 8 | nonzero_nibble(v.w) << 12;
}

// The strip of the CTA's row block that starts at key c0, as this CTA reads it.
struct Strip {
  std::int64_t c0;
  int cols;           // keys of the strip inside the mask
  int seen;           // keys before this one are visible to some row of the block (causal)
  int vector_blocks;  // leading summary blocks read as 16-byte vectors
  const std::uint8_t* base;
};

// Every lane's 16-byte vector of each of its warp's rows of the strip's vectorized blocks (zeros
// where it reads none), all loads issued before any is used.
__device__ __forceinline__ void load_vectors(const Strip& strip, const MaskExtent& mask, int rows,
                                             uint4 (&v)[kRowsPerWarp]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, block = lane / kVectorsPerBlock;
  const bool lane_reads = block < strip.vector_blocks && block * kSummaryBlock < strip.seen;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int row = warp + i * kWarps;
    v[i] = lane_reads && row < rows ? *reinterpret_cast<const uint4*>(strip.base + row * mask.row_stride + lane * 16)
                                    : make_uint4(0, 0, 0, 0);
  }
}

// Three CTAs per SM: at most 80 registers a thread (measured above).
__global__ void __launch_bounds__(kThreads, 3) tile_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                 std::uint32_t* bits_out) {
  __shared__ std::uint32_t words[kSummaryBlock][kStripWords];
  __shared__ __align__(8) std::uint8_t flags[8];
  const GridCoords cta = unfold_block(summary_grid_shape(mask));
  let_next_grid_start();  // the forward, launched early, waits for this kernel to finish
  const std::int64_t col_blocks = blocks_of(mask.cols), row_blocks = blocks_of(mask.rows);
  const std::int64_t bh = cta.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::int64_t r0 = std::int64_t(cta.y) * kSummaryBlock;
  const int rows = static_cast<int>(mask.rows - r0 < kSummaryBlock ? mask.rows - r0 : kSummaryBlock);
  const std::uint8_t* row0 = mask.ptr + b * mask.batch_stride + h * mask.head_stride + r0 * mask.row_stride;
  // Keys at or past `seen_end` are causally hidden from every row of the block.
  std::int64_t seen_end = mask.cols;
  if (mask.causal) {
    const std::int64_t last_key = r0 + rows - 1 + mask.diagonal;
    seen_end = last_key < 0 ? 0 : (last_key + 1 < mask.cols ? last_key + 1 : mask.cols);
  }
  const std::int64_t first_c0 = std::int64_t(cta.x) * kCtaStrips * kStripCols;
  auto strip_at = [&](int s) {
    Strip strip;
    strip.c0 = first_c0 + std::int64_t(s) * kStripCols;
    strip.cols = static_cast<int>(mask.cols - strip.c0 < kStripCols ? mask.cols - strip.c0 : kStripCols);
    strip.seen = static_cast<int>(seen_end <= strip.c0 ? 0 : (seen_end - strip.c0 < strip.cols ? seen_end - strip.c0 : strip.cols));
    strip.base = row0 + strip.c0 * mask.col_stride;
    // Whole blocks of 16-byte-aligned rows.
    const bool aligned = mask.col_stride == 1 && mask.row_stride % 16 == 0 &&
                         reinterpret_cast<std::uintptr_t>(strip.base) % 16 == 0;
    strip.vector_blocks = aligned ? strip.cols / kSummaryBlock : 0;
    return strip;
  };
  // This CTA's strips, and those of them some row of the block can see (a prefix): the others get
  // class 0 and no reads.
  auto strips_before = [&](std::int64_t end) {
    const std::int64_t n = end > first_c0 ? (end - first_c0 + kStripCols - 1) / kStripCols : 0;
    return static_cast<int>(n < kCtaStrips ? n : kCtaStrips);
  };
  const int strips = strips_before(mask.cols), visible_strips = strips_before(seen_end);
  // The class bytes of the blocks of the strip at key c0: flags[k] for block k, or 0 (no flags).
  auto store_classes = [&](std::int64_t c0, const std::uint8_t* block_flags) {
    const std::int64_t block = c0 / kSummaryBlock + threadIdx.x;
    if (threadIdx.x < kStripBlocks && block < col_blocks) {
      out[(bh * row_blocks + cta.y) * col_blocks + block] = block_flags ? block_flags[threadIdx.x] : 0;
    }
  };
  for (int s = visible_strips; s < strips; ++s) store_classes(first_c0 + std::int64_t(s) * kStripCols, nullptr);

  uint4 v[kRowsPerWarp];
  if (visible_strips > 0) load_vectors(strip_at(0), mask, rows, v);
  for (int s = 0; s < visible_strips; ++s) {
    const Strip strip = strip_at(s);
    // The next strip's loads fly while this one is summarized.
    uint4 next[kRowsPerWarp] = {};
    if (s + 1 < visible_strips) load_vectors(strip_at(s + 1), mask, rows, next);
    std::uint32_t* bits_row0 = bits_out + (bh * mask.rows + r0) * words_of(mask.cols) + strip.c0 / 32;
    const int first_col = strip.vector_blocks * kSummaryBlock;
    const int scalar_cols = strip.seen > first_col ? strip.seen - first_col : 0;
    if (threadIdx.x < 8) flags[threadIdx.x] = 0;
    if (scalar_cols > 0) {
      for (int i = threadIdx.x; i < kSummaryBlock * kStripWords; i += kThreads) words[i / kStripWords][i % kStripWords] = 0;
    }
    __syncthreads();  // flags (and words) cleared, the last strip's readers of both done

    // Lane l of a warp holds vector l of a row (the warp one row's kStripCols contiguous bytes per
    // load), warp w rows w, w + kWarps, ... The 16 bits of a vector pair up across neighbouring
    // lanes into the row's words; the kVectorsPerBlock lanes of a block OR their flags over the rows.
    if (strip.vector_blocks > 0) {  // uniform: every lane takes part in the shuffles
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, block = lane / kVectorsPerBlock;
      const bool lane_reads = block < strip.vector_blocks && block * kSummaryBlock < strip.seen;
      bool visible = false, hidden = false;
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int row = warp + i * kWarps;
        const bool read = lane_reads && row < rows;
        const std::uint32_t keep = nonzero_bytes(v[i]);
        const std::uint32_t pair = keep | (__shfl_down_sync(0xffffffffu, keep, 1) << 16);
        if (read && lane % 2 == 0) bits_row0[row * words_of(mask.cols) + lane / 2] = pair;
        visible |= read && keep != 0;
        hidden |= read && keep != 0xffffu;
      }
      unsigned block_flags = (visible ? kTileHasVisible : 0) | (hidden ? kTileHasHidden : 0);
      for (int lanes = 1; lanes < kVectorsPerBlock; lanes *= 2) block_flags |= __shfl_xor_sync(0xffffffffu, block_flags, lanes);
      if (lane % kVectorsPerBlock == 0 && block_flags) {
        atomicOr(reinterpret_cast<unsigned long long*>(flags), (unsigned long long)block_flags << (8 * block));
      }
    }

    // The rest of the strip element by element: a block cut by the end of the keys, or every
    // block of a mask whose rows are not 16-byte aligned.
    if (scalar_cols > 0) {
      unsigned long long my_flags = 0;  // byte k: block k's flags
      for (int e = threadIdx.x; e < rows * scalar_cols; e += kThreads) {
        const int row = e / scalar_cols, col = first_col + e % scalar_cols;
        const bool keep = strip.base[row * mask.row_stride + col * mask.col_stride] != 0;
        my_flags |= (unsigned long long)(keep ? kTileHasVisible : kTileHasHidden) << (8 * (col / kSummaryBlock));
        if (keep) atomicOr(&words[row][col / 32], 1u << (col % 32));
      }
      if (my_flags) atomicOr(reinterpret_cast<unsigned long long*>(flags), my_flags);
    }
    __syncthreads();
    if (scalar_cols > 0) {
      const int first_word = first_col / 32, scalar_words = static_cast<int>(words_of(strip.cols)) - first_word;
      for (int i = threadIdx.x; i < rows * scalar_words; i += kThreads) {
        const int row = i / scalar_words, w = first_word + i % scalar_words;
        bits_row0[row * words_of(mask.cols) + w] = words[row][w];
      }
      __syncthreads();  // words read before the next strip clears them
    }
    store_classes(strip.c0, flags);
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) v[i] = next[i];
  }
}

// A mask with one row for every query (decode masks, key-padding masks): the kernel above gives
// a 64-row block 256 threads, so here all but 4 of them would idle. Instead every thread
// summarizes kRowVectors runs of 16 keys, their loads all in flight at once, and the 4 threads
// of a 64-key block combine their flags by shuffles. Measured under Nsight Compute on an H200
// (the decode benchmark's 1 x 8 x 1 x 131072 mask): 19.2 us with the kernel above, 4.6 here
// with 4 runs a thread. A decode's forward waits for this kernel, so its latency counts more
// than its loads in flight: one run a thread spreads the mask over 4x the CTAs. Torch profiler,
// H200, decode masks (1, 8, 1, Sk): 4 runs -> 1 run 1.7 -> 1.3 us at Sk 1024, 3.4 -> 1.8 at
// 16384, 3.6 -> 1.9 at 65536, 3.7 -> 2.1 at 131072 (2 runs: 1.4, 2.4, 2.5, 2.6).
constexpr int kRowVectors = 1;
constexpr int kRowRunCols = 16;
constexpr int kRowCtaCols = kThreads * kRowRunCols * kRowVectors;
static_assert(kSummaryBlock % kRowRunCols == 0 && 32 % (kSummaryBlock / kRowRunCols) == 0,
              "a block's runs sit in adjacent lanes of one warp");

// x the CTAs along the keys, z the mask's (batch, head).
__host__ __device__ GridShape row_summary_grid_shape(const MaskExtent& mask) {
  return {(mask.cols + kRowCtaCols - 1) / kRowCtaCols, 1, mask.batches * mask.heads};
}

__global__ void __launch_bounds__(kThreads) row_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                std::uint32_t* bits_out) {
  const GridCoords cta = unfold_block(row_summary_grid_shape(mask));
  let_next_grid_start();  // the forward, launched early, waits for this kernel to finish
  const std::int64_t bh = cta.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::uint8_t* row = mask.ptr + b * mask.batch_stride + h * mask.head_stride;
  const bool aligned = mask.col_stride == 1 && reinterpret_cast<std::uintptr_t>(row) % 16 == 0;
  std::uint32_t* bits = bits_out + bh * words_of(mask.cols);
  std::uint8_t* classes = out + bh * blocks_of(mask.cols);
  auto first_col = [&](int k) {
    return (std::int64_t(cta.x) * kRowVectors + k) * (kThreads * kRowRunCols) + threadIdx.x * kRowRunCols;
  };

  std::uint32_t keep[kRowVectors];  // bit i: key first_col(k) + i is visible
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    const std::int64_t c = first_col(k);
    if (aligned && c + kRowRunCols <= mask.cols) {
      keep[k] = nonzero_bytes(*reinterpret_cast<const uint4*>(row + c));
    } else {
      keep[k] = 0;
      for (int i = 0; i < kRowRunCols && c + i < mask.cols; ++i) {
        keep[k] |= std::uint32_t(row[(c + i) * mask.col_stride] != 0) << i;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kRowVectors; ++k) {
    const std::int64_t c = first_col(k);
    const std::uint32_t pair = keep[k] | (__shfl_down_sync(0xffffffffu, keep[k], 1) << 16);
    if (threadIdx.x % 2 == 0 && c < mask.cols) bits[c / 32] = pair;
    const int valid = c >= mask.cols ? 0 : static_cast<int>(mask.cols - c < kRowRunCols ? mask.cols - c : kRowRunCols);
    const std::uint32_t all = (1u << valid) - 1u;
    unsigned flags = unsigned(keep[k] != 0 ? kTileHasVisible : 0) | unsigned(keep[k] != all ? kTileHasHidden : 0);
    if (valid == 0) flags = 0;
    for (int lanes = 1; lanes < kSummaryBlock / kRowRunCols; lanes *= 2) flags |= __shfl_xor_sync(0xffffffffu, flags, lanes);
    if (threadIdx.x % (kSummaryBlock / kRowRunCols) == 0 && c < mask.cols) classes[c / kSummaryBlock] = flags;
  }
}

// A bit-packed mask holds a summary block's 64 keys in 8 bytes of a row. A warp lies along a row:
// lane i takes the CTA's i-th block, so each load instruction reads 256 contiguous bytes of one
// row, and each store writes them back as the row's bits (little-endian: key j is bit j % 32 of
// word j / 32, as in the bytes), the bits past the keys cleared. The CTA's kPackedRowGroups groups
// of kPackedCtaBlocks threads split the row block's rows; a thread loads all of its rows before
// it tests or stores any (a store may alias the mask for all the compiler knows, so loads behind
// one would wait for it), ORs the flags in registers, and the groups' flags meet in shared memory.
// The first layout, a thread per (row, block) with a warp's lanes on 32 rows, took 67 us a call for
// the seed's 16384 x 16384 causal mask on an H200 (33.5 MB, about 0.5 TB/s), against 49 us for
// the bool mask's 268 MB; this one takes 15 us (docs/architecture.md, bit-packed masks).
constexpr int kPackedCtaBlocks = 64;
constexpr int kPackedRowGroups = kThreads / kPackedCtaBlocks;
constexpr int kPackedRowsPerThread = kSummaryBlock / kPackedRowGroups;
static_assert(kPackedCtaBlocks % 32 == 0, "a warp's lanes lie along one row");

__host__ __device__ GridShape packed_summary_grid_shape(const MaskExtent& mask) {
  return {(blocks_of(mask.cols) + kPackedCtaBlocks - 1) / kPackedCtaBlocks, blocks_of(mask.rows), mask.batches * mask.heads};
}

__global__ void __launch_bounds__(kThreads) packed_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                   std::uint32_t* bits_out) {
  __shared__ unsigned flags[kPackedRowGroups][kPackedCtaBlocks];
  const GridCoords cta = unfold_block(packed_summary_grid_shape(mask));
  let_next_grid_start();  // the forward, launched early, waits for this kernel to finish
  const std::int64_t col_blocks = blocks_of(mask.cols), row_blocks = blocks_of(mask.rows);
  const std::int64_t bh = cta.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::int64_t r0 = std::int64_t(cta.y) * kSummaryBlock;
  const int rows = static_cast<int>(mask.rows - r0 < kSummaryBlock ? mask.rows - r0 : kSummaryBlock);
  const int local = threadIdx.x % kPackedCtaBlocks, group = threadIdx.x / kPackedCtaBlocks;
  const std::int64_t block = std::int64_t(cta.x) * kPackedCtaBlocks + local, c0 = block * kSummaryBlock;
  // Keys at or past `seen_end` are causally hidden from every row of the block: not summarized.
  std::int64_t seen_end = mask.cols;
  if (mask.causal) {
    const std::int64_t last_key = r0 + rows - 1 + mask.diagonal;
    seen_end = last_key < 0 ? 0 : (last_key + 1 < mask.cols ? last_key + 1 : mask.cols);
  }
  unsigned block_flags = 0;
  if (block < col_blocks && c0 < seen_end) {
    const std::uint8_t* column = mask.ptr + b * mask.batch_stride + h * mask.head_stride + c0 / 8;
    const int keys = static_cast<int>(mask.cols - c0 < kSummaryBlock ? mask.cols - c0 : kSummaryBlock);
    const bool whole_words = keys == kSummaryBlock && reinterpret_cast<std::uintptr_t>(column) % 8 == 0 &&
                             mask.row_stride % 8 == 0;
    std::uint64_t v[kPackedRowsPerThread] = {};
    if (whole_words) {
#pragma unroll
      for (int i = 0; i < kPackedRowsPerThread; ++i) {
        const int row = group + i * kPackedRowGroups;
        if (row < rows) v[i] = *reinterpret_cast<const std::uint64_t*>(column + (r0 + row) * mask.row_stride);
      }
    } else {  // the keys' last block, or rows not 8-byte aligned
#pragma unroll
      for (int i = 0; i < kPackedRowsPerThread; ++i) {
        const int row = group + i * kPackedRowGroups;
        if (row >= rows) continue;
        const std::uint8_t* bytes = column + (r0 + row) * mask.row_stride;
        for (int k = 0; k < (keys + 7) / 8; ++k) v[i] |= std::uint64_t(bytes[k]) << (8 * k);
      }
    }
    const auto first = [](int n) { return n >= 64 ? ~0ull : (1ull << n) - 1ull; };
    const int counted = static_cast<int>(seen_end - c0 < keys ? seen_end - c0 : keys);
    const std::uint64_t in = first(counted), inside = first(keys);
    std::uint32_t* words = bits_out + (bh * mask.rows + r0) * words_of(mask.cols) + c0 / 32;
#pragma unroll
    for (int i = 0; i < kPackedRowsPerThread; ++i) {
      const int row = group + i * kPackedRowGroups;
      if (row >= rows) continue;
      const std::uint64_t bits = v[i] & inside, keep = bits & in;
      block_flags |= (keep != 0 ? kTileHasVisible : 0u) | (keep != in ? kTileHasHidden : 0u);
      std::uint32_t* row_words = words + std::int64_t(row) * words_of(mask.cols);
      row_words[0] = static_cast<std::uint32_t>(bits);
      if (keys > 32) row_words[1] = static_cast<std::uint32_t>(bits >> 32);
    }
  }
  flags[group][local] = block_flags;
  __syncthreads();
  if (group == 0 && block < col_blocks) {
    unsigned all = 0;
#pragma unroll
    for (int g = 0; g < kPackedRowGroups; ++g) all |= flags[g][local];
    out[(bh * row_blocks + cta.y) * col_blocks + block] = static_cast<std::uint8_t>(all);
  }
}

}  // namespace

std::size_t tile_summary_bytes(const MaskExtent& mask) {
  const std::int64_t bit_words = mask.batches * mask.heads * mask.rows * words_of(mask.cols);
  return bit_words == 0 ? 0 : bits_offset(mask) + static_cast<std::size_t>(bit_words) * sizeof(std::uint32_t);
}

TileSummary describe_tile_summary(const MaskExtent& mask, void* memory) {
  TileSummary s;
  TileSummary* summary = &s;
  const std::int64_t row_blocks = blocks_of(mask.rows), col_blocks = blocks_of(mask.cols);
  auto* out = static_cast<std::uint8_t*>(memory);
  summary->classes = out;
  summary->batch_stride = mask.batches == 1 ? 0 : mask.heads * row_blocks * col_blocks;
  summary->head_stride = row_blocks * col_blocks;
  summary->row_stride = mask.rows == 1 ? 0 : col_blocks;
  summary->col_stride = mask.cols == 1 ? 0 : 1;
  summary->head_divisor = mask.head_divisor;
  const std::int64_t row_words = words_of(mask.cols);
  auto* bits = reinterpret_cast<std::uint32_t*>(out + bits_offset(mask));
  summary->bits = bits;
  summary->bits_batch_stride = mask.batches == 1 ? 0 : mask.heads * mask.rows * row_words;
  summary->bits_head_stride = mask.rows * row_words;
  summary->bits_row_stride = mask.rows == 1 ? 0 : row_words;
  summary->bits_row_words = static_cast<int>(row_words);
  return s;
}

cudaError_t build_tile_summary(const MaskExtent& mask, void* workspace, cudaStream_t stream, TileSummary* summary) {
  *summary = describe_tile_summary(mask, workspace);
  if (tile_summary_bytes(mask) == 0) return cudaSuccess;
  auto* out = static_cast<std::uint8_t*>(workspace);
  auto* bits = const_cast<std::uint32_t*>(summary->bits);
  if (mask.packed) {
    return launch_folded<0>(&packed_summary_kernel, packed_summary_grid_shape(mask), kThreads, stream, mask, out, bits);
  }
  if (mask.rows == 1 && !mask.causal) {
    return launch_folded<0>(&row_summary_kernel, row_summary_grid_shape(mask), kThreads, stream, mask, out, bits);
  }
  return launch_folded<0>(&tile_summary_kernel, summary_grid_shape(mask), kThreads, stream, mask, out, bits);
}

}  // namespace flash_dmattn::kernels
