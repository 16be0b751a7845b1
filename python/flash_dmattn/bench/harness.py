"""Runs one case: makes its tensors once, then per implementation the check (one forward and
backward, compared), the per-mask preparation time, and each mode's timing, into table rows.

Failures are contained per implementation. Out of memory, and any exception of a baseline (a
shape its backend refuses, a compiler failure), become "skipped (reason)" rows; an exception
from ours (but NotImplementedError: a head dim or dtype this build left out) becomes an "error"
row and makes the run exit non-zero. Tracebacks are printed for errors and for exceptions that
are not RuntimeErrors (a harness bug, an API that moved), and for every skip with --verbose.
"""
import sys
import traceback
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from . import check, flops, suites, timing
from .impls import OOM, Implementation, Ours, Runner, first_line
from .problem import Problem, make_problem, visibility

FP64_ROWS = 64  # query rows checked against the float64 reference (the last ones: the densest under causality)


@dataclass
class Options:
    device: torch.device
    dtype: torch.dtype
    settings: timing.Settings
    modes: tuple = ("fwd", "bwd", "fwd_bwd")   # the modes to time, where a case has them
    check: bool = False
    seed: int = 0
    verbose: bool = False
    kernels: bool = False  # each mode's kernel timeline (timing.kernel_timeline) into its row


@dataclass
class CaseResult:
    rows: List[dict]
    comparisons: List[check.Comparison] = field(default_factory=list)
    errors: int = 0


def case_row(case: suites.Case) -> dict:
    return {"suite": case.suite, "case": case.name, "batch": case.batch, "heads": case.heads,
            "kv_heads": case.kv_heads, "seqlen_q": case.seqlen_q, "seqlen_k": case.seqlen_k,
            "head_dim": case.head_dim, "causal": case.causal, "mask": case.mask, "window": case.window,
            "bias": case.bias, "sweep": case.sweep, "x": case.x}


def status_rows(case: suites.Case, impl: str, modes, status: str, notes=()) -> List[dict]:
    return [{**case_row(case), "impl": impl, "mode": mode, "status": status, "notes": list(notes)} for mode in modes]


def _steps(runner: Runner, mode: str, copies: list):
    """(prepare, run) for timing.measure: what is made untimed, and the timed work."""
    def grads(out, inputs):
        return torch.autograd.grad(out, [t for _, t in runner.grad_inputs(inputs)], runner.dout)

    if mode == "fwd":
        return (lambda i: copies[i]), (lambda inputs: runner.call(*inputs))
    if mode == "bwd":
        return (lambda i: (runner.call(*copies[i]), copies[i])), (lambda state: grads(*state))
    return (lambda i: copies[i]), (lambda inputs: grads(runner.call(*inputs), inputs))


def _visited(impl: Implementation, runner: Runner, case: suites.Case, pairs: dict, mode: str):
    """(visited-tile FLOPs, tile density) of impl on the case, for the rule in impls.Implementation.visits."""
    if impl.visits == "tiles":
        tiles = runner.tiles or impl.tiles(case.head_dim)
        (forward, forward_density), (backward, backward_density) = pairs[tiles["fwd"]], pairs[tiles["bwd"]]
        density = backward_density if mode == "bwd" else forward_density
        return flops.pass_flops(case.head_dim, forward, backward, mode), density
    every = case.batch * case.heads * (case.seqlen_q * case.seqlen_k if impl.visits == "all" else
                                       flops.causal_pairs(case.seqlen_q, case.seqlen_k, case.causal))
    return flops.pass_flops(case.head_dim, every, every, mode), (1.0 if impl.visits == "all" else None)


def _fp64_out(problem: Problem) -> tuple:
    """The float64 output of the last FP64_ROWS query rows (the causal limit is bottom-right
    aligned, so the last rows of q against all keys are the same problem), and how many rows."""
    from ..reference import attention_reference
    rows = min(FP64_ROWS, problem.case.seqlen_q)
    mask = problem.mask
    if mask is not None and mask.shape[2] > 1:
        mask = mask[:, :, -rows:]
    out, _ = attention_reference(problem.q[:, -rows:], problem.k, problem.v, mask, problem.bias,
                                 causal=problem.case.causal, upcast=True)
    return out, rows


class _Checker:
    """The expected values of one case, made on first use, and the comparisons."""

    def __init__(self, problem: Problem, keep_rows: torch.Tensor, grad: bool):
        self.problem, self.keep_rows, self.grad = problem, keep_rows, grad
        self.case_name = problem.case.name
        self.dtype = problem.dtype_name
        self.ours: Optional[dict] = None
        self._plain: Optional[dict] = None
        self._fp64 = None

    def plain(self) -> dict:
        """Ours without mask and bias: what the dense ceilings compute."""
        if self._plain is None:
            self._plain = Ours(use_mask=False, use_bias=False).runner(self.problem, self.grad).results(self.grad)
        return self._plain

    def fp64(self):
        if self._fp64 is None:
            self._fp64 = _fp64_out(self.problem)
        return self._fp64

    def compare(self, impl: Implementation, results: dict, ours_available: bool) -> List[check.Comparison]:
        name = impl.name
        if not impl.computes_case:
            if not ours_available:
                return []
            return check.compare_all(name, self.case_name, results, self.plain(), self.dtype,
                                     against="ours without mask and bias")
        comparisons = []
        if self.ours is not None and name != "ours":
            comparisons += check.compare_all(name, self.case_name, results, self.ours, self.dtype, self.keep_rows)
        reference, rows = self.fp64()
        comparisons.append(check.compare(name, self.case_name, "out", results["out"][:, -rows:], reference,
                                         self.dtype, self.keep_rows[:, -rows:],
                                         against=f"the float64 reference (last {rows} rows)"))
        return comparisons


def _classify(impl: Implementation, error: BaseException, verbose: bool) -> tuple:
    """(status, is_error) for an exception raised while running impl."""
    line = first_line(error)
    if isinstance(error, OOM):
        return "skipped (out of memory)", False
    is_error = impl.name == "ours" and not isinstance(error, NotImplementedError)
    if is_error or verbose or not isinstance(error, RuntimeError):
        print(f"{impl.name}:", file=sys.stderr)
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return (f"error ({line})", True) if is_error else (f"skipped ({line})", False)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_case(case: suites.Case, impls: List[Implementation], unavailable: dict, options: Options,
             clock: timing.Clock) -> CaseResult:
    """The rows of every implementation and mode of one case (and the check's comparisons)."""
    device = options.device
    wanted = [m for m in case.modes if m in options.modes]
    try:
        problem = make_problem(case, options.dtype, device, options.seed)
        tiles = [t for impl in impls if impl.visits == "tiles" for t in impl.tile_candidates(case.head_dim)]
        seen = visibility(problem, tiles)
    except OOM:
        _free(device)
        status = "skipped (out of memory making the inputs)"
        return CaseResult([r for impl in impls for r in status_rows(case, impl.name, wanted, status)])
    result = CaseResult([])
    checker = _Checker(problem, seen.rows, case.backward) if options.check else None
    if checker is not None and "ours" not in unavailable:
        try:
            checker.ours = Ours().runner(problem, case.backward).results(case.backward)
        except Exception as error:  # ours' own row reports it again below
            _classify(Ours(), error, options.verbose)
    for impl in impls:
        reason = unavailable.get(impl.name) or impl.unsupported(case, device)
        if reason:
            result.rows += status_rows(case, impl.name, wanted, f"skipped ({reason})")
            continue
        modes = list(wanted)
        backward_reason = impl.backward_unsupported(device) if case.backward else None
        rows: List[dict] = []
        if backward_reason:
            rows += status_rows(case, impl.name, [m for m in modes if m != "fwd"], f"skipped ({backward_reason})")
            modes = [m for m in modes if m == "fwd"]
        grad = case.backward and not backward_reason
        try:
            _run_impl(impl, problem, seen.pairs, modes, grad, checker, options, clock, result, rows)
        except Exception as error:
            status, is_error = _classify(impl, error, options.verbose)
            result.errors += is_error
            done = {r["mode"] for r in rows}
            rows += status_rows(case, impl.name, [m for m in modes if m not in done], status)
        result.rows += sorted(rows, key=lambda r: suites.MODES.index(r["mode"]))
        _free(device)
    return result


def _run_impl(impl: Implementation, problem: Problem, pairs: dict, modes: List[str], grad: bool,
              checker: Optional[_Checker], options: Options, clock: timing.Clock, result: CaseResult,
              rows: List[dict]) -> None:
    """Appends impl's rows (one per mode) to rows as they are measured."""
    runner = impl.runner(problem, grad)
    with runner.scope():
        _measure_impl(impl, runner, problem, pairs, modes, grad, checker, options, clock, result, rows)


def _measure_impl(impl: Implementation, runner: Runner, problem: Problem, pairs: dict, modes: List[str], grad: bool,
                  checker: Optional[_Checker], options: Options, clock: timing.Clock, result: CaseResult,
                  rows: List[dict]) -> None:
    case = problem.case
    verdict, errors = "-", None
    if checker is not None:
        results = checker.ours if impl.name == "ours" and checker.ours is not None else runner.results(grad)
        comparisons = checker.compare(impl, results, ours_available=checker.ours is not None)
        result.comparisons += comparisons
        verdict, errors = check.verdict(comparisons), check.relative_errors(comparisons)
        del results
    prep_ms = timing.wall_ms(clock, runner.rebuild, options.settings) if runner.rebuild else None
    copies_count, flush = timing.rotation(runner.footprint(), options.device)
    copies = [runner.inputs] + [runner.copy_inputs() for _ in range(copies_count - 1)]
    notes = list(runner.notes) + ([f"rotating {copies_count} input copies"] if copies_count > 1 else [])
    for mode in modes:
        prepare, run = _steps(runner, mode, copies)
        # A backward follows its own forward on the same inputs: flush whenever the inputs fit in L2.
        flush_mode = flush or (mode == "bwd" and copies_count > 1)
        measured = timing.measure(clock, prepare, run, copies_count, flush_mode, options.settings)
        timeline, timeline_note = None, []
        # Not where the queued timing gave up (a call that waits for the GPU): its gaps would be host time.
        if options.kernels and not (clock.cuda and measured.queued_ms is None):
            try:
                timeline = timing.kernel_timeline(clock, prepare, run, copies_count, flush_mode, measured.host_ms)
            except Exception as error:  # the timed row stands without it
                timeline_note = [f"no kernel timeline ({first_line(error)})"]
            else:
                timeline_note = [] if timeline is not None or not clock.cuda else ["no kernel timeline (no call's kernels)"]
        dense = flops.case_dense_flops(case, mode)
        visited, density = _visited(impl, runner, case, pairs, mode)
        # The per-mask preparation belongs to a step's forward; a backward reuses what it made.
        prep = prep_ms if mode != "bwd" else None
        rows.append({**case_row(case), "impl": impl.name, "mode": mode, "status": "ok", "ms": measured.ms,
                     "gpu_ms": measured.queued_ms, "prep_ms": prep, "total_ms": measured.ms + (prep or 0.0),
                     "dense_tflops": dense / measured.ms / 1e9,
                     "visited_tflops": visited / measured.ms / 1e9, "tile_density": density,
                     "peak_mib": None if measured.peak_bytes is None else measured.peak_bytes / 2**20,
                     "reps": measured.reps, "check": verdict, "check_errors": errors, "notes": notes + timeline_note,
                     **timeline_fields(timeline)})


def timeline_fields(timeline: Optional[timing.Timeline]) -> dict:
    """A row's record of its kernel timeline (none without one)."""
    if timeline is None:
        return {}
    return {"kernels": [{"name": k.name, "us": round(k.us, 2), "gap_us": round(k.gap_us, 2)} for k in timeline.kernels],
            "span_us": round(timeline.span_us, 2), "kernel_calls": timeline.calls}
