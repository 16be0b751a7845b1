"""context_parallel_attention against the single-call result on the gathered tensors.

Each test spawns W processes (2 and 4) that form a gloo group on CPU tensors (the CPU backend), or
an NCCL group with a GPU each where that many GPUs exist. Every rank builds the same global problem,
runs the ring on its zigzag shards, and compares its rows of out and lse, its shards of dq, dk and
dv and its part of dbias with the float64 reference of the whole problem (tolerance.py's rule).
"""
import os
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch_cases import make_case, run_reference  # noqa: E402
from tolerance import assert_within_baseline  # noqa: E402

# (batch, S, heads, kv_heads, head_dim, mask shape, bias shape, causal, softcap); S = 2·W·chunk
# with odd chunks for W = 2 (S = 12: chunk 3).
CASES = [
    (2, 12, 4, 2, 16, "BHkSS", "BHk1S", True, 0.0),
    (1, 12, 2, 1, 24, "11S1", "BHSS", False, 0.0),
    (2, 24, 4, 1, 32, "111S", "11S1", True, 5.0),
    (1, 24, 2, 2, 8, None, "BH1S", True, 0.0),
    (1, 16, 4, 2, 16, "BHSS", None, False, 0.0),
    # Each row keeps the keys (i - 2, i]: on 4 ranks most blocks hold no kept key and are not
    # computed, while their K and V still travel on.
    (1, 24, 2, 1, 16, "band", "BH1S", True, 0.0),
]


def _shape(code, batch, heads, kv_heads, seqlen):
    if code is None:
        return None
    sizes = {"B": batch, "H": heads, "Hk": kv_heads, "S": seqlen, "1": 1}
    parts, i = [], 0
    while i < len(code):
        token = code[i:i + 2] if code[i:i + 2] == "Hk" else code[i]
        parts.append(sizes[token])
        i += len(token)
    return tuple(parts)


def _worker(rank, world_size, init_file, use_cuda, world_cases):
    from flash_dmattn.distributed import context_parallel_attention, zigzag_shard

    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    try:
        for index, (batch, seqlen, heads, kv_heads, head_dim, mask_code, bias_code, causal, softcap) in \
                enumerate(world_cases):
            band = mask_code == "band"
            case = make_case(batch, seqlen, seqlen, heads, kv_heads, head_dim, dtype=torch.float16, device=device,
                             mask_shape=None if band else _shape(mask_code, batch, heads, kv_heads, seqlen),
                             bias_shape=_shape(bias_code, batch, heads, kv_heads, seqlen), keep=0.6, seed=index)
            if band:
                offsets = torch.arange(seqlen)[None, :] - torch.arange(seqlen)[:, None]
                case["mask"] = ((offsets <= 0) & (offsets > -2)).view(1, 1, seqlen, seqlen).to(device)
            dout = torch.randn(batch, seqlen, heads, head_dim, generator=torch.Generator().manual_seed(100 + index))
            dout = dout.to(device=device, dtype=torch.float16)
            options = dict(is_causal=causal, softcap=softcap)
            ref_out, ref_lse, ref_grads = run_reference(case, dout, **options)
            base_out, base_lse, base_grads = run_reference(case, dout, upcast=False, **options)

            def rows(t, dim):  # this rank's zigzag shard where t has a row per token
                return zigzag_shard(t, dim, rank, world_size) if t is not None and t.size(dim) > 1 else t

            q, k, v = (rows(case[n], 1).detach().requires_grad_() for n in ("q", "k", "v"))
            if index == 1:  # K and V as views of one packed tensor: not contiguous
                kv = torch.stack([k.detach(), v.detach()], 2).requires_grad_()
                k, v = kv[:, :, 0], kv[:, :, 1]
            mask = rows(case["mask"], 2)
            if index == 0:  # the mask bit-packed (unpacked by the call): the same results
                from flash_dmattn import pack_mask
                mask = pack_mask(mask)
            bias = rows(case["bias"], 2)
            bias = bias.detach().requires_grad_() if bias is not None else None
            out, lse = context_parallel_attention(q, k, v, attn_mask=mask, attn_bias=bias, return_lse=True, **options)
            wrt = [q, k, v] + ([bias] if bias is not None else [])
            grads = torch.autograd.grad(out, wrt, rows(dout, 1))  # through the views where k, v are views
            tag = f"world {world_size} rank {rank} case {index}"
            assert_within_baseline(f"{tag} out", out, rows(ref_out, 1), rows(base_out, 1))
            assert_within_baseline(f"{tag} lse", lse, rows(ref_lse, 2), rows(base_lse, 2))
            for name, grad in zip(("q", "k", "v"), grads):
                assert_within_baseline(f"{tag} d{name}", grad, rows(ref_grads[name], 1), rows(base_grads[name], 1))
            if bias is not None:
                dbias = grads[3]
                if bias.size(2) == 1:  # shared by every query: each rank holds its queries' part
                    dbias = dbias.float()
                    dist.all_reduce(dbias)
                    dbias = dbias.to(bias.dtype)
                assert_within_baseline(f"{tag} dbias", dbias, rows(ref_grads["bias"], 2), rows(base_grads["bias"], 2))
        # Every check of this rank passed (written before the barrier: past it, a peer's abort in
        # its teardown may get this rank terminated at any point).
        open(f"{init_file}.rank{rank}.passed", "w").close()
        # No rank closes its connections while a peer may still be reading from them.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(world_size):
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if not use_cuda and not dist.is_gloo_available():
        pytest.skip("needs gloo (or as many GPUs as ranks)")
    cases = [c for c in CASES if c[1] % (2 * world_size) == 0]
    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        try:
            torch.multiprocessing.spawn(_worker, args=(world_size, init_file, use_cuda, cases),
                                        nprocs=world_size, join=True)
        except torch.multiprocessing.ProcessExitedException as error:
            # In CI a gloo rank has aborted ("terminate called without an active exception") after
            # the last barrier, in the process group's or the interpreter's teardown (twice, the
            # second time with the barrier in place). That is gloo's, not the ring's: a rank that
            # fails a check raises, writes no marker and fails here as before.
            passed = [os.path.exists(f"{init_file}.rank{r}.passed") for r in range(world_size)]
            if error.signal_name is None or not all(passed):
                raise
            warnings.warn(f"every rank passed; rank {error.error_index} then died by {error.signal_name}")


def test_two_ranks_match_the_single_call():
    _run(2)


def test_four_ranks_match_the_single_call():
    _run(4)


def _capture_worker(rank, world_size, init_file):
    from flash_dmattn.distributed import context_parallel_attention

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    try:
        q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 16, 1, 64, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA-graph capture is not supported"):
            with torch.cuda.graph(graph):
                context_parallel_attention(q, k, k, is_causal=True)
    finally:
        dist.destroy_process_group()


def test_a_call_under_capture_raises_before_any_exchange(monkeypatch):
    from flash_dmattn import distributed

    monkeypatch.setattr(distributed, "_capturing", lambda query: True)
    q = torch.randn(1, 4, 2, 8, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="CUDA-graph capture is not supported"):
        distributed.context_parallel_attention(q, q[:, :, :1], q[:, :, :1])


def test_a_backward_under_capture_raises_before_any_exchange(monkeypatch, tmp_path):
    from flash_dmattn import distributed

    if not dist.is_gloo_available():
        pytest.skip("needs gloo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        q = torch.randn(1, 4, 2, 8, dtype=torch.float16, requires_grad=True)
        out = distributed.context_parallel_attention(q, q[:, :, :1], q[:, :, :1])
        monkeypatch.setattr(distributed, "_capturing", lambda query: True)
        with pytest.raises(RuntimeError, match="CUDA-graph capture is not supported"):
            out.sum().backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_capture_is_refused():
    with tempfile.TemporaryDirectory() as directory:
        torch.multiprocessing.spawn(_capture_worker, args=(1, os.path.join(directory, "init")), nprocs=1, join=True)


def test_zigzag_shards_put_back_together_are_the_tensor():
    from flash_dmattn.distributed import zigzag_shard

    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    world_size = 3
    shards = [zigzag_shard(x, 1, r, world_size) for r in range(world_size)]
    chunks = [None] * (2 * world_size)
    for r, s in enumerate(shards):
        chunks[r], chunks[2 * world_size - 1 - r] = s.chunk(2, 1)
    assert torch.equal(torch.cat(chunks, 1), x)
    with pytest.raises(ValueError, match="multiple of 2 x 5"):
        zigzag_shard(x, 1, 0, 5)
