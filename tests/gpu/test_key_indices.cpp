// Key indices (ForwardArgs::indices) on the CUDA backend: the key lists built from them against a
// host build, then forward and backward through the public API against the bool mask they stand
// for, on the gather path both (FLASH_DMATTN_SPARSE_PATH=gather): the same lists, so out, lse and
// dQ (one writer per element) agree bit for bit, and dK, dV and dBias (atomic reductions, in any
// order) to rounding. Cases: decode (lists built straight from the entries) with GQA packing, causal,
// empty lists; causal prefill, one list for every row, lists per query head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "device_tensor.h"
#include "forward_harness.h"
#include "cuda/sparse_path.h"
#include "kernels/common/index_bits.h"
#include "test_util.h"

namespace flash_dmattn::test {
namespace {

class IndexBitsBuild : public GpuTest {};

// Random entries, -1, duplicates and values outside [0, Sk) (skipped: the CUDA backend cannot read
// the values before launch), rows broadcast from one list, causal or not: the lists built from
// them against a host build of what build_key_lists makes of a mask (each query tile's union of
// keys ascending, each row's bits at them).
TEST_F(IndexBitsBuild, ListsHoldTheListedKeysOnly) {
  auto rng = test_rng();
  struct Shape {
    std::int64_t Sq, Sk, K;
  };
  // Up to 2^18 keys the lists come straight from the entries (one word per thread up to 32768
  // keys, a run of words past it; one query row, or several per tile with up to 256 entries,
  // or two tiles), past it, or with longer lists for several rows, through the bits.
  for (const Shape n : {Shape{1, 77, 40}, Shape{5, 77, 40}, Shape{70, 77, 40}, Shape{1, 40000, 3000},
                        Shape{70, 40000, 200}, Shape{70, 40000, 700}, Shape{1, 262145, 500}, Shape{5, 262145, 300}})
    for (const bool shared_rows : {false, true})
      for (const bool causal : {false, true}) {
        const std::int64_t B = 2, H = 3, Sq = n.Sq, Sk = n.Sk, K = n.K;
        if (shared_rows && Sq == 1) continue;
        SCOPED_TRACE("Sq " + std::to_string(Sq) + " Sk " + std::to_string(Sk) +
                     (shared_rows ? ", one list for every row" : ", a list per row") + (causal ? ", causal" : ""));
        HostTensor indices = HostTensor::empty(DType::int32, {B, H, shared_rows ? 1 : Sq, K});
        std::uniform_int_distribution<int> key(-3, static_cast<int>(Sk) + 2);
        for (std::int64_t i = 0; i < indices.view.numel(); ++i) indices.set(i, key(rng));
        const DeviceTensor device = DeviceTensor::upload(indices);
        kernels::KeyListExtent e;
        e.batches = B, e.heads = H, e.seqlen_q = static_cast<int>(Sq), e.seqlen_k = static_cast<int>(Sk);
        e.block_m = 64, e.block_n = 64, e.causal = causal, e.diagonal = static_cast<int>(Sk - Sq);
        DeviceBuffer bits(std::max<std::size_t>(kernels::index_bits_bytes(e, static_cast<int>(K)), 1));
        DeviceBuffer memory(kernels::key_lists_bytes(e));
        cuda_check(cudaMemsetAsync(memory.data(), 0xab, memory.bytes(), stream()), "poison");
        kernels::TileSummary summary;
        kernels::KeyLists lists;
        cuda_check(kernels::build_index_lists(e, index_rows(device.view()), bits.data(), memory.data(), stream(),
                                              &summary, &lists),
                   "build");
        std::vector<std::uint32_t> words(memory.bytes() / 4);
        cuda_check(cudaMemcpyAsync(words.data(), memory.data(), memory.bytes(), cudaMemcpyDeviceToHost, stream()),
                   "download");
        cuda_check(cudaStreamSynchronize(stream()), "synchronize");
        auto at = [&](const void* p) {
          return static_cast<std::size_t>(static_cast<const char*>(p) - static_cast<const char*>(memory.data())) / 4;
        };
        const int words_per_chunk_row = e.block_n / 32;
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t m = 0; m < e.query_tiles(); ++m) {
              const std::int64_t list = (b * H + h) * e.query_tiles() + m;
              const std::int64_t m_begin = m * e.block_m, m_end = std::min<std::int64_t>(m_begin + e.block_m, Sq);
              // kept[r][j]: row m_begin + r names key j, and j <= its row + diagonal where causal.
              std::vector<std::vector<bool>> kept(static_cast<std::size_t>(m_end - m_begin),
                                                  std::vector<bool>(static_cast<std::size_t>(Sk), false));
              for (std::int64_t i = m_begin; i < m_end; ++i)
                for (std::int64_t t = 0; t < K; ++t) {
                  const auto j = static_cast<std::int64_t>(
                      indices.get(host::offset4(indices.view, b, h, shared_rows ? 0 : i, t)));
                  if (j >= 0 && j < Sk && (!causal || j <= i + e.diagonal)) {
                    kept[static_cast<std::size_t>(i - m_begin)][static_cast<std::size_t>(j)] = true;
                  }
                }
              std::vector<int> expected;
              for (std::int64_t j = 0; j < Sk; ++j)
                for (const auto& row : kept)
                  if (row[static_cast<std::size_t>(j)]) {
                    expected.push_back(static_cast<int>(j));
                    break;
                  }
              const int count = static_cast<int>(words[at(lists.counts) + list]);
              ASSERT_EQ(count, static_cast<int>(expected.size())) << "list " << list;
              const std::size_t keys = at(lists.keys) + static_cast<std::size_t>(list * lists.capacity);
              for (int t = 0; t < count; ++t) ASSERT_EQ(static_cast<int>(words[keys + t]), expected[t]) << "list " << list;
              const std::size_t row_bits = at(lists.row_bits) + static_cast<std::size_t>(list * lists.row_bits_stride);
              for (std::int64_t r = 0; r < m_end - m_begin; ++r)
                for (int t = 0; t < count; ++t) {
                  const int q = t / 32;
                  const std::uint32_t word =
                      words[row_bits + (std::size_t(q / words_per_chunk_row) * e.block_m + r) * words_per_chunk_row +
                            q % words_per_chunk_row];
                  ASSERT_EQ(((word >> (t % 32)) & 1u) != 0,
                            kept[static_cast<std::size_t>(r)][static_cast<std::size_t>(expected[t])])
                      << "row " << m_begin + r << " position " << t;
                }
            }
      }
}

struct IndexCase {
  const char* name;
  Sizes n;
  OperandShape rows;  // the indices' batch, heads and query dims (key: the list)
  std::int64_t keep;  // distinct keys per list (each list also repeats one and pads one)
  bool causal;
};

struct Results {
  HostTensor out, lse, dq, dk, dv, dbias;
};

// Whether a refusal is the build's or the device's to make (a head dim left out of the build, a
// gather kernel larger than the device's shared memory): the test skips then.
bool not_for_this_build_or_device(const Status& status) {
  return head_dim_not_compiled(status) ||
         (status.code() == StatusCode::unsupported && status.message().find("shared memory") != std::string::npos);
}

// Forward and backward of p through the public API on the device, with `mask` or `indices`;
// nullopt where the call was refused (a test failure unless not_for_this_build_or_device).
std::optional<Results> run(const RefProblem& p, const HostTensor* mask, const HostTensor* indices,
                           cudaStream_t stream) {
  const Sizes& n = p.n;
  const DeviceTensor q = DeviceTensor::upload(p.q), k = DeviceTensor::upload(p.k), v = DeviceTensor::upload(p.v);
  const DeviceTensor bias = DeviceTensor::upload(*p.bias), dout = DeviceTensor::upload(p.dout);
  std::optional<DeviceTensor> m, idx;
  if (mask) m = DeviceTensor::upload(*mask);
  if (indices) idx = DeviceTensor::upload(*indices);
  const DeviceTensor out = DeviceTensor::poisoned(HostTensor::empty(p.q.view.dtype, {n.B, n.Sq, n.H, n.D}));
  const DeviceTensor lse = DeviceTensor::poisoned(HostTensor::empty(DType::float32, {n.B, n.H, n.Sq}));
  const DeviceTensor dq = DeviceTensor::poisoned(HostTensor::empty(p.q.view.dtype, {n.B, n.Sq, n.H, n.D}));
  const DeviceTensor dk = DeviceTensor::poisoned(HostTensor::empty(p.q.view.dtype, {n.B, n.Sk, n.Hk, n.D}));
  const DeviceTensor dv = DeviceTensor::poisoned(HostTensor::empty(p.q.view.dtype, {n.B, n.Sk, n.Hk, n.D}));
  const DeviceTensor dbias = DeviceTensor::poisoned(*p.bias);
  ForwardArgs f;
  f.q = q.view(), f.k = k.view(), f.v = v.view(), f.bias = bias.view(), f.out = out.view(), f.lse = lse.view();
  if (m) f.mask = m->view();
  if (idx) f.indices = idx->view();
  f.options.causal = p.causal;
  f.options.stream = stream;
  std::size_t bytes = 0;
  Status status = forward_workspace_size(f, &bytes);
  if (!status.ok()) {
    if (!not_for_this_build_or_device(status)) ADD_FAILURE() << status.message();
    return std::nullopt;
  }
  DeviceBuffer forward_space(bytes);
  f.workspace = forward_space.workspace();
  status = forward(f);
  EXPECT_TRUE(status.ok()) << status.message();
  BackwardArgs b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.mask = f.mask, b.indices = f.indices, b.bias = f.bias, b.out = f.out;
  b.lse = f.lse, b.dout = dout.view(), b.dq = dq.view(), b.dk = dk.view(), b.dv = dv.view(), b.dbias = dbias.view();
  b.options = f.options;
  status = backward_workspace_size(b, &bytes);
  if (!status.ok()) {
    if (!not_for_this_build_or_device(status)) ADD_FAILURE() << status.message();
    return std::nullopt;
  }
  DeviceBuffer backward_space(bytes);
  b.workspace = backward_space.workspace();
  status = backward(b);
  EXPECT_TRUE(status.ok()) << status.message();
  cuda_check(cudaStreamSynchronize(stream), "synchronize");
  return Results{out.download(), lse.download(), dq.download(), dk.download(), dv.download(), dbias.download()};
}

void expect_same_bytes(const char* name, const HostTensor& a, const HostTensor& b) {
  EXPECT_TRUE(a.bytes == b.bytes) << name << " differs between the two calls";
}

// Within 1% of the tensor's largest magnitude: fp32 reductions summed in another order. A value
// that is not finite (an element never written keeps its NaN poison) fails.
void expect_close(const char* name, const HostTensor& a, const HostTensor& b) {
  double largest = 0;
  for (std::int64_t i = 0; i < b.view.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(a.get(i)) && std::isfinite(b.get(i))) << name << "[" << i << "] is not finite";
    largest = std::max(largest, std::abs(b.get(i)));
  }
  for (std::int64_t i = 0; i < b.view.numel(); ++i) {
    EXPECT_LE(std::abs(a.get(i) - b.get(i)), 1e-2 * largest + 1e-6) << name << "[" << i << "] of " << largest;
    if (::testing::Test::HasFailure()) return;
  }
}

// Two calls that must agree: out and lse bit for bit, dK, dV and dBias (fp32 reductions) to
// rounding, and dQ bit for bit where each query tile's CTA writes it once (the gather path), else
// to rounding too (the tile path sums it by atomics in any order).
enum class Dq { bitwise, rounded };
void expect_same_results(const Results& a, const Results& b, Dq dq) {
  expect_same_bytes("out", a.out, b.out);
  expect_same_bytes("lse", a.lse, b.lse);
  if (dq == Dq::bitwise) {
    expect_same_bytes("dq", a.dq, b.dq);
  } else {
    expect_close("dq", a.dq, b.dq);
  }
  expect_close("dk", a.dk, b.dk);
  expect_close("dv", a.dv, b.dv);
  expect_close("dbias", a.dbias, b.dbias);
}

class KeyIndicesCall : public GpuParamTest<IndexCase> {};

TEST_P(KeyIndicesCall, MatchTheMaskTheyStandFor) {
  const IndexCase& c = GetParam();
  auto rng = test_rng();
  RefProblem p = RefProblem::random(c.n, rng, std::nullopt, OperandShape{true, c.n.Hk, false, true}, 0.7,
                                    DType::bfloat16);
  p.causal = c.causal;
  const Shape rows = operand_shape(c.n, c.rows);
  const RandomKeyLists lists(Shape{rows[0], rows[1], rows[2]}, c.n.Sk, c.keep, rng);
  // The mask with a row per query: a mask shared by every row has no gather path to compare with.
  HostTensor mask = HostTensor::empty(DType::boolean, {rows[0], rows[1], c.n.Sq, c.n.Sk});
  for (std::int64_t b = 0; b < rows[0]; ++b)
    for (std::int64_t h = 0; h < rows[1]; ++h)
      for (std::int64_t i = 0; i < c.n.Sq; ++i)
        for (std::int64_t j = 0; j < c.n.Sk; ++j)
          mask.set(host::offset4(mask.view, b, h, i, j),
                   lists.mask.get(host::offset4(lists.mask.view, b, h, rows[2] == 1 ? 0 : i, j)));
  const ScopedEnv gather("FLASH_DMATTN_SPARSE_PATH", "gather");
  const std::optional<Results> with_indices = run(p, nullptr, &lists.indices, stream());
  if (!with_indices) {
    if (!HasFailure()) GTEST_SKIP() << "indices refused by this build or device";
    return;
  }
  const std::optional<Results> with_mask = run(p, &mask, nullptr, stream());
  ASSERT_TRUE(with_mask.has_value());
  expect_same_results(*with_indices, *with_mask, Dq::bitwise);
}

// Bit-packed masks (uint8, 8 keys a byte) against the bool masks they pack, on both paths: the
// kernels read only the summary and bits that the packed summary pass builds, so out and lse
// agree bit for bit, and dQ, dK, dV and dBias (on the tile path dQ too is summed by atomics in
// any order) to rounding.
class PackedMaskCall : public GpuParamTest<const char*> {};

TEST_P(PackedMaskCall, MatchesTheBoolMaskItPacks) {
  const ScopedEnv path("FLASH_DMATTN_SPARSE_PATH", GetParam());
  auto rng = test_rng();
  struct Case {
    Sizes n;
    OperandShape mask;
    bool causal;
  };
  for (const Case& c : {Case{{2, 130, 203, 4, 2, 64}, {true, 2, true, true}, true},
                        Case{{1, 77, 64, 4, 1, 128}, {false, 1, true, true}, false},
                        Case{{2, 1, 999, 8, 2, 64}, {true, 2, true, true}, true},
                        Case{{1, 65, 9, 2, 2, 64}, {true, 0, false, true}, true}}) {
    RefProblem p = RefProblem::random(c.n, rng, c.mask, OperandShape{true, c.n.Hk, false, true}, 0.3, DType::bfloat16);
    p.causal = c.causal;
    const HostTensor bits = pack(*p.mask, rng);
    const std::optional<Results> with_bits = run(p, &bits, nullptr, stream());
    if (!with_bits) {
      if (!HasFailure()) GTEST_SKIP() << "refused by this build or device";
      return;
    }
    const std::optional<Results> with_mask = run(p, &*p.mask, nullptr, stream());
    ASSERT_TRUE(with_mask.has_value());
    expect_same_results(*with_bits, *with_mask, Dq::rounded);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, PackedMaskCall, ::testing::Values("tile", "gather"));

TEST_F(IndexBitsBuild, OneListForEveryQueryRowIsRefused) {
  // One list for all of several query rows would be built once per query tile: refused, named.
  auto rng = test_rng();
  RefProblem p = RefProblem::random(Sizes{1, 5, 64, 2, 1, 64}, rng, std::nullopt, std::nullopt, 0.7, DType::bfloat16);
  HostTensor indices = HostTensor::empty(DType::int32, {1, 1, 1, 3});
  for (std::int64_t t = 0; t < 3; ++t) indices.set(t, static_cast<double>(t));
  const DeviceTensor q = DeviceTensor::upload(p.q), k = DeviceTensor::upload(p.k), v = DeviceTensor::upload(p.v);
  const DeviceTensor idx = DeviceTensor::upload(indices);
  const DeviceTensor out = DeviceTensor::poisoned(p.q);
  const DeviceTensor lse = DeviceTensor::poisoned(HostTensor::empty(DType::float32, {1, 2, 5}));
  ForwardArgs f;
  f.q = q.view(), f.k = k.view(), f.v = v.view(), f.out = out.view(), f.lse = lse.view(), f.indices = idx.view();
  std::size_t bytes = 0;
  const Status status = forward_workspace_size(f, &bytes);
  if (head_dim_not_compiled(status)) GTEST_SKIP() << status.message();
  EXPECT_EQ(status.code(), StatusCode::unsupported);
  EXPECT_NE(status.message().find("not one list shared by every query row"), std::string::npos) << status.message();
}

// Sizes: B, Sq, Sk, H, Hk, D.
INSTANTIATE_TEST_SUITE_P(
    Cases, KeyIndicesCall,
    ::testing::Values(IndexCase{"decode_gqa_packed", {2, 1, 3000, 8, 2, 128}, {true, 2, true, true}, 300, false},
                      IndexCase{"causal_prefill", {1, 150, 333, 4, 2, 64}, {true, 2, true, true}, 40, true},
                      IndexCase{"decode_one_list_for_all", {2, 1, 700, 8, 2, 64}, {false, 1, false, true}, 50, false},
                      IndexCase{"empty_lists", {1, 20, 300, 4, 2, 64}, {true, 2, true, true}, 0, true},
                      IndexCase{"lists_per_query_head", {2, 3, 500, 4, 2, 128}, {true, 4, true, true}, 64, true},
                      IndexCase{"decode_causal_per_query_head", {3, 1, 1025, 4, 1, 64}, {true, 4, true, true}, 200,
                                true},
                      IndexCase{"decode_empty_lists", {1, 1, 300, 4, 2, 128}, {true, 2, true, true}, 0, false}),
    [](const ::testing::TestParamInfo<IndexCase>& param) { return std::string(param.param.name); });

}  // namespace
}  // namespace flash_dmattn::test
