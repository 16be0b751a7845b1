#!/usr/bin/env bash
# Configures and builds into build/ with every core. Extra arguments go to CMake's configure step
# (for example -DFLASH_DMATTN_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH="/usr/local/cuda/bin:$PATH"; fi
cmake -S . -B build -G Ninja -DFLASH_DMATTN_WERROR=ON "$@"
cmake --build build -j "$(nproc)"
