"""The torch custom ops behind flash_dmattn_func: flash_dmattn::forward and flash_dmattn::backward.

Each op has a real implementation (the compiled module, on the tensors' device), a fake one (shapes
and dtypes only, for torch.compile and meta tensors) and, for the forward, an autograd formula that
calls the backward op. torch.compile sees two opaque ops and traces through without a graph break.
Eager calls on plain tensors take `attention` instead: an autograd.Function around the same
implementations, which skips the custom-op dispatch (measured on a 2-core CPU, a decode-sized call's
host time with gradients: 352 us through the op, 137 us through the Function).

The real implementations launch on torch.cuda.current_stream(), take scratch memory from torch's
caching allocator and never synchronize, so they can be captured in a CUDA graph. They expect the
checked arguments that interface.flash_dmattn_func prepares, and pad head dims themselves: the
padding and the default scale (from the unpadded head dim) then stay out of traced graphs, where
a dynamic head dim would make them symbolic.

No `from __future__ import annotations` here: torch.library reads the annotations as types.
"""
import atexit
import collections
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from . import _C

_HEAD_DIM_MULTIPLE = 8

# The module reads the tensors themselves (_C.forward_args, _C.backward_args): it is told once
# which torch dtypes are which.
_C.register_dtypes({torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                    torch.bool: "bool", torch.int32: "int32", torch.uint8: "uint8"})

# torch's own accessor of the current stream's handle (what torch.compile's generated code calls),
# about 1 us cheaper than torch.cuda.current_stream(index).cuda_stream, which builds a Stream.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _int32(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """t as the C++ API takes sequence offsets, lengths and block tables: int32, contiguous, on
    `device` (None stays None)."""
    return None if t is None else t.to(device=device, dtype=torch.int32).contiguous()


def _stream(t: torch.Tensor) -> int:
    """The current stream of t's device (0 for CPU tensors)."""
    if not t.is_cuda:
        return 0
    if not _C.cuda_compiled:
        raise RuntimeError(
            "flash_dmattn: this installation was built without the CUDA backends (no nvcc was found when it was "
            "installed, or FLASH_DMATTN_CUDA=OFF), so it runs CPU tensors only; reinstall with nvcc on PATH")
    index = t.get_device()
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def _rows_aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where the CUDA kernels' vector loads need one.

    They load q, k, v, out and dout rows as 16-byte vectors: the base address and every stride but
    the last must be whole vectors (8 elements), and the last dim contiguous. Views from reshapes,
    transposes and slices of whole heads already are; anything else is copied. The calls ask the
    args they built first (`args.rows_aligned`, read from views the module holds anyway) and come
    here only when that fails.
    """
    # (Read in the module: the same test in Python took about 3 us per tensor.)
    return t if _C.rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def _run(call, size_of, args, device: torch.device) -> None:
    """Runs one call with a workspace from torch's allocator (none where it needs none), on the current stream."""
    nbytes = size_of(args)
    if nbytes == 0:
        call(args, 0, 0)
        return
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=device)
    call(args, workspace.data_ptr(), nbytes)


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t with its last dim zero-padded to a multiple of 8, the kernels' head-dim granularity.

    Zeros add nothing to q.k, and the padded columns of v only make output columns that are cut
    off again; the default scale is taken from the unpadded head dim.
    """
    pad = -t.size(-1) % _HEAD_DIM_MULTIPLE
    return F.pad(t, (0, pad)) if pad else t


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized contiguous tensor of t's shape, dtype and device: torch.empty(t.shape, dtype=...,
    device=...) costs about 2 us more host time."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _unpadded(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The first head_dim columns, as a tensor of its own (the fake implementations promise contiguous outputs)."""
    return t if t.size(-1) == head_dim else t[..., :head_dim].contiguous()


def _prepared(storage: Optional[torch.Tensor], fingerprint: int, paths: int):
    """The module's PreparedMask over storage (None: no preparation). The op schemas carry the
    fingerprint as a signed 64-bit int, and the passes that take the gather path as `paths` (bit 0
    the forward, bit 1 the backward, bit 3 a backward whose query heads cannot pair; bit 2: the
    storage also holds the sm90a forward's lists)."""
    if storage is None:
        return None
    return _C.PreparedMask(storage.data_ptr(), storage.numel(), fingerprint % 2**64, paths)


def _forward_args(q, k, v, out, lse, mask, bias, scale, causal, softcap, prepared=None, indices=None):
    """The module's ForwardArgs of padded, aligned q, k, v (and out, lse)."""
    return _C.forward_args(q, k, v, out, lse, mask, indices, bias, scale, causal, softcap, _stream(q), prepared)


def _shape_of_padded(t: torch.Tensor) -> torch.Tensor:
    """A tensor of t's shape with the head dim padded as _padded pads it, dtype and device: one
    row of memory read through zero strides."""
    width = t.size(-1) + (-t.size(-1) % _HEAD_DIM_MULTIPLE)
    return torch.empty(width, dtype=t.dtype, device=t.device).expand(*t.shape[:-1], width)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            causal: bool, what: str = "full") -> Tuple[torch.Tensor, int, int]:
    """(storage, fingerprint, paths): mask prepared for the calls of these q, k, v and causal flag
    (attention.h PreparedMask), built on the current stream into a uint8 tensor from torch's
    allocator (empty where the backend builds nothing, as on the CPU). what: the
    MaskPreparation, "full" (which may wait for the GPU to choose the paths), "tile_summary" (the
    summary alone: every call on the tile path, no wait), "deferred_choice" or
    "deferred_choice_with_lists" (the choice made later: _PendingChoice)."""
    storage, prepared, _ = _prepare(q, k, v, mask, causal, what)
    return storage, _signed(prepared.fingerprint), prepared.paths


def _prepare(q, k, v, mask, causal, what):
    """(storage, the module's PreparedMask, the ForwardArgs it was prepared for)."""
    batch, seqlen_q, heads, _ = q.shape
    # Only shapes, dtypes and devices are read: q, k and v as views of one padded row each (no
    # copy), out and lse as the forward's (validated, never written; from the caching allocator).
    q, k, v = (_shape_of_padded(t) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    args = _forward_args(q, k, v, out, lse, mask, None, None, causal, 0.0)
    storage = torch.empty(_C.prepared_mask_size(args, what), dtype=torch.uint8, device=q.device)
    prepared = _C.PreparedMask(storage.data_ptr(), storage.numel())
    _C.prepare_mask(args, prepared, what)
    return storage, prepared, args


def _signed(fingerprint: int) -> int:
    """The fingerprint as the op schemas' signed 64-bit int."""
    return fingerprint - 2**64 if fingerprint >= 2**63 else fingerprint


_CHOICE_PENDING = 16  # the paths bit of PreparedMask::choice_pending
_BACKWARD_PATHS = 2 | 8  # gather_backward, gather_backward_unpaired


class _PendingChoice:
    """A training forward's preparation whose choice of paths is made later
    (MaskPreparation::deferred_choice): its key lists' sizes are copied to pinned host memory
    behind it on the stream, and an event marks their arrival. Its backward chooses from them if
    they have arrived, and otherwise as the latest call of the same shapes whose sizes did
    (_CHOSEN), where that chose the gather path and this preparation holds every list
    (deferred_choice_with_lists, which such calls make); it never waits. Where the host runs
    ahead of the GPU, as it does in a GPU-bound training step, a backward is queued before its
    forward has run, and the sizes of the calls of one step arrive in time for the next step's
    calls (_AWAITED, read at each forward)."""

    __slots__ = ("key", "args", "with_lists", "memory", "fingerprint", "pending_paths", "sizes", "arrived", "chosen")

    def __init__(self, key, storage: torch.Tensor, prepared, args, with_lists: bool):
        self.key, self.args, self.with_lists = key, args, with_lists
        # (The choice reads the memory's address and size only: the storage may be gone by then.)
        self.memory = (storage.data_ptr(), storage.numel())
        self.fingerprint, self.pending_paths = prepared.fingerprint, prepared.paths
        offset, size = _C.prepared_list_sizes(args, prepared)
        self.sizes = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.sizes.copy_(storage[offset:offset + size], non_blocking=True)
        self.arrived = torch.cuda.Event()
        self.arrived.record()
        self.chosen = None
        while _AWAITED and _AWAITED[0].choose() is not None:
            _AWAITED.popleft()
        _AWAITED.append(self)

    def choose(self) -> Optional[int]:
        """The paths chosen from the sizes, once they have arrived (remembered for the key)."""
        if self.chosen is None and self.arrived.query():
            prepared = _C.PreparedMask(*self.memory, self.fingerprint, self.pending_paths)
            _C.choose_mask_paths(self.args, prepared, self.sizes.data_ptr(), self.sizes.numel())
            self.chosen = _CHOSEN[self.key] = prepared.paths
        return self.chosen

    def paths(self, paths: int) -> int:
        """The backward's paths: chosen from the sizes, else (every list held) the backward
        choice of the key's latest choice beside the pending one, else pending (the tile path)."""
        chosen = self.choose()
        if chosen is not None:
            return chosen
        return paths | (_CHOSEN.get(self.key, 0) & _BACKWARD_PATHS) if self.with_lists else paths


# The paths last chosen for a key of shapes (torch_ops.attention), and the preparations whose
# sizes have not been read yet, oldest first (a bounded number: the oldest are dropped unread).
# Emptied at exit, before the module's objects they hold are torn down (nanobind reports those
# still alive then as leaks).
_CHOSEN = {}
_AWAITED = collections.deque(maxlen=256)
atexit.register(lambda: _AWAITED.clear())


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
            bias: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool, softcap: float,
            deterministic: bool, prepared: Optional[torch.Tensor] = None, prepared_fingerprint: int = 0,
            prepared_paths: int = 0,
             indices: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    # `deterministic` only reaches the backward: setup_context sees the forward's inputs alone.
    batch, seqlen_q, heads, head_dim = q.shape
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    if head_dim % _HEAD_DIM_MULTIPLE:  # (q, k and v share the head dim)
        q, k, v = _padded(q), _padded(k), _padded(v)
    out = _empty_like(q)  # (contiguous: its rows are aligned whatever q's are)
    # (The sizes as separate arguments: torch parses them faster than a tuple, by about 0.7 us.)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float32, device=q.device)
    prepared_mask = _prepared(prepared, prepared_fingerprint, prepared_paths)
    args = _forward_args(q, k, v, out, lse, mask, bias, scale, causal, softcap, prepared_mask, indices)
    if q.is_cuda and not args.rows_aligned:  # (rare: views whose rows are not whole 16-byte vectors)
        q, k, v = _rows_aligned(q), _rows_aligned(k), _rows_aligned(v)
        args = _forward_args(q, k, v, out, lse, mask, bias, scale, causal, softcap, prepared_mask, indices)
    _run(_C.forward, _C.forward_workspace_size, args, q.device)
    return _unpadded(out, head_dim), lse


forward = torch.library.custom_op("flash_dmattn::forward", _forward, mutates_args=())


@forward.register_fake
def _(q, k, v, mask, bias, softmax_scale, causal, softcap, deterministic, prepared=None, prepared_fingerprint=0,
      prepared_paths=0, indices=None):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, softmax_scale: Optional[float],
             causal: bool, softcap: float, deterministic: bool, prepared: Optional[torch.Tensor],
             prepared_fingerprint: int, prepared_paths: int, bias_grad: bool,
             indices: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias); dbias is empty unless bias_grad (a custom op cannot return None)."""
    head_dim = q.size(-1)
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    # Autograd hands over gradients of any layout (a sum's gradient is an all-zero-stride expand).
    dout = dout.contiguous()
    if head_dim % _HEAD_DIM_MULTIPLE:  # (every one of them has q's head dim)
        dout, q, k, v, out = _padded(dout), _padded(q), _padded(k), _padded(v), _padded(out)
    dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)  # (contiguous: aligned rows)
    dbias = _empty_like(bias) if bias_grad else q.new_empty(0)
    prepared_mask = _prepared(prepared, prepared_fingerprint, prepared_paths)
    stream = _stream(q)

    def arguments():
        return _C.backward_args(q, k, v, out, lse, dout, dq, dk, dv, mask, indices, bias, dbias if bias_grad else None,
                                scale, causal, softcap, deterministic, stream, prepared_mask)

    args = arguments()
    if q.is_cuda and not args.rows_aligned:  # (rare: views whose rows are not whole 16-byte vectors)
        dout, q, k, v, out = (_rows_aligned(t) for t in (dout, q, k, v, out))
        args = arguments()
    _run(_C.backward, _C.backward_workspace_size, args, q.device)
    return _unpadded(dq, head_dim), _unpadded(dk, head_dim), _unpadded(dv, head_dim), dbias


backward = torch.library.custom_op("flash_dmattn::backward", _backward_impl, mutates_args=())


@backward.register_fake
def _(dout, q, k, v, mask, bias, out, lse, softmax_scale, causal, softcap, deterministic, prepared,
      prepared_fingerprint, prepared_paths, bias_grad, indices=None):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, softmax_scale, causal, softcap, deterministic, prepared, fingerprint, paths, indices = inputs
    out, lse = output
    # Saved whichever inputs require grad: a call where only the bias does needs them all too. The
    # prepared mask goes to the backward, which then builds neither summary nor lists.
    ctx.save_for_backward(q, k, v, mask, bias, out, lse, prepared, indices)
    ctx.options = (softmax_scale, causal, softcap, deterministic)
    # The preparation was made for the mask at this address; a saved-tensor hook that moves it
    # (save_on_cpu, activation offloading) makes the backward build its own. (Traced graphs,
    # whose tensors have no address, keep theirs.)
    eager = prepared is not None and type(mask) is torch.Tensor
    ctx.prepared = (fingerprint, paths, mask.data_ptr() if eager else None)
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, run_backward, pending=None):
    q, k, v, mask, bias, out, lse, prepared, indices = ctx.saved_tensors
    needs = ctx.needs_input_grad
    bias_grad = bias is not None and needs[4]
    fingerprint, paths, mask_address = ctx.prepared
    if mask_address is not None and mask.data_ptr() != mask_address:
        prepared, fingerprint, paths = None, 0, 0
    elif pending is not None:
        paths = pending.paths(paths)
    dq, dk, dv, dbias = run_backward(dout, q, k, v, mask, bias, out, lse, *ctx.options, prepared, fingerprint, paths,
                                     bias_grad, indices)
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None,
            dbias if bias_grad else None, None, None, None, None, None, None, None, None)


def _backward(ctx, dout, _dlse):
    return _gradients(ctx, dout, backward)


forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The forward op's autograd without the custom-op dispatch (the same implementations)."""

    @staticmethod
    def forward(ctx, *inputs_and_pending):
        """The forward op's inputs, then the _PendingChoice of the preparation among them, or None."""
        *inputs, ctx.pending = inputs_and_pending
        output = _forward(*inputs)
        _setup_context(ctx, inputs, output)
        # lse has no gradient: without this, autograd would allocate and fill a zero one on every
        # backward. (torch's profiler put that fill at hundreds of microseconds of host time on an
        # H200; timed directly, the backward's host time did not measurably fall.)
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # out took no part in the loss (lse is not differentiable)
            return (None,) * len(ctx.needs_input_grad)
        return (*_gradients(ctx, dout, _backward_impl, ctx.pending), None)


def _plain_eager(tensors) -> bool:
    """Whether a call may skip the custom op: outside torch.compile, with plain tensors (no fake or
    other subclasses), and no dispatch mode or torch.func transform active, which the op serves."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            return False
    try:
        return torch._C._len_torch_dispatch_stack() == 0 and not torch._C._are_functorch_transforms_active()
    except AttributeError:  # a torch without these hooks: the op serves every case
        return False


def attention(q, k, v, mask, bias, softmax_scale, causal, softcap, deterministic, prepared=None, indices=None):
    """(out, lse) with autograd: the forward op, or in plain eager calls the same without its dispatch,
    and without autograd's bookkeeping where no gradient can be asked for (inference, decode).

    prepared: (storage, fingerprint, paths) of prepare() for this call's mask, or None. An eager
    call on CUDA that will need a backward prepares a mask with a row per query itself, so that
    the forward's summary serves the backward too, which then does not read the mask again. With
    the summary come the key lists, and the backward takes the gather path where they hold few
    enough keys (as prepare_mask chooses), from their sizes copied back behind the forward, or
    where those have not arrived yet, as the latest call of the same shapes chose (_PendingChoice:
    no wait; the forward makes its own choice on the device, from the same sizes).
    Without lists where no gather backward can follow (deterministic mode, the largest head
    dims, FLASH_DMATTN_SPARSE_PATH=tile); under FLASH_DMATTN_SPARSE_PATH=gather the summary and
    lists for both passes. The preparation stays until the backward runs (an eighth of the bool
    mask's bytes for the summary, about a fifth more for the lists), once per call: layers that
    share a mask share one with prepare_mask (the transformers integration does). Masks of under
    _HELD_SUMMARY_MASK_BYTES (and those shared by all queries) are summarized again in the
    backward, on the tile path: their summary pass is about a launch. A forward alone (no
    gradient wanted) prepares such a mask too, for the device's choice of its path, and drops the
    preparation when it returns."""
    prepared = (None, 0, 0) if prepared is None else prepared
    inputs = (q, k, v, mask, bias, softmax_scale, causal, softcap, deterministic, *prepared, indices)
    if not _plain_eager((q, k, v, mask, bias, prepared[0], indices)):
        return forward(*inputs)
    preparable = mask is not None and indices is None and mask.size(2) > 1 and prepared[0] is None and q.is_cuda
    sparse_path = os.environ.get("FLASH_DMATTN_SPARSE_PATH", "")
    if (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                     (bias is not None and bias.requires_grad))) or _forward_ad_active():
        pending = None
        if preparable:
            gather = sparse_path == "gather"
            if gather or _mask_bytes(mask) >= _HELD_SUMMARY_MASK_BYTES:
                key = (q.shape, k.shape, mask.shape, tuple(n == 0 for n in mask.stride()), mask.dtype, q.dtype,
                       causal, q.device)
                with_lists = bool(_CHOSEN.get(key, 0) & _BACKWARD_PATHS)
                what = ("full" if gather else "tile_summary" if deterministic else
                        "deferred_choice_with_lists" if with_lists else "deferred_choice")
                storage, held, held_args = _prepare(q, k, v, mask, causal, what)
                if held.paths & _CHOICE_PENDING:
                    pending = _PendingChoice(key, storage, held, held_args, with_lists)
                inputs = (*inputs[:9], storage, _signed(held.fingerprint), held.paths, indices)
        return _EagerAttention.apply(*inputs, pending)  # (it refuses dual tensors loudly: no jvp)
    if preparable and sparse_path in ("", "auto") and _mask_bytes(mask) >= _HELD_SUMMARY_MASK_BYTES:
        # No backward follows, but the forward alone chooses its path on the device as a training
        # forward does: a scattered top-k mask takes the gather path instead of the tile walk
        # (H200 gpu time, seed top-1024: 0.466 -> 0.140 ms; a mask of whole 64-key blocks, which
        # the tile path serves, 0.107 -> 0.111: the estimate, choice and launches). A forced path
        # needs no preparation: under "gather" the forward builds its lists itself.
        storage, held, _ = _prepare(q, k, v, mask, causal, "deferred_choice")
        inputs = (*inputs[:9], storage, _signed(held.fingerprint), held.paths, indices)
    return _forward(*inputs)


# The mask bytes (4 MiB) from which a training forward holds its tile summary for the backward.
# Below them the backward's summary pass lasts a few microseconds (about 3 TB/s on an H200, plus
# a launch), and holding it would add host work (a tensor allocated, two calls into the module)
# to calls whose host time may be what bounds them; that trade was not measured.
_HELD_SUMMARY_MASK_BYTES = 1 << 22


def _mask_bytes(mask: torch.Tensor) -> int:
    """Bytes the summary pass reads: the mask's elements, its broadcast (zero-stride) dims once."""
    count = 1
    for size, stride in zip(mask.shape, mask.stride()):
        if stride != 0:
            count *= size
    return count * mask.element_size()


def _forward_ad_active() -> bool:
    """Whether a forward-mode AD level is open: its dual tensors need not require grad, and the
    plain forward would drop their tangents silently."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0
