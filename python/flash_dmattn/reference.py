"""A plain PyTorch implementation of docs/semantics.md, the oracle of the GPU tests.

It shares no code with the kernels or with flash_dmattn_func's argument handling: heads are
repeated, masks and biases expanded, and every step is a torch op, so autograd gives its
gradients. upcast=True computes in float64 (the reference); upcast=False computes in the inputs'
own dtype, as a straightforward fp16/bf16 implementation would (the baseline that the tolerance is
measured against, style rule 11). Memory grows as B·H·Sq·Sk: for tests, not for training.
"""
from typing import Optional, Tuple

import torch


def _per_query_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(B|1, H|Hk|1, Sq|1, Sk|1) -> (B|1, H, Sq|1, Sk|1): query head h reads head h // (H / Hx)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def past_diagonal(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(Sq, Sk) int: how far key j lies past the last key that row i sees under causal masking
    aligned bottom-right, j - i - (Sk - Sq). Causal keeps the pairs where it is <= 0; a sliding
    window of W keys those in (-W, 0]."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    keys = torch.arange(seqlen_k, device=device)[None, :]
    return keys - rows - (seqlen_k - seqlen_q)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                        bias: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                        causal: bool = False, softcap: float = 0.0,
                        upcast: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Sq, H, D), lse (B, H, Sq)) in the compute dtype: float64 with upcast, else q's.

    Rows without a visible key get out = 0 and lse = +inf; hidden positions never reach a
    result or a gradient, whatever the bias holds there.
    """
    dtype = torch.float64 if upcast else q.dtype
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    group = heads // k.shape[2]
    qh = q.to(dtype).transpose(1, 2)                                      # (B, H, Sq, D)
    kh = k.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)      # (B, H, Sk, D)
    vh = v.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)

    logits = torch.matmul(qh, kh.transpose(-1, -2)) * scale              # 1. scale
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)                   # 2. softcap
    if bias is not None:
        logits = logits + _per_query_head(bias.to(dtype), heads)          # 3. bias, neither scaled nor capped

    visible = torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if mask is not None:
        visible = visible & _per_query_head(mask, heads)
    if causal:
        visible = visible & (past_diagonal(seqlen_q, seqlen_k, q.device) <= 0)  # bottom-right aligned
    logits = logits.masked_fill(~visible, float("-inf"))

    # A max-shifted softmax whose empty rows (all -inf) give p = 0 and no NaN, in values or in
    # gradients: the shift is detached and finite, and the row sum is replaced by 1 where it is 0.
    row_max = logits.amax(dim=-1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - shift)
    row_sum = weights.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    probs = weights / torch.where(empty, torch.ones_like(row_sum), row_sum)
    out = torch.matmul(probs, vh).transpose(1, 2)                         # (B, Sq, H, D)
    lse = torch.where(empty, torch.full_like(row_sum, float("inf")), shift + torch.log(row_sum)).squeeze(-1)
    return out, lse
