"""flash_dmattn_with_kvcache: decode and chunked prefill against a KV cache, paged or not, with mask and bias.

The call serving engines make: the newest Sq tokens of every sequence attend to that sequence's
cached keys, which are addressed through a block table (vLLM's and FlashInfer's paged layout) or
lie contiguously. The mask and bias address logical key positions (docs/semantics.md §12).

Eager calls that need no gradient hand the cache to the backend as it lies (attention.h
KeyValueCache): the sm80 forward reads each key tile's rows from their pages and each sequence's
length from cache_seqlens, and the CPU reference gathers them. Other calls (gradients,
torch.compile, tensor subclasses, head dims that are not a multiple of 8, rows the kernels cannot
load as 16-byte vectors, and calls the backend refuses) gather each sequence's pages into a
contiguous (B, K, Hk, D) copy and run the dense kernels with the lengths and the causal limit as a
mask.
"""
import torch

from . import _C, torch_ops
from .interface import (_autocast, _check_operands, _checked_options, _kernel_operands, _unpacked,
                        flash_dmattn_func)


def _fail(error, argument: str, message: str):
    raise error(f"flash_dmattn_with_kvcache: argument '{argument}': {message}")


def _read_entries(block_table, cache_seqlens, page_size: int):
    """(B, max_pages) bool: the entries of the block table that a sequence reads (below its length)."""
    return torch.arange(block_table.size(1), device=block_table.device)[None, :] * page_size < \
        cache_seqlens.to(device=block_table.device, dtype=torch.long)[:, None]


def _logical_keys(cache: torch.Tensor, pages, batch: int) -> torch.Tensor:
    """(B, K, Hk, D): the cache as each sequence sees it, K = max_pages x page_size when paged."""
    if pages is None:
        return cache
    return cache[pages].reshape(batch, pages.size(1) * cache.size(1), *cache.shape[2:])


def _run_cached(query, k_cache, v_cache, cache_seqlens, block_table, keys, mask, bias, softmax_scale, is_causal,
                softcap):
    """(out, lse) of the backend reading the cache as it lies, or None where the call takes the
    gathered copy (the module's docstring says when)."""
    operands = (query, k_cache, v_cache, cache_seqlens, block_table, mask, bias)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, k_cache, v_cache, bias))
    if needs_grad or not torch_ops._plain_eager(operands) or query.size(-1) % torch_ops._HEAD_DIM_MULTIPLE:
        return None
    query, k_cache, v_cache, bias = _autocast(query, k_cache, v_cache, bias)
    batch, seqlen_q, heads, head_dim = query.shape
    # The checks flash_dmattn_func makes, on a stand-in for the logical (B, K, Hk, D) keys.
    logical = k_cache.new_empty(1).expand(batch, keys, *k_cache.shape[2:])
    _check_operands(query, logical, logical, mask, bias, None)
    softmax_scale, softcap = _checked_options(softmax_scale, softcap)
    softmax_scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    mask, bias = _kernel_operands(mask, bias)
    out = torch_ops._empty_like(query)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=query.device)
    args = torch_ops._forward_args(query, k_cache, v_cache, out, lse, mask, bias, softmax_scale, bool(is_causal), softcap)
    if query.is_cuda and not args.rows_aligned:
        return None
    _C.set_cache(args, torch_ops._int32(cache_seqlens, query.device), torch_ops._int32(block_table, query.device))
    try:
        torch_ops._run(_C.forward, _C.forward_workspace_size, args, query.device)
    except NotImplementedError:  # (refused before any launch: the gathered copy runs instead)
        return None
    return out, lse


def flash_dmattn_with_kvcache(query, k_cache, v_cache, cache_seqlens, block_table=None, attn_mask=None,
                              attn_bias=None, softmax_scale=None, is_causal=None, softcap=None,
                              return_attn_probs=None, validate=True):
    """Attention of the newest queries of each sequence over its cached keys.

    Args:
        query: (B, Sq, H, D), float16 or bfloat16: the last Sq tokens of each sequence, whose keys
            and values are already in the cache.
        k_cache, v_cache: (num_pages, page_size, Hk, D) with `block_table`, or (B, K, Hk, D)
            without; query's dtype.
        cache_seqlens: int (B,): sequence b's keys are its logical positions [0, cache_seqlens[b]).
        block_table: optional int32 or int64 (B, max_pages): page p of sequence b (its keys
            p x page_size to (p + 1) x page_size - 1) is k_cache[block_table[b, p]]. Entries past a
            sequence's last page are not read.
        attn_mask, attn_bias: optional, (B|1, H|Hk|1, Sq|1, K|1) over logical key positions, with
            K = max_pages x page_size (or the contiguous cache's K); positions at or past a
            sequence's length are not read.
        is_causal: query i of sequence b is token cache_seqlens[b] - Sq + i and sees the keys up to
            it (bottom-right alignment per sequence); without it every query sees every cached key.
        softmax_scale, softcap: as in flash_dmattn_func.
        return_attn_probs: True returns (out, lse, None) with lse (B, H, Sq) float32.
        validate: check cache_seqlens and the block-table entries each sequence reads, and raise
            ValueError naming the bad one. The check reads a flag back from the GPU, so the host
            waits for the work queued before the call. A serving loop whose lengths and tables
            are right by construction (and on the query's device) passes False and nothing waits:
            lengths are then clamped to [0, K], and on CUDA a page index out of range is
            undefined behaviour (an illegal memory access). The CPU backend checks both whatever
            this says. Never made under torch.compile or CUDA-graph capture, which cannot wait.

    Returns:
        out (B, Sq, H, D), or the tuple above.
    """
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        _fail(ValueError, "query", "expected a 4-dim tensor (B, Sq, H, D)")
    batch, seqlen_q = query.shape[:2]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            _fail(ValueError, name, "expected (num_pages, page_size, Hk, D) with block_table, or (B, K, Hk, D)")
    if v_cache.shape != k_cache.shape:
        _fail(ValueError, "v_cache", f"expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if block_table is not None and (not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or
                                    block_table.size(0) != batch or
                                    block_table.dtype not in (torch.int32, torch.int64)):
        _fail(ValueError, "block_table", f"expected an int32 or int64 (B={batch}, max_pages) tensor, got "
                                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    if block_table is None and k_cache.size(0) != batch:
        _fail(ValueError, "k_cache", f"expected (B={batch}, K, Hk, D) without a block_table, got {tuple(k_cache.shape)}")
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.shape != (batch,) or \
            cache_seqlens.dtype not in (torch.int32, torch.int64):
        _fail(ValueError, "cache_seqlens", f"expected an int32 or int64 tensor of shape ({batch},), got "
                                           f"{getattr(cache_seqlens, 'shape', type(cache_seqlens).__name__)}")
    keys = block_table.size(1) * k_cache.size(1) if block_table is not None else k_cache.size(1)
    # Reading the values synchronizes with the GPU: not while torch.compile traces or a CUDA graph
    # is captured.
    check = validate and not torch.compiler.is_compiling() and \
        not (cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing())
    if check:  # one read of the GPU for both checks
        flags = [((cache_seqlens < 0) | (cache_seqlens > keys)).any()]
        if block_table is not None:
            bad_pages = _read_entries(block_table, cache_seqlens, k_cache.size(1)) & \
                ((block_table < 0) | (block_table >= k_cache.size(0)))
            flags.append(bad_pages.any().to(flags[0].device))
        flags = torch.stack(flags).tolist()
        if flags[0]:
            _fail(ValueError, "cache_seqlens", f"expected lengths in [0, {keys}] (the cache's logical keys), got "
                                               f"{cache_seqlens.tolist()}")
        if len(flags) > 1 and flags[1]:
            b, p = (int(i) for i in bad_pages.nonzero()[0])
            _fail(ValueError, "block_table", f"expected page indices in [0, {k_cache.size(0)}) where a sequence "
                                             f"reads them, got {int(block_table[b, p])} at ({b}, {p})")
    cached = _run_cached(query, k_cache, v_cache, cache_seqlens, block_table, keys, attn_mask, attn_bias,
                         softmax_scale, is_causal, softcap)
    if cached is not None:
        return (cached[0], cached[1], None) if return_attn_probs else cached[0]
    # The gathered copy: entries past a sequence's last page (any value) read page 0. Unchecked
    # lengths are clamped to the cache, as the kernels clamp them.
    cache_seqlens = cache_seqlens.clamp(0, keys)
    pages = None if block_table is None else \
        torch.where(_read_entries(block_table, cache_seqlens, k_cache.size(1)), block_table.long(), 0)
    k = _logical_keys(k_cache, pages, batch)
    v = _logical_keys(v_cache, pages, batch)
    lengths = cache_seqlens.to(device=query.device, dtype=torch.long).view(batch, 1, 1, 1)
    positions = torch.arange(keys, device=query.device).view(1, 1, 1, keys)
    visible = positions < lengths  # (B, 1, 1, K)
    if is_causal:
        rows = torch.arange(seqlen_q, device=query.device).view(1, 1, seqlen_q, 1)
        visible = visible & (positions <= lengths - seqlen_q + rows)  # (B, 1, Sq, K)
    attn_mask = _unpacked(_fail, "attn_mask", attn_mask, keys)  # (ANDed with the lengths' mask)
    mask = visible if attn_mask is None else attn_mask & visible
    return flash_dmattn_func(query, k, v, attn_mask=mask, attn_bias=attn_bias, softmax_scale=softmax_scale,
                             is_causal=False, softcap=softcap, return_attn_probs=return_attn_probs)
