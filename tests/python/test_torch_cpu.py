"""flash_dmattn_func on CPU tensors (the fp64 CPU backend): argument checks, autograd, broadcasting,
head-dim padding, autocast, the custom ops' registrations and torch.compile tracing.

Needs torch, not a GPU; skipped where torch is missing (CI).
"""
import pytest

torch = pytest.importorskip("torch")

import flash_dmattn  # noqa: E402
from flash_dmattn import flash_dmattn_func, interface, torch_ops  # noqa: E402
from tolerance import assert_rounded  # noqa: E402
from torch_cases import make_case, run_flash, run_reference  # noqa: E402


def q_k_v(dtype=torch.float16, head_dim=16, **kwargs):
    case = make_case(2, 5, 7, 4, 2, head_dim, dtype=dtype, **kwargs)
    return case["q"], case["k"], case["v"]


# ------------------------------------------------------------------------------------------------
# Argument checks: TypeError / ValueError before any launch


@pytest.mark.parametrize("mutate, error, message", [
    (lambda a: a.update(query=[1.0]), TypeError, "argument 'query': expected a torch.Tensor, got list"),
    (lambda a: a.update(query=a["query"][0]), ValueError,
     "argument 'query': expected 4 dims (B, Sq, H, D), got shape (5, 4, 16)"),
    (lambda a: a.update(query=a["query"].float()), TypeError, "argument 'query': expected dtype float16 or bfloat16"),
    (lambda a: a.update(key=a["key"].bfloat16()), TypeError,
     "argument 'key': expected the dtype of query (torch.float16), got torch.bfloat16"),
    (lambda a: a.update(key=a["key"].to("meta")), ValueError,
     "argument 'key': expected the device of query (cpu), got meta"),
    (lambda a: a.update(key=a["key"][:, :, :, :8]), ValueError,
     "argument 'key': expected shape (B=2, Sk, Hk, D=16), got (2, 7, 2, 8)"),
    (lambda a: a.update(key=a["key"][:, :, :1].expand(2, 7, 3, 16), value=a["value"][:, :, :1].expand(2, 7, 3, 16)),
     ValueError, "argument 'key': expected a head count Hk (dim 2) >= 1 that divides the H=4 of query, got 3"),
    (lambda a: a.update(value=a["value"][:, :6]), ValueError,
     "argument 'value': expected the shape of key (2, 7, 2, 16), got (2, 6, 2, 16)"),
    (lambda a: a.update(attn_mask=torch.ones(2, 1, 1, 7)), TypeError,
     "argument 'attn_mask': expected dtype torch.bool (True keeps a key) or torch.uint8 (bit-packed, pack_mask), "
     "got torch.float32"),
    (lambda a: a.update(attn_mask=torch.ones(2, 1, 1, 7, dtype=torch.uint8)), ValueError,
     "argument 'attn_mask': expected a bit-packed key size (dim 3) of ceil(Sk / 8) = 1 (Sk=7), got 7"),
    (lambda a: a.update(attn_mask=torch.ones(2, 3, 1, 7, dtype=torch.bool)), ValueError,
     "argument 'attn_mask': expected heads size (dim 1) in [1, 2, 4], got 3"),
    (lambda a: a.update(attn_bias=torch.ones(2, 1, 1, 6, dtype=torch.float16)), ValueError,
     "argument 'attn_bias': expected key size (dim 3) in [1, 7], got 6"),
    (lambda a: a.update(attn_bias=torch.ones(1, 1, 7)), ValueError, "argument 'attn_bias': expected 4 dims"),
    (lambda a: a.update(attn_bias=torch.ones(1, 1, 1, 7, dtype=torch.float64)), TypeError,
     "argument 'attn_bias': expected the dtype of query (torch.float16) or torch.float32, got torch.float64"),
    (lambda a: a.update(softmax_scale=0.0), ValueError,
     "argument 'softmax_scale': expected a finite value > 0, got 0.0"),
    (lambda a: a.update(softcap=float("nan")), ValueError, "argument 'softcap': expected a finite value >= 0"),
])
def test_bad_arguments(mutate, error, message):
    q, k, v = q_k_v()
    call = dict(query=q, key=k, value=v)
    mutate(call)
    with pytest.raises(error) as raised:
        flash_dmattn_func(**call)
    assert message in str(raised.value)


def test_head_dim_limit():
    q, k, v = q_k_v(head_dim=264)
    with pytest.raises(ValueError, match=r"expected a head dim \(dim 3\) in \[1, 256\], got 264"):
        flash_dmattn_func(q, k, v)


# ------------------------------------------------------------------------------------------------
# Results and gradients against the float64 reference


BIAS_SHAPES = [(2, 2, 1, 7), (1, 1, 5, 7), (2, 4, 5, 1), (2, 1, 1, 1), (1, 4, 5, 7)]


@pytest.mark.parametrize("bias_shape", BIAS_SHAPES)
@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 7), (1, 2, 5, 7)])
@pytest.mark.parametrize("is_causal, softcap", [(False, 0.0), (True, 3.0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autograd_matches_reference(bias_shape, mask_shape, is_causal, softcap, dtype):
    case = make_case(2, 5, 7, 4, 2, 16, dtype=dtype, mask_shape=mask_shape, bias_shape=bias_shape)
    dout = torch.randn(case["q"].shape).to(dtype)
    out, lse, grads = run_flash(case, dout, is_causal=is_causal, softcap=softcap)
    ref_out, ref_lse, ref_grads = run_reference(case, dout, is_causal=is_causal, softcap=softcap)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 5)
    assert_rounded("out", out, ref_out)
    assert_rounded("lse", lse, ref_lse)
    for name in ("q", "k", "v", "bias"):
        assert grads[name].dtype == case[name].dtype
        assert_rounded(f"d{name}", grads[name], ref_grads[name])


def test_float32_bias_gets_a_float32_gradient():
    case = make_case(1, 6, 9, 4, 1, 32, dtype=torch.float16, bias_shape=(1, 1, 6, 9), bias_dtype=torch.float32)
    dout = torch.randn(case["q"].shape).half()
    _, _, grads = run_flash(case, dout)
    _, _, ref_grads = run_reference(case, dout)
    assert grads["bias"].dtype == torch.float32 and grads["bias"].shape == (1, 1, 6, 9)
    assert_rounded("dbias", grads["bias"], ref_grads["bias"])


def test_only_the_bias_requires_grad():
    case = make_case(2, 5, 7, 4, 2, 16, bias_shape=(2, 2, 1, 7))
    dout = torch.randn(case["q"].shape).bfloat16()
    _, _, grads = run_flash(case, dout, wrt=("bias",), is_causal=True)
    _, _, ref_grads = run_reference(case, dout, wrt=("bias",), is_causal=True)
    assert list(grads) == ["bias"]
    assert_rounded("dbias", grads["bias"], ref_grads["bias"])


@pytest.mark.parametrize("head_dim", [4, 20, 63])
def test_head_dims_that_are_not_a_multiple_of_8_are_padded(head_dim):
    case = make_case(1, 5, 6, 2, 2, head_dim, mask_shape=(1, 1, 5, 6), bias_shape=(1, 2, 1, 6))
    dout = torch.randn(case["q"].shape).bfloat16()
    out, lse, grads = run_flash(case, dout)
    ref_out, ref_lse, ref_grads = run_reference(case, dout)  # default scale: 1/sqrt(head_dim), unpadded
    assert out.shape == case["q"].shape
    assert_rounded("out", out, ref_out)
    assert_rounded("lse", lse, ref_lse)
    for name in ("q", "k", "v", "bias"):
        assert grads[name].shape == case[name].shape
        assert_rounded(f"d{name}", grads[name], ref_grads[name])


def test_autocast_runs_float32_inputs_in_the_autocast_dtype():
    case = make_case(1, 5, 7, 2, 1, 16, dtype=torch.float32, bias_shape=(1, 1, 1, 7))
    dout = torch.randn(case["q"].shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _, grads = run_flash(case, dout)
    assert out.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in grads.values())  # the float32 leaves' own dtype
    rounded = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in case.items()}
    ref_out, _, _ = run_reference(rounded)
    assert_rounded("out", out, ref_out)


def test_expanded_mask_and_bias_are_read_in_place():
    case = make_case(2, 5, 7, 4, 2, 16, mask_shape=(2, 1, 1, 7), bias_shape=(2, 2, 1, 7))
    q, k, v, mask, bias = (case[n] for n in ("q", "k", "v", "mask", "bias"))
    wide_mask, wide_bias = mask.expand(2, 4, 5, 7), bias.expand(2, 2, 5, 7)
    assert interface._compact_broadcast(wide_mask).shape == (2, 1, 1, 7)
    assert interface._compact_broadcast(wide_bias).shape == (2, 2, 1, 7)
    compact = flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias)
    assert torch.equal(flash_dmattn_func(q, k, v, attn_mask=wide_mask, attn_bias=wide_bias), compact)

    # A bias expand()ed from a leaf that needs a gradient: the leaf gets the reduced gradient.
    dout = torch.randn(q.shape).bfloat16()
    leaf = bias.clone().requires_grad_()
    flash_dmattn_func(q, k, v, attn_mask=wide_mask, attn_bias=leaf.expand(2, 2, 5, 7)).backward(dout)
    _, _, ref_grads = run_reference(case, dout, wrt=("bias",))
    assert leaf.grad.shape == (2, 2, 1, 7)
    assert_rounded("dbias", leaf.grad, ref_grads["bias"])


@pytest.mark.parametrize("seqlen_k", [7, 16, 21])
@pytest.mark.parametrize("mask_shape", [(2, 1, 1), (1, 2, 5), (2, 4, 5)])
def test_bit_packed_masks_give_the_bool_masks_results(seqlen_k, mask_shape):
    case = make_case(2, 5, seqlen_k, 4, 2, 16, mask_shape=(*mask_shape, seqlen_k), bias_shape=(2, 2, 1, seqlen_k),
                     keep=0.6)
    dout = torch.randn(case["q"].shape).bfloat16()
    out, lse, grads = run_flash(case, dout, is_causal=True)
    packed = dict(case, mask=flash_dmattn.pack_mask(case["mask"]))
    packed_out, packed_lse, packed_grads = run_flash(packed, dout, is_causal=True)
    assert torch.equal(packed_out, out) and torch.equal(packed_lse, lse)
    for name, grad in grads.items():
        assert torch.equal(packed_grads[name], grad), name
    # Expanded (stride 0) leading dims stay views; a prepared packed mask runs the same.
    wide = flash_dmattn.pack_mask(case["mask"].expand(2, mask_shape[1] if mask_shape[1] > 1 else 4, 5, seqlen_k))
    assert torch.equal(flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=wide, attn_bias=case["bias"],
                                         is_causal=True), out)
    prepared = flash_dmattn.prepare_mask(case["q"], case["k"], case["v"], packed["mask"], is_causal=True)
    assert torch.equal(flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=prepared, attn_bias=case["bias"],
                                         is_causal=True), out)


def test_bit_packed_mask_beside_key_indices():
    """Key indices ANDed with a bit-packed mask: as with the bool mask it packs."""
    case = make_case(2, 5, 13, 4, 2, 16, mask_shape=(2, 2, 5, 13), keep=0.6)
    indices = torch.randint(0, 13, (2, 2, 5, 6), generator=torch.Generator().manual_seed(1))
    q, k, v = case["q"], case["k"], case["v"]
    expected = flash_dmattn_func(q, k, v, attn_mask=case["mask"], attn_indices=indices)
    packed = flash_dmattn.pack_mask(case["mask"])
    assert torch.equal(flash_dmattn_func(q, k, v, attn_mask=packed, attn_indices=indices), expected)


def test_mask_with_an_expanded_key_dim():
    """A mask that broadcasts over the keys by stride 0 (not a size-1 dim) is legal too."""
    q, k, v = q_k_v()
    row_switch = torch.tensor([True, False, True, True, False]).view(1, 1, 5, 1)
    out = flash_dmattn_func(q, k, v, attn_mask=row_switch.expand(2, 4, 5, 7))
    assert torch.equal(out, flash_dmattn_func(q, k, v, attn_mask=row_switch))
    assert (out[:, 1] == 0).all() and (out[:, 4] == 0).all()


def test_return_attn_probs_gives_lse_and_no_probabilities():
    q, k, v = q_k_v()
    out, lse, probs = flash_dmattn_func(q, k, v, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    assert not lse.requires_grad
    assert torch.equal(out, flash_dmattn_func(q, k, v))


def test_non_contiguous_inputs():
    packed = torch.randn(2, 5, 3, 4, 16).half()
    q, k, v = packed[:, :, 0], packed[:, :, 1, :2], packed[:, :, 2, 2:]
    assert torch.equal(flash_dmattn_func(q, k, v), flash_dmattn_func(q.contiguous(), k.contiguous(), v.contiguous()))
    transposed = torch.randn(2, 4, 5, 16).half().transpose(1, 2)  # (B, H, S, D) storage, as transformers has it
    assert torch.equal(flash_dmattn_func(transposed, k, v), flash_dmattn_func(transposed.contiguous(), k, v))


def test_deterministic_backward_is_bitwise_repeatable():
    case = make_case(2, 5, 7, 4, 2, 16, bias_shape=(1, 4, 5, 7))
    dout = torch.randn(case["q"].shape).bfloat16()
    first = run_flash(case, dout, deterministic=True)[2]
    second = run_flash(case, dout, deterministic=True)[2]
    assert all(torch.equal(first[n], second[n]) for n in first)


# ------------------------------------------------------------------------------------------------
# torch.library registrations and torch.compile tracing


def _op_args(requires_grad):
    case = make_case(2, 5, 7, 4, 2, 16, mask_shape=(2, 1, 1, 7), bias_shape=(2, 2, 1, 7))
    q, k, v, bias = (case[n].requires_grad_(requires_grad) for n in ("q", "k", "v", "bias"))
    return q, k, v, case["mask"], bias


def test_opcheck_forward():
    torch.library.opcheck(torch_ops.forward, (*_op_args(True), 0.25, True, 0.0, False))


def test_opcheck_backward():
    q, k, v, mask, bias = _op_args(False)
    out, lse = torch_ops.forward(q, k, v, mask, bias, 0.25, True, 0.0, False)
    torch.library.opcheck(torch_ops.backward, (torch.randn_like(out), q, k, v, mask, bias, out, lse, 0.25, True, 0.0,
                                               False, None, 0, 0, True))


def test_opcheck_with_key_indices():
    q, k, v, _, bias = _op_args(True)
    indices = torch.tensor([[0, 3, -1], [6, 2, 2]], dtype=torch.int32).view(1, 2, 1, 3).expand(2, 2, 5, 3).contiguous()
    torch.library.opcheck(torch_ops.forward, (q, k, v, None, bias, 0.25, True, 0.0, False, None, 0, 0, indices))
    out, lse = torch_ops.forward(q.detach(), k.detach(), v.detach(), None, bias.detach(), 0.25, True, 0.0, False,
                                 None, 0, 0, indices)
    torch.library.opcheck(torch_ops.backward, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), None,
                                               bias.detach(), out, lse, 0.25, True, 0.0, False, None, 0, 0, True,
                                               indices))


def prepared_mask_case(device="cpu"):
    case = make_case(2, 9, 11, 4, 2, 16, device=device, mask_shape=(2, 2, 9, 11), bias_shape=(2, 2, 1, 11))
    leaves = {n: case[n].clone().requires_grad_() for n in ("q", "k", "v", "bias")}
    return case, leaves, torch.randn(case["q"].shape, device=device).bfloat16()


def check_prepared_mask_matches_the_mask(device="cpu"):
    """Forward and gradients with a PreparedMask equal those with its bool mask, bitwise."""
    case, t, dout = prepared_mask_case(device)
    results = []
    for mask in (case["mask"], flash_dmattn.prepare_mask(t["q"], t["k"], t["v"], case["mask"], is_causal=True)):
        out = flash_dmattn_func(t["q"], t["k"], t["v"], attn_mask=mask, attn_bias=t["bias"], is_causal=True)
        results.append((out, *torch.autograd.grad(out, list(t.values()), dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    return case, t


def test_saved_tensors_moved_by_a_hook_drop_the_preparation():
    """A saved-tensor hook that moves the mask (save_on_cpu, offloading) makes the backward build
    its own summary rather than refuse a preparation of another address."""
    case, t, dout = prepared_mask_case()
    prepared = flash_dmattn.prepare_mask(t["q"], t["k"], t["v"], case["mask"], is_causal=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: x.clone(), lambda x: x):
        out = flash_dmattn_func(t["q"], t["k"], t["v"], attn_mask=prepared, attn_bias=t["bias"], is_causal=True)
    moved = torch.autograd.grad(out, list(t.values()), dout)
    out = flash_dmattn_func(t["q"], t["k"], t["v"], attn_mask=case["mask"], attn_bias=t["bias"], is_causal=True)
    for a, b in zip(moved, torch.autograd.grad(out, list(t.values()), dout)):
        assert torch.equal(a, b)


def test_prepared_mask_matches_the_mask_and_refuses_what_it_can_see():
    case, t = check_prepared_mask_matches_the_mask()
    q, k, v, bias = t["q"], t["k"], t["v"], t["bias"]
    prepared = flash_dmattn.prepare_mask(q, k, v, case["mask"], is_causal=True)
    assert isinstance(prepared, flash_dmattn.PreparedMask) and prepared.nbytes == 0  # the CPU builds nothing
    with pytest.raises(ValueError, match="argument 'is_causal': expected True"):
        flash_dmattn_func(q, k, v, attn_mask=prepared)
    # Other heads (the mask's 2 serve H = 2 too): the library's fingerprint check names the argument.
    with pytest.raises(ValueError, match="argument 'prepared_mask'"):
        flash_dmattn_func(q[:, :, :2], k, v, attn_mask=prepared, is_causal=True)
    with pytest.raises(ValueError, match="argument 'attn_mask': expected a bool mask beside attn_indices"):
        flash_dmattn_func(q, k, v, attn_mask=prepared, is_causal=True,
                          attn_indices=torch.zeros(2, 2, 9, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="argument 'attn_mask': expected a mask to prepare"):
        flash_dmattn.prepare_mask(q, k, v, None)
    case["mask"][0, 0, 0, 0] = ~case["mask"][0, 0, 0, 0]  # in place: the version counter moves
    with pytest.raises(ValueError, match="modified in place"):
        flash_dmattn_func(q, k, v, attn_mask=prepared, is_causal=True)


def test_compile_fullgraph_traces_forward_and_backward():
    """fullgraph=True fails on any graph break; aot_eager traces the backward through the ops too."""
    case = make_case(2, 5, 7, 4, 2, 20, mask_shape=(2, 1, 1, 7), bias_shape=(2, 2, 1, 7))
    dout = torch.randn(case["q"].shape).bfloat16()

    def attention(q, k, v, mask, bias):
        return flash_dmattn_func(q, k, v, attn_mask=mask.expand(2, 4, 5, 7), attn_bias=bias, is_causal=True)

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, attention):
        leaves = [case[n].clone().requires_grad_(n != "mask") for n in ("q", "k", "v", "mask", "bias")]
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dout)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_eager_calls_skip_the_custom_op_and_fake_tensors_take_it():
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    assert torch_ops._plain_eager((q, q, q, None, None))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        assert not torch_ops._plain_eager((fake, fake, fake, None, None))
        out, lse = torch_ops.attention(fake, fake, fake, None, None, None, False, 0.0, False)
        assert out.shape == q.shape and lse.shape == (1, 2, 4)


def test_calls_that_need_no_gradient_skip_autograd_but_keep_every_gradient_asked_for(monkeypatch):
    """torch_ops.attention calls the forward directly when no gradient can be asked for; wherever
    one can (grad mode on and any of q, k, v, bias requiring it, or a forward-AD level open), the
    autograd path runs."""
    applied = []
    apply = torch_ops._EagerAttention.apply
    monkeypatch.setattr(torch_ops._EagerAttention, "apply", lambda *a: applied.append(1) or apply(*a))
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 2, 8, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(1, 7, 1, 8, generator=generator).to(torch.bfloat16) for _ in range(2))
    bias = torch.randn(1, 1, 1, 7, generator=generator).to(torch.bfloat16)

    out = flash_dmattn_func(q, k, v, attn_bias=bias)
    assert not out.requires_grad and applied == []
    with torch.inference_mode():
        assert torch.equal(flash_dmattn_func(q, k, v, attn_bias=bias), out) and applied == []
    leaf = bias.clone().requires_grad_()
    with torch.no_grad():
        assert not flash_dmattn_func(q, k, v, attn_bias=leaf).requires_grad and applied == []
    # Only the bias requires grad: the autograd path, and its gradient arrives.
    grad_out = flash_dmattn_func(q, k, v, attn_bias=leaf)
    assert torch.equal(grad_out, out) and applied == [1]
    (dbias,) = torch.autograd.grad(grad_out.float().sum(), [leaf])
    assert dbias.shape == bias.shape and dbias.abs().sum() > 0
    # Dual tensors need not require grad: they take the autograd path, which refuses them loudly
    # (no jvp) instead of dropping their tangents.
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(RuntimeError):
            flash_dmattn_func(dual, k, v, attn_bias=bias)


def test_the_module_reads_torch_tensors_directly():
    """_C.rows_aligned and _C.forward_args (and the args' rows_aligned) read dtype, shape, strides,
    pointer and device from the tensors themselves (the torch front's fast path); what they cannot
    read is named."""
    _C = torch_ops._C
    t = torch.zeros(2, 3, 4, 16, dtype=torch.bfloat16)
    assert _C.rows_aligned(t)
    assert not _C.rows_aligned(t.view(-1)[1:].view(-1)[:2 * 3 * 4 * 15].view(2, 3, 4, 15))  # odd base, odd rows
    assert _C.rows_aligned(t[..., :12])  # a row's length does not matter, its stride does
    assert not _C.rows_aligned(torch.zeros(2, 3, 4, 12, dtype=torch.bfloat16))  # rows 24 bytes apart
    assert not _C.rows_aligned(t.transpose(2, 3))  # last dim not contiguous
    with pytest.raises(ValueError, match="argument 'tensor': expected dtype float16, bfloat16, float32, bool, int32 or uint8"):
        _C.rows_aligned(t.to(torch.int8))
    with pytest.raises(ValueError, match="argument 'q': expected a CPU or CUDA tensor"):
        _C.forward_args(t.to("meta"), t, t, t, t, None, None, None, None, False, 0.0, 0, None)
    q, k, v = q_k_v()
    out, lse = torch.empty_like(q), torch.empty(2, 4, 5)
    args = _C.forward_args(q, k, v, out, lse, None, None, None, None, False, 0.0, 0, None)
    assert args.rows_aligned  # (q, k, v and out as the views hold them: no second read of the tensors)
    odd = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    assert not _C.forward_args(odd, k, v, out, lse, None, None, None, None, False, 0.0, 0, None).rows_aligned
    torch_ops._run(_C.forward, _C.forward_workspace_size, args, q.device)
    expected, expected_lse, _ = flash_dmattn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)


def test_the_one_pass_check_accepts_only_what_the_checks_accept():
    """interface._plainly_valid lets a call skip the per-argument checks: every call it accepts
    must pass them (random shapes, dims and dtypes, many of them invalid)."""
    import random
    rng = random.Random(0)
    pick = rng.choice
    accepted = 0
    for _ in range(4000):
        batch, seqlen_q, kv_heads, seqlen_k = pick([1, 2]), pick([0, 1, 3]), pick([0, 1, 2]), pick([0, 1, 4])
        head_dim = pick([8, 8, 8, 0])
        heads = kv_heads * pick([1, 2]) if rng.random() < 0.8 else pick([0, 3])
        dtype = pick([torch.float16, torch.bfloat16, torch.float32])
        q = torch.zeros(batch, seqlen_q, heads, pick([head_dim, head_dim, 264]), dtype=dtype)
        k = torch.zeros(pick([batch, batch, 3]), seqlen_k, pick([kv_heads, kv_heads, 3]), head_dim,
                        dtype=pick([dtype, dtype, torch.float16]))
        v = torch.zeros(k.shape[0], pick([seqlen_k, seqlen_k, 5]), k.shape[2], head_dim,
                        dtype=pick([k.dtype, k.dtype, dtype]))

        def operand(dtypes):
            if rng.random() < 0.3:
                return None
            sizes = [pick([1, batch, 3]), pick([1, kv_heads, heads, 3]), pick([1, seqlen_q, 2]), pick([1, seqlen_k, 6])]
            return torch.zeros(sizes[:pick([4, 4, 4, 3])], dtype=pick(dtypes))

        mask = operand([torch.bool, torch.bool, torch.uint8, torch.float16])
        bias = operand([dtype, torch.float32, torch.float64])
        quick = interface._plainly_valid(q, k, v, mask, bias)
        try:
            interface._check_types(q, k, v, mask, bias, None)
            interface._check_operands(q, k, v, mask, bias, None)
        except (TypeError, ValueError):
            assert not quick, (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype,
                               None if mask is None else (mask.shape, mask.dtype),
                               None if bias is None else (bias.shape, bias.dtype))
        accepted += quick
    assert accepted > 20


def test_a_pending_choice_reads_arrived_sizes_and_guesses_only_over_every_list(monkeypatch):
    """torch_ops._PendingChoice without a GPU (its CUDA parts faked): the backward's paths come
    from the sizes once they have arrived, and are remembered for the key; before that, a
    preparation holding every list takes the key's latest backward choice, any other stays
    pending (the tile path). The GPU suite runs the real thing."""
    chosen_paths = 2 | 8  # what the faked choose_mask_paths chooses: both gather backwards

    class FakePrepared:
        def __init__(self, data, numel, fingerprint, paths):
            self.paths = paths

    def choose(args, prepared, sizes, size):
        prepared.paths = chosen_paths

    monkeypatch.setattr(torch_ops._C, "PreparedMask", FakePrepared)
    monkeypatch.setattr(torch_ops._C, "choose_mask_paths", choose)
    monkeypatch.setattr(torch_ops, "_CHOSEN", {})

    class Event:
        def __init__(self, arrived):
            self.arrived = arrived

        def query(self):
            return self.arrived

    def pending(key, arrived, with_lists):
        p = object.__new__(torch_ops._PendingChoice)
        p.key, p.args, p.with_lists, p.memory, p.fingerprint = key, None, with_lists, (0, 0), 1
        p.pending_paths, p.sizes, p.arrived, p.chosen = torch_ops._CHOICE_PENDING, torch.empty(8, dtype=torch.uint8), \
            Event(arrived), None
        return p

    waiting = torch_ops._CHOICE_PENDING
    assert pending("a", False, True).paths(waiting) == waiting  # nothing chosen for "a" yet
    assert pending("a", True, False).paths(waiting) == chosen_paths
    assert torch_ops._CHOSEN == {"a": chosen_paths}
    assert pending("a", False, True).paths(waiting) == waiting | chosen_paths  # every list held: the guess
    assert pending("a", False, False).paths(waiting) == waiting  # lists the gate may have skipped: no guess
    assert pending("b", False, True).paths(waiting) == waiting
