// The CUDA backend's path choice for a prepared mask (src/cuda/sparse_path.h), from the work its key
// lists describe: host arithmetic, no GPU.
#include <gtest/gtest.h>

#include "cuda/sparse_path.h"

namespace flash_dmattn {
namespace {

struct Case {
  const char* what;
  std::int64_t listed, visible, span;  // in chunks of block_n keys
  double share;                        // the pass's threshold
  bool gather;                         // expected
};

TEST(GatherPays, ChoosesByTheTilesThePathWouldVisit) {
  const Case cases[] = {
      {"scattered keys: every block visible, the share of the span decides", 45, 100, 100, 0.65, true},
      {"scattered keys past the backward's share", 76, 100, 100, 0.65, false},
      {"the same under the forward's share", 76, 100, 100, 0.9, true},
      {"a window: a chunk per visible block, a quarter of the span", 2200, 2200, 8800, 0.9, false},
      {"few visible tiles (2% of the span): gather whatever the share", 20, 20, 1000, 0.5, true},
      {"visible tiles at kSparseTilesShare of the span", 50, 50, 1000, 0.5, true},
      {"visible tiles just past it", 51, 51, 1000, 0.5, false},
      {"empty lists", 0, 0, 1000, 0.5, true},
  };
  for (const Case& c : cases) {
    ListedWork work;
    work.listed = c.listed, work.visible = c.visible, work.span = c.span, work.known = true;
    EXPECT_EQ(gather_pays(work, c.share), c.gather) << c.what;
  }
  ListedWork unknown;  // sizes not read back (a stream being captured): the tile path
  EXPECT_FALSE(gather_pays(unknown, 1.0));
}

// listed_work sums the lists' sizes as the device's choice does (choose_gather_path in
// key_lists.h, from the same KeyListExtent helpers): the listed keys and the span in whole
// chunks, the span of a query tile up to its last row's causal limit.
TEST(ListedWork, SumsChunksAndCausalSpans) {
  kernels::KeyListExtent e;
  e.batches = 1, e.heads = 2, e.seqlen_q = 150, e.seqlen_k = 300, e.block_m = 64, e.block_n = 128;
  e.causal = true, e.diagonal = 150;  // bottom-right: row i sees keys j <= i + 150
  ASSERT_EQ(e.query_tiles(), 3);
  EXPECT_EQ(e.span_keys(0), 214);  // rows 0..63
  EXPECT_EQ(e.span_keys(1), 278);
  EXPECT_EQ(e.span_keys(2), 300);  // rows 128..149: up to 299, all keys
  EXPECT_EQ(e.chunks(0), 0);
  EXPECT_EQ(e.chunks(128), 1);
  EXPECT_EQ(e.chunks(129), 2);
  kernels::KeyListExtent negative = e;
  negative.diagonal = -100;  // the first tile's rows see nothing
  EXPECT_EQ(negative.span_keys(0), 0);
  EXPECT_EQ(negative.span_keys(2), 50);
  kernels::KeyListExtent plain = e;
  plain.causal = false;
  EXPECT_EQ(plain.span_keys(0), 300);
  // counts then blocks, for the 6 lists (2 heads x 3 query tiles).
  const int sizes[] = {0, 1, 129, 200, 300, 5, /* blocks */ 0, 1, 2, 2, 3, 1};
  const ListedWork work = listed_work(e, sizes);
  EXPECT_TRUE(work.known);
  EXPECT_EQ(work.listed, 0 + 1 + 2 + 2 + 3 + 1);
  EXPECT_EQ(work.visible, 0 + 1 + 2 + 2 + 3 + 1);
  EXPECT_EQ(work.span, 2 * (2 + 3 + 3));
  EXPECT_EQ(gather_pays(work, 0.9), kernels::lists_pay(work.listed, work.visible, work.span, 0.9, kSparseTilesShare));
}

TEST(GatherBackwardShare, PairedHeadsGatherFurther) {
  using Kernel = GatherBackwardKernel;
  EXPECT_EQ(gather_backward_share(128, Kernel::sm80), 0.65);
  EXPECT_EQ(gather_backward_share(128, Kernel::sm80_paired), kPairedGatherBackwardShare);
  EXPECT_EQ(gather_backward_share(128, Kernel::sm90a_paired), kSm90aPairedGatherBackwardShare);
  EXPECT_EQ(gather_backward_share(64, Kernel::sm80), 0.8);
  EXPECT_EQ(gather_backward_share(32, Kernel::sm80_paired), kD32GatherBackwardShare);
  // Scattered keys at 0.76 of the span (top-4096 of 8192): gathered with paired heads only.
  ListedWork work;
  work.listed = 76, work.visible = 100, work.span = 100, work.known = true;
  EXPECT_TRUE(gather_pays(work, gather_backward_share(128, Kernel::sm80_paired)));
  EXPECT_FALSE(gather_pays(work, gather_backward_share(128, Kernel::sm80)));
  // At 0.94 (top-6144 of 8192): gathered on the sm90a paired kernel only.
  work.listed = 94;
  EXPECT_TRUE(gather_pays(work, gather_backward_share(128, Kernel::sm90a_paired)));
  EXPECT_FALSE(gather_pays(work, gather_backward_share(128, Kernel::sm80_paired)));
}

// A prepared mask holds a backward choice for calls whose heads pair and one for calls whose
// heads do not (a bias with a head per query head), and each backward follows its own.
TEST(GatherApplies, BackwardFollowsTheChoiceForItsKernel) {
  if (sparse_path() != SparsePath::automatic) GTEST_SKIP() << kSparsePathVariable << " is set";
  bool byte = true;
  const std::optional<TensorView> mask = make_contiguous_view(&byte, DType::boolean, {1, 1, 1, 1});
  TensorView rows = *mask;  // a row per query and a key dim: lists can be built
  rows.shape[2] = 8, rows.shape[3] = 8, rows.stride[2] = 8, rows.stride[1] = rows.stride[0] = 64;
  PreparedMask prepared;
  prepared.gather_backward = true;  // paired heads gather at this share, a head per CTA would not
  prepared.gather_backward_unpaired = false;
  EXPECT_TRUE(gather_applies(rows, 8, &prepared, BackendImpl::Pass::backward, /*heads_pair=*/true));
  EXPECT_FALSE(gather_applies(rows, 8, &prepared, BackendImpl::Pass::backward, /*heads_pair=*/false));
  EXPECT_FALSE(gather_applies(rows, 8, &prepared, BackendImpl::Pass::forward));
  EXPECT_FALSE(gather_applies(rows, 8, nullptr, BackendImpl::Pass::backward, true));  // unprepared: tile
  EXPECT_FALSE(gather_applies(mask, 8, &prepared, BackendImpl::Pass::backward, true));  // one row for all queries
}

}  // namespace
}  // namespace flash_dmattn
