#!/usr/bin/env bash
# Sets up, builds, and runs the main job: one forward and backward on random data with the best
# backend present, with the error of every output against the fp64 reference.
# Arguments go to flash_dmattn_run (see tools/flash_dmattn_run.cpp), e.g. --causal --seqlen-q 512.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh >/dev/null
exec build/flash_dmattn_run "$@"
