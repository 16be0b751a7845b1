"""What a run shows and keeps: the stdout table, the JSON under benchmarks/results/, the speedup
plot, and the progress bar on stderr. Plain Python; matplotlib and tqdm are optional."""
import datetime
import json
import os
import sys
from typing import Dict, List, Optional

from .suites import group_by_sweep

JSON_KEY = "bench_cli"

# (header, row key, width, format); None values print as "-".
COLUMNS = [
    ("impl", "impl", 15, "{}"),
    ("mode", "mode", 7, "{}"),
    ("ms", "ms", 9, "{:.3f}"),
    ("gpu ms", "gpu_ms", 8, "{:.3f}"),
    ("prep ms", "prep_ms", 8, "{:.3f}"),
    ("total ms", "total_ms", 9, "{:.3f}"),
    ("vs ours", "vs_ours", 8, "{:.2f}x"),
    ("dense TF/s", "dense_tflops", 10, "{:.1f}"),
    ("visit TF/s", "visited_tflops", 10, "{:.1f}"),
    ("tiles", "tile_density", 6, "{:.3f}"),
    ("peak MiB", "peak_mib", 9, "{:.0f}"),
    ("check", "check", 8, "{}"),
]


def device_file_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3', the name of benchmarks/results/*.json."""
    return device.strip().replace(" ", "_")


def add_speedups(rows: List[dict]) -> None:
    """Sets each row's vs_ours: its total ms over ours' for the same case and mode (> 1: ours is faster)."""
    ours = {(r["suite"], r["case"], r["mode"]): r["total_ms"] for r in rows
            if r["impl"] == "ours" and r.get("total_ms")}
    for row in rows:
        reference = ours.get((row["suite"], row["case"], row["mode"]))
        row["vs_ours"] = row["total_ms"] / reference if reference and row.get("total_ms") else None


_LEFT = ("impl", "mode", "check")  # text columns; numbers are right-aligned


def _align(text: str, key: str, width: int) -> str:
    return text.ljust(width) if key in _LEFT else text.rjust(width)


def _cell(row: dict, key: str, width: int, fmt: str) -> str:
    value = row.get(key)
    return _align("-" if value is None else fmt.format(value), key, width)


def format_table(rows: List[dict]) -> str:
    """One block per case: a title line, then a line per implementation and mode; skipped and failed
    rows carry their reason at the end of the line."""
    header = " ".join(_align(title, key, width) for title, key, width, _ in COLUMNS).rstrip()
    lines = []
    current = None
    for row in rows:
        if (row["suite"], row["case"]) != current:
            current = (row["suite"], row["case"])
            lines += ["", f"{row['suite']}: {row['case']}", header]
        cells = " ".join(_cell(row, key, width, fmt) for _, key, width, fmt in COLUMNS)
        note = "" if row["status"] == "ok" else row["status"]
        notes = "; ".join(filter(None, [note, *row.get("notes", [])]))
        lines.append(cells.rstrip() + (f"  {notes}" if notes else ""))
    return "\n".join(lines).lstrip("\n")


def format_kernels(rows: List[dict]) -> str:
    """Each row's kernel timeline (--kernels) on a line: kernel duration (gap before it) in us, and
    the call's span; empty where no row has one."""
    lines = []
    for row in rows:
        kernels = row.get("kernels")
        if not kernels:
            continue
        parts = " | ".join(f"{k['name']} {k['us']:.1f}" + (f" ({k['gap_us']:+.1f})" if i else "")
                           for i, k in enumerate(kernels))
        lines.append(f"  {row['impl']} {row['mode']} ({row['kernel_calls']} calls): span {row['span_us']:.1f} us = {parts}")
    if not lines:
        return ""
    return "kernels (us, medians of calls queued behind a sleep; (+gap) before a kernel):\n" + "\n".join(lines)


def proportionality(rows: List[dict]) -> str:
    """Per sweep, implementation and mode: each point's time over (its tile density / the densest
    point's) x the densest point's time, issue 26's measure of a time that follows the tile density
    (1.0: proportional; more: the sparser point pays for more than its tiles). GPU time where
    measured. Empty where no sweep has two points with a tile density."""
    def time(r: dict) -> Optional[float]:
        return r.get("gpu_ms") or r.get("ms")

    lines = []
    for name, group in group_by_sweep(rows).items():
        series: Dict[tuple, List[dict]] = {}
        for r in group:
            if r["status"] == "ok" and r.get("tile_density") and time(r):
                series.setdefault((r["impl"], r["mode"]), []).append(r)
        for (impl, mode), points in series.items():
            if len(points) < 2:
                continue
            densest = max(points, key=lambda r: r["tile_density"])
            ratios = ", ".join(f"{r['x']} {time(r) / time(densest) * densest['tile_density'] / r['tile_density']:.2f}x"
                               for r in sorted(points, key=lambda r: r["x"]))
            lines.append(f"  {name}, {impl} {mode}: {ratios}")
    if not lines:
        return ""
    return "\n".join(["time over tile density x the densest point's time (1.00x: proportional):", *lines])


# Decimals kept in the JSON per field: timings to 0.1 µs, rates to 0.01 TFLOP/s.
_DECIMALS = {"ms": 4, "gpu_ms": 4, "prep_ms": 4, "total_ms": 4, "vs_ours": 3, "dense_tflops": 2, "visited_tflops": 2,
             "tile_density": 4, "peak_mib": 1}


def rounded(row: dict) -> dict:
    return {k: round(v, _DECIMALS[k]) if k in _DECIMALS and isinstance(v, float) else v for k, v in row.items()}


def merge_results(existing: dict, suite_key: str, rows: List[dict], meta: dict) -> dict:
    """existing (a results file's JSON) with `rows` merged under existing[JSON_KEY][suite_key].

    Rows replace the stored ones of the same (case, impl, mode) and keep the others, so that a
    run of some implementations or cases does not drop the rest; every other key of the file is
    kept as it is.
    """
    merged = dict(existing)
    section = dict(merged.get(JSON_KEY, {}))
    old = section.get(suite_key, {})

    def identity(row):
        return row["case"], row["impl"], row["mode"]

    new_ids = {identity(r) for r in rows}
    kept = [r for r in old.get("rows", []) if identity(r) not in new_ids]
    section[suite_key] = {**meta, "rows": kept + [rounded(r) for r in rows]}
    merged[JSON_KEY] = section
    return merged


def save_json(path: str, device: str, rows_by_suite: Dict[str, List[dict]], meta: dict) -> str:
    """Merges the rows into the results file at path (created if missing); returns the path written.

    A file that is not JSON is left alone, and the rows go to <path>.bench_cli.json beside it:
    a run's results are never lost to a broken file.
    """
    data = {"device": device}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except ValueError:
            path, data = path + ".bench_cli.json", {"device": device}
    for suite_key, rows in rows_by_suite.items():
        data = merge_results(data, suite_key, rows, meta)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return path


def load_rows(path: str, suite_keys: Optional[List[str]] = None) -> tuple:
    """(device, rows) of a results file's bench_cli sections (those named, or all)."""
    with open(path) as f:
        data = json.load(f)
    sections = data.get(JSON_KEY, {})
    rows = [r for key, section in sections.items() if not suite_keys or key in suite_keys for r in section["rows"]]
    return data.get("device", "unknown"), rows


def run_meta(command: List[str], torch_version: Optional[str], quick: bool) -> dict:
    return {"date": datetime.date.today().isoformat(), "command": " ".join(command), "torch": torch_version,
            "quick": quick}


def plot_speedup(rows: List[dict], path: str) -> Optional[str]:
    """Writes the speedup of ours over each other implementation (its total ms / ours), against
    the x of every sweep (sequence length, window) and per mode. Returns why nothing was
    written, or None."""
    return _plot_sweeps([r for r in rows if r.get("vs_ours") and r["impl"] != "ours"], path, "vs_ours",
                        "speedup of ours (x)", 1.0, "no sweep with timings of ours and another implementation")


def plot_times(rows: List[dict], path: str) -> Optional[str]:
    """Writes every implementation's total ms (ours and ours_gather included) against the x of
    every sweep and per mode: how each one's time grows with the window or length. Returns why
    nothing was written, or None."""
    return _plot_sweeps([r for r in rows if r.get("total_ms")], path, "total_ms", "total ms", None,
                        "no sweep with timings")


def times_path(speedup_path: str) -> str:
    """The time plot's path beside a speedup plot's: <device>_times.png for <device>_speedup.png."""
    stem, extension = os.path.splitext(speedup_path)
    stem = stem[:-len("_speedup")] if stem.endswith("_speedup") else stem
    return stem + "_times" + (extension or ".png")


def _plot_sweeps(rows: List[dict], path: str, value: str, ylabel: str, reference: Optional[float],
                 empty: str) -> Optional[str]:
    """A panel per sweep and mode: rows[value] against x, a line per implementation, log axes."""
    groups = group_by_sweep(rows)
    if not groups:
        return empty
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install flash-dmattn[bench])"
    modes = [m for m in ("fwd", "bwd", "fwd_bwd") if any(r["mode"] == m for g in groups.values() for r in g)]
    figure, axes = plt.subplots(len(groups), len(modes), figsize=(5 * len(modes), 3.6 * len(groups)), squeeze=False)
    for axes_row, (title, group) in zip(axes, groups.items()):
        for ax, mode in zip(axes_row, modes):
            lines: Dict[str, list] = {}
            for r in group:
                if r["mode"] == mode:
                    # Lines per implementation, and per mask kind where a sweep has several (decode).
                    label = r["impl"] if len({g["mask"] for g in group}) == 1 else f"{r['impl']} ({r['mask']})"
                    lines.setdefault(label, []).append((r["x"], r[value]))
            for label, points in sorted(lines.items()):
                points.sort()
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            if reference is not None:
                ax.axhline(reference, color="gray", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{title} ({mode})", fontsize=9)
            ax.set_ylabel(ylabel)
            ax.set_xlabel(group[0]["sweep"].split(",")[0])
            if lines:
                ax.legend(fontsize=7)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


class Progress:
    """A progress bar on stderr: tqdm where it is installed and stderr is a terminal, a built-in bar
    on other terminals, and one line per step in logs (no carriage returns to garble them)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled and total > 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.bar = None
        if self.enabled and self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=self.stream, leave=False, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        """Announces the step about to run."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(text[:60])
        elif self.tty:
            filled = 30 * self.done // self.total
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {text[:70]:70}")
        else:
            self.stream.write(f"[{self.done + 1}/{self.total}] {text}\n")
        self.stream.flush()

    def write(self, text: str) -> None:
        """Prints text to stdout without garbling the bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
            return
        if self.enabled and self.tty:
            self.stream.write("\r" + " " * 110 + "\r")
            self.stream.flush()
        print(text, flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            self.stream.write("\r" + " " * 110 + "\r")
            self.stream.flush()
