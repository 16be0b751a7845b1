"""Dynamic masks from a bias, with upstream's semantics (upstream_spec §1.5).

A dynamic mask keeps, for every row, the keys whose bias is high: the top `window_size` of them
(topk_mask) or the positive ones (relu_mask), optionally smoothed into whole blocks of keys
(block_smooth). create_mask is the one-call form models use, and accepts 2-D padding masks.
Shapes follow the attention call: (B|1, H|Hk|1, Sq|1, Sk); results are bool, True = keep.
pack_mask packs a bool mask 8 keys to a byte (docs/semantics.md §2), the form flash_dmattn_func
also takes, with 8x fewer bytes for the kernels' summary pass to read; unpack_mask undoes it.

Where upstream errs, we differ on purpose: create_mask returns the mask unchanged when the window
holds every key (upstream's torch.topk fails there).
"""
from typing import Optional

import torch


def _masked_bias(attention_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], min_dtype: float):
    """The bias without gradient, with min_dtype where the mask hides a key (broadcast shape)."""
    bias = attention_bias.detach()
    return bias if attention_mask is None else bias.masked_fill(~attention_mask, min_dtype)


def topk_indices(attention_bias: torch.Tensor, window_size: int) -> torch.Tensor:
    """Sorted indices of the window_size largest entries along the last dim, e.g. (B, Hk, Sk) -> (B, Hk, W)."""
    indices = torch.topk(attention_bias.detach(), window_size, dim=-1, largest=True, sorted=False).indices
    return torch.sort(indices, dim=-1).values


def block_smooth(attention_mask: torch.Tensor, key_len: int, block_size: int) -> torch.Tensor:
    """Majority vote over blocks of block_size keys, in place: a block is kept whole iff more than
    half of it is kept. The tail block votes over its own length. Returns attention_mask.
    """
    if block_size <= 0:
        raise ValueError(f"block_smooth: argument 'block_size': expected a positive integer, got {block_size}")
    if block_size == 1:
        return attention_mask
    full = key_len // block_size * block_size
    if full:
        blocks = attention_mask[..., :full].unflatten(-1, (full // block_size, block_size))
        keep = blocks.sum(dim=-1, keepdim=True) * 2 > block_size
        blocks.copy_(keep.expand_as(blocks))
    if key_len > full:
        tail = attention_mask[..., full:key_len]
        keep = tail.sum(dim=-1, keepdim=True) * 2 > key_len - full
        tail.copy_(keep.expand_as(tail))
    return attention_mask


def _smoothed(mask: torch.Tensor, block_size: Optional[int]) -> torch.Tensor:
    if block_size is not None and block_size > 1:
        block_smooth(mask, mask.shape[-1], block_size)
    return mask


def topk_mask(attention_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], window_size: int,
              min_dtype: float, block_size: Optional[int] = None) -> torch.Tensor:
    """Keeps the window_size keys of highest bias in every row, among the keys attention_mask keeps.

    A selected key whose (masked) bias equals min_dtype is not kept, so a row with fewer visible
    keys than the window keeps only those. block_size > 1 then smooths the result by blocks.
    """
    bias = _masked_bias(attention_bias, attention_mask, min_dtype)
    values, indices = torch.topk(bias, window_size, dim=-1, largest=True, sorted=False)
    mask = torch.zeros(bias.shape, dtype=torch.bool, device=bias.device).scatter_(-1, indices, values != min_dtype)
    return _smoothed(mask, block_size)


def topk_key_indices(attention_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], window_size: int,
                     min_dtype: float) -> torch.Tensor:
    """topk_mask's choice as key indices, for flash_dmattn_func(attn_indices=...) without an Sq x Sk
    mask: int32 (.., window_size), sorted, so that the -1 of a row with fewer visible keys than the
    window come first.
    No block smoothing (a smoothed mask keeps blocks, not a list of keys).
    """
    bias = _masked_bias(attention_bias, attention_mask, min_dtype)
    values, indices = torch.topk(bias, min(window_size, bias.shape[-1]), dim=-1, largest=True, sorted=False)
    indices = indices.masked_fill(values == min_dtype, -1).to(torch.int32)
    return torch.sort(indices, dim=-1).values


def relu_mask(attention_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], min_dtype: float,
              block_size: Optional[int] = None) -> torch.Tensor:
    """Keeps the keys of positive bias among those attention_mask keeps; block_size smooths."""
    return _smoothed(_masked_bias(attention_bias, attention_mask, min_dtype) > 0, block_size)


def _four_dim_mask(attention_mask: Optional[torch.Tensor], batch_size: int, query_len: int,
                   key_len: int) -> Optional[torch.Tensor]:
    """A 2-D padding mask as (B, 1, 1, key_len); 4-D masks pass through.

    (B, key_len) is a key padding mask. (B, query_len) covers only the newest keys, so the older
    key_len - query_len keys (a cache) are kept in front of it.
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    attention_mask = attention_mask.bool()
    if attention_mask.shape == (batch_size, key_len):
        return attention_mask.view(batch_size, 1, 1, key_len)
    if attention_mask.shape == (batch_size, query_len) and query_len <= key_len:
        cached = attention_mask.new_ones((batch_size, key_len - query_len))
        return torch.cat([cached, attention_mask], dim=-1).view(batch_size, 1, 1, key_len)
    raise ValueError(f"create_mask: argument 'attention_mask': expected a 2-D mask of shape (B={batch_size}, "
                     f"key_len={key_len}) or (B, query_len={query_len}), got {tuple(attention_mask.shape)}")


def create_mask(attention_bias: torch.Tensor, attention_mask: Optional[torch.Tensor], batch_size: int,
                query_len: int, key_len: int, window_size: int, min_dtype: float,
                block_size: Optional[int] = None, type: str = "topk") -> Optional[torch.Tensor]:
    """The dynamic mask of a model: topk_mask (type "topk") or relu_mask (type "relu") of the bias,
    within attention_mask, which may be 2-D (a padding mask, see above) or 4-D.

    With type "topk" and window_size >= key_len every key fits the window: the mask is returned
    as given (made 4-D), where upstream's torch.topk would fail.
    """
    if type not in ("topk", "relu"):
        raise ValueError(f"create_mask: argument 'type': expected 'topk' or 'relu', got {type!r}")
    attention_mask = _four_dim_mask(attention_mask, batch_size, query_len, key_len)
    if type == "relu":
        return relu_mask(attention_bias, attention_mask, min_dtype, block_size)
    if window_size >= key_len:
        return attention_mask
    return topk_mask(attention_bias, attention_mask, window_size, min_dtype, block_size)


def _bit_weights(device) -> torch.Tensor:
    """(8,) uint8: bit j mod 8 of a byte holds key j (least significant first)."""
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """A bool mask (..., Sk) packed 8 keys to a byte: uint8 (..., ceil(Sk / 8)), key j at bit j mod 8
    (least significant first) of byte j // 8, the bits past Sk zero. flash_dmattn_func, prepare_mask
    and the varlen, KV-cache and context-parallel calls take it wherever they take a bool mask.

    The key dim is packed as it is: a key-broadcast mask (last dim 1, Sk > 1) stays bool, since a
    packed mask's key dim never broadcasts. Leading dims that an expand() made (stride 0) are
    packed once and expanded again, so that nothing is materialized."""
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"pack_mask: argument 'attention_mask': expected dtype torch.bool, got {attention_mask.dtype}")
    if attention_mask.dim() == 0:
        raise ValueError("pack_mask: argument 'attention_mask': expected at least 1 dim (the keys), got a scalar")
    shape = attention_mask.shape
    compact = attention_mask
    for d in range(attention_mask.dim() - 1):
        if compact.stride(d) == 0 and compact.size(d) > 1:
            compact = compact.narrow(d, 0, 1)
    seqlen_k = shape[-1]
    bits = compact.to(torch.uint8)
    if seqlen_k % 8:
        bits = torch.nn.functional.pad(bits, (0, -seqlen_k % 8))
    packed = (bits.unflatten(-1, (-1, 8)) * _bit_weights(bits.device)).sum(-1, dtype=torch.uint8)
    return packed.expand(*shape[:-1], packed.shape[-1])


def unpack_mask(packed_mask: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The bool mask (..., seqlen_k) that pack_mask packed into packed_mask (..., ceil(seqlen_k / 8))."""
    if packed_mask.dtype != torch.uint8:
        raise TypeError(f"unpack_mask: argument 'packed_mask': expected dtype torch.uint8, got {packed_mask.dtype}")
    if packed_mask.dim() == 0 or packed_mask.shape[-1] != (seqlen_k + 7) // 8:
        raise ValueError(f"unpack_mask: argument 'packed_mask': expected a last dim of ceil({seqlen_k} / 8) = "
                         f"{(seqlen_k + 7) // 8}, got shape {tuple(packed_mask.shape)}")
    bits = packed_mask.unsqueeze(-1).bitwise_and(_bit_weights(packed_mask.device)).ne(0)
    return bits.flatten(-2)[..., :seqlen_k]
