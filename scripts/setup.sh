#!/usr/bin/env bash
# Installs what the build needs, only where it is missing: a C++ toolchain, CMake, Ninja and
# GoogleTest from Debian's packages, and, when nvcc is present, the pinned CuTe/CUTLASS headers
# from PyPI. Safe to run again.
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
