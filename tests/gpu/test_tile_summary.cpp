// The mask summary builder against a CPU summary of the same mask: every block's class byte and
// every bit the kernels may read, for masks with one row (their own kernel) and with many, rows
// that are 16-byte aligned or not, strided keys, key counts that end inside a 16-key run and a
// block, densities from empty to full, and causal row blocks.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "device_tensor.h"
#include "forward_harness.h"
#include "kernels/common/tile_summary.h"
#include "test_util.h"

namespace flash_dmattn::test {
namespace {

using kernels::kSummaryBlock;
using kernels::MaskExtent;
using kernels::TileSummary;

struct SummaryCase {
  std::int64_t batches, heads, rows, cols;
  std::int64_t col_stride = 1;
  std::int64_t byte_offset = 0;  // the mask starts this many bytes into its allocation
  std::int64_t row_pad = 0;      // extra bytes after each row
  double density = 0.5;
  bool causal = false;
  std::int64_t diagonal = 0;
  bool packed = false;  // the device mask holds the keys 8 to a byte (MaskExtent::packed)
  // Kept keys are 1, as in a bool tensor (the build's fast path), rather than any nonzero byte
  // (a uint8 mask viewed as bool).
  bool bool_bytes = false;
};

std::string describe(const SummaryCase& c) {
  return std::to_string(c.batches) + "x" + std::to_string(c.heads) + "x" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols) + " col_stride " + std::to_string(c.col_stride) + " offset " +
         std::to_string(c.byte_offset) + " density " + std::to_string(c.density) + (c.causal ? " causal" : "") +
         (c.packed ? " packed" : "") + (c.bool_bytes ? " bool bytes" : "");
}

class TileSummaryBuild : public GpuTest {
 protected:
  void check(const SummaryCase& c) {
    SCOPED_TRACE(describe(c));
    auto rng = test_rng();
    const std::int64_t row_stride = (c.cols - 1) * c.col_stride + 1 + c.row_pad;
    const std::int64_t head_stride = c.rows * row_stride, batch_stride = c.heads * head_stride;
    std::vector<std::uint8_t> host(static_cast<std::size_t>(c.byte_offset + c.batches * batch_stride), 0xcd);
    std::bernoulli_distribution keep(c.density);
    auto at = [&](std::int64_t bh, std::int64_t i, std::int64_t j) -> std::uint8_t& {
      return host[static_cast<std::size_t>(c.byte_offset + bh * head_stride + i * row_stride + j * c.col_stride)];
    };
    const std::int64_t bhs = c.batches * c.heads;
    for (std::int64_t bh = 0; bh < bhs; ++bh)
      for (std::int64_t i = 0; i < c.rows; ++i)
        for (std::int64_t j = 0; j < c.cols; ++j) at(bh, i, j) = keep(rng) ? static_cast<std::uint8_t>(c.bool_bytes ? 1 : 1 + rng() % 255) : 0;

    // Packed: the same keys 8 to a byte, rows of ceil(cols / 8) bytes plus the pad, the bits past
    // the keys set (never read).
    const std::int64_t packed_row = (c.cols + 7) / 8 + c.row_pad;
    std::vector<std::uint8_t> packed(c.packed ? static_cast<std::size_t>(c.byte_offset + bhs * c.rows * packed_row) : 0, 0xff);
    for (std::int64_t bh = 0; bh < bhs && c.packed; ++bh)
      for (std::int64_t i = 0; i < c.rows; ++i)
        for (std::int64_t j = 0; j < c.cols; ++j) {
          std::uint8_t& byte = packed[static_cast<std::size_t>(c.byte_offset + (bh * c.rows + i) * packed_row + j / 8)];
          byte = at(bh, i, j) ? byte | (1u << (j % 8)) : byte & ~(1u << (j % 8));
        }
    const std::vector<std::uint8_t>& device_bytes = c.packed ? packed : host;
    DeviceBuffer mask(device_bytes.size());
    cuda_check(cudaMemcpy(mask.data(), device_bytes.data(), device_bytes.size(), cudaMemcpyHostToDevice), "mask upload");
    MaskExtent extent;
    extent.ptr = static_cast<const std::uint8_t*>(mask.data()) + c.byte_offset;
    extent.batches = c.batches;
    extent.heads = c.heads;
    extent.rows = c.rows;
    extent.cols = c.cols;
    extent.batch_stride = c.packed ? c.heads * c.rows * packed_row : batch_stride;
    extent.head_stride = c.packed ? c.rows * packed_row : head_stride;
    extent.row_stride = c.packed ? packed_row : row_stride;
    extent.col_stride = c.packed ? 1 : c.col_stride;
    extent.packed = c.packed;
    extent.causal = c.causal;
    extent.diagonal = c.diagonal;
    const std::size_t bytes = kernels::tile_summary_bytes(extent);
    DeviceBuffer workspace(bytes);
    // On the stream the build runs on, which does not wait for the legacy stream.
    cuda_check(cudaMemsetAsync(workspace.data(), 0xab, bytes, stream()), "workspace poison");
    TileSummary summary;
    cuda_check(kernels::build_tile_summary(extent, workspace.data(), stream(), &summary), "build_tile_summary");
    std::vector<std::uint8_t> built(bytes);
    cuda_check(cudaMemcpyAsync(built.data(), workspace.data(), bytes, cudaMemcpyDeviceToHost, stream()), "download");
    cuda_check(cudaStreamSynchronize(stream()), "synchronize");
    auto offset_of = [&](const void* device_ptr) {
      return static_cast<const std::uint8_t*>(device_ptr) - static_cast<const std::uint8_t*>(workspace.data());
    };
    const std::uint8_t* classes = built.data() + offset_of(summary.classes);
    const auto* bits = reinterpret_cast<const std::uint32_t*>(built.data() + offset_of(summary.bits));

    const std::int64_t row_blocks = (c.rows + kSummaryBlock - 1) / kSummaryBlock;
    const std::int64_t col_blocks = (c.cols + kSummaryBlock - 1) / kSummaryBlock;
    int failures = 0;
    for (std::int64_t bh = 0; bh < bhs && failures < 10; ++bh) {
      for (std::int64_t rb = 0; rb < row_blocks; ++rb) {
        const std::int64_t i_end = std::min(c.rows, (rb + 1) * kSummaryBlock);
        // Keys past the block's last row's diagonal: no row of the block sees them.
        const std::int64_t seen = c.causal ? std::min(c.cols, i_end - 1 + c.diagonal + 1) : c.cols;
        for (std::int64_t cb = 0; cb < col_blocks; ++cb) {
          std::uint8_t expected = 0;
          for (std::int64_t i = rb * kSummaryBlock; i < i_end; ++i)
            for (std::int64_t j = cb * kSummaryBlock; j < std::min(seen, (cb + 1) * kSummaryBlock); ++j)
              expected |= at(bh, i, j) ? kernels::kTileHasVisible : kernels::kTileHasHidden;
          const std::uint8_t got = classes[bh * summary.head_stride + rb * summary.row_stride + cb * summary.col_stride];
          if (got != expected && failures++ < 10) {
            ADD_FAILURE() << "class of (bh " << bh << ", row block " << rb << ", key block " << cb << "): expected "
                          << int(expected) << ", got " << int(got);
          }
        }
        for (std::int64_t i = rb * kSummaryBlock; i < i_end; ++i) {
          for (std::int64_t j = 0; j < seen; ++j) {
            const std::uint32_t word = bits[bh * summary.bits_head_stride + i * summary.bits_row_stride + j / 32];
            const bool got = (word >> (j % 32)) & 1u;
            if (got != (at(bh, i, j) != 0) && failures++ < 10) {
              ADD_FAILURE() << "bit of (bh " << bh << ", row " << i << ", key " << j << "): expected " << (got ? 0 : 1);
            }
          }
        }
      }
    }
  }
};

// Bit-packed masks: their own kernel, 8x fewer bytes to read, the same summary.
TEST_F(TileSummaryBuild, PackedMasks) {
  for (const std::int64_t rows : {1, 17, 64, 130}) {
    for (const std::int64_t cols : {1, 9, 64, 100, 1000, 4096}) {
      check({2, 2, rows, cols, 1, 0, 0, 0.5, false, 0, true});
      check({1, 2, rows, cols, 1, 3, 5, 0.3, false, 0, true});  // rows off an 8-byte boundary
      check({2, 1, rows, cols, 1, 0, 0, 0.01, true, cols - rows, true});
      check({1, 1, rows, cols, 1, 0, 0, 1.0, true, cols - rows + 37, true});
      if (test_stopped()) return;
    }
  }
}

TEST_F(TileSummaryBuild, OneRowMasks) {
  for (const std::int64_t cols : {1, 17, 64, 100, 4095, 16384, 20000 + 5}) {
    for (const double density : {0.0, 0.002, 0.5, 1.0}) {
      check({2, 3, 1, cols, 1, 0, 0, density});
      if (test_stopped()) return;
    }
  }
  check({1, 8, 1, 131072, 1, 0, 0, 0.9});
}

TEST_F(TileSummaryBuild, OneRowMasksUnalignedOrStrided) {
  for (const std::int64_t cols : {33, 4095, 16390}) {
    check({2, 2, 1, cols, 1, 3, 0, 0.5});  // rows start off a 16-byte boundary
    check({2, 2, 1, cols, 2, 0, 0, 0.5});  // every other byte is a key
    check({2, 2, 1, cols, 1, 0, 5, 0.3});  // heads an odd stride apart
    if (test_stopped()) return;
  }
}

TEST_F(TileSummaryBuild, ManyRowMasks) {
  for (const bool bools : {false, true}) {
    for (const std::int64_t rows : {2, 17, 64, 130}) {
      for (const std::int64_t cols : {1, 63, 257, 1000, 1024, 1040}) {
        check({2, 2, rows, cols, 1, 0, 0, 0.5, false, 0, false, bools});
        check({1, 3, rows, cols, 1, 0, 16, 0.01, false, 0, false, bools});
        check({1, 2, rows, cols, 1, 1, 3, 0.7, false, 0, false, bools});
        check({1, 1, rows, cols, 1, 0, 0, 1.0, false, 0, false, bools});
        if (test_stopped()) return;
      }
    }
  }
}

// Causal row blocks whose last seen key cuts a summary block, in rows that are 16-byte aligned
// (1024 and 1040 keys: read as vectors, the last block of 1040 cut short) and not (300).
TEST_F(TileSummaryBuild, CausalRowBlocks) {
  for (const bool bools : {false, true}) {
    for (const std::int64_t cols : {300, 1024, 1040}) {
      for (const std::int64_t diagonal : {-70, 0, 37, 300, 1000}) {
        check({1, 2, 200, cols, 1, 0, 0, 0.6, true, diagonal, false, bools});
        check({1, 1, 200, cols, 1, 0, 0, 1.0, true, diagonal, false, bools});
        if (test_stopped()) return;
      }
    }
  }
}

}  // namespace
}  // namespace flash_dmattn::test
