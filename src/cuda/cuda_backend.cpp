// The CUDA backends behind the public API: fill the kernels' plain parameter structs from the
// validated views, build the mask's tile summary in the caller's workspace, launch on the
// caller's stream. Nothing here allocates; only a mask's preparation synchronizes, to choose its
// path (sparse_path.h).
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>

#include <algorithm>

#include "../backend.h"
#include "cuda/device_info.h"
#include "cuda/sparse_path.h"
#include "kernels/common/grad_passes.h"
#include "kernels/common/key_lists.h"
#include "kernels/common/split_combine.h"
#include "kernels/common/tile_summary.h"
#include "kernels/params.h"
#include "kernels/sm80/entry_points.h"
#include "kernels/sm80/tile_size.h"
#include "kernels/sm90/entry_points.h"
#include "kernels/sm90/tma_operand.h"
#include "kernels/sm90/tile_size.h"

namespace flash_dmattn {
namespace {

using kernels::BroadcastOperand;
using kernels::ElementType;
using Pass = BackendImpl::Pass;

// Decode: up to this many query rows, whose GQA groups the sm80 kernels pack into one query tile.
constexpr std::int64_t kDecodePackedRows = 16;

constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

ElementType element_type(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return ElementType::bfloat16;
    case DType::float32: return ElementType::float32;
    default: return ElementType::float16;
  }
}

// Reads a size-1 dimension through stride 0, so kernels never test for broadcasting.
BroadcastOperand broadcast_operand(const TensorView& t, std::int64_t heads) {
  BroadcastOperand op;
  op.ptr = t.data;
  op.type = element_type(t.dtype);
  op.batch_stride = t.shape[0] == 1 ? 0 : t.stride[0];
  op.head_stride = t.shape[1] == 1 ? 0 : t.stride[1];
  op.row_stride = t.shape[2] == 1 ? 0 : t.stride[2];
  op.col_stride = t.shape[3] == 1 ? 0 : t.stride[3];
  op.head_divisor = static_cast<int>(heads / t.shape[1]);
  return op;
}

kernels::MaskExtent mask_extent(const TensorView& mask, const Problem& p) {
  const std::int64_t heads = p.heads;
  kernels::MaskExtent m;
  m.ptr = static_cast<const std::uint8_t*>(mask.data);
  m.batches = mask.shape[0];
  m.heads = mask.shape[1];
  m.rows = mask.shape[2];
  m.packed = mask.dtype == DType::uint8;  // 8 keys a byte: the keys are Sk (validate.cpp)
  m.cols = m.packed ? p.seqlen_k : mask.shape[3];
  m.batch_stride = mask.stride[0];
  m.head_stride = mask.stride[1];
  m.row_stride = mask.stride[2];
  m.col_stride = mask.stride[3];
  m.head_divisor = static_cast<int>(heads / mask.shape[1]);
  // Packed sequences and KV caches align their causal diagonals each its own way: no block is
  // skipped for all.
  m.causal = p.causal && mask.shape[2] > 1 && !p.packed && !p.cached;
  m.diagonal = p.seqlen_k - p.seqlen_q;
  return m;
}

kernels::ForwardParams forward_params(const ForwardArgs& a, const Problem& p) {
  kernels::ForwardParams f;
  f.q = a.q.data;
  f.k = a.k.data;
  f.v = a.v.data;
  f.out = a.out.data;
  f.lse = static_cast<float*>(a.lse.data);
  f.element = element_type(p.dtype);
  f.q_batch_stride = a.q.stride[0];
  f.q_row_stride = a.q.stride[1];
  f.q_head_stride = a.q.stride[2];
  f.k_batch_stride = a.k.stride[0];
  f.k_row_stride = a.k.stride[1];
  f.k_head_stride = a.k.stride[2];
  f.v_batch_stride = a.v.stride[0];
  f.v_row_stride = a.v.stride[1];
  f.v_head_stride = a.v.stride[2];
  f.out_batch_stride = a.out.stride[0];
  f.out_row_stride = a.out.stride[1];
  f.out_head_stride = a.out.stride[2];
  f.lse_batch_stride = a.lse.stride[0];
  f.lse_head_stride = a.lse.stride[1];
  if (p.packed) {  // (total, heads, D) and lse (H, total_q): the kernels rebase per sequence (sequences.h)
    const TensorView* rows[] = {&a.q, &a.k, &a.v, &a.out};
    std::int64_t* strides[][3] = {{&f.q_batch_stride, &f.q_row_stride, &f.q_head_stride},
                                  {&f.k_batch_stride, &f.k_row_stride, &f.k_head_stride},
                                  {&f.v_batch_stride, &f.v_row_stride, &f.v_head_stride},
                                  {&f.out_batch_stride, &f.out_row_stride, &f.out_head_stride}};
    for (int t = 0; t < 4; ++t) {
      *strides[t][0] = 0;
      *strides[t][1] = rows[t]->stride[0];
      *strides[t][2] = rows[t]->stride[1];
    }
    f.lse_batch_stride = 0;
    f.lse_head_stride = a.lse.stride[0];
    f.cu_seqlens_q = static_cast<const int*>(a.sequences->cu_seqlens_q.data);
    f.cu_seqlens_k = static_cast<const int*>(a.sequences->cu_seqlens_k.data);
    f.total_q = static_cast<int>(a.q.shape[0]);
    f.total_k = static_cast<int>(a.k.shape[0]);
  }
  if (a.cache) {  // k and v: (B, K, Hk, D), or pages (num_pages, page_size, Hk, D) with their strides
    f.seqlens_k = static_cast<const int*>(a.cache->seqlens_k.data);
    if (a.cache->block_table) {
      f.block_table = static_cast<const int*>(a.cache->block_table->data);
      f.block_table_stride = a.cache->block_table->stride[0];
      f.page_size = static_cast<int>(p.page_size);
    }
  }
  if (a.mask) f.mask = broadcast_operand(*a.mask, p.heads);
  if (a.bias) f.bias = broadcast_operand(*a.bias, p.heads);
  f.batch = static_cast<int>(p.batch);
  f.seqlen_q = static_cast<int>(p.seqlen_q);
  f.seqlen_k = static_cast<int>(p.seqlen_k);
  f.heads = static_cast<int>(p.heads);
  f.kv_heads = static_cast<int>(p.kv_heads);
  f.head_dim = static_cast<int>(p.head_dim);
  f.scale = static_cast<float>(p.scale);
  f.softcap = static_cast<float>(p.softcap);
  f.causal = p.causal;
  return f;
}

// The kernel family of a pass. FLASH_DMATTN_KERNELS=sm80 or sm90a forces one (to test both on a
// Hopper GPU); unset or "auto" picks sm90a wherever it can run.
enum class KernelFamily { sm80, sm90a };
constexpr const char* kKernelsVariable = "FLASH_DMATTN_KERNELS";
// How a forward runs: the kernel family, GQA packing and split-KV when the grid would not fill
// the GPU (decode) or the gather path's key lists, and the workspace layout that follows:
// [tile summary][split partial O][split partial LSE][key lists].
struct ForwardPlan {
  KernelFamily family = KernelFamily::sm80;
  int pack_group = 1;
  int num_splits = 1;
  bool gather = false;  // the gather path: key lists (sm80 kernels unless gather_forward_family says sm90a)
  bool mask_bytes = false;  // the kernel reads the bool mask's bytes: no summary (MaskReads in mask_bias.h)
  kernels::KvPipeline kv_pipeline = kernels::KvPipeline::two_phase;  // the sm80 tile path's (ForwardParams')
  kernels::KeyListExtent lists;
  std::size_t summary_bytes = 0, partial_out_bytes = 0, partial_lse_bytes = 0, lists_bytes = 0;

  std::size_t lists_offset() const {
    return align_up(summary_bytes) + align_up(partial_out_bytes) + align_up(partial_lse_bytes);
  }
  std::size_t workspace_bytes() const { return lists_offset() + align_up(lists_bytes); }
};

// Why the sm90a kernels cannot run a pass of a call, or nothing when they can.
std::optional<std::string> sm90a_unavailable(const Problem& p, int arch, Pass pass) {
  if (arch != 90) return "needs an sm_90 GPU (H100, H200), the device is sm_" + std::to_string(arch);
  const ElementType element = element_type(p.dtype);
  const int head_dim = static_cast<int>(p.head_dim);
  if (!(pass == Pass::forward ? kernels::sm90::has_forward(element, head_dim)
                              : kernels::sm90::has_backward(element, head_dim))) {
    return "is not in this build for head dim " + std::to_string(p.head_dim) + " (" + dtype_name(p.dtype) +
           "; FLASH_DMATTN_SM90A, FLASH_DMATTN_HEAD_DIMS, FLASH_DMATTN_DTYPES)";
  }
  // The forward's 128-row tiles would compute mostly padding there; the sm80 warps without rows
  // skip theirs, and only there do GQA heads get packed (which this kernel does not do).
  if (pass == Pass::forward && p.seqlen_q <= kDecodePackedRows) return std::string("does not run Sq <= 16 (decode runs on sm80)");
  if (p.cached) return std::string("does not read KV caches (the sm80 forward does)");
  return std::nullopt;
}

// A value it cannot honour sets *error (check_settings reports it before any plan is made; the
// plans pass no error and get the family the fallback picks).
KernelFamily choose_family(const Problem& p, int arch, Pass pass, std::string* error = nullptr) {
  const char* value = std::getenv(kKernelsVariable);
  const std::string mode = value && *value ? value : "auto";
  if (mode == "sm80") return KernelFamily::sm80;
  if (mode != "auto" && mode != "sm90a") {
    if (error) {
      *error = std::string("flash_dmattn: ") + kKernelsVariable + " must be auto, sm80 or sm90a, got '" + mode + "'";
    }
    return KernelFamily::sm80;
  }
  const auto unavailable = sm90a_unavailable(p, arch, pass);
  if (!unavailable) return KernelFamily::sm90a;
  if (mode == "sm90a" && error) {
    *error = std::string("flash_dmattn: ") + kKernelsVariable + "=sm90a, but the sm90a " +
            (pass == Pass::forward ? "forward " : "backward ") + *unavailable;
  }
  return KernelFamily::sm80;
}

// The key lists of a call's mask, for a kernel whose tiles are block_m query rows by block_n keys.
kernels::KeyListExtent list_extent(const TensorView& mask, const Problem& p, int block_m, int block_n) {
  kernels::KeyListExtent e;
  e.batches = mask.shape[0];
  e.heads = mask.shape[1];
  e.seqlen_q = static_cast<int>(p.seqlen_q);
  e.seqlen_k = static_cast<int>(p.seqlen_k);
  e.block_m = block_m;
  e.block_n = block_n;
  e.head_divisor = static_cast<int>(p.heads / mask.shape[1]);
  e.causal = p.causal;
  e.diagonal = static_cast<int>(p.seqlen_k - p.seqlen_q);
  return e;
}

// What a call's key lists come from: its key indices where it has them (the CUDA backend takes
// them without a mask, cannot_run), else its mask.
const TensorView& list_source(const std::optional<TensorView>& mask, const std::optional<TensorView>& indices) {
  return indices ? *indices : *mask;
}

// The forward's lists: also the ones a prepared mask holds, and up to D = 128 the backward's.
kernels::KeyListExtent forward_list_extent(const TensorView& mask, const Problem& p) {
  const kernels::sm80::ForwardTile tile = kernels::sm80::forward_tile(static_cast<int>(p.head_dim));
  return list_extent(mask, p, tile.block_m, tile.block_n);
}

// The gather forward's kernel family: sm90a where the build has its gather forward and the family
// choice allows sm90a (FLASH_DMATTN_KERNELS=sm80 forces sm80).
KernelFamily gather_forward_family(const Problem& p, int arch) {
  if (!kernels::sm90::has_gather_forward(element_type(p.dtype), static_cast<int>(p.head_dim))) return KernelFamily::sm80;
  return choose_family(p, arch, Pass::forward);
}

// Whether query heads 2k and 2k + 1 can share a CTA of the gather path: an even GQA group whose
// heads pairwise read one list (list_heads: the mask's or the indices' heads) and one bias head
// (bias_heads, 0: no bias). The kernels' launches check the same of their operands
// (pairs_share_operands in kernels/common/gathered_keys.h).
bool heads_pair_operands(std::int64_t list_heads, std::int64_t bias_heads, const Problem& p) {
  auto pairs_share = [&](std::int64_t operand_heads) { return operand_heads == 1 || (p.heads / operand_heads) % 2 == 0; };
  return p.group_size() % 2 == 0 && pairs_share(list_heads) && (bias_heads == 0 || pairs_share(bias_heads));
}

// Whether the sm90a gather forward takes two query heads of a KV head per CTA (pack_group 2),
// where heads_pair_operands holds, as the gather backward pairs them (gather_backward_pairs).
// Not for decode, which packs whole groups (plan_forward), nor packed sequences, which have no
// gather path yet.
bool gather_forward_pairs(std::int64_t list_heads, std::int64_t bias_heads, const Problem& p) {
  return p.seqlen_q > kDecodePackedRows && !p.packed && heads_pair_operands(list_heads, bias_heads, p);
}

// The lists a gather forward of `family` reads: its kernel's tile, of half its rows where the
// sm90a kernel pairs heads (`pairs`).
kernels::KeyListExtent gather_forward_lists(KernelFamily family, const TensorView& source, const Problem& p,
                                            bool pairs = false) {
  if (family == KernelFamily::sm80) return forward_list_extent(source, p);
  const auto tile = kernels::sm90::forward_tile(static_cast<int>(p.head_dim), kernels::sm90::KvLoads::tma_producer);
  return list_extent(source, p, pairs ? tile.block_m / 2 : tile.block_m, tile.block_n);
}

// The lists of the sm90a gather forward's tile: those a prepared mask holds besides
// forward_list_extent's where that forward would run and its tile differs. Paired where the
// mask's heads let the heads pair; a call whose bias keeps them apart builds its own lists.
kernels::KeyListExtent sm90a_forward_list_extent(const TensorView& mask, const Problem& p) {
  return gather_forward_lists(KernelFamily::sm90a, mask, p, gather_forward_pairs(mask.shape[1], 0, p));
}

bool same_tile(const kernels::KeyListExtent& a, const kernels::KeyListExtent& b) {
  return a.block_m == b.block_m && a.block_n == b.block_n;
}

// The chunks of the sm90a gather forward's lists where they differ from forward_list_extent's
// in their width alone (at D128 64 x 128 for paired heads beside 64 x 64): a deferred
// preparation's build then writes its lists in both (kernels::WiderChunks), for the forward that
// chooses on the device. Else 0.
int wider_chunks(const TensorView& mask, const Problem& p) {
  if (gather_forward_family(p, device_info(p.device.index).arch) != KernelFamily::sm90a) return 0;
  const kernels::KeyListExtent held = forward_list_extent(mask, p), sm90a = sm90a_forward_list_extent(mask, p);
  return held.block_m == sm90a.block_m && kernels::wider_chunks_fit(held, sm90a.block_n) ? sm90a.block_n : 0;
}

// A prepared mask's memory: [tile summary][key lists, where it holds them][the sm90a gather
// forward's key lists where it holds them, else the lists' estimate where its choice is deferred]
// [where it is deferred, the row bits and block counts of its lists in wider chunks (wider_chunks)].
struct PreparedLayout {
  std::size_t summary_bytes = 0, lists_bytes = 0, sm90a_lists_bytes = 0, estimate_bytes = 0, wider_bytes = 0;
  int wider_block_n = 0;
  std::size_t lists_offset() const { return align_up(summary_bytes); }
  std::size_t sm90a_lists_offset() const { return lists_offset() + align_up(lists_bytes); }
  std::size_t estimate_offset() const { return sm90a_lists_offset(); }
  // Where a deferred preparation's sizes begin: the counts and block counts of `lists` (the
  // forward_list_extent's), then the estimate (prepared_list_sizes).
  std::size_t sizes_offset(const kernels::KeyListExtent& lists) const {
    return lists_offset() + kernels::key_list_counts_offset(lists);
  }
  std::size_t wider_offset() const { return sm90a_lists_offset() + align_up(sm90a_lists_bytes + estimate_bytes); }
  std::size_t bytes() const { return wider_offset() + align_up(wider_bytes); }
};

PreparedLayout prepared_layout(const TensorView& mask, const Problem& p, bool lists, bool sm90a_lists,
                               bool deferred = false) {
  PreparedLayout layout;
  layout.summary_bytes = kernels::tile_summary_bytes(mask_extent(mask, p));
  if (lists) layout.lists_bytes = kernels::key_lists_bytes(forward_list_extent(mask, p));
  if (lists && sm90a_lists) layout.sm90a_lists_bytes = kernels::key_lists_bytes(sm90a_forward_list_extent(mask, p));
  if (lists && deferred && !sm90a_lists) {
    layout.estimate_bytes = sizeof(kernels::ListEstimate);
    layout.wider_block_n = wider_chunks(mask, p);
    if (layout.wider_block_n) {
      layout.wider_bytes = kernels::wider_lists_bytes(forward_list_extent(mask, p), layout.wider_block_n);
    }
  }
  return layout;
}

PreparedLayout prepared_layout(const TensorView& mask, const Problem& p, const PreparedMask& prepared) {
  return prepared_layout(mask, p, prepared.lists(), prepared.sm90a_forward_lists, prepared.choice_pending);
}

// A call's lists in its prepared mask, if it holds lists of their tile.
std::optional<kernels::KeyLists> prepared_lists(const PreparedMask* prepared, const kernels::KeyListExtent& wanted,
                                                const TensorView& mask, const Problem& p) {
  if (!prepared || !prepared->lists()) return std::nullopt;
  char* memory = static_cast<char*>(prepared->memory.data);
  const PreparedLayout layout = prepared_layout(mask, p, *prepared);
  const kernels::KeyListExtent held = forward_list_extent(mask, p);
  if (same_tile(held, wanted)) return kernels::describe_key_lists(wanted, memory + layout.lists_offset());
  if (prepared->sm90a_forward_lists && same_tile(sm90a_forward_list_extent(mask, p), wanted)) {
    return kernels::describe_key_lists(wanted, memory + layout.sm90a_lists_offset());
  }
  if (layout.wider_bytes && wanted.block_m == held.block_m && wanted.block_n == layout.wider_block_n) {
    return kernels::describe_wider_key_lists(held, memory + layout.lists_offset(), wanted.block_n,
                                             memory + layout.wider_offset());
  }
  return std::nullopt;
}

bool lists_prepared(const PreparedMask* prepared, const kernels::KeyListExtent& wanted, const TensorView& mask,
                    const Problem& p) {
  return prepared_lists(prepared, wanted, mask, p).has_value();
}

// Packed sequences and KV caches have no gather path yet: their lists would follow each
// sequence's lengths.
bool per_sequence_lengths(const Problem& p) { return p.packed || p.cached; }

// Whether a preparation makes room for key lists: where the gather path is possible and not
// forbidden (FLASH_DMATTN_SPARSE_PATH=tile).
bool lists_room(const ForwardArgs& a, const Problem& p) {
  return gather_possible(a.mask, p.seqlen_q) && sparse_path() != SparsePath::tile && !p.empty() &&
         !per_sequence_lengths(p);
}

// The mask's summary (the kernels' TileSummary): from the prepared mask, or built on `stream`
// into `workspace`.
cudaError_t mask_summary(const TensorView& mask, const Problem& p, const PreparedMask* prepared, void* workspace,
                         cudaStream_t stream, kernels::TileSummary* summary) {
  if (prepared) {
    *summary = kernels::describe_tile_summary(mask_extent(mask, p), prepared->memory.data);
    return cudaSuccess;
  }
  return kernels::build_tile_summary(mask_extent(mask, p), workspace, stream, summary);
}

// The call's key lists: from the prepared mask (lists_prepared), or built into `workspace` (a
// build that `gate` may let skip them).
cudaError_t key_lists(const kernels::KeyListExtent& extent, const TensorView& mask, const Problem& p,
                      const PreparedMask* prepared, const kernels::TileSummary& summary, void* workspace,
                      cudaStream_t stream, kernels::KeyLists* lists, const kernels::ListGate& gate = {}) {
  if (const auto held = prepared_lists(prepared, extent, mask, p)) {
    *lists = *held;
    return cudaSuccess;
  }
  return kernels::build_key_lists(extent, summary, workspace, stream, lists, gate);
}

// Whether a kernel needing `needed` bytes of shared memory per block (0: not built) fits p's device.
bool smem_fits(int needed, const Problem& p) {
  return needed > 0 && needed <= device_info(p.device.index).smem_per_block_optin;
}

// Whether the sm80 forward's ring of K/V stages runs at p's head dim on p's device (tile_size.h).
bool ring_fits(const Problem& p) {
  const int bucket = kernels::sm80::head_dim_bucket(static_cast<int>(p.head_dim));
  return kernels::sm80::has_ring(bucket) && smem_fits(kernels::sm80::ring_smem_bytes(bucket), p);
}

// Whether the gather forward's shared memory (a second K/V buffer beside the tiles') fits the
// device: not at the largest head dims on GPUs with less than Hopper's and A100's.
bool gather_forward_fits(const Problem& p) {
  return smem_fits(kernels::sm80::gather_forward_smem_bytes(element_type(p.dtype), static_cast<int>(p.head_dim)), p);
}

// Whether a preparation also makes room for the sm90a gather forward's lists: where that forward
// would run (gather_forward_family, on this device and FLASH_DMATTN_KERNELS) on lists of its own tile.
bool sm90a_lists_room(const ForwardArgs& a, const Problem& p) {
  return lists_room(a, p) && gather_forward_fits(p) &&
         gather_forward_family(p, device_info(p.device.index).arch) == KernelFamily::sm90a &&
         !same_tile(forward_list_extent(*a.mask, p), sm90a_forward_list_extent(*a.mask, p));
}

// Whether a preparation of MaskPreparation::deferred_choice builds key lists: they serve the
// forward it was made for (device_choice) and its backward, so only where the gather backward
// could run and the choice is not forced either way.
bool deferred_lists_room(const ForwardArgs& a, const Problem& p) {
  return lists_room(a, p) && sparse_path() == SparsePath::automatic && p.seqlen_k > 0 &&
         smem_fits(kernels::sm80::gather_backward_smem_bytes(element_type(p.dtype), static_cast<int>(p.head_dim)), p);
}

// Why a call with key indices cannot run, if it cannot: they are read on the gather path only
// (sm80 kernels), and without a mask beside them.
std::optional<std::string> indices_cannot_run(const Problem& p, BackendImpl::Pass pass) {
  const std::string refusal = "reads key lists (indices) on its gather path only, ";
  const std::string instead = ": pass the bool mask they stand for (the torch front builds it)";
  if (p.has_mask) return refusal + "and not beside a mask yet" + instead;
  // One list for every query row would be built once per query tile, with Sk keys of room each
  // (gather_possible refuses a one-row mask for the same reason).
  if (p.indices_rows == 1 && p.seqlen_q > 1) return refusal + "not one list shared by every query row" + instead;
  // The bits pass runs a CTA per (batch, head, query row) and counts entries in 32 bits.
  if (p.batch * p.heads * p.seqlen_q > INT_MAX || p.indices_entries > INT_MAX) {
    return refusal + "with at most 2^31 - 1 rows over batch x heads x seqlen_q and entries per list, got " +
           std::to_string(p.batch * p.heads * p.seqlen_q) + " rows and " + std::to_string(p.indices_entries) +
           " entries" + instead;
  }
  if (sparse_path() == SparsePath::tile) return refusal + "which " + kSparsePathVariable + "=tile forbids" + instead;
  if (pass == BackendImpl::Pass::forward && !gather_forward_fits(p)) {
    return refusal + "whose forward does not fit this device's shared memory at head dim " +
           std::to_string(p.head_dim) + instead;
  }
  if (pass == BackendImpl::Pass::backward) {
    if (p.deterministic) return refusal + "whose backward is not deterministic yet" + instead;
    if (!smem_fits(kernels::sm80::gather_backward_smem_bytes(element_type(p.dtype), static_cast<int>(p.head_dim)), p)) {
      return refusal + "whose backward does not run head dim " + std::to_string(p.head_dim) +
             " on this device" + instead;
    }
  }
  return std::nullopt;
}

constexpr std::int64_t kUnsplitKeyTiles = 2;
constexpr std::int64_t kSplitKeysMinKeys = 128;

// The path a forward plan takes: the one the prepared mask or FLASH_DMATTN_SPARSE_PATH chose, or
// the gather path where it is possible (a forward choosing its path on the device: device_choice).
enum class ForwardPath { as_chosen, gather };

ForwardPlan plan_forward(const ForwardArgs& a, const Problem& p, int arch, ForwardPath path = ForwardPath::as_chosen) {
  ForwardPlan plan;
  if (a.mask && !a.prepared_mask) plan.summary_bytes = kernels::tile_summary_bytes(mask_extent(*a.mask, p));
  // Packing puts the query heads of one KV head into one CTA's rows, so they share each K/V load.
  // A tile then reads one mask summary (on the gather path one key list), so a mask with a head
  // per query head is not packed. Packed rows of up to 16 query rows lie in one query tile of
  // the gather path's lists.
  const std::int64_t group = p.group_size();
  const TensorView* chooser = a.indices ? &*a.indices : a.mask ? &*a.mask : nullptr;
  const bool mask_per_query_head = chooser && chooser->shape[1] == p.heads && group > 1;
  if (group > 1 && p.seqlen_q <= kDecodePackedRows && !mask_per_query_head && !p.packed) plan.pack_group = static_cast<int>(group);
  // The gather path over the lists of `source` (the indices or the mask): its kernel family, and
  // on the sm90a kernel two query heads per CTA where the source's and the bias's heads pair (one
  // rule for both sources, so that indices and the mask they stand for run one kernel).
  auto plan_gather = [&](const TensorView& source) {
    plan.gather = true;
    plan.family = gather_forward_family(p, arch);
    const bool pairs = plan.family == KernelFamily::sm90a &&
                       gather_forward_pairs(source.shape[1], a.bias ? a.bias->shape[1] : 0, p);
    if (pairs) plan.pack_group = 2;
    plan.lists = gather_forward_lists(plan.family, source, p, pairs);
  };
  if (a.indices) {
    // Key indices go the gather path only (cannot_run refuses what it cannot take): their lists,
    // straight from the entries where index_bits.cu's lists_direct allows (one query row, or
    // short lists), else through per-row bits.
    plan_gather(*a.indices);
    plan.summary_bytes = kernels::index_bits_bytes(plan.lists, index_rows(*a.indices).entries);
    plan.lists_bytes = kernels::key_lists_bytes(plan.lists);
  } else if (!per_sequence_lengths(p) && gather_forward_fits(p) &&
             (path == ForwardPath::gather ? gather_possible(a.mask, p.seqlen_q)
                                          : gather_applies(a.mask, p.seqlen_q, a.prepared_mask, Pass::forward))) {
    // The splits of the gather path share out the chunks of each list.
    plan_gather(*a.mask);
    if (!lists_prepared(a.prepared_mask, plan.lists, *a.mask, p)) plan.lists_bytes = kernels::key_lists_bytes(plan.lists);
  } else {
    plan.family = choose_family(p, arch, Pass::forward);
    // Decodes (packed rows in one 16-row slab) and KV caches (cannot_run: only where it fits).
    if (plan.family == KernelFamily::sm80 && (p.seqlen_q * plan.pack_group <= kDecodePackedRows || p.cached) &&
        ring_fits(p)) {
      plan.kv_pipeline = kernels::KvPipeline::ring;
    }
  }

  // Split the keys when the grid has fewer CTAs than the GPU runs at once: aim at one wave.
  // Measured on an H200 (decode B1 H32 Hk8 Sk131072 D128, 8 packed CTAs before splitting): one
  // wave 0.174 ms, two 0.178, three 0.182, four 0.185; more splits cost more partial rows.
  // The sm90a family's widest tiles (its TMA kernel's): its other kernel's key tiles are no wider,
  // so it never has fewer key tiles than splits. A list has at most as many chunks as the span
  // has key tiles; a split whose share is empty writes an LSE of -inf, which the combine skips.
  const auto tile = plan.family == KernelFamily::sm90a
                        ? kernels::sm90::forward_tile(static_cast<int>(p.head_dim), kernels::sm90::KvLoads::tma_producer)
                        : kernels::sm80::forward_tile(static_cast<int>(p.head_dim));
  const std::int64_t rows = p.seqlen_q * plan.pack_group;
  const std::int64_t ctas = (rows + tile.block_m - 1) / tile.block_m * (p.heads / plan.pack_group) * p.batch;
  const std::int64_t key_tiles = (p.seqlen_k + tile.block_n - 1) / tile.block_n;
  const std::int64_t slots = std::int64_t(device_info(p.device.index).multiprocessors) * tile.ctas_per_sm;
  // A span of one or two key tiles runs unsplit: its combine (a second launch, and a kernel that
  // waits for the first) costs more than walking the second tile in the same CTA. Measured on an
  // H200 (B1 H4/2 Sq1 Sk256, mask + bias): at D64 (two 128-key tiles) 0.024-0.026 ms unsplit
  // against 0.029 split (bench CLI); at D128 (four 64-key tiles) the unsplit kernel took 13.7 us
  // against 7.0 + 2.3 for the split one and its combine, so four tiles still split.
  // (Packed sequences run unsplit: their partial rows would need each sequence's offsets.)
  if (ctas > 0 && ctas < slots && key_tiles > kUnsplitKeyTiles && !p.packed) {
    plan.num_splits = static_cast<int>(
        std::min<std::int64_t>({(slots + ctas - 1) / ctas, key_tiles, kernels::kMaxSplits}));
  }
  // A ring CTA whose packed rows fit one slab and that walks keys enough has its warps split
  // them: one warp's math per tile was what the CTA waited on, and the split costs a merge at the
  // end. Measured on an H200 (kernel spans by the torch profiler, B1 H32/8 Sq1, mask + bias;
  // serving-suite gpu ms): 64 keys a CTA (D128 Sk 1024) 11.3 -> 11.7 us; 128 keys a CTA (D128 Sk
  // 4096, D64 Sk 1024) 0.021 -> 0.021 ms and 11.9 -> 11.6 us; D128 Sk 65536 83.8 -> 80.7 us; D64
  // Sk 65536 69.2 -> 50.0 us, D64 B64 Sk 4096 196.7 -> 138.7 us; B64 of 4k to 32k keys (D128,
  // unsplit) 1.445 -> 1.313 ms.
  if (plan.kv_pipeline == kernels::KvPipeline::ring && rows <= kDecodePackedRows &&
      kernels::sm80::has_split_keys_ring(static_cast<int>(p.head_dim)) &&
      (key_tiles + plan.num_splits - 1) / plan.num_splits * tile.block_n >= kSplitKeysMinKeys) {
    plan.kv_pipeline = kernels::KvPipeline::ring_split_keys;
    // Its tiles hold one slab of packed rows, for a decode one mask row, whose bytes it reads
    // itself (MaskReads::bytes_or_summary): no summary pass to launch and wait for. A prepared
    // mask's summary costs nothing more to read; a bit-packed mask has no bytes a key.
    if (a.mask && !a.prepared_mask && a.mask->dtype == DType::boolean) {
      plan.mask_bytes = true;
      plan.summary_bytes = 0;
    }
  }
  if (plan.num_splits > 1) {
    const std::size_t row_count = static_cast<std::size_t>(plan.num_splits) * p.batch * p.heads * p.seqlen_q;
    plan.partial_out_bytes = row_count * p.head_dim * sizeof(float);
    plan.partial_lse_bytes = row_count * sizeof(float);
  }
  return plan;
}

// Whether an sm90a backward gets dQ from the dQ kernel, which sums it in registers over the key
// tiles and writes it once, rather than from reductions of every (query tile, key tile) pair in
// the key-tile kernel: at the head dims where that measures faster (sm90::has_dq_kernel) and where
// TMA can address q, k, v and dout (the dQ kernel loads them so).
bool dq_in_own_kernel(const BackwardArgs& a, const Problem& p) {
  using namespace kernels::sm90;
  if (!has_dq_kernel(static_cast<int>(p.head_dim))) return false;
  const int head_dim = static_cast<int>(p.head_dim);
  for (const TensorView* t : {&a.q, &a.k, &a.v, &a.dout}) {
    // Packed sequences, (total, heads, D): TMA addresses them as one batch (tma_batches).
    const int row = p.packed ? 0 : 1;
    const TmaOperand operand =
        tma_operand(t->data, static_cast<int>(t->shape[row]), static_cast<int>(t->shape[row + 1]), t->stride[row],
                    t->stride[row + 1], p.packed ? 0 : t->stride[0], head_dim, p.packed ? 1 : static_cast<int>(p.batch));
    if (!tma_addressable(operand)) return false;
  }
  return true;
}

// How a backward runs: the kernel family, the grid (one CTA per key tile, or head_splits of them;
// in deterministic mode key_splits CTAs striding over the key tiles; on the gather path one per
// query tile), how dbias is produced, and the workspace layout that follows: [tile summary][Δ][dq
// accumulators][dbias accumulators][dK and dV accumulators][key lists].
struct BackwardPlan {
  KernelFamily family = KernelFamily::sm80;
  int key_tiles = 0;
  int key_splits = 1;  // deterministic: CTAs per (KV head, batch), each owning a dq slot
  int head_splits = 1;  // CTAs per (key tile, KV head, batch), sharing out the query heads
  int dq_slots = 1;
  bool separate_dq = false;  // dQ by the sm90a dQ kernel: no dq slots (BackwardParams::separate_dq)
  bool gather = false;       // the gather path: key lists, dQ per query tile, dK and dV by reductions
  bool pair_heads = false;   // the gather path's CTAs take two query heads (gather_backward_pairs)
  kernels::KeyListExtent lists;
  kernels::BiasGrad dbias;  // everything but the pointers
  std::size_t summary_bytes = 0, dsum_bytes = 0, dq_accum_bytes = 0, dbias_accum_bytes = 0;
  std::size_t dkv_accum_bytes = 0, lists_bytes = 0;  // dkv: dK's and dV's accumulators, each this size

  // The sm90a gather backward computes Δ in its prologue (RowDeltas): no compute_dsum, no Δ
  // workspace.
  bool kernel_computes_dsum() const { return gather && family == KernelFamily::sm90a; }

  // The accumulators (dQ, dBias, dK, dV) lie back to back from here to lists_offset().
  std::size_t accumulators_offset() const { return align_up(summary_bytes) + align_up(dsum_bytes); }
  std::size_t dkv_offset() const {
    return accumulators_offset() + align_up(dq_accum_bytes) + align_up(dbias_accum_bytes);
  }
  std::size_t lists_offset() const { return dkv_offset() + 2 * align_up(dkv_accum_bytes); }
  std::size_t workspace_bytes() const { return lists_offset() + align_up(lists_bytes); }
};

// Whether the gather backward takes two query heads of a KV head per CTA (BackwardParams::
// pair_heads): at the head dims that gain from it, where heads_pair_operands holds and the device
// has the shared memory (not an A100's 163 KB at D128).
bool gather_backward_pairs(std::int64_t list_heads, std::int64_t bias_heads, const Problem& p) {
  return kernels::sm80::gather_backward_pairs_heads_at(static_cast<int>(p.head_dim)) &&
         heads_pair_operands(list_heads, bias_heads, p) &&
         smem_fits(kernels::sm80::gather_backward_smem_bytes(element_type(p.dtype), static_cast<int>(p.head_dim), 2), p);
}

// Key-tile CTAs per (key tile, KV head, batch) (BackwardParams::head_splits). Under causal
// masking key tile 0 walks every query tile of its group's heads, twice the average walk, and
// where the grid is under two waves the kernel lasts as long as that walk: the seed's B1 H2/Hk1
// S16384 D32 has 128 CTAs, and key tile 0 walks 2 x 256 query tiles. Sharing the group's query
// heads out among CTAs shortens every walk alike, so the smallest divisor of the group that
// makes two waves, or the whole group. Not in deterministic mode (its own grid), on the gather
// path (its grid is of query tiles) or where sequences have lengths of their own (a key tile
// past a shorter sequence's keys writes nothing, and the slots' sums would read unwritten rows).
int backward_head_splits(const Problem& p, const BackwardPlan& plan, int ctas_per_sm) {
  const int group = static_cast<int>(p.group_size());
  if (plan.gather || p.deterministic || per_sequence_lengths(p) || p.empty() || group < 2) return 1;
  const std::int64_t ctas = std::int64_t(plan.key_tiles) * p.kv_heads * p.batch;
  const std::int64_t two_waves = 2 * std::int64_t(device_info(p.device.index).multiprocessors) * ctas_per_sm;
  if (ctas >= two_waves) return 1;
  int splits = group;
  for (int d = group - 1; d > 1; --d) {
    if (group % d == 0 && ctas * d >= two_waves) splits = d;
  }
  return splits;
}

// Whether a backward takes the gather path: where gather_applies holds for its pass (under auto,
// the prepared mask's choice for the kernel it would run: heads_pair, gather_backward_pairs), but
// not in deterministic mode (its dK, dV and dBias reductions arrive in any order), past
// head dim 128 (sm80/tile_size.h), on empty problems, or where its shared memory exceeds the device's.
bool gather_backward(const BackwardArgs& a, const Problem& p, bool heads_pair) {
  if (!a.indices && !gather_applies(a.mask, p.seqlen_q, a.prepared_mask, Pass::backward, heads_pair)) return false;
  if (p.deterministic || p.empty() || p.seqlen_k == 0 || per_sequence_lengths(p)) return false;
  return smem_fits(kernels::sm80::gather_backward_smem_bytes(element_type(p.dtype), static_cast<int>(p.head_dim)), p);
}

// Whether paired heads' gather backward runs on the sm90a kernel (wgmma, on the sm80 backward's
// lists): where the build has it (with the sm90a kernels, at D128) and the family choice allows
// sm90a (FLASH_DMATTN_KERNELS=sm80 forces the sm80 one).
bool sm90a_gather_backward(const Problem& p, int arch) {
  return kernels::sm90::has_gather_backward(element_type(p.dtype), static_cast<int>(p.head_dim)) &&
         choose_family(p, arch, Pass::backward) == KernelFamily::sm90a;
}

// The share up to which a forward of p takes the gather path, for the kernel family its gather
// forward would run (gather_forward_family): the one rule of a preparation's choice
// (choose_paths), its build's gate (list_gate) and the device's choice (forward_choosing_path).
double forward_gather_share(const Problem& p) {
  const bool sm90a = gather_forward_family(p, device_info(p.device.index).arch) == KernelFamily::sm90a;
  return gather_forward_share(p.seqlen_q, p.head_dim, sm90a);
}

// A preparation's paths from the work its lists describe: the forward's, and both backward
// choices, since the calls' bias decides whether their heads pair (gather_backward).
void choose_paths(const ForwardArgs& a, const Problem& p, const ListedWork& work, PreparedMask* prepared) {
  const int arch = device_info(p.device.index).arch;
  prepared->gather_forward = gather_pays(work, forward_gather_share(p)) && gather_forward_fits(p);
  const bool pairs = gather_backward_pairs(a.mask->shape[1], a.bias ? a.bias->shape[1] : 0, p);
  const GatherBackwardKernel paired = !pairs                            ? GatherBackwardKernel::sm80
                                      : sm90a_gather_backward(p, arch) ? GatherBackwardKernel::sm90a_paired
                                                                       : GatherBackwardKernel::sm80_paired;
  prepared->gather_backward = gather_pays(work, gather_backward_share(p.head_dim, paired));
  prepared->gather_backward_unpaired = gather_pays(work, gather_backward_share(p.head_dim, GatherBackwardKernel::sm80));
}

bool deferred_preparation(MaskPreparation what) {
  return what == MaskPreparation::deferred_choice || what == MaskPreparation::deferred_choice_with_lists;
}

// The gate of a deferred preparation's list build: the largest share any of choose_paths's choices
// may take the gather path at, so that the gate skips only lists that no choice would read, but
// for masks of whole blocks estimated above kDeferredListsShare. The choices from such a
// preparation (choose_mask_paths, choose_gather_path) apply the same gate first.
kernels::ListGate list_gate(const Problem& p) {
  double share = forward_gather_share(p);
  for (GatherBackwardKernel kernel : {GatherBackwardKernel::sm80, GatherBackwardKernel::sm80_paired,
                                      GatherBackwardKernel::sm90a_paired}) {
    share = std::max(share, gather_backward_share(p.head_dim, kernel));
  }
  kernels::ListGate gate;
  gate.share_permille = static_cast<int>(std::ceil(std::min(share, kDeferredListsShare) * 1000));
  gate.sparse_permille = static_cast<int>(std::ceil(kSparseTilesShare * 1000));
  return gate;
}

// A forward whose prepared mask's choice is pending (MaskPreparation::deferred_choice: the
// preparation built the lists without waiting for their sizes) chooses its path on the device:
// choose_gather_path reads the sizes and sets a flag in the workspace, then the gather path's
// lists (where its kernel's tile is not the prepared lists') and kernel and the tile path's
// kernel are all launched, and each returns at once where the flag names the other path
// (ForwardParams::gather_chosen). So an unprepared scattered mask's forward takes the gather path
// where prepare_mask would, without waiting for the GPU; the path not taken costs its launches.
// Only where both paths run unsplit: grids of at least a wave of CTAs on either path (a training
// call of few heads and short sequences may split, and keeps the tile path). The sm90a gather
// forward reads the preparation's lists in its wider chunks (wider_chunks) where its heads pair;
// else its plan's workspace holds lists of its own tile, reserved whichever path the device
// takes (about 96 MiB for B2 Hk4 S8192 at D128, growing with batch x mask heads x Sq x Sk).
struct DeviceChoice {
  ForwardPlan tile, gather;
  // [either plan's workspace (the gather path's lists)][the flag]
  std::size_t flag_offset() const { return align_up(std::max(tile.workspace_bytes(), gather.workspace_bytes())); }
  std::size_t workspace_bytes() const { return flag_offset() + align_up(sizeof(int)); }
};

std::optional<DeviceChoice> device_choice(const ForwardArgs& a, const Problem& p, int arch) {
  if (!a.prepared_mask || !a.prepared_mask->choice_pending || sparse_path() != SparsePath::automatic) {
    return std::nullopt;
  }
  // The plans rule out the rest: key indices (the tile plan gathers too), packed sequences, KV
  // caches and a gather forward that does not fit (the gather plan does not gather), splits.
  DeviceChoice choice{plan_forward(a, p, arch), plan_forward(a, p, arch, ForwardPath::gather)};
  if (choice.tile.gather || !choice.gather.gather || choice.tile.num_splits > 1 || choice.gather.num_splits > 1) {
    return std::nullopt;
  }
  return choice;
}

BackwardPlan plan_backward(const BackwardArgs& a, const Problem& p, int arch) {
  BackwardPlan plan;
  const bool pairs = (a.mask || a.indices) &&
                     gather_backward_pairs(list_source(a.mask, a.indices).shape[1], a.bias ? a.bias->shape[1] : 0, p);
  if (gather_backward(a, p, pairs)) {
    plan.gather = true;
    const kernels::sm80::BackwardTile tile = kernels::sm80::backward_tile(static_cast<int>(p.head_dim));
    const TensorView& source = list_source(a.mask, a.indices);
    plan.lists = list_extent(source, p, tile.block_m, tile.block_n);
    plan.pair_heads = pairs;
    plan.family = plan.pair_heads && sm90a_gather_backward(p, arch) ? KernelFamily::sm90a : KernelFamily::sm80;
    if (!lists_prepared(a.prepared_mask, plan.lists, source, p)) plan.lists_bytes = kernels::key_lists_bytes(plan.lists);
    plan.dkv_accum_bytes = static_cast<std::size_t>(p.batch * p.kv_heads * p.seqlen_k * p.head_dim) * sizeof(float);
    plan.dq_slots = 0;  // every query tile's CTA writes its dQ (gather_backward() ruled deterministic mode out)
  } else {
    plan.family = choose_family(p, arch, Pass::backward);
  }
  const int head_dim = static_cast<int>(p.head_dim);
  const int block_n = plan.family == KernelFamily::sm90a ? kernels::sm90::backward_tile(head_dim).block_n
                                                          : kernels::sm80::backward_tile(head_dim).block_n;
  const int ctas_per_sm = plan.family == KernelFamily::sm90a ? kernels::sm90::backward_tile(head_dim).ctas_per_sm
                                                              : kernels::sm80::backward_tile(head_dim).ctas_per_sm;
  plan.key_tiles = static_cast<int>((p.seqlen_k + block_n - 1) / block_n);
  const std::int64_t ctas_per_split = p.kv_heads * p.batch;
  plan.separate_dq = !plan.gather && plan.family == KernelFamily::sm90a && dq_in_own_kernel(a, p);
  if (plan.separate_dq) {
    // dK, dV and dBias have one writer per element on the default grid, and dQ none there.
    plan.key_splits = std::max(1, plan.key_tiles);
    plan.dq_slots = 0;
  } else if (p.deterministic && ctas_per_split > 0) {
    // At most one wave (a CTA past it would double the time), and no more: every dq slot costs a
    // zeroed B·H·Sq·D fp32 buffer and a read in the reduction.
    const std::int64_t wave = std::int64_t(device_info(p.device.index).multiprocessors) * ctas_per_sm;
    plan.key_splits = static_cast<int>(std::clamp<std::int64_t>(wave / ctas_per_split, 1, std::max(1, plan.key_tiles)));
    plan.dq_slots = plan.key_splits;
  }
  plan.head_splits = backward_head_splits(p, plan, ctas_per_sm);
  if (plan.head_splits > 1) {
    plan.dkv_accum_bytes =
        static_cast<std::size_t>(plan.head_splits * p.batch * p.kv_heads * p.seqlen_k * p.head_dim) * sizeof(float);
  }
  if (a.indices) {
    plan.summary_bytes = kernels::index_bits_bytes(plan.lists, index_rows(*a.indices).entries);  // (cannot_run: indices take the gather path)
  } else if (a.mask && !a.prepared_mask) {
    plan.summary_bytes = kernels::tile_summary_bytes(mask_extent(*a.mask, p));
  }
  if (!plan.kernel_computes_dsum()) plan.dsum_bytes = static_cast<std::size_t>(p.batch * p.heads * p.seqlen_q) * sizeof(float);
  plan.dq_accum_bytes = static_cast<std::size_t>(plan.dq_slots) * p.batch * p.heads * p.seqlen_q * p.head_dim * sizeof(float);

  if (!a.dbias) return plan;
  kernels::BiasGrad& g = plan.dbias;
  const TensorView& bias = *a.bias;
  const std::int64_t bias_heads = bias.shape[1];
  const bool rows = bias.shape[2] != 1, keys = bias.shape[3] != 1;
  g.type = element_type(bias.dtype);
  g.batches = bias.shape[0];
  g.heads = bias_heads;
  g.rows = bias.shape[2];
  g.cols = bias.shape[3];
  g.head_divisor = static_cast<int>(p.heads / bias_heads);
  g.accum_row_stride = g.cols;
  g.accum_head_stride = g.heads == 1 ? 0 : g.rows * g.cols;
  g.accum_batch_stride = g.batches == 1 ? 0 : g.heads * g.rows * g.cols;
  g.accum_slot_stride = g.batches * g.heads * g.rows * g.cols;
  // A bias with key dim 1 adds a per-row constant, which cancels in the softmax: for every row,
  // Σ_j dZ = Σ_j P·dP - Δ·Σ_j P = 0. Its gradient is exactly 0, written from a zeroed accumulator.
  g.kind = !keys ? kernels::BiasGradKind::none
                 : rows ? kernels::BiasGradKind::elements : kernels::BiasGradKind::columns;
  // Which CTAs share a dbias element: those of other batches (a bias with one batch) and of other
  // KV heads (a bias with fewer heads than K and V). Inside a CTA, the query heads of the GQA
  // group may read one bias head too.
  const bool batch_shared = bias.shape[0] == 1 && p.batch > 1;
  const bool kv_shared = bias_heads < p.kv_heads;
  const bool grid_empty = p.batch == 0 || p.heads == 0 || plan.key_tiles == 0;
  const bool heads_in_cta = bias_heads != p.heads && p.group_size() > 1;
  // Head splits share a bias head's query heads out among CTAs (unless each has its own).
  const bool heads_split = plan.head_splits > 1 && bias_heads != p.heads;
  // On the gather path every query tile adds to the keys it gathers: always reductions.
  // Packed sequences: the key tiles past a shorter sequence's keys write nothing, so their dBias
  // elements come from the zeroed accumulators.
  g.direct = keys && !grid_empty && !batch_shared && !kv_shared && !heads_split && !plan.gather && !p.packed &&
             (g.kind == kernels::BiasGradKind::columns || !heads_in_cta);
  if (g.direct) return plan;
  if (p.deterministic && keys) {
    g.batch_slots = batch_shared ? static_cast<int>(p.batch) : 1;
    g.kv_slots = kv_shared ? static_cast<int>(p.kv_heads / bias_heads) : 1;
  }
  plan.dbias_accum_bytes =
      static_cast<std::size_t>(g.batch_slots) * g.kv_slots * g.accum_slot_stride * sizeof(float);
  return plan;
}

kernels::BackwardParams backward_params(const BackwardArgs& a, const Problem& p, const BackwardPlan& plan) {
  kernels::BackwardParams b;
  b.fwd = forward_params(forward_view(a), p);
  b.dout = a.dout.data;
  b.dq = a.dq.data;
  b.dk = a.dk.data;
  b.dv = a.dv.data;
  b.dout_batch_stride = a.dout.stride[0];
  b.dout_row_stride = a.dout.stride[1];
  b.dout_head_stride = a.dout.stride[2];
  b.dq_batch_stride = a.dq.stride[0];
  b.dq_row_stride = a.dq.stride[1];
  b.dq_head_stride = a.dq.stride[2];
  b.dk_batch_stride = a.dk.stride[0];
  b.dk_row_stride = a.dk.stride[1];
  b.dk_head_stride = a.dk.stride[2];
  b.dv_batch_stride = a.dv.stride[0];
  b.dv_row_stride = a.dv.stride[1];
  b.dv_head_stride = a.dv.stride[2];
  if (p.packed) {  // (total, heads, D): the kernels rebase per sequence (sequences.h)
    std::int64_t* strides[][3] = {{&b.dout_batch_stride, &b.dout_row_stride, &b.dout_head_stride},
                                  {&b.dq_batch_stride, &b.dq_row_stride, &b.dq_head_stride},
                                  {&b.dk_batch_stride, &b.dk_row_stride, &b.dk_head_stride},
                                  {&b.dv_batch_stride, &b.dv_row_stride, &b.dv_head_stride}};
    const TensorView* rows[] = {&a.dout, &a.dq, &a.dk, &a.dv};
    for (int t = 0; t < 4; ++t) {
      *strides[t][0] = 0;
      *strides[t][1] = rows[t]->stride[0];
      *strides[t][2] = rows[t]->stride[1];
    }
  }
  b.accum_rows = static_cast<int>(p.seqlen_q);  // (the maximum, for packed sequences)
  b.dbias = plan.dbias;
  if (a.dbias) {
    const TensorView& d = *a.dbias;
    b.dbias.out = d.data;
    b.dbias.batch_stride = d.shape[0] == 1 ? 0 : d.stride[0];
    b.dbias.head_stride = d.shape[1] == 1 ? 0 : d.stride[1];
    b.dbias.row_stride = d.shape[2] == 1 ? 0 : d.stride[2];
  }
  b.dq_slots = plan.dq_slots;
  b.pair_heads = plan.pair_heads;
  b.deterministic = p.deterministic;
  b.key_splits = plan.key_splits;
  b.head_splits = plan.head_splits;
  b.separate_dq = plan.separate_dq;
  return b;
}

// Makes the tensors' device current for the duration of a call, and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int current = previous_;
    cudaGetDevice(&current);
    if (current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

Status cuda_failure(const char* what, cudaError_t error) {
  return Status::error(StatusCode::backend_error,
                       std::string("flash_dmattn: ") + what + " failed: " + cudaGetErrorString(error));
}

class CudaSm80Backend final : public BackendImpl {
 public:
  Backend id() const override { return Backend::cuda_sm80; }

  Status check_settings(const Problem& p, Pass pass) const override {
    std::string error;
    choose_family(p, arch_of(p.device.index), pass, &error);
    if (error.empty()) sparse_path(&error);
    return error.empty() ? Status::success() : Status::error(StatusCode::invalid_argument, error);
  }

  std::optional<std::string> cannot_run(const Problem& p, Pass pass) const override {
    if (p.device.type != DeviceType::cuda) return "runs on CUDA tensors, got tensors on " + device_name(p.device);
    // (A cache's key indices would take the gather path, which has no per-sequence lengths.)
    if (p.cached && p.has_indices) return std::string("reads no key indices of a KV cache yet");
    if (p.cached && !ring_fits(p)) {
      const int bucket = kernels::sm80::head_dim_bucket(static_cast<int>(p.head_dim));
      return "reads KV caches with its decode ring, which needs a head dim up to 192 and " +
             std::to_string(kernels::sm80::ring_smem_bytes(bucket)) + " bytes of shared memory per block; got head dim " +
             std::to_string(p.head_dim) + ", and the device allows " +
             std::to_string(device_info(p.device.index).smem_per_block_optin);
    }
    const int arch = arch_of(p.device.index);
    if (arch < 0) return "cannot query CUDA device " + std::to_string(p.device.index);
    if (arch < 80) return "needs compute capability 8.0 or newer, device has " + std::to_string(arch / 10) + "." +
                          std::to_string(arch % 10);
    const ElementType element = element_type(p.dtype);
    if (kernels::sm80::compiled_head_dim_bucket(element, static_cast<int>(p.head_dim)) == 0) {
      return "head dim " + std::to_string(p.head_dim) + " (" + dtype_name(p.dtype) + ") needs the head-dim " +
             std::to_string(kernels::sm80::head_dim_bucket(static_cast<int>(p.head_dim))) +
             " kernel, which this build does not include (FLASH_DMATTN_HEAD_DIMS, FLASH_DMATTN_DTYPES)";
    }
    if (p.has_indices) {
      if (const auto why_not = indices_cannot_run(p, pass)) return why_not;
    }
    if (!p.rows_aligned_16) {
      return std::string(
          "needs q, k, v and out with 16-byte aligned rows: base pointers aligned to 16 bytes and batch, row and "
          "head strides that are multiples of 8 elements");
    }
    // The kernels hold batch and head indices in 32 bits, and their grids run along grid.x
    // (launch.h), which takes at most 2^31 - 1 CTAs: counted here with 64-row query tiles and
    // 64-key tiles, the smallest any kernel takes, so that no launch fails for its size.
    if (p.batch > INT_MAX) return "supports at most 2^31 - 1 batches, got " + std::to_string(p.batch);
    if (p.heads > INT_MAX) return "supports at most 2^31 - 1 heads, got " + std::to_string(p.heads);
    const std::int64_t query_tiles = p.batch * p.heads * ((p.seqlen_q + 63) / 64);
    const std::int64_t key_tiles = p.batch * p.kv_heads * ((p.seqlen_k + 63) / 64);
    if (std::max(query_tiles, key_tiles) > INT_MAX) {
      return "supports at most 2^31 - 1 tiles of 64 rows over batch x heads, got " +
             std::to_string(std::max(query_tiles, key_tiles)) + " (batch " + std::to_string(p.batch) + ", heads " +
             std::to_string(p.heads) + ", seqlen_q " + std::to_string(p.seqlen_q) + ", seqlen_k " +
             std::to_string(p.seqlen_k) + ")";
    }
    if (pass == Pass::backward) {
      const int needed = kernels::sm80::backward_smem_bytes(element, static_cast<int>(p.head_dim));
      const int available = device_info(p.device.index).smem_per_block_optin;
      if (needed > available) {
        return "the backward at head dim " + std::to_string(p.head_dim) + " needs " + std::to_string(needed) +
               " bytes of shared memory per block, the device allows " + std::to_string(available);
      }
    }
    if (p.seqlen_q > INT_MAX / 2) return "supports seqlen_q below 2^30, got " + std::to_string(p.seqlen_q);
    if (p.seqlen_k > INT_MAX / 2) return "supports seqlen_k below 2^30, got " + std::to_string(p.seqlen_k);
    return std::nullopt;
  }

  int arch(const Problem& p) const override { return arch_of(p.device.index); }

  std::string describe(const Problem& p) const override {
    const int arch = arch_of(p.device.index);
    std::string families = "mma.sync kernels";
    const bool forward = choose_family(p, arch, Pass::forward) == KernelFamily::sm90a;
    const bool backward = choose_family(p, arch, Pass::backward) == KernelFamily::sm90a;
    if (forward || backward) {
      families += std::string(", wgmma (sm90a) ") + (forward && backward ? "forward and backward" : forward ? "forward" : "backward");
    }
    return "cuda_sm80: " + families + " on cuda:" + std::to_string(p.device.index) + " (sm_" + std::to_string(arch) + ")";
  }

  std::size_t forward_workspace_size(const ForwardArgs& a, const Problem& p) const override {
    if (p.empty()) return 0;
    const int arch = arch_of(p.device.index);
    if (const auto choice = device_choice(a, p, arch)) return choice->workspace_bytes();
    return plan_forward(a, p, arch).workspace_bytes();
  }

  std::size_t backward_workspace_size(const BackwardArgs& a, const Problem& p) const override {
    return plan_backward(a, p, arch_of(p.device.index)).workspace_bytes();
  }

  std::size_t prepared_mask_size(const ForwardArgs& a, const Problem& p, const PreparedMask* prepared,
                                 MaskPreparation what) const override {
    if (!a.mask) return 0;
    if (prepared) return prepared_layout(*a.mask, p, *prepared).bytes();
    const bool full = what == MaskPreparation::full, deferred = deferred_preparation(what);
    const bool lists = full ? lists_room(a, p) : deferred && deferred_lists_room(a, p);
    return prepared_layout(*a.mask, p, lists, full && sm90a_lists_room(a, p), deferred).bytes();
  }

  Status prepare_mask(const ForwardArgs& a, const Problem& p, PreparedMask* prepared,
                      MaskPreparation what) const override {
    const bool full = what == MaskPreparation::full;
    prepared->gather_forward = prepared->gather_backward = prepared->gather_backward_unpaired = full && lists_room(a, p);
    prepared->sm90a_forward_lists = full && sm90a_lists_room(a, p);  // implies lists_room, so lists()
    prepared->choice_pending = deferred_preparation(what) && deferred_lists_room(a, p);
    if (!a.mask || p.empty()) return Status::success();
    // The caller sized the memory from its own read of FLASH_DMATTN_SPARSE_PATH and
    // FLASH_DMATTN_KERNELS, which may have changed since.
    const PreparedLayout layout = prepared_layout(*a.mask, p, *prepared);
    const std::size_t needed = layout.bytes();
    if (prepared->memory.bytes < needed) {
      return Status::error(StatusCode::invalid_argument,
                           "flash_dmattn.prepare_mask: argument 'prepared': memory: expected at least " +
                               std::to_string(needed) + " bytes (" + kSparsePathVariable +
                               " or FLASH_DMATTN_KERNELS changed since prepared_mask_size?), got " +
                               std::to_string(prepared->memory.bytes));
    }
    const DeviceGuard guard(p.device.index);
    const auto stream = static_cast<cudaStream_t>(a.options.stream);
    char* memory = static_cast<char*>(prepared->memory.data);
    kernels::TileSummary summary;
    cudaError_t e = kernels::build_tile_summary(mask_extent(*a.mask, p), memory, stream, &summary);
    if (e != cudaSuccess) return cuda_failure("the tile summary launch", e);
    if (!prepared->lists()) return Status::success();
    const kernels::KeyListExtent extent = forward_list_extent(*a.mask, p);
    kernels::KeyLists lists;
    if (prepared->choice_pending) {
      // The lists' estimate first, and a build that it lets skip (on the device) lists that
      // cannot pay, unless the caller may read them before the choice.
      auto* estimate = reinterpret_cast<kernels::ListEstimate*>(memory + layout.estimate_offset());
      e = kernels::estimate_key_lists(extent, summary, estimate, stream);
      if (e != cudaSuccess) return cuda_failure("the key-list estimate launch", e);
      kernels::ListGate gate = list_gate(p);
      if (what == MaskPreparation::deferred_choice_with_lists) gate.estimate = nullptr;
      else gate.estimate = estimate;
      kernels::WiderChunks wider;  // for a forward choosing the sm90a gather kernel (prepared_lists)
      if (layout.wider_bytes) {
        wider.block_n = layout.wider_block_n;
        wider.memory = memory + layout.wider_offset();
      }
      e = kernels::build_key_lists(extent, summary, memory + layout.lists_offset(), stream, &lists, gate, wider);
      if (e != cudaSuccess) return cuda_failure("the key-list launch", e);
      return Status::success();
    }
    e = kernels::build_key_lists(extent, summary, memory + layout.lists_offset(), stream, &lists);
    if (e != cudaSuccess) return cuda_failure("the key-list launch", e);
    if (sparse_path() == SparsePath::automatic) {
      ListedWork work;
      e = listed_work(extent, lists, stream, &work);
      if (e != cudaSuccess) return cuda_failure("reading the key-list sizes", e);
      choose_paths(a, p, work, prepared);
    }
    // The sm90a gather forward's own lists, once here rather than on every call. A mask whose
    // forwards keep the tile path leaves their room unused.
    if (prepared->sm90a_forward_lists && prepared->gather_forward) {
      kernels::KeyLists sm90a_lists;
      e = kernels::build_key_lists(sm90a_forward_list_extent(*a.mask, p), summary, memory + layout.sm90a_lists_offset(),
                                   stream, &sm90a_lists);
      if (e != cudaSuccess) return cuda_failure("the sm90a key-list launch", e);
    } else {
      prepared->sm90a_forward_lists = false;
    }
    return Status::success();
  }

  std::pair<std::size_t, std::size_t> prepared_list_sizes(const ForwardArgs& a, const Problem& p,
                                                          const PreparedMask& prepared) const override {
    if (!a.mask || p.empty() || !prepared.choice_pending) return {0, 0};
    const kernels::KeyListExtent extent = forward_list_extent(*a.mask, p);
    const PreparedLayout layout = prepared_layout(*a.mask, p, prepared);
    const std::size_t begin = layout.sizes_offset(extent);
    return {begin, layout.estimate_offset() + layout.estimate_bytes - begin};
  }

  // (The sm90a gather forward's lists, of a tile of their own, were not built: a forward taking
  // that path builds them itself.)
  Status choose_mask_paths(const ForwardArgs& a, const Problem& p, PreparedMask* prepared,
                           const void* sizes) const override {
    if (!prepared->choice_pending) return Status::success();
    if (!a.mask || p.empty() || sizes == nullptr) {
      prepared->choice_pending = false;
      return Status::success();
    }
    // (The layout of the preparation as it was made: with its lists and their estimate.)
    const PreparedLayout layout = prepared_layout(*a.mask, p, *prepared);
    prepared->choice_pending = false;
    const kernels::KeyListExtent extent = forward_list_extent(*a.mask, p);
    const std::size_t begin = layout.sizes_offset(extent);
    kernels::ListEstimate estimate;
    std::memcpy(&estimate, static_cast<const char*>(sizes) + (layout.estimate_offset() - begin), sizeof(estimate));
    const kernels::ListGate gate = list_gate(p);
    prepared->gather_forward = prepared->gather_backward = prepared->gather_backward_unpaired = false;
    // (Where the estimate rules the gather path out, the gated build wrote no sizes.)
    if (kernels::lists_may_pay(estimate, gate.share_permille, gate.sparse_permille)) {
      choose_paths(a, p, listed_work(extent, static_cast<const int*>(sizes)), prepared);
    }
    return Status::success();
  }

  Status forward(const ForwardArgs& a, const Problem& p) const override {
    if (p.empty()) return Status::success();
    const DeviceGuard guard(p.device.index);
    const auto stream = static_cast<cudaStream_t>(a.options.stream);
    const int arch = arch_of(p.device.index);
    char* workspace = static_cast<char*>(a.workspace.data);
    if (const auto choice = device_choice(a, p, arch)) return forward_choosing_path(a, p, *choice, workspace, stream);
    return run_forward(a, p, plan_forward(a, p, arch), workspace, stream);
  }

  // A forward as `plan` says, its kernels' CTAs returning at once where the device chose the
  // other path (gather_chosen, device_choice).
  static Status run_forward(const ForwardArgs& a, const Problem& p, const ForwardPlan& plan, char* workspace,
                            cudaStream_t stream, const int* gather_chosen = nullptr) {
    kernels::ForwardParams params = forward_params(a, p);
    params.gather_chosen = gather_chosen;
    params.pack_group = plan.pack_group;
    params.num_splits = plan.num_splits;
    params.kv_pipeline = plan.kv_pipeline;
    if (plan.num_splits > 1) {
      params.partial_out = reinterpret_cast<float*>(workspace + align_up(plan.summary_bytes));
      params.partial_lse =
          reinterpret_cast<float*>(workspace + align_up(plan.summary_bytes) + align_up(plan.partial_out_bytes));
    }
    if (a.indices) {
      const cudaError_t e = kernels::build_index_lists(plan.lists, index_rows(*a.indices), workspace,
                                                       workspace + plan.lists_offset(), stream, &params.summary,
                                                       &params.lists);
      if (e != cudaSuccess) return cuda_failure("the key lists from indices", e);
    } else if (a.mask && !plan.mask_bytes) {
      const cudaError_t e = mask_summary(*a.mask, p, a.prepared_mask, workspace, stream, &params.summary);
      if (e != cudaSuccess) return cuda_failure("the tile summary launch", e);
      if (plan.gather) {
        kernels::ListGate gate;
        gate.gather_chosen = gather_chosen;
        const cudaError_t l = key_lists(plan.lists, *a.mask, p, a.prepared_mask, params.summary,
                                        workspace + plan.lists_offset(), stream, &params.lists, gate);
        if (l != cudaSuccess) return cuda_failure("the key-list launch", l);
      }
    }
    const bool sm90a = plan.family == KernelFamily::sm90a;
    cudaError_t e = sm90a ? kernels::sm90::forward(params, stream) : kernels::sm80::forward(params, stream);
    if (e != cudaSuccess) return cuda_failure(sm90a ? "the sm90a forward launch" : "the sm80 forward launch", e);
    if (plan.num_splits > 1) {
      e = kernels::combine_split_partials(params, stream);
      if (e != cudaSuccess) return cuda_failure("the split-KV combine launch", e);
    }
    return Status::success();
  }

  Status forward_choosing_path(const ForwardArgs& a, const Problem& p, const DeviceChoice& choice, char* workspace,
                               cudaStream_t stream) const {
    int* chosen = reinterpret_cast<int*>(workspace + choice.flag_offset());
    char* memory = static_cast<char*>(a.prepared_mask->memory.data);
    const PreparedLayout layout = prepared_layout(*a.mask, p, *a.prepared_mask);
    const kernels::KeyListExtent extent = forward_list_extent(*a.mask, p);
    kernels::ListGate gate = list_gate(p);  // the preparation's build's
    gate.estimate = reinterpret_cast<const kernels::ListEstimate*>(memory + layout.estimate_offset());
    const cudaError_t e =
        kernels::choose_gather_path(extent, kernels::describe_key_lists(extent, memory + layout.lists_offset()), gate,
                                    forward_gather_share(p), kSparseTilesShare, chosen, stream);
    if (e != cudaSuccess) return cuda_failure("the path choice launch", e);
    const Status gathered = run_forward(a, p, choice.gather, workspace, stream, chosen);
    if (!gathered.ok()) return gathered;
    return run_forward(a, p, choice.tile, workspace, stream, chosen);
  }

  Status backward(const BackwardArgs& a, const Problem& p) const override {
    const DeviceGuard guard(p.device.index);
    const auto stream = static_cast<cudaStream_t>(a.options.stream);
    const BackwardPlan plan = plan_backward(a, p, arch_of(p.device.index));
    kernels::BackwardParams params = backward_params(a, p, plan);
    char* workspace = static_cast<char*>(a.workspace.data);
    params.dsum = plan.dsum_bytes ? reinterpret_cast<float*>(workspace + align_up(plan.summary_bytes)) : nullptr;
    params.dq_accum = reinterpret_cast<float*>(workspace + plan.accumulators_offset());
    params.dbias.accum = reinterpret_cast<float*>(workspace + plan.accumulators_offset() + align_up(plan.dq_accum_bytes));
    params.dk_accum = reinterpret_cast<float*>(workspace + plan.dkv_offset());
    params.dv_accum = reinterpret_cast<float*>(workspace + plan.dkv_offset() + align_up(plan.dkv_accum_bytes));

    if (a.indices) {
      if (plan.gather) {  // (no gather on an empty problem: nothing reads the lists)
        const cudaError_t e = kernels::build_index_lists(plan.lists, index_rows(*a.indices), workspace,
                                                         workspace + plan.lists_offset(), stream, &params.fwd.summary,
                                                         &params.fwd.lists);
        if (e != cudaSuccess) return cuda_failure("the key lists from indices", e);
      }
    } else if (a.mask) {
      const cudaError_t e = mask_summary(*a.mask, p, a.prepared_mask, workspace, stream, &params.fwd.summary);
      if (e != cudaSuccess) return cuda_failure("the tile summary launch", e);
      if (plan.gather) {
        const cudaError_t l = key_lists(plan.lists, *a.mask, p, a.prepared_mask, params.fwd.summary,
                                        workspace + plan.lists_offset(), stream, &params.fwd.lists);
        if (l != cudaSuccess) return cuda_failure("the key-list launch", l);
      }
    }
    // One memset zeroes every accumulator (each memset costs the host 6-15 us, about a launch);
    // head splits write every element of their dK and dV slots.
    const std::size_t accumulators = plan.accumulators_offset();
    const std::size_t zeroed_end = plan.head_splits > 1 ? plan.dkv_offset() : plan.lists_offset();
    if (zeroed_end > accumulators) {
      const cudaError_t e = cudaMemsetAsync(workspace + accumulators, 0, zeroed_end - accumulators, stream);
      if (e != cudaSuccess) return cuda_failure("zeroing the backward accumulators", e);
    }
    cudaError_t e = cudaSuccess;
    if (!plan.kernel_computes_dsum()) {
      e = kernels::compute_dsum(params, stream);
      if (e != cudaSuccess) return cuda_failure("the dO·O row-sum launch", e);
    }
    if (p.batch > 0 && p.kv_heads > 0) {
      const bool sm90a = plan.family == KernelFamily::sm90a;
      e = sm90a ? kernels::sm90::backward(params, stream) : kernels::sm80::backward(params, stream);
      if (e != cudaSuccess) return cuda_failure(sm90a ? "the sm90a backward launch" : "the sm80 backward launch", e);
    }
    if (plan.gather || plan.head_splits > 1) {
      e = kernels::reduce_dk_dv(params, stream);
      if (e != cudaSuccess) return cuda_failure("the dk/dv reduction launch", e);
    }
    if (!plan.gather && !plan.separate_dq) {
      e = kernels::reduce_dq(params, stream);
      if (e != cudaSuccess) return cuda_failure("the dq reduction launch", e);
    }
    if (a.dbias && !plan.dbias.direct) {
      e = kernels::reduce_bias_grad(params, stream);
      if (e != cudaSuccess) return cuda_failure("the dbias reduction launch", e);
    }
    return Status::success();
  }

 private:
  static int arch_of(int device) { return device_info(device).arch; }
};

}  // namespace

const BackendImpl& cuda_sm80_backend() {
  static const CudaSm80Backend backend;
  return backend;
}

}  // namespace flash_dmattn
