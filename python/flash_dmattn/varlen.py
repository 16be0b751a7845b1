"""flash_dmattn_varlen_func: packed sequences (cu_seqlens), with mask and bias.

q, k and v hold the tokens of B sequences back to back, as FlashAttention's varlen call takes them;
mask and bias address (sequence, head, query position, key position) with positions counted from
each sequence's start (docs/semantics.md §11).

This first version runs the dense kernels on a padded batch: every sequence is padded at the front
to the maxima, so that the kernels' bottom-right causal alignment is each sequence's own. The keys
in front are hidden by a key mask, and the query rows in front are dropped. The mask and bias views
are shifted to match. The padding costs what the padded batch costs. Kernels that read the packed
layout directly are to replace it behind the same call.
"""
import weakref

import torch

from .interface import _unpacked, flash_dmattn_func


def _fail_varlen(error, argument: str, message: str):
    raise error(f"flash_dmattn_varlen_func: argument '{argument}': {message}")


def _lengths(cu_seqlens, name: str) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        _fail_varlen(ValueError, name, "expected a 1-dim tensor of B + 1 offsets (0, len_0, len_0 + len_1, ...)")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        _fail_varlen(TypeError, name, f"expected dtype torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def _offset_problems(cu_seqlens, lengths, total: int, max_seqlen: int) -> torch.Tensor:
    """A 0-dim bool tensor: whether the offsets do not rise from 0 to `total` or a length passes max_seqlen."""
    bad = (cu_seqlens[0] != 0) | (cu_seqlens[-1] != total)
    if lengths.numel():
        bad = bad | (lengths < 0).any() | (lengths.max() > max_seqlen)
    return bad


# Offset tensors that passed the check, by id: (the tensor, weakly; its version; total; max_seqlen).
# A model's layers are called with the same offset tensors: only the first call reads them.
_CHECKED = {}


def _already_checked(cu_seqlens, total, max_seqlen) -> bool:
    entry = _CHECKED.get(id(cu_seqlens))
    return entry is not None and entry[0]() is cu_seqlens and entry[1:] == (cu_seqlens._version, total, max_seqlen)


def _check_offsets(checks) -> None:
    """checks: (name, cu_seqlens, lengths, total, max_seqlen) per offset list. Reading values
    synchronizes with the GPU: one read for all of them, none while torch.compile traces or a CUDA
    graph is captured, and none for offset tensors checked before and not modified since (the
    tensor objects themselves, held weakly); the message is made only when one fails."""
    if torch.compiler.is_compiling() or any(c[1].is_cuda and torch.cuda.is_current_stream_capturing() for c in checks):
        return
    checks = [c for c in checks if not _already_checked(c[1], c[3], c[4])]
    if not checks:
        return
    device = checks[0][1].device
    flags = torch.stack([_offset_problems(*c[1:]).to(device) for c in checks]).cpu()
    for (name, cu_seqlens, lengths, total, max_seqlen), bad in zip(checks, flags.tolist()):
        if not bad:
            continue
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total or bool((lengths < 0).any()):
            _fail_varlen(ValueError, name, f"expected offsets from 0 rising to the {total} packed tokens, got "
                                           f"{cu_seqlens.tolist()}")
        _fail_varlen(ValueError, name, f"a sequence of {int(lengths.max())} tokens is longer than its "
                                       f"max_seqlen {max_seqlen}")
    if len(_CHECKED) > 64:
        _CHECKED.clear()
    for _, cu_seqlens, _, total, max_seqlen in checks:
        _CHECKED[id(cu_seqlens)] = (weakref.ref(cu_seqlens), cu_seqlens._version, total, max_seqlen)


def _front_padding(lengths: torch.Tensor, width: int, total: int):
    """(padded row of every packed token in a (B·width) batch, front padding per sequence)."""
    front = width - lengths
    batch = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths,
                                    output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(total, device=lengths.device) - starts[batch]
    return batch * width + front[batch] + position, front


def gather_positions(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """t (B|1, heads, rows, cols) read along dim (2 or 3) at per-sequence positions: index (B, width)
    holds sequence b's positions; the result is (B, heads, .., width, ..)."""
    batch, width = index.shape
    shape = list(t.shape)
    shape[0], shape[dim] = batch, width
    view = [batch, 1, 1, 1]
    view[dim] = width
    return torch.gather(t.expand(batch, *t.shape[1:]), dim, index.view(view).expand(shape))


def _shift(t, dim: int, front: torch.Tensor):
    """t (B|1, heads, rows, cols) with dim 2 or 3 moved back by each sequence's front padding: padded
    position p reads position p - front[b] (clamped to 0 in front, where nothing reads it)."""
    if t is None or t.size(dim) == 1:
        return t
    width = t.size(dim)
    return gather_positions(t, dim, (torch.arange(width, device=front.device)[None, :] - front[:, None]).clamp(min=0))


def flash_dmattn_varlen_func(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             attn_mask=None, attn_bias=None, softmax_scale=None, is_causal=None, softcap=None,
                             deterministic=None, return_attn_probs=None):
    """Attention over packed sequences, each with its own lengths, mask and bias.

    Args:
        query: (total_q, H, D); key, value: (total_k, Hk, D); dtypes as in flash_dmattn_func.
        cu_seqlens_q, cu_seqlens_k: int32 or int64 (B + 1,): sequence b's queries are
            query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]], its keys likewise. Empty sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence's lengths (the padded sizes).
        attn_mask: optional bool (B|1, H|Hk|1, max_seqlen_q|1, max_seqlen_k|1): element (b, h, i, j)
            is query i and key j of sequence b, counted from the sequence's start; positions past a
            sequence's lengths are not read. Or bit-packed (pack_mask), unpacked here for now.
        attn_bias: optional bias of the same layout; its gradient comes back in its shape (zero at
            the positions that no sequence reads).
        is_causal: bottom-right aligned per sequence: query i of sequence b sees keys
            j <= i + len_k(b) - len_q(b).
        softmax_scale, softcap, deterministic: as in flash_dmattn_func.
        return_attn_probs: True returns (out, lse, None) with lse (H, total_q) float32.

    Returns:
        out (total_q, H, D), or the tuple above.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            _fail_varlen(ValueError, name, "expected a 3-dim tensor (total tokens, heads, D), got "
                                           f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        _fail_varlen(ValueError, "cu_seqlens_k", f"expected {cu_seqlens_q.numel()} offsets like cu_seqlens_q, got "
                                                 f"{cu_seqlens_k.numel()}")
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    total_q, total_k = query.shape[0], key.shape[0]
    lengths_q = _lengths(cu_seqlens_q, "cu_seqlens_q")
    lengths_k = _lengths(cu_seqlens_k, "cu_seqlens_k")
    _check_offsets([("cu_seqlens_q", cu_seqlens_q, lengths_q, total_q, max_seqlen_q),
                    ("cu_seqlens_k", cu_seqlens_k, lengths_k, total_k, max_seqlen_k)])
    batch = lengths_q.numel()
    rows_q, front_q = _front_padding(lengths_q.to(query.device), max_seqlen_q, total_q)
    rows_k, front_k = _front_padding(lengths_k.to(query.device), max_seqlen_k, total_k)

    def padded(t, rows, width):
        flat = t.new_zeros(batch * width, *t.shape[1:]).index_copy(0, rows, t)
        return flat.view(batch, width, *t.shape[1:])

    q = padded(query, rows_q, max_seqlen_q)
    k = padded(key, rows_k, max_seqlen_k)
    v = padded(value, rows_k, max_seqlen_k)
    keys_kept = (torch.arange(max_seqlen_k, device=query.device)[None, :] >= front_k[:, None]).view(
        batch, 1, 1, max_seqlen_k)
    attn_mask = _unpacked(_fail_varlen, "attn_mask", attn_mask, max_seqlen_k)  # (shifted per sequence below)
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.size(0) not in (1, batch) or
                              t.size(2) not in (1, max_seqlen_q) or t.size(3) not in (1, max_seqlen_k)):
            _fail_varlen(ValueError, name, f"expected (B|1 = {batch}, H|Hk|1, max_seqlen_q|1 = {max_seqlen_q}, "
                                           f"max_seqlen_k|1 = {max_seqlen_k}), got "
                                           f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    mask = keys_kept
    if attn_mask is not None:
        mask = _shift(_shift(attn_mask, 2, front_q), 3, front_k) & keys_kept
    bias = _shift(_shift(attn_bias, 2, front_q), 3, front_k) if attn_bias is not None else None
    out, lse, _ = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, softmax_scale=softmax_scale,
                                    is_causal=is_causal, softcap=softcap, deterministic=deterministic,
                                    return_attn_probs=True)
    out = out.reshape(batch * max_seqlen_q, *out.shape[2:]).index_select(0, rows_q)
    if not return_attn_probs:
        return out
    lse = lse.transpose(0, 1).reshape(lse.size(1), batch * max_seqlen_q).index_select(1, rows_q)
    return out, lse, None
