"""flash_dmattn as a transformers attention backend.

    from flash_dmattn.integrations.transformers import register
    register()                                   # adds "dmattn" to transformers' registries
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dmattn")

Any model that dispatches through transformers' AttentionInterface then runs flash_dmattn_func.
A model with a dynamic-mask bias (upstream's Doge example: bias = A * softplus(dt_proj(V)), of
shape (B, Hk, 1, Sk)) passes it as the keyword `attention_bias`, and may pass `window_size` to keep
only the top-k keys of the bias per row (create_mask), or its own key lists as the keyword
`attention_indices` ((B|1, H|Hk|1, Sq|1, K) int, -1 pads; see masks.topk_key_indices), with the
bias of each listed key as `attention_indices_bias` if it has one.

A 4-D bool mask is prepared once (prepare_mask) and read by every layer and every backward.

Packed batches (transformers' DataCollatorWithFlattening with return_flash_attn_kwargs=True, or
any caller passing `cu_seq_lens_q`, `cu_seq_lens_k`, `max_length_q` and `max_length_k`, as
transformers' flash-attention backends take them) run through flash_dmattn_varlen_func: every
sequence attends to itself alone, and the bias, given over the packed tokens, is cut per sequence.
"""
import os
import weakref
from typing import Optional

import torch

from ..interface import PreparedMask, flash_dmattn_func, prepare_mask
from ..masks import create_mask
from ..varlen import flash_dmattn_varlen_func, gather_positions

# The keywords in which transformers hands a packed batch's offsets to flash-attention backends.
PACKED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

# Not "flash_dmattn": transformers takes every name that contains "flash" for a flash-attention
# build of its own and tries to import one.
NAME = "dmattn"


# Every layer of a model reads the one attention_mask transformers built: the first layer prepares
# it (prepare_mask: the kernels' tile summary and key lists), the others and every backward read
# that preparation. An entry lives as long as the mask it was made from: it refers to the mask
# weakly (by id, as tensors compare element-wise) and keeps the preparation's memory, not the
# PreparedMask, whose view of the mask would keep the mask alive.
_PREPARED = {}  # id(attention_mask) -> (weak reference to it, signature, (storage, fingerprint, paths))


def _shared_preparation(attention_mask: torch.Tensor, mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, is_causal: bool):
    """The PreparedMask of mask (a view of attention_mask) for calls of these shapes: made once and
    kept with attention_mask, made again when shapes, flag or the mask's contents changed."""
    signature = (query.shape, key.shape, value.shape, query.device, is_causal, mask.data_ptr(), mask.shape,
                 mask.stride(), mask._version)
    key_id = id(attention_mask)
    entry = _PREPARED.get(key_id)
    if entry is not None and entry[0]() is attention_mask and entry[1] == signature:
        return PreparedMask.of(mask, entry[2], is_causal)
    prepared = prepare_mask(query, key, value, mask, is_causal=is_causal)
    reference = weakref.ref(attention_mask, lambda _, key_id=key_id: _PREPARED.pop(key_id, None))
    _PREPARED[key_id] = (reference, signature, prepared._prepared)
    return prepared


def _causal_mask(query_len: int, key_len: int, device: torch.device) -> torch.Tensor:
    """(1, 1, Sq, Sk) bool, bottom-right aligned like the kernels' causal flag."""
    rows = torch.arange(query_len, device=device)[:, None]
    cols = torch.arange(key_len, device=device)[None, :]
    return (cols <= rows + key_len - query_len)[None, None]


def _compute_dtype(module: torch.nn.Module, query: torch.Tensor) -> torch.dtype:
    """float32 activations (from layer norms kept in float32, as PEFT does) run in the autocast
    dtype, else in the dtype of the module's linear weights, as transformers' flash-attention path does.
    """
    if query.dtype != torch.float32:
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in (torch.float16, torch.bfloat16):
            return layer.weight.dtype
    return query.dtype


def flash_dmattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                   value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                   attention_bias: Optional[torch.Tensor] = None, scaling: Optional[float] = None,
                                   softcap: Optional[float] = None, window_size: Optional[int] = None,
                                   dropout: float = 0.0, is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function signature: q (B, H, Sq, D), k and v (B, Hk, Sk, D).

    attention_mask may be None, a 4-D bool mask (True keeps; transformers' sdpa format, which
    register() asks transformers to build for this backend), a 4-D float mask (additive, the eager
    format: it is added to the bias), or a 2-D (B, Sk) padding mask. Causality follows
    transformers' sdpa backend: applied from `is_causal` (default module.is_causal) when the mask
    is not 4-D and Sq > 1. Returns (out (B, Sq, H, D), None): no attention weights.

    With cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k in kwargs (a packed batch:
    B = 1, the sequences back to back), each sequence attends to itself alone, causally per
    sequence when is_causal holds; attention_mask is not read (for a packed batch transformers
    builds the block-diagonal mask the offsets already say), and a (1, H|Hk, 1|total, total) bias
    is read at each sequence's own tokens.
    """
    if dropout > 0:
        raise ValueError(f"flash_dmattn: attention dropout is not supported, got dropout={dropout} "
                         "(set the config's attention_dropout to 0)")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if window_size is None:
        window_size = getattr(module, "window_size", None)
    if attention_bias is not None and attention_bias.dim() == 3:
        attention_bias = attention_bias.unsqueeze(2)  # (B, H|Hk, Sk): one bias row for every query
    if all(kwargs.get(name) is not None for name in PACKED_KEYWORDS):
        return _packed_attention(module, query, key, value, attention_bias, scaling, softcap, window_size,
                                 bool(is_causal), kwargs), None
    query_len, key_len = query.shape[2], key.shape[2]
    is_causal = bool(is_causal) and query_len > 1

    mask = attention_mask
    shared = False  # a 4-D bool mask with a row per query: every layer's calls may share its preparation
    if mask is not None and mask.dim() == 2:
        mask = mask.bool().view(mask.shape[0], 1, 1, mask.shape[1])[..., :key_len]
    elif mask is not None:
        mask = mask[..., :key_len]
        is_causal = False  # a 4-D mask is complete: it already holds the causal pattern
        if mask.dtype != torch.bool:
            attention_bias = mask if attention_bias is None else attention_bias + mask
            mask = None
        else:
            shared = mask.size(2) > 1

    if attention_bias is not None and window_size is not None and key_len > window_size:
        # The top-k must choose among visible keys only, so causality goes into the mask first.
        if is_causal:
            causal = _causal_mask(query_len, key_len, query.device)
            mask = causal if mask is None else mask & causal
        mask = create_mask(attention_bias, mask, query.shape[0], query_len, key_len, window_size,
                           torch.finfo(attention_bias.dtype).min, block_size=kwargs.get("block_size"))
        shared = False  # each layer's own top-k

    dtype = _compute_dtype(module, query)
    query, key, value = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
    if shared and kwargs.get("attention_indices") is None and not torch.compiler.is_compiling():
        mask = _shared_preparation(attention_mask, mask, query, key, value, is_causal)
    out = flash_dmattn_func(query, key, value, attn_mask=mask, attn_bias=_bias_in(attention_bias, dtype),
                            softmax_scale=scaling, is_causal=is_causal, softcap=softcap,
                            deterministic=_deterministic(kwargs), attn_indices=kwargs.get("attention_indices"),
                            attn_indices_bias=kwargs.get("attention_indices_bias"))
    return out, None


def _bias_in(bias: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The bias in a dtype the kernels take: the compute dtype, or float32 as given."""
    if bias is not None and bias.dtype not in (dtype, torch.float32):
        return bias.to(dtype)
    return bias


def _deterministic(kwargs) -> bool:
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_DMATTN_DETERMINISTIC", "0") == "1"
    return bool(deterministic)


def _per_sequence(t: Optional[torch.Tensor], dim: int, cu_seqlens: torch.Tensor, width: int):
    """t (1, heads, rows, cols), whose dim (2: rows, 3: cols) runs over packed tokens, as the varlen
    layout (B, heads, .., width, ..): position p of sequence b is packed token cu_seqlens[b] + p.
    Positions past a sequence's length read its last token or beyond; the kernels never read them."""
    if t is None or t.size(dim) == 1:
        return t
    total = t.size(dim)
    if total == 0:
        shape = list(t.shape)
        shape[0], shape[dim] = cu_seqlens.numel() - 1, width
        return t.new_zeros(shape)
    index = (cu_seqlens[:-1, None].to(t.device, torch.long) + torch.arange(width, device=t.device)[None, :]).clamp(
        max=total - 1)
    return gather_positions(t, dim, index)


def _packed_attention(module, query, key, value, attention_bias, scaling, softcap, window_size, is_causal,
                      kwargs) -> torch.Tensor:
    """A packed batch: q (1, H, total_q, D), k and v (1, Hk, total_k, D), offsets in kwargs.
    transformers' own mask for it (block-diagonal) says what the offsets say, so it is not read;
    a sliding window (kwargs["sliding_window"]) is applied per sequence. Other patterns that only
    a mask would carry (chunked attention) are not. Returns out (1, total_q, H, D)."""
    if kwargs.get("attention_indices") is not None or kwargs.get("attention_indices_bias") is not None:
        raise ValueError("flash_dmattn: argument 'attention_indices': key lists are not taken with a packed batch "
                         "(cu_seq_lens_q given); pass window_size, or unpack the batch")
    if query.shape[0] != 1:
        raise ValueError("flash_dmattn: argument 'query': a packed batch (cu_seq_lens_q given) holds its sequences "
                         f"in one row, expected batch 1, got {query.shape[0]}")
    total_q, total_k = query.shape[2], key.shape[2]
    if attention_bias is not None and (attention_bias.shape[0] != 1 or attention_bias.shape[2] not in (1, total_q) or
                                       attention_bias.shape[3] not in (1, total_k)):
        raise ValueError("flash_dmattn: argument 'attention_bias': a packed batch's bias lies over its packed tokens, "
                         f"expected (1, H|Hk|1, 1|{total_q}, 1|{total_k}), got {tuple(attention_bias.shape)}")
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q, max_k = int(kwargs["max_length_q"]), int(kwargs["max_length_k"])
    bias = _per_sequence(_per_sequence(attention_bias, 2, cu_q, max_q), 3, cu_k, max_k)
    # The mask transformers builds is not read, so what it would add to the packing is built here
    # per sequence: a sliding window (Mistral, Qwen2, Gemma pass `sliding_window`), and the top-k.
    sliding_window = kwargs.get("sliding_window")
    top_k = bias is not None and window_size is not None and max_k > window_size
    mask = None
    if sliding_window is not None or top_k:
        lengths_q = (cu_q[1:] - cu_q[:-1]).to(query.device, torch.long)[:, None, None, None]
        lengths_k = (cu_k[1:] - cu_k[:-1]).to(query.device, torch.long)[:, None, None, None]
        rows = torch.arange(max_q, device=query.device)[:, None]
        cols = torch.arange(max_k, device=query.device)[None, :]
        diagonal = rows + lengths_k - lengths_q  # query i's own position among its sequence's keys
        mask = cols < lengths_k
        if is_causal:
            mask = mask & (cols <= diagonal)
        if sliding_window is not None:
            mask = mask & (cols > diagonal - sliding_window)  # transformers' sliding_window_overlay
        if top_k:
            # The top-k of each row chooses among the keys its own sequence lets it see.
            mask = create_mask(bias, mask, lengths_q.shape[0], max_q, max_k, window_size,
                               torch.finfo(bias.dtype).min, block_size=kwargs.get("block_size"))
    dtype = _compute_dtype(module, query)
    query, key, value = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
    out = flash_dmattn_varlen_func(query, key, value, cu_q, cu_k, max_q, max_k, attn_mask=mask,
                                   attn_bias=_bias_in(bias, dtype), softmax_scale=scaling, is_causal=is_causal,
                                   softcap=softcap, deterministic=_deterministic(kwargs))
    return out.unsqueeze(0)


def register(name: str = NAME) -> str:
    """Registers the attention function, and transformers' sdpa mask builder for it, under name.

    Without a mask builder, transformers builds no mask at all for an unknown backend (padding
    would be ignored); the sdpa one makes bool masks, or none when is_causal says everything.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(name, flash_dmattn_attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError:  # transformers before 4.53 builds masks per model
        return name
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
