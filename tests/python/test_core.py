"""The compiled module and flash_dmattn.core on numpy arrays: CI runs these (no torch, no GPU).

They check that views cross the binding intact (shapes, strides, zero strides, dtypes), that the
library's validation reaches Python as ValueError / NotImplementedError with its messages, and
that the CPU backend's forward and backward agree with an fp64 numpy implementation
(numpy_reference.py) up to one rounding of each output.
"""
import numpy as np
import pytest

import flash_dmattn
from flash_dmattn import _C, core
from numpy_reference import Attention

RNG = np.random.default_rng(0)


def randn(*shape, dtype=np.float16):
    return RNG.standard_normal(shape).astype(dtype)


def assert_rounded_close(actual, expected, name):
    """Within one rounding of the output dtype (plus a little for the fp64 sums' own error)."""
    eps = np.finfo(actual.dtype).eps
    expected = np.asarray(expected, dtype=np.float64)
    error = np.abs(actual.astype(np.float64) - expected)
    bound = eps * (np.abs(expected) + 1e-2)
    worst = np.unravel_index(np.argmax(error - bound), error.shape) if error.size else None
    assert (error <= bound).all(), f"{name}: error {error[worst]} > {bound[worst]} at {worst}"


def problem(batch=2, seqlen_q=5, seqlen_k=7, heads=4, kv_heads=2, head_dim=16):
    q = randn(batch, seqlen_q, heads, head_dim)
    k = randn(batch, seqlen_k, kv_heads, head_dim)
    v = randn(batch, seqlen_k, kv_heads, head_dim)
    return q, k, v


# ------------------------------------------------------------------------------------------------
# The module itself


def test_version_and_backends():
    assert flash_dmattn.version() == flash_dmattn.__version__ == "0.1.0"
    assert "cpu_reference" in flash_dmattn.available_backends()
    assert isinstance(flash_dmattn.cuda_compiled(), bool)


def test_view_round_trip():
    view = _C.View(1024, "bfloat16", (2, 3, 4, 8), (96, 0, 8, 1), "cuda", 1)
    assert (view.data, view.dtype, view.shape, view.strides, view.device) == \
        (1024, "bfloat16", (2, 3, 4, 8), (96, 0, 8, 1), "cuda:1")
    assert "shape=(2, 3, 4, 8)" in repr(view)


@pytest.mark.parametrize("args, message", [
    ((0, "int8", (1,), (1,)),
     "argument 'dtype': expected one of float16, bfloat16, float32, float64, bool, int32, uint8, got 'int8'"),
    ((0, "float16", (1, 2), (1,)),
     "arguments 'shape' and 'strides': expected the same length, at most 4, got 2 and 1"),
    ((0, "float16", (1,) * 5, (1,) * 5), "expected the same length, at most 4, got 5 and 5"),
    ((0, "float16", (1,), (1,), "tpu"), "argument 'device': expected 'cpu' or 'cuda', got 'tpu'"),
    ((0, "float16", (1,), (1,), "cuda", -1), "argument 'device_index': expected >= 0, got -1"),
])
def test_view_errors(args, message):
    with pytest.raises(ValueError) as error:
        _C.View(*args)
    assert message in str(error.value)


def test_capability_and_workspace_queries():
    q, k, v = problem()
    out, lse = np.empty_like(q), np.empty((2, 4, 5), np.float32)
    args = _C.ForwardArgs(*(core.numpy_view(n, a) for n, a in
                            (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))))
    assert _C.forward_workspace_size(args) == 0
    capability = _C.query_forward(args)
    assert capability["backend"] == "cpu_reference" and capability["arch"] == 0
    assert capability["description"].startswith("cpu_reference")


def test_unknown_backend_is_a_value_error():
    q, k, v = problem()
    with pytest.raises(ValueError, match="argument 'backend': expected one of automatic"):
        core.forward(q, k, v, backend="cuda_sm70")


def test_unsupported_call_is_not_implemented():
    """A valid call no backend runs: NotImplementedError (a RuntimeError) with every reason."""
    empty = _C.View(0, "float16", (0, 1, 1, 8), (8, 8, 8, 1), "cuda", 0)
    lse = _C.View(0, "float32", (0, 1, 1), (1, 1, 1), "cuda", 0)
    args = _C.ForwardArgs(empty, empty, empty, empty, lse, backend="cpu_reference")
    with pytest.raises(NotImplementedError, match="cpu_reference: runs on CPU tensors, got tensors on cuda:0"):
        _C.forward(args)
    assert issubclass(NotImplementedError, RuntimeError)


# ------------------------------------------------------------------------------------------------
# Validation: the library's messages, verbatim, as ValueError


def test_messages_name_the_argument_expected_and_actual():
    q, k, v = problem()
    cases = [
        (dict(q=q.astype(np.float32)),
         "flash_dmattn.forward: argument 'q': expected dtype float16 or bfloat16, got float32"),
        (dict(k=k.astype(np.float32)), "argument 'k': expected dtype float16 (the dtype of q), got float32"),
        (dict(k=k[:, :, :, :8].copy()),
         "argument 'k': expected shape (B=2, Sk, Hk, D=16) (B, Sk, Hk, D), got (2, 7, 2, 8)"),
        (dict(k=randn(2, 7, 3, 16), v=randn(2, 7, 3, 16)),
         "argument 'k': expected a head count (dim 2) that divides q's H=4, got Hk=3"),
        (dict(q=randn(2, 5, 4, 12), k=randn(2, 7, 2, 12), v=randn(2, 7, 2, 12)),
         "expected head dim (dim 3) a multiple of 8"),
        (dict(q=q[..., ::2]), "argument 'q': expected a contiguous last dimension (stride 1)"),
        (dict(q=q[::-1]), "argument 'q': expected non-negative strides"),
        (dict(q=q[0]), "argument 'q': expected rank 4 (B, Sq, H, D), got rank 3"),
        (dict(mask=np.ones((2, 1, 1, 7), np.float16)),
         "argument 'mask': expected dtype bool (True keeps a key; uint8: bit-packed), got float16"),
        (dict(mask=np.ones((2, 3, 1, 7), bool)), "argument 'mask': expected heads (dim 1) in {1, Hk=2, H=4}, got 3"),
        (dict(mask=np.ones((2, 1, 1, 6), bool)), "argument 'mask': expected key size (dim 3) 1 or 7, got 6"),
        (dict(bias=randn(1, 1, 5, 7, dtype=np.float64)),
         "argument 'bias': expected dtype float16 (the dtype of q) or float32, got float64"),
        (dict(bias=randn(3, 1, 1, 7)), "argument 'bias': expected batch size (dim 0) 1 or 2, got 3"),
        (dict(softmax_scale=0.0), "argument 'softmax_scale': expected a finite value > 0, got 0"),
        (dict(softcap=-1.0), "argument 'softcap': expected a finite value >= 0 (0 disables it), got -1"),
    ]
    for overrides, message in cases:
        call = dict(q=q, k=k, v=v)
        call.update(overrides)
        with pytest.raises(ValueError) as error:
            core.forward(**call)
        assert message in str(error.value), (overrides.keys(), str(error.value))


def test_python_side_type_errors():
    q, k, v = problem()
    with pytest.raises(TypeError, match="argument 'k': expected a numpy.ndarray, got list"):
        core.forward(q, [1.0], v)
    with pytest.raises(TypeError, match="argument 'mask': expected dtype float16, bfloat16, float32 or bool, got"):
        core.forward(q, k, v, mask=np.ones((1, 1, 1, 7), np.int64))


def test_outputs_must_not_alias_inputs():
    q, k, v = problem()
    views = [core.numpy_view(n, a) for n, a in (("q", q), ("k", k), ("v", v))]
    lse = np.empty((2, 4, 5), np.float32)
    args = _C.ForwardArgs(*views, views[0], core.numpy_view("lse", lse))  # out written over q
    with pytest.raises(ValueError, match="argument 'out': expected memory disjoint from input 'q'"):
        _C.forward(args)


def test_backward_rejects_dbias_without_bias():
    q, k, v = problem()
    out, lse = core.forward(q, k, v)
    named = [("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("dout", out.copy())]
    grads = [np.empty_like(a) for a in (q, k, v)]
    args = _C.BackwardArgs(*(core.numpy_view(n, a) for n, a in named),
                           *(core.numpy_view(n, a) for n, a in zip(("dq", "dk", "dv"), grads)),
                           dbias=core.numpy_view("dbias", np.empty((1, 1, 1, 7), np.float16)))
    with pytest.raises(ValueError, match="argument 'dbias': expected no dbias when no bias is given"):
        _C.backward(args)


# ------------------------------------------------------------------------------------------------
# Results against numpy float64

MASKS = [None, (2, 1, 1, 7), (1, 2, 5, 7), (2, 4, 5, 1), (1, 1, 1, 1)]
BIASES = [None, ((2, 2, 1, 7), np.float16), ((1, 1, 5, 7), np.float32), ((2, 4, 5, 7), np.float16),
          ((2, 4, 5, 1), np.float32)]


def random_mask(shape):
    return RNG.random(shape) < 0.7


@pytest.mark.parametrize("mask_shape", MASKS)
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("causal, softcap", [(False, 0.0), (True, 0.0), (False, 2.5), (True, 1.5)])
def test_forward_and_backward_match_numpy(mask_shape, bias, causal, softcap):
    q, k, v = problem()
    mask = None if mask_shape is None else random_mask(mask_shape)
    bias = None if bias is None else randn(*bias[0], dtype=bias[1])
    out, lse = core.forward(q, k, v, mask=mask, bias=bias, causal=causal, softcap=softcap)
    oracle = Attention(q, k, v, mask, bias, causal=causal, softcap=softcap)
    expected_out, expected_lse = oracle.forward()
    assert out.dtype == np.float16 and lse.dtype == np.float32
    assert_rounded_close(out, expected_out, "out")
    assert np.array_equal(np.isinf(lse), np.isinf(expected_lse))
    assert_rounded_close(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(expected_lse), 0, expected_lse), "lse")

    dout = randn(*q.shape)
    grads = core.backward(dout, q, k, v, out, lse, mask=mask, bias=bias, causal=causal, softcap=softcap)
    for name, actual, expected in zip(("dq", "dk", "dv", "dbias"), grads, oracle.backward(dout)):
        if expected is None:
            assert actual is None
            continue
        assert actual.shape == expected.shape and actual.dtype == (bias.dtype if name == "dbias" else q.dtype)
        assert_rounded_close(actual, expected, name)


def test_gqa_mqa_and_explicit_scale():
    q, k, v = problem(heads=8, kv_heads=1, head_dim=32)
    out, lse = core.forward(q, k, v, softmax_scale=0.3)
    expected_out, expected_lse = Attention(q, k, v, softmax_scale=0.3).forward()
    assert_rounded_close(out, expected_out, "out")
    assert_rounded_close(lse, expected_lse, "lse")


def test_zero_strides_read_in_place():
    """A numpy broadcast (stride 0 on size > 1) reads the same values as the compact array."""
    q, k, v = problem()
    mask = random_mask((2, 1, 1, 7))
    bias = randn(2, 2, 1, 7)
    wide_mask = np.broadcast_to(mask, (2, 4, 5, 7))
    wide_bias = np.broadcast_to(bias, (2, 2, 5, 7))
    assert wide_mask.strides[1] == wide_bias.strides[2] == 0
    compact = core.forward(q, k, v, mask=mask, bias=bias)
    wide = core.forward(q, k, v, mask=wide_mask, bias=wide_bias)
    for a, b in zip(compact, wide):
        assert np.array_equal(a, b)


def test_strided_inputs_give_the_same_bits():
    """q, k and v as slices of larger buffers (whole heads of a packed tensor)."""
    packed = randn(2, 5, 3, 4, 16)
    q = packed[:, :, 0]
    k, v = packed[:, :, 1, :2], packed[:, :, 2, 2:]
    q2, k2, v2 = (np.ascontiguousarray(a) for a in (q, k, v))
    assert not q.flags.c_contiguous
    for a, b in zip(core.forward(q, k, v, causal=True), core.forward(q2, k2, v2, causal=True)):
        assert np.array_equal(a, b)


def test_empty_rows_and_empty_keys():
    q, k, v = problem()
    mask = np.ones((2, 1, 5, 7), bool)
    mask[1, 0, 3] = False  # row 3 of batch 1 sees nothing
    out, lse = core.forward(q, k, v, mask=mask)
    assert (out[1, 3] == 0).all() and np.isinf(lse[1, :, 3]).all() and (lse[1, :, 3] > 0).all()
    dq, dk, dv, _ = core.backward(np.ones_like(out), q, k, v, out, lse, mask=mask)
    assert (dq[1, 3] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()

    out, lse = core.forward(q, k[:, :0], v[:, :0])
    assert (out == 0).all() and np.isposinf(lse).all()


def test_backward_is_deterministic():
    q, k, v = problem()
    bias = randn(1, 4, 5, 1)
    out, lse = core.forward(q, k, v, bias=bias, causal=True)
    dout = randn(*q.shape)
    first = core.backward(dout, q, k, v, out, lse, bias=bias, causal=True, deterministic=True)
    second = core.backward(dout, q, k, v, out, lse, bias=bias, causal=True, deterministic=True)
    for a, b in zip(first, second):
        assert np.array_equal(a, b)


def test_bias_grad_can_be_skipped():
    q, k, v = problem()
    bias = randn(2, 2, 1, 7)
    out, lse = core.forward(q, k, v, bias=bias)
    assert core.backward(out, q, k, v, out, lse, bias=bias, bias_grad=False)[3] is None


def _to_bfloat16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bfloat16_bits(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_bfloat16_views_through_the_module():
    """numpy has no bfloat16: uint16 buffers carry its bits, named "bfloat16" in the view."""
    shapes = {"q": (1, 4, 2, 8), "k": (1, 6, 2, 8), "v": (1, 6, 2, 8)}
    bits = {n: _to_bfloat16_bits(RNG.standard_normal(s)) for n, s in shapes.items()}
    out = np.empty(shapes["q"], np.uint16)
    lse = np.empty((1, 2, 4), np.float32)

    def view(array, dtype):
        return _C.View(array.__array_interface__["data"][0], dtype, array.shape,
                       [s // array.itemsize for s in array.strides])

    args = _C.ForwardArgs(*(view(bits[n], "bfloat16") for n in ("q", "k", "v")), view(out, "bfloat16"),
                          view(lse, "float32"), causal=True)
    _C.forward(args)
    expected_out, expected_lse = Attention(*(_from_bfloat16_bits(bits[n]) for n in ("q", "k", "v")),
                                           causal=True).forward()
    error = np.abs(_from_bfloat16_bits(out) - expected_out)
    assert (error <= 2.0 ** -8 * (np.abs(expected_out) + 1e-2)).all()
    assert_rounded_close(lse, expected_lse, "lse")
