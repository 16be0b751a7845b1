#!/usr/bin/env bash
# Installs what the build needs, only where it is missing: a C++ toolchain, CMake, Ninja and
# GoogleTest from Debian's packages, and, when nvcc is present, the pinned CuTe/CUTLASS headers
# from PyPI. Safe to run again.
#
# With --python (scripts/test.sh passes it), also a virtual environment in build/python-venv with
# numpy, pytest, torch, transformers and matplotlib from PyPI, into which the tests install the
# Python package, so that the torch, transformers and plotting tests run (on the CPU where there is
# no GPU). Each is installed only where it is missing, so a second run downloads nothing.
set -euo pipefail

CUTLASS_PIN="nvidia-cutlass==4.2.0.0"

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  if [ -z "${CUTLASS_DIR:-}" ] && ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
    echo "setup: installing ${CUTLASS_PIN} (headers only, without its Python dependencies)"
    python3 -m pip install -q --no-deps "${CUTLASS_PIN}"
  fi
fi

if [ "${1:-}" = "--python" ]; then
  venv="$(dirname "$0")/../build/python-venv"
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating the virtual environment build/python-venv"
    python3 -m venv "$venv"
  fi
  # The import name of each package, then the requirement that pip installs where it is missing.
  # PyPI's torch wheel for Linux x86-64 is the CUDA build (it brings the nvidia-* libraries, a few
  # GB); it runs on a machine without a GPU as well.
  wanted=(numpy:numpy pytest:pytest torch:"torch>=2.4" transformers:transformers
          matplotlib:matplotlib)
  reqs=()
  for w in "${wanted[@]}"; do
    "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${w%%:*}') is None)" \
      || reqs+=("${w#*:}")
  done
  # An older torch than the front needs (torch.library custom ops, torch.compiler) is upgraded.
  if ! printf '%s\n' "${reqs[@]}" | grep -q '^torch' && ! "$venv/bin/python" -c \
      "import sys, torch; sys.exit(tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) < (2, 4))"; then
    reqs+=("torch>=2.4")
  fi
  if [ ${#reqs[@]} -gt 0 ]; then
    echo "setup: installing ${reqs[*]} into build/python-venv"
    start=$SECONDS
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${reqs[@]}"
    echo "setup: the Python packages took $((SECONDS - start)) s"
  fi
fi
