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
from typing import Dict, List, Tuple

FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")
ARCH = re.compile(r"^\s*arch = (\S+)\s*$")


def find_cuobjdump() -> str:
    for candidate in (shutil.which("cuobjdump"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin",
                                                               "cuobjdump")):
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
    args = parser.parse_args(argv)

    cuobjdump = find_cuobjdump()
    if not cuobjdump:
        print("check_spills: no cuobjdump on PATH or in $CUDA_HOME/bin", file=sys.stderr)
        return 2
    rows = []
    for path in inputs(args.paths):
        rows += resource_usage(cuobjdump, path)
    rows = sorted(set(row for row in rows if row[0] == args.arch), key=lambda row: (-row[3], row[1]))
    if not rows:
        print(f"check_spills: no {args.arch} kernels in {' '.join(args.paths)}", file=sys.stderr)
        return 2
    names = demangled([row[1] for row in rows])
    framed = [row for row in rows if row[3] > 0]
    for arch, name, registers, stack in rows if args.all else framed:
        print(f"{arch:8} REG {registers:3} STACK {stack:5}  {short(names[name])}")
    print(f"check_spills: {len(framed)} of {len(rows)} {args.arch} kernels have a stack frame")
    return 1 if framed else 0


if __name__ == "__main__":
    sys.exit(main())
