// The fp64 CPU reference: the test oracle for every kernel and the CPU backend of the public API.
//
// It follows docs/semantics.md literally, one query row at a time, accumulating in double, and
// reads mask and bias through its own broadcast indexing (no code shared with the kernels).
// Inputs are strided views of any dtype, fp64 included; validation is the caller's job.
#pragma once

#include <cstdint>
#include <vector>

#include "flash_dmattn/tensor.h"

namespace flash_dmattn::reference {

struct Inputs {
  TensorView q;                      // (B, Sq, H, D)
  TensorView k, v;                   // (B, Sk, Hk, D)
  // (B|1, H|Hk|1, Sq|1, Sk|1), nonzero keeps a key; uint8: bit-packed, (.., ceil(Sk/8)), key j at
  // bit j % 8 of byte j / 8
  const TensorView* mask = nullptr;
  const TensorView* bias = nullptr;  // same broadcast shapes
  // (B|1, H|Hk|1, Sq|1, K) int32: a row keeps the keys it lists (and the mask keeps); -1 and any
  // other value outside [0, Sk) are no key.
  const TensorView* indices = nullptr;
  double scale = 1.0;
  bool causal = false;
  double softcap = 0.0;
};

struct ForwardResult {
  std::vector<double> out;  // (B, Sq, H, D), contiguous
  std::vector<double> lse;  // (B, H, Sq), contiguous; +inf for a row with no visible key
};

struct Gradients {
  std::vector<double> dq;     // (B, Sq, H, D), contiguous
  std::vector<double> dk;     // (B, Sk, Hk, D), contiguous
  std::vector<double> dv;     // (B, Sk, Hk, D), contiguous
  std::vector<double> dbias;  // the bias's own shape, contiguous; empty without a bias
};

// The statistics a backward call was given: the forward's out (B, Sq, H, D) and lse (B, H, Sq).
struct GivenRows {
  const TensorView* out = nullptr;
  const TensorView* lse = nullptr;
};

ForwardResult forward(const Inputs& inputs);
// Gradients of the loss L = sum(dout * out), recomputing the forward in fp64. With `given`, a row
// whose given lse differs from the recomputed one (both rounded to fp32) takes its statistics from
// there: P = exp(z - lse) and D_i = <dO_i, O_i> with the given out. That is a row whose out and lse
// come from attention over more keys than these (context parallelism merges blocks of keys and
// runs each block's backward with the merged out and lse). Where they agree, the recomputation is
// the same quantity in fp64; a NaN lse (a backward run without its forward) is no statistic.
Gradients backward(const Inputs& inputs, const TensorView& dout, const GivenRows& given = {});

// Packed sequences (docs/semantics.md §11), each its own problem of the calls above: q (total_q,
// H, D), k and v (total_k, Hk, D); mask, bias and indices as Inputs' with max_seqlen_q and
// max_seqlen_k for Sq and Sk, positions counted from each sequence's start. Offsets are host int32
// (B + 1,) views, already checked. Results are packed: out (total_q, H, D), lse (H, total_q),
// dq, dk and dv as q and k, dbias the bias's shape (0 where no sequence reads an element).
struct Sequences {
  const TensorView* cu_seqlens_q = nullptr;
  const TensorView* cu_seqlens_k = nullptr;
};

ForwardResult forward(const Inputs& inputs, const Sequences& sequences);
// given: out (total_q, H, D) and lse (H, total_q) as the packed forward returns them.
Gradients backward(const Inputs& inputs, const Sequences& sequences, const TensorView& dout,
                   const GivenRows& given = {});

// A KV cache (docs/semantics.md §12), forwards only: q (B, Sq, H, D); k and v the cache, pages
// (num_pages, page_size, Hk, D) with a block table or (B, K, Hk, D) without; mask, bias and indices
// over the K logical keys. Each sequence is the forward above on its keys [0, seqlens_k[b]).
// Lengths and pages are host int32 views, already checked. Results as the batched forward's.
struct Cache {
  const TensorView* seqlens_k = nullptr;    // (B,)
  const TensorView* block_table = nullptr;  // (B, max_pages), nullptr for a contiguous cache
};

ForwardResult forward(const Inputs& inputs, const Cache& cache);

}  // namespace flash_dmattn::reference
