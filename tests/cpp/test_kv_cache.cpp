// A KV cache (ForwardArgs::cache) on the CPU backend: each sequence's out and lse equal those of
// its newest queries over its own cached keys, gathered here from the pages (or cut from the
// contiguous cache) into a batch of one, with its part of the mask, bias and key indices. And the
// cache's checks.
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.h"

namespace flash_dmattn::test {
namespace {

struct CacheCase {
  std::vector<std::int32_t> lengths;
  std::int64_t Sq, H, Hk;
  std::int64_t page_size;  // 0: a contiguous (B, K, Hk, D) cache
  std::int64_t max_pages;  // paged: pages per sequence in the table; contiguous: K = max_pages
  bool mask_batch, mask_rows, bias_keys, causal, with_indices;
  double softcap;
};

struct Cached {
  CacheCase c;
  std::int64_t B, D = 16, K, num_pages = 0;
  HostTensor q, k, v, seqlens, table, mask, bias, indices;

  Cached(const CacheCase& cc, DType dtype, std::mt19937_64& rng) : c(cc), B(static_cast<std::int64_t>(cc.lengths.size())) {
    const bool paged = c.page_size > 0;
    K = paged ? c.max_pages * c.page_size : c.max_pages;
    q = HostTensor::random(dtype, {B, c.Sq, c.H, D}, rng);
    seqlens = HostTensor::empty(DType::int32, {B});
    for (std::int64_t b = 0; b < B; ++b) seqlens.set(b, c.lengths[b]);
    if (paged) {
      // Every table entry a distinct page, in a scrambled order, plus spare pages; entries past a
      // sequence's last page hold indices no cache has (never read).
      num_pages = B * c.max_pages + 3;
      std::vector<std::int32_t> order(static_cast<size_t>(num_pages));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      table = HostTensor::empty(DType::int32, {B, c.max_pages});
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t p = 0; p < c.max_pages; ++p)
          table.set(b * c.max_pages + p, p * c.page_size < c.lengths[b] ? order[b * c.max_pages + p] : -7 - p);
      k = HostTensor::random(dtype, {num_pages, c.page_size, c.Hk, D}, rng, -1.0, 1.0, /*row_pad=*/8);
      v = HostTensor::random(dtype, {num_pages, c.page_size, c.Hk, D}, rng);
    } else {
      k = HostTensor::random(dtype, {B, K, c.Hk, D}, rng, -1.0, 1.0, /*row_pad=*/8);
      v = HostTensor::random(dtype, {B, K, c.Hk, D}, rng);
    }
    mask = HostTensor::random(DType::boolean, {c.mask_batch ? B : 1, c.Hk, c.mask_rows ? c.Sq : 1, K}, rng, 0.8);
    bias = HostTensor::random(dtype, {B, c.H, 1, c.bias_keys ? K : 1}, rng, -2.0, 2.0);
    if (c.with_indices) {  // five keys per row, some past a sequence's length, -1 pads
      indices = HostTensor::empty(DType::int32, {B, 1, c.Sq, 6});
      std::uniform_int_distribution<std::int64_t> key(0, K - 1);
      indices.for_each([&](std::int64_t o) { indices.set(o, key(rng)); });
      for (std::int64_t r = 0; r < B * c.Sq; ++r) indices.set(r * 6 + 5, -1);
    }
  }

  KeyValueCache cache() const {
    KeyValueCache kv;
    kv.seqlens_k = seqlens.view;
    if (c.page_size > 0) kv.block_table = table.view;
    return kv;
  }

  // Sequence b's logical keys [0, length) of a cache, copied into (1, length, Hk, D).
  HostTensor keys_of(const HostTensor& cache, std::int64_t b) const {
    const std::int64_t length = c.lengths[b];
    HostTensor t = HostTensor::empty(cache.view.dtype, {1, length, c.Hk, D});
    for (std::int64_t j = 0; j < length; ++j) {
      const bool paged = c.page_size > 0;
      const std::int64_t page = paged ? static_cast<std::int64_t>(table.get(b * c.max_pages + j / c.page_size)) : b;
      const std::int64_t row = paged ? j % c.page_size : j;
      for (std::int64_t h = 0; h < c.Hk; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          t.set(host::offset4(t.view, 0, j, h, d), cache.get(host::offset4(cache.view, page, row, h, d)));
    }
    return t;
  }

  ForwardArgs args(const HostTensor& out, const HostTensor& lse) const {
    ForwardArgs a;
    a.q = q.view;
    a.k = k.view;
    a.v = v.view;
    a.cache = cache();
    a.mask = mask.view;
    a.bias = bias.view;
    if (c.with_indices) a.indices = indices.view;
    a.out = out.view;
    a.lse = lse.view;
    a.options.causal = c.causal;
    a.options.softcap = c.softcap;
    return a;
  }
};

// Batch b of a (B, ...) tensor, copied into (1, ...).
HostTensor batch_of(const HostTensor& t, std::int64_t b) {
  Shape shape(t.view.shape, t.view.shape + t.view.rank);
  shape[0] = 1;
  HostTensor one = HostTensor::empty(t.view.dtype, shape);
  const std::vector<double> values = t.values();
  std::int64_t e = b * (t.view.numel() / t.view.shape[0]);
  one.for_each([&](std::int64_t o) { one.set(o, values[e++]); });
  return one;
}

void expect_cache_matches_alone(const CacheCase& c, DType dtype) {
  auto rng = test_rng();
  const Cached p(c, dtype, rng);
  HostTensor out = HostTensor::empty(dtype, {p.B, c.Sq, c.H, p.D}), lse = HostTensor::empty(DType::float32, {p.B, c.H, c.Sq});
  poison(out);
  poison(lse);
  const Status status = forward(p.args(out, lse));
  ASSERT_TRUE(status.ok()) << status.message();
  for (std::int64_t b = 0; b < p.B; ++b) {
    const std::int64_t length = c.lengths[b];
    SCOPED_TRACE("sequence " + std::to_string(b) + " of " + std::to_string(length) + " keys");
    HostTensor q1 = batch_of(p.q, b), k1 = p.keys_of(p.k, b), v1 = p.keys_of(p.v, b);
    HostTensor mask1 = operand_of(p.mask, b, c.Sq, length), bias1 = operand_of(p.bias, b, c.Sq, length);
    HostTensor out1 = HostTensor::empty(dtype, {1, c.Sq, c.H, p.D}), lse1 = HostTensor::empty(DType::float32, {1, c.H, c.Sq});
    ForwardArgs a = p.args(out1, lse1);
    a.cache.reset();
    a.q = q1.view;
    a.k = k1.view;
    a.v = v1.view;
    a.mask = mask1.view;
    a.bias = bias1.view;
    HostTensor indices1;
    if (c.with_indices) {  // keys past the length are no key to the sequence alone either
      indices1 = batch_of(p.indices, b);
      a.indices = indices1.view;
      indices1.for_each([&](std::int64_t o) {
        if (indices1.get(o) >= static_cast<double>(length)) indices1.set(o, -1);
      });
    }
    const Status alone = forward(a);
    ASSERT_TRUE(alone.ok()) << alone.message();
    EXPECT_EQ(batch_of(out, b).values(), out1.values()) << "out";
    EXPECT_EQ(batch_of(lse, b).values(), lse1.values()) << "lse";
  }
}

class KvCacheMatch : public ::testing::TestWithParam<DType> {};

TEST_P(KvCacheMatch, EachSequenceAsIfAlone) {
  // lengths: 0, 1, fewer than Sq (causal rows that see nothing), a partial last page, a full cache
  const std::vector<CacheCase> cases = {
      {{9, 0, 1, 16, 5}, 1, 4, 2, 4, 4, true, false, true, false, false, 0.0},
      {{9, 2, 16, 13}, 3, 4, 1, 4, 4, false, true, true, true, false, 0.0},
      {{7, 11, 3}, 3, 2, 2, 8, 2, true, true, false, true, true, 4.0},
      {{5, 12, 0}, 2, 4, 2, 0, 12, true, true, true, true, false, 0.0},  // contiguous
      {{6, 1}, 1, 4, 4, 0, 9, false, false, true, false, true, 0.0},      // contiguous
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    expect_cache_matches_alone(cases[i], GetParam());
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KvCacheMatch, ::testing::Values(DType::float16, DType::bfloat16));

TEST(KvCacheChecks, LengthsPagesAndLayoutsAreNamed) {
  auto rng = test_rng();
  const Cached p({{9, 3}, 1, 2, 1, 4, 3, true, false, true, false, false, 0.0}, DType::float16, rng);
  HostTensor out = HostTensor::empty(DType::float16, {2, 1, 2, 16}), lse = HostTensor::empty(DType::float32, {2, 2, 1});
  ASSERT_TRUE(forward(p.args(out, lse)).ok());
  {
    HostTensor lengths = p.seqlens;
    lengths.set(1, 13);  // K is 12
    ForwardArgs a = p.args(out, lse);
    a.cache->seqlens_k = lengths.view;
    expect_refused(a, "argument 'seqlens_k': expected lengths in [0, K=12] (the cache's logical keys), got 13 for sequence 1");
  }
  {
    HostTensor table = p.table;
    table.set(2, 99);  // sequence 0's third page: read (9 keys of pages of 4)
    ForwardArgs a = p.args(out, lse);
    a.cache->block_table = table.view;
    expect_refused(a, "argument 'block_table': expected page indices in [0, num_pages=9) where a sequence reads them, got 99 at (0, 2)");
  }
  {
    HostTensor table = HostTensor::empty(DType::int32, {3, 3});
    ForwardArgs a = p.args(out, lse);
    a.cache->block_table = table.view;
    expect_refused(a, "argument 'block_table': expected shape (B=2, max_pages), got (3, 3)");
  }
  {
    HostTensor lengths = HostTensor::empty(DType::float32, {2});
    ForwardArgs a = p.args(out, lse);
    a.cache->seqlens_k = lengths.view;
    expect_refused(a, "argument 'seqlens_k': expected dtype int32");
  }
  {
    HostTensor wide = HostTensor::random(DType::float16, {9, 4, 1, 32}, rng);
    ForwardArgs a = p.args(out, lse);
    a.k = wide.view;
    expect_refused(a, "argument 'k': expected shape (num_pages, page_size, Hk, D=16) (a paged cache), got (9, 4, 1, 32)");
  }
  {
    ForwardArgs a = p.args(out, lse);
    a.mask.reset();
    HostTensor short_bias = HostTensor::random(DType::float16, {2, 2, 1, 9}, rng);
    a.bias = short_bias.view;  // over the 12 logical keys, not the longest length
    expect_refused(a, "argument 'bias': expected key size (dim 3) 1 or 12, got 9");
  }
  {
    ForwardArgs a = p.args(out, lse);
    HostTensor offsets = HostTensor::empty(DType::int32, {3});
    a.sequences = PackedSequences{offsets.view, offsets.view, 1, 1};
    expect_refused(a, "argument 'cache': expected no KV cache with packed sequences");
  }
}

}  // namespace
}  // namespace flash_dmattn::test
