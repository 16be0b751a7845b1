#!/usr/bin/env bash
# Sets up, builds, and runs every test that this machine can run: the C++ suites through CTest,
# then the Python package's through pytest (the GPU suites skip themselves where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --python
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"

# The Python package, built without CUDA (the build above already compiled the kernels), and its
# tests (torch, transformers and matplotlib are in the venv: those that need a GPU skip themselves
# where there is none, the others run on the CPU).
FLASH_DMATTN_CUDA=OFF build/python-venv/bin/python -m pip install -q .
build/python-venv/bin/python -m pytest -q tests/python
