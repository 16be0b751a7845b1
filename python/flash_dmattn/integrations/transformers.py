"""flash_dmattn as a transformers attention backend.

    from flash_dmattn.integrations.transformers import register
    register()                                   # adds "dmattn" to transformers' registries
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dmattn")

Any model that dispatches through transformers' AttentionInterface then runs flash_dmattn_func.
A model with a dynamic-mask bias (upstream's Doge example: bias = A * softplus(dt_proj(V)), of
shape (B, Hk, 1, Sk)) passes it as the keyword `attention_bias`, and may pass `window_size` to keep
only the top-k keys of the bias per row (create_mask), or its own key lists as the keyword
`attention_indices` ((B|1, H|Hk|1, Sq|1, K) int, -1 pads; see masks.topk_key_indices).
"""
import os
from typing import Optional

import torch

from ..interface import flash_dmattn_func
from ..masks import create_mask

# Not "flash_dmattn": transformers takes every name that contains "flash" for a flash-attention
# build of its own and tries to import one.
NAME = "dmattn"


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
    """
    if dropout > 0:
        raise ValueError(f"flash_dmattn: attention dropout is not supported, got dropout={dropout} "
                         "(set the config's attention_dropout to 0)")
    query_len, key_len = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal) and query_len > 1

    mask = attention_mask
    if mask is not None and mask.dim() == 2:
        mask = mask.bool().view(mask.shape[0], 1, 1, mask.shape[1])[..., :key_len]
    elif mask is not None:
        mask = mask[..., :key_len]
        is_causal = False  # a 4-D mask is complete: it already holds the causal pattern
        if mask.dtype != torch.bool:
            attention_bias = mask if attention_bias is None else attention_bias + mask
            mask = None

    if attention_bias is not None and attention_bias.dim() == 3:
        attention_bias = attention_bias.unsqueeze(2)  # (B, H|Hk, Sk): one bias row for every query
    if window_size is None:
        window_size = getattr(module, "window_size", None)
    if attention_bias is not None and window_size is not None and key_len > window_size:
        # The top-k must choose among visible keys only, so causality goes into the mask first.
        if is_causal:
            causal = _causal_mask(query_len, key_len, query.device)
            mask = causal if mask is None else mask & causal
        mask = create_mask(attention_bias, mask, query.shape[0], query_len, key_len, window_size,
                           torch.finfo(attention_bias.dtype).min, block_size=kwargs.get("block_size"))

    dtype = _compute_dtype(module, query)
    query, key, value = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
    if attention_bias is not None and attention_bias.dtype not in (dtype, torch.float32):
        attention_bias = attention_bias.to(dtype)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = os.environ.get("FLASH_DMATTN_DETERMINISTIC", "0") == "1"
    out = flash_dmattn_func(query, key, value, attn_mask=mask, attn_bias=attention_bias, softmax_scale=scaling,
                            is_causal=is_causal, softcap=softcap, deterministic=deterministic,
                            attn_indices=kwargs.get("attention_indices"))
    return out, None


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
