// Four warps per (row block of kSummaryBlock rows, strip of kWarpCols keys), each on a quarter
// of the rows: a lane holds 32 keys of each of its rows, reads them as two 16-byte vectors, writes
// them back as one word of bits and ORs its flags over the rows in registers; the two lanes of a
// summary block, then the four warps, merge theirs at the end (one barrier a CTA). A mask with a
// single row gets a kernel of its own (below).
// Measured with a standalone harness (CUDA events, medians of 20, H200; every output byte the
// kernels may read compared with the layout before), the causal masks of the D128 training
// benchmark (2 x 4 x 8192 x 8192, 268 MB read) and of the D32 seed one (16384 x 16384, 134 MB),
// and a non-causal 4 x 8192 x 8192 (268 MB), us:
//  - before, a CTA per row block and four 512-key strips, each warp on 8 rows, flags meeting in
//    shared memory behind two barriers a strip: 97, 55 and 94 (2.8, 2.4, 2.9 TB/s). Under Nsight
//    Compute issue-bound, not memory-bound: 110 instructions a 16-byte load (index arithmetic,
//    shuffles, barriers), 58% of the ALU pipe, 55% of DRAM bandwidth. Its variants (512 threads,
//    streaming loads, 2 or 8 strips a CTA) were no faster.
//  - a warp per row block and strip, 32 keys a lane, no shared memory: 94, 52, 80 (61% fewer
//    instructions, 44% of the ALU pipe);
//  - with bool_bits for bytes that are 0 or 1: 87, 44, 77 (16 M instructions, 19% of the ALU
//    pipe, 74% of DRAM bandwidth); 2 or 8 rows' loads in flight instead of 4: no better;
//  - two or four warps a row block: 82, 48, 79 and 82, 44, 80; the last, in a later run beside
//    the layout before (98, 54, 92): 79, 44, 77 (3.4, 3.1, 3.5 TB/s). A linear read of the same
//    bytes takes 68, 38, 68; the summary also writes an eighth of them as bits.
#include "kernels/common/tile_summary.h"

#include "kernels/common/launch.h"

namespace flash_dmattn::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kLaneCols = 32;                 // a lane's keys of a row: two 16-byte vectors, a word of bits
constexpr int kWarpCols = 32 * kLaneCols;     // a warp's strip
constexpr int kRowBlockWarps = 4;              // warps that split a row block's rows
constexpr int kWarpRows = kSummaryBlock / kRowBlockWarps;
constexpr int kCtaRowBlocks = kThreads / 32 / kRowBlockWarps;  // a CTA's consecutive row blocks of one strip
constexpr int kRowGroup = 4;                  // rows whose loads a lane has in flight together
static_assert(2 * kLaneCols == kSummaryBlock, "two lanes hold a summary block");

__host__ __device__ std::int64_t blocks_of(std::int64_t n) { return (n + kSummaryBlock - 1) / kSummaryBlock; }
__host__ __device__ std::int64_t words_of(std::int64_t cols) { return (cols + 31) / 32; }
std::size_t classes_bytes(const MaskExtent& mask) {
  return static_cast<std::size_t>(mask.batches * mask.heads * blocks_of(mask.rows) * blocks_of(mask.cols));
}
// The bits start 16-byte aligned after the classes.
std::size_t bits_offset(const MaskExtent& mask) { return (classes_bytes(mask) + 15) / 16 * 16; }

// The grid (folded into grid.x, launch.h): x the strips along the keys, y groups of kCtaRowBlocks
// row blocks, z the mask's (batch, head).
__host__ __device__ GridShape summary_grid_shape(const MaskExtent& mask) {
  return {(mask.cols + kWarpCols - 1) / kWarpCols, (blocks_of(mask.rows) + kCtaRowBlocks - 1) / kCtaRowBlocks,
          mask.batches * mask.heads};
}

// Bit i set where byte i of the word is nonzero, for i < 4: (b & 0x7f) + 0x7f has its top bit
// set iff the low seven bits are not all zero, and cannot carry into the next byte (at most
// 0xfe); or-ed with b, the top bit says b != 0. The multiply moves the four top bits (7, 15, 23,
// 31) to bits 28-31; its other partial products land on distinct lower bits, so nothing carries.
// Five instructions a word; testing the 16 bytes one by one left the build issue-bound.
__device__ __forceinline__ std::uint32_t nonzero_nibble(std::uint32_t word) {
  const std::uint32_t top = (((word & 0x7f7f7f7fu) + 0x7f7f7f7fu) | word) & 0x80808080u;
  return (top * 0x00204081u) >> 28;
}

// Bit i set where byte i of the 16 is nonzero.
__device__ __forceinline__ std::uint32_t nonzero_bytes(const uint4& v) {
  return nonzero_nibble(v.x) | nonzero_nibble(v.y) << 4 | nonzero_nibble(v.z) << 8 | nonzero_nibble(v.w) << 12;
}

// Bit i set where byte i of the 32 (two vectors) is nonzero, when every byte is 0 or 1 as in a
// bool tensor: three instructions a pair of words against twelve above. With such bytes,
// x = w0 + 16 * w1 holds byte i of w0 at bit 8i and of w1 at bit 8i + 4, and multiplying by
// 2^24 + 2^17 + 2^10 + 2^3 moves them to bits 24 + i and 28 + i: the other partial products
// are single bits at distinct places below bit 24 (no carries) or past bit 31 (dropped). Byte 3
// of each product is 8 keys' bits; two byte permutes gather the four.
__device__ __forceinline__ std::uint32_t bool_bits(const uint4& a, const uint4& b) {
  constexpr std::uint32_t kGather = 0x01020408u;
  const std::uint32_t p0 = (a.x + (a.y << 4)) * kGather, p1 = (a.z + (a.w << 4)) * kGather;
  const std::uint32_t p2 = (b.x + (b.y << 4)) * kGather, p3 = (b.z + (b.w << 4)) * kGather;
  return __byte_perm(__byte_perm(p0, p1, 0x0073), __byte_perm(p2, p3, 0x0073), 0x5410);
}

// The 32 bytes' bits, by bool_bits where every byte is 0 or 1 (a uint8 mask viewed as bool may
// hold any nonzero byte: those take nonzero_bytes).
__device__ __forceinline__ std::uint32_t vector_bits(const uint4& a, const uint4& b) {
  if (((a.x | a.y | a.z | a.w | b.x | b.y | b.z | b.w) & 0xfefefefeu) != 0) {
    return nonzero_bytes(a) | nonzero_bytes(b) << 16;
  }
  return bool_bits(a, b);
}

// A lane's keys, tested byte by byte (rows not 16-byte aligned, or the keys' last block where it
// is cut short): keys at or past `counted` (hidden from the whole row block, or past the mask) are
// neither bits nor flags.
__device__ __forceinline__ unsigned summarize_bytes(const std::uint8_t* first, std::int64_t row_stride,
                                                    std::int64_t col_stride, int rows, int counted,
                                                    std::uint32_t* bits, std::int64_t bits_row_stride) {
  const std::uint32_t full = counted >= 32 ? ~0u : (1u << counted) - 1u;
  unsigned flags = 0;
  for (int r = 0; r < rows; ++r) {
    std::uint32_t word = 0;
    for (int j = 0; j < counted; ++j) word |= std::uint32_t(first[r * row_stride + j * col_stride] != 0) << j;
    bits[r * bits_row_stride] = word;
    flags |= (word != 0 ? kTileHasVisible : 0u) | (word != full ? kTileHasHidden : 0u);
  }
  return flags;
}

// Four CTAs per SM: at most 64 registers a thread.
__global__ void __launch_bounds__(kThreads, 4) tile_summary_kernel(MaskExtent mask, std::uint8_t* out,
                                                                 std::uint32_t* bits_out) {
  const GridCoords cta = unfold_block(summary_grid_shape(mask));
  let_next_grid_start();  // the forward, launched early, waits for this kernel to finish
  __shared__ unsigned shared_flags[kThreads];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, share = warp % kRowBlockWarps;
  const std::int64_t col_blocks = blocks_of(mask.cols), row_blocks = blocks_of(mask.rows);
  const std::int64_t row_block = std::int64_t(cta.y) * kCtaRowBlocks + warp / kRowBlockWarps;
  const bool live = row_block < row_blocks;
  const unsigned bh = static_cast<unsigned>(cta.z), b = bh / static_cast<unsigned>(mask.heads),
                 h = bh % static_cast<unsigned>(mask.heads);
  const std::int64_t r0 = row_block * kSummaryBlock;
  const int rows = static_cast<int>(mask.rows - r0 < kSummaryBlock ? mask.rows - r0 : kSummaryBlock);
  // Keys at or past `seen_end` are causally hidden from every row of the block.
  std::int64_t seen_end = mask.cols;
  if (mask.causal) {
    const std::int64_t last_key = r0 + rows - 1 + mask.diagonal;
    seen_end = last_key < 0 ? 0 : (last_key + 1 < mask.cols ? last_key + 1 : mask.cols);
  }
  const std::int64_t c = std::int64_t(cta.x) * kWarpCols + lane * kLaneCols, block = c / kSummaryBlock;
  const int warp_rows = live ? (rows - share * kWarpRows < kWarpRows ? rows - share * kWarpRows : kWarpRows) : 0;
  const std::uint8_t* first = mask.ptr + b * mask.batch_stride + h * mask.head_stride +
                              (r0 + share * kWarpRows) * mask.row_stride + c * mask.col_stride;
  const std::int64_t row_words = words_of(mask.cols);
  std::uint32_t* bits = bits_out + (std::int64_t(bh) * mask.rows + r0 + share * kWarpRows) * row_words + c / 32;
  const bool aligned = mask.col_stride == 1 && mask.row_stride % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(first) % 16 == 0;
  // A lane reads where some row of the block sees its block's first key: as two 16-byte vectors a
  // row where the rows are aligned and the block whole, else byte by byte up to seen_end.
  const std::int64_t whole = mask.cols / kSummaryBlock * kSummaryBlock;
  const bool reads = warp_rows > 0 && c < mask.cols && block * kSummaryBlock < seen_end;
  const bool vector = reads && aligned && c + kLaneCols <= whole;
  // The flags count keys before seen_end alone (a vector may run past it); the bits past it are
  // never read.
  const std::int64_t counted = seen_end - c < 0 ? 0 : (seen_end - c < kLaneCols ? seen_end - c : kLaneCols);
  unsigned flags = 0;
  if (vector) {
    const std::uint32_t in = counted == kLaneCols ? ~0u : (1u << counted) - 1u;
    std::uint32_t any = 0, all = ~0u;  // over the rows, of the keys before seen_end
    for (int r = 0; r < warp_rows; r += kRowGroup) {
      uint4 v[kRowGroup][2];
#pragma unroll
      for (int i = 0; i < kRowGroup; ++i) {
        if (r + i < warp_rows) {
          const auto* p = reinterpret_cast<const uint4*>(first + (r + i) * mask.row_stride);
          v[i][0] = p[0];
          v[i][1] = p[1];
        }
      }
#pragma unroll
      for (int i = 0; i < kRowGroup; ++i) {
        if (r + i < warp_rows) {
          const std::uint32_t word = vector_bits(v[i][0], v[i][1]);
          bits[(r + i) * row_words] = word;
          any |= word & in;
          all &= word | ~in;
        }
      }
    }
    flags = (any != 0 ? kTileHasVisible : 0u) | (all != ~0u ? kTileHasHidden : 0u);
  } else if (reads) {
    flags = summarize_bytes(first, mask.row_stride, mask.col_stride, warp_rows, static_cast<int>(counted), bits, row_words);
  }
  // The block's two lanes, then the row block's warps.
  flags |= __shfl_xor_sync(0xffffffffu, flags, 1);
  shared_flags[threadIdx.x] = flags;
  __syncthreads();
  if (share == 0) {
#pragma unroll
    for (int k = 1; k < kRowBlockWarps; ++k) flags |= shared_flags[threadIdx.x + 32 * k];
  }
  if (live && share == 0 && lane % 2 == 0 && block < col_blocks) {
    out[(std::int64_t(bh) * row_blocks + row_block) * col_blocks + block] = flags;
  }
}

// A mask with one row for every query (decode masks, key-padding masks): the kernel above gives
// a row block four warps, three of which would idle here, the fourth loading one row. Instead
// every thread summarizes kRowVectors runs of 16 keys, their loads all in flight at once, and the
// 4 threads of a 64-key block combine their flags by shuffles. Measured under Nsight Compute on
// an H200 (the decode benchmark's 1 x 8 x 1 x 131072 mask): 19.2 us with the many-row kernel of
// the time (a CTA of 256 threads a row block), 4.6 here with 4 runs a thread. A decode's forward
// waits for this kernel, so its latency counts more than its loads in flight: one run a thread
// spreads the mask over 4x the CTAs. Torch profiler, H200, decode masks (1, 8, 1, Sk): 4 runs ->
// 1 run 1.7 -> 1.3 us at Sk 1024, 3.4 -> 1.8 at 16384, 3.6 -> 1.9 at 65536, 3.7 -> 2.1 at 131072
// (2 runs: 1.4, 2.4, 2.5, 2.6).
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
