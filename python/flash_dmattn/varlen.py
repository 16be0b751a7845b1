"""flash_dmattn_varlen_func: packed sequences (cu_seqlens), with mask and bias.

q, k and v hold the tokens of B sequences back to back, as FlashAttention's varlen call takes them;
mask and bias address (sequence, head, query position, key position) with positions counted from
each sequence's start (docs/semantics.md §11).

Eager calls go to the kernels as packed sequences (attention.h PackedSequences), where the backend
takes them (the CPU reference, and on CUDA the kernels that read the offsets: docs/semantics.md
§11), forward and backward. Other calls (torch.compile, tensor subclasses, and calls the backend
refuses) run the dense kernels on a padded batch: every sequence is padded at the front to the
maxima, so that the kernels' bottom-right causal alignment is each sequence's own. The keys in
front are hidden by a key mask, and the query rows in front are dropped. The mask and bias views
are shifted to match. The padding costs what the padded batch costs.
"""
import weakref

import torch

from . import _C, torch_ops
from .interface import (_autocast, _check_mask_bias_types, _check_operands, _checked_options, _kernel_operands,
                        _unpacked, flash_dmattn_func)


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


class _PackedAttention(torch.autograd.Function):
    """Forward and backward of packed sequences through the module, without padding: (out, lse)
    with lse (H, total_q). Raises NotImplementedError where the backend refuses the forward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, scale, causal, softcap, deterministic):
        head_dim = q.size(-1)
        scale = head_dim ** -0.5 if scale is None else scale
        if head_dim % torch_ops._HEAD_DIM_MULTIPLE:
            q, k, v = torch_ops._padded(q), torch_ops._padded(k), torch_ops._padded(v)
        out = torch_ops._empty_like(q)
        lse = torch.empty(q.size(1), q.size(0), dtype=torch.float32, device=q.device)

        def args_of(q, k, v):
            args = torch_ops._forward_args(q, k, v, out, lse, mask, bias, scale, causal, softcap)
            _C.set_sequences(args, cu_q, cu_k, max_q, max_k)
            return args

        args = args_of(q, k, v)
        if q.is_cuda and not args.rows_aligned:
            q, k, v = torch_ops._rows_aligned(q), torch_ops._rows_aligned(k), torch_ops._rows_aligned(v)
            args = args_of(q, k, v)
        torch_ops._run(_C.forward, _C.forward_workspace_size, args, q.device)
        ctx.save_for_backward(q, k, v, mask, bias, out, lse, cu_q, cu_k)
        ctx.options = (max_q, max_k, scale, causal, softcap, deterministic, head_dim)
        ctx.set_materialize_grads(False)
        return torch_ops._unpadded(out, head_dim), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out took no part in the loss (lse is not differentiable)
            return (None,) * len(ctx.needs_input_grad)
        q, k, v, mask, bias, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, causal, softcap, deterministic, head_dim = ctx.options
        dout = torch_ops._padded(dout) if head_dim % torch_ops._HEAD_DIM_MULTIPLE else dout
        dout = dout.contiguous()
        dq, dk, dv = torch_ops._empty_like(q), torch_ops._empty_like(k), torch_ops._empty_like(v)
        dbias = torch_ops._empty_like(bias) if bias is not None and ctx.needs_input_grad[4] else None
        args = _C.backward_args(q, k, v, out, lse, dout, dq, dk, dv, mask, None, bias, dbias, scale, causal, softcap,
                                deterministic, torch_ops._stream(q), None)
        _C.set_sequences(args, cu_q, cu_k, max_q, max_k)
        torch_ops._run(_C.backward, _C.backward_workspace_size, args, q.device)
        return (torch_ops._unpadded(dq, head_dim), torch_ops._unpadded(dk, head_dim), torch_ops._unpadded(dv, head_dim),
                None, dbias) + (None,) * 8


def _run_packed(query, key, value, mask, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                is_causal, softcap, deterministic):
    """(out, lse) of the packed sequences as they are, or None where they take the padded batch:
    under torch.compile or on tensor subclasses, and where the backend refuses them."""
    operands = (query, key, value, mask, bias, cu_seqlens_q, cu_seqlens_k)
    if not torch_ops._plain_eager(operands):
        return None
    # The checks flash_dmattn_func makes on the padded batch, on one-batch views of the tokens.
    query, key, value, bias = _autocast(query, key, value, bias)
    _check_operands(query[None], key[None], value[None], None, None, None)
    _check_mask_bias_types(query, mask, bias)
    softmax_scale, softcap = _checked_options(softmax_scale, softcap)
    mask, bias = _kernel_operands(mask, bias)
    cu_q, cu_k = (torch_ops._int32(t, query.device) for t in (cu_seqlens_q, cu_seqlens_k))
    try:
        return _PackedAttention.apply(query, key, value, mask, bias, cu_q, cu_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, bool(is_causal), softcap, bool(deterministic))
    except NotImplementedError:  # (refused before any launch: the padded batch runs instead)
        return None


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
            sequence's lengths are not read. Or bit-packed (pack_mask).
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
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        keys = (1, max_seqlen_k)
        if name == "attn_mask" and isinstance(t, torch.Tensor) and t.dtype == torch.uint8:
            keys = ((max_seqlen_k + 7) // 8,)  # bit-packed: 8 keys a byte, never broadcast
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.size(0) not in (1, batch) or
                              t.size(2) not in (1, max_seqlen_q) or t.size(3) not in keys):
            _fail_varlen(ValueError, name, f"expected (B|1 = {batch}, H|Hk|1, max_seqlen_q|1 = {max_seqlen_q}, "
                                           f"max_seqlen_k|1 = {max_seqlen_k}, or ceil(max_seqlen_k / 8) for a "
                                           f"bit-packed mask), got "
                                           f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    packed = _run_packed(query, key, value, attn_mask, attn_bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, softmax_scale, is_causal, softcap, deterministic)
    if packed is not None:
        return (packed[0], packed[1], None) if return_attn_probs else packed[0]

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
