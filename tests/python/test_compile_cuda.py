"""flash_dmattn_func under torch.compile (fullgraph, inductor) and inside a captured CUDA graph.

Skipped without torch or without a GPU.
"""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flash_dmattn import flash_dmattn_func  # noqa: E402
from tolerance import assert_rounded  # noqa: E402
from torch_cases import make_case  # noqa: E402

NAMES = ("q", "k", "v", "mask", "bias")


def attention(q, k, v, mask, bias):
    """A call with every preparation step: an expand()ed mask, a padded head dim, softcap."""
    batch, seqlen_q, heads, _ = q.shape
    wide_mask = mask.expand(batch, heads, seqlen_q, mask.shape[-1])
    return flash_dmattn_func(q, k, v, attn_mask=wide_mask, attn_bias=bias, is_causal=True, softcap=5.0,
                             deterministic=True)


def leaves(case):
    return [case[n].detach().clone().requires_grad_(n != "mask") for n in NAMES]


def forward_backward(fn, inputs, dout):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, [t for t in inputs if t.requires_grad], dout))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(dynamic):
    case = make_case(2, 100, 130, 8, 2, 72, device="cuda", mask_shape=(2, 1, 1, 130), bias_shape=(2, 2, 1, 130))
    dout = torch.randn(case["q"].shape, device="cuda").bfloat16()
    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic)
    results = forward_backward(compiled, leaves(case), dout)
    expected = forward_backward(attention, leaves(case), dout)
    assert torch.equal(results[0], expected[0])
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), results[1:], expected[1:]):
        assert_rounded(name, a, b)


def test_compile_recompiles_for_a_new_shape_without_graph_breaks():
    compiled = torch.compile(attention, fullgraph=True)
    for seqlen in (64, 96):
        case = make_case(1, seqlen, seqlen, 4, 2, 64, device="cuda", mask_shape=(1, 1, 1, seqlen),
                         bias_shape=(1, 2, 1, seqlen))
        inputs = [case[n] for n in NAMES]
        assert torch.equal(compiled(*inputs), attention(*inputs))


@pytest.mark.parametrize("shape", [(2, 128, 160, 8, 2, 64), (1, 1, 8192, 32, 8, 128)], ids=["prefill", "decode"])
def test_cuda_graph_capture_and_replay(shape):
    """Forward and backward captured once, replayed on new data: same as running them eagerly.
    The decode shape splits the keys, so its workspace comes from the graph's memory pool."""
    batch, seqlen_q, seqlen_k, heads, kv_heads, _ = shape
    mask_shape, bias_shape = (batch, 1, 1, seqlen_k), (batch, kv_heads, 1, seqlen_k)
    static = leaves(make_case(*shape, device="cuda", mask_shape=mask_shape, bias_shape=bias_shape))
    dout = torch.randn(static[0].shape, device="cuda").bfloat16()

    # Warm up on a side stream first (lazy module loading and allocator state), as torch's docs ask.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward_backward(attention, static, dout)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_backward(attention, static, dout)

    fresh = make_case(*shape, device="cuda", mask_shape=mask_shape, bias_shape=bias_shape, seed=1)
    with torch.no_grad():
        for t, name in zip(static, NAMES):
            t.copy_(fresh[name])
    graph.replay()
    torch.cuda.synchronize()
    expected = forward_backward(attention, leaves(fresh), dout)
    assert torch.equal(captured[0], expected[0])
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), captured[1:], expected[1:]):
        assert_rounded(name, a, b)
