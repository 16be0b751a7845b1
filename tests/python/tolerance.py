"""How close a torch result must be to the float64 reference (docs/semantics.md §8).

Two rules, one per kind of backend:
- rounded: the CPU backend computes in float64, so each output is off by at most one rounding
  into its dtype;
- within_baseline: a GPU kernel may err at most twice as much as a plain same-precision torch
  implementation does (reference.py with upcast=False), plus one rounding of the output dtype.
The error is the maximum absolute difference, per output; no "most elements close" rule.
"""
import torch


def _split_inf(actual, expected, name):
    """Infinite entries (the +inf lse of empty rows) must match exactly; the rest is compared."""
    actual, expected = actual.double(), expected.double()
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf) and torch.equal(actual[inf], expected[inf]), \
        f"{name}: infinities differ"
    return actual.masked_fill(inf, 0), expected.masked_fill(inf, 0)


def rounding(dtype: torch.dtype, expected: torch.Tensor) -> float:
    """One rounding into dtype, at the size of the largest expected value."""
    return torch.finfo(dtype).eps * max(expected.abs().max().item(), 1e-2) if expected.numel() else 0.0


def assert_rounded(name, actual, expected):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = _split_inf(actual, expected, name)
    error = (a - e).abs().max().item() if e.numel() else 0.0
    assert error <= 2 * rounding(actual.dtype, e), f"{name}: error {error:.3g} exceeds one rounding"


def assert_within_baseline(name, actual, expected, baseline, factor=2.0):
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = _split_inf(actual, expected, name)
    b = baseline.double().masked_fill(torch.isinf(expected), 0)
    if not e.numel():
        return
    error = (a - e).abs().max().item()
    base = (b - e).abs().max().item()
    bound = factor * base + rounding(actual.dtype, e)
    assert error <= bound, f"{name}: error {error:.3g} > {factor} x baseline {base:.3g} + rounding"
