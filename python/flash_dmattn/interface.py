"""flash_dmattn_func: upstream's call, on torch tensors.

What happens here, before the custom op (torch_ops.py) runs:
  1. autocast: under torch.autocast, q, k and v (float32 ones too) run in the autocast dtype;
  2. checks: every argument is checked on shapes, dtypes and devices alone, so a bad call raises
     TypeError or ValueError before any launch, also while torch.compile traces;
  3. broadcasting: a mask dimension of stride 0 (an expand() view) becomes a size-1 dimension,
     which the kernels read through a zero stride: nothing is materialized;
  4. key indices (attn_indices) go to the kernels as int32 lists where the backend reads them
     (_indices_read_directly); otherwise they become the bool mask they stand for (one scatter),
     ANDed with attn_mask when both are given.
Autograd, torch.compile and CUDA graphs then see the custom op, which pads head dims that are not
a multiple of 8 and cuts the results back. docs/python.md has the details.
"""
import math
import os

import torch

from . import masks, torch_ops

_MAX_HEAD_DIM = 256


def _fail(error, argument: str, message: str):
    raise error(f"flash_dmattn_func: argument '{argument}': {message}")


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def _check_tensor(argument: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, argument, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(ValueError, argument, f"expected {ndim} dims {layout}, got shape {_shape(t)}")


def _check_broadcast(argument: str, t: torch.Tensor, batch: int, heads: int, kv_heads: int, seqlen_q: int,
                     seqlen_k: int, dims: int = 4, layout: str = "(B|1, H|Hk|1, Sq|1, Sk|1)") -> None:
    """Each dim of a mask or bias is 1 or full; heads are 1, Hk or H (docs/semantics.md §2). Key
    lists check their first three dims so (dims=3): the last one is the list."""
    allowed = ((1, batch), (1, kv_heads, heads), (1, seqlen_q), (1, seqlen_k))
    for d, size in enumerate(t.shape[:dims]):
        if size not in allowed[d]:
            names = ("batch", "heads", "query", "key")
            _fail(ValueError, argument, f"expected {names[d]} size (dim {d}) in {sorted(set(allowed[d]))}, got {size} "
                                        f"in shape {_shape(t)} (layout {layout})")


def _packed(mask) -> bool:
    """Whether a mask is bit-packed, 8 keys a byte (pack_mask): its dtype is uint8."""
    return mask.dtype == torch.uint8


def _unpacked(fail, argument: str, mask, seqlen_k: int):
    """A bit-packed mask as the bool mask it packs, for the calls that shift, slice or AND it with
    masks of their own (varlen, KV cache, context parallelism); any other mask as it is."""
    if not isinstance(mask, torch.Tensor) or not _packed(mask):
        return mask
    if mask.dim() != 4 or mask.size(3) != (seqlen_k + 7) // 8:
        fail(ValueError, argument, f"expected a bit-packed mask (uint8) of key size (dim 3) ceil({seqlen_k} / 8) = "
                                   f"{(seqlen_k + 7) // 8}, got shape {_shape(mask)}")
    return masks.unpack_mask(mask, seqlen_k)


def _check_types(query, key, value, attn_mask, attn_bias, attn_indices, attn_indices_bias=None) -> None:
    _check_tensor("query", query, 4, "(B, Sq, H, D)")
    _check_tensor("key", key, 4, "(B, Sk, Hk, D)")
    _check_tensor("value", value, 4, "(B, Sk, Hk, D)")
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None:
            _check_tensor(name, t, 4, "(B|1, H|Hk|1, Sq|1, Sk|1)")
    if attn_indices is not None:
        _check_tensor("attn_indices", attn_indices, 4, "(B|1, H|Hk|1, Sq|1, K)")
    if attn_indices_bias is not None:
        _check_tensor("attn_indices_bias", attn_indices_bias, 4, "(B|1, H|Hk|1, Sq|1, K), aligned with attn_indices")


def _check_operands(query, key, value, attn_mask, attn_bias, attn_indices) -> None:
    """Dtypes, devices and shapes, after autocast."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        _fail(TypeError, "query", f"expected dtype float16 or bfloat16 (or float32 under torch.autocast), got "
                                  f"{query.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            _fail(TypeError, name, f"expected the dtype of query ({query.dtype}), got {t.dtype}")
    for name, t in (("key", key), ("value", value)):
        _check_device(name, t, query)
    _check_mask_bias_types(query, attn_mask, attn_bias)
    if attn_indices is not None:
        _check_device("attn_indices", attn_indices, query)
    batch, seqlen_q, heads, head_dim = query.shape
    key_batch, seqlen_k, kv_heads, key_head_dim = key.shape
    if not 0 < head_dim <= _MAX_HEAD_DIM:
        _fail(ValueError, "query", f"expected a head dim (dim 3) in [1, {_MAX_HEAD_DIM}], got {head_dim}")
    if key_batch != batch or key_head_dim != head_dim:
        _fail(ValueError, "key", f"expected shape (B={batch}, Sk, Hk, D={head_dim}), got {_shape(key)}")
    if heads == 0 or kv_heads == 0 or heads % kv_heads != 0:
        _fail(ValueError, "key", f"expected a head count Hk (dim 2) >= 1 that divides the H={heads} of query, "
                                 f"got {kv_heads}")
    if value.shape != key.shape:
        _fail(ValueError, "value", f"expected the shape of key {_shape(key)}, got {_shape(value)}")
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None:
            _check_broadcast(name, t, batch, heads, kv_heads, seqlen_q, seqlen_k, dims=3 if _packed(t) else 4)
    if attn_mask is not None and _packed(attn_mask) and attn_mask.shape[3] != (seqlen_k + 7) // 8:
        _fail(ValueError, "attn_mask", f"expected a bit-packed key size (dim 3) of ceil(Sk / 8) = {(seqlen_k + 7) // 8} "
                                       f"(Sk={seqlen_k}), got {attn_mask.shape[3]} in shape {_shape(attn_mask)} "
                                       "(a uint8 mask holds 8 keys a byte, pack_mask; its key dim never broadcasts)")


def _check_device(argument: str, t: torch.Tensor, query) -> None:
    if t.device != query.device:
        _fail(ValueError, argument, f"expected the device of query ({query.device}), got {t.device}")


def _check_bias_dtype(argument: str, t: torch.Tensor, query) -> None:
    if t.dtype not in (query.dtype, torch.float32):
        _fail(TypeError, argument, f"expected the dtype of query ({query.dtype}) or torch.float32, got {t.dtype}")


def _check_mask_bias_types(query, attn_mask, attn_bias) -> None:
    """Devices and dtypes of mask and bias (their shapes depend on the call)."""
    for name, t in (("attn_mask", attn_mask), ("attn_bias", attn_bias)):
        if t is not None:
            _check_device(name, t, query)
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.uint8):
        _fail(TypeError, "attn_mask", f"expected dtype torch.bool (True keeps a key) or torch.uint8 (bit-packed, "
                                      f"pack_mask), got {attn_mask.dtype}")
    if attn_bias is not None:
        _check_bias_dtype("attn_bias", attn_bias, query)


def _check_indices(attn_indices, query, key, check_values: bool) -> None:
    """Shape and dtype of attn_indices (its device is checked with the others); its values where
    asked for (check_indices) and reading them is allowed (eager)."""
    if attn_indices.dtype not in (torch.int32, torch.int64):
        _fail(TypeError, "attn_indices", f"expected dtype torch.int32 or torch.int64, got {attn_indices.dtype}")
    batch, seqlen_q, heads, _ = query.shape
    seqlen_k, kv_heads = key.shape[1], key.shape[2]
    # The last dim is the list of keys (any length), not a key dim: check the other three as a mask's.
    _check_broadcast("attn_indices", attn_indices, batch, heads, kv_heads, seqlen_q, seqlen_k, dims=3,
                     layout="(B|1, H|Hk|1, Sq|1, K)")
    # Reading the values synchronizes with the GPU: not while torch.compile traces (checked first:
    # dynamo cannot fold the capture query) or a CUDA graph is captured, where out-of-range entries
    # are ignored as the docstring says.
    if (check_values and attn_indices.numel() and not torch.compiler.is_compiling() and
            not (attn_indices.is_cuda and torch.cuda.is_current_stream_capturing())):
        bad = (attn_indices < -1) | (attn_indices >= seqlen_k)
        if bool(bad.any()):
            first = tuple(int(i) for i in bad.nonzero()[0])
            _fail(ValueError, "attn_indices", f"expected key indices in [0, {seqlen_k}) or -1 (padding), got "
                                              f"{int(attn_indices[first])} at {first}")


def _listed_columns(attn_indices: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The column each list entry writes to: its key, or Sk (one past the keys, cut off after) for
    padding (-1) and any out-of-range entry, so that nothing is written out of bounds even where
    the values were not checked."""
    idx = attn_indices.long()
    return torch.where((idx >= 0) & (idx < seqlen_k), idx, seqlen_k)


def _indices_mask(columns: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The bool mask (.., Sq|1, Sk) of key lists (as _listed_columns): key j is kept in a row that
    lists it (once or more)."""
    # Rows of a multiple of 16 bytes: the CUDA summary reads aligned rows as 16-byte vectors.
    width = (seqlen_k + 1 + 15) // 16 * 16
    mask = torch.zeros(*columns.shape[:-1], width, dtype=torch.bool, device=columns.device)
    return mask.scatter_(-1, columns, True)[..., :seqlen_k]


# Up to which share of the keys (list length K over Sk) lists go to the CUDA gather path as they
# are: where the gather path measured faster than the tile path (src/cuda/sparse_path.h,
# kGatherForwardShare and kGatherDecodeShare). K only bounds a query tile's union from below: rows
# that choose their keys independently can make it much larger.
_DIRECT_SHARE, _DIRECT_DECODE_SHARE = 0.5, 0.25


def _indices_read_directly(query, key, attn_mask, attn_indices, deterministic: bool) -> bool:
    """Whether key lists go to the kernels as lists, rather than as the bool mask they stand for:
    the CPU reference reads them everywhere; the CUDA backend on its gather path, without a mask
    beside them, with a list per query row (or one query), outside deterministic mode, up to head
    dim 128, at most 2^31 - 1 rows, unless FLASH_DMATTN_SPARSE_PATH=tile, and where the lists are
    short enough for the gather path to pay (docs/semantics.md §2). Decided from shapes alone, once
    per forward: the backward follows the forward's choice."""
    if attn_mask is not None:
        return False
    if not query.is_cuda:
        return True
    batch, seqlen_q, heads, head_dim = query.shape
    share = _DIRECT_DECODE_SHARE if seqlen_q == 1 else _DIRECT_SHARE
    return (not deterministic and head_dim <= 128 and (attn_indices.size(2) > 1 or seqlen_q == 1) and
            batch * heads * seqlen_q < 2**31 and attn_indices.size(3) <= share * key.size(1) and
            os.environ.get("FLASH_DMATTN_SPARSE_PATH") != "tile")


def _check_indexed_bias(attn_indices_bias, attn_indices, query) -> None:
    """attn_indices_bias: one bias value per listed key, laid out as attn_indices."""
    if attn_indices is None:
        _fail(ValueError, "attn_indices_bias", "expected attn_indices beside it (its values follow their lists)")
    _check_device("attn_indices_bias", attn_indices_bias, query)
    _check_bias_dtype("attn_indices_bias", attn_indices_bias, query)
    try:
        torch.broadcast_shapes(attn_indices_bias.shape[:-1], attn_indices.shape[:-1])
    except RuntimeError:
        broadcasts = False
    else:
        broadcasts = True
    if not broadcasts or attn_indices_bias.shape[-1] != attn_indices.shape[-1]:
        _fail(ValueError, "attn_indices_bias", f"expected a list length (dim 3) of {attn_indices.shape[-1]} like "
                                               f"attn_indices {_shape(attn_indices)}, and first dims that broadcast "
                                               f"with its, got {_shape(attn_indices_bias)}")


def _same_heads(a: torch.Tensor, b: torch.Tensor, group: int):
    """a and b with head dims that broadcast: where one has a head per query head and the other
    one per KV head, the KV head's entries serve its group of query heads."""
    if 1 != a.shape[1] != b.shape[1] != 1:
        if a.shape[1] < b.shape[1]:
            a = a.repeat_interleave(group, dim=1)
        else:
            b = b.repeat_interleave(group, dim=1)
    return a, b


def _indexed_bias(attn_indices_bias: torch.Tensor, columns: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """The bias (.., Sk) that per-key values of key lists (as _listed_columns) stand for: each
    listed key gets its value (a key listed twice, the sum of its values), every other key 0.
    Autograd returns the gradient of each listed entry (0 for padding) in attn_indices_bias's shape."""
    shape = torch.broadcast_shapes(attn_indices_bias.shape, columns.shape)
    idx = columns.expand(shape)
    dense = attn_indices_bias.new_zeros(*shape[:-1], seqlen_k + 1)
    return dense.scatter_add(-1, idx, attn_indices_bias.expand(shape))[..., :seqlen_k]


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _plainly_valid(query, key, value, attn_mask, attn_bias) -> bool:
    """Whether a call without key lists passes every check of _check_types and _check_operands,
    decided in one pass over the arguments (a decode's host time is counted in microseconds, and
    the checks' function calls took about 8 of them). Only a True is trusted: a False, or a call
    under autocast, runs the checks themselves, which raise with the argument named."""
    tensor = torch.Tensor
    if not (isinstance(query, tensor) and isinstance(key, tensor) and isinstance(value, tensor)):
        return False
    dtype, device = query.dtype, query.device
    shape, key_shape = query.shape, key.shape
    if (dtype not in _HALF_DTYPES or key.dtype != dtype or value.dtype != dtype or len(shape) != 4 or
            len(key_shape) != 4 or value.shape != key_shape or key.device != device or value.device != device):
        return False
    batch, seqlen_q, heads, head_dim = shape
    key_batch, seqlen_k, kv_heads, key_head_dim = key_shape
    if (key_batch != batch or key_head_dim != head_dim or not 0 < head_dim <= _MAX_HEAD_DIM or heads == 0 or
            kv_heads == 0 or heads % kv_heads != 0):
        return False
    mask_keys = (1, seqlen_k)
    if attn_mask is not None and isinstance(attn_mask, tensor) and attn_mask.dtype == torch.uint8:
        mask_keys = ((seqlen_k + 7) // 8,)  # bit-packed: never broadcast
    for t, keys in ((attn_mask, mask_keys), (attn_bias, (1, seqlen_k))):
        if t is not None:
            if not isinstance(t, tensor) or t.device != device:
                return False
            sizes = t.shape
            if (len(sizes) != 4 or sizes[0] not in (1, batch) or sizes[1] not in (1, kv_heads, heads) or
                    sizes[2] not in (1, seqlen_q) or sizes[3] not in keys):
                return False
    return ((attn_mask is None or attn_mask.dtype == torch.bool or attn_mask.dtype == torch.uint8) and
            (attn_bias is None or attn_bias.dtype == dtype or attn_bias.dtype == torch.float32))


def _checked_options(softmax_scale, softcap):
    """(softmax_scale, softcap) as floats, checked: a scale of None stays None (1/sqrt(D) later),
    a softcap of None is 0 (off)."""
    softmax_scale = None if softmax_scale is None else float(softmax_scale)
    softcap = 0.0 if softcap is None else float(softcap)
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        _fail(ValueError, "softmax_scale", f"expected a finite value > 0, got {softmax_scale}")
    if not (math.isfinite(softcap) and softcap >= 0):
        _fail(ValueError, "softcap", f"expected a finite value >= 0 (0 turns it off), got {softcap}")
    return softmax_scale, softcap


def _autocast(query, key, value, *biases):
    """Under torch.autocast, q, k and v run in the autocast dtype, as a matmul would.

    A float32 bias (attn_bias, attn_indices_bias) stays as it is (the kernels read it at full
    precision); a bias of another dtype follows q. Autograd returns each gradient in its tensor's
    own dtype. Returns (query, key, value, *biases).
    """
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return (query, key, value, *biases)
    dtype = torch.get_autocast_dtype(device_type)
    query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
    return (query, key, value, *(b.to(dtype) if b is not None and b.dtype not in (dtype, torch.float32) else b
                                 for b in biases))


def _compact_broadcast(t: torch.Tensor) -> torch.Tensor:
    """Turns each zero-stride dim of size > 1 (an expand() view) into a size-1 view of it.

    The kernels read a size-1 dim through stride 0, so nothing is copied and a smaller tensor is
    read; the key dim then also meets the library's rule that the last dim be contiguous.
    """
    strides = t.stride()
    if 0 not in strides:  # the common case, answered without a loop over the dims
        return t
    dims = t.dim() - 1 if t.dtype == torch.uint8 else t.dim()  # (a bit-packed mask's keys never broadcast)
    for d, (size, stride) in enumerate(zip(t.shape[:dims], strides)):
        if size > 1 and stride == 0:
            t = t.narrow(d, 0, 1)
    return t


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.size(-1) == 1 else t.contiguous()


def _kernel_operands(attn_mask, attn_bias):
    """Mask and bias as the kernels read them: broadcast dims as size-1 views, keys contiguous."""
    if attn_mask is not None:
        attn_mask = _last_dim_contiguous(_compact_broadcast(attn_mask))
    if attn_bias is not None:
        # A bias that needs a gradient keeps its expanded shape: autograd wants a gradient of that
        # shape. Pass real size-1 dims to get the reduced dbias straight from the kernel.
        if not attn_bias.requires_grad:
            attn_bias = _compact_broadcast(attn_bias)
        attn_bias = _last_dim_contiguous(attn_bias)
    return attn_mask, attn_bias


class PreparedMask:
    """A mask (bool or bit-packed) prepared once (prepare_mask) for the calls that share it: every
    layer that reads the same mask, and each forward with its backward. Pass it as
    flash_dmattn_func's attn_mask.

    It holds the mask and what the CUDA kernels would otherwise build from it on every call: the
    tile summary and, for a mask with a row per query (unless FLASH_DMATTN_SPARSE_PATH=tile), the
    key lists of the gather path, whichever path the preparation then chose (`path`,
    `backward_path`; their room is kept either way, about a fifth of the mask's bytes). The mask
    must not change while the preparation is in use: a change in place through torch (which bumps
    the tensor's version counter) is refused with ValueError; one that bypasses torch cannot be
    seen.
    A call with other shapes, another causal flag or another device is refused too.
    """

    def __init__(self, mask: torch.Tensor, storage: torch.Tensor, fingerprint: int, paths: int, causal: bool):
        self.mask, self.causal = mask, causal
        self._prepared = (storage, fingerprint, paths)
        self._version = mask._version

    @classmethod
    def of(cls, mask: torch.Tensor, prepared: tuple, causal: bool) -> "PreparedMask":
        """The PreparedMask of mask from the (storage, fingerprint, paths) of an earlier preparation
        of the same view of it (same memory, shape and strides; the library's fingerprint checks)."""
        return cls(_kernel_operands(mask, None)[0], *prepared, causal)

    @property
    def path(self) -> str:
        """The way its forwards go under FLASH_DMATTN_SPARSE_PATH=auto: "gather" where the
        preparation found the key lists small enough to pay (docs/architecture.md), else "tile"."""
        return "gather" if self._prepared[2] & 1 else "tile"

    @property
    def backward_path(self) -> str:
        """The same for its backwards, whose gather path pays up to more keys at some head dims
        (past head dim 128 and in deterministic mode the backward runs the tile path regardless).
        Where its kernel takes two query heads per CTA, it pays up to more keys still, and a bias
        with a head per query head keeps the heads apart: such calls follow `backward_path_unpaired`."""
        return "gather" if self._prepared[2] & 2 else "tile"

    @property
    def backward_path_unpaired(self) -> str:
        """The way of its backwards whose bias has a head per query head (or whose mask does)."""
        return "gather" if self._prepared[2] & 8 else "tile"

    @property
    def nbytes(self) -> int:
        """Device memory the preparation holds (beside the mask)."""
        return self._prepared[0].numel()

    def _for_call(self, is_causal: bool, attn_indices) -> tuple:
        """(mask, (storage, fingerprint, paths)) for a call, after the checks the Python side can make."""
        if attn_indices is not None:
            _fail(ValueError, "attn_mask", "expected a bool mask beside attn_indices, got a PreparedMask (the indices "
                                           "change the mask it was prepared from)")
        if is_causal != self.causal:
            _fail(ValueError, "is_causal", f"expected {self.causal}, the flag the PreparedMask was prepared with, "
                                           f"got {is_causal}")
        if not torch.compiler.is_compiling() and self.mask._version != self._version:
            _fail(ValueError, "attn_mask", "expected the mask as prepare_mask saw it, but it was modified in place "
                                           "since: call prepare_mask again")
        return self.mask, self._prepared


def prepare_mask(query, key, value, attn_mask, is_causal=None) -> PreparedMask:
    """Prepares attn_mask once for every flash_dmattn_func call with these shapes, device and
    causal flag, and for their backwards (see PreparedMask). Arguments as flash_dmattn_func's;
    only their shapes, dtypes and devices are read. Asynchronous on the current stream, but for
    one wait: on CUDA under FLASH_DMATTN_SPARSE_PATH=auto (the default), a mask with a row per
    query has its key lists built and their sizes read back to choose the path. During CUDA-graph
    capture it cannot wait and chooses the tile path; FLASH_DMATTN_SPARSE_PATH=gather or tile
    forces a path without waiting."""
    if attn_mask is None:
        _fail(ValueError, "attn_mask", "expected a mask to prepare (bool or bit-packed), got None")
    _check_types(query, key, value, attn_mask, None, None)
    query, key, value = _autocast(query, key, value)
    _check_operands(query, key, value, attn_mask, None, None)
    mask, _ = _kernel_operands(attn_mask, None)
    causal = bool(is_causal)
    return PreparedMask(mask, *torch_ops.prepare(query, key, value, mask, causal), causal)


def flash_dmattn_func(query, key, value, attn_mask=None, attn_bias=None, softmax_scale=None, is_causal=None,
                      softcap=None, deterministic=None, return_attn_probs=None, attn_indices=None,
                      attn_indices_bias=None, check_indices=True):
    """Attention with a dynamic boolean mask and an additive bias (docs/semantics.md).

    Args:
        query: (B, Sq, H, D), float16 or bfloat16 (float32 under torch.autocast).
        key, value: (B, Sk, Hk, D), query's dtype; Hk divides H (GQA/MQA).
        attn_mask: optional bool (B|1, H|Hk|1, Sq|1, Sk|1); True keeps a key. No gradient. Or the
            same packed 8 keys a byte (pack_mask): uint8 (B|1, H|Hk|1, Sq|1, ceil(Sk / 8)), 8x fewer
            bytes for the CUDA summary pass to read. Or a PreparedMask (prepare_mask) of either, for
            calls that share one mask.
        attn_bias: optional additive bias, same broadcast shapes, query's dtype or float32. Its
            gradient has the bias's own shape and dtype (summed over its size-1 dims).
        softmax_scale: default 1/sqrt(D) of the unpadded head dim.
        is_causal: default False; bottom-right aligned (key j is visible from row i iff
            j <= i + Sk - Sq).
        softcap: default 0 (off); logits become softcap * tanh(logits / softcap) before the bias.
        deterministic: default False; True makes the backward bitwise reproducible.
        return_attn_probs: default False; True returns (out, lse, None): lse is the (B, H, Sq)
            float32 log-sum-exp; the probabilities are never materialized, so the third is None.
        attn_indices: optional int32 or int64 (B|1, H|Hk|1, Sq|1, K): for every query row, the keys
            it may see (DeepSeek's sparse-attention form); -1 pads a row's list, a key listed twice
            counts once, and any other value outside [0, Sk) raises ValueError (checked eagerly,
            which on CUDA waits for the GPU once per call; under CUDA-graph capture or
            torch.compile such entries are ignored). It keeps exactly the keys of the bool mask it
            stands for, ANDed with attn_mask when both are given.
        attn_indices_bias: optional (B|1, H|Hk|1, Sq|1, K) beside attn_indices, query's dtype or
            float32: the bias of each listed key (DeepSeek-style compact scores), added to
            attn_bias where both are given; a key listed twice gets the sum of its values, padding
            entries are not read. Its gradient comes back in its own shape (0 at padding).
        check_indices: default True (None too); False skips reading attn_indices' values, so that a CUDA call
            does not wait for the GPU (decode): entries outside [0, Sk) then count as padding.

    Returns:
        out (B, Sq, H, D) in query's dtype, or the tuple above.
    """
    prepared = None
    if isinstance(attn_mask, PreparedMask):
        attn_mask, prepared = attn_mask._for_call(bool(is_causal), attn_indices)
    if (attn_indices is not None or attn_indices_bias is not None or
            not _plainly_valid(query, key, value, attn_mask, attn_bias) or
            torch.is_autocast_enabled("cuda" if query.is_cuda else query.device.type)):
        _check_types(query, key, value, attn_mask, attn_bias, attn_indices, attn_indices_bias)
        query, key, value, attn_bias, attn_indices_bias = _autocast(query, key, value, attn_bias, attn_indices_bias)
        _check_operands(query, key, value, attn_mask, attn_bias, attn_indices)
    if attn_indices is not None:
        _check_indices(attn_indices, query, key, check_indices is None or bool(check_indices))
    if attn_indices_bias is not None:
        _check_indexed_bias(attn_indices_bias, attn_indices, query)
    softmax_scale, softcap = _checked_options(softmax_scale, softcap)  # scale None: 1/sqrt(D) in the op

    indices = columns = None
    direct = attn_indices is not None and _indices_read_directly(query, key, attn_mask, attn_indices,
                                                                 bool(deterministic))
    if direct and query.is_cuda and attn_indices.dtype == torch.int32:
        # The CUDA kernels skip entries outside [0, Sk) themselves: no launches to convert them.
        indices = attn_indices.contiguous()  # (the kernels read the lists' last dim with stride 1)
    elif attn_indices is not None:
        columns = _listed_columns(attn_indices, key.shape[1])
    if direct and indices is None:  # (int64 values past 2^31 must not wrap into range)
        indices = torch.where(columns < key.shape[1], columns, -1).to(torch.int32).contiguous()
    elif attn_indices is not None and not direct:
        listed = _indices_mask(columns, key.shape[1])
        if attn_mask is not None and _packed(attn_mask):
            attn_mask = masks.unpack_mask(_compact_broadcast(attn_mask), key.shape[1])
        if attn_mask is not None:
            attn_mask = _compact_broadcast(attn_mask)
        if attn_mask is not None:
            attn_mask, listed = _same_heads(attn_mask, listed, query.shape[2] // key.shape[2])
        attn_mask = listed if attn_mask is None else attn_mask & listed
    if attn_indices_bias is not None:
        if columns is None:
            columns = _listed_columns(attn_indices, key.shape[1])
        listed_bias = _indexed_bias(attn_indices_bias, columns, key.shape[1])
        if attn_bias is not None:
            attn_bias, listed_bias = _same_heads(attn_bias, listed_bias, query.shape[2] // key.shape[2])
        attn_bias = listed_bias if attn_bias is None else attn_bias + listed_bias
    attn_mask, attn_bias = _kernel_operands(attn_mask, attn_bias)
    out, lse = torch_ops.attention(query, key, value, attn_mask, attn_bias, softmax_scale, bool(is_causal), softcap,
                                   bool(deterministic), prepared, indices)
    return (out, lse, None) if return_attn_probs else out
