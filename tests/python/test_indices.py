"""flash_dmattn_func(attn_indices=...): per-row key lists (DeepSeek's sparse-attention form) keep
exactly the keys of the bool mask they stand for (docs/semantics.md §2), with -1 padding,
duplicates counted once, every broadcast shape of the rows, and clear errors for bad lists.

Needs torch, not a GPU: runs on CPU tensors (the fp64 CPU backend), and on CUDA ones where there
is a GPU.
"""
import pytest

torch = pytest.importorskip("torch")

from flash_dmattn import flash_dmattn_func, topk_key_indices, topk_mask  # noqa: E402
from torch_cases import make_case  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_indices(shape, seqlen_k, keep, generator):
    """(.., keep) sorted distinct keys per row, with about a fifth of each list padded by -1."""
    scores = torch.rand(*shape[:3], seqlen_k, generator=generator)
    indices = torch.topk(scores, keep, dim=-1).indices
    pad = torch.rand(*shape[:3], keep, generator=generator) < 0.2
    return torch.sort(indices.masked_fill(pad, -1), dim=-1).values.to(torch.int32)


def mask_of(indices, seqlen_k):
    """The bool mask the lists stand for, built the plain way."""
    mask = torch.zeros(*indices.shape[:3], seqlen_k, dtype=torch.bool)
    for row in torch.cartesian_prod(*(torch.arange(n) for n in indices.shape[:3])):
        for j in indices[tuple(row)].tolist():
            if j >= 0:
                mask[tuple(row) + (j,)] = True
    return mask


def outputs_and_grads(case, dout, **options):
    leaves = {n: t.detach().clone().requires_grad_(n in ("q", "k", "v", "bias")) if t is not None else None
              for n, t in case.items()}
    out = flash_dmattn_func(leaves["q"], leaves["k"], leaves["v"], attn_mask=leaves["mask"],
                            attn_bias=leaves["bias"], **options)
    grads = torch.autograd.grad(out, [leaves[n] for n in ("q", "k", "v", "bias")], dout)
    return [out, *grads]


def test_lists_of_any_layout_are_read():
    # Lists whose last dim is not contiguous (built as (.., K, Sq), then transposed) give what the
    # same lists laid out plainly give.
    generator = torch.Generator().manual_seed(3)
    case = make_case(1, 9, 13, 4, 2, 16, dtype=torch.bfloat16)
    indices = random_indices((1, 2, 9, 5), 13, 5, generator)
    transposed = indices.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert transposed.stride(-1) != 1
    a = flash_dmattn_func(case["q"], case["k"], case["v"], attn_indices=indices)
    b = flash_dmattn_func(case["q"], case["k"], case["v"], attn_indices=transposed)
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows_shape", [(2, 4, 9, 5), (1, 2, 9, 5), (2, 1, 1, 5), (1, 4, 9, 0)],
                         ids=["per-head-row", "per-kv-head", "one-row-per-batch", "empty-lists"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_indices_match_the_mask_they_stand_for(device, rows_shape, is_causal, monkeypatch):
    # On CUDA the lists go to the gather path as they are: the mask takes it too, so that both
    # build the same key lists. dK, dV and dBias are then summed by atomics, in any order.
    if device == "cuda":
        monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "gather")
    generator = torch.Generator().manual_seed(1)
    case = make_case(2, 9, 13, 4, 2, 16, dtype=torch.bfloat16, bias_shape=(2, 2, 1, 13))
    keep = rows_shape[3]
    indices = random_indices(rows_shape, 13, keep, generator) if keep else torch.zeros(rows_shape, dtype=torch.int32)
    dout = torch.randn(case["q"].shape, generator=generator).to(torch.bfloat16)
    case = {n: t.to(device) if t is not None else None for n, t in case.items()}
    with_mask = outputs_and_grads(dict(case, mask=mask_of(indices, 13).to(device)), dout.to(device),
                                  is_causal=is_causal)
    with_indices = outputs_and_grads(case, dout.to(device), is_causal=is_causal, attn_indices=indices.to(device))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dbias"), with_mask, with_indices):
        if device == "cuda" and name in ("dk", "dv", "dbias"):
            assert torch.allclose(a.float(), b.float(), rtol=0, atol=1e-2 * float(a.float().abs().max()) + 1e-6), name
        else:
            assert torch.equal(a, b), name


def test_duplicates_and_padding_count_as_the_set_of_keys():
    case = make_case(1, 3, 6, 2, 1, 8, dtype=torch.float16)
    plain = torch.tensor([[[[1, 4, -1], [0, 2, 5], [3, -1, -1]]]], dtype=torch.int64)
    repeated = torch.tensor([[[[4, 1, 4, 1, -1], [5, 2, 0, 2, -1], [-1, 3, 3, 3, -1]]]], dtype=torch.int64)
    a = flash_dmattn_func(case["q"], case["k"], case["v"], attn_indices=plain)
    b = flash_dmattn_func(case["q"], case["k"], case["v"], attn_indices=repeated)
    assert torch.equal(a, b)


def test_indices_and_mask_together_keep_the_keys_both_keep():
    generator = torch.Generator().manual_seed(2)
    case = make_case(2, 7, 11, 4, 2, 16, dtype=torch.float16, mask_shape=(2, 2, 7, 11))
    indices = random_indices((2, 4, 7, 6), 11, 6, generator)  # per query head; the mask per KV head
    both = flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=case["mask"], attn_indices=indices)
    combined = case["mask"].repeat_interleave(2, dim=1) & mask_of(indices, 11)
    assert torch.equal(both, flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=combined))


def test_topk_key_indices_keep_what_topk_mask_keeps():
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(2, 2, 5, 12, generator=generator)
    padding = torch.rand(2, 1, 1, 12, generator=generator) < 0.7  # some rows keep fewer than the window
    min_dtype = torch.finfo(bias.dtype).min
    indices = topk_key_indices(bias, padding, 8, min_dtype)
    assert indices.dtype == torch.int32 and indices.shape == (2, 2, 5, 8)
    assert torch.equal(mask_of(indices, 12), topk_mask(bias, padding, 8, min_dtype))


@pytest.mark.parametrize("indices, error, message", [
    (torch.zeros(2, 4, 5, 3), TypeError, "argument 'attn_indices': expected dtype torch.int32 or torch.int64, got "
                                         "torch.float32"),
    (torch.zeros(2, 4, 5, dtype=torch.int32), ValueError,
     "argument 'attn_indices': expected 4 dims (B|1, H|Hk|1, Sq|1, K), got shape (2, 4, 5)"),
    (torch.zeros(2, 3, 5, 2, dtype=torch.int32), ValueError,
     "argument 'attn_indices': expected heads size (dim 1) in [1, 2, 4], got 3 in shape (2, 3, 5, 2) "
     "(layout (B|1, H|Hk|1, Sq|1, K))"),
    (torch.full((2, 4, 5, 2), 7, dtype=torch.int32), ValueError,
     "argument 'attn_indices': expected key indices in [0, 7) or -1 (padding), got 7 at (0, 0, 0, 0)"),
    (torch.tensor([[[[0, -2]]]], dtype=torch.int32), ValueError,
     "argument 'attn_indices': expected key indices in [0, 7) or -1 (padding), got -2 at (0, 0, 0, 1)"),
])
def test_bad_indices_are_named(indices, error, message):
    case = make_case(2, 5, 7, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(error) as raised:
        flash_dmattn_func(case["q"], case["k"], case["v"], attn_indices=indices)
    assert message in str(raised.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_unchecked_entries_out_of_range_count_as_padding(device, dtype):
    """check_indices=False reads no values (no wait for the GPU): out-of-range entries, even ones
    past 2^31 in int64, count as -1 on every path."""
    case = make_case(1, 4, 9, 2, 1, 16, dtype=torch.bfloat16, device=device)
    far = 2**32 + 3 if dtype == torch.int64 else -5
    bad = torch.tensor([[[[0, 9, 4], [far, 2, -1], [8, 100, 1], [5, 6, 7]]]], dtype=dtype, device=device)
    padded = torch.where((bad >= 0) & (bad < 9), bad, -1)
    for single in (False, True):  # lists per row (direct on CUDA), and one query (decode)
        q = case["q"][:, :1] if single else case["q"]
        rows = slice(0, 1) if single else slice(None)
        got = flash_dmattn_func(q, case["k"], case["v"], attn_indices=bad[:, :, rows], check_indices=False)
        want = flash_dmattn_func(q, case["k"], case["v"], attn_indices=padded[:, :, rows])
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_traces_the_lists(device):
    """Under torch.compile the values are not read (that would synchronize); the result is the same."""
    case = make_case(1, 8, 10, 2, 1, 16, dtype=torch.bfloat16, device=device)
    indices = torch.tensor([[[[0, 3, 5, -1]]]], dtype=torch.int32, device=device)

    def call(q, k, v, i):
        return flash_dmattn_func(q, k, v, attn_indices=i, is_causal=True)

    compiled = torch.compile(call, fullgraph=True)
    assert torch.equal(compiled(case["q"], case["k"], case["v"], indices),
                       call(case["q"], case["k"], case["v"], indices))


# ------------------------------------------------------------------------------------------------
# attn_indices_bias: a bias value per listed key


def dense_of(indices, values, seqlen_k):
    """The (.., Sk) bias that per-key values stand for, built the plain way (duplicates add)."""
    shape = torch.broadcast_shapes(indices.shape, values.shape)
    indices, values = indices.expand(shape), values.expand(shape)
    dense = torch.zeros(*shape[:3], seqlen_k, dtype=torch.float64)
    for row in torch.cartesian_prod(*(torch.arange(n) for n in shape[:3])):
        for j, x in zip(indices[tuple(row)].tolist(), values[tuple(row)].double().tolist()):
            if j >= 0:
                dense[tuple(row) + (j,)] += x
    return dense


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", [((2, 4, 9, 5), (2, 4, 9, 5)), ((1, 2, 9, 5), (2, 2, 1, 5)),
                                    ((2, 1, 1, 5), (2, 4, 9, 5))],
                         ids=["aligned", "rows-per-kv-head-values-per-batch", "one-list-values-per-row"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_indexed_bias_is_the_dense_bias_it_stands_for(device, shapes, with_bias):
    """Out and gradients equal those of the dense bias built by hand; the values' gradient is the
    dense bias gradient read at the listed keys, 0 at padding, summed over broadcast dims."""
    generator = torch.Generator().manual_seed(2)
    index_shape, value_shape = shapes
    case = make_case(2, 9, 13, 4, 2, 16, dtype=torch.bfloat16, bias_shape=(2, 2, 1, 13))
    indices = random_indices(index_shape, 13, 5, generator)
    indices[..., 0] = indices[..., 1].clamp(min=0)  # a key listed twice in some rows: its values add
    values = torch.randn(value_shape, generator=generator).to(torch.bfloat16)
    dout = torch.randn(case["q"].shape, generator=generator).to(device, torch.bfloat16)
    case = {n: t.to(device) if t is not None else None for n, t in case.items()}
    if not with_bias:
        case["bias"] = None
    q, k, v = (case[n].detach().requires_grad_() for n in ("q", "k", "v"))
    bias = None if case["bias"] is None else case["bias"].detach().requires_grad_()
    listed = values.to(device).requires_grad_()
    out = flash_dmattn_func(q, k, v, attn_bias=bias, attn_indices=indices.to(device), attn_indices_bias=listed)
    leaves = [q, k, v, listed] + ([bias] if bias is not None else [])
    grads = torch.autograd.grad(out, leaves, dout)

    # The same call with the dense bias (float32: the sum of bf16 values is exact there).
    full = dense_of(indices, values, 13).to(device, torch.float32)
    if bias is not None:
        # The bias has a head per KV head; lists with a head per query head serve groups of 2.
        full = full + bias.detach().float().repeat_interleave(full.shape[1] // bias.shape[1], dim=1)
    full = full.detach().requires_grad_()
    q2, k2, v2 = (case[n].detach().requires_grad_() for n in ("q", "k", "v"))
    expected = flash_dmattn_func(q2, k2, v2, attn_bias=full, attn_indices=indices.to(device))
    expected_grads = torch.autograd.grad(expected, [q2, k2, v2, full], dout)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    for name, a, b in zip(("dq", "dk", "dv"), grads[:3], expected_grads[:3]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=name)
    # d values: the dense gradient at each listed key, summed over the dims the values broadcast.
    shape = torch.broadcast_shapes(indices.shape, values.shape)
    idx = indices.to(device).long().expand(shape)
    at_keys = torch.gather(expected_grads[3].expand(*shape[:3], 13), -1, idx.clamp(min=0)).masked_fill(idx < 0, 0)
    reduce = tuple(d for d in range(3) if values.shape[d] == 1 and shape[d] > 1)
    expected_values_grad = at_keys.sum(reduce, keepdim=True) if reduce else at_keys
    torch.testing.assert_close(grads[3].float(), expected_values_grad.float(), atol=3e-2, rtol=3e-2)


def test_indexed_bias_errors_name_the_argument():
    case = make_case(1, 4, 6, 2, 1, 8, dtype=torch.bfloat16)
    q, k, v = case["q"], case["k"], case["v"]
    indices = torch.tensor([[[[0, 3]]]], dtype=torch.int32)
    with pytest.raises(ValueError, match="'attn_indices_bias'.*expected attn_indices beside it"):
        flash_dmattn_func(q, k, v, attn_indices_bias=torch.zeros(1, 1, 1, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="'attn_indices_bias'.*list length \\(dim 3\\) of 2"):
        flash_dmattn_func(q, k, v, attn_indices=indices, attn_indices_bias=torch.zeros(1, 1, 1, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="'attn_indices_bias'.*dtype"):
        flash_dmattn_func(q, k, v, attn_indices=indices, attn_indices_bias=torch.zeros(1, 1, 1, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="'attn_indices_bias'.*expected 4 dims"):
        flash_dmattn_func(q, k, v, attn_indices=indices, attn_indices_bias=torch.zeros(1, 2, dtype=torch.bfloat16))
