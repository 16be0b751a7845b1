#!/usr/bin/env bash
# Sets up, builds, and runs every test that this machine can run (the GPU suites skip themselves
# where there is no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
