// The mask and bias policy: classify a (query tile, key tile) pair, walk the tiles that have
// visible keys, and turn raw q·k products into final logits (scale, softcap, bias, -inf where hidden).
//
// Emptiness comes from the tile summary (src/kernels/common/tile_summary.cu), built once per call,
// or in the decode ring from the bool mask's own bytes (MaskReads); causal and sequence-end limits
// come from index arithmetic and never from reading the mask.
#pragma once

#include <cute/tensor.hpp>
#include <cstdint>
#include <type_traits>

#include <cutlass/detail/helper_macros.hpp>

#include "kernels/common/fragment_layouts.h"
#include "kernels/params.h"

namespace flash_dmattn::kernels {

// Which query row and head each row of a CTA's tile is (see ForwardParams::pack_group).
struct RowMap {
  int group;       // query heads packed per CTA (1: no packing)
  int first_head;  // query head of packed row 0
  int rows;        // packed rows in all: Sq · group
  __device__ __forceinline__ int query(int packed_row) const { return packed_row / group; }
  __device__ __forceinline__ int head(int packed_row) const { return first_head + packed_row % group; }
  // Offset of a packed row in a tensor indexed by (query row, head) with these strides.
  __device__ __forceinline__ std::int64_t offset(int packed_row, std::int64_t row_stride,
                                                 std::int64_t head_stride) const {
    return query(packed_row) * row_stride + head(packed_row) * head_stride;
  }
  // Row r's address in a tile whose packed row 0 is row0, in the tensor at `base` (batch_offset
  // elements on: its batch's rows), for copy_rows_by_pointer_async.
  template <typename Element>
  __device__ __forceinline__ auto row_pointers(const void* base, std::int64_t batch_offset, int row0,
                                               std::int64_t row_stride, std::int64_t head_stride) const {
    const Element* const rows_of_batch = static_cast<const Element*>(base) + batch_offset;
    const RowMap map = *this;
    return [=](int r) { return rows_of_batch + map.offset(row0 + r, row_stride, head_stride); };
  }
};

struct TileClass {
  bool skip;         // no visible key: no loads, no MMA, no softmax
  bool elementwise;  // some key may be hidden: apply mask, causal and length limits per element
};

// One (batch, mask head)'s tile summary. A kernel tile is a union of whole summary blocks, so its
// class is the OR of their bytes.
struct SummaryView {
  const std::uint8_t* classes = nullptr;  // nullptr: no mask, every tile is visible
  std::int64_t row_stride = 0, col_stride = 0;

  __device__ __forceinline__ SummaryView(const TileSummary& s, int b, int query_head) {
    if (s.classes) {
      classes = s.classes + b * s.batch_stride + (query_head / s.head_divisor) * s.head_stride;
      row_stride = s.row_stride;
      col_stride = s.col_stride;
    }
  }

  // Query rows [m_begin, m_end) x keys [n_begin, n_last]; call only with a mask.
  __device__ __forceinline__ std::uint8_t bits(int m_begin, int m_end, int n_begin, int n_last) const {
    std::uint8_t b = 0;
    for (int r = m_begin / kSummaryBlock; r <= (m_end - 1) / kSummaryBlock; ++r)
      for (int k = n_begin / kSummaryBlock; k <= n_last / kSummaryBlock; ++k)
        b |= classes[r * row_stride + k * col_stride];
    return b;
  }

  __device__ __forceinline__ void refine(TileClass& c, int m_begin, int m_end, int n_begin, int n_last) const {
    if (!classes) return;
    const std::uint8_t b = bits(m_begin, m_end, n_begin, n_last);
    c.skip |= !(b & kTileHasVisible);
    c.elementwise |= (b & kTileHasHidden) != 0;
  }
};

// Where a kernel learns which keys the mask keeps. summary: the tile summary's classes and bits,
// built by a pass before the kernel (or by a preparation). bytes_or_summary: also the bool mask's
// own bytes, where the host left the summary out (the decode ring, KvPipeline::ring_split_keys:
// its tiles hold one 16-row slab of packed rows, for a decode a single mask row, whose bytes the
// walk reads instead of a summary that a launch in front of the kernel would build; plan_forward).
enum class MaskReads { summary, bytes_or_summary };

// One (batch, mask head)'s bool mask read as it lies, a byte per key (nonzero keeps it), for
// MaskReads::bytes_or_summary. Row and key strides are 0 where the mask broadcasts (the key
// stride is otherwise 1, validated).
struct MaskByteView {
  const std::uint8_t* rows = nullptr;  // row 0 of this (batch, mask head); nullptr: read the summary
  std::int64_t row_stride = 0;
  bool key_broadcast = false;

  __device__ __forceinline__ MaskByteView(const ForwardParams& p, int b, int query_head) {
    if (p.mask.ptr && !p.summary.classes) {
      rows = static_cast<const std::uint8_t*>(p.mask.ptr) + b * p.mask.batch_stride +
             (query_head / p.mask.head_divisor) * p.mask.head_stride;
      row_stride = p.mask.row_stride;
      key_broadcast = p.mask.col_stride == 0;
    }
  }

  // As SummaryView::refine, from the bytes of rows [m_begin, m_end) at keys [n_begin, n_last]: a
  // full tile of a row as 16-byte loads where it is aligned, else byte by byte.
  template <int kBlockN>
  __device__ __forceinline__ void refine(TileClass& c, int m_begin, int m_end, int n_begin, int n_last) const {
    std::uint32_t visible = 0, hidden = 0;
    const int last_row = row_stride == 0 ? m_begin : m_end - 1;
    for (int i = m_begin; i <= last_row; ++i) {
      const std::uint8_t* keys = rows + i * row_stride + (key_broadcast ? 0 : n_begin);
      const int count = key_broadcast ? 1 : n_last - n_begin + 1;
      if (count == kBlockN && reinterpret_cast<std::uintptr_t>(keys) % 16 == 0) {
        CUTE_UNROLL
        for (int k = 0; k < kBlockN; k += 16) {
          const uint4 w = *reinterpret_cast<const uint4*>(keys + k);
          visible |= w.x | w.y | w.z | w.w;
          hidden |= __vcmpeq4(w.x, 0u) | __vcmpeq4(w.y, 0u) | __vcmpeq4(w.z, 0u) | __vcmpeq4(w.w, 0u);
        }
      } else {
        for (int k = 0; k < count; ++k) {
          visible |= keys[k];
          hidden |= keys[k] == 0;
        }
      }
    }
    c.skip |= visible == 0;
    c.elementwise |= hidden != 0;
  }
};

// The backward's view of one key tile and one query head: classifies the query tiles against the
// fixed key tile, for ActiveTileWalk over query tiles. Tiles wholly above the causal diagonal
// are skipped by index arithmetic.
template <int kBlockM, int kBlockN>
struct QueryTileClassifier {
  SummaryView summary;
  int seqlen_q, seqlen_k, diagonal;
  bool causal;
  int n_begin, n_last;

  __device__ __forceinline__ QueryTileClassifier(const ForwardParams& p, int b, int query_head, int n_block)
      : summary(p.summary, b, query_head), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k),
        diagonal(p.seqlen_k - p.seqlen_q), causal(p.causal), n_begin(n_block * kBlockN),
        n_last(min(n_begin + kBlockN, p.seqlen_k) - 1) {}

  // The first query tile with a row that can see a key of this tile.
  __device__ __forceinline__ int first_m_block() const {
    return causal ? max(0, n_begin - diagonal) / kBlockM : 0;
  }

  __device__ __forceinline__ TileClass classify(int m_block) const {
    const int m_begin = m_block * kBlockM, m_end = min(m_begin + kBlockM, seqlen_q);
    if (causal && n_begin > m_end - 1 + diagonal) return {true, false};
    TileClass c{false, n_begin + kBlockN > seqlen_k || (causal && n_last > m_begin + diagonal)};
    summary.refine(c, m_begin, m_end, n_begin, n_last);
    return c;
  }
};

// The forward's view of one query tile: classifies its key tiles, for the tile walk. Needs no
// per-thread state, so a warp that only loads tiles (the sm90a producer) walks them too.
template <int kBlockM, int kBlockN, MaskReads kReads = MaskReads::summary>
struct KeyTileClassifier {
  // Plain copies of what the classifier reads: holding a reference to the __grid_constant__
  // parameters would take their address and move every access to generic memory.
  int seqlen_q, seqlen_k;
  bool causal;
  int m_begin, m_end;  // query rows [m_begin, m_end) that the tile's rows belong to
  int diagonal;        // causal: row i sees keys j <= i + diagonal
  SummaryView summary;  // this (batch, mask head)'s summary
  MaskByteView bytes;   // or its bytes (MaskReads::bytes_or_summary, where the host gave no summary)

  // rows: what each packed row of the tile is; row0: the tile's first packed row. With packing,
  // every row of the tile shares one mask head (the host packs only then), hence one summary.
  __device__ __forceinline__ KeyTileClassifier(const ForwardParams& p, int b, const RowMap& rows, int row0)
      : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k), causal(p.causal), m_begin(rows.query(row0)),
        m_end(rows.query(min(row0 + kBlockM, rows.rows) - 1) + 1), diagonal(p.seqlen_k - p.seqlen_q),
        summary(p.summary, b, rows.head(row0)), bytes(p, b, rows.head(row0)) {}

  // Under MaskReads::summary the bytes are never read, whatever the host passed.
  __device__ __forceinline__ bool reads_bytes() const {
    return kReads == MaskReads::bytes_or_summary && bytes.rows != nullptr;
  }

  // One past the last key tile any row of this CTA can see.
  __device__ __forceinline__ int n_block_end() const {
    int keys = seqlen_k;
    if (causal) keys = min(keys, max(0, m_end - 1 + diagonal + 1));
    return (keys + kBlockN - 1) / kBlockN;
  }

  __device__ __forceinline__ TileClass classify(int n_block) const {
    const int n_begin = n_block * kBlockN, n_last = min(n_begin + kBlockN, seqlen_k) - 1;
    TileClass c{false, n_begin + kBlockN > seqlen_k || (causal && n_last > m_begin + diagonal)};
    if (reads_bytes()) {
      bytes.refine<kBlockN>(c, m_begin, m_end, n_begin, n_last);
    } else {
      summary.refine(c, m_begin, m_end, n_begin, n_last);
    }
    return c;
  }
};

// Where a call's bias values come from: none; one row shared by every query row (a bias whose
// query dim is 1, the common (B, Hk, 1, Sk) case: each key's value is loaded once per tile), read
// from global memory or staged in shared memory by a producer (BiasStaging: 16-bit values next to
// each K tile, or floats at a key list's keys, the staged_row kind's element type then float); or
// a row per query row.
enum class BiasSource { none, shared_row, staged_row, per_row };

// Whether and how a main loop's producer stages a shared bias row in shared memory: not at all,
// its 16-bit values per key tile (the dense sm90a forward), or its values at a key list's keys as
// floats (the sm90a gather forward, any bias type).
enum class BiasStaging { none, sixteen_bit, as_float };

// How a call forms its logits, fixed for the whole call: softcap or not, the bias source and the
// bias's element type (float without bias). A main loop instantiated per kind
// (MaskBiasPolicy::with_logit_kind) holds that kind's code alone, and needs the registers of one
// path rather than the most any of them needs: with every kind inlined in one loop, the sm90a
// forward's consumers spilled 1.8 KB per thread at 128-key tiles (ptxas, D = 128).
template <bool kSoftcap_, BiasSource kBias_, typename BiasElement_ = float>
struct LogitKind {
  static constexpr bool kSoftcap = kSoftcap_;
  static constexpr BiasSource kBias = kBias_;
  using BiasElement = BiasElement_;
};
template <typename T>
inline constexpr bool is_logit_kind_v = false;
template <bool kSoftcap, BiasSource kBias, typename T>
inline constexpr bool is_logit_kind_v<LogitKind<kSoftcap, kBias, T>> = true;

// kRows, kCols: query rows and keys of the tile one thread holds in the accumulator layout.
template <int kBlockM, int kBlockN, int kRows, int kCols, MaskReads kReads = MaskReads::summary>
struct MaskBiasPolicy : KeyTileClassifier<kBlockM, kBlockN, kReads> {
  using Classifier = KeyTileClassifier<kBlockM, kBlockN, kReads>;
  using Classifier::bytes;
  using Classifier::reads_bytes;
  using Classifier::causal;
  using Classifier::diagonal;
  using Classifier::seqlen_k;
  using Classifier::seqlen_q;
  float scale, softcap;
  // Per row this thread holds: the query index, and where its mask bits and bias row start. Rows
  // past Sq point at the last existing row: always in bounds, and their logits are discarded.
  // Computed once per CTA and shared by every specialization of apply().
  int row_index[kRows];
  const std::uint32_t* mask_bits[kRows];
  const char* bias_row[kRows];
  int mask_row_words = 0;
  bool has_mask = false, has_bias = false;
  bool mask_key_broadcast = false, bias_key_broadcast = false;  // key dim of size 1
  bool bias_shared_row = false;                                 // query dim of size 1
  bool bias_pairs = false;  // a shared row whose neighbouring keys load as one aligned access
  ElementType bias_type = ElementType::float16;

  // rows, row0: as for the classifier; coords: the (row, col) in the tile of every accumulator
  // element this thread holds.
  template <typename TensorC>
  __device__ __forceinline__ MaskBiasPolicy(const ForwardParams& p, int b, const RowMap& rows, int row0,
                                            const TensorC& coords)
      : Classifier(p, b, rows, row0), scale(p.scale), softcap(p.softcap) {
    using namespace cute;
    has_mask = p.summary.bits != nullptr || reads_bytes();
    has_bias = p.bias.ptr != nullptr;
    // The mask's key dim is 1 (in the summary: one column).
    mask_key_broadcast = reads_bytes() ? bytes.key_broadcast : p.summary.col_stride == 0;
    mask_row_words = p.summary.bits_row_words;
    bias_key_broadcast = p.bias.col_stride == 0;
    bias_shared_row = p.bias.row_stride == 0;
    bias_type = p.bias.type;
    const int bias_bytes = p.bias.type == ElementType::float32 ? 4 : 2;
    Tensor tile_rows = make_tensor(coords.data(), accumulator_as_rows_cols(coords.layout()));
    static_assert(decltype(size<0>(tile_rows))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int packed = row0 + get<0>(tile_rows(r, 0));
      const int h = rows.head(packed);
      row_index[r] = rows.query(packed);
      const std::int64_t existing = min(row_index[r], p.seqlen_q - 1);
      mask_bits[r] = p.summary.bits + b * p.summary.bits_batch_stride +
                     (h / p.summary.head_divisor) * p.summary.bits_head_stride + existing * p.summary.bits_row_stride;
      bias_row[r] = static_cast<const char*>(p.bias.ptr) +
                    bias_bytes * (b * p.bias.batch_stride + (h / p.bias.head_divisor) * p.bias.head_stride +
                                  existing * p.bias.row_stride);
    }
    // With packing, a thread's rows may belong to different query heads: the bias row stays
    // shared only if they all read one bias head (a bias with 1 or Hk heads).
    bias_shared_row = bias_shared_row && (rows.group == 1 || p.bias.head_divisor >= rows.group);
    bias_pairs = has_bias && bias_shared_row && !bias_key_broadcast &&
                 reinterpret_cast<std::uintptr_t>(bias_row[0]) % (2 * bias_bytes) == 0;
  }

  static constexpr int kWindowWords = kBlockN / 32;

  // What a tile reads from global memory besides S, loaded by load_inputs() before S exists so
  // that a main loop can issue the loads ahead of the S = Q·Kᵀ MMA and hide their latency behind
  // it: the bias values at the thread's columns when every query row shares one bias row read
  // from global memory (raw bits, converted when used: a conversion right after the load would
  // wait for it), where a staged row is, and the mask bits of the thread's rows on tiles that
  // need per-element masking.
  struct TileInputs {
    std::uint32_t shared_bias[kCols];
    std::uint32_t keep[kRows][kWindowWords];
    const std::uint16_t* staged;
  };

  // Calls f(kind) with this call's LogitKind: a main loop that runs inside f and passes the kind
  // to load_inputs() and apply() is compiled once per kind. staged: whether this call's producer
  // stages the shared bias row as kStaging says; only a loop that can stage it compiles the
  // staged kinds, which the others would carry unused.
  template <BiasStaging kStaging = BiasStaging::none, typename F>
  __device__ __forceinline__ void with_logit_kind(F&& f, bool staged = false) const {
    if (softcap > 0.f) {
      with_bias_source<true, kStaging>(f, staged);
    } else {
      with_bias_source<false, kStaging>(f, staged);
    }
  }

  // staged: for a staged_row kind, the tile's kBlockN 16-bit values of the shared row in shared
  // memory (arbitrary past Sk: those keys are hidden).
  template <typename Kind, typename TensorC, typename = std::enable_if_t<is_logit_kind_v<Kind>>>
  __device__ __forceinline__ void load_inputs(Kind, TileInputs& in, const TensorC& coords_flat, int n_block,
                                              bool elementwise, const std::uint16_t* staged = nullptr) const {
    using namespace cute;
    using T = typename Kind::BiasElement;
    Tensor coords = make_tensor(coords_flat.data(), accumulator_as_rows_cols(coords_flat.layout()));
    static_assert(decltype(size<1>(coords))::value == kCols);
    static_assert(kCols % 2 == 0, "a thread's columns come in neighbouring pairs");
    const int n_begin = n_block * kBlockN;
    in.staged = staged;
    if constexpr (Kind::kBias == BiasSource::shared_row) {
      if (bias_pairs && !elementwise) {
        // A tile without per-element masking lies inside [0, Sk), and the thread's columns come in
        // neighbouring pairs starting at even keys: one aligned access per pair, no clamping. A
        // 16-bit pair stays packed in the even slot.
        const int lowest_col = get<1>(coords(0, 0));
        const int first = n_begin + lowest_col;
        CUTE_UNROLL
        for (int c = 0; c < kCols; c += 2) {
          const int j = first + (get<1>(coords(0, c)) - lowest_col);
          if constexpr (std::is_same_v<T, float>) {
            const uint2 pair = *reinterpret_cast<const uint2*>(reinterpret_cast<const std::uint32_t*>(bias_row[0]) + j);
            in.shared_bias[c] = pair.x;
            in.shared_bias[c + 1] = pair.y;
          } else {
            in.shared_bias[c] = *reinterpret_cast<const std::uint32_t*>(reinterpret_cast<const std::uint16_t*>(bias_row[0]) + j);
          }
        }
      } else {
        CUTE_UNROLL
        for (int c = 0; c < kCols; ++c) {
          const int j = bias_key_broadcast ? 0 : min(n_begin + get<1>(coords(0, c)), seqlen_k - 1);
          if constexpr (std::is_same_v<T, float>) {
            in.shared_bias[c] = reinterpret_cast<const std::uint32_t*>(bias_row[0])[j];
          } else {
            in.shared_bias[c] = reinterpret_cast<const std::uint16_t*>(bias_row[0])[j];
          }
        }
      }
    }
    if (elementwise) {
      if (reads_bytes()) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) load_window_from_bytes(r, coords, n_begin, in.keep[r]);
      } else {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) load_window(r, n_begin + get<1>(coords(0, 0)), in.keep[r]);
      }
    }
  }

  // s: raw q·k products of key tile n_block; coords: the (row, col) of each element in the tile;
  // in: the tile's load_inputs() for the same kind. Writes z = softcap(scale·qk) + bias, or -inf
  // where the key is hidden, then calls emit(r, c, z, dcap) for every element, indexed by (row,
  // col) of the accumulator_as_rows_cols view, with dcap = dz/d(scale·qk) / scale: 1 - tanh² of
  // the capped argument under softcap, 1 without. The backward turns z into P and dZ right there,
  // so no second fragment stays live. The elementwise flag is uniform, so it picks one
  // specialized loop per tile instead of being tested per element.
  template <typename Kind, typename TensorS, typename TensorC, typename Emit,
            typename = std::enable_if_t<is_logit_kind_v<Kind>>>
  __device__ __forceinline__ void apply(Kind, TensorS& s, const TensorC& coords, int n_block, bool elementwise,
                                        const TileInputs& in, Emit&& emit) const {
    if (elementwise) {
      apply_tile<Kind, true>(s, coords, n_block, in, emit);
    } else {
      apply_tile<Kind, false>(s, coords, n_block, in, emit);
    }
  }

  template <typename Kind, typename TensorS, typename TensorC, typename = std::enable_if_t<is_logit_kind_v<Kind>>>
  __device__ __forceinline__ void apply(Kind kind, TensorS& s, const TensorC& coords, int n_block, bool elementwise,
                                        const TileInputs& in) const {
    apply(kind, s, coords, n_block, elementwise, in, [](int, int, float, float) {});
  }

  // The same for main loops compiled once for every kind: the kind is picked per tile, and the
  // bias is never staged.
  template <typename TensorC>
  __device__ __forceinline__ void load_inputs(TileInputs& in, const TensorC& coords, int n_block,
                                              bool elementwise) const {
    with_logit_kind([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE { load_inputs(kind, in, coords, n_block, elementwise); });
  }

  template <typename TensorS, typename TensorC, typename Emit, typename = std::enable_if_t<!is_logit_kind_v<TensorS>>>
  __device__ __forceinline__ void apply(TensorS& s, const TensorC& coords, int n_block, bool elementwise,
                                        const TileInputs& in, Emit&& emit) const {
    with_logit_kind([&](auto kind) CUTLASS_LAMBDA_FUNC_INLINE { apply(kind, s, coords, n_block, elementwise, in, emit); });
  }

  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& s, const TensorC& coords, int n_block, bool elementwise,
                                        const TileInputs& in) const {
    apply(s, coords, n_block, elementwise, in, [](int, int, float, float) {});
  }

  // load_inputs() and apply() back to back, for main loops with nothing to hide the loads behind.
  template <typename TensorS, typename TensorC>
  __device__ __forceinline__ void apply(TensorS& s, const TensorC& coords, int n_block, bool elementwise) const {
    TileInputs in;
    load_inputs(in, coords, n_block, elementwise);
    apply(s, coords, n_block, elementwise, in);
  }

  template <typename TensorS, typename TensorC, typename Emit,
            typename = std::enable_if_t<std::is_invocable_v<Emit&, int, int, float, float>>>
  __device__ __forceinline__ void apply(TensorS& s, const TensorC& coords, int n_block, bool elementwise,
                                        Emit&& emit) const {
    TileInputs in;
    load_inputs(in, coords, n_block, elementwise);
    apply(s, coords, n_block, elementwise, in, emit);
  }

 private:
  template <bool kSoftcap, BiasStaging kStaging, typename F>
  __device__ __forceinline__ void with_bias_source(F& f, bool staged) const {
    if (!has_bias) {
      f(LogitKind<kSoftcap, BiasSource::none>{});
    } else if (kStaging != BiasStaging::none && bias_shared_row && staged) {
      if constexpr (kStaging == BiasStaging::sixteen_bit) {
        with_bias_element<kSoftcap, BiasSource::staged_row>(f);
      } else if constexpr (kStaging == BiasStaging::as_float) {
        f(LogitKind<kSoftcap, BiasSource::staged_row, float>{});
      }
    } else if (bias_shared_row) {
      with_bias_element<kSoftcap, BiasSource::shared_row>(f);
    } else {
      with_bias_element<kSoftcap, BiasSource::per_row>(f);
    }
  }

  template <bool kSoftcap, BiasSource kBias, typename F>
  __device__ __forceinline__ void with_bias_element(F& f) const {
    if (bias_type == ElementType::bfloat16) {
      f(LogitKind<kSoftcap, kBias, cute::bfloat16_t>{});
    } else if (bias_type == ElementType::float16) {
      f(LogitKind<kSoftcap, kBias, cute::half_t>{});
    } else if constexpr (kBias != BiasSource::staged_row) {  // staged values are 16-bit
      f(LogitKind<kSoftcap, kBias, float>{});
    }
  }

  // A bias value from raw bits: fp32 as is, 16-bit in the low half.
  template <typename T>
  __device__ __forceinline__ static float bias_from_bits(std::uint32_t bits) {
    if constexpr (std::is_same_v<T, float>) {
      return __uint_as_float(bits);
    } else {
      return static_cast<float>(T::bitcast(static_cast<std::uint16_t>(bits)));
    }
  }

  // Bits of row r's mask for the keys [first, first + 32 kWindowWords), where `first` is the
  // thread's lowest key in the tile: bit t of word k is key first + 32k + t (all set without a
  // mask). Words past the row read as hidden: keys past Sk, which the caller hides anyway.
  __device__ __forceinline__ void load_window(int r, int first, std::uint32_t (&window)[kWindowWords]) const {
    if (!has_mask || mask_key_broadcast) {
      const std::uint32_t all = !has_mask || (mask_bits[r][0] & 1u) ? ~0u : 0u;
      CUTE_UNROLL
      for (int k = 0; k < kWindowWords; ++k) window[k] = all;
      return;
    }
    const std::uint32_t* row = mask_bits[r];
    const int w0 = first / 32;
    std::uint32_t words[kWindowWords + 1];
    CUTE_UNROLL
    for (int k = 0; k <= kWindowWords; ++k) words[k] = w0 + k < mask_row_words ? row[w0 + k] : 0u;
    CUTE_UNROLL
    for (int k = 0; k < kWindowWords; ++k) window[k] = __funnelshift_r(words[k], words[k + 1], first % 32);
  }

  // The same window from the mask's bytes (MaskReads::bytes_or_summary), with only the bits of the
  // thread's own columns set: a byte load each, at positions known at compile time. coords: the
  // (rows, cols) view of the thread's elements.
  template <typename TensorC>
  __device__ __forceinline__ void load_window_from_bytes(int r, const TensorC& coords, int n_begin,
                                                         std::uint32_t (&window)[kWindowWords]) const {
    using namespace cute;
    const std::uint8_t* row = bytes.rows + min(row_index[r], seqlen_q - 1) * bytes.row_stride;
    const int lowest_col = get<1>(coords(0, 0));
    CUTE_UNROLL
    for (int k = 0; k < kWindowWords; ++k) window[k] = 0;
    CUTE_UNROLL
    for (int c = 0; c < kCols; ++c) {
      const int bit = get<1>(coords(0, c)) - lowest_col;  // a compile-time constant
      // Keys past Sk read the last key: in bounds, and hidden by apply_tile.
      const int j = bytes.key_broadcast ? 0 : min(n_begin + get<1>(coords(0, c)), seqlen_k - 1);
      window[bit / 32] |= static_cast<std::uint32_t>(row[j] != 0) << (bit % 32);
    }
  }

  // Works on the (rows, cols) view of the tile. Keys are contiguous or broadcast (validated: key
  // stride 1, or 0 for size 1), so a key's offset is j or 0, computed from the tile's first key:
  // loop-variant, where per-element offsets from strides would be hoisted into registers.
  template <typename Kind, bool kElementwise, typename TensorS, typename TensorC, typename Emit>
  __device__ __forceinline__ void apply_tile(TensorS& s_flat, const TensorC& coords_flat, int n_block,
                                             const TileInputs& in, Emit& emit) const {
    using namespace cute;
    using T = typename Kind::BiasElement;
    constexpr bool kSoftcap = Kind::kSoftcap;
    constexpr BiasSource kBias = Kind::kBias;
    Tensor s = make_tensor(s_flat.data(), accumulator_as_rows_cols(s_flat.layout()));
    Tensor coords = make_tensor(coords_flat.data(), accumulator_as_rows_cols(coords_flat.layout()));
    static_assert(decltype(size<1>(s))::value == kCols);
    const float logit_scale = kSoftcap ? scale / softcap : scale;
    const int n_begin = n_block * kBlockN;
    // A shared row's value at each of the thread's columns: from the raw bits load_inputs() kept,
    // or from the staged row, read here, after S, so that no register holds it across the MMA.
    float shared_bias[kCols];
    if constexpr (kBias == BiasSource::shared_row) {
      const bool pairs = !std::is_same_v<T, float> && !kElementwise && bias_pairs;
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        shared_bias[c] = bias_from_bits<T>(pairs ? in.shared_bias[c & ~1] >> (16 * (c % 2)) : in.shared_bias[c]);
      }
    } else if constexpr (kBias == BiasSource::staged_row) {
      CUTE_UNROLL
      for (int c = 0; c < kCols; c += 2) {
        const std::uint32_t pair = *reinterpret_cast<const std::uint32_t*>(in.staged + get<1>(coords(0, c)));
        shared_bias[c] = bias_from_bits<T>(pair);
        shared_bias[c + 1] = bias_from_bits<T>(pair >> 16);
      }
    }
    // Row r's value at key j (per_row). Keys past Sk (only in the last key tile, which is
    // elementwise) read the last key: in bounds, and masked below.
    auto row_bias = [&](int r, int j) CUTLASS_LAMBDA_FUNC_INLINE {
      const T* row = reinterpret_cast<const T*>(bias_row[r]);
      return static_cast<float>(row[bias_key_broadcast ? 0 : kElementwise ? min(j, seqlen_k - 1) : j]);
    };
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int i = row_index[r];
      // The thread's columns are its lowest one plus constants, and load_inputs() shifted the
      // row's bits to start there, so each element tests a fixed bit: no per-element shift
      // amounts, which the compiler would hoist out of the key loop into dozens of registers.
      const int lowest_col = get<1>(coords(0, 0));
      const std::uint32_t* keep = in.keep[r];
      CUTE_UNROLL
      for (int c = 0; c < kCols; ++c) {
        const int j = n_begin + get<1>(coords(0, c));
        float bias = 0.f;
        if constexpr (kBias == BiasSource::per_row) {
          bias = row_bias(r, j);
        } else if constexpr (kBias != BiasSource::none) {
          bias = shared_bias[c];
        }
        float z, dcap = 1.f;
        if constexpr (kSoftcap) {
          const float t = tanhf(s(r, c) * logit_scale);
          z = softcap * t;
          dcap = fmaf(-t, t, 1.f);
          if constexpr (kBias != BiasSource::none) z += bias;
        } else if constexpr (kBias != BiasSource::none) {
          z = fmaf(s(r, c), logit_scale, bias);
        } else {
          z = s(r, c) * logit_scale;
        }
        if constexpr (kElementwise) {
          const int bit = get<1>(coords(0, c)) - lowest_col;  // a compile-time constant
          const bool visible = i < seqlen_q && j < seqlen_k && (!causal || j <= i + diagonal) &&
                               ((keep[bit / 32] >> (bit % 32)) & 1u);
          if (!visible) z = -INFINITY;
        }
        s(r, c) = z;
        emit(r, c, z, dcap);
      }
    }
  }
};

// Walks the key tiles with visible keys in descending order. Each warp classifies 32 tiles at
// once, one per lane, and keeps the answers as ballots, so no tile needs a second summary read
// and the walk costs no shared memory or barrier. Every warp computes the same ballots, so the
// walk is uniform across the CTA.
struct ActiveTileWalk {
  int chunk_top = -1;  // lane l holds tile chunk_top - l
  std::uint32_t active = 0, elementwise = 0;

  // The first tile at or below n that has a visible key, or -1.
  template <typename Classifier>
  __device__ __forceinline__ int next_at_or_below(int n, const Classifier& classifier) {
    while (n >= 0) {
      if (n > chunk_top || n <= chunk_top - 32) load(n, classifier);
      const int lane = chunk_top - n;
      const std::uint32_t candidates = active & (~0u << lane);
      if (candidates) return chunk_top - (__ffs(candidates) - 1);
      n = chunk_top - 32;
    }
    return -1;
  }

  // Valid for the tile last returned by next_at_or_below, until the next call.
  __device__ __forceinline__ bool needs_elementwise(int n) const { return (elementwise >> (chunk_top - n)) & 1u; }

 private:
  template <typename Classifier>
  __device__ __forceinline__ void load(int top, const Classifier& classifier) {
    const int lane = threadIdx.x % 32, n = top - lane;
    const TileClass c = n >= 0 ? classifier.classify(n) : TileClass{true, false};
    chunk_top = top;
    active = __ballot_sync(0xffffffffu, !c.skip);
    elementwise = __ballot_sync(0xffffffffu, c.elementwise);
  }
};

// The forward's walk: the active key tiles of this CTA's split-KV share [begin, end), in
// descending order from the last one any row of the CTA can see.
template <typename Classifier>
struct SplitTileWalk {
  const Classifier& classifier;
  ActiveTileWalk walk;
  int begin, end;

  __device__ __forceinline__ SplitTileWalk(const Classifier& classifier_, int key_tiles, int num_splits, int split)
      : classifier(classifier_) {
    const int per_split = (key_tiles + num_splits - 1) / num_splits;
    begin = split * per_split;
    end = min(key_tiles, begin + per_split);
  }

  __device__ __forceinline__ int first() { return at_or_below(min(classifier.n_block_end(), end) - 1); }
  // The first active tile of the share at or below n, or -1.
  __device__ __forceinline__ int at_or_below(int n) {
    const int next = walk.next_at_or_below(n, classifier);
    return next >= begin ? next : -1;
  }
  // Valid for the tile last returned, until the next call.
  __device__ __forceinline__ bool needs_elementwise(int n) const { return walk.needs_elementwise(n); }
};

}  // namespace flash_dmattn::kernels
