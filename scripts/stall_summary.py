#!/usr/bin/env python3
"""Where a kernel's warps wait, from Nsight Compute's per-instruction source table.

ncu's PC sampling (the WarpStateStats and SourceCounters sections) gives every SASS instruction
its warp samples split by stall reason. Exported as CSV,

    ncu -k regex:NAME -c 1 --section WarpStateStats --section SourceCounters -o report ./program
    ncu -i report.ncu-rep --page source --csv --print-source sass > sass.csv

this prints the samples by stall reason, by opcode (each with its two main reasons) and the
hottest instructions with their index in the listing; --ranges sums named spans of that index,
for example the phases of a main loop found from the hottest instructions:

    python3 scripts/stall_summary.py sass.csv
    python3 scripts/stall_summary.py sass.csv --ranges "top:1750-2500,reductions:9500-10500"

How the sm90a gather backward's chunk was split this way: docs/architecture.md, "Where a chunk's
time goes".
"""
import argparse
import csv
import sys
from collections import Counter
from typing import Dict, List, Tuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_table(path: str) -> Tuple[List[str], List[List[str]]]:
    """The header and rows of the instruction table (ncu puts a "Kernel Name" line above it)."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    for i, row in enumerate(rows):
        if SAMPLES in row and "Source" in row:
            header = row
            return header, [r for r in rows[i + 1:] if len(r) >= len(header)]
    raise ValueError(f"stall_summary: {path}: no column '{SAMPLES}' (ncu --page source --csv --print-source sass)")


def number(text: str) -> int:
    try:
        return int(float(text))
    except ValueError:
        return 0


def opcode(sass: str) -> str:
    """The instruction's opcode without its modifiers or predicate: '@P0 FSEL R1, ...' -> 'FSEL'."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def parse_ranges(text: str) -> List[Tuple[str, int, int]]:
    ranges = []
    for item in filter(None, text.split(",")):
        name, _, span = item.rpartition(":")
        first, _, last = span.partition("-")
        if not name or not first.isdigit() or not last.isdigit() or int(first) > int(last):
            raise ValueError(f"stall_summary: argument '--ranges': expected NAME:FIRST-LAST items, got '{item}'")
        ranges.append((name, int(first), int(last)))
    return ranges


def row_reasons(row: List[str], column: Dict[str, int], reasons: List[str], samples: int) -> Counter:
    """An instruction's samples by reason; those the table names no reason for (an HGMMA's wait
    for the tensor pipe, for one) as stall_unlisted."""
    counts = Counter({reason: number(row[column[reason]]) for reason in reasons})
    counts["stall_unlisted"] = max(0, samples - sum(counts.values()))
    return counts


def summarize(header: List[str], rows: List[List[str]], top: int, ranges: List[Tuple[str, int, int]]) -> str:
    column = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = [number(r[column[SAMPLES]]) for r in rows]
    per_row = [row_reasons(row, column, reasons, count) for row, count in zip(rows, samples)]
    total = sum(samples) or 1
    by_reason: Counter = Counter()
    by_opcode: Counter = Counter()
    opcode_reasons: Dict[str, Counter] = {}
    for row, count, mine in zip(rows, samples, per_row):
        op = opcode(row[column["Source"]])
        by_opcode[op] += count
        opcode_reasons.setdefault(op, Counter()).update(mine)
        by_reason.update(mine)

    def share(value: int) -> str:
        return f"{100.0 * value / total:5.1f}%"

    def main_reasons(counter: Counter, n: int = 2) -> str:
        return ", ".join(f"{r[len('stall_'):]} {share(v).strip()}" for r, v in counter.most_common(n) if v)

    lines = [f"{len(rows)} instructions, {sum(samples)} warp samples"]
    lines.append("by stall reason:")
    lines += [f"  {reason[len('stall_'):]:20s} {share(v)}" for reason, v in by_reason.most_common() if v]
    lines.append("by opcode (main reasons):")
    lines += [f"  {op:12s} {share(v)}  {main_reasons(opcode_reasons[op])}" for op, v in by_opcode.most_common(top)]
    if ranges:
        lines.append("by range of instruction index:")
        for name, first, last in ranges:
            span = Counter()
            for mine in per_row[first:last + 1]:
                span.update(mine)
            lines.append(f"  {name:20s} {first}-{last} {share(sum(samples[first:last + 1]))}  {main_reasons(span, 3)}")
    lines.append("hottest instructions (index, share, executed, SASS, main reasons):")
    for i in sorted(sorted(range(len(rows)), key=lambda i: -samples[i])[:top]):
        row = rows[i]
        executed = row[column[EXECUTED]] if EXECUTED in column else "-"
        lines.append(f"  {i:6d} {share(samples[i])} {executed:>9s}  {row[column['Source']].strip()[:60]:60s}  "
                     f"{main_reasons(per_row[i])}")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=20, help="opcodes and instructions to list (default 20)")
    parser.add_argument("--ranges", default="", help="NAME:FIRST-LAST,... spans of instruction index to sum")
    args = parser.parse_args(argv)
    try:
        header, rows = read_table(args.table)
        print(summarize(header, rows, args.top, parse_ranges(args.ranges)))
    except (OSError, ValueError) as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
