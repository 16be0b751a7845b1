"""The implementations compared, one class each. Every one gets the same Problem and returns a
Runner: its inputs in its own layout (made before timing), the call, the per-mask preparation it
needs (timed apart as "prep"), and how to put its results back into our layout for the check.

- ours: flash_dmattn_func with the bool mask and the (B, Hk, 1, Sk) bias; the bias gradient
  comes from bias.requires_grad.
- ours_prepared: the same with the mask prepared once (prepare_mask: the tile summary and, where
  they may serve, the key lists, timed as prep, as FlexAttention's BlockMask is). The
  preparation chooses the tile or the gather path (FLASH_DMATTN_SPARSE_PATH=auto); the notes
  say which.
- ours_gather: ours_prepared with FLASH_DMATTN_SPARSE_PATH=gather set around each call: forward
  and backward over per-tile key lists (CUDA, masked cases; the backward keeps the tile path
  past head dim 128 and in deterministic mode).
- ours_tile: ours_prepared with FLASH_DMATTN_SPARSE_PATH=tile set around each call.
- ours_packed: ours with the mask bit-packed once outside the timing (pack_mask, 8 keys a byte).
- ours_varlen: flash_dmattn_varlen_func on a case's sequences of several lengths (serving suite)
  packed back to back; mask and bias in its per-sequence layout. ours takes the padded batch.
- ours_paged: flash_dmattn_with_kvcache on a paged copy of a decode case's cache (pages in a
  scrambled order, a block table, the lengths); ours takes the contiguous padded cache.
- sdpa_efficient: SDPA's memory-efficient backend with mask and bias folded into one float mask
  bias + where(mask, 0, -inf) of shape (B, H, Sq, Sk) (what a user without this library does).
  That float mask requires grad in the backward; its (B, H, Sq, Sk) gradient, reduced to
  (B, Hk, 1, Sk), is the bias gradient. The causal limit is part of the float mask.
- sdpa_cudnn, sdpa_flash: SDPA's cuDNN and FlashAttention-2 backends with no mask and no bias,
  causal through is_causal: dense ceilings, not the same function (checked against ours called
  without mask and bias).
- flex: FlexAttention, torch.compile'd, with a BlockMask built by create_block_mask (also
  compiled) from a mask_mod that indexes the mask tensor, and a score_mod that adds the bias
  (a captured tensor; it requires grad where the installed torch supports that).

GQA: SDPA backends get enable_gqa=True where they accept it, else K and V repeated per query
head by repeat_interleave inside the timed call (each row's notes say which); ours and
FlexAttention (enable_gqa) take the KV heads as they are.
"""
import contextlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from ..varlen import gather_positions
from .flops import gather_tiles, kernel_tiles
from .problem import Problem, causal_keep, front_padding
from .suites import Case

OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # a RuntimeError: catch it first


@dataclass
class Runner:
    names: Sequence[str]             # one per input: "q", "k", "v", "bias", "mask", "attn_mask"
    inputs: list                     # tensors (or None) in call order; those that require grad get gradients
    call: Callable                   # call(*inputs) -> output in the implementation's layout
    dout: torch.Tensor               # the output gradient in that layout
    canonical: Callable              # canonical(name, tensor) -> tensor in our layout ("out" or an input name)
    rebuild: Optional[Callable] = None   # the per-mask preparation (prep ms), or None
    notes: List[str] = field(default_factory=list)
    # Environment variables set while the harness runs this implementation (its forwards and
    # backwards alike) and restored after: settings the library reads on every call.
    environment: Dict[str, str] = field(default_factory=dict)
    # The tiles its passes visit where only its preparation knows them (the path it chose), as
    # Implementation.tiles gives them; None: the implementation's.
    tiles: Optional[Dict[str, tuple]] = None

    @contextlib.contextmanager
    def scope(self):
        previous = {name: os.environ.get(name) for name in self.environment}
        os.environ.update(self.environment)
        try:
            yield self
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def grad_inputs(self, inputs) -> list:
        return [(n, t) for n, t in zip(self.names, inputs) if isinstance(t, torch.Tensor) and t.requires_grad]

    def footprint(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs if isinstance(t, torch.Tensor))

    def copy_inputs(self) -> list:
        return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                for t in self.inputs]

    def results(self, grad: bool) -> dict:
        """{"out": ..., name: gradient ...} in our layout, for the check."""
        out = self.call(*self.inputs)
        results = {"out": self.canonical("out", out.detach())}
        if grad:
            pairs = self.grad_inputs(self.inputs)
            grads = torch.autograd.grad(out, [t for _, t in pairs], self.dout)
            # SDPA's float mask stands for the bias: its gradient, reduced by canonical, is dbias.
            results.update({("bias" if n == "attn_mask" else n): self.canonical(n, g)
                            for (n, _), g in zip(pairs, grads)})
        return results


def _leaf(t: Optional[torch.Tensor], grad: bool) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone().requires_grad_(grad)


def _heads_first(t: torch.Tensor, grad: bool) -> torch.Tensor:
    """(B, S, H, D) -> a contiguous (B, H, S, D) leaf: the layout SDPA and FlexAttention want."""
    return t.detach().transpose(1, 2).contiguous().requires_grad_(grad)


def _from_heads_first(name: str, t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2) if name in ("out", "q", "k", "v") else t


def first_line(error: BaseException) -> str:
    """'Type: the first line of the message', short enough for a table row."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


class Implementation:
    name = ""
    computes_case = True   # False: a dense ceiling, without the case's mask and bias
    # What it computes, for the visited-tile FLOPs: "tiles" (skips tiles without a visible key, at
    # the tile shapes of tiles()), "causal" (the causal limit's pairs: dense), or "all" (every
    # pair; the causal limit hidden in a float mask).
    visits = "causal"

    def tiles(self, head_dim: int) -> dict:
        """{"fwd": (block_m, block_n), "bwd": ...} where visits == "tiles" (a runner's own
        Runner.tiles, set by its preparation, takes precedence)."""
        return {}

    def tile_candidates(self, head_dim: int) -> list:
        """Every tile shape its runs may visit at, for the visibility count made before them."""
        return list(self.tiles(head_dim).values())

    def unavailable(self, device: torch.device) -> Optional[str]:
        """Why this implementation cannot run here at all, or None."""
        return None

    def unsupported(self, case: Case, device: torch.device) -> Optional[str]:
        """Why it cannot run this case, or None."""
        return None

    def backward_unsupported(self, device: torch.device) -> Optional[str]:
        return None

    def runner(self, problem: Problem, grad: bool) -> Runner:
        raise NotImplementedError


class Ours(Implementation):
    name = "ours"
    visits = "tiles"
    tiles = staticmethod(kernel_tiles)

    def __init__(self, use_mask: bool = True, use_bias: bool = True):
        # Without mask and bias: the reference that the dense ceilings are checked against.
        self.use_mask, self.use_bias = use_mask, use_bias

    def unavailable(self, device):
        from .. import core
        if device.type == "cuda" and not core.cuda_compiled():
            return "flash_dmattn was installed without the CUDA backends (no nvcc at install time)"
        return None

    def runner(self, problem, grad):
        from ..interface import flash_dmattn_func
        causal = problem.case.causal
        q, k, v = (_leaf(t, grad) for t in (problem.q, problem.k, problem.v))
        bias = _leaf(problem.bias, grad) if self.use_bias else None
        mask = problem.mask if self.use_mask else None

        def call(q, k, v, bias, mask):
            return flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=causal)

        return Runner(("q", "k", "v", "bias", "mask"), [q, k, v, bias, mask], call, problem.dout,
                      lambda name, t: t)


class OursPrepared(Ours):
    """ours with the mask prepared once (prepare_mask), as FlexAttention's BlockMask is built
    once: its time is the prep column, and the calls read it. Under FLASH_DMATTN_SPARSE_PATH=auto
    the preparation chooses the path (its notes say which)."""
    name = "ours_prepared"
    path = "auto"  # FLASH_DMATTN_SPARSE_PATH around each call

    def tile_candidates(self, head_dim):
        return list(kernel_tiles(head_dim).values()) + list(gather_tiles(head_dim).values())

    def unsupported(self, case, device):
        return "nothing to prepare without a mask" if case.mask == "none" else None

    def runner(self, problem, grad):
        from ..interface import flash_dmattn_func, prepare_mask
        runner = super().runner(problem, grad)
        runner.environment["FLASH_DMATTN_SPARSE_PATH"] = self.path
        causal = problem.case.causal
        # The rotating input copies hold the same mask, so every call reads the first's preparation.
        prepared = {}
        runner.notes.append("prepared mask")

        def rebuild():
            prepared["mask"] = prepare_mask(problem.q, problem.k, problem.v, problem.mask, is_causal=causal)
            mask = prepared["mask"]
            runner.notes[-1] = f"prepared mask, {mask.path} path" + \
                ("" if mask.backward_path == mask.path else f" (backward: {mask.backward_path})")
            chosen = {"gather": gather_tiles(problem.case.head_dim), "tile": kernel_tiles(problem.case.head_dim)}
            runner.tiles = {"fwd": chosen[mask.path]["fwd"], "bwd": chosen[mask.backward_path]["bwd"]}
            return prepared["mask"]

        def call(q, k, v, bias, mask):
            if "mask" not in prepared:
                rebuild()
            return flash_dmattn_func(q, k, v, attn_mask=prepared["mask"], attn_bias=bias, is_causal=causal)

        runner.call, runner.rebuild = call, rebuild
        return runner


class OursGather(OursPrepared):
    name = "ours_gather"
    path = "gather"
    tiles = staticmethod(gather_tiles)  # visits: the keys of each query tile's list

    def unavailable(self, device):
        if device.type != "cuda":
            return "the gather path is a CUDA path (the CPU backend has one way only)"
        return super().unavailable(device)

    def unsupported(self, case, device):
        return "the gather path needs a mask" if case.mask == "none" else None


class OursTile(OursPrepared):
    """ours_prepared held to the tile path (FLASH_DMATTN_SPARSE_PATH=tile): the other side of the
    crossover suite's comparison."""
    name = "ours_tile"
    path = "tile"


class OursIndices(Ours):
    """ours given the case's mask as key lists (attn_indices, int32, -1 padded to the longest row),
    built once outside the timing, as a user with top-k indices holds them. Without a mask beside
    them the lists go to the gather path as they are, on CUDA: docs/semantics.md §2. The lists are
    built here, so the calls skip the check of their values (check_indices=False: no GPU wait)."""
    name = "ours_indices"
    tiles = staticmethod(gather_tiles)

    def unsupported(self, case, device):
        return "key lists stand for a mask" if case.mask == "none" else None

    def runner(self, problem, grad):
        from ..interface import flash_dmattn_func
        runner = super().runner(problem, grad)
        causal = problem.case.causal
        mask = problem.mask
        if mask is None:
            raise NotImplementedError("no mask to turn into key lists (every key kept)")
        if mask.size(2) == 1 and problem.q.size(1) > 1:
            raise NotImplementedError("one list for every query row: the front scatters it back into the mask")
        width = max(1, int(mask.sum(-1, dtype=torch.int32).max()))
        rows = mask.numel() // max(1, mask.size(-1))
        if rows * width * 9 > 2**32:  # topk's values and int64 indices below, 9 bytes an entry
            raise NotImplementedError(f"key lists of {rows} rows of {width}: more memory than this bench spends")
        # Each row's kept keys (value 1) before the rest, in no particular order; -1 for the rest.
        values, order = torch.topk(mask.to(torch.int8), width, dim=-1)
        indices = torch.where(values > 0, order, -1).to(torch.int32)
        del values, order
        runner.notes.append(f"key lists of {width}, not checked per call")

        def call(q, k, v, bias, mask):
            return flash_dmattn_func(q, k, v, attn_indices=indices, attn_bias=bias, is_causal=causal,
                                     check_indices=False)

        runner.call = call
        return runner


class OursPacked(Ours):
    """ours with the mask bit-packed (pack_mask) once outside the timing, as a user who keeps masks
    packed holds it: each call's summary pass reads 8x fewer mask bytes."""
    name = "ours_packed"

    def unsupported(self, case, device):
        return "nothing to pack without a mask" if case.mask == "none" else None

    def runner(self, problem, grad):
        from ..masks import pack_mask
        runner = super().runner(problem, grad)
        mask = problem.mask
        if mask is None or mask.size(-1) != problem.k.size(1):
            raise NotImplementedError("a mask without a key dim stays bool (a packed mask's keys never broadcast)")
        runner.inputs[list(runner.names).index("mask")] = pack_mask(mask)
        runner.notes.append("bit-packed mask")
        return runner


class _Sequences:
    """A case with lengths in the padded layout of problem.py (sequence b in the last lengths[b]
    positions) and the per-sequence layout of the varlen and KV-cache calls (from position 0)."""

    def __init__(self, case: Case, device: torch.device):
        self.case, self.width = case, case.seqlen_k
        self.lengths = torch.tensor(case.lengths, device=device)
        self.front, self.real = front_padding(case, device)                              # (B,), (B, S)
        positions = torch.arange(self.width, device=device)[None, :]
        self.tokens = self.real.flatten().nonzero().squeeze(1)    # padded rows of the packed tokens, in order
        self.from_start = (positions + self.front[:, None]).clamp(max=self.width - 1)    # own position -> padded
        self.to_padded = (positions - self.front[:, None]).clamp(min=0)                  # padded -> own position

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """(B, S, h, D) -> (total, h, D)."""
        return t.reshape(-1, *t.shape[2:]).index_select(0, self.tokens)

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """(total, h, D) -> (B, S, h, D), zero in the padding."""
        flat = t.new_zeros(self.case.batch * self.width, *t.shape[1:]).index_copy(0, self.tokens, t)
        return flat.view(self.case.batch, self.width, *t.shape[1:])

    def keys_from_start(self, t: Optional[torch.Tensor], width: int) -> Optional[torch.Tensor]:
        """A (B, h, 1, S) mask or bias with each sequence's keys moved to positions 0..len-1, then
        padded (False or 0) to `width` keys."""
        if t is None:
            return None
        return F.pad(gather_positions(t, 3, self.from_start), (0, width - self.width))

    def keys_padded(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of keys_from_start (for a bias gradient): zero in the padding."""
        moved = gather_positions(t[..., :self.width], 3, self.to_padded)
        return moved.masked_fill(~self.real[:, None, None, :], 0)


class OursVarlen(Ours):
    name = "ours_varlen"

    def unsupported(self, case, device):
        return None if case.lengths and case.seqlen_q > 1 else "packs batches of several lengths (serving suite)"

    def runner(self, problem, grad):
        from ..varlen import flash_dmattn_varlen_func
        case = problem.case
        seqs = _Sequences(case, problem.q.device)
        offsets = torch.cat([seqs.lengths.new_zeros(1), seqs.lengths.cumsum(0)]).to(torch.int32)
        q, k, v = (seqs.pack(t).detach().requires_grad_(grad) for t in (problem.q, problem.k, problem.v))
        bias = _leaf(seqs.keys_from_start(problem.bias, seqs.width), grad)
        mask = seqs.keys_from_start(problem.mask, seqs.width)

        def call(q, k, v, bias, mask):
            return flash_dmattn_varlen_func(q, k, v, offsets, offsets, seqs.width, seqs.width, attn_mask=mask,
                                            attn_bias=bias, is_causal=case.causal)

        def canonical(name, t):
            return seqs.keys_padded(t) if name == "bias" else seqs.unpack(t)

        runner = Runner(("q", "k", "v", "bias", "mask"), [q, k, v, bias, mask], call, seqs.pack(problem.dout),
                        canonical)
        runner.notes.append(f"{len(case.lengths)} sequences packed, {int(seqs.lengths.sum())} tokens")
        return runner


class OursPaged(Ours):
    name = "ours_paged"

    def unsupported(self, case, device):
        return None if case.page else "reads a paged KV cache (serving suite's paged decode)"

    def runner(self, problem, grad):
        from ..kvcache import flash_dmattn_with_kvcache
        case, device = problem.case, problem.q.device
        seqs = _Sequences(case, device)
        page = case.page
        counts = [(n + page - 1) // page for n in case.lengths]
        max_pages = (seqs.width + page - 1) // page
        # Pages in a scrambled order, as a serving engine's allocator leaves them.
        order = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(0)).to(device)
        block_table = torch.zeros(case.batch, max_pages, dtype=torch.int32, device=device)
        caches = [torch.zeros(sum(counts), page, *problem.k.shape[2:], dtype=problem.k.dtype, device=device)
                  for _ in range(2)]
        start = 0
        for b, (n, length) in enumerate(zip(counts, case.lengths)):
            ids = order[start:start + n]
            start += n
            block_table[b, :n] = ids.to(torch.int32)
            for cache, t in zip(caches, (problem.k, problem.v)):
                own = F.pad(t[b, seqs.width - length:], (0, 0, 0, 0, 0, n * page - length))
                cache[ids] = own.view(n, page, *t.shape[2:])
        width = max_pages * page
        bias = seqs.keys_from_start(problem.bias, width)
        mask = seqs.keys_from_start(problem.mask, width)
        lengths = seqs.lengths.to(torch.int32)

        def call(q, k_cache, v_cache, bias, mask):
            # validate=False: the per-call check waits for the GPU, and a serving loop skips it.
            return flash_dmattn_with_kvcache(q, k_cache, v_cache, lengths, block_table=block_table, attn_mask=mask,
                                             attn_bias=bias, is_causal=case.causal, validate=False)

        runner = Runner(("q", "k_cache", "v_cache", "bias", "mask"), [problem.q, *caches, bias, mask], call,
                        problem.dout, lambda name, t: t)
        runner.notes.append(f"{sum(counts)} pages of {page} keys")
        return runner


class _Sdpa(Implementation):
    """SDPA pinned to one backend; GQA through enable_gqa where the backend takes it."""
    backend_name = ""

    def _backend(self):
        from torch.nn.attention import SDPBackend
        return getattr(SDPBackend, self.backend_name, None)

    def unavailable(self, device):
        try:
            from torch.nn.attention import sdpa_kernel  # noqa: F401  (torch >= 2.3)
        except ImportError:
            return "torch.nn.attention.sdpa_kernel is missing (torch < 2.3)"
        if self._backend() is None:
            return f"this torch has no SDPBackend.{self.backend_name}"
        return None

    def _gqa_call(self, problem: Problem, attention: Callable, inputs: list, grad: bool):
        """A call that handles GQA: enable_gqa where this backend accepts it (tried on the inputs,
        with the backward where one is timed), else repeat_interleave of K and V inside the call."""
        from torch.nn.attention import sdpa_kernel
        case = problem.case
        group = case.heads // case.kv_heads
        backend = self._backend() if problem.q.device.type == "cuda" else None

        def run(q, k, v, *rest, enable_gqa):
            if group > 1 and not enable_gqa:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            extra = {"enable_gqa": True} if group > 1 and enable_gqa else {}
            # On the CPU (harness tests) SDPA picks its own kernel: the CUDA backends do not exist there.
            if backend is None:
                return attention(q, k, v, *rest, **extra)
            with sdpa_kernel(backend):
                return attention(q, k, v, *rest, **extra)

        if group == 1:
            return (lambda *a: run(*a, enable_gqa=False)), "gqa: none (H = Hk)"
        try:
            with warnings.catch_warnings():  # SDPA warns about each backend it could not use
                warnings.simplefilter("ignore")
                out = run(*inputs, enable_gqa=True)
                if grad:
                    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                    torch.autograd.grad(out, leaves, torch.ones_like(out))
            return (lambda *a: run(*a, enable_gqa=True)), "gqa: enable_gqa"
        except OOM:
            raise
        except (RuntimeError, TypeError) as error:
            return (lambda *a: run(*a, enable_gqa=False)), f"gqa: repeat_interleave ({first_line(error)})"


class SdpaEfficient(_Sdpa):
    name = "sdpa_efficient"
    backend_name = "EFFICIENT_ATTENTION"
    visits = "all"

    def runner(self, problem, grad):
        case = problem.case
        q, k, v = (_heads_first(t, grad) for t in (problem.q, problem.k, problem.v))

        def fold():
            return fold_mask(problem)

        def attention(q, k, v, attn_mask, **options):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)

        attn_mask = fold()
        if attn_mask is not None:
            attn_mask.requires_grad_(grad and problem.bias is not None)
        call, gqa = self._gqa_call(problem, attention, [q, k, v, attn_mask], grad)
        group = case.heads // case.kv_heads

        def canonical(name, t):
            if name != "attn_mask":
                return _from_heads_first(name, t)
            # (B, H, Sq, Sk) -> the bias gradient (B, Hk, 1, Sk): summed over the group's query heads and rows.
            b, _, sq, sk = t.shape
            return t.float().view(b, case.kv_heads, group, sq, sk).sum(dim=(2, 3)).unsqueeze(2)

        return Runner(("q", "k", "v", "attn_mask"), [q, k, v, attn_mask], call,
                      problem.dout.transpose(1, 2).contiguous(), canonical, rebuild=fold, notes=[gqa])


def fold_mask(problem: Problem) -> Optional[torch.Tensor]:
    """bias + where(visible, 0, -inf) as one (B, H, Sq, Sk) float mask in q's dtype, causal limit
    included; None when there is neither mask nor bias nor causal limit."""
    case = problem.case
    if problem.mask is None and problem.bias is None and not case.causal:
        return None
    keep = problem.mask
    if case.causal:
        limit = causal_keep(case.seqlen_q, case.seqlen_k, problem.q.device)
        keep = limit if keep is None else keep & limit
    bias = problem.bias if problem.bias is not None else torch.zeros((), dtype=problem.q.dtype, device=problem.q.device)
    folded = bias if keep is None else torch.where(keep, bias, float("-inf"))       # (B|1, Hk|1, Sq|1, Sk)
    folded = folded.to(problem.q.dtype)
    while folded.dim() < 4:
        folded = folded[None]
    b, hk, sq, sk = folded.shape
    group = case.heads // hk  # hk is Hk or 1
    # Query head h reads KV head h // group: expand each KV head's map over its group, then copy
    # into the dense (B, H, Sq, Sk) layout SDPA reads.
    folded = folded[:, :, None].expand(b, hk, group, sq, sk).reshape(b, hk * group, sq, sk)
    return folded.expand(case.batch, case.heads, case.seqlen_q, case.seqlen_k).contiguous()


class _DenseCeiling(_Sdpa):
    """No mask, no bias: how fast dense attention of the same shape runs on this backend."""
    computes_case = False

    def unsupported(self, case, device):
        if case.causal and case.seqlen_q not in (1, case.seqlen_k):
            return "SDPA's is_causal is top-left aligned; the case's causal limit is bottom-right"
        return None

    def runner(self, problem, grad):
        case = problem.case
        # With one query row the bottom-right causal limit shows every key: not causal for SDPA.
        is_causal = case.causal and case.seqlen_q > 1
        q, k, v = (_heads_first(t, grad) for t in (problem.q, problem.k, problem.v))

        def attention(q, k, v, **options):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **options)

        call, gqa = self._gqa_call(problem, attention, [q, k, v], grad)
        return Runner(("q", "k", "v"), [q, k, v], call, problem.dout.transpose(1, 2).contiguous(),
                      _from_heads_first, notes=[gqa])


class SdpaCudnn(_DenseCeiling):
    name = "sdpa_cudnn"
    backend_name = "CUDNN_ATTENTION"

    def unavailable(self, device):
        if device.type == "cuda" and not torch.backends.cudnn.is_available():
            return "cuDNN is not available to torch"
        return super().unavailable(device)


class SdpaFlash(_DenseCeiling):
    name = "sdpa_flash"
    backend_name = "FLASH_ATTENTION"


class Flex(Implementation):
    name = "flex"
    visits = "tiles"
    BLOCK = (128, 128)  # create_block_mask's default BLOCK_SIZE, used below
    _compiled = {}  # one compiled flex_attention and create_block_mask per process

    def tiles(self, head_dim):
        return {"fwd": self.BLOCK, "bwd": self.BLOCK}

    def unavailable(self, device):
        try:
            from torch.nn.attention import flex_attention  # noqa: F401  (torch >= 2.5)
        except ImportError as error:
            return f"FlexAttention is missing ({first_line(error)})"
        return None

    def backward_unsupported(self, device):
        return "FlexAttention has no backward on the CPU" if device.type == "cpu" else None

    @classmethod
    def _functions(cls):
        if not cls._compiled:
            import torch._dynamo
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            # Every case compiles its own shapes; the default limit of 8 graphs would be reached
            # by a sweep, after which torch would run flex_attention uncompiled (and very slowly).
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, limit):
                    setattr(torch._dynamo.config, limit, 256)
                    break
            cls._compiled["attention"] = torch.compile(flex_attention, dynamic=False)
            cls._compiled["block_mask"] = torch.compile(create_block_mask, dynamic=False)
        return cls._compiled["attention"], cls._compiled["block_mask"]

    def runner(self, problem, grad):
        case = problem.case
        attention, block_mask_of = self._functions()
        # The mods capture plain values and tensors only: torch.compile guards on what they
        # capture, and the same code over new tensors of the same shapes must not recompile.
        group, offset, causal = case.heads // case.kv_heads, case.seqlen_k - case.seqlen_q, case.causal
        mask = problem.mask
        if mask is not None:  # size-1 dims as zero-stride views, so that one index expression serves all
            mask = mask.expand(case.batch, case.kv_heads, case.seqlen_q, case.seqlen_k)

        def mask_mod(b, h, q_idx, kv_idx):
            keep = kv_idx <= q_idx + offset if causal else kv_idx >= 0
            return keep if mask is None else keep & mask[b, h // group, q_idx, kv_idx]

        def rebuild():
            if mask is None and not causal:
                return None
            return block_mask_of(mask_mod, case.batch, case.heads, case.seqlen_q, case.seqlen_k,
                                 device=problem.q.device, BLOCK_SIZE=self.BLOCK)

        block_mask = rebuild()
        gqa = {"enable_gqa": True} if group > 1 else {}

        def adds(bias):
            """The score_mod adding bias; made per call, so that each input copy brings its own bias."""
            def score_mod(score, b, h, q_idx, kv_idx):
                return score + bias[b, h // group, 0, kv_idx]
            return score_mod

        def call(q, k, v, bias):
            score_mod = None if bias is None else adds(bias)
            return attention(q, k, v, score_mod=score_mod, block_mask=block_mask, **gqa)

        q, k, v = (_heads_first(t, grad) for t in (problem.q, problem.k, problem.v))
        bias = _leaf(problem.bias, grad)
        runner = Runner(("q", "k", "v", "bias"), [q, k, v, bias], call, problem.dout.transpose(1, 2).contiguous(),
                        _from_heads_first, rebuild=rebuild, notes=["gqa: enable_gqa" if group > 1 else "gqa: none"])
        if grad and bias is not None:
            # The gradient of a captured tensor: older torch versions refuse it; run once to find out.
            try:
                runner.results(grad=True)
            except OOM:
                raise
            except (RuntimeError, NotImplementedError, AssertionError) as error:
                runner.inputs[3] = bias.detach()
                runner.notes.append(f"dbias unsupported ({first_line(error)})")
        return runner


IMPLEMENTATIONS = {impl.name: impl for impl in (Ours(), OursPrepared(), OursGather(), OursTile(), OursIndices(), OursPacked(), OursVarlen(),
                                                OursPaged(), SdpaEfficient(), SdpaCudnn(), SdpaFlash(), Flex())}
