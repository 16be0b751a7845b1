"""python -m flash_dmattn.bench: times ours against SDPA and FlexAttention on named suites.

    python -m flash_dmattn.bench --list
    python -m flash_dmattn.bench --suite training --suite seed --check
    python -m flash_dmattn.bench --suite decode --impl ours --impl flex --quick

Prints a table, merges the rows into benchmarks/results/<device>.json (key "bench_cli") and plots
the speedups of the sweeps to benchmarks/results/<device>_speedup.png. docs/benchmarks.md says
what every column means and how the times are taken. Without torch or a GPU it says that
everything is skipped and exits 0.
"""
import argparse
import os
import sys
from typing import List, Optional

from . import report, suites

IMPL_NAMES = ("ours", "ours_prepared", "ours_gather", "ours_tile", "ours_indices", "ours_packed", "ours_varlen", "ours_paged", "sdpa_efficient", "sdpa_cudnn", "sdpa_flash", "flex")


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flash_dmattn.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", action="append", choices=list(suites.SUITES),
                        help="suite to run (repeat for several); default: training")
    parser.add_argument("--list", action="store_true", help="print the cases of the suites (all without --suite)")
    parser.add_argument("--impl", action="append", choices=IMPL_NAMES,
                        help="implementation to time (repeat for several); default: every one available")
    parser.add_argument("--modes", default="fwd,bwd,fwd_bwd",
                        help="comma-separated subset of fwd, bwd, fwd_bwd (forward-only cases time fwd alone)")
    parser.add_argument("--check", action="store_true",
                        help="compare outputs and gradients with ours and a float64 reference; exit 1 on a mismatch")
    parser.add_argument("--kernels", action="store_true",
                        help="also profile each mode's calls (torch.profiler) and print their kernels' times and gaps")
    parser.add_argument("--quick", action="store_true", help="smaller suites (fewer, shorter points) for smoke runs")
    parser.add_argument("--max-cases", type=int, default=0, metavar="N", help="the first N cases of each suite")
    parser.add_argument("--case", action="append", metavar="TEXT",
                        help="only the cases whose name contains TEXT; repeat for several")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu runs the harness on CPU tensors (testing only: its times mean nothing)")
    parser.add_argument("--results-dir", default=os.path.join("benchmarks", "results"),
                        help="where <device>.json and <device>_speedup.png go (default: benchmarks/results)")
    parser.add_argument("--json", metavar="PATH",
                        help="results file to merge into, instead of <results-dir>/<device>.json")
    parser.add_argument("--no-save", action="store_true", help="write no JSON")
    parser.add_argument("--plot", metavar="PATH",
                        help="speedup plot path, instead of <results-dir>/<device>_speedup.png")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--replot", metavar="JSON",
                        help="only plot the rows stored in a results file (no torch, no GPU needed) and exit")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    parser.add_argument("--min-reps", type=int, default=5, help="timed calls at least (default 5)")
    parser.add_argument("--max-reps", type=int, default=30, help="timed calls at most (default 30)")
    parser.add_argument("--budget-ms", type=float, default=150.0,
                        help="aim for this much timed work per implementation and mode (default 150)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of every skipped implementation")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(suites.MODES)
    if unknown or not args.modes:
        parser.error(f"--modes: expected a subset of {','.join(suites.MODES)}, got {args.modes}")
    return args


def _environment(device_name: str):
    """(torch module, device, None) where the suites can run; else (None, None, why not)."""
    try:
        import torch
    except ImportError:
        return None, None, "torch is not installed (pip install torch)"
    if device_name == "cuda" and not torch.cuda.is_available():
        return None, None, "no CUDA GPU (torch.cuda.is_available() is False)"
    return torch, torch.device(device_name), None


def _selected(args) -> List[str]:
    chosen = args.impl or list(IMPL_NAMES)
    # ours first: the check compares against it and the "vs ours" column divides by it.
    return sorted(set(chosen), key=IMPL_NAMES.index)


def _all_skipped(suite_names: List[str], args, reason: str) -> int:
    print(f"flash_dmattn.bench: every implementation is skipped: {reason}")
    for suite in suite_names:
        count = len(suites.cases(suite, args.quick, args.max_cases))
        print(f"  {suite}: {count} cases skipped ({', '.join(_selected(args))})")
    print("nothing was timed; no results written")
    return 0


def _replot(args) -> int:
    """The plot of a results file's rows, e.g. on a machine with matplotlib after a GPU run without it."""
    device, rows = report.load_rows(args.replot, args.suite)
    path = args.plot or os.path.join(os.path.dirname(args.replot), report.device_file_name(device) + "_speedup.png")
    _plot(rows, path)
    return 0


def _plot(rows, path: str) -> None:
    """The speedup plot at `path` and the time plot beside it (report.times_path)."""
    for plot, where in ((report.plot_speedup, path), (report.plot_times, report.times_path(path))):
        try:
            why_not = plot(rows, where)
        except Exception as error:  # a plotting problem must not cost the run's other results
            why_not = f"{type(error).__name__}: {error}"
        print(f"plot: {where}" if why_not is None else f"plot skipped ({why_not})")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list:
        print(suites.listing(args.suite or list(suites.SUITES), args.quick, args.max_cases))
        return 0
    if args.replot:
        return _replot(args)
    suite_names = args.suite or ["training"]
    torch, device, reason = _environment(args.device)
    if reason:
        return _all_skipped(suite_names, args, reason)

    from . import check, harness, timing
    from .impls import IMPLEMENTATIONS

    impls = [IMPLEMENTATIONS[name] for name in _selected(args)]
    unavailable = {impl.name: why for impl in impls for why in [impl.unavailable(device)] if why}
    if len(unavailable) == len(impls):
        return _all_skipped(suite_names, args, "; ".join(f"{n}: {why}" for n, why in unavailable.items()))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    settings = timing.Settings(args.warmup, args.min_reps, args.max_reps, args.budget_ms)
    options = harness.Options(device, getattr(torch, args.dtype), settings, args.modes, args.check, args.seed,
                              args.verbose, args.kernels)
    clock = timing.Clock(device)

    plan = [(suite, case) for suite in suite_names for case in suites.cases(suite, args.quick, args.max_cases)
            if set(case.modes) & set(args.modes) and (not args.case or any(text in case.name for text in args.case))]
    clock_name = "CUDA-event" if device.type == "cuda" else "perf_counter (CPU: for testing only)"
    print(f"flash_dmattn.bench on {device_name}: torch {torch.__version__}, {args.dtype}, medians of {clock_name} "
          f"timings in ms; vs ours = total ms / ours' total ms; docs/benchmarks.md explains the columns", flush=True)
    progress = report.Progress(len(plan), enabled=not args.no_progress)
    rows_by_suite = {suite: [] for suite in suite_names}
    comparisons, errors, done = [], 0, {}
    for suite, case in plan:
        progress.step(f"{suite}: {case.name}")
        if case.key in done:  # one point of two sweeps: measured once
            rows = [{**row, **harness.case_row(case)} for row in done[case.key]]
        else:
            result = harness.run_case(case, impls, unavailable, options, clock)
            rows = done[case.key] = result.rows
            report.add_speedups(rows)
            comparisons += result.comparisons
            errors += result.errors
        rows_by_suite[suite] += rows
        # Each case's block as soon as it is measured: a long run shows its results as it goes.
        progress.write("\n" + report.format_table(rows))
        kernels = report.format_kernels(rows)
        if kernels:
            progress.write(kernels)
        progress.advance()
    progress.close()

    all_rows = [row for rows in rows_by_suite.values() for row in rows]
    proportional = report.proportionality(all_rows)
    if proportional:
        print("\n" + proportional)
    _save(args, argv, device, device_name, rows_by_suite, all_rows, torch.__version__)
    failed = check.failures(comparisons)
    if args.check:
        if failed:
            print(check.failure_report(failed), file=sys.stderr)
            print(check.failure_report(failed))
        else:
            print(f"check: {len(comparisons)} tensors compared, all within tolerance")
        margins = ", ".join(f"{impl} {ratio:.2f}" for impl, ratio in check.worst_margins(comparisons).items())
        print(f"check: largest error as a fraction of the tolerance: {margins or '-'}")
    if errors:
        print(f"flash_dmattn.bench: {errors} implementation(s) failed with an error (tracebacks above)",
              file=sys.stderr)
    return 1 if failed or errors else 0


def _save(args, argv: List[str], device, device_name: str, rows_by_suite: dict, all_rows: List[dict],
          torch_version: str) -> None:
    """The JSON and the plot; on the CPU only where a path is given (CPU times are not results)."""
    stem = os.path.join(args.results_dir, report.device_file_name(device_name))
    on_gpu = device.type == "cuda"
    json_path = args.json or (stem + ".json" if on_gpu else None)
    if json_path and not args.no_save:
        meta = report.run_meta(["python -m flash_dmattn.bench", *argv], torch_version, args.quick)
        keyed = {suite + ("-quick" if args.quick else ""): rows for suite, rows in rows_by_suite.items()}
        written = report.save_json(json_path, device_name, keyed, meta)
        print(f"results merged into {written} (key '{report.JSON_KEY}')")
    plot_path = args.plot or (stem + "_speedup.png" if on_gpu else None)
    if plot_path and not args.no_plot:
        _plot(all_rows, plot_path)


if __name__ == "__main__":
    sys.exit(main())
