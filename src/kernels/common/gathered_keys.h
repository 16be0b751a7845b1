// The gather path's part of a forward main loop: the CTA's key list (KeyLists, built by
// key_lists.cu), walked in chunks of kBlockN keys. A chunk's keys and its rows' keep bits are
// staged in shared memory by cp.async ahead of their use (kStages buffers: the forward stages a
// chunk ahead, the backward two), so that gathering its K and V rows by cp.async and masking its
// logits wait on no global load; the bias is read at the gathered keys' own columns, or, where a
// producer stages it (kStagesBias), gathered into shared memory beside the keys as floats.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>

#include "kernels/common/fragment_layouts.h"
#include "kernels/common/mask_bias.h"
#include "kernels/common/tile_copy.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Where a forward CTA's keys come from: the key tiles of the span the tile summary leaves active,
// or the key list of the gather path (ForwardParams::lists).
enum class KeySource { tiles, lists };

// The chunks whose keys a forward keeps staged (GatheredKeys' kStages): two ahead of the chunk
// that computes, one for the gathers in flight.
inline constexpr int kForwardGatherStages = 3;

// Whether query heads 2k and 2k + 1 read one list, and one bias row wherever the bias is one
// row per (batch, head): a CTA of two paired heads reads the list of its first head and stages
// that head's bias row for both (stage_bias_row). Launches of paired heads check it; the host
// pairs heads only where it holds (gather_forward_pairs, gather_backward_pairs).
__host__ __device__ inline bool pairs_share_operands(const KeyLists& lists, const BroadcastOperand& bias) {
  auto shared = [](std::int64_t head_stride, int head_divisor) { return head_stride == 0 || head_divisor % 2 == 0; };
  return shared(lists.head_stride, lists.head_divisor) &&
         (bias.ptr == nullptr || bias.row_stride != 0 || shared(bias.head_stride, bias.head_divisor));
}

template <int kBlockM, int kBlockN, int kStages = 2, bool kStagesBias = false>
struct GatheredKeys {
  static_assert(kBlockN % 32 == 0, "a chunk's row bits are whole words");
  static constexpr int kWords = kBlockN / 32;  // row bits per row per chunk
  // One chunk's staging: its kBlockN keys, kWords row-bit words per row, then (kStagesBias) the
  // shared bias row's value at each key, as a float.
  static constexpr int kListWords = kBlockN + kBlockM * kWords;
  static constexpr int kStageWords = kListWords + (kStagesBias ? kBlockN : 0);
  static constexpr int kSmemBytes = kStages * kStageWords * 4;

  const int* keys;  // this CTA's list, ascending
  const std::uint32_t* row_bits;
  int count;
  int first_query;  // the query row of the list's row-bit row 0
  std::uint32_t* staged;  // kSmemBytes of shared memory: chunk c in buffer slot(c)
  // Chunk first_chunk is staged in buffer 0: a pipeline whose stages start at a split's first
  // chunk sets it, so that a chunk's staging shares its stage index.
  int first_chunk = 0;
  // kStagesBias: the bias row whose values a producer stages (set by stage_bias_row()),
  // nullptr where the logits read the bias from global memory instead.
  const char* bias_row = nullptr;
  ElementType bias_type = ElementType::float16;
  bool bias_key_broadcast = false;

  // The list of the query tile of kBlockM query rows that holds query row `query`, for mask head
  // query_head / head_divisor. A CTA of GQA-packed rows (the query heads of one KV head, a few
  // query rows each) reads the list of its query rows, which its heads share.
  __device__ __forceinline__ GatheredKeys(const KeyLists& lists, int b, int query_head, int query, char* smem) {
    const int m_block = query / kBlockM;
    const std::int64_t list = b * lists.batch_stride + (query_head / lists.head_divisor) * lists.head_stride + m_block;
    keys = lists.keys + list * lists.capacity;
    row_bits = lists.row_bits + list * lists.row_bits_stride;
    count = lists.counts[list];
    first_query = m_block * kBlockM;
    staged = reinterpret_cast<std::uint32_t*>(smem);
  }

  __device__ __forceinline__ int chunks() const { return (count + kBlockN - 1) / kBlockN; }

  // Step c of a walk over the list visits chunk position(c): chunks rotation, rotation + 1, ..., then
  // from chunk 0. Every method that takes c takes the step; staging slots follow the steps. A
  // backward rotates its walk (stagger) so that the CTAs running side by side, whose lists hold
  // nearly the same keys, reduce into different keys' dK and dV rows at any moment; forwards
  // walk from chunk 0.
  int rotation = 0;
  __device__ __forceinline__ int position(int c) const {
    const int at = c + rotation, n = chunks();
    return at < n ? at : at - n;
  }
  // Keys from step c's chunk to the list's end: a bound on the chunk's keys (all kBlockN of them
  // but in the last chunk).
  __device__ __forceinline__ int valid(int c) const { return count - position(c) * kBlockN; }
  // Starts the walk at chunk seed mod chunks(): the query tile's index spreads a head's CTAs.
  __device__ __forceinline__ void stagger(int seed) {
    const int n = chunks();
    rotation = n > 0 ? seed % n : 0;
  }

  __device__ __forceinline__ int slot(int c) const { return (c - first_chunk) % kStages; }
  __device__ __forceinline__ const int* staged_keys(int c) const {
    return reinterpret_cast<const int*>(staged + slot(c) * kStageWords);
  }
  __device__ __forceinline__ const std::uint32_t* staged_row_bits(int c) const {
    return staged + slot(c) * kStageWords + kBlockN;
  }
  __device__ __forceinline__ const float* staged_bias(int c) const {
    return reinterpret_cast<const float*>(staged + slot(c) * kStageWords + kListWords);
  }

  // Stages the bias where every query row of (b, query head h) reads one row, the common
  // (B, Hk, 1, Sk) bias: its values at the chunks' keys are then staged (put_bias). Both roles of
  // a CTA call it alike.
  __device__ __forceinline__ void stage_bias_row(const ForwardParams& p, int b, int h) {
    static_assert(kStagesBias, "this list has no room for bias values");
    const BroadcastOperand& bias = p.bias;
    if (bias.ptr == nullptr || bias.row_stride != 0) return;
    const int bytes = bias.type == ElementType::float32 ? 4 : 2;
    bias_row = static_cast<const char*>(bias.ptr) + bytes * (b * bias.batch_stride + (h / bias.head_divisor) * bias.head_stride);
    bias_type = bias.type;
    bias_key_broadcast = bias.col_stride == 0;
  }

  // The staged bias row's value at `key` (kStagesBias, bias_row set) in two steps, the load of its
  // raw 2 or 4 bytes and their conversion to float, so that a thread can hold the load in flight
  // across other work and convert where it stores the value: converting right after the load
  // waited for the load there.
  __device__ __forceinline__ std::uint32_t bias_bits_at(int key) const {
    if (bias_key_broadcast) key = 0;
    if (bias_type == ElementType::float32) return __ldg(reinterpret_cast<const unsigned int*>(bias_row) + key);
    return __ldg(reinterpret_cast<const unsigned short*>(bias_row) + key);
  }
  __device__ __forceinline__ float bias_from_bits(std::uint32_t bits) const {
    if (bias_type == ElementType::bfloat16) return __uint_as_float(bits << 16);
    if (bias_type == ElementType::float16) return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    return __uint_as_float(bits);
  }
  // Both steps at once, by a plain load: the sm90a gather backward spills more with
  // bias_from_bits(bias_bits_at(key)) here (ptxas, D128 bf16: 88 bytes of stack against 72).
  __device__ __forceinline__ float bias_at(int key) const {
    if (bias_key_broadcast) key = 0;
    if (bias_type == ElementType::bfloat16) return static_cast<float>(reinterpret_cast<const cute::bfloat16_t*>(bias_row)[key]);
    if (bias_type == ElementType::float16) return static_cast<float>(reinterpret_cast<const cute::half_t*>(bias_row)[key]);
    return reinterpret_cast<const float*>(bias_row)[key];
  }

  // Key j's bias value into chunk c's staging (a plain store: the caller's barrier or arrival
  // releases it to the readers).
  __device__ __forceinline__ void put_bias(int c, int j, float value) const {
    static_assert(kStagesBias, "this list has no room for bias values");
    reinterpret_cast<float*>(staged + slot(c) * kStageWords + kListWords)[j] = value;
  }

  // Issues the cp.async copies (16 bytes each, the CTA's threads sharing them) that stage chunk c.
  // Every copy stays inside the list: its room is a multiple of 4 keys and its row bits hold every
  // chunk of Sk keys. Keys past the list's end are not copied (they are never read). Some copied
  // words were never written by the build (keys up to the next multiple of 4, the row bits of rows
  // past Sq and of positions past the list's end): apply() never lets them decide anything.
  __device__ __forceinline__ void stage(int c, int thread, int threads) const {
    using Vector = cute::uint128_t;
    std::uint32_t* dst = staged + slot(c) * kStageWords;
    const int at = position(c), listed = count - at * kBlockN;
    for (int v = thread; v < kListWords / 4; v += threads) {
      const std::uint32_t* src;
      if (v < kBlockN / 4) {
        if (4 * v >= listed) continue;
        src = reinterpret_cast<const std::uint32_t*>(keys) + at * kBlockN + 4 * v;
      } else {
        src = row_bits + std::int64_t(at) * kBlockM * kWords + 4 * v - kBlockN;
      }
      cute::SM80_CP_ASYNC_CACHEGLOBAL<Vector>::copy(*reinterpret_cast<const Vector*>(src),
                                                   *reinterpret_cast<Vector*>(dst + 4 * v));
    }
  }

  // Gathers the K or V rows of chunk c (staged) into a (kBlockN, D) tile; base: row 0 of this
  // (batch, KV head). Rows past the list's end are zero-filled: zero V rows keep P·V finite where
  // P is 0. dst, coords: the thread's vectors as the tiled copy partitions them, (vector, rows, cols).
  template <typename Element, typename TensorD, typename TensorC>
  __device__ __forceinline__ void load(TensorD&& dst, const TensorC& coords, int c, const Element* base,
                                       std::int64_t row_stride, int head_dim) const {
    const int* chunk = staged_keys(c);
    copy_rows_by_pointer_async<Element>(dst, coords, valid(c), head_dim,
                               [&](int row) { return base + chunk[row] * row_stride; });
  }

  // Turns the raw q·k products of chunk c into logits, as MaskBiasPolicy::apply does for a key
  // tile: z = softcap(scale·qk) + bias, -inf where the row does not keep the key (its keep bit,
  // which holds the mask and causal alignment; past Sq; past the list's end).
  // emit(r, col, z, dcap) sees every element as MaskBiasPolicy::apply's does (the backward forms
  // P and dZ there); dcap = 1 - tanh² under softcap, 1 without.
  template <typename Kind, typename Policy, typename TensorS, typename TensorC, typename Emit>
  __device__ __forceinline__ void apply(Kind, const Policy& policy, TensorS& s_flat, const TensorC& coords_flat,
                                        int c, Emit&& emit) const {
    using namespace cute;
    using T = typename Kind::BiasElement;
    Tensor s = make_tensor(s_flat.data(), accumulator_as_rows_cols(s_flat.layout()));
    Tensor coords = make_tensor(coords_flat.data(), accumulator_as_rows_cols(coords_flat.layout()));
    constexpr int kRows = decltype(size<0>(s))::value, kCols = decltype(size<1>(s))::value;
    constexpr bool kBias = Kind::kBias != BiasSource::none;
    // Column by column: a column's key and (where every row reads one bias row) its bias value
    // serve all of the thread's rows, and no per-column array stays live.
    const int* chunk = staged_keys(c);
    // The thread's columns lie at fixed offsets from its lowest one (the accumulator layout), so
    // its rows' bits are shifted once to start there: each element then tests one bit whose
    // position is known at compile time. Indexing the words by the column itself put them in
    // local memory (the sm90a gather forward spilled 1.8 KB per thread). The words also fold in
    // what hides whole rows (past Sq) and columns (past the list's end), once per chunk.
    const int lowest_col = get<1>(coords(0, 0));
    const int first_word = lowest_col / 32, shift = lowest_col % 32;
    const int in_chunk = valid(c), listed = in_chunk - lowest_col;  // offsets below listed hold keys of the list
    std::uint32_t keep[kRows][kWords];  // the row's bits from lowest_col on
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // A row's bits by its query row (with packing, rows of several heads share one); a row past
      // Sq reads some row's and is hidden.
      const int row = min(max(policy.row_index[r] - first_query, 0), kBlockM - 1);
      const bool row_exists = policy.row_index[r] < policy.seqlen_q;
      const std::uint32_t* bits = staged_row_bits(c) + row * kWords;
      CUTE_UNROLL
      for (int w = 0; w < kWords; ++w) {
        const int at = first_word + w, below = listed - 32 * w;
        const std::uint32_t lo = at < kWords ? bits[at] : 0u, hi = at + 1 < kWords ? bits[at + 1] : 0u;
        const std::uint32_t in_list = below >= 32 ? ~0u : below <= 0 ? 0u : (1u << below) - 1u;
        keep[r][w] = row_exists ? __funnelshift_r(lo, hi, shift) & in_list : 0u;
      }
    }
    const float logit_scale = Kind::kSoftcap ? policy.scale / policy.softcap : policy.scale;
    CUTE_UNROLL
    for (int col = 0; col < kCols; ++col) {
      const int k = get<1>(coords(0, col));
      const int offset = k - lowest_col;  // a compile-time constant once the loop is unrolled
      float shared_bias = 0.f;
      int key = 0;
      if constexpr (Kind::kBias == BiasSource::staged_row) {
        static_assert(kStagesBias, "a staged bias row needs a list that stages it");
        shared_bias = staged_bias(c)[k];
      } else if constexpr (kBias) {
        // The key at this column (key 0 past the list's end: its logit is discarded).
        key = policy.bias_key_broadcast || k >= in_chunk ? 0 : chunk[k];
        if (policy.bias_shared_row) shared_bias = static_cast<float>(reinterpret_cast<const T*>(policy.bias_row[0])[key]);
      }
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float z, dcap = 1.f;
        if constexpr (Kind::kSoftcap) {
          const float t = tanhf(s(r, col) * logit_scale);
          z = policy.softcap * t;
          dcap = fmaf(-t, t, 1.f);
        } else {
          z = s(r, col) * logit_scale;
        }
        if constexpr (Kind::kBias == BiasSource::staged_row) {
          z += shared_bias;
        } else if constexpr (kBias) {
          z += policy.bias_shared_row ? shared_bias : static_cast<float>(reinterpret_cast<const T*>(policy.bias_row[r])[key]);
        }
        const bool visible = (keep[r][offset / 32] & (1u << (offset % 32))) != 0u;
        s(r, col) = visible ? z : -INFINITY;
        emit(r, col, s(r, col), dcap);
      }
    }
  }

  template <typename Kind, typename Policy, typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(Kind kind, const Policy& policy, TensorS& s_flat, const TensorC& coords_flat,
                                        int c) const {
    apply(kind, policy, s_flat, coords_flat, c, [](int, int, float, float) {});
  }
};

}  // namespace flash_dmattn::kernels
