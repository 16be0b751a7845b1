"""--check: every implementation's outputs and gradients against ours, and ours (and the others)
against a float64 reference on a few rows.

The rule, per tensor: max |actual - expected| over the compared elements must not exceed
TOLERANCE × max |expected| (plus 1e-6, for all-zero tensors). It is relative to the tensor's
magnitude because the tensors here differ in scale by orders (an output is a weighted mean of
values; a dbias of shape (B, Hk, 1, Sk) sums over every query row of a group). Two bf16
implementations differ by a few roundings of the output dtype (bf16's eps is 2^-8 = 3.9e-3) and of
the probabilities they multiply V with, so 2e-2 holds for outputs; gradients go through more
bf16 products and long sums, hence 5e-2. A bug (a mask ignored, a bias unscaled or doubled, a
head mapped wrong) moves values by their own size, far beyond either. A NaN among the compared
elements always fails.

Rows with no visible key are left out of row-indexed tensors (out, dq): SDPA returns NaN there,
ours and FlexAttention 0. Works on numpy arrays and torch tensors alike.
"""
from dataclasses import dataclass
from typing import Iterable, List

import numpy as np

# Relative tolerance per dtype: "out" for outputs, "grad" for dq, dk, dv and dbias.
TOLERANCE = {
    "bfloat16": {"out": 2e-2, "grad": 5e-2},
    "float16": {"out": 5e-3, "grad": 1.5e-2},   # 3 more mantissa bits than bf16
}
ABSOLUTE_FLOOR = 1e-6
ROW_INDEXED = ("out", "q")  # tensors laid out (B, Sq, H, D): the rows of empty queries are left out


@dataclass
class Comparison:
    impl: str
    case: str
    tensor: str       # "out", or the input whose gradient this is: "q", "k", "v", "bias"
    against: str      # what the expected values came from
    error: float      # max |actual - expected| over the compared elements
    scale: float      # max |expected| over the same elements
    tolerance: float
    nan: bool
    compared: int

    @property
    def ok(self) -> bool:
        return not self.nan and self.error <= self.tolerance * self.scale + ABSOLUTE_FLOOR

    @property
    def label(self) -> str:
        return "out" if self.tensor == "out" else f"d{self.tensor}"

    def message(self) -> str:
        if self.nan:
            detail = "NaN among the compared elements"
        else:
            detail = (f"max |diff| {self.error:.3g} > {self.tolerance:g} x max |expected| {self.scale:.3g} "
                      f"(relative {self.error / max(self.scale, ABSOLUTE_FLOOR):.3g})")
        return f"{self.impl} on '{self.case}': {self.label} differs from {self.against}: {detail}"


def tolerance(dtype: str, tensor: str) -> float:
    return TOLERANCE[dtype]["out" if tensor == "out" else "grad"]


def _upcast(array):
    return array.double() if hasattr(array, "double") else np.asarray(array, dtype=np.float64)


def compare(impl: str, case: str, tensor: str, actual, expected, dtype: str, keep=None,
            against: str = "ours") -> Comparison:
    """One tensor against its expected values; keep (bool over the leading dims) picks the rows compared."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"check: {impl} {tensor}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    actual, expected = _upcast(actual), _upcast(expected)
    if keep is not None:
        actual, expected = actual[keep], expected[keep]
    compared = int(np.prod(tuple(actual.shape)))
    if compared == 0:
        return Comparison(impl, case, tensor, against, 0.0, 0.0, tolerance(dtype, tensor), False, 0)
    diff = abs(actual - expected)
    # NaN != NaN: the one NaN test numpy and torch share.
    nan = bool((diff != diff).any())
    error = 0.0 if nan else float(diff.max())
    scale = float(abs(expected).max())
    return Comparison(impl, case, tensor, against, error, scale, tolerance(dtype, tensor), nan, compared)


def compare_all(impl: str, case: str, actual: dict, expected: dict, dtype: str, keep_rows=None,
                against: str = "ours") -> List[Comparison]:
    """Every tensor the two result dicts share, row-indexed ones restricted to keep_rows (B, Sq, H)."""
    return [compare(impl, case, name, actual[name], expected[name], dtype,
                    keep_rows if name in ROW_INDEXED else None, against)
            for name in expected if name in actual]


def verdict(comparisons: List[Comparison]) -> str:
    """The table's check column for one implementation and case."""
    if not comparisons:
        return "-"
    failed = [c.label for c in comparisons if not c.ok]
    return "FAIL " + ",".join(failed) if failed else "ok"


def relative_errors(comparisons: List[Comparison]) -> dict:
    """{tensor label: max |diff| / max |expected|} for the JSON ("fp64" marks the float64 reference;
    None stands for NaN, which JSON lacks)."""
    return {c.label + (" fp64" if "float64" in c.against else ""):
            (None if c.nan else round(c.error / max(c.scale, ABSOLUTE_FLOOR), 6)) for c in comparisons}


def worst_margins(comparisons: Iterable[Comparison]) -> dict:
    """{impl: the largest (relative error / tolerance)}: how close each implementation came to failing."""
    worst: dict = {}
    for c in comparisons:
        ratio = float("inf") if c.nan else c.error / max(c.scale, ABSOLUTE_FLOOR) / c.tolerance
        worst[c.impl] = max(worst.get(c.impl, 0.0), ratio)
    return worst


def failures(comparisons: Iterable[Comparison]) -> List[Comparison]:
    return [c for c in comparisons if not c.ok]


def failure_report(failed: List[Comparison]) -> str:
    """The loud message a failing --check ends with."""
    bar = "!" * 100
    lines = [bar, f"CHECK FAILED: {len(failed)} tensor(s) beyond tolerance (relative to max |expected|, "
                  "see docs/benchmarks.md)"]
    lines += [f"  {c.message()}" for c in failed]
    lines.append(bar)
    return "\n".join(lines)
