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

TEST(GatherBackwardShare, PairedHeadsGatherFurther) {
  EXPECT_EQ(gather_backward_share(128, false), 0.65);
  EXPECT_EQ(gather_backward_share(128, true), kPairedGatherBackwardShare);
  EXPECT_EQ(gather_backward_share(128, true, true), kSm90aPairedGatherBackwardShare);
  EXPECT_EQ(gather_backward_share(64, false), 0.8);
  EXPECT_EQ(gather_backward_share(32, true), 1.0);
  // Scattered keys at 0.76 of the span (top-4096 of 8192): gathered with paired heads only.
  ListedWork work;
  work.listed = 76, work.visible = 100, work.span = 100, work.known = true;
  EXPECT_TRUE(gather_pays(work, gather_backward_share(128, true)));
  EXPECT_FALSE(gather_pays(work, gather_backward_share(128, false)));
  // At 0.94 (top-6144 of 8192): gathered on the sm90a paired kernel only.
  work.listed = 94;
  EXPECT_TRUE(gather_pays(work, gather_backward_share(128, true, true)));
  EXPECT_FALSE(gather_pays(work, gather_backward_share(128, true)));
}

}  // namespace
}  // namespace flash_dmattn
