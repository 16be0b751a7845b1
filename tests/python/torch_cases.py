"""Random attention problems for the torch tests, and their results through flash_dmattn_func and
through the reference (flash_dmattn.reference), gradients included."""
import torch

from flash_dmattn import attention_reference, flash_dmattn_func

GRAD_NAMES = ("q", "k", "v", "bias")


def route_fast_path(monkeypatch, module, name: str, taken: bool):
    """Forces a front's fast path, module.<name> (which returns None where it declines the call), off
    where not `taken`; otherwise records what it returns, in the list returned, for the test to check
    that it ran."""
    runs = []
    if not taken:
        monkeypatch.setattr(module, name, lambda *args: None)
    else:
        run = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args: runs.append(run(*args)) or runs[-1])
    return runs


def make_case(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=torch.bfloat16, device="cpu",
              mask_shape=None, bias_shape=None, bias_dtype=None, keep=0.8, seed=0):
    """q, k, v, an optional bool mask (about `keep` of the keys kept) and an optional bias."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dt)

    case = dict(q=randn(batch, seqlen_q, heads, head_dim), k=randn(batch, seqlen_k, kv_heads, head_dim),
                v=randn(batch, seqlen_k, kv_heads, head_dim), mask=None, bias=None)
    if mask_shape is not None:
        case["mask"] = (torch.rand(mask_shape, generator=generator) < keep).to(device)
    if bias_shape is not None:
        case["bias"] = randn(*bias_shape, dt=bias_dtype or dtype)
    return case


def _leaves(case, wrt):
    return {n: (t.detach().clone().requires_grad_(n in wrt) if n in GRAD_NAMES and t is not None else t)
            for n, t in case.items()}


def _grads(out, leaves, wrt, dout):
    if dout is None:
        return {}
    grads = torch.autograd.grad(out, [leaves[n] for n in wrt], dout.to(out.dtype))
    return dict(zip(wrt, grads))


def run_flash(case, dout=None, wrt=("q", "k", "v", "bias"), **options):
    """(out, lse, {name: grad}) from flash_dmattn_func; grads only when dout is given."""
    wrt = [n for n in wrt if case.get(n) is not None]
    t = _leaves(case, wrt)
    # (A build without the call's head dim raises NotImplementedError: conftest.py skips the test.)
    out, lse, _ = flash_dmattn_func(t["q"], t["k"], t["v"], attn_mask=t["mask"], attn_bias=t["bias"],
                                    return_attn_probs=True, **options)
    return out, lse, _grads(out, t, wrt, dout)


def run_reference(case, dout=None, wrt=("q", "k", "v", "bias"), upcast=True, is_causal=False, **options):
    """The same through the plain torch reference, in float64 (upcast) or the inputs' dtype."""
    wrt = [n for n in wrt if case.get(n) is not None]
    t = _leaves(case, wrt)
    out, lse = attention_reference(t["q"], t["k"], t["v"], t["mask"], t["bias"], causal=is_causal, upcast=upcast,
                                   **options)
    return out, lse, _grads(out, t, wrt, dout)
