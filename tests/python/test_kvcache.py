"""flash_dmattn_with_kvcache against flash_dmattn_func on each sequence's contiguous keys."""
import pytest

torch = pytest.importorskip("torch")

from flash_dmattn import flash_dmattn_func, pack_mask  # noqa: E402
from flash_dmattn.kvcache import flash_dmattn_with_kvcache  # noqa: E402
from torch_cases import route_fast_path  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("path", ["as_it_lies", "gathered"])
def test_cache_calls_match_each_sequence_alone(device, paged, is_causal, seqlen_q, path, monkeypatch):
    """Both ways through the call: the cache handed to the backend as it lies (the test fails if it
    was refused) and the gathered copy."""
    import flash_dmattn.kvcache as kvcache
    runs = route_fast_path(monkeypatch, kvcache, "_run_cached", path != "gathered")
    generator = torch.Generator().manual_seed(11)
    B, H, Hk, D, page = 4, 4, 2, 32, 16
    lengths = [37, 3, 16, 64]
    max_pages = 5  # 80 logical keys: the longest sequence leaves one page unused
    dtype = torch.bfloat16

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dt)

    q = randn(B, seqlen_q, H, D)
    keys = max_pages * page
    k_logical, v_logical = randn(B, keys, Hk, D), randn(B, keys, Hk, D)
    mask = (torch.rand(B, Hk, seqlen_q, keys, generator=generator) < 0.8).to(device)
    bias = randn(B, 1, 1, keys)
    if paged:
        # Pages in a shuffled pool with spares; unused table entries point anywhere (-1 here).
        pool = B * max_pages + 3
        order = torch.randperm(pool, generator=generator)[:B * max_pages].view(B, max_pages)
        k_cache, v_cache = randn(pool, page, Hk, D), randn(pool, page, Hk, D)
        for b in range(B):
            for p in range(max_pages):
                k_cache[order[b, p]] = k_logical[b, p * page:(p + 1) * page]
                v_cache[order[b, p]] = v_logical[b, p * page:(p + 1) * page]
        block_table = order.to(device=device, dtype=torch.int32)
        for b, n in enumerate(lengths):
            block_table[b, (n + page - 1) // page:] = -1
    else:
        k_cache, v_cache, block_table = k_logical, v_logical, None
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    out, lse, _ = flash_dmattn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, attn_mask=mask,
                                            attn_bias=bias, is_causal=is_causal, return_attn_probs=True)
    packed_out = flash_dmattn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, attn_mask=pack_mask(mask),
                                           attn_bias=bias, is_causal=is_causal)
    assert torch.equal(packed_out, out)  # the same mask bit-packed (unpacked on the gathered path)
    assert path == "gathered" or (len(runs) == 2 and all(r is not None for r in runs))
    for b, n in enumerate(lengths):
        expected, expected_lse, _ = flash_dmattn_func(q[b:b + 1], k_logical[b:b + 1, :n], v_logical[b:b + 1, :n],
                                                      attn_mask=mask[b:b + 1, ..., :n], attn_bias=bias[b:b + 1, ..., :n],
                                                      is_causal=is_causal, return_attn_probs=True)
        tolerance = dict(atol=0, rtol=0) if device == "cpu" else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out[b:b + 1], expected, **tolerance)
        torch.testing.assert_close(lse[b:b + 1], expected_lse, **tolerance)


def test_bad_arguments_are_named():
    q = torch.zeros(2, 1, 2, 8, dtype=torch.float16)
    cache = torch.zeros(6, 16, 2, 8, dtype=torch.float16)
    table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens.*lengths in \\[0, 48\\]"):
        flash_dmattn_with_kvcache(q, cache, cache, torch.tensor([5, 49], dtype=torch.int32), table)
    with pytest.raises(ValueError, match="block_table.*\\(B=2, max_pages\\)"):
        flash_dmattn_with_kvcache(q, cache, cache, torch.tensor([5, 9], dtype=torch.int32), table[:1])
    with pytest.raises(ValueError, match="k_cache.*without a block_table"):
        flash_dmattn_with_kvcache(q, cache, cache, torch.tensor([5, 9], dtype=torch.int32))


def test_validate_false_skips_only_the_check(monkeypatch):
    """Good inputs give the same result either way. Unchecked, the gathered copy clamps a length
    past the cache (causal rows included) to the cache's keys, as the kernels do; the CPU backend
    checks lengths whatever `validate` says."""
    import flash_dmattn.kvcache as kvcache
    torch.manual_seed(0)
    q = torch.randn(2, 2, 2, 8, dtype=torch.float16)
    cache = torch.randn(4, 16, 2, 8, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([20, 32], dtype=torch.int32)
    checked = flash_dmattn_with_kvcache(q, cache, cache, lengths, table, is_causal=True)
    assert torch.equal(flash_dmattn_with_kvcache(q, cache, cache, lengths, table, is_causal=True, validate=False),
                       checked)
    too_long = torch.tensor([20, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqlens_k.*lengths in \\[0, K=32\\].*got 40"):
        flash_dmattn_with_kvcache(q, cache, cache, too_long, table, is_causal=True, validate=False)
    route_fast_path(monkeypatch, kvcache, "_run_cached", False)
    gathered = flash_dmattn_with_kvcache(q, cache, cache, too_long, table, is_causal=True, validate=False)
    torch.testing.assert_close(gathered, checked, atol=0, rtol=0)


def test_a_page_a_sequence_reads_must_exist_and_an_empty_batch_runs():
    q = torch.zeros(2, 1, 2, 8, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)  # sequence 1 reads page 9 only if longer than 16
    lengths = torch.tensor([20, 16], dtype=torch.int32)
    assert flash_dmattn_with_kvcache(q, cache, cache, lengths, table).shape == q.shape
    with pytest.raises(ValueError, match="block_table.*\\[0, 4\\).*got 9 at \\(1, 1\\)"):
        flash_dmattn_with_kvcache(q, cache, cache, torch.tensor([20, 17], dtype=torch.int32), table)
    out = flash_dmattn_with_kvcache(q[:0], cache, cache, lengths[:0], table[:0])
    assert out.shape == (0, 1, 2, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_serving_calls_do_not_wait_for_the_gpu():
    """A serving loop's calls (a paged decode unchecked, a plain decode with mask and bias) queue
    their kernels without a host-device synchronization; the checked paged call does wait, which
    shows the debug mode sees one."""
    torch.manual_seed(0)
    B, H, Hk, D, page, pages = 2, 8, 2, 64, 16, 4
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(B * pages, page, Hk, D, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(B * pages, device="cuda", dtype=torch.int32).view(B, pages)
    lengths = torch.tensor([50, 64], device="cuda", dtype=torch.int32)
    k = torch.randn(B, 300, Hk, D, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(B, Hk, 1, 300, device="cuda") < 0.5
    bias = torch.randn(B, Hk, 1, 300, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the first calls may set things up (module load, device queries)
        flash_dmattn_with_kvcache(q, cache, cache, lengths, table, validate=False)
        flash_dmattn_func(q, k, k, attn_mask=mask, attn_bias=bias)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_dmattn_with_kvcache(q, cache, cache, lengths, table, validate=False)
        flash_dmattn_func(q, k, k, attn_mask=mask, attn_bias=bias)
        with pytest.raises(RuntimeError, match="synchroniz"):
            flash_dmattn_with_kvcache(q, cache, cache, lengths, table)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
