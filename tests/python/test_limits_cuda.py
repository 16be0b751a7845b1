"""The edges of the shape space and of the runtime through the torch front: batch x heads past
CUDA's 65,535-CTA grid dimensions, the smallest problem, a million tokens, tensors on a device
that is not the current one, calls from several threads on streams of their own, running out of
memory, and torch.compile(mode="reduce-overhead") (CUDA graphs through inductor).

Skipped without torch or a GPU; the two-GPU case also without a second GPU.
"""
import threading

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flash_dmattn import flash_dmattn_func  # noqa: E402
from tolerance import assert_within_baseline  # noqa: E402
from torch_cases import make_case, run_flash, run_reference  # noqa: E402


def check_against_reference(case, dout, **options):
    out, lse, grads = run_flash(case, dout, **options)
    ref_out, ref_lse, ref_grads = run_reference(case, dout, **options)
    base_out, base_lse, base_grads = run_reference(case, dout, upcast=False, **options)
    assert_within_baseline("out", out, ref_out, base_out)
    assert_within_baseline("lse", lse, ref_lse, base_lse)
    for name, grad in grads.items():
        assert_within_baseline(f"d{name}", grad, ref_grads[name], base_grads[name])


def random_dout(case):
    return torch.randn(case["q"].shape, device=case["q"].device).to(case["q"].dtype)


@pytest.mark.parametrize("shape", [(1250, 16, 16, 80, 8, 64), (100000, 16, 16, 1, 1, 128)],
                         ids=["B1250xH80", "B100000xH1"])
def test_batch_times_heads_of_100000(shape):
    batch, seqlen_q, seqlen_k, heads, kv_heads, _ = shape
    case = make_case(*shape, device="cuda", mask_shape=(batch, heads, seqlen_q, seqlen_k),
                     bias_shape=(batch, kv_heads, 1, seqlen_k))
    check_against_reference(case, random_dout(case), is_causal=True)


def test_one_of_everything():
    case = make_case(1, 1, 1, 1, 1, 64, device="cuda", mask_shape=(1, 1, 1, 1), bias_shape=(1, 1, 1, 1), keep=1.0)
    check_against_reference(case, random_dout(case))
    check_against_reference(case, random_dout(case), is_causal=True)


def test_million_token_forward_on_its_last_rows():
    """Sq = Sk = 2^20 at D = 32, causal: the last 64 query rows (which see every key) against the
    reference of those rows alone, which bottom-right causal alignment makes the same problem."""
    n, rows = 1 << 20, 64
    case = make_case(1, n, n, 2, 1, 32, device="cuda", mask_shape=(1, 1, 1, n), bias_shape=(1, 1, 1, n))
    out, lse, _ = run_flash(case, is_causal=True)
    tail = dict(case, q=case["q"][:, -rows:])
    ref_out, ref_lse, _ = run_reference(tail, is_causal=True)
    base_out, base_lse, _ = run_reference(tail, upcast=False, is_causal=True)
    assert_within_baseline("out", out[:, -rows:], ref_out, base_out)
    assert_within_baseline("lse", lse[:, :, -rows:], ref_lse, base_lse)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_device_that_is_not_current():
    case = make_case(2, 100, 130, 4, 2, 64, device="cuda:0", mask_shape=(2, 2, 100, 130), bias_shape=(2, 2, 1, 130))
    dout = random_dout(case)
    on_0 = run_flash(case, dout, is_causal=True, deterministic=True)
    case_1 = {name: t.to("cuda:1") if t is not None else None for name, t in case.items()}
    with torch.cuda.device(0):
        on_1 = run_flash(case_1, dout.to("cuda:1"), is_causal=True, deterministic=True)
    assert on_1[0].device == torch.device("cuda:1")
    assert torch.equal(on_0[0], on_1[0].to("cuda:0"))
    for name, grad in on_0[2].items():
        assert torch.equal(grad, on_1[2][name].to("cuda:0")), name


def test_threads_on_streams_of_their_own_match_serial_calls():
    cases = [make_case(2, 150 + 50 * t, 260 + 40 * t, 4, 2, 64 if t % 2 else 128, device="cuda",
                       mask_shape=(2, 2, 150 + 50 * t, 260 + 40 * t), bias_shape=(2, 2, 1, 260 + 40 * t), seed=t)
             for t in range(4)]
    douts = [random_dout(c) for c in cases]
    alone = [run_flash(c, d, is_causal=True, deterministic=True) for c, d in zip(cases, douts)]
    torch.cuda.synchronize()
    together, errors = [None] * len(cases), []

    def work(t):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(3):
                    together[t] = run_flash(cases[t], douts[t], is_causal=True, deterministic=True)
            stream.synchronize()
        except Exception as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for t, (a, b) in enumerate(zip(alone, together)):
        assert torch.equal(a[0], b[0]), f"thread {t}: out"
        for name in a[2]:
            assert torch.equal(a[2][name], b[2][name]), f"thread {t}: d{name}"


def test_out_of_memory_is_a_clear_error_and_the_device_stays_usable():
    """With the card all but full, the call's allocations (outputs, workspace) fail with torch's
    OutOfMemoryError before any launch; once memory is back, the same call is right."""
    case = make_case(4, 2048, 2048, 16, 4, 128, device="cuda", mask_shape=(4, 4, 2048, 2048),
                     bias_shape=(4, 4, 1, 2048))
    dout = random_dout(case)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # blocks torch keeps cached would serve the call
    # Fill the card in ever smaller pieces until nothing is left: mem_get_info's free bytes proved
    # no sure guide (a hog of all but 2 MiB of them still left room for the call on an H100).
    hog = []
    for piece_mib in (1024, 64, 2):
        while True:
            try:
                hog.append(torch.empty(piece_mib << 20, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    assert hog
    try:
        with pytest.raises(torch.OutOfMemoryError):
            run_flash(case, dout, is_causal=True)
    finally:
        del hog
        torch.cuda.empty_cache()
    small = make_case(2, 256, 256, 4, 2, 64, device="cuda", mask_shape=(2, 2, 256, 256), bias_shape=(2, 2, 1, 256))
    check_against_reference(small, random_dout(small), is_causal=True)


def test_compile_reduce_overhead_matches_eager():
    case = make_case(2, 128, 192, 4, 2, 64, device="cuda", mask_shape=(2, 2, 128, 192), bias_shape=(2, 2, 1, 192))
    dout = random_dout(case)

    def step(q, k, v, mask, bias):
        return flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True, deterministic=True)

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    eager_leaves = {n: t.detach().clone().requires_grad_(n in ("q", "k", "v", "bias")) if t is not None else None
                    for n, t in case.items()}
    eager_out = step(*(eager_leaves[n] for n in ("q", "k", "v", "mask", "bias")))
    eager_grads = torch.autograd.grad(eager_out, [eager_leaves[n] for n in ("q", "k", "v", "bias")], dout)
    for _ in range(3):  # the first runs record the graph, the later ones replay it
        leaves = {n: t.detach().clone().requires_grad_(n in ("q", "k", "v", "bias")) if t is not None else None
                  for n, t in case.items()}
        out = compiled(*(leaves[n] for n in ("q", "k", "v", "mask", "bias")))
        grads = torch.autograd.grad(out, [leaves[n] for n in ("q", "k", "v", "bias")], dout)
        assert torch.equal(out, eager_out)
        for name, a, b in zip(("q", "k", "v", "bias"), grads, eager_grads):
            assert torch.equal(a, b), f"d{name}"
