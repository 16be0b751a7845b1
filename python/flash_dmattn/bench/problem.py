"""The tensors of one case, made once and handed to every implementation: q, k, v (B, S, H|Hk, D),
the bias (B, Hk, 1, Sk), the bool mask, and the output gradient; and what the mask leaves
visible, for the FLOP counts and the check."""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..masks import create_mask
from ..reference import past_diagonal
from . import flops
from .suites import Case


@dataclass
class Problem:
    case: Case
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]   # bool (B, Hk, Sq, Sk); (B, Hk, 1, Sk) for one query row or per-sequence lengths
    bias: Optional[torch.Tensor]   # (B, Hk, 1, Sk)
    dout: torch.Tensor             # (B, Sq, H, D)

    @property
    def dtype_name(self) -> str:
        return str(self.q.dtype).replace("torch.", "")


def causal_keep(seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """(Sq, Sk) bool: key j is visible from row i iff j <= i + Sk - Sq (bottom-right aligned)."""
    return past_diagonal(seqlen_q, seqlen_k, device) <= 0


def front_padding(case: Case, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """For a case with lengths: each sequence's front padding (B,) and its own positions (B, Sk)
    bool, sequence b filling the last lengths[b] positions."""
    front = case.seqlen_k - torch.tensor(case.lengths, device=device)
    return front, torch.arange(case.seqlen_k, device=device)[None, :] >= front[:, None]


def build_mask(case: Case, bias: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """The case's mask, materialized per batch and KV head as a model's dynamic mask would be."""
    shape = (case.batch, case.kv_heads, case.seqlen_q, case.seqlen_k)
    if case.lengths:
        keep = front_padding(case, device)[1]  # each sequence's own keys
        return keep[:, None, None, :].expand(case.batch, case.kv_heads, 1, case.seqlen_k).contiguous()
    if case.mask == "none":
        return None
    if case.mask == "all_true":
        return torch.ones(shape, dtype=torch.bool, device=device)
    if case.mask == "window":
        past = past_diagonal(case.seqlen_q, case.seqlen_k, device)
        return ((past <= 0) & (past > -case.window)).expand(shape).contiguous()
    # Upstream's benchmarks: the causal mask goes into create_mask, so the top-k never picks a key
    # causality hides; min_dtype is the bias dtype's lowest value, as in upstream.
    causal = causal_keep(case.seqlen_q, case.seqlen_k, device)[None, None] if case.causal else None
    mask = create_mask(bias, causal, case.batch, case.seqlen_q, case.seqlen_k, case.window,
                       torch.finfo(bias.dtype).min, block_size=case.block or None, type="topk")
    if mask is None:  # a window that holds every key of a non-causal case
        return None
    # A window wider than the keys returns the causal mask itself, shared by every (b, h): expand
    # it so that every point of a window sweep moves the same mask bytes.
    full_shape = (case.batch, case.kv_heads, mask.shape[2], case.seqlen_k)
    return mask if tuple(mask.shape) == full_shape else mask.expand(full_shape).contiguous()


def make_problem(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Problem:
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    b, h, hk, sq, sk, d = (case.batch, case.heads, case.kv_heads, case.seqlen_q, case.seqlen_k, case.head_dim)
    q, k, v = randn(b, sq, h, d), randn(b, sk, hk, d), randn(b, sk, hk, d)
    bias = randn(b, hk, 1, sk) if case.bias else None
    mask = build_mask(case, bias, device)
    return Problem(case, q, k, v, mask, bias, randn(b, sq, h, d))


def visible(problem: Problem) -> torch.Tensor:
    """(B|1, Hk|1, Sq, Sk) bool: mask and causal limit together (all True without either)."""
    case = problem.case
    keep = (causal_keep(case.seqlen_q, case.seqlen_k, problem.q.device) if case.causal else
            torch.ones(case.seqlen_q, case.seqlen_k, dtype=torch.bool, device=problem.q.device))[None, None]
    return keep if problem.mask is None else problem.mask & keep


@dataclass
class Visibility:
    """What the FLOP counts and the check need of the visibility map, kept small."""
    rows: torch.Tensor                          # (B, Sq, H) bool: rows with at least one visible key
    pairs: Dict[Tuple[int, int], Tuple[int, float]]   # tile shape -> (visited pairs, tile density)


def visibility(problem: Problem, tiles) -> Visibility:
    """Reduces the visibility map once per case: to the visited pairs of each tile shape in tiles
    (counted for all B·H heads) and to the rows that see a key."""
    case = problem.case
    vis = visible(problem)
    pairs = {tile: flops.visited_pairs(vis, tile, case.batch, case.heads) for tile in set(tiles)}
    rows = vis.any(-1)                                                         # (B|1, Hm, Sq)
    rows = rows.repeat_interleave(case.heads // rows.shape[1], dim=1)          # query head h reads h // g
    rows = rows.expand(case.batch, case.heads, case.seqlen_q).transpose(1, 2)  # (B, Sq, H)
    return Visibility(rows, pairs)
