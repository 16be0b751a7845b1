// The attention calls. docs/semantics.md is the contract: shapes, broadcast rules, causal
// alignment, softcap, fully masked rows and how each gradient reduces.
//
// Shapes (B batch, Sq query length, Sk key length, H query heads, Hk key/value heads, D head dim):
//   q, out, dout, dq        (B, Sq, H, D)    fp16 or bf16
//   k, v, dk, dv            (B, Sk, Hk, D)   same dtype as q
//   lse                     (B, H, Sq)       fp32, natural log
//   mask (optional)         (B|1, H|Hk|1, Sq|1, Sk|1)  bool, or bit-packed:
//                           (B|1, H|Hk|1, Sq|1, ceil(Sk/8)) uint8, key j at bit j % 8 (the least
//                           significant first) of byte j / 8; bits past Sk are not read
//   bias (optional), dbias  (B|1, H|Hk|1, Sq|1, Sk|1)  q's dtype or fp32; dbias has bias's shape and dtype
//   indices (optional)      (B|1, H|Hk|1, Sq|1, K)   int32: each row's keys, -1 pads (docs/semantics.md §2);
//                                                    with a mask, a key must be kept by both
// Packed sequences (ForwardArgs::sequences; docs/semantics.md §11): B sequences back to back, each
// its own attention problem, with positions counted from its start:
//   q, out, dout, dq        (total_q, H, D)
//   k, v, dk, dv            (total_k, Hk, D)
//   lse                     (H, total_q)
//   mask, bias, dbias       (B|1, H|Hk|1, max_seqlen_q|1, max_seqlen_k|1) (a bit-packed mask's key
//                           dim: ceil(max_seqlen_k/8) bytes); positions at or past a sequence's
//                           lengths are not read, and their dbias is 0
//   indices                 not taken with packed sequences
// A KV cache (ForwardArgs::cache; docs/semantics.md §12, forwards only): q, out (B, Sq, H, D) are
// every sequence's newest Sq tokens, lse (B, H, Sq), and sequence b sees its cached keys, the
// logical positions [0, seqlens_k[b]) of K, bottom-right aligned under causal masking:
//   k, v                    (num_pages, page_size, Hk, D) with a block table, K = max_pages·page_size,
//                           or (B, K, Hk, D) without one
//   mask, bias, indices     as above, over the K logical positions; those at or past a sequence's
//                           length are not read
// Every view may have any non-negative int64 strides as long as its last dimension is contiguous
// (stride 1, or size 1). A size-1 mask or bias dimension is read through a zero stride, never expanded.
//
// Every call validates all of its arguments before any work starts; a failed check returns
// StatusCode::invalid_argument naming the argument, the expected and the actual value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flash_dmattn/status.h"
#include "flash_dmattn/tensor.h"

namespace flash_dmattn {

// Which implementation runs a call. `automatic` takes the fastest one that supports the call on
// the tensors' device; naming one forces it (an error if it cannot run the call).
enum class Backend : int {
  automatic,
  cpu_reference,  // the fp64 CPU reference (src/reference/); CPU tensors
  cuda_sm80,      // mma.sync kernels, sm_80 and newer; CUDA tensors
  cuda_sm90,      // wgmma/TMA kernels, sm_90a; CUDA tensors
};

const char* backend_name(Backend backend);

// Scratch memory the caller allocates on the tensors' device, at least the size that
// *_workspace_size reports and aligned to kWorkspaceAlignment bytes. The library allocates nothing.
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

inline constexpr std::size_t kWorkspaceAlignment = 256;

struct AttentionOptions {
  std::optional<double> softmax_scale;  // default: 1/sqrt(D); must be finite and > 0
  bool causal = false;                  // bottom-right aligned: key j is visible from row i iff j <= i + Sk - Sq
  double softcap = 0.0;                 // > 0: logits become softcap * tanh(logits / softcap), before the bias
  Backend backend = Backend::automatic;
  void* stream = nullptr;  // a cudaStream_t for CUDA tensors; every launch goes on it. Ignored on the CPU.
};

// A mask prepared once for the calls that share it: the layers of a model that read the same mask,
// and a forward with its backward. prepare_mask() builds into memory the caller owns what a
// masked call otherwise builds from the mask in its workspace every time (the CUDA backends' tile
// summary and, on the gather path, the key lists); a call given the prepared mask reads them
// instead. The call still passes the mask itself (the CPU backend reads it).
// Contract: the mask's contents must not change while a preparation of it is in use; the library
// cannot see such a change. It does check what it can see: a call whose mask view (pointer,
// shape, strides), lengths, heads, head dim, causal flag or device differ from those it was
// prepared for is refused before launch (invalid_argument naming 'prepared_mask').
struct PreparedMask {
  Workspace memory;              // prepared_mask_size() bytes on the mask's device, kWorkspaceAlignment-aligned
  std::uint64_t fingerprint = 0;  // of the call it was prepared for (set by prepare_mask)
  // Whether its forwards, and its backwards, take the gather path over the key lists it holds
  // (set by prepare_mask; a backward where the gather backward runs, else the tile path). The
  // gather backward pays up to a larger share of the work where it takes two query heads per CTA,
  // which a call's bias can prevent (one with a head per query head): gather_backward is the
  // choice for calls whose heads pair as far as the preparation can see (its mask's heads and, if
  // given, its bias's), gather_backward_unpaired for calls whose heads do not.
  bool gather_forward = false, gather_backward = false, gather_backward_unpaired = false;
  // Whether it also holds the forward's key lists for the sm90a gather kernel, whose tiles differ
  // from those of the lists the backward reads (set by prepare_mask).
  bool sm90a_forward_lists = false;
  // Whether it holds key lists whose paths are not chosen yet (MaskPreparation::deferred_choice,
  // until choose_mask_paths()): its forwards choose on the device, its backwards take the tile
  // path meanwhile.
  bool choice_pending = false;

  bool lists() const { return choice_pending || gather_forward || gather_backward || gather_backward_unpaired; }
};

// The offsets of packed sequences: sequence b holds query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
// and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]). Both are (B + 1,) int32 on the tensors'
// device, rising from 0 to total_q and total_k. On the CPU their values are checked before any
// work (invalid_argument naming the offsets); CUDA backends cannot read them without waiting for
// the device and trust them (a sequence longer than the maxima is cut to them). On CUDA the sm80
// and sm90a tile kernels run packed calls, forward and backward (not the gather path); the torch
// front hands eager calls over packed where they need no gradient.
struct PackedSequences {
  TensorView cu_seqlens_q, cu_seqlens_k;
  std::int64_t max_seqlen_q = 0, max_seqlen_k = 0;  // at least every sequence's length; size mask and bias
};

// A KV cache's lengths and pages. Logical key p·page_size + t of sequence b is row t of page
// block_table[b, p]; entries past a sequence's last page are not read. Both int32 on the tensors'
// device; on the CPU their values are checked before any work, while the CUDA backend cannot read
// them without waiting for the device and trusts them (the torch front checks them). On CUDA the
// sm80 forward runs cached calls, reading each key row from its page (not with key indices).
struct KeyValueCache {
  TensorView seqlens_k;                   // (B,): sequence b's cached keys, in [0, K]
  std::optional<TensorView> block_table;  // (B, max_pages): k and v are pages; without it (B, K, Hk, D)
};

struct ForwardArgs {
  TensorView q, k, v;
  std::optional<PackedSequences> sequences;  // given: the packed layouts above
  std::optional<KeyValueCache> cache;        // given: k and v are a KV cache (above)
  std::optional<TensorView> mask;
  std::optional<TensorView> indices;  // key lists per row; CUDA: without a mask, gather path only (semantics.md §2)
  std::optional<TensorView> bias;
  TensorView out;  // written
  TensorView lse;  // written
  AttentionOptions options;
  Workspace workspace;
  const PreparedMask* prepared_mask = nullptr;  // optional: prepare_mask() on these arguments
};

struct BackwardArgs {
  TensorView q, k, v;
  std::optional<PackedSequences> sequences;
  std::optional<TensorView> mask;
  std::optional<TensorView> indices;
  std::optional<TensorView> bias;
  TensorView out;   // the forward's output
  TensorView lse;   // the forward's log-sum-exp
  TensorView dout;  // gradient of the loss with respect to out
  TensorView dq, dk, dv;            // written
  std::optional<TensorView> dbias;  // written when given; requires a bias
  AttentionOptions options;
  bool deterministic = false;  // bitwise-equal results on reruns with the same inputs
  Workspace workspace;
  const PreparedMask* prepared_mask = nullptr;  // optional: prepared from the forward's arguments
};

// What would run a call, without running it.
struct Capability {
  Backend backend = Backend::automatic;  // the backend that would run the call
  int arch = 0;                          // compute capability as 10*major+minor (90 for H100); 0 on the CPU
  std::string description;               // e.g. "cpu_reference: fp64 CPU reference, 2 threads"
};

Status query_forward(const ForwardArgs& args, Capability* capability);
Status query_backward(const BackwardArgs& args, Capability* capability);

Status forward_workspace_size(const ForwardArgs& args, std::size_t* bytes);
Status backward_workspace_size(const BackwardArgs& args, std::size_t* bytes);

// What prepare_mask() builds.
enum class MaskPreparation {
  // Everything the calls can use: the CUDA tile summary and, where the gather path may run, the
  // key lists and the choice of path for each pass (which may wait for the stream, below).
  full,
  // The tile summary alone: no lists and no wait, and every call given it takes the tile path
  // as an unprepared call does (FLASH_DMATTN_SPARSE_PATH=gather still forces the gather path,
  // whose lists such a call then builds itself). What the torch front builds in a deterministic
  // forward that autograd will differentiate, so that its backward does not summarize the mask
  // again.
  tile_summary,
  // The tile summary and, where the gather path may run, the key lists, without waiting: the
  // lists' sizes stay on the device (prepared_list_sizes() says where). Until choose_mask_paths()
  // has read a host copy of them and chosen as `full` would have, a forward given the preparation
  // makes the forward's choice on the device from them (launching both paths' kernels, the one
  // not chosen returning at once; on CUDA where neither path splits the keys, else the tile
  // path), and a backward takes the tile path. Lists that the summary shows cannot pay (a full
  // mask's; at head dims 65 to 128 a sliding window's of 1024 keys or more, at 4096 or more
  // queries; not narrower windows', whose partly visible edge blocks keep it from showing that)
  // are skipped on the device, and their choice is the tile path. What the torch front builds in
  // a forward that autograd will differentiate: the copy is queued behind the preparation and has
  // usually landed by the time the backward runs, which then chooses its path without a wait.
  deferred_choice,
  // The same with every list built, for a caller that may set a gather path itself (its flags in
  // PreparedMask) before the choice has been made.
  deferred_choice_with_lists,
};

// Bytes of PreparedMask::memory that prepare_mask() needs for these arguments (0 where the
// backend builds nothing, as on the CPU). args: a masked forward's, validated as such.
Status prepared_mask_size(const ForwardArgs& args, std::size_t* bytes, MaskPreparation what = MaskPreparation::full);
// Prepares args.mask for the calls of these arguments (and their backward) into
// prepared->memory and sets its fingerprint and paths; asynchronous on args.options.stream,
// except that on CUDA under FLASH_DMATTN_SPARSE_PATH=auto (the default) a mask with a row per
// query and a key per column has its key lists built and their sizes read back (one wait for
// the stream) to choose between the gather and the tile path, for each pass; on a stream being
// captured into a CUDA graph it chooses the tile path without waiting. Writes neither out nor lse.
// `what` as given to prepared_mask_size().
Status prepare_mask(const ForwardArgs& args, PreparedMask* prepared, MaskPreparation what = MaskPreparation::full);
// Where a preparation of these arguments with MaskPreparation::deferred_choice (or
// deferred_choice_with_lists) keeps its key lists' sizes and their estimate: *bytes bytes at
// *offset in prepared.memory, which the caller copies to the host once the stream has passed the
// preparation. 0 bytes where no choice is pending (no lists held,
// as on the CPU, or the paths chosen already): choose_mask_paths() then takes none.
Status prepared_list_sizes(const ForwardArgs& args, const PreparedMask& prepared, std::size_t* offset,
                           std::size_t* bytes);
// Chooses the paths of a preparation made with MaskPreparation::deferred_choice (and clears its
// choice_pending), as MaskPreparation::full would have chosen them, from `sizes`: a host copy of
// the prepared_list_sizes() bytes. args as given to prepare_mask(); no GPU work, no wait. Where
// no choice is pending it leaves the paths as they are.
Status choose_mask_paths(const ForwardArgs& args, PreparedMask* prepared, const void* sizes, std::size_t bytes);

// Runs the forward: writes out and lse. Asynchronous on the stream for CUDA tensors.
Status forward(const ForwardArgs& args);
// Runs the backward: writes dq, dk, dv and, when given, dbias.
Status backward(const BackwardArgs& args);

// The backends compiled into this library that can run on this machine now, best first.
std::vector<Backend> available_backends();

// "0.1.0"
const char* version();

}  // namespace flash_dmattn
