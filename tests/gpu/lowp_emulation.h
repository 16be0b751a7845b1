// Same-precision baseline of the tolerance rule (tolerance.h): what a plain PyTorch attention in
// the input dtype (fp16/bf16) computes, emulated on the CPU. Every tensor PyTorch would
// materialize is rounded to the input dtype; each operation itself runs in fp32, as PyTorch's
// fp16/bf16 kernels do internally:
//   s = round(fp32 dot(q_i, k_j))                 the q·kᵀ matmul (fp32 accumulation)
//   s = round(s · scale)
//   s = round(cap · tanh(s / cap))                only with softcap
//   z = round(s + bias)                           only with a bias (an fp32 bias is rounded here too)
//   z = -inf where the key is hidden (mask, causal)
//   p = round(softmax_fp32(z))
//   out = round(fp32 Σ_j p_j · v_j)               the p·v matmul
//   lse = fp32 logsumexp(z)
// Rows with no visible key (or only -inf logits) follow the contract instead of producing NaN:
// out = 0, lse = +inf.
//
// It reads the inputs through their TensorView strides and indexes mask and bias with its own
// broadcast code, sharing nothing with the reference or the kernels. The per-row logits are a
// step of their own so that a backward emulation can reuse them.
#pragma once

#include "reference/reference.h"

namespace flash_dmattn::test::lowp {

// Results in the reference's layout: out (B, Sq, H, D) and lse (B, H, Sq), contiguous. Runs on
// all hardware threads over (batch, head, block of query rows).
reference::ForwardResult forward(const reference::Inputs& inputs);

}  // namespace flash_dmattn::test::lowp
