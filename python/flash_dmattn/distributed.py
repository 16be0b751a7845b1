"""Context parallelism: one attention over the ranks of a torch.distributed group, with mask and bias.

Every rank holds a shard of one long sequence: its queries, keys and values, and the rows of the
mask and bias that belong to its queries (with all of the sequence's keys as columns). K and V go
around the ring of ranks, one neighbour at a time, with NCCL (or gloo on CPU tensors) send/recv
overlapped with the attention of the block already there. Each block is an ordinary call of the
library's kernels (torch_ops.forward and torch_ops.backward, on the current stream), and the partial
outputs merge through their log-sum-exps. In the backward, dK and dV travel the ring with K and V
and arrive at the rank that owns them.

Sharding is zigzag: the sequence of S tokens is cut into 2W chunks of S / 2W tokens for W ranks,
and rank r holds chunks r and 2W - 1 - r, in that order. Under causal masking every rank then has
the same work: the keys of an earlier chunk are seen in full, a later chunk not at all, and its own
chunks causally. `zigzag_shard` cuts a full tensor into a rank's shard and `zigzag_unshard` puts the
shards back together. docs/python.md ("Context parallelism") describes the layouts and the memory
and communication per rank.
"""
import math

import torch
import torch.distributed as dist

from . import torch_ops
from .interface import (_autocast, _check_mask_bias_types, _check_operands, _checked_options, _kernel_operands,
                        _unpacked)


def zigzag_shard(x: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s shard of x along `dim`: chunks rank and 2W - 1 - rank of 2W equal chunks."""
    if x.size(dim) % (2 * world_size):
        raise ValueError(f"zigzag_shard: dim {dim} has {x.size(dim)} entries, not a multiple of 2 x "
                         f"{world_size} ranks")
    chunks = x.chunk(2 * world_size, dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim)


def zigzag_unshard(shard: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The full tensor from every rank's zigzag shard along `dim` (an all-gather of the group)."""
    world_size = dist.get_world_size(group)
    shards = [torch.empty_like(shard) for _ in range(world_size)]
    dist.all_gather(shards, shard.contiguous(), group=group)
    chunks = [None] * (2 * world_size)
    for rank, s in enumerate(shards):
        chunks[rank], chunks[2 * world_size - 1 - rank] = s.chunk(2, dim)
    return torch.cat(chunks, dim)


def _fail(error, argument: str, message: str):
    raise error(f"context_parallel_attention: argument '{argument}': {message}")


class _Ring:
    """Asynchronous exchange with the ring's neighbours: send to the next rank, receive from the previous."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world_size) if group else \
            (self.rank + 1) % self.world_size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world_size) if group else \
            (self.rank - 1) % self.world_size

    def start(self, tensors):
        """Sends `tensors` on and receives the previous rank's into new tensors of the same shapes.

        Returns (handle, received); wait(handle) before reading the received tensors or writing
        the sent ones.
        """
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(handle):
        for request in handle:
            request.wait()


class _Step:
    """The block of one ring step: which local query rows see which of the visiting keys, and how.

    With causal masking and zigzag shards, the keys of source rank `src` hold chunks src and
    2W - 1 - src: at the rank's own step the local tensors attend causally (their chunks are in
    sequence order); an earlier source's first chunk is seen in full by every local row and its
    second chunk by none; a later source is seen in full by the second local chunk alone.
    """

    def __init__(self, rank: int, src: int, world_size: int, chunk: int, causal: bool):
        self.causal = causal and src == rank
        self.rows = slice(None)  # local query rows
        self.keys = slice(None)  # positions in the visiting K and V
        self.columns = [src, 2 * world_size - 1 - src]  # chunks of the global key columns
        if causal and src < rank:
            self.keys = slice(0, chunk)
            self.columns = [src]
        elif causal and src > rank:
            self.rows = slice(chunk, 2 * chunk)


def _block_operand(t, step: _Step, chunk: int):
    """A mask's or bias's part for a step: its query rows (where it has a row per query) and the
    global key columns of the visiting chunks (where it has a column per key)."""
    if t is None:
        return None
    if t.size(2) > 1:
        t = t[:, :, step.rows]
    if t.size(3) > 1:
        parts = [t.narrow(3, c * chunk, chunk) for c in step.columns]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, 3)
    return t


def _add_block_operand(total, block, step: _Step, chunk: int) -> None:
    """Adds a block's dbias into the rows and columns of the full dbias it came from."""
    rows = total[:, :, step.rows] if total.size(2) > 1 else total
    if total.size(3) == 1:
        rows += block
        return
    for i, c in enumerate(step.columns):
        rows[..., c * chunk:(c + 1) * chunk] += block[..., i * chunk:(i + 1) * chunk]


def _merge(out, lse, block_out, block_lse, rows) -> None:
    """Folds a block's normalized output and LSE into the running ones (fp32, -inf for none) for
    the given query rows. A block's empty rows have LSE = +inf (docs/semantics.md §5): they add nothing."""
    block_lse = block_lse.float().masked_fill(torch.isposinf(block_lse), -math.inf)
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    safe = new.masked_fill(torch.isneginf(new), 0.0)
    keep = torch.exp(old - safe).transpose(1, 2).unsqueeze(-1)  # (B, rows, H, 1)
    add = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * keep + block_out.float() * add
    lse[:, :, rows] = new


def _ring_steps(ring: _Ring, chunk: int, causal: bool):
    """This rank's block at every ring step: step s holds the keys of rank - s."""
    return [_Step(ring.rank, (ring.rank - s) % ring.world_size, ring.world_size, chunk, causal)
            for s in range(ring.world_size)]


def _steps_with_keys(mask, steps, chunk: int):
    """Whether each step's block has a key its rows keep, from this rank's mask rows: a block with
    none is not computed (its K and V still travel on). One read of the device for all steps;
    every step counts as visible without a mask, and while torch.compile traces."""
    if mask is None or torch.compiler.is_compiling():
        return [True] * len(steps)
    return torch.stack([_block_operand(mask, step, chunk).any() for step in steps]).tolist()


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mask, bias, softmax_scale, causal, softcap, deterministic, group):
        ring = _Ring(group)
        chunk = q.size(1) // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.size(0), q.size(2), q.size(1)), -math.inf, dtype=torch.float32, device=q.device)
        kv = (k, v)
        steps = _ring_steps(ring, chunk, causal)
        computed = _steps_with_keys(mask, steps, chunk)
        for s, step in enumerate(steps):
            handle, incoming = ring.start(kv) if s + 1 < ring.world_size else (None, None)
            if computed[s]:
                block_out, block_lse = torch_ops.forward(
                    q[:, step.rows], kv[0][:, step.keys], kv[1][:, step.keys], _block_operand(mask, step, chunk),
                    _block_operand(bias, step, chunk), softmax_scale, step.causal, softcap, deterministic)
                _merge(out, lse, block_out, block_lse, step.rows)
            if handle is not None:
                _Ring.wait(handle)
                kv = tuple(incoming)
        lse = lse.masked_fill(torch.isneginf(lse), math.inf)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, bias, out, lse)
        ctx.options = (softmax_scale, softcap, deterministic, group)  # causal lives in the steps
        ctx.steps, ctx.computed = steps, computed
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if _capturing(dout):  # the backward's ring exchanges K, V and their gradients: as the forward
            raise RuntimeError(_CAPTURE_REFUSED)
        q, k, v, mask, bias, out, lse = ctx.saved_tensors
        softmax_scale, softcap, deterministic, group = ctx.options
        bias_grad = bias is not None and ctx.needs_input_grad[4]
        ring = _Ring(group)
        chunk = q.size(1) // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dbias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias_grad else None
        kv = (k, v)
        dkv = None  # the visiting K and V's gradients so far, from the ranks they visited before
        grad_handle = None
        for s, step in enumerate(ctx.steps):
            kv_handle, incoming = ring.start(kv) if s + 1 < ring.world_size else (None, None)
            if ctx.computed[s]:
                dq_block, dk_block, dv_block, dbias_block = torch_ops.backward(
                    dout[:, step.rows], q[:, step.rows], kv[0][:, step.keys], kv[1][:, step.keys],
                    _block_operand(mask, step, chunk), _block_operand(bias, step, chunk), out[:, step.rows],
                    lse[:, :, step.rows], softmax_scale, step.causal, softcap, deterministic, None, 0, 0,
                    bias_grad)
                dq[:, step.rows] += dq_block.float()
                if bias_grad:
                    _add_block_operand(dbias, dbias_block.float(), step, chunk)
            if grad_handle is None:
                dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
            else:
                _Ring.wait(grad_handle)
                dkv = received
            if ctx.computed[s]:
                dkv[0][:, step.keys] += dk_block.float()
                dkv[1][:, step.keys] += dv_block.float()
            # On to the rank that visits these keys next; after the last step that is their owner.
            if ring.world_size > 1:
                grad_handle, received = ring.start(dkv)
            if kv_handle is not None:
                _Ring.wait(kv_handle)
                kv = tuple(incoming)
        if grad_handle is not None:
            _Ring.wait(grad_handle)
            dkv = received
        dk, dv = dkv
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, dbias.to(bias.dtype) if bias_grad else None,
                None, None, None, None, None)


def _check(query, key, value, attn_mask, attn_bias, world_size: int) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            _fail(TypeError if not isinstance(t, torch.Tensor) else ValueError, name,
                  f"expected a 4-dim tensor (B, S_local, heads, D), got "
                  f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    batch, local, heads, head_dim = query.shape
    if local % 2:
        _fail(ValueError, "query", f"expected an even shard length (two zigzag chunks, dim 1), got {local}")
    if key.shape[:2] != (batch, local) or key.shape[3] != head_dim or value.shape != key.shape:
        _fail(ValueError, "key", f"expected key and value of shape (B={batch}, S_local={local}, Hk, D={head_dim}) "
                                 f"(the same zigzag shard as query), got {tuple(key.shape)} and {tuple(value.shape)}")
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is None:
            continue
        if t.dim() != 4 or t.size(2) not in (1, local) or t.size(3) not in (1, local * world_size):
            _fail(ValueError, name, f"expected (B|1, H|Hk|1, S_local|1 = {local}, S|1 = {local * world_size}): the "
                                    f"rows of this rank's queries and the columns of every key, got "
                                    f"{tuple(t.shape)}")


_CAPTURE_REFUSED = ("context_parallel_attention: CUDA-graph capture is not supported: capturing the ring's NCCL "
                     "send/recv exchanges hung when tried; call it (and its backward) outside the captured region")


def _capturing(query) -> bool:
    """Whether a CUDA graph is being captured on the current stream. Tried on 2 H200s (NCCL),
    capturing the forward ring's batch_isend_irecv exchanges hung (docs/python.md): such a call
    is refused rather than left to hang."""
    if not (isinstance(query, torch.Tensor) and query.is_cuda):
        return False
    with torch.cuda.device(query.device):
        return torch.cuda.is_current_stream_capturing()


def context_parallel_attention(query, key, value, attn_mask=None, attn_bias=None, softmax_scale=None,
                               is_causal=False, softcap=None, deterministic=False, group=None,
                               return_lse=False):
    """flash_dmattn_func over a sequence sharded across the ranks of `group` (default: the world).

    Args:
        query, key, value: this rank's zigzag shards (`zigzag_shard` along dim 1) of (B, S, H, D)
            and (B, S, Hk, D): (B, S_local, H, D) and (B, S_local, Hk, D) with S_local = S / W,
            even. One sequence for queries and keys (self-attention).
        attn_mask: optional bool (B|1, H|Hk|1, S_local|1, S|1): the rows of this rank's queries
            (zigzag-sharded along dim 2 like query, or 1 for all) and the columns of all S keys in
            sequence order (or 1). Nothing of it travels.
        attn_bias: optional bias of the same layout. Its gradient comes back in its shape: a row
            per query is this rank's rows, complete; a bias with query dim 1 (shared by every
            query) gets the sum over this rank's queries only, so sum it over the group where the
            full gradient is wanted (a data- and context-parallel all-reduce of gradients does).
        softmax_scale, softcap, deterministic: as in flash_dmattn_func.
        is_causal: causal in sequence order (zigzag shards keep every rank's work equal).
        group: the torch.distributed process group of the ring.
        return_lse: also return this rank's (B, H, S_local) float32 log-sum-exp.

    Returns:
        out (B, S_local, H, D), this rank's rows, or (out, lse).
    """
    if _capturing(query):
        raise RuntimeError(_CAPTURE_REFUSED)
    world_size = dist.get_world_size(group)
    if isinstance(query, torch.Tensor) and query.dim() == 4:  # (each step reads a block of the keys' columns)
        attn_mask = _unpacked(_fail, "attn_mask", attn_mask, query.size(1) * world_size)
    _check(query, key, value, attn_mask, attn_bias, world_size)
    query, key, value, attn_bias = _autocast(query, key, value, attn_bias)
    # Dtypes, devices and head counts as flash_dmattn_func checks them; mask and bias shapes differ
    # here (every key's column) and were checked above.
    _check_operands(query, key, value, None, None, None)
    _check_mask_bias_types(query, attn_mask, attn_bias)
    # K and V are sent as they are: the ring's transfers need them contiguous.
    key, value = key.contiguous(), value.contiguous()
    softmax_scale, softcap = _checked_options(softmax_scale, softcap)
    attn_mask, attn_bias = _kernel_operands(attn_mask, attn_bias)
    out, lse = _RingAttention.apply(query, key, value, attn_mask, attn_bias, softmax_scale, bool(is_causal), softcap,
                                    bool(deterministic), group)
    return (out, lse) if return_lse else out
