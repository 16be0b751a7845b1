// The gather path's key-list builder against a CPU build from the same mask: per query tile, the
// ascending union of the keys its rows keep (causal alignment included) and every row's compacted
// keep bits, for tiles that keep nothing, lists longer than one 8192-key pass of the build (its
// bits then cross a pass inside a word), both forward tile shapes, and causal diagonals; the
// estimate of their sizes, and the device's choice of path from them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "device_tensor.h"
#include "forward_harness.h"
#include "kernels/common/key_lists.h"
#include "kernels/common/tile_summary.h"
#include "test_util.h"

namespace flash_dmattn::test {
namespace {

using kernels::KeyListExtent;
using kernels::KeyLists;
using kernels::MaskExtent;
using kernels::TileSummary;

struct ListCase {
  std::int64_t batches, heads, rows, cols;
  int block_m, block_n;
  double density;
  bool causal = false;
  int diagonal = 0;
  // Rows [empty_from, empty_from + block_m) keep nothing: a whole query tile with an empty list.
  std::int64_t empty_from = -1;
  // Deterministic patterns instead of random keys where set: keep_every > 0 keeps key j iff
  // j % keep_every == 0; keys [gap_from, gap_from + gap_keys) are kept by no row.
  int keep_every = 0;
  std::int64_t gap_from = -1, gap_keys = 0;
};

std::string describe(const ListCase& c) {
  return std::to_string(c.batches) + "x" + std::to_string(c.heads) + "x" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols) + " tile " + std::to_string(c.block_m) + "x" + std::to_string(c.block_n) +
         " density " + std::to_string(c.density) + (c.causal ? " causal " + std::to_string(c.diagonal) : "");
}

template <typename T>
std::vector<T> download(const void* device, std::size_t count, cudaStream_t stream) {
  std::vector<T> host(count);
  if (count == 0) return host;
  cuda_check(cudaMemcpyAsync(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost, stream), "download");
  cuda_check(cudaStreamSynchronize(stream), "synchronize");
  return host;
}

class KeyListBuild : public GpuTest {
 protected:
  void check(const ListCase& c) {
    SCOPED_TRACE(describe(c));
    auto rng = test_rng();
    std::bernoulli_distribution keep(c.density);
    const std::int64_t bhs = c.batches * c.heads;
    std::vector<std::uint8_t> host(static_cast<std::size_t>(bhs * c.rows * c.cols));
    auto at = [&](std::int64_t bh, std::int64_t i, std::int64_t j) -> std::uint8_t& {
      return host[static_cast<std::size_t>((bh * c.rows + i) * c.cols + j)];
    };
    for (std::int64_t bh = 0; bh < bhs; ++bh)
      for (std::int64_t i = 0; i < c.rows; ++i)
        for (std::int64_t j = 0; j < c.cols; ++j)
          at(bh, i, j) = !(i >= c.empty_from && i < c.empty_from + c.block_m) &&
                         !(j >= c.gap_from && j < c.gap_from + c.gap_keys) &&
                         (c.keep_every > 0 ? j % c.keep_every == 0 : keep(rng));

    DeviceBuffer mask(host.size());
    if (!host.empty()) {
      cuda_check(cudaMemcpy(mask.data(), host.data(), host.size(), cudaMemcpyHostToDevice), "mask upload");
    }
    MaskExtent me;
    me.ptr = static_cast<const std::uint8_t*>(mask.data());
    me.batches = c.batches, me.heads = c.heads, me.rows = c.rows, me.cols = c.cols;
    me.batch_stride = c.heads * c.rows * c.cols, me.head_stride = c.rows * c.cols, me.row_stride = c.cols,
    me.col_stride = 1;
    me.causal = c.causal, me.diagonal = c.diagonal;
    KeyListExtent le;
    le.batches = c.batches, le.heads = c.heads;
    le.seqlen_q = static_cast<int>(c.rows), le.seqlen_k = static_cast<int>(c.cols);
    le.block_m = c.block_m, le.block_n = c.block_n;
    le.causal = c.causal, le.diagonal = c.diagonal;
    DeviceBuffer summary_space(kernels::tile_summary_bytes(me));
    const std::size_t list_bytes = kernels::key_lists_bytes(le);
    DeviceBuffer list_space(list_bytes);
    cuda_check(cudaMemsetAsync(list_space.data(), 0xab, list_bytes, stream()), "list poison");
    TileSummary summary;
    cuda_check(kernels::build_tile_summary(me, summary_space.data(), stream(), &summary), "build_tile_summary");
    KeyLists lists;
    cuda_check(kernels::build_key_lists(le, summary, list_space.data(), stream(), &lists), "build_key_lists");
    const std::int64_t n = le.lists();
    const auto counts = download<int>(lists.counts, static_cast<std::size_t>(n), stream());
    const auto blocks = download<int>(lists.blocks, static_cast<std::size_t>(n), stream());
    verify(c, le, lists, at);

    // The same build writing its lists in chunks of twice the keys too (kernels::WiderChunks).
    const int wider_n = 2 * c.block_n;
    if (32 % (wider_n / 32) == 0) {
      SCOPED_TRACE("in chunks of " + std::to_string(wider_n) + " keys too");
      DeviceBuffer wider_space(kernels::wider_lists_bytes(le, wider_n));
      cuda_check(cudaMemsetAsync(list_space.data(), 0xab, list_bytes, stream()), "list poison");
      cuda_check(cudaMemsetAsync(wider_space.data(), 0xab, kernels::wider_lists_bytes(le, wider_n), stream()),
                 "wider poison");
      KeyLists again;
      cuda_check(kernels::build_key_lists(le, summary, list_space.data(), stream(), &again, {},
                                          kernels::WiderChunks{wider_n, wider_space.data()}),
                 "build_key_lists with wider chunks");
      verify(c, le, again, at);
      KeyListExtent wider_extent = le;
      wider_extent.block_n = wider_n;
      ListCase wider_case = c;
      wider_case.block_n = wider_n;
      verify(wider_case, wider_extent,
             kernels::describe_wider_key_lists(le, list_space.data(), wider_n, wider_space.data()), at);
    }
    check_estimate(c, le, summary, list_space, counts, blocks);
  }

  // The lists against a CPU build from the mask (`at`, the host copy): per list its count, its
  // keys, its blocks of block_n keys that hold a listed key and every row's compacted keep bits.
  template <typename At>
  void verify(const ListCase& c, const KeyListExtent& le, const KeyLists& lists, At& at) {
    const std::int64_t n = le.lists();
    const std::int64_t bhs = c.batches * c.heads;
    const auto counts = download<int>(lists.counts, static_cast<std::size_t>(n), stream());
    const auto blocks = download<int>(lists.blocks, static_cast<std::size_t>(n), stream());
    const auto keys = download<int>(lists.keys, static_cast<std::size_t>(n * lists.capacity), stream());
    const auto row_bits = download<std::uint32_t>(lists.row_bits, static_cast<std::size_t>(n * lists.row_bits_stride),
                                                  stream());
    const int words = c.block_n / 32;
    int failures = 0;
    for (std::int64_t bh = 0; bh < bhs && failures < 10; ++bh) {
      for (std::int64_t t = 0; t < le.query_tiles(); ++t) {
        const std::int64_t list = bh * le.query_tiles() + t;
        const std::int64_t i0 = t * c.block_m, i1 = std::min(c.rows, i0 + c.block_m);
        auto kept = [&](std::int64_t i, std::int64_t j) {
          return at(bh, i, j) && (!c.causal || j <= i + c.diagonal);
        };
        std::vector<int> expected;
        for (std::int64_t j = 0; j < c.cols; ++j) {
          bool any = false;
          for (std::int64_t i = i0; i < i1 && !any; ++i) any = kept(i, j);
          if (any) expected.push_back(static_cast<int>(j));
        }
        if (counts[list] != static_cast<int>(expected.size())) {
          if (failures++ < 10) ADD_FAILURE() << "list " << list << ": " << counts[list] << " keys, expected " << expected.size();
          continue;
        }
        const int* got = keys.data() + list * lists.capacity;
        if (!std::equal(expected.begin(), expected.end(), got)) {
          if (failures++ < 10) ADD_FAILURE() << "list " << list << ": keys differ";
          continue;
        }
        int expected_blocks = 0;  // blocks of block_n keys from key 0 that hold a listed key
        for (std::size_t p = 0; p < expected.size(); ++p) {
          expected_blocks += p == 0 || expected[p] / c.block_n != expected[p - 1] / c.block_n;
        }
        if (blocks[list] != expected_blocks && failures++ < 10) {
          ADD_FAILURE() << "list " << list << ": " << blocks[list] << " blocks, expected " << expected_blocks;
        }
        const std::uint32_t* bits = row_bits.data() + list * lists.row_bits_stride;
        for (std::int64_t i = i0; i < i1; ++i) {
          const std::int64_t r = i - i0;
          for (std::size_t p = 0; p < expected.size(); ++p) {
            const std::uint32_t word = bits[(p / c.block_n * c.block_m + r) * words + p % c.block_n / 32];
            const bool bit = (word >> (p % 32)) & 1u;
            if (bit != kept(i, expected[p]) && failures++ < 10) {
              ADD_FAILURE() << "list " << list << ", row " << r << ", position " << p << " (key " << expected[p]
                            << "): keep bit " << bit;
            }
          }
        }
      }
    }
  }

  // The estimate's bounds around the lists' own sums (as listed_work sums them), and a build gated
  // by an estimate: every list where it may pay (share and sparse shares of 0: only lists without
  // a full block, or without a visible one), nothing where it cannot (the poison stays).
  void check_estimate(const ListCase& c, const KeyListExtent& le, const TileSummary& summary, DeviceBuffer& space,
                      const std::vector<int>& counts, const std::vector<int>& blocks) {
    DeviceBuffer estimate_space(sizeof(kernels::ListEstimate));
    auto* device_estimate = static_cast<kernels::ListEstimate*>(estimate_space.data());
    cuda_check(kernels::estimate_key_lists(le, summary, device_estimate, stream()), "estimate_key_lists");
    const auto estimate = download<kernels::ListEstimate>(device_estimate, 1, stream())[0];
    unsigned long long listed = 0, visible = 0, span = 0;
    for (std::int64_t list = 0; list < le.lists(); ++list) {
      const std::int64_t t = list % le.query_tiles();
      const std::int64_t rows_end = std::min(c.rows, (t + 1) * c.block_m);
      const std::int64_t keys = c.causal ? std::clamp<std::int64_t>(rows_end + c.diagonal, 0, c.cols) : c.cols;
      listed += (counts[list] + c.block_n - 1) / c.block_n;
      visible += blocks[list];
      span += (keys + c.block_n - 1) / c.block_n;
    }
    EXPECT_LE(estimate.listed_at_least, listed);
    EXPECT_LE(estimate.visible_at_least, visible);
    EXPECT_GE(estimate.visible_at_most, visible);
    EXPECT_EQ(estimate.span, span);
    if (c.density == 1.0 && c.keep_every == 0 && !c.causal && c.cols >= 64) {
      EXPECT_GT(estimate.listed_at_least, 0u) << "a full mask's blocks are full";
    }
    const bool may = kernels::lists_may_pay(estimate, 0, 0);
    const std::size_t bytes = kernels::key_lists_bytes(le);
    cuda_check(cudaMemsetAsync(space.data(), 0xab, bytes, stream()), "list poison");
    KeyLists gated;
    kernels::ListGate gate;  // shares of 0: build only where nothing is full, or nothing visible
    gate.estimate = device_estimate;
    cuda_check(kernels::build_key_lists(le, summary, space.data(), stream(), &gated, gate), "gated build_key_lists");
    const auto gated_counts = download<int>(gated.counts, counts.size(), stream());
    constexpr int kPoison = static_cast<int>(0xabababab);
    for (std::size_t list = 0; list < counts.size(); ++list) {
      ASSERT_EQ(gated_counts[list], may ? counts[list] : kPoison) << "list " << list << (may ? " built" : " skipped");
    }
    check_choice(le, summary, space, gated, gate, may, listed, visible, span);
  }

  // The device's choice from the gated lists' sizes (choose_gather_path) against the host's rule
  // on the same sums, at shares on either side; and a build gated by that choice writing its lists
  // only where the gather path was chosen.
  void check_choice(const KeyListExtent& le, const TileSummary& summary, DeviceBuffer& space, const KeyLists& lists,
                    const kernels::ListGate& gate, bool may, unsigned long long listed, unsigned long long visible,
                    unsigned long long span) {
    DeviceBuffer flag_space(sizeof(int));
    auto* flag = static_cast<int*>(flag_space.data());
    constexpr double kSparse = 0.05;
    for (double share : {0.0, 0.5, 1.0}) {
      cuda_check(cudaMemsetAsync(flag, 0x7f, sizeof(int), stream()), "flag poison");
      cuda_check(kernels::choose_gather_path(le, lists, gate, share, kSparse, flag, stream()), "choose_gather_path");
      const int chosen = download<int>(flag, 1, stream())[0];
      const bool expected = may && kernels::lists_pay(static_cast<std::int64_t>(listed), static_cast<std::int64_t>(visible),
                                                      static_cast<std::int64_t>(span), share, kSparse);
      ASSERT_EQ(chosen, expected ? 1 : 0) << "share " << share;
    }
    const std::size_t bytes = kernels::key_lists_bytes(le);
    for (int chosen : {0, 1}) {
      cuda_check(cudaMemcpyAsync(flag, &chosen, sizeof(int), cudaMemcpyHostToDevice, stream()), "flag");
      cuda_check(cudaMemsetAsync(space.data(), 0xab, bytes, stream()), "list poison");
      KeyLists built;
      kernels::ListGate by_choice;
      by_choice.gather_chosen = flag;
      cuda_check(kernels::build_key_lists(le, summary, space.data(), stream(), &built, by_choice), "chosen build");
      const auto built_counts = download<int>(built.counts, static_cast<std::size_t>(le.lists()), stream());
      constexpr int kPoison = static_cast<int>(0xabababab);
      for (std::size_t list = 0; list < built_counts.size(); ++list) {
        if (chosen) {
          ASSERT_NE(built_counts[list], kPoison) << "list " << list << " not built where chosen";
        } else {
          ASSERT_EQ(built_counts[list], kPoison) << "list " << list << " built where not chosen";
        }
      }
    }
  }
};

TEST_F(KeyListBuild, BothTileShapes) {
  for (const auto& [block_m, block_n] : {std::pair{64, 128}, std::pair{64, 64}, std::pair{128, 64}}) {
    for (const double density : {0.0, 0.01, 0.3, 1.0}) {
      check({2, 2, 150, 333, block_m, block_n, density});
      if (test_stopped()) return;
    }
  }
}

TEST_F(KeyListBuild, ListsLongerThanAPass) {
  check({1, 1, 70, 20000, 64, 128, 0.9});
  check({1, 2, 64, 17001, 64, 64, 0.4});
  check({1, 1, 128, 9000, 64, 128, 0.3, false, 0, 64});  // the second tile keeps nothing
  check({1, 1, 200, 9000, 128, 64, 0.02, false, 0, 64});
}

// A pass of 8192 keys holding a count that is not a multiple of 32 (its last word is completed by
// the next pass), a pass in the middle that holds no key, and no keys at all.
TEST_F(KeyListBuild, PassesEndingInsideAWordOrEmpty) {
  ListCase every_third{1, 1, 64, 20000, 64, 128, 1.0};
  every_third.keep_every = 3;
  check(every_third);
  ListCase gap{1, 2, 100, 30000, 64, 64, 0.5};
  gap.gap_from = 5000, gap.gap_keys = 12000;
  check(gap);
  check({1, 1, 70, 0, 64, 128, 0.5});
}

TEST_F(KeyListBuild, CausalDiagonals) {
  for (const int diagonal : {-70, 0, 37, 300}) {
    check({1, 2, 200, 300, 64, 128, 0.6, true, diagonal});
    check({2, 1, 130, 9000, 64, 64, 0.1, true, 9000 - 130});
    if (test_stopped()) return;
  }
}

}  // namespace
}  // namespace flash_dmattn::test
