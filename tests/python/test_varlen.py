"""flash_dmattn_varlen_func against the float64 reference run on each sequence alone."""
import pytest

torch = pytest.importorskip("torch")

from flash_dmattn import attention_reference, pack_mask  # noqa: E402
from flash_dmattn.varlen import flash_dmattn_varlen_func  # noqa: E402
from tolerance import assert_rounded, assert_within_baseline  # noqa: E402
from torch_cases import route_fast_path  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _offsets(lengths, device):
    return torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)


def _per_sequence(q, k, v, mask, bias, lengths_q, lengths_k, dout, is_causal, softcap, upcast):
    """Packed out and (dq, dk, dv, dbias) from the reference run on every sequence alone."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.detach().clone().requires_grad_() if bias is not None else None
    outs, loss = [], 0
    starts_q, starts_k = [0], [0]
    for lq, lk in zip(lengths_q, lengths_k):
        starts_q.append(starts_q[-1] + lq)
        starts_k.append(starts_k[-1] + lk)
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        sq, sk = slice(starts_q[b], starts_q[b] + lq), slice(starts_k[b], starts_k[b] + lk)

        def part(t):
            if t is None:
                return None
            t = t[b:b + 1] if t.size(0) > 1 else t
            t = t[:, :, :lq] if t.size(2) > 1 else t
            return t[..., :lk] if t.size(3) > 1 else t

        out, _ = attention_reference(leaves[0][None, sq], leaves[1][None, sk], leaves[2][None, sk], part(mask),
                                     part(bias_leaf), causal=is_causal, softcap=softcap, upcast=upcast)
        outs.append(out[0])
        loss = loss + (out[0].double() * dout[sq].double()).sum()
    wrt = leaves + ([bias_leaf] if bias_leaf is not None else [])
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, wrt)]
    return torch.cat(outs), grads


@pytest.mark.parametrize("path", ["packed", "padded"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shapes", [
    (None, None),
    ("B,Hk,Q,K", "B,H,Q,K"),
    ("1,1,1,K", "B,Hk,1,K"),
    ("B,1,Q,1", "1,1,Q,K"),
])
def test_packed_sequences_match_each_sequence_alone(device, is_causal, shapes, path, monkeypatch):
    """Both ways through the call: the packed sequences as they are (where the backend takes them;
    the test fails if it refused) and the padded batch."""
    import flash_dmattn.varlen as varlen
    runs = route_fast_path(monkeypatch, varlen, "_run_packed", path != "padded")
    generator = torch.Generator().manual_seed(7)
    lengths_q, lengths_k = [5, 0, 1, 13, 8], [7, 3, 1, 13, 4]
    H, Hk, D = 4, 2, 24
    max_q, max_k = 14, 15  # above the longest: the padded sizes need not be tight
    B = len(lengths_q)
    sizes = {"B": B, "H": H, "Hk": Hk, "Q": max_q, "K": max_k, "1": 1}
    dtype = torch.float16

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dt)

    q, k, v = randn(sum(lengths_q), H, D), randn(sum(lengths_k), Hk, D), randn(sum(lengths_k), Hk, D)
    dout = randn(sum(lengths_q), H, D)
    mask_code, bias_code = shapes
    mask = (torch.rand([sizes[c] for c in mask_code.split(",")], generator=generator) < 0.7).to(device) \
        if mask_code else None
    # A bias shared by several sequences sums its gradient over them: float32 keeps that exact.
    bias = randn(*[sizes[c] for c in bias_code.split(",")], dt=torch.float32) if bias_code else None

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    bias_leaf = bias.clone().requires_grad_() if bias is not None else None
    out, lse, _ = flash_dmattn_varlen_func(*leaves, _offsets(lengths_q, device), _offsets(lengths_k, device),
                                           max_q, max_k, attn_mask=mask, attn_bias=bias_leaf, is_causal=is_causal,
                                           return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    assert path == "padded" or runs[-1] is not None, "the backend refused the packed sequences"
    wrt = leaves + ([bias_leaf] if bias_leaf is not None else [])
    grads = torch.autograd.grad(out, wrt, dout)
    ref_out, ref_grads = _per_sequence(q, k, v, mask, bias, lengths_q, lengths_k, dout, is_causal, 0.0, True)
    base_out, base_grads = _per_sequence(q, k, v, mask, bias, lengths_q, lengths_k, dout, is_causal, 0.0, False)
    names = ("dq", "dk", "dv", "dbias")
    if mask is not None and mask.size(3) > 1:  # the same mask bit-packed: unpacked on the way, same bytes
        packed_out = flash_dmattn_varlen_func(q, k, v, _offsets(lengths_q, device), _offsets(lengths_k, device), max_q,
                                              max_k, attn_mask=pack_mask(mask), attn_bias=bias, is_causal=is_causal)
        assert torch.equal(packed_out, out.detach())
    if device == "cpu":  # the CPU backend: fp64, rounded once per call
        assert_rounded("out", out, ref_out.to(out.dtype))
        for name, g, r in zip(names, grads, ref_grads):
            # Gradients summed over sequences on the way back: within twice their own rounding.
            assert_within_baseline(name, g, r, r.to(g.dtype))
    else:
        assert_within_baseline("out", out, ref_out, base_out)
        for name, g, r, b in zip(names, grads, ref_grads, base_grads):
            assert_within_baseline(name, g, r, b)


def test_bad_offsets_are_named():
    q = torch.zeros(6, 2, 8, dtype=torch.float16)
    k = torch.zeros(5, 2, 8, dtype=torch.float16)
    good_k = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q.*rising to the 6 packed tokens"):
        flash_dmattn_varlen_func(q, k, k, torch.tensor([0, 3, 5], dtype=torch.int32), good_k, 4, 4)
    with pytest.raises(ValueError, match="longer than its max_seqlen 2"):
        flash_dmattn_varlen_func(q, k, k, torch.tensor([0, 3, 6], dtype=torch.int32), good_k, 2, 4)
    with pytest.raises(ValueError, match="attn_mask.*max_seqlen_q\\|1 = 4"):
        flash_dmattn_varlen_func(q, k, k, torch.tensor([0, 3, 6], dtype=torch.int32), good_k, 4, 4,
                                 attn_mask=torch.ones(2, 1, 3, 4, dtype=torch.bool))


def test_offsets_are_read_once_until_they_change(monkeypatch):
    """A model's layers pass the same offset tensors: only the first call reads them (a GPU wait
    on CUDA); an in-place change is seen and checked again."""
    import flash_dmattn.varlen as varlen
    reads = []
    problems = varlen._offset_problems
    monkeypatch.setattr(varlen, "_offset_problems", lambda *a: reads.append(1) or problems(*a))
    q = torch.zeros(6, 2, 8, dtype=torch.float16)
    cu_q, cu_k = torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    for _ in range(3):
        flash_dmattn_varlen_func(q, q, q, cu_q, cu_k, 3, 3)
    assert len(reads) == 2  # once per offset tensor
    cu_q[1] = 5  # a sequence of 5 tokens: longer than max_seqlen_q 3
    with pytest.raises(ValueError, match="cu_seqlens_q.*longer than its max_seqlen 3"):
        flash_dmattn_varlen_func(q, q, q, cu_q, cu_k, 3, 3)
