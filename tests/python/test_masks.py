"""The mask utilities against plain torch code written row by row, on CPU and (where present) CUDA.

Needs torch; skipped where it is missing (CI).
"""
import pytest

torch = pytest.importorskip("torch")

from flash_dmattn import (block_smooth, create_mask, pack_mask, relu_mask, topk_indices, topk_mask,  # noqa: E402
                          unpack_mask)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MIN = torch.finfo(torch.float32).min


def rows(t):
    return t.reshape(-1, t.shape[-1])


def expected_topk(bias, mask, window):
    """Per row: the `window` largest biases among the kept keys (random biases have no ties)."""
    shape = torch.broadcast_shapes(bias.shape, mask.shape) if mask is not None else bias.shape
    bias = bias.expand(shape)
    mask = torch.ones(shape, dtype=torch.bool, device=bias.device) if mask is None else mask.expand(shape)
    result = torch.zeros(shape, dtype=torch.bool)
    for out_row, b, m in zip(rows(result), rows(bias.cpu()), rows(mask.cpu())):
        visible = [j for j in range(len(b)) if m[j]]
        for j in sorted(visible, key=lambda j: -b[j].item())[:window]:
            out_row[j] = True
    return result


def expected_smooth(mask, block_size):
    result = mask.clone().cpu()
    for row in rows(result):
        for start in range(0, len(row), block_size):
            block = row[start:start + block_size]
            block[:] = bool(block.sum().item() * 2 > len(block))
    return result


@pytest.mark.parametrize("device", DEVICES)
def test_topk_mask_keeps_the_largest_visible_biases(device):
    bias = torch.randn(2, 2, 1, 40, device=device)
    mask = torch.rand(2, 1, 6, 40, device=device) < 0.5
    mask[0, 0, 0] = False
    mask[0, 0, 0, :3] = True  # fewer visible keys than the window: only those are kept
    result = topk_mask(bias, mask, window_size=8, min_dtype=MIN)
    assert result.dtype == torch.bool and result.shape == (2, 2, 6, 40)
    assert torch.equal(result.cpu(), expected_topk(bias, mask, 8))
    assert result[0, :, 0].sum(-1).tolist() == [3, 3]
    assert torch.equal(topk_mask(bias, None, 8, MIN).cpu(), expected_topk(bias, None, 8))


@pytest.mark.parametrize("device", DEVICES)
def test_relu_mask_keeps_positive_visible_biases(device):
    bias = torch.randn(2, 4, 3, 33, device=device)
    mask = torch.rand(1, 1, 3, 33, device=device) < 0.6
    assert torch.equal(relu_mask(bias, mask, MIN), (bias > 0) & mask)
    assert torch.equal(relu_mask(bias, None, MIN), bias > 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_len, block_size", [(37, 8), (32, 8), (5, 8), (20, 1)])
def test_block_smooth_votes_by_block(device, key_len, block_size):
    mask = torch.rand(3, 2, key_len, device=device) < 0.5
    expected = expected_smooth(mask, block_size)
    result = block_smooth(mask, key_len, block_size)
    assert result is mask  # in place, as upstream
    assert torch.equal(result.cpu(), expected)


@pytest.mark.parametrize("block_size", [0, -3])
def test_block_smooth_rejects_non_positive_blocks(block_size):
    with pytest.raises(ValueError, match="expected a positive integer"):
        block_smooth(torch.ones(1, 4, dtype=torch.bool), 4, block_size)


@pytest.mark.parametrize("device", DEVICES)
def test_topk_and_relu_smooth_when_asked(device):
    bias = torch.randn(1, 2, 4, 50, device=device)
    assert torch.equal(topk_mask(bias, None, 20, MIN, block_size=8).cpu(),
                       expected_smooth(expected_topk(bias, None, 20), 8))
    assert torch.equal(relu_mask(bias, None, MIN, block_size=8).cpu(), expected_smooth(bias > 0, 8))


def test_topk_indices_are_sorted_top_positions():
    bias = torch.randn(2, 3, 30)
    indices = topk_indices(bias, 5)
    expected = torch.sort(torch.argsort(bias, dim=-1, descending=True)[..., :5], dim=-1).values
    assert torch.equal(indices, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_create_mask_with_padding_masks(device):
    batch, query_len, key_len = 2, 4, 24
    bias = torch.randn(batch, 2, 1, key_len, device=device)
    padding = torch.ones(batch, key_len, dtype=torch.long, device=device)
    padding[1, :5] = 0  # left padding of the second sequence
    result = create_mask(bias, padding, batch, query_len, key_len, window_size=6, min_dtype=MIN)
    assert torch.equal(result.cpu(), expected_topk(bias, padding.bool().view(batch, 1, 1, key_len), 6))

    # A (B, query_len) mask covers the newest keys; the cached ones in front are kept.
    newest = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool, device=device)
    full = torch.cat([torch.ones(batch, key_len - query_len, dtype=torch.bool, device=device), newest], dim=-1)
    result = create_mask(bias, newest, batch, query_len, key_len, window_size=6, min_dtype=MIN)
    assert torch.equal(result.cpu(), expected_topk(bias, full.view(batch, 1, 1, key_len), 6))

    relu = create_mask(bias, padding, batch, query_len, key_len, window_size=6, min_dtype=MIN, type="relu")
    assert torch.equal(relu, (bias > 0) & padding.bool().view(batch, 1, 1, key_len))


def test_create_mask_guards_a_window_that_holds_every_key():
    bias = torch.randn(2, 1, 1, 10)
    mask = torch.rand(2, 1, 3, 10) < 0.5
    assert create_mask(bias, mask, 2, 3, 10, window_size=10, min_dtype=MIN) is mask
    assert create_mask(bias, None, 2, 3, 10, window_size=64, min_dtype=MIN) is None
    padding = torch.ones(2, 10, dtype=torch.bool)
    assert create_mask(bias, padding, 2, 3, 10, window_size=64, min_dtype=MIN).shape == (2, 1, 1, 10)


def test_create_mask_rejects_bad_arguments():
    bias = torch.randn(2, 1, 1, 10)
    with pytest.raises(ValueError, match=r"expected a 2-D mask of shape \(B=2, key_len=10\) or \(B, query_len=3\)"):
        create_mask(bias, torch.ones(2, 7, dtype=torch.bool), 2, 3, 10, window_size=4, min_dtype=MIN)
    with pytest.raises(ValueError, match="argument 'type': expected 'topk' or 'relu', got 'top-p'"):
        create_mask(bias, None, 2, 3, 10, window_size=4, min_dtype=MIN, type="top-p")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqlen_k", [1, 8, 13, 64])
def test_pack_mask_puts_key_j_at_bit_j_mod_8(device, seqlen_k):
    mask = (torch.rand(2, 3, 4, seqlen_k, generator=torch.Generator().manual_seed(seqlen_k)) < 0.5).to(device)
    packed = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 4, (seqlen_k + 7) // 8)
    for j in range(seqlen_k):
        assert torch.equal(((packed[..., j // 8] >> (j % 8)) & 1).bool(), mask[..., j])
    if seqlen_k % 8:  # the bits past the keys are zero
        assert (packed[..., -1] >> (seqlen_k % 8) == 0).all()
    assert torch.equal(unpack_mask(packed, seqlen_k), mask)


def test_pack_mask_keeps_expanded_dims_expanded():
    mask = (torch.rand(2, 1, 1, 20, generator=torch.Generator().manual_seed(3)) < 0.5).expand(2, 4, 6, 20)
    packed = pack_mask(mask)
    assert packed.shape == (2, 4, 6, 3) and packed.stride()[1:3] == (0, 0)
    assert torch.equal(unpack_mask(packed, 20), mask)


def test_pack_and_unpack_name_bad_arguments():
    with pytest.raises(TypeError, match="pack_mask: argument 'attention_mask': expected dtype torch.bool"):
        pack_mask(torch.ones(1, 1, 1, 8))
    with pytest.raises(ValueError, match=r"expected a last dim of ceil\(20 / 8\) = 3, got shape \(1, 1, 1, 2\)"):
        unpack_mask(torch.zeros(1, 1, 1, 2, dtype=torch.uint8), 20)
