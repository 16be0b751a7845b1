// GPU forward on decode shapes, the calls a split-KV decode kernel serves: a few query rows
// (Sq = 1, 2, 5, 16) against key lengths from 1 to 131072, with GQA ratios 1, 3, 4 and 8.
//   ShortKeys/DecodeShapes  every (Sq, Sk) pair with Sk in {1, 63, 4097} and each of five
//       mask/bias pairings (the serving case of a (B, Hk, 1, Sk) mask and bias, per-row
//       (B, H, Sq, Sk) ones, a shared key mask with an fp32 per-key bias, a bias alone, a mask
//       alone), causal off and on (with Sk = 1 < Sq, causal leaves the first Sq - 1 rows without
//       a key); batch, heads, head dim and dtype rotate over the cases.
//   LongKeys/DecodeShapes   Sk = 65537 for every Sq and pairing, and Sq = 1 at Sk = 131072,
//       picked by hand.
//   DecodeMasks  on three shapes, two of them with Sk = 65537: a top-k-like mask of density 0.03,
//       visible keys confined to one short range of the key axis (a few key tiles active, most
//       splits empty), and rows and whole KV groups with no visible key.
// Host cost, which bounds what runs here: building, uploading and checking a problem costs about
// 30-40 ns per input element on one thread (k and v hold B·Sk·Hk·D each), and the fp64 reference
// about 10 ns per multiply-add (B·H·Sq·Sk·D of them, fewer where the mask hides keys), spread over
// the threads. The short-key rotation skips the choices over kMaxMultiplyAdds or kMaxKeyElements.
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "forward_harness.h"

namespace flash_dmattn::test {
namespace {

struct HeadCounts {
  std::int64_t H, Hk;
};

constexpr std::array<std::int64_t, 4> kQueryLengths = {1, 2, 5, 16};
constexpr std::array<std::int64_t, 3> kShortKeyLengths = {1, 63, 4097};
constexpr std::int64_t kLongKeys = 65537;
constexpr std::int64_t kLongestKeys = 131072;  // Sq = 1 only
constexpr std::array<std::int64_t, 2> kBatches = {1, 3};
constexpr std::array<HeadCounts, 4> kHeadCounts = {{{32, 8}, {8, 8}, {8, 1}, {6, 2}}};
constexpr std::array<std::int64_t, 2> kHeadDims = {64, 128};
constexpr std::array<DType, 2> kDtypes = {DType::bfloat16, DType::float16};

// Host budget of a short-key case (see the top of the file): multiply-adds of the reference, and
// elements of k (as many again in v).
constexpr double kMaxMultiplyAdds = 1.5e8;
constexpr double kMaxKeyElements = 2.5e6;

double multiply_adds(const Sizes& n) {
  return static_cast<double>(n.B) * static_cast<double>(n.H) * static_cast<double>(n.Sq) *
         static_cast<double>(n.Sk) * static_cast<double>(n.D);
}

double key_elements(const Sizes& n) {
  return static_cast<double>(n.B) * static_cast<double>(n.Sk) * static_cast<double>(n.Hk) * static_cast<double>(n.D);
}

std::string dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::float16: return "fp16";
    case DType::bfloat16: return "bf16";
    case DType::float32: return "f32";
    default: return dtype_name(dtype);
  }
}

std::string sizes_name(const Sizes& n, DType dtype) {
  return "Sq" + std::to_string(n.Sq) + "_Sk" + std::to_string(n.Sk) + "_B" + std::to_string(n.B) + "_H" +
         std::to_string(n.H) + "_Hk" + std::to_string(n.Hk) + "_D" + std::to_string(n.D) + "_" + dtype_tag(dtype);
}

// ---- every (Sq, Sk) pair × five mask/bias pairings, causal off and on ----

enum class Operands {
  serving,               // mask (B, Hk, 1, Sk) + bias (B, Hk, 1, Sk): one key selection per KV head
  per_row,               // mask (B, H, Sq, Sk) + bias (B, H, Sq, Sk)
  key_mask_fp32_bias,    // mask (1, 1, 1, Sk) + fp32 bias (B, 1, 1, Sk)
  bias_only,             // no mask, bias (B, Hk, 1, Sk)
  mask_only,             // mask (B, Hk, Sq, Sk), no bias
};

constexpr std::array<Operands, 5> kOperandPairings = {Operands::serving, Operands::per_row,
                                                       Operands::key_mask_fp32_bias, Operands::bias_only,
                                                       Operands::mask_only};

const char* operands_name(Operands operands) {
  switch (operands) {
    case Operands::serving: return "mask_BHk1Sk_bias_BHk1Sk";
    case Operands::per_row: return "mask_BHSqSk_bias_BHSqSk";
    case Operands::key_mask_fp32_bias: return "mask_111Sk_bias_B11Sk_f32";
    case Operands::bias_only: return "mask_none_bias_BHk1Sk";
    case Operands::mask_only: return "mask_BHkSqSk_bias_none";
  }
  return "unknown";
}

struct DecodeCase {
  Sizes n;
  DType dtype = DType::bfloat16;
  Operands operands = Operands::serving;
  bool causal = false;
  bool expanded = false;  // size-1 mask/bias dimensions through stride 0; otherwise odd row pads
};

ForwardCase forward_case(const DecodeCase& d) {
  ForwardCase c;
  c.n = d.n;
  c.dtype = d.dtype;
  c.causal = d.causal;
  const Sizes& n = d.n;
  switch (d.operands) {
    case Operands::serving:
      c.mask = OperandShape{true, n.Hk, false, true};
      c.bias = OperandShape{true, n.Hk, false, true};
      break;
    case Operands::per_row:
      c.mask = OperandShape{true, n.H, true, true};
      c.bias = OperandShape{true, n.H, true, true};
      break;
    case Operands::key_mask_fp32_bias:
      c.mask = OperandShape{false, 1, false, true};
      c.bias = OperandShape{true, 1, false, true};
      c.bias_dtype = DType::float32;
      break;
    case Operands::bias_only:
      c.bias = OperandShape{true, n.Hk, false, true};
      break;
    case Operands::mask_only:
      c.mask = OperandShape{true, n.Hk, true, true};
      break;
  }
  c.layout.zero_broadcast_strides = d.expanded;
  c.layout.mask_row_pad = d.expanded ? 0 : 3;
  c.layout.bias_row_pad = d.expanded ? 0 : 5;
  return c;
}

// The 32 (batch, heads, head dim, dtype) choices, those within the host budget at these lengths
// in a fixed order; a case takes choice `index` of them, cyclically.
Sizes rotated_sizes(int index, std::int64_t sq, std::int64_t sk, DType* dtype) {
  std::vector<std::pair<Sizes, DType>> fitting;
  for (int k = 0; k < 32; ++k) {
    const HeadCounts heads = kHeadCounts[k / 2 % 4];
    const Sizes n{kBatches[k % 2], sq, sk, heads.H, heads.Hk, kHeadDims[k / 8 % 2]};
    if (multiply_adds(n) <= kMaxMultiplyAdds && key_elements(n) <= kMaxKeyElements)
      fitting.emplace_back(n, kDtypes[k / 16 % 2]);
  }
  if (fitting.empty()) {  // never with kShortKeyLengths: B = 1, H = 8, Hk = 1, D = 64 fits them all
    *dtype = DType::bfloat16;
    return Sizes{1, sq, sk, 8, 1, 64};
  }
  const auto& [n, chosen] = fitting[static_cast<std::size_t>(index) % fitting.size()];
  *dtype = chosen;
  return n;
}

// Every (Sq, Sk) pair of kQueryLengths × kShortKeyLengths with every pairing: causal off and on
// when Sq > 1; with Sq = 1 causal hides nothing, so those cases alternate it. Names must not
// change between runs, so nothing here is random.
std::vector<DecodeCase> short_key_cases() {
  std::vector<DecodeCase> cases;
  int index = 0;
  for (const std::int64_t sq : kQueryLengths) {
    for (const std::int64_t sk : kShortKeyLengths) {
      for (const Operands operands : kOperandPairings) {
        DecodeCase d;
        d.n = rotated_sizes(index, sq, sk, &d.dtype);
        d.operands = operands;
        d.expanded = index / 2 % 2 == 1;
        if (sq == 1) {
          d.causal = index / 4 % 2 == 1;
          cases.push_back(d);
        } else {
          for (const bool causal : {false, true}) {
            d.causal = causal;
            cases.push_back(d);
          }
        }
        ++index;
      }
    }
  }
  return cases;
}

DecodeCase decode_case(const Sizes& n, DType dtype, Operands operands, bool causal, bool expanded) {
  DecodeCase d;
  d.n = n;
  d.dtype = dtype;
  d.operands = operands;
  d.causal = causal;
  d.expanded = expanded;
  return d;
}

// Sk = 65537 (one key past a power of two, so the last key tile holds a single key) for every Sq
// and pairing, and Sq = 1 at Sk = 131072, picked by hand rather than multiplied out: k and v hold
// 4-13 M elements each here and the host pays 30-40 ns for each. Every pairing and query length,
// both head dims, dtypes and batch sizes, causal off and on for Sq > 1; GQA ratios 3 and 8 only,
// as 8 KV heads would take k and v to 34 M elements each (the other head counts run at Sk = 4097).
std::vector<DecodeCase> long_key_cases() {
  constexpr std::int64_t sk = kLongKeys;
  constexpr DType bf16 = DType::bfloat16, fp16 = DType::float16;
  //           Sizes{B, Sq, Sk, H, Hk, D}
  return {
      decode_case(Sizes{1, 1, sk, 6, 2, 64}, bf16, Operands::serving, false, true),
      decode_case(Sizes{3, 1, sk, 8, 1, 64}, fp16, Operands::key_mask_fp32_bias, true, false),
      decode_case(Sizes{1, 2, sk, 6, 2, 64}, bf16, Operands::per_row, false, false),
      decode_case(Sizes{1, 2, sk, 6, 2, 64}, bf16, Operands::per_row, true, false),
      decode_case(Sizes{1, 5, sk, 8, 1, 128}, fp16, Operands::mask_only, false, true),
      decode_case(Sizes{1, 5, sk, 8, 1, 128}, fp16, Operands::mask_only, true, true),
      decode_case(Sizes{1, 16, sk, 8, 1, 64}, bf16, Operands::serving, false, true),
      decode_case(Sizes{1, 16, sk, 8, 1, 64}, bf16, Operands::serving, true, true),
      decode_case(Sizes{1, 16, sk, 6, 2, 64}, fp16, Operands::bias_only, true, false),
      decode_case(Sizes{1, 1, kLongestKeys, 8, 1, 64}, fp16, Operands::serving, false, true),
  };
}

std::string decode_case_name(const ::testing::TestParamInfo<DecodeCase>& test) {
  const DecodeCase& d = test.param;
  return sizes_name(d.n, d.dtype) + "_" + operands_name(d.operands) + (d.expanded ? "_stride0" : "_padded") +
         (d.causal ? "_causal" : "_full");
}

class DecodeShapes : public GpuParamTest<DecodeCase> {};

TEST_P(DecodeShapes, MatchesReference) {
  auto rng = test_rng();
  expect_forward_matches_reference(ForwardProblem::random(forward_case(GetParam()), rng), stream());
}

INSTANTIATE_TEST_SUITE_P(ShortKeys, DecodeShapes, ::testing::ValuesIn(short_key_cases()), decode_case_name);
INSTANTIATE_TEST_SUITE_P(LongKeys, DecodeShapes, ::testing::ValuesIn(long_key_cases()), decode_case_name);

// ---- sparse and empty masks on long key axes ----

struct DecodeShape {
  Sizes n;
  DType dtype = DType::bfloat16;
};

// Query lengths 1, 5 and 16 with GQA ratios 8, 4 and 3 (8·1, 4·5 and 3·16 query rows per KV
// head), two of them at a key length that a decode kernel splits over many blocks.
std::vector<DecodeShape> sparse_mask_shapes() {
  //       Sizes{B, Sq, Sk, H, Hk, D}
  return {
      {Sizes{1, 1, kLongKeys, 8, 1, 128}, DType::bfloat16},
      {Sizes{1, 5, 4097, 32, 8, 64}, DType::float16},
      {Sizes{1, 16, kLongKeys, 6, 2, 64}, DType::float16},
  };
}

std::string decode_shape_name(const ::testing::TestParamInfo<DecodeShape>& test) {
  return sizes_name(test.param.n, test.param.dtype);
}

// Calls fn(b, head, row, j, offset) for every element of a mask, for edits after ForwardProblem::random.
template <typename Fn>
void for_each_mask_element(HostTensor& mask, Fn fn) {
  const TensorView& v = mask.view;
  for (std::int64_t b = 0; b < v.shape[0]; ++b)
    for (std::int64_t h = 0; h < v.shape[1]; ++h)
      for (std::int64_t i = 0; i < v.shape[2]; ++i)
        for (std::int64_t j = 0; j < v.shape[3]; ++j) fn(b, h, i, j, host::offset4(v, b, h, i, j));
}

// A mask of the given shape and density with the serving bias (B, Hk, 1, Sk).
ForwardCase sparse_case(const DecodeShape& shape, const OperandShape& mask, double density, bool causal) {
  ForwardCase c;
  c.n = shape.n;
  c.dtype = shape.dtype;
  c.mask = mask;
  c.density = density;
  c.bias = OperandShape{true, shape.n.Hk, false, true};
  c.causal = causal;
  return c;
}

OperandShape serving_mask(const Sizes& n) { return OperandShape{true, n.Hk, false, true}; }
OperandShape per_row_mask(const Sizes& n) { return OperandShape{true, n.H, true, true}; }

// Each (batch, KV head) sees only 150 consecutive keys, not tile aligned: in the middle of the
// key axis, flush with the last key, or near the first, in turn over the groups. Every other key
// tile, and so most splits, is empty. Causal, so that with Sq > 1 the rows above the last one see
// only part of a range that ends at the last key.
ForwardProblem short_range_problem(const DecodeShape& shape, std::mt19937_64& rng) {
  const Sizes& n = shape.n;
  const std::int64_t length = std::min<std::int64_t>(150, n.Sk);
  ForwardProblem p = ForwardProblem::random(sparse_case(shape, serving_mask(n), 0.8, true), rng);
  for_each_mask_element(*p.mask, [&](std::int64_t b, std::int64_t m, std::int64_t, std::int64_t j,
                                     std::int64_t offset) {
    const std::int64_t where = (b * n.Hk + m) % 3;
    const std::int64_t first = where == 0   ? (n.Sk - length) / 2 + 5 * b
                               : where == 1 ? n.Sk - length
                                            : std::min<std::int64_t>(37, n.Sk - length);
    if (j < first || j >= first + length) p.mask->set(offset, 0.0);
  });
  return p;
}

// A third of the (batch, head, row) rows see no key, spread over the heads of each GQA group and
// over the rows of each head; the others keep half of the keys. Non-causal.
ForwardProblem empty_rows_problem(const DecodeShape& shape, std::mt19937_64& rng) {
  ForwardProblem p = ForwardProblem::random(sparse_case(shape, per_row_mask(shape.n), 0.5, false), rng);
  for_each_mask_element(*p.mask, [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t,
                                     std::int64_t offset) {
    if ((b + h + i) % 3 == 0) p.mask->set(offset, 0.0);
  });
  return p;
}

// Every other (batch, KV head) group, the last one included, hides every key from all of its
// query heads and rows (with B·Hk = 1 the whole call is empty); the others keep a top-k-like 3 %.
// Causal.
ForwardProblem empty_groups_problem(const DecodeShape& shape, std::mt19937_64& rng) {
  const Sizes& n = shape.n;
  ForwardProblem p = ForwardProblem::random(sparse_case(shape, serving_mask(n), 0.03, true), rng);
  for_each_mask_element(*p.mask, [&](std::int64_t b, std::int64_t m, std::int64_t, std::int64_t,
                                     std::int64_t offset) {
    if ((n.B * n.Hk - 1 - (b * n.Hk + m)) % 2 == 0) p.mask->set(offset, 0.0);
  });
  return p;
}

class DecodeMasks : public GpuParamTest<DecodeShape> {};

// About 3 % of the keys visible at random, as a top-k selection leaves them: most key tiles of
// every split hold one or two visible keys, and some rows may see none.
TEST_P(DecodeMasks, TopKLikeDensity3Percent) {
  auto rng = test_rng();
  const DecodeShape shape = GetParam();
  {
    SCOPED_TRACE("mask (B, Hk, 1, Sk), causal");
    expect_forward_matches_reference(
        ForwardProblem::random(sparse_case(shape, serving_mask(shape.n), 0.03, true), rng), stream());
    if (test_stopped()) return;
  }
  {
    SCOPED_TRACE("mask (B, H, Sq, Sk), non-causal");
    expect_forward_matches_reference(
        ForwardProblem::random(sparse_case(shape, per_row_mask(shape.n), 0.03, false), rng), stream());
    if (test_stopped()) return;
  }
  {
    // A row per query and KV head: the gather path packs each KV head's query heads into one
    // CTA, whose rows then read one key list.
    SCOPED_TRACE("mask (B, Hk, Sq, Sk), causal");
    expect_forward_matches_reference(
        ForwardProblem::random(sparse_case(shape, OperandShape{true, shape.n.Hk, true, true}, 0.03, true), rng),
        stream());
  }
}

TEST_P(DecodeMasks, VisibleKeysInOneShortRange) {
  auto rng = test_rng();
  expect_forward_matches_reference(short_range_problem(GetParam(), rng), stream());
}

TEST_P(DecodeMasks, RowsWithNoVisibleKey) {
  auto rng = test_rng();
  {
    SCOPED_TRACE("empty rows of a (B, H, Sq, Sk) mask, non-causal");
    expect_forward_matches_reference(empty_rows_problem(GetParam(), rng), stream());
    if (test_stopped()) return;
  }
  {
    SCOPED_TRACE("empty KV groups of a (B, Hk, 1, Sk) mask, causal");
    expect_forward_matches_reference(empty_groups_problem(GetParam(), rng), stream());
  }
}

INSTANTIATE_TEST_SUITE_P(Forward, DecodeMasks, ::testing::ValuesIn(sparse_mask_shapes()), decode_shape_name);

}  // namespace
}  // namespace flash_dmattn::test
