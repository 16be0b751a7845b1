// Plain parameter structs the kernels take: pointers and int64 strides counted in elements, no
// framework types. Host code fills them from validated TensorViews (src/cuda/cuda_backend.cpp).
#pragma once

#include <cstdint>

namespace flash_dmattn::kernels {

enum class ElementType : int { float16, bfloat16, float32 };

// A mask or bias read through broadcast strides: a size-1 dimension has stride 0, and query head
// h reads head h / head_divisor. The key stride is 1, or 0 for a broadcast key dim.
struct BroadcastOperand {
  const void* ptr = nullptr;  // nullptr: absent
  ElementType type = ElementType::float16;
  std::int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;
  int head_divisor = 1;
};

// What the kernels know of the mask, built once per call by build_tile_summary() into the
// workspace from one read of the bool mask:
// - classes: per kSummaryBlock x kSummaryBlock block, a byte that ORs kTileHasVisible and
//   kTileHasHidden over the block's elements inside [0, Sq) x [0, Sk);
// - bits: the mask itself, one bit per element (bit j % 32 of word j / 32 of a row is key j; a
//   mask with key dim 1 has one word per row, bit 0). A partly visible tile reads a few words per
//   row instead of a byte per element.
struct TileSummary {
  const std::uint8_t* classes = nullptr;  // nullptr: no mask, every tile is visible
  std::int64_t batch_stride = 0, head_stride = 0, row_stride = 0, col_stride = 0;  // 0 where the mask broadcasts
  int head_divisor = 1;
  const std::uint32_t* bits = nullptr;
  std::int64_t bits_batch_stride = 0, bits_head_stride = 0, bits_row_stride = 0;  // in words; 0 where the mask broadcasts
  int bits_row_words = 0;  // words per mask row
};

// The gather path's key lists, built by build_key_lists() (key_lists.h) from the mask's bits: for
// every query tile of block_m rows of every (mask batch, mask head), the keys that some row of the
// tile may see, ascending, and how many there are. The forward then loads only those K and V rows,
// so its cost follows the kept keys rather than the key span.
//
// Beside each list, which of its keys each row of the tile keeps (mask bit and causal alignment),
// compacted like the list: chunk c of block_n keys holds, per row r, block_n / 32 words whose bit
// k says whether row r keeps key c·block_n + k of the list. A kernel reads a few words per row
// per chunk instead of one scattered mask word per element.
struct KeyLists {
  const int* keys = nullptr;    // nullptr: the tile path. List t starts at keys + t * capacity
  const int* counts = nullptr;  // keys in list t
  // Blocks of block_n keys (from key 0) holding a key of list t: what the tile path would visit
  // for the list's rows. Written by build_key_lists (masks), not by the indices builds.
  const int* blocks = nullptr;
  const std::uint32_t* row_bits = nullptr;  // list t's start at row_bits + t * row_bits_stride
  std::int64_t row_bits_stride = 0;         // words per list: chunks of room x block_m x block_n / 32
  std::int64_t batch_stride = 0, head_stride = 0;  // in lists; 0 where the mask broadcasts
  int head_divisor = 1;  // query heads per mask head
  int capacity = 0;      // room per list: Sk keys, rounded up to a multiple of 4
  int block_m = 0, block_n = 0;  // the tile the lists were built for: the kernel's (checked at launch)
};

// Head dims every kernel runs: multiples of 8 up to 256 (validation holds calls to this).
inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadDimMultiple = 8;

inline constexpr int kSummaryBlock = 64;

// How the sm80 forward's tile path streams K and V (fwd_mainloop.h), chosen by the host
// (plan_forward in cuda_backend.cpp). two_phase: K of the next active tile loads behind this one's
// softmax and P·V, and V behind its S (FlashAttention-2's order: one tile in flight), which the
// math of 16 rows per warp hides. ring: ring_stages() tiles of K and V in flight, and each tile's
// bias and mask bits loaded before its S, for KV caches and decodes, where a CTA's math is a few
// rows and every load's latency would show; only it reads pages. ring_split_keys: the ring for
// tiles whose packed rows fit one warp's 16-row slab (decodes), with the warps splitting each
// tile's keys instead of its rows: every warp computes the slab over its block_n / warps keys with
// its own online softmax, and the warps' partial outputs meet at the end. In the ring one warp
// holds every row and does all of a tile's math while the others only load.
enum class KvPipeline : int { two_phase, ring, ring_split_keys };
inline constexpr std::uint8_t kTileHasVisible = 1;
inline constexpr std::uint8_t kTileHasHidden = 2;

struct ForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;
  ElementType element = ElementType::float16;

  std::int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  std::int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  std::int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  std::int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  std::int64_t lse_batch_stride = 0, lse_head_stride = 0;  // rows are contiguous

  BroadcastOperand mask;  // bytes, nonzero keeps a key
  BroadcastOperand bias;
  TileSummary summary;
  KeyLists lists;  // the gather path's (sm80 kernels); keys == nullptr otherwise
  // Where the host left the choice between the tile and the gather path to the device (the
  // forward of a deferred preparation: choose_gather_path in key_lists.h), the flag it set,
  // nonzero for the gather path. Both paths' kernels are launched, and the CTAs of the one not
  // chosen return at once (runs_chosen_path in forward_grid.h). nullptr: the host chose.
  const int* gather_chosen = nullptr;

  int batch = 0, seqlen_q = 0, seqlen_k = 0, heads = 0, kv_heads = 0, head_dim = 0;
  // Packed sequences (attention.h PackedSequences): sequence b's queries start at q's row
  // cu_seqlens_q[b] and its keys at k's row cu_seqlens_k[b]; seqlen_q and seqlen_k are then the
  // maxima, and a kernel reads its CTA's sequence through for_sequence (sequences.h). nullptr:
  // a batch of equal lengths.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  // Packed sequences on TMA: the rows of q (and out) and of k and v (set by the host), and the
  // CTA's sequence's first row of each (set by for_sequence): TMA addresses the packed tensors
  // whole, as batch 0, from those rows.
  int total_q = 0, total_k = 0;
  int q_row0 = 0, k_row0 = 0;
  // A KV cache (attention.h KeyValueCache; the sm80 forward's tile path): batch b sees its first
  // seqlens_k[b] keys (for_sequence makes that its seqlen_k). With a block table, k and v are
  // pages of page_size rows, k_batch_stride (v_batch_stride) apart, and key j of batch b is row
  // j % page_size of page block_table[b * block_table_stride + j / page_size].
  const int* seqlens_k = nullptr;
  const int* block_table = nullptr;
  std::int64_t block_table_stride = 0;
  int page_size = 0;
  // The sm80 tile path's K/V streaming: the host picks a ring for decodes (a tile's packed rows
  // fit one 16-row slab) and KV caches, where its shared memory fits the device; other decodes
  // take the two-phase kernel, and KV caches need a ring.
  KvPipeline kv_pipeline = KvPipeline::two_phase;
  float scale = 1.f;
  float softcap = 0.f;  // 0: off
  bool causal = false;

  // GQA packing: with pack_group = g > 1, CTA y serves query heads y·g .. y·g + g - 1 of one KV
  // head, and its packed row r is query row r / g of query head y·g + r % g, so the g query heads
  // that read the same K and V share one pass over them: a decode's whole group (the sm80
  // forward, which takes g = H / Hk only), or two heads in the sm90a gather forward.
  // pack_group = 1: a CTA serves one query head.
  int pack_group = 1;

  // Split-KV: num_splits CTAs share a query tile's key tiles; each writes its normalized partial
  // output and LSE (-inf where it saw no visible key) to the workspace, and
  // combine_split_partials() merges them into out and lse.
  int num_splits = 1;
  float* partial_out = nullptr;  // (num_splits, B, H, Sq, head_dim)
  float* partial_lse = nullptr;  // (num_splits, B, H, Sq)
};

// How the backward produces dbias (chosen on the host from the bias's shape, see
// src/cuda/cuda_backend.cpp). dZ is summed in fp32 over every position that reads a bias element.
enum class BiasGradKind : int {
  none,      // no dbias requested, or one that is exactly 0 (a bias with key dim 1 cancels in the softmax)
  elements,  // bias with query and key dims: one dZ (or a sum over query heads) per element
  columns,   // bias with query dim 1: sums over a tile's rows, reduced in the CTA per key
};

// The dbias the backward writes: into `out` directly where a CTA is the only one to produce its
// elements and holds each element's whole sum, otherwise into the fp32 `accum` (zeroed by the
// host), which reduce_bias_grad() sums over slots and writes to `out`.
struct BiasGrad {
  BiasGradKind kind = BiasGradKind::none;
  bool direct = false;
  void* out = nullptr;  // bias's shape and dtype
  ElementType type = ElementType::float16;
  std::int64_t batch_stride = 0, head_stride = 0, row_stride = 0;  // 0 where the bias broadcasts; keys contiguous
  int head_divisor = 1;  // query heads per bias head
  // accum: (slots, bias batches, bias heads, bias rows, bias cols), contiguous; the batch and
  // head strides are 0 where the bias has one batch or one head.
  float* accum = nullptr;
  std::int64_t batches = 0, heads = 0, rows = 0, cols = 0;  // the bias's shape
  std::int64_t accum_slot_stride = 0, accum_batch_stride = 0, accum_head_stride = 0, accum_row_stride = 0;
  // Deterministic mode gives every CTA that shares accumulator elements its own slot, which it
  // updates with plain read-modify-writes in a fixed order: slot = batch_slot·kv_slots + kv slot.
  // The default mode uses slot 0 and atomics.
  int batch_slots = 1, kv_slots = 1;
};

struct BackwardParams {
  ForwardParams fwd;  // q, k, v, out, lse, mask, bias, summary, sizes and options as in the forward
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  std::int64_t dout_batch_stride = 0, dout_row_stride = 0, dout_head_stride = 0;
  std::int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  std::int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  std::int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  BiasGrad dbias;

  // Workspace. dsum: (B, H, Sq) rowsum(dO∘O), FlashAttention's D. dq_accum: (dq_slots, B, H, Sq,
  // head_dim) fp32, zeroed by the host; reduce_dq() sums the slots into dq.
  float* dsum = nullptr;
  float* dq_accum = nullptr;
  int dq_slots = 1;
  // The rows per (batch, head) of dsum and dq_accum: Sq, or for packed sequences the longest's
  // (fwd.seqlen_q is then the kernels' own sequence's: for_sequence in sequences.h).
  int accum_rows = 0;
  // The gather path's CTAs take two query heads of a KV head (the host decides: gather_backward_pairs
  // in cuda_backend.cpp). sm80/bwd_kernel.h runs it at the head dims gather_backward_pairs_heads_at
  // names; the sm90a gather backward (sm90/bwd_gather_kernel.h) runs only paired heads.
  bool pair_heads = false;
  // Deterministic: the grid has key_splits CTAs per (KV head, batch); CTA s visits one key tile
  // of every key_splits (see backward_kernel) and owns dq slot s, whose elements only it reduces
  // into. Otherwise one CTA per key tile (or head_splits, below), all reducing into slot 0.
  bool deterministic = false;
  int key_splits = 1;
  // Key-tile CTAs per (key tile, KV head, batch), each walking head_splits-th of the GQA group's
  // query heads (the host splits where the grid is under two waves: plan_backward): the walk of
  // key tile 0, the longest under causal masking, shrinks by as much.
  int head_splits = 1;
  // fp32 accumulators of dK and dV, (head_splits, B, Hk, Sk, head_dim), which reduce_dk_dv() sums
  // over the slots and writes out. The gather path (fwd.lists set: a CTA per query tile keeps dQ
  // in registers and writes it once) adds the dK and dV of the keys it gathers to its one slot by
  // reductions, into memory the host zeroed; head splits store their partial sums into their own
  // slots, each element once.
  float* dk_accum = nullptr;
  float* dv_accum = nullptr;
  // dQ comes from a kernel of its own (sm90a, bwd_dq_mainloop.h), a CTA per query tile that sums
  // it in registers over the key tiles: the key-tile kernel leaves dQ out, and there are no dq
  // slots (dq_slots = 0) and no reduction.
  bool separate_dq = false;
};

}  // namespace flash_dmattn::kernels
