// A KV cache (ForwardArgs::cache) on the CUDA backend: the newest Sq queries of every sequence
// against its own cached keys, read through a scrambled block table (pages of 1 to 256 keys, so
// that a key tile spans several pages or lies inside one) or from a contiguous cache, with
// lengths 0, 1, odd, shorter than Sq and past a page; decodes (GQA packing, split keys, the
// decode ring), speculative rows and chunked prefill. Each sequence's out and lse against the
// fp64 reference of that sequence alone; pages no sequence reads hold random values.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "device_tensor.h"
#include "forward_harness.h"
#include "test_util.h"

namespace flash_dmattn::test {
namespace {

struct CacheCase {
  std::vector<std::int64_t> lengths;
  std::int64_t Sq, H, Hk, D;
  std::int64_t page_size;  // 0: a contiguous (B, K, Hk, D) cache
  OperandShape mask, bias;  // batch full; heads and rows as given, keys full
  bool causal;
};

ForwardCase sequence_case(const CacheCase& c, std::int64_t b) {
  ForwardCase fc;
  fc.n = Sizes{1, c.Sq, c.lengths[b], c.H, c.Hk, c.D};
  fc.mask = OperandShape{true, c.mask.heads, c.mask.query, true};
  fc.bias = OperandShape{true, c.bias.heads, c.bias.query, true};
  fc.causal = c.causal;
  return fc;
}

// The cache holding every sequence's keys: sequence b's key j in page table[b, j / page_size],
// row j % page_size (pages in a scrambled order, entries past its last page naming no page), or
// at [b, j] of a contiguous cache; q, mask and bias batch b from the sequence's problem, the
// mask and bias random at keys past its length.
struct CacheBatch {
  std::int64_t B = 0, K = 0, max_pages = 0;
  HostTensor q, k, v, mask, bias, seqlens, table;

  CacheBatch(const CacheCase& c, const std::vector<ForwardProblem>& alone, std::mt19937_64& rng)
      : B(static_cast<std::int64_t>(alone.size())) {
    const std::int64_t longest = *std::max_element(c.lengths.begin(), c.lengths.end());
    const bool paged = c.page_size > 0;
    max_pages = paged ? (longest + c.page_size - 1) / c.page_size + 1 : 0;  // one entry past the longest
    K = paged ? max_pages * c.page_size : longest + 5;
    const std::int64_t rows = paged ? c.page_size : K, slabs = paged ? B * max_pages + 3 : B;
    q = HostTensor::empty(DType::bfloat16, {B, c.Sq, c.H, c.D}, 8);
    k = HostTensor::random(DType::bfloat16, {slabs, rows, c.Hk, c.D}, rng, -1.0, 1.0, 8);
    v = HostTensor::random(DType::bfloat16, {slabs, rows, c.Hk, c.D}, rng);
    const std::int64_t mask_heads = c.mask.heads == 0 ? c.H : c.mask.heads, bias_heads = c.bias.heads == 0 ? c.H : c.bias.heads;
    mask = HostTensor::random(DType::boolean, {B, mask_heads, c.mask.query ? c.Sq : 1, K}, rng, 0.5);
    bias = HostTensor::random(DType::bfloat16, {B, bias_heads, c.bias.query ? c.Sq : 1, K}, rng);
    seqlens = HostTensor::empty(DType::int32, {B});
    std::vector<std::int32_t> order(static_cast<std::size_t>(slabs));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    if (paged) table = HostTensor::empty(DType::int32, {B, max_pages});
    for (std::int64_t b = 0; b < B; ++b) {
      const std::int64_t length = c.lengths[b];
      seqlens.set(b, static_cast<double>(length));
      for (std::int64_t p = 0; paged && p < max_pages; ++p) {
        table.set(b * max_pages + p, p * c.page_size < length ? order[b * max_pages + p] : -7.0 - p);
      }
      copy4(alone[b].q, q, [&](std::int64_t i) { return std::pair{b, i}; });
      auto key_place = [&](std::int64_t j) {
        return paged ? std::pair<std::int64_t, std::int64_t>{order[b * max_pages + j / c.page_size], j % c.page_size}
                     : std::pair<std::int64_t, std::int64_t>{b, j};
      };
      copy4(alone[b].k, k, key_place);
      copy4(alone[b].v, v, key_place);
      place_operand(*alone[b].mask, mask, b);
      place_operand(*alone[b].bias, bias, b);
    }
  }

  // Row i of a (1, rows, heads, D) tensor to row place(i).second of slab place(i).first.
  template <typename Place>
  static void copy4(const HostTensor& one, HostTensor& to, Place place) {
    const TensorView& o = one.view;
    for (std::int64_t i = 0; i < o.shape[1]; ++i) {
      const auto [slab, row] = place(i);
      for (std::int64_t h = 0; h < o.shape[2]; ++h)
        for (std::int64_t d = 0; d < o.shape[3]; ++d)
          to.set(host::offset4(to.view, slab, row, h, d), one.get(host::offset4(o, 0, i, h, d)));
    }
  }
  static void place_operand(const HostTensor& one, HostTensor& to, std::int64_t b) {
    const TensorView& o = one.view;
    for (std::int64_t h = 0; h < o.shape[1]; ++h)
      for (std::int64_t i = 0; i < o.shape[2]; ++i)
        for (std::int64_t j = 0; j < o.shape[3]; ++j)
          to.set(host::offset4(to.view, b, h, i, j), one.get(host::offset4(o, 0, h, i, j)));
  }
};

class KvCacheForward : public GpuParamTest<CacheCase> {};

TEST_P(KvCacheForward, EachSequenceMatchesItsReference) {
  const CacheCase& c = GetParam();
  auto rng = test_rng();
  std::vector<ForwardProblem> alone;
  for (std::int64_t b = 0; b < static_cast<std::int64_t>(c.lengths.size()); ++b) {
    alone.push_back(ForwardProblem::random(sequence_case(c, b), rng));
  }
  const CacheBatch p(c, alone, rng);
  DeviceTensor q = DeviceTensor::upload(p.q), k = DeviceTensor::upload(p.k), v = DeviceTensor::upload(p.v),
               mask = DeviceTensor::upload(p.mask), bias = DeviceTensor::upload(p.bias),
               seqlens = DeviceTensor::upload(p.seqlens);
  DeviceTensor out = DeviceTensor::poisoned(HostTensor::empty(DType::bfloat16, {p.B, c.Sq, c.H, c.D}));
  DeviceTensor lse = DeviceTensor::poisoned(HostTensor::empty(DType::float32, {p.B, c.H, c.Sq}));
  std::optional<DeviceTensor> table;
  if (c.page_size > 0) table = DeviceTensor::upload(p.table);
  ForwardArgs a;
  a.q = q.view(), a.k = k.view(), a.v = v.view(), a.mask = mask.view(), a.bias = bias.view();
  a.out = out.view(), a.lse = lse.view();
  a.cache = KeyValueCache{seqlens.view(), table ? std::optional<TensorView>(table->view()) : std::nullopt};
  a.options.causal = c.causal;
  a.options.stream = stream();
  std::size_t bytes = 0;
  Status status = forward_workspace_size(a, &bytes);
  if (head_dim_not_compiled(status)) GTEST_SKIP() << status.message();
  ASSERT_TRUE(status.ok()) << status.message();
  DeviceBuffer workspace(bytes);
  a.workspace = workspace.workspace();
  cuda_check(cudaDeviceSynchronize(), "uploads");  // (synchronous copies the stream does not wait for)
  status = forward(a);
  ASSERT_TRUE(status.ok()) << status.message();
  cuda_check(cudaStreamSynchronize(stream()), "synchronize");
  const HostTensor all_out = out.download(), all_lse = lse.download();
  EXPECT_TRUE(out.untouched_outside_view("out"));
  EXPECT_TRUE(lse.untouched_outside_view("lse"));

  for (std::int64_t b = 0; b < p.B; ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b) + " of " + std::to_string(c.lengths[b]) + " keys");
    GpuOutputs gpu{HostTensor::empty(DType::bfloat16, {1, c.Sq, c.H, c.D}), HostTensor::empty(DType::float32, {1, c.H, c.Sq})};
    for (std::int64_t i = 0; i < c.Sq; ++i)
      for (std::int64_t h = 0; h < c.H; ++h) {
        for (std::int64_t d = 0; d < c.D; ++d)
          gpu.out.set(host::offset4(gpu.out.view, 0, i, h, d), all_out.get(host::offset4(all_out.view, b, i, h, d)));
        gpu.lse.set(h * gpu.lse.view.stride[1] + i, all_lse.get(b * all_lse.view.stride[0] + h * all_lse.view.stride[1] + i));
      }
    expect_outputs_match_reference(alone[b], gpu);
    if (test_stopped()) return;
  }
}

// Decodes: a GQA group packed into one tile's rows, split keys, a 64- or 128-key tile over pages
// of 16 and inside pages of 64, and over pages of 1 and 7; speculative rows (Sq 4, one shorter sequence); chunked prefill
// (Sq 40 and 33, several warps' rows in the ring) from a contiguous and a paged cache.
const auto kCases = ::testing::Values(
    CacheCase{{5, 1, 130, 0, 64, 300}, 1, 8, 2, 64, 16, {true, 2, false, true}, {true, 0, false, true}, true},
    CacheCase{{1000, 37, 513}, 1, 32, 8, 128, 64, {true, 8, false, true}, {true, 0, false, true}, false},
    CacheCase{{4, 300, 3}, 4, 4, 4, 128, 256, {true, 4, true, true}, {true, 1, false, true}, true},
    CacheCase{{40, 170, 77}, 40, 4, 2, 64, 0, {true, 0, true, true}, {true, 2, false, true}, true},
    CacheCase{{33, 200}, 33, 2, 1, 128, 32, {true, 1, true, true}, {true, 2, true, true}, true},
    // Pages of 1 key (a shift of 0: a tile spans 64 block-table entries) and of 7 (the division:
    // a D64 tile of 128 keys spans 19 or 20 entries and begins mid-page).
    CacheCase{{300, 1, 129}, 1, 8, 2, 128, 1, {true, 2, false, true}, {true, 0, false, true}, false},
    CacheCase{{450, 64, 3}, 2, 4, 4, 64, 7, {true, 4, true, true}, {true, 1, false, true}, true});

INSTANTIATE_TEST_SUITE_P(Cases, KvCacheForward, kCases);

}  // namespace
}  // namespace flash_dmattn::test
