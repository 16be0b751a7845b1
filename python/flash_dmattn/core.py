"""The torch-free layer: the compiled module's calls on numpy arrays.

numpy arrays live on the CPU, so these calls run the fp64 CPU reference backend; they serve tests
and callers without torch. Shapes, dtypes and the math are those of docs/semantics.md: q is
(B, Sq, H, D), k and v (B, Sk, Hk, D), float16 (or ml_dtypes' bfloat16); the mask is bool and the
bias q's dtype or float32, each (B|1, H|Hk|1, Sq|1, Sk|1). Every argument is checked by the
library itself, so a bad one raises ValueError with the library's message.
"""
from typing import Optional, Tuple

import numpy as np

from . import _C

# numpy names the dtypes as the library does; ml_dtypes' bfloat16 reports the name "bfloat16".
# float64 passes here so that the library explains why it refuses it.
_DTYPE_NAMES = {"float16", "bfloat16", "float32", "float64", "bool"}


def version() -> str:
    return _C.version()


def available_backends() -> list:
    """Backends compiled in that can run on this machine now, best first (e.g. ['cuda_sm80', 'cpu_reference'])."""
    return _C.available_backends()


def cuda_compiled() -> bool:
    """Whether this build contains the CUDA backends (it does not when nvcc was missing at install time)."""
    return bool(_C.cuda_compiled)


def numpy_view(name: str, array: np.ndarray):
    """A view of a numpy array for the compiled module; the array must outlive the call."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"flash_dmattn: argument '{name}': expected a numpy.ndarray, got {type(array).__name__}")
    dtype = array.dtype.name
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"flash_dmattn: argument '{name}': expected dtype float16, bfloat16, float32 or bool, "
                        f"got {dtype}")
    itemsize = array.dtype.itemsize
    if any(s % itemsize for s in array.strides):
        raise ValueError(f"flash_dmattn: argument '{name}': expected strides in whole elements, "
                         f"got {array.strides} bytes")
    strides = [s // itemsize for s in array.strides]
    return _C.View(array.__array_interface__["data"][0], dtype, array.shape, strides, "cpu", 0)


def _optional_view(name: str, array: Optional[np.ndarray]):
    return None if array is None else numpy_view(name, array)


def _options(softmax_scale, causal, softcap) -> dict:
    """The options as the module's strict argument types want them (a bool, not a 1)."""
    return dict(softmax_scale=None if softmax_scale is None else float(softmax_scale), causal=bool(causal),
                softcap=float(softcap))


def _workspace(nbytes: int) -> Tuple[np.ndarray, int]:
    """A host buffer with nbytes at the alignment the library asks for: (buffer, aligned address)."""
    align = _C.workspace_alignment
    buffer = np.empty(nbytes + align, dtype=np.uint8)
    address = buffer.__array_interface__["data"][0]
    return buffer, address + (-address) % align


def forward(q, k, v, mask=None, bias=None, softmax_scale=None, causal=False, softcap=0.0, backend="automatic"):
    """Attention on numpy arrays. Returns (out (B, Sq, H, D) in q's dtype, lse (B, H, Sq) float32)."""
    q_view = numpy_view("q", q)
    out = np.empty(q.shape, dtype=q.dtype)
    # A q of another rank gets an empty lse; the library then reports q's rank.
    lse = np.empty((q.shape[0], q.shape[2], q.shape[1]) if q.ndim == 4 else (0, 0, 0), dtype=np.float32)
    args = _C.ForwardArgs(q_view, numpy_view("k", k), numpy_view("v", v), numpy_view("out", out),
                          numpy_view("lse", lse), mask=_optional_view("mask", mask),
                          bias=_optional_view("bias", bias), backend=backend,
                          **_options(softmax_scale, causal, softcap))
    nbytes = _C.forward_workspace_size(args)
    buffer, address = _workspace(nbytes)  # `buffer` keeps the workspace alive through the call
    _C.forward(args, address, nbytes)
    return out, lse


def backward(dout, q, k, v, out, lse, mask=None, bias=None, softmax_scale=None, causal=False, softcap=0.0,
             deterministic=False, bias_grad=True, backend="automatic"):
    """Gradients of attention on numpy arrays, given the forward's out and lse.

    Returns (dq, dk, dv, dbias); dbias has the bias's shape and dtype, and is None without a bias
    or with bias_grad=False.
    """
    inputs = [numpy_view(name, a) for name, a in
              (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", dout))]
    bias_view = _optional_view("bias", bias)
    dq, dk, dv = (np.empty(a.shape, dtype=a.dtype) for a in (q, k, v))
    dbias = np.empty(bias.shape, dtype=bias.dtype) if bias is not None and bias_grad else None
    args = _C.BackwardArgs(*inputs, numpy_view("dq", dq), numpy_view("dk", dk), numpy_view("dv", dv),
                           mask=_optional_view("mask", mask), bias=bias_view, dbias=_optional_view("dbias", dbias),
                           deterministic=bool(deterministic), backend=backend,
                           **_options(softmax_scale, causal, softcap))
    nbytes = _C.backward_workspace_size(args)
    buffer, address = _workspace(nbytes)  # `buffer` keeps the workspace alive through the call
    _C.backward(args, address, nbytes)
    return dq, dk, dv, dbias
