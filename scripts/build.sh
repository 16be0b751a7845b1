#!/usr/bin/env bash
# Configures and builds into build/ with every core. Extra arguments go to CMake's configure step
# (for example -DFLASH_DMATTN_CUDA=OFF).
#
# On a machine without a GPU (CI) the kernels can only be compile-checked, so they are compiled
# for sm_80 alone, which keeps the build inside CI's time; FLASH_DMATTN_CUDA_ARCHS overrides this,
# and with a GPU the CMake default (sm_80, sm_90 and PTX) applies.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH="/usr/local/cuda/bin:$PATH"; fi
archs=()
if [ -n "${FLASH_DMATTN_CUDA_ARCHS:-}" ]; then
  archs=(-DFLASH_DMATTN_CUDA_ARCHS="$FLASH_DMATTN_CUDA_ARCHS")
elif ! nvidia-smi -L >/dev/null 2>&1; then
  archs=(-DFLASH_DMATTN_CUDA_ARCHS=80-real)
fi
cmake -S . -B build -G Ninja -DFLASH_DMATTN_WERROR=ON "${archs[@]}" "$@"
cmake --build build -j "$(nproc)"
