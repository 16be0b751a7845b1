"""flash_dmattn_func on CUDA tensors against the float64 torch reference, for the output, the lse and
all four gradients, with the tolerance of docs/semantics.md §8: at most twice the error of a plain
same-precision torch implementation, plus one rounding (tolerance.py).

Skipped without torch or without a GPU.
"""
import collections

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import flash_dmattn  # noqa: E402
from flash_dmattn import _C, flash_dmattn_func, torch_ops  # noqa: E402
from tolerance import assert_within_baseline  # noqa: E402
from torch_cases import make_case, run_flash, run_reference  # noqa: E402

# batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim
SHAPES = [
    (2, 128, 128, 8, 2, 64),     # square, GQA 4
    (1, 113, 203, 4, 4, 128),    # odd lengths, Sq < Sk
    (2, 200, 77, 6, 3, 32),      # Sq > Sk: causal leaves the first rows empty
    (3, 1, 300, 8, 1, 64),       # decode, MQA
    (1, 65, 63, 2, 1, 256),      # the largest head dim
    (1, 70, 90, 4, 2, 96),
]


def mask_bias_shapes(batch, seqlen_q, seqlen_k, heads, kv_heads):
    """(mask shape, bias shape) pairs over the broadcast forms of docs/semantics.md §2."""
    return [
        (None, None),
        ((batch, 1, 1, seqlen_k), (batch, kv_heads, 1, seqlen_k)),    # key padding + Doge-style bias
        ((1, kv_heads, seqlen_q, seqlen_k), (1, 1, seqlen_q, seqlen_k)),
        ((batch, heads, seqlen_q, seqlen_k), (batch, heads, seqlen_q, seqlen_k)),
        ((batch, heads, seqlen_q, 1), (batch, 1, 1, 1)),               # row switches; a bias that cancels
        (None, (1, heads, seqlen_q, 1)),
    ]


def check_against_reference(case, dout, **options):
    out, lse, grads = run_flash(case, dout, **options)
    ref_out, ref_lse, ref_grads = run_reference(case, dout, **options)
    base_out, base_lse, base_grads = run_reference(case, dout, upcast=False, **options)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    assert_within_baseline("out", out, ref_out, base_out)
    assert_within_baseline("lse", lse, ref_lse, base_lse)
    for name, grad in grads.items():
        assert grad.shape == case[name].shape and grad.dtype == case[name].dtype, name
        assert_within_baseline(f"d{name}", grad, ref_grads[name], base_grads[name])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("form", range(6))
@pytest.mark.parametrize("is_causal, softcap", [(False, 0.0), (True, 0.0), (True, 2.0)])
def test_autograd_matches_reference(shape, dtype, form, is_causal, softcap):
    batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim = shape
    mask_shape, bias_shape = mask_bias_shapes(batch, seqlen_q, seqlen_k, heads, kv_heads)[form]
    case = make_case(*shape, dtype=dtype, device="cuda", mask_shape=mask_shape, bias_shape=bias_shape)
    dout = torch.randn(case["q"].shape, device="cuda").to(dtype)
    check_against_reference(case, dout, is_causal=is_causal, softcap=softcap)


def test_larger_problem():
    case = make_case(2, 1024, 1024, 16, 4, 128, device="cuda", mask_shape=(2, 4, 1, 1024),
                     bias_shape=(2, 4, 1, 1024))
    check_against_reference(case, torch.randn(case["q"].shape, device="cuda").bfloat16(), is_causal=True)


def test_float32_bias_keeps_float32():
    case = make_case(2, 96, 160, 8, 2, 64, device="cuda", bias_shape=(2, 2, 1, 160), bias_dtype=torch.float32)
    dout = torch.randn(case["q"].shape, device="cuda").bfloat16()
    check_against_reference(case, dout, is_causal=True)


def test_only_the_bias_requires_grad():
    case = make_case(2, 64, 96, 4, 2, 64, device="cuda", bias_shape=(2, 2, 1, 96))
    dout = torch.randn(case["q"].shape, device="cuda").bfloat16()
    _, _, grads = run_flash(case, dout, wrt=("bias",))
    _, _, ref = run_reference(case, dout, wrt=("bias",))
    _, _, base = run_reference(case, dout, wrt=("bias",), upcast=False)
    assert list(grads) == ["bias"]
    assert_within_baseline("dbias", grads["bias"], ref["bias"], base["bias"])


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view whose base is one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def test_views_with_unaligned_rows_give_the_same_results():
    """q, k, v and dout whose rows are not whole 16-byte vectors are copied before the kernels'
    vector loads (the args' rows_aligned check): the results equal those of aligned tensors."""
    case = make_case(2, 33, 47, 4, 2, 64, device="cuda", mask_shape=(2, 2, 33, 47), bias_shape=(2, 2, 1, 47))
    dout = torch.randn(case["q"].shape, device="cuda").bfloat16()
    grads = []
    for views in (False, True):
        q, k, v = (_unaligned(case[n]) if views else case[n].clone() for n in ("q", "k", "v"))
        for t in (q, k, v):
            t.requires_grad_()
        out = flash_dmattn_func(q, k, v, attn_mask=case["mask"], attn_bias=case["bias"], is_causal=True)
        grads.append([out, *torch.autograd.grad(out, (q, k, v), _unaligned(dout) if views else dout)])
    for aligned, unaligned in zip(*grads):
        assert torch.equal(aligned, unaligned)


@pytest.mark.parametrize("head_dim", [4, 20, 100])
def test_padded_head_dims(head_dim):
    case = make_case(2, 50, 70, 4, 2, head_dim, device="cuda", mask_shape=(2, 1, 1, 70), bias_shape=(2, 2, 1, 70))
    check_against_reference(case, torch.randn(case["q"].shape, device="cuda").bfloat16(), is_causal=True)


def test_autocast_runs_float32_in_the_autocast_dtype():
    case = make_case(2, 64, 80, 4, 2, 64, dtype=torch.float32, device="cuda", bias_shape=(2, 2, 1, 80))
    dout = torch.randn(case["q"].shape, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _, grads = run_flash(case, dout, is_causal=True)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads.values())
    rounded = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in case.items()}
    ref_out, _, ref_grads = run_reference(rounded, dout, is_causal=True)
    base_out, _, base_grads = run_reference(rounded, dout, is_causal=True, upcast=False)
    assert_within_baseline("out", out, ref_out, base_out)
    for name, grad in grads.items():
        assert_within_baseline(f"d{name}", grad, ref_grads[name], base_grads[name])


def test_deterministic_backward_is_bitwise_repeatable():
    case = make_case(2, 256, 256, 8, 2, 64, device="cuda", bias_shape=(1, 1, 256, 256))
    dout = torch.randn(case["q"].shape, device="cuda").bfloat16()
    first = run_flash(case, dout, deterministic=True)[2]
    for _ in range(3):
        again = run_flash(case, dout, deterministic=True)[2]
        assert all(torch.equal(first[n], again[n]) for n in first)


def test_launches_on_the_current_stream():
    """Inputs written on a side stream behind a long sleep: a launch on any other stream would
    read them before they are written."""
    case = make_case(2, 128, 128, 4, 2, 64, device="cuda", bias_shape=(2, 2, 1, 128))
    expected = flash_dmattn_func(case["q"], case["k"], case["v"], attn_bias=case["bias"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        inputs = {n: torch.zeros_like(case[n]) for n in ("q", "k", "v", "bias")}
        torch.cuda._sleep(200_000_000)
        for n, t in inputs.items():
            t.copy_(case[n])
        out = flash_dmattn_func(inputs["q"], inputs["k"], inputs["v"], attn_bias=inputs["bias"])
    side.synchronize()
    assert torch.equal(out, expected)


def test_decode_with_a_workspace():
    """A decode call splits the keys (workspace from torch's allocator) and matches the reference."""
    case = make_case(1, 1, 8192, 32, 8, 128, device="cuda", mask_shape=(1, 8, 1, 8192), bias_shape=(1, 8, 1, 8192))
    out, lse = torch.empty_like(case["q"]), torch.empty(1, 32, 1, device="cuda")
    views = [_C.View(t.data_ptr(), "bfloat16", t.shape, t.stride(), "cuda", 0)
             for t in (case["q"], case["k"], case["v"], out)]
    args = _C.ForwardArgs(*views, _C.View(lse.data_ptr(), "float32", lse.shape, lse.stride(), "cuda", 0))
    assert _C.forward_workspace_size(args) > 0
    check_against_reference(case, None)


def test_decode_on_the_gather_path(monkeypatch):
    """A decode's one-row mask can take the gather path, whose splits share out the kept keys:
    forced, it matches the reference (a KV head that keeps no key included), backward too; a
    preparation chooses it for few keys and gives the same output bitwise."""
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "gather")
    case = make_case(1, 1, 8195, 32, 8, 128, device="cuda", mask_shape=(1, 8, 1, 8195), bias_shape=(1, 8, 1, 8195),
                     keep=0.03)
    case["mask"][:, 3] = False
    check_against_reference(case, torch.randn(case["q"].shape, device="cuda").bfloat16())
    gathered = flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=case["mask"], attn_bias=case["bias"])
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "auto")
    prepared = flash_dmattn.prepare_mask(case["q"], case["k"], case["v"], case["mask"])
    assert prepared.path == "gather"
    assert torch.equal(flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=prepared, attn_bias=case["bias"]),
                       gathered)


def test_mixed_devices_fail_before_launch():
    case = make_case(1, 8, 8, 2, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="argument 'attn_mask': expected the device of query"):
        flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=torch.ones(1, 1, 1, 8, dtype=torch.bool))


@pytest.mark.parametrize("path", ["tile", "gather"])
def test_prepared_mask_matches_the_mask(path, monkeypatch):
    """On both paths, a PreparedMask gives the bool mask's results bitwise (on the gather path the
    backward of a call with a bool mask reads the summary and lists its forward prepared). The
    shape keeps the gather backward's fp32 reductions to two per element, so their order cannot
    change a bit."""
    from test_torch_cpu import check_prepared_mask_matches_the_mask
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", path)
    case, t = check_prepared_mask_matches_the_mask("cuda")
    prepared = flash_dmattn.prepare_mask(t["q"], t["k"], t["v"], case["mask"], is_causal=True)
    assert prepared.nbytes > 0 and prepared.path == path


@pytest.mark.parametrize("path", ["tile", "gather"])
@pytest.mark.parametrize("seqlen_k", [200, 203])
def test_bit_packed_mask_matches_the_bool_mask(path, seqlen_k, monkeypatch):
    """On both paths the kernels read only the summary and row bits that the packed summary pass
    builds: out and lse bitwise as with the bool mask, the gradients within the reference's
    tolerance (the tile path's dQ is summed by atomics in any order); prepared, too."""
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", path)
    case = make_case(2, 130, seqlen_k, 4, 2, 32, device="cuda", mask_shape=(2, 2, 130, seqlen_k),
                     bias_shape=(2, 2, 1, seqlen_k), keep=0.3)
    dout = torch.randn(2, 130, 4, 32, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    out, lse, _ = run_flash(case, dout, is_causal=True)
    packed = dict(case, mask=flash_dmattn.pack_mask(case["mask"]))
    packed_out, packed_lse, packed_grads = run_flash(packed, dout, is_causal=True)
    assert torch.equal(packed_out, out) and torch.equal(packed_lse, lse)
    _, _, ref_grads = run_reference(case, dout, is_causal=True)
    _, _, base_grads = run_reference(case, dout, upcast=False, is_causal=True)
    for name, grad in packed_grads.items():
        assert_within_baseline(f"d{name}", grad, ref_grads[name], base_grads[name])
    prepared = flash_dmattn.prepare_mask(case["q"], case["k"], case["v"], packed["mask"], is_causal=True)
    assert torch.equal(flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=prepared, attn_bias=case["bias"],
                                         is_causal=True), out)


def test_prepared_mask_holds_the_lists_of_the_forward_that_reads_them(monkeypatch):
    """A preparation holds the key lists of the forward kernels that will run: with the sm90a
    gather forward (a build with it, on sm_90) its 128 x 128 lists beside the ones the backward
    reads (paths bit 2). Calls give what the bool mask gives, also after FLASH_DMATTN_KERNELS
    changed between the preparation and the call (the call then builds the lists it needs)."""
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "gather")
    monkeypatch.delenv("FLASH_DMATTN_KERNELS", raising=False)
    case = make_case(1, 333, 301, 4, 2, 64, device="cuda", mask_shape=(1, 2, 333, 301), bias_shape=(1, 2, 1, 301),
                     keep=0.1)
    q, k, v, mask, bias = case["q"], case["k"], case["v"], case["mask"], case["bias"]

    def call(attn_mask):
        return flash_dmattn_func(q, k, v, attn_mask=attn_mask, attn_bias=bias, is_causal=True)

    try:
        prepared = flash_dmattn.prepare_mask(q, k, v, mask, is_causal=True)
    except NotImplementedError as error:  # a build for fewer head dims (FLASH_DMATTN_HEAD_DIMS)
        pytest.skip(str(error))
    expected = call(mask)
    assert torch.equal(call(prepared), expected)
    monkeypatch.setenv("FLASH_DMATTN_KERNELS", "sm80")
    prepared_sm80 = flash_dmattn.prepare_mask(q, k, v, mask, is_causal=True)
    expected_sm80 = call(mask)
    assert torch.equal(call(prepared), expected_sm80)
    assert torch.equal(call(prepared_sm80), expected_sm80)
    monkeypatch.delenv("FLASH_DMATTN_KERNELS")
    assert torch.equal(call(prepared_sm80), expected)
    # The sm90a lists take room of their own where they exist.
    assert (prepared._prepared[2] & 4 != 0) == (prepared.nbytes > prepared_sm80.nbytes)


def _record_preparations(monkeypatch):
    """The `what` of each preparation torch_ops.attention makes, in a list."""
    made = []
    prepare = torch_ops._prepare

    def recording(q, k, v, mask, causal, what):
        made.append(what)
        return prepare(q, k, v, mask, causal, what)

    monkeypatch.setattr(torch_ops, "_prepare", recording)
    return made


def test_training_forward_holds_its_tile_summary_for_the_backward(monkeypatch):
    """An eager CUDA forward that autograd will differentiate prepares a mask with a row per query
    of at least _HELD_SUMMARY_MASK_BYTES itself (in deterministic mode the tile summary alone, no
    lists, no wait), and its backward reads that summary instead of the mask: outputs and
    gradients are bitwise those of calls that summarize the mask in each pass, and match the
    reference."""
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    case = make_case(2, 300, 290, 4, 2, 32, device="cuda", mask_shape=(2, 2, 300, 290), bias_shape=(2, 2, 1, 290),
                     keep=0.5)
    dout = torch.randn_like(case["q"])
    held = _record_preparations(monkeypatch)
    monkeypatch.setattr(torch_ops, "_HELD_SUMMARY_MASK_BYTES", 1 << 40)
    out, lse, grads = run_flash(case, dout, is_causal=True, deterministic=True)
    assert held == []
    monkeypatch.setattr(torch_ops, "_HELD_SUMMARY_MASK_BYTES", 0)
    held_out, held_lse, held_grads = run_flash(case, dout, is_causal=True, deterministic=True)
    assert held == ["tile_summary"]
    assert torch.equal(held_out, out) and torch.equal(held_lse, lse)
    for name, grad in grads.items():
        assert torch.equal(held_grads[name], grad), name
    check_against_reference(case, dout, is_causal=True)  # (the default mode, its choice deferred)
    assert held == ["tile_summary", "deferred_choice"]
    # No backward to come: the forward alone chooses its path on the device, as the training
    # forward does, and gives that forward's output bitwise.
    q = case["q"].detach().requires_grad_()
    trained = flash_dmattn_func(q, case["k"], case["v"], attn_mask=case["mask"], is_causal=True)
    assert held[-1] == "deferred_choice"
    with torch.no_grad():
        alone = flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=case["mask"], is_causal=True)
    assert held[2:] == ["deferred_choice", "deferred_choice"]
    assert torch.equal(alone, trained.detach())


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("arrival", ["arrived", "pending", "predicted"])
def test_training_backward_takes_the_gather_path_its_forward_prepared(arrival, head_dim, monkeypatch):
    """A training forward's preparation (MaskPreparation::deferred_choice) holds the key lists and
    copies their sizes back without waiting. The backward chooses its path from them as
    prepare_mask would where they have arrived; where not, as the latest call of the same shapes
    chose ("predicted"), and without one keeps the tile path ("pending"). Either way the
    gradients match the reference."""
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    monkeypatch.setattr(torch_ops, "_HELD_SUMMARY_MASK_BYTES", 0)
    monkeypatch.setattr(torch_ops, "_CHOSEN", {})
    monkeypatch.setattr(torch_ops, "_AWAITED", collections.deque(maxlen=4))
    batch, seqlen, heads, kv_heads = 2, 384, 4, 2
    case = make_case(batch, seqlen, seqlen, heads, kv_heads, head_dim, device="cuda",
                     bias_shape=(batch, kv_heads, 1, seqlen))
    # The same 24 scattered keys for every row of a head (as top-k of a bias row), causal: every
    # tile of the mask partly visible, few keys per query tile.
    rank = torch.rand(batch, kv_heads, 1, seqlen, generator=torch.Generator().manual_seed(3)).argsort(-1).argsort(-1)
    case["mask"] = (rank < 24).expand(batch, kv_heads, seqlen, seqlen).contiguous().cuda()
    dout = torch.randn_like(case["q"])
    held = _record_preparations(monkeypatch)
    chosen, arrive = [], [arrival == "arrived"]
    paths = torch_ops._PendingChoice.paths

    def choosing(self, bits):
        if arrive[0]:
            self.arrived.synchronize()
        else:
            self.arrived = type("NotYet", (), {"query": lambda _: False})()
        chosen.append(paths(self, bits))
        return chosen[-1]

    monkeypatch.setattr(torch_ops._PendingChoice, "paths", choosing)
    if arrival == "predicted":  # an earlier call of the same shapes whose sizes arrived
        arrive[0] = True
        run_flash(case, dout, is_causal=True)
        arrive[0] = False
        del chosen[:], held[:]
    check_against_reference(case, dout, is_causal=True)
    assert held == ["deferred_choice_with_lists" if arrival == "predicted" else "deferred_choice"]
    assert len(chosen) == 1
    pending, backward_paths = torch_ops._CHOICE_PENDING, torch_ops._BACKWARD_PATHS
    if arrival == "arrived":  # as a preparation that waits for the sizes chooses
        assert not chosen[0] & pending and chosen[0] & backward_paths, chosen[0]
        full = torch_ops.prepare(case["q"], case["k"], case["v"], case["mask"], True)[2]
        assert chosen[0] & backward_paths == full & backward_paths, (chosen[0], full)
    elif arrival == "predicted":
        assert chosen[0] & pending and chosen[0] & backward_paths, chosen[0]
    else:
        assert chosen[0] & pending and not chosen[0] & backward_paths, chosen[0]


@pytest.mark.parametrize("kernels", ["auto", "sm80"])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_training_forward_chooses_its_path_on_the_device(head_dim, kernels, monkeypatch):
    """A training forward whose preparation defers the choice of paths (deferred_choice) makes
    the forward's choice on the device from the lists' sizes (choose_gather_path in key_lists.h),
    without waiting: a scattered mask's output is bitwise the forced gather path's, a full mask's
    the forced tile path's. (A grid that fills an H100 or H200 on either path: a forward whose
    keys would be split across CTAs keeps the tile path.) The sm80 kernels start early
    (programmatic dependent launch) and read the flag after waiting for the kernel before them."""
    monkeypatch.setattr(torch_ops, "_HELD_SUMMARY_MASK_BYTES", 0)
    if kernels == "sm80":
        monkeypatch.setenv("FLASH_DMATTN_KERNELS", "sm80")
    else:
        monkeypatch.delenv("FLASH_DMATTN_KERNELS", raising=False)
    monkeypatch.setattr(torch_ops, "_CHOSEN", {})
    batch, seqlen, heads, kv_heads = 2, 1024, 16, 4
    case = make_case(batch, seqlen, seqlen, heads, kv_heads, head_dim, device="cuda",
                     bias_shape=(batch, kv_heads, 1, seqlen))
    rank = torch.rand(batch, kv_heads, 1, seqlen, generator=torch.Generator().manual_seed(5)).argsort(-1).argsort(-1)
    scattered = (rank < 24).expand(batch, kv_heads, seqlen, seqlen).contiguous().cuda()

    def training_forward(mask):
        q = case["q"].detach().clone().requires_grad_()
        return flash_dmattn_func(q, case["k"], case["v"], attn_mask=mask, attn_bias=case["bias"],
                                 is_causal=True).detach()

    held = _record_preparations(monkeypatch)
    for mask, path in ((scattered, "gather"), (torch.ones_like(scattered), "tile")):
        monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
        del held[:]
        chosen = training_forward(mask)
        assert held == ["deferred_choice"]
        monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", path)
        assert torch.equal(training_forward(mask), chosen), path


def test_auto_path_prepares_the_gather_path_for_few_keys_only(monkeypatch):
    """Under FLASH_DMATTN_SPARSE_PATH=auto (the default) a preparation takes the gather path where
    the key lists hold at most a measured share of the causal span (src/cuda/sparse_path.h: 0.5 for
    the sm80 gather forward and at D32, 0.9 for the sm90a one above D32), the tile path for a full mask, and the tile path during CUDA-graph capture, where it cannot wait
    for the lists' sizes. Its calls then give what the forced path gives."""
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    case = make_case(1, 512, 512, 2, 1, 32, device="cuda", bias_shape=(1, 1, 1, 512))
    q, k, v = case["q"], case["k"], case["v"]
    keep = torch.zeros(512, dtype=torch.bool)
    keep[torch.randperm(512, generator=torch.Generator().manual_seed(1))[:24]] = True
    sparse = keep.expand(1, 1, 512, 512).contiguous().cuda()  # every query tile lists at most 24 keys
    full = torch.ones(1, 1, 512, 512, dtype=torch.bool, device="cuda")
    try:
        prepared = flash_dmattn.prepare_mask(q, k, v, sparse, is_causal=True)
    except NotImplementedError as error:  # a build for fewer head dims (FLASH_DMATTN_HEAD_DIMS)
        pytest.skip(str(error))
    assert (prepared.path, prepared.backward_path) == ("gather", "gather")
    # A full mask lists every key of the span: the tile path both ways, whatever the heads
    # (kGatherForwardShare, kD32GatherBackwardShare).
    dense = flash_dmattn.prepare_mask(q, k, v, full, is_causal=True)
    assert (dense.path, dense.backward_path) == ("tile", "tile")
    assert (prepared.backward_path_unpaired, dense.backward_path_unpaired) == ("gather", "tile")
    leaves = {n: case[n].clone().requires_grad_() for n in ("q", "k", "v", "bias")}
    dout = torch.randn_like(q)

    def run(mask):
        out = flash_dmattn_func(leaves["q"], leaves["k"], leaves["v"], attn_mask=mask, attn_bias=leaves["bias"],
                                is_causal=True)
        return (out, *torch.autograd.grad(out, list(leaves.values()), dout))

    auto = run(prepared)
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "gather")
    gather = run(sparse)
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "tile")
    tile = run(sparse)
    assert torch.equal(auto[0], gather[0])  # the same kernel over the same lists
    # Each path within the project's rule of the float64 reference, not against each other at a
    # fixed tolerance: dbias sums dZ over every (query, head), and each path's Δ = rowsum(dO∘O)
    # reads its own rounding of O (the tile and gather dbias differed by up to 0.047 here).
    masked = dict(case, mask=sparse)
    ref_out, _, ref = run_reference(masked, dout, is_causal=True)
    base_out, _, base = run_reference(masked, dout, upcast=False, is_causal=True)
    for path, results in (("auto", auto), ("gather", gather), ("tile", tile)):
        assert_within_baseline(f"{path}: out", results[0], ref_out, base_out)
        for name, grad in zip(("q", "k", "v", "bias"), results[1:]):
            assert_within_baseline(f"{path}: d{name}", grad, ref[name], base[name])
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_dmattn.prepare_mask(q, k, v, sparse, is_causal=True)
    assert (captured.path, captured.backward_path) == ("tile", "tile")


def _captured_and_replayed(call):
    """What call() returns when captured in a CUDA graph (after a warm-up on a side stream, as
    torch.cuda.graphs asks) and the graph replayed once; and the graph, which the caller keeps
    while it reads the result."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    return captured, graph


def test_inference_forward_chooses_its_path_on_the_device(monkeypatch):
    """A forward without gradient prepares a mask of at least _HELD_SUMMARY_MASK_BYTES itself
    (deferred_choice) and its kernels choose the path on the device: a scattered mask's output is
    the forced gather path's, a full mask's the forced tile path's, bitwise; and so in a CUDA
    graph, whose capture cannot wait for anything. The seed's shape: the device chooses only
    where neither path splits the keys across CTAs (a grid of at least a wave)."""
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    n = 16384
    case = make_case(1, n, n, 2, 1, 32, device="cuda", bias_shape=(1, 1, 1, n))
    q, k, v, bias = case["q"], case["k"], case["v"], case["bias"]
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:24]] = True
    sparse = keep.expand(1, 1, n, n).contiguous().cuda()
    full = torch.ones(1, 1, n, n, dtype=torch.bool, device="cuda")
    assert torch_ops._mask_bytes(sparse) >= torch_ops._HELD_SUMMARY_MASK_BYTES

    def call(mask):
        with torch.no_grad():
            return flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=True)

    held = _record_preparations(monkeypatch)
    try:
        chosen = {"gather": call(sparse), "tile": call(full)}
    except NotImplementedError as error:  # a build for fewer head dims (FLASH_DMATTN_HEAD_DIMS)
        pytest.skip(str(error))
    assert held == ["deferred_choice", "deferred_choice"]
    for path, mask in (("gather", sparse), ("tile", full)):
        monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", path)
        assert torch.equal(chosen[path], call(mask)), path
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH")
    assert len(held) == 2  # (a forced path prepares nothing)
    captured, _graph = _captured_and_replayed(lambda: call(sparse))
    assert torch.equal(captured, chosen["gather"])


def test_inference_forward_on_uneven_lists(monkeypatch):
    """The seed's shape with key lists of every length: the first 2048 query rows keep every causal
    key (up to 16 chunks of 128 keys a tile), rows 2048 to 4095 none (empty lists, whose CTAs
    write O = 0 and LSE = +inf without a pipeline), the rest 24 keys scattered above 4096. The
    device chooses the gather path (bitwise the forced one's output); out and LSE are within the
    project's rule of the float64 reference, and bitwise equal on a rerun and in a CUDA graph."""
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    n, dense_rows, empty_rows = 16384, 2048, 4096
    case = make_case(1, n, n, 2, 1, 32, device="cuda", bias_shape=(1, 1, 1, n))
    keep = torch.zeros(n, dtype=torch.bool)
    keep[empty_rows + torch.randperm(n - empty_rows, generator=torch.Generator().manual_seed(2))[:24]] = True
    mask = keep.expand(1, 1, n, n).clone()
    mask[:, :, :dense_rows] = True
    case["mask"] = mask.cuda()

    def call():
        with torch.no_grad():
            return flash_dmattn_func(case["q"], case["k"], case["v"], attn_mask=case["mask"], attn_bias=case["bias"],
                                     is_causal=True, return_attn_probs=True)[:2]

    held = _record_preparations(monkeypatch)
    try:
        out, lse = call()
    except NotImplementedError as error:  # a build for fewer head dims (FLASH_DMATTN_HEAD_DIMS)
        pytest.skip(str(error))
    assert held == ["deferred_choice"]
    assert torch.isinf(lse[:, :, dense_rows:empty_rows]).all() and not out[:, dense_rows:empty_rows].any()
    again = call()
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "gather")
    assert torch.equal(call()[0], out)
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH")
    captured, _graph = _captured_and_replayed(call)
    assert torch.equal(captured[0], out) and torch.equal(captured[1], lse)
    ref_out, ref_lse, _ = run_reference(case, is_causal=True)
    base_out, base_lse, _ = run_reference(case, upcast=False, is_causal=True)
    assert_within_baseline("out", out, ref_out, base_out)
    assert_within_baseline("lse", lse, ref_lse, base_lse)


def test_auto_path_keeps_a_window_on_the_tile_path(monkeypatch):
    """A sliding window lists the keys of its visible tiles, which are full: the gather path would
    visit as many keys at a higher price per key (src/cuda/sparse_path.h, gather_pays), though its
    lists hold a small share of the causal span. The same keys scattered go to the gather path."""
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    s, width = 1024, 128
    case = make_case(1, s, s, 2, 1, 64, device="cuda", bias_shape=(1, 1, 1, s))
    q, k, v = case["q"], case["k"], case["v"]
    i = torch.arange(s, device="cuda")
    window = ((i[:, None] - i[None, :]) < width).expand(1, 1, s, s)
    try:
        prepared = flash_dmattn.prepare_mask(q, k, v, window, is_causal=True)
    except NotImplementedError as error:  # a build for fewer head dims (FLASH_DMATTN_HEAD_DIMS)
        pytest.skip(str(error))
    assert (prepared.path, prepared.backward_path) == ("tile", "tile")
    keep = torch.zeros(s, dtype=torch.bool)
    keep[torch.randperm(s, generator=torch.Generator().manual_seed(2))[:width]] = True
    scattered = flash_dmattn.prepare_mask(q, k, v, keep.expand(1, 1, s, s).contiguous().cuda(), is_causal=True)
    assert (scattered.path, scattered.backward_path) == ("gather", "gather")


def test_opcheck_on_cuda():
    """Schema, fake implementation and autograd registration of the ops, checked on CUDA tensors."""
    case = make_case(2, 40, 56, 4, 2, 64, device="cuda", mask_shape=(2, 1, 1, 56), bias_shape=(2, 2, 1, 56))
    q, k, v, bias = (case[n].requires_grad_() for n in ("q", "k", "v", "bias"))
    try:  # opcheck would wrap a refusal of this build (FLASH_DMATTN_HEAD_DIMS) as a failure
        with torch.no_grad():
            torch_ops.forward(q, k, v, case["mask"], bias, None, True, 0.0, True)
    except NotImplementedError as error:
        pytest.skip(str(error))
    torch.library.opcheck(torch_ops.forward, (q, k, v, case["mask"], bias, None, True, 0.0, True))
