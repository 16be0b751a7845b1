#!/usr/bin/env python3
"""Lists the kernels of a build that have a stack frame (register spills or local arrays) and fails
where one of the checked architecture does.

A kernel's frame is what ptxas gave it in local memory: spilled registers, or arrays indexed at run
time. Either puts loads and stores to local memory (L1, then L2) inside loops that should run from
registers, which is how the sm90a kernels lost their speed before (docs/architecture.md, "The sm90a
gather forward"). cuobjdump reads the frame of every kernel from the compiled objects:

    python3 scripts/check_spills.py build                   # sm_90a kernels of build/'s libraries
    python3 scripts/check_spills.py --arch sm_80 build      # the sm80 ones
    python3 scripts/check_spills.py path/to/object.o ...    # objects or archives
    python3 scripts/check_spills.py --lines build           # and where their local loads and
                                                            # stores come from, by source line

--lines reads the kernels' machine code with nvdisasm and counts each framed kernel's local-memory
instructions (LDL, STL) by the source line its line table gives them (builds carry -lineinfo).
That is where the spill survey of docs/architecture.md ("Open design points") comes from. With
inlining, a line of a shared header may stand for several callers, and a loop compiled once per
logit kind shows its kinds summed.

Exit status: 0 when no kernel of the architecture has a frame, 1 when one does, 2 when there is
nothing to read (no cuobjdump, no compiled kernels of that architecture).
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Dict, List, Tuple

FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
# A kernel's code starts at its label: ".text.<name>:" or "<name>:" (mangled names start with _Z).
SECTION = re.compile(r"^\s*(?:\.text\.)?(_Z\S+):")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
LOCAL = re.compile(r"\b(LDL|STL)(\.\S+)?\s")
USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
ARCH = re.compile(r"^\s*arch = (\S+)\s*$")


def find_tool(name: str) -> str:
    for candidate in (shutil.which(name), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name)):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return ""


def inputs(paths: List[str]) -> List[str]:
    """The objects to read: files as given, and for a build directory its kernel libraries."""
    found = []
    for path in paths:
        if os.path.isdir(path):
            found += sorted(glob.glob(os.path.join(path, "**", "libflash_dmattn_kernels*.a"), recursive=True))
        else:
            found.append(path)
    return found


def resource_usage(cuobjdump: str, path: str) -> List[Tuple[str, str, int, int]]:
    """(arch, mangled name, registers, stack bytes) of every kernel in the file."""
    text = subprocess.run([cuobjdump, "--dump-resource-usage", path], check=True, capture_output=True,
                          text=True).stdout
    rows, arch, function = [], "", ""
    for line in text.splitlines():
        if ARCH.match(line):
            arch = ARCH.match(line).group(1)
        elif FUNCTION.match(line):
            function = FUNCTION.match(line).group(1)
        elif function and USAGE.search(line):
            registers, stack = (int(x) for x in USAGE.search(line).group(1, 2))
            rows.append((arch, function, registers, stack))
            function = ""
    return rows


def local_accesses_by_line(cuobjdump: str, nvdisasm: str, path: str, arch: str) -> Dict[str, Counter]:
    """Per kernel of the file's `arch` images: Counter of (LDL or STL, "file:line") -> instructions."""
    found: Dict[str, Counter] = {}
    with tempfile.TemporaryDirectory() as scratch:
        extracted = subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(path)], cwd=scratch,
                                   capture_output=True, text=True)
        if extracted.returncode != 0:
            print(f"check_spills: --lines could not extract the kernels of {path}: {extracted.stderr.strip()}",
                  file=sys.stderr)
            return found
        for cubin in sorted(glob.glob(os.path.join(scratch, f"*.{arch}.cubin"))):
            listing = subprocess.run([nvdisasm, "-g", "-c", cubin], check=True, capture_output=True,
                                     text=True).stdout
            function, where = "", "?"
            for line in listing.splitlines():
                if section := SECTION.match(line):
                    function, where = section.group(1), "?"
                elif source := LINE.search(line):
                    file, number = source.groups()
                    where = f"{os.path.basename(file)}:{number}"
                elif function and (local := LOCAL.search(line)):
                    found.setdefault(function, Counter())[(local.group(1), where)] += 1
    return found


def print_lines(accesses: Counter, top: int = 12) -> None:
    """A framed kernel's local loads and stores, the most frequent lines first."""
    loads = sum(n for (kind, _), n in accesses.items() if kind == "LDL")
    print(f"           LDL {loads}, STL {sum(accesses.values()) - loads} instructions; by source line:")
    for (kind, where), n in accesses.most_common(top):
        print(f"           {kind} {n:4}  {where}")


def demangled(names: List[str]) -> Dict[str, str]:
    filt = shutil.which("c++filt")
    if not filt or not names:
        return {name: name for name in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {name: name for name in names}


def short(name: str, width: int = 150) -> str:
    """The kernel and its template arguments, without the namespaces that every one repeats."""
    name = re.sub(r"flash_dmattn::kernels::", "", name)
    name = re.sub(r"cutlass::", "", name)
    return name if len(name) <= width else name[:width - 3] + "..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="build directories, objects or archives")
    parser.add_argument("--arch", default="sm_90a", help="the architecture whose frames fail the check (default sm_90a)")
    parser.add_argument("--all", action="store_true", help="list every kernel, not only those with a frame")
    parser.add_argument("--lines", action="store_true",
                        help="count each framed kernel's local loads and stores by source line (nvdisasm)")
    args = parser.parse_args(argv)

    cuobjdump = find_tool("cuobjdump")
    if not cuobjdump:
        print("check_spills: no cuobjdump on PATH or in $CUDA_HOME/bin", file=sys.stderr)
        return 2
    nvdisasm = find_tool("nvdisasm") if args.lines else ""
    if args.lines and not nvdisasm:
        print("check_spills: --lines needs nvdisasm on PATH or in $CUDA_HOME/bin", file=sys.stderr)
        return 2
    rows, accesses = [], {}
    for path in inputs(args.paths):
        rows += resource_usage(cuobjdump, path)
        if args.lines:
            accesses.update(local_accesses_by_line(cuobjdump, nvdisasm, path, args.arch))
    rows = sorted(set(row for row in rows if row[0] == args.arch), key=lambda row: (-row[3], row[1]))
    if not rows:
        print(f"check_spills: no {args.arch} kernels in {' '.join(args.paths)}", file=sys.stderr)
        return 2
    names = demangled([row[1] for row in rows])
    framed = [row for row in rows if row[3] > 0]
    for arch, name, registers, stack in rows if args.all else framed:
        print(f"{arch:8} REG {registers:3} STACK {stack:5}  {short(names[name])}")
        if stack > 0 and name in accesses:
            print_lines(accesses[name])
    print(f"check_spills: {len(framed)} of {len(rows)} {args.arch} kernels have a stack frame")
    return 1 if framed else 0


if __name__ == "__main__":
    sys.exit(main())
