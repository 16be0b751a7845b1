// One CTA per strip of kStripBlocks summary blocks along the keys (kSummaryBlock rows x
// kStripBlocks · kSummaryBlock keys): per block, the OR of "some key visible" and "some key
// hidden" over its elements inside the mask, one byte out; and the strip's elements as bits,
// written as whole words. A strip rather than a block per CTA: every thread has several 16-byte
// loads in flight, which the mask's read (as large as the attention's K and V on long sequences)
// needs to run at memory bandwidth. A mask with a single row gets a kernel of its own (below).
// Measured under Nsight Compute on an H200 (the all-true causal 16384 x 16384 mask of the D32
// benchmark, 134 MB read): 4-block strips with a thread per (row, vector) 74.9 us, 8-block
// strips 68.2, 8-block strips with a warp per row (this kernel) 66.6. That is 47% of DRAM
// bandwidth: the build is still latency-bound, and open.
#include "kernels/common/tile_summary.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kStripBlocks = 8;
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

// Bit i set where byte i of the 16 is nonzero.
__device__ __forceinline__ std::uint32_t nonzero_bytes(const uint4& v) {
  std::uint32_t bits = 0;
  int i = 0;
  for (const std::uint32_t word : {v.x, v.y, v.z, v.w}) {
    for (int byte = 0; byte < 4; ++byte, ++i) bits |= std::uint32_t(((word >> (8 * byte)) & 0xffu) != 0) << i;
  }
  return bits;
}

__global__ void __launch_bounds__(kThreads) tile_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                 std::uint32_t* bits_out) {
  __shared__ std::uint32_t words[kSummaryBlock][kStripWords];
  __shared__ __align__(8) std::uint8_t flags[8];
  const std::int64_t col_blocks = blocks_of(mask.cols), row_blocks = gridDim.y;
  const std::int64_t bh = blockIdx.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::int64_t r0 = std::int64_t(blockIdx.y) * kSummaryBlock, c0 = std::int64_t(blockIdx.x) * kStripCols;
  const int rows = static_cast<int>(mask.rows - r0 < kSummaryBlock ? mask.rows - r0 : kSummaryBlock);
  const int cols = static_cast<int>(mask.cols - c0 < kStripCols ? mask.cols - c0 : kStripCols);
  const std::uint8_t* base =
      mask.ptr + b * mask.batch_stride + h * mask.head_stride + r0 * mask.row_stride + c0 * mask.col_stride;
  std::uint32_t* bits_row0 = bits_out + (bh * mask.rows + r0) * words_of(mask.cols) + c0 / 32;
  if (threadIdx.x < 8) flags[threadIdx.x] = 0;
  // Keys of the strip at or past `seen` are causally hidden from every one of its rows.
  int seen = cols;
  if (mask.causal) {
    const std::int64_t last_key = r0 + rows - 1 + mask.diagonal;
    seen = static_cast<int>(last_key < c0 ? 0 : (last_key - c0 + 1 < cols ? last_key - c0 + 1 : cols));
  }

  for (int i = threadIdx.x; i < kSummaryBlock * kStripWords; i += kThreads) words[i / kStripWords][i % kStripWords] = 0;
  __syncthreads();  // flags and words cleared

  // Whole blocks of 16-byte-aligned rows: lane l of a warp reads vector l of a row (the warp one
  // row's kStripCols contiguous bytes per load), warp w rows w, w + kWarps, ..., all loads issued
  // before the first is used. The 16 bits of a vector pair up across neighbouring lanes into the
  // row's words; the kVectorsPerBlock lanes of a block OR their flags over the rows.
  const bool aligned = mask.col_stride == 1 && mask.row_stride % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(base) % 16 == 0;
  const int vector_blocks = aligned ? cols / kSummaryBlock : 0;
  if (vector_blocks > 0) {  // uniform: every lane takes part in the shuffles
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, block = lane / kVectorsPerBlock;
    const bool lane_reads = block < vector_blocks && block * kSummaryBlock < seen;
    uint4 v[kRowsPerWarp];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int row = warp + i * kWarps;
      v[i] = lane_reads && row < rows ? *reinterpret_cast<const uint4*>(base + row * mask.row_stride + lane * 16)
                                      : make_uint4(0, 0, 0, 0);
    }
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
  const int first_col = vector_blocks * kSummaryBlock;
  const int scalar_cols = seen > first_col ? seen - first_col : 0;
  unsigned long long my_flags = 0;  // byte k: block k's flags
  for (int e = threadIdx.x; e < rows * scalar_cols; e += kThreads) {
    const int row = e / scalar_cols, col = first_col + e % scalar_cols;
    const bool keep = base[row * mask.row_stride + col * mask.col_stride] != 0;
    my_flags |= (unsigned long long)(keep ? kTileHasVisible : kTileHasHidden) << (8 * (col / kSummaryBlock));
    if (keep) atomicOr(&words[row][col / 32], 1u << (col % 32));
  }
  if (my_flags) atomicOr(reinterpret_cast<unsigned long long*>(flags), my_flags);
  __syncthreads();
  const int first_word = first_col / 32, scalar_words = static_cast<int>(words_of(cols)) - first_word;
  for (int i = threadIdx.x; i < rows * scalar_words; i += kThreads) {
    const int row = i / scalar_words, w = first_word + i % scalar_words;
    bits_row0[row * words_of(mask.cols) + w] = words[row][w];
  }
  const std::int64_t first_block = std::int64_t(blockIdx.x) * kStripBlocks;
  if (threadIdx.x < kStripBlocks && first_block + threadIdx.x < col_blocks) {
    out[(bh * row_blocks + blockIdx.y) * col_blocks + first_block + threadIdx.x] = flags[threadIdx.x];
  }
}

// A mask with one row for every query (decode masks, key-padding masks): the kernel above gives
// a 64-row block 256 threads, so here all but 4 of them would idle. Instead every thread
// summarizes kRowVectors runs of 16 keys, their loads all in flight at once, and the 4 threads
// of a 64-key block combine their flags by shuffles. Measured under Nsight Compute on an H200
// (the decode benchmark's 1 x 8 x 1 x 131072 mask): 19.2 us with the kernel above, 4.6 here.
constexpr int kRowVectors = 4;
constexpr int kRowRunCols = 16;
constexpr int kRowCtaCols = kThreads * kRowRunCols * kRowVectors;
static_assert(kSummaryBlock % kRowRunCols == 0 && 32 % (kSummaryBlock / kRowRunCols) == 0,
              "a block's runs sit in adjacent lanes of one warp");

__global__ void __launch_bounds__(kThreads) row_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                std::uint32_t* bits_out) {
  const std::int64_t bh = blockIdx.z, b = bh / mask.heads, h = bh % mask.heads;
  const std::uint8_t* row = mask.ptr + b * mask.batch_stride + h * mask.head_stride;
  const bool aligned = mask.col_stride == 1 && reinterpret_cast<std::uintptr_t>(row) % 16 == 0;
  std::uint32_t* bits = bits_out + bh * words_of(mask.cols);
  std::uint8_t* classes = out + bh * blocks_of(mask.cols);
  auto first_col = [&](int k) {
    return (std::int64_t(blockIdx.x) * kRowVectors + k) * (kThreads * kRowRunCols) + threadIdx.x * kRowRunCols;
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

}  // namespace

std::size_t tile_summary_bytes(const MaskExtent& mask) {
  const std::int64_t bit_words = mask.batches * mask.heads * mask.rows * words_of(mask.cols);
  return bit_words == 0 ? 0 : bits_offset(mask) + static_cast<std::size_t>(bit_words) * sizeof(std::uint32_t);
}

cudaError_t build_tile_summary(const MaskExtent& mask, void* workspace, cudaStream_t stream, TileSummary* summary) {
  const std::int64_t row_blocks = blocks_of(mask.rows), col_blocks = blocks_of(mask.cols);
  auto* out = static_cast<std::uint8_t*>(workspace);
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
  if (tile_summary_bytes(mask) == 0) return cudaSuccess;
  if (mask.rows == 1 && !mask.causal) {
    const dim3 grid(static_cast<unsigned>((mask.cols + kRowCtaCols - 1) / kRowCtaCols), 1,
                    static_cast<unsigned>(mask.batches * mask.heads));
    row_summary_kernel<<<grid, kThreads, 0, stream>>>(mask, out, bits);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((col_blocks + kStripBlocks - 1) / kStripBlocks), static_cast<unsigned>(row_blocks),
                  static_cast<unsigned>(mask.batches * mask.heads));
  tile_summary_kernel<<<grid, kThreads, 0, stream>>>(mask, out, bits);
  return cudaGetLastError();
}

}  // namespace flash_dmattn::kernels
