"""FLOP counts: dense-equivalent and visited-tile, reported apart so that sparsity is not passed off
as kernel speed (../shared/reference/anchors.md).

- Dense-equivalent: the FLOPs of the dense problem with the case's causal limit only,
  4·B·H·D per (query, key) pair that causality allows (S(S+1)/2 pairs for Sq = Sk, about half of
  S², the anchors' "halved for causal"); the backward counts 2.5 times the forward (its five
  GEMMs against the forward's two).
- Visited-tile: the same 4·D per pair, over the pairs inside the tiles an implementation computes.
  A tile is computed when it holds one visible key (mask and causal limit); its pairs are counted
  up to the ends of the problem, so the rows a decode tile pads with are not counted as work.

Works on numpy arrays and torch tensors alike (the tile reduction runs where the mask lives, the
small tile maps are counted in numpy), so that the tests need no torch.
"""
from typing import Dict, Tuple

import numpy as np


def kernel_tiles(head_dim: int) -> Dict[str, Tuple[int, int]]:
    """(block_m, block_n) of our sm80 kernels per pass: the values of forward_tile and backward_tile
    in src/kernels/sm80/tile_size.h. Update both together."""
    if head_dim <= 64:
        forward = (64, 128)
    elif head_dim <= 128:
        forward = (64, 64)
    else:
        forward = (128, 64)
    backward = (64, 128) if head_dim <= 64 else (64, 64)
    return {"fwd": forward, "bwd": backward}


def gather_tiles(head_dim: int) -> Dict[str, Tuple[int, int]]:
    """The gather path's work as tiles: its forward computes, per query tile of the sm80 forward's
    block_m rows, the keys that some row of the tile sees (the tile's key list), which is what
    (block_m, 1) tiles count: a one-key tile is visited iff a row of the query tile sees that key,
    and their density is the union density. Its backward does the same per query tile of the
    sm80 backward's block_m rows up to head dim 128, and takes the tile path past it (and in
    deterministic mode)."""
    tiles = kernel_tiles(head_dim)
    backward = (tiles["bwd"][0], 1) if head_dim <= 128 else tiles["bwd"]
    return {"fwd": (tiles["fwd"][0], 1), "bwd": backward}


def causal_pairs(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """(query, key) pairs the causal limit allows: key j is visible from row i iff j <= i + Sk - Sq."""
    if not causal:
        return seqlen_q * seqlen_k
    # Row i sees i + Sk - Sq + 1 keys (never more than Sk, as i < Sq); the first Sq - Sk rows of a
    # problem with more queries than keys see none. The rest is an arithmetic series.
    first = max(0, seqlen_q - seqlen_k)
    rows = seqlen_q - first
    return rows * (first + seqlen_k - seqlen_q + 1 + seqlen_k) // 2


def pass_flops(head_dim: int, forward_pairs: int, backward_pairs: int, mode: str) -> float:
    """FLOPs of `mode` over the given (query, key) pairs of one head: 4·D per pair in the forward
    (Q·Kᵀ and P·V), 10·D in the backward (its five GEMMs)."""
    forward = 4.0 * head_dim * forward_pairs if mode in ("fwd", "fwd_bwd") else 0.0
    backward = 10.0 * head_dim * backward_pairs if mode in ("bwd", "fwd_bwd") else 0.0
    return forward + backward


def dense_flops(batch: int, heads: int, head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool,
                mode: str) -> float:
    pairs = causal_pairs(seqlen_q, seqlen_k, causal)
    return batch * heads * pass_flops(head_dim, pairs, pairs, mode)


def case_dense_flops(case, mode: str) -> float:
    """dense_flops of a case's real problem: for a batch of sequences of several lengths, the sum
    over its sequences (the work a packed call does), not the padded batch."""
    return sum(dense_flops(1, case.heads, case.head_dim, q, k, case.causal, mode) for q, k in case.sequence_lengths)


def _to_numpy(array) -> np.ndarray:
    return array.cpu().numpy() if hasattr(array, "cpu") else np.asarray(array)


def _pad_false(visible, pad_m: int, pad_n: int):
    """visible with pad_m more rows and pad_n more keys, all False (no key there)."""
    *lead, rows, keys = visible.shape
    shape = (*lead, rows + pad_m, keys + pad_n)
    padded = visible.new_zeros(shape) if hasattr(visible, "new_zeros") else np.zeros(shape, dtype=bool)
    padded[..., :rows, :keys] = visible
    return padded


def tile_map(visible, block_m: int, block_n: int) -> np.ndarray:
    """(..., Sq, Sk) bool -> (..., ceil(Sq/block_m), ceil(Sk/block_n)) numpy bool: tiles with a visible key."""
    *lead, rows, keys = visible.shape
    pad_m, pad_n = -rows % block_m, -keys % block_n
    if pad_m or pad_n:
        visible = _pad_false(visible, pad_m, pad_n)
    tiles = visible.reshape(*lead, (rows + pad_m) // block_m, block_m, (keys + pad_n) // block_n, block_n)
    return _to_numpy(tiles.any(-1).any(-2))


def visited_pairs(visible, block: Tuple[int, int], batch: int, heads: int) -> Tuple[int, float]:
    """(pairs inside visited tiles, tile density) for a (B|1, Hm, Sq, Sk) visibility map.

    Hm is the mask's head count (1 or Hk): query head h reads mask head h // (H / Hm), so every
    mask head stands for H / Hm query heads, and a batch dim of 1 for all B. The density is
    visited tiles over all tiles of the grid (the causal upper triangle included).
    """
    block_m, block_n = block
    vis_batch, vis_heads, rows, keys = visible.shape
    tiles = tile_map(visible, block_m, block_n)
    row_counts = np.minimum(block_m, rows - block_m * np.arange(tiles.shape[-2]))
    key_counts = np.minimum(block_n, keys - block_n * np.arange(tiles.shape[-1]))
    per_map = (tiles * (row_counts[:, None] * key_counts[None, :]).astype(np.int64)).sum()
    scale = (batch // vis_batch) * (heads // vis_heads)
    density = float(tiles.mean()) if tiles.size else 0.0
    return int(per_map) * scale, density
