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
// The backward is what PyTorch's autograd computes through that graph in the same dtype. It
// recomputes the forward as above (rounded logits z, rounded p) and then, per query row,
//   dP  = round(fp32 Σ_d dO_d · v_jd)                      the dO·vᵀ matmul
//   Δ   = fp32 Σ_j p_j · dP_j                              softmax backward's row sum (not rounded)
//   dZ  = round(fp32 p_j · (dP_j − Δ))                     gradient of the logits
//   dS  = round(fp32 dZ · scale · (1 − t²)),  t = round(tanh(s / cap))   the factor is 1 without softcap;
//                                             s is the rounded scaled logit before the cap
//   dq  = round(fp32 Σ_j dS_j · k_j)                       the dS·k matmul
//   dk  = round(fp32 Σ_{h in group} Σ_i dS · q_i)          the dSᵀ·q matmul, the GQA group summed in fp32
//   dv  = round(fp32 Σ_{h in group} Σ_i p · dO_i)          the pᵀ·dO matmul, likewise
//   dbias = round_to(bias dtype, fp32 Σ dZ over every (b, h, i, j) that reads the element)
// Every fp32 sum runs in index order (d, j, then (h, i), then (b, h, i, j) for dbias). Rows with
// no visible key (or only -inf logits) contribute exactly 0 to every gradient.
//
// It reads the inputs through their TensorView strides and indexes mask and bias with its own
// broadcast code, sharing nothing with the reference or the kernels. The per-row logits are a
// step of their own, shared by the forward and the backward.
#pragma once

#include "reference/reference.h"

namespace flash_dmattn::test::lowp {

// Results in the reference's layout: out (B, Sq, H, D) and lse (B, H, Sq), contiguous. Runs on
// all hardware threads over (batch, head, block of query rows).
reference::ForwardResult forward(const reference::Inputs& inputs);

// Gradients of L = sum(dout * out) in the reference's layouts: dq (B, Sq, H, D), dk and dv
// (B, Sk, Hk, D), dbias the bias's shape (empty without a bias), all contiguous; dq, dk and dv
// rounded to q's dtype, dbias to the bias's. `dout` is a (B, Sq, H, D) view of q's dtype.
// Multi-threaded like the forward; it keeps p, dS and (with a bias) dZ of every row in fp32
// between its passes, 4 to 12 bytes per (b, h, i, j).
reference::Gradients backward(const reference::Inputs& inputs, const TensorView& dout);

}  // namespace flash_dmattn::test::lowp
