#!/usr/bin/env bash
# On a GPU machine: build with every core, run the GPU test suite, the sanitizers on a small
# subset, and the benchmark smoke; print a short table last. The benchmark JSON goes to $OUT, the
# logs to $OUT/gpu_check_logs.tar.gz (packed after every step, so that a run cut short keeps
# what it did; the device tool brings back at most 8 files).
#
# Environment: FLASH_DMATTN_CUDA_ARCHS (default 90-real on a Hopper GPU, else 80-real),
# CUTLASS_DIR (default .carry/cutlass when present), GTEST_SOURCE_DIR (default .carry/googletest
# when present), CMAKE_EXTRA (more configure flags), SKIP_TESTS=1, SKIP_BENCH=1, SKIP_SANITIZERS=1,
# GPU_TEST_FILTER (gtest filter for the GPU suite), GPU_SUITES (which runs of the suite: any of
# "default sm80 gather deterministic", all by default). On an sm_90 GPU the GPU suite and the
# benchmark run twice: with the default kernels (the sm90a ones where they apply) and with
# FLASH_DMATTN_KERNELS=sm80 (GPU_SM80_FILTER narrows that run), and the backward tests a third
# time, all in deterministic mode (FLASH_DMATTN_TEST_DETERMINISTIC=1; GPU_DETERMINISTIC_FILTER
# narrows them). Every sm_80+ GPU runs the suite once more with FLASH_DMATTN_SPARSE_PATH=gather
# (GPU_GATHER_FILTER narrows it).
# The summary also counts the kernels with a stack frame (scripts/check_spills.py), and the
# sanitizers are memcheck, racecheck and synccheck.
# GATHER_PROFILE=1 also prints the per-kernel durations of the gather path's forward against the
# tile path's (ncu) for the scattered-key benchmark workloads, both paths' forward and backward
# times, the gather backward's kernel durations, its main kernel's L2 reduction traffic and pipe
# use at D128, and where that kernel's warps wait (scripts/stall_summary.py).
# PYTHON_TESTS="test_a.py test_b.py" also builds the module flash_dmattn._C in the same build
# (nanobind from .carry/nanobind_pkg when present) and runs those files of tests/python against
# it with the machine's torch (pytest from the wheels in .carry/py when it is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/flash_dmattn_gpu_check}"
LOGS="$(mktemp -d)"
mkdir -p "$OUT"
save_logs() { tar czf "$OUT/gpu_check_logs.tar.gz" -C "$LOGS" .; }
export PATH="/usr/local/cuda/bin:$PATH"
[ -d .carry/cutlass ] && export CUTLASS_DIR="${CUTLASS_DIR:-$PWD/.carry/cutlass}"
gtest_flag=()
[ -d .carry/googletest ] && gtest_flag=(-DGTEST_SOURCE_DIR="${GTEST_SOURCE_DIR:-$PWD/.carry/googletest}")
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d .)
archs="${FLASH_DMATTN_CUDA_ARCHS:-$([ "${cc:-80}" -ge 90 ] && echo 90-real || echo 80-real)}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$LOGS/device.txt"

start=$(date +%s)
# Off unless asked for: the CMake cache would keep an earlier run's ON.
python_flags=(-DFLASH_DMATTN_BUILD_PYTHON=OFF)
if [ -n "${PYTHON_TESTS:-}" ]; then
  python_flags=(-DFLASH_DMATTN_BUILD_PYTHON=ON)
  [ -d .carry/nanobind_pkg ] && python_flags+=(-Dnanobind_DIR="$PWD/.carry/nanobind_pkg/nanobind/cmake")
fi
# A module an earlier build left must not stand in for this one's.
find build-gpu -maxdepth 2 -name '_C*.so' -delete 2>/dev/null
configure() {
  cmake -S . -B build-gpu -G Ninja -DFLASH_DMATTN_CUDA_ARCHS="$archs" -DFLASH_DMATTN_WERROR=ON "${gtest_flag[@]}" \
    "$@" ${CMAKE_EXTRA:-} > "$LOGS/configure.log" 2>&1
}
# Without the module (no Python headers, say) the C++ suites still run.
configure "${python_flags[@]}" || { [ -n "${PYTHON_TESTS:-}" ] && cp "$LOGS/configure.log" "$LOGS/configure_python.log" &&
  configure -DFLASH_DMATTN_BUILD_PYTHON=OFF; } || { tail -30 "$LOGS/configure.log"; exit 1; }
# -k 0: a target that fails to build does not keep the others (the benchmark, say) from running.
cmake --build build-gpu -j "$(nproc)" -- -k 0 > "$LOGS/build.log" 2>&1 || grep -E "error|Error" "$LOGS/build.log" | head -40
build_s=$(( $(date +%s) - start ))
# Kernels with a stack frame (spills or local arrays), per architecture built; informational.
spills=""
for arch in sm_80 sm_90a; do
  python3 scripts/check_spills.py --arch "$arch" build-gpu > "$LOGS/spills_$arch.txt" 2>&1
  spills+="$arch: $(tail -n 1 "$LOGS/spills_$arch.txt" | sed 's/^check_spills: //'); "
done
save_logs

start=$(date +%s)
gpu_rc=0
extra_lines=""
suites=" ${GPU_SUITES:-default sm80 gather deterministic} "
if [ -z "${SKIP_TESTS:-}" ]; then
  if [[ $suites == *" default "* ]]; then
    build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 --gtest_filter="${GPU_TEST_FILTER:-*}" > "$LOGS/gpu_tests.log" 2>&1
    gpu_rc=$?
    save_logs
  fi
  if [ "${cc:-80}" -eq 90 ] && [[ $suites == *" sm80 "* ]]; then
    FLASH_DMATTN_KERNELS=sm80 build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 \
      --gtest_filter="${GPU_SM80_FILTER:-${GPU_TEST_FILTER:-*}}" > "$LOGS/gpu_tests_sm80.log" 2>&1 || gpu_rc=1
    extra_lines="GPU tests with FLASH_DMATTN_KERNELS=sm80: $(grep -E '^\[  (PASSED|FAILED)  \]|tests ran' "$LOGS/gpu_tests_sm80.log" | tr '\n' ' ')"
    tail -5 "$LOGS/gpu_tests_sm80.log"
    save_logs
  fi
  # The whole suite once more with the forward on the gather path (key lists, sm80 kernels); the
  # backward tests check their forward's out and lse too. GPU_GATHER_FILTER narrows it.
  if [[ $suites == *" gather "* ]]; then
    FLASH_DMATTN_SPARSE_PATH=gather build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 \
      --gtest_filter="${GPU_GATHER_FILTER:-${GPU_TEST_FILTER:-*}}" > "$LOGS/gpu_tests_gather.log" 2>&1 || gpu_rc=1
    extra_lines+=$'\n'"GPU tests with FLASH_DMATTN_SPARSE_PATH=gather: $(grep -E '^\[  (PASSED|FAILED)  \]|tests ran' "$LOGS/gpu_tests_gather.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$LOGS/gpu_tests_gather.log" | head -20
    save_logs
  fi
  # Every backward test once more in deterministic mode, whose kernels differ (dq slots per key
  # split; on sm90a at D = 128 a dQ kernel of its own, sm90/tile_size.h has_dq_kernel).
  if [[ $suites == *" deterministic "* ]]; then
    FLASH_DMATTN_TEST_DETERMINISTIC=1 build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 \
      --gtest_filter="${GPU_DETERMINISTIC_FILTER:-*Backward*}" > "$LOGS/gpu_tests_deterministic.log" 2>&1 || gpu_rc=1
    extra_lines+=$'\n'"backward tests in deterministic mode: $(grep -E '^\[  (PASSED|FAILED)  \]|tests ran' "$LOGS/gpu_tests_deterministic.log" | tr '\n' ' ')"
  fi
fi
gpu_s=$(( $(date +%s) - start ))
save_logs
[ -f "$LOGS/gpu_tests.log" ] && tail -30 "$LOGS/gpu_tests.log"

python_line=""
if [ -n "${PYTHON_TESTS:-}" ]; then
  module="$(find build-gpu -maxdepth 2 -name '_C*.so' | head -1)"
  [ -z "$module" ] && echo "gpu_check: no flash_dmattn._C was built (see configure_python.log, build.log)"
  site="$(mktemp -d)"
  cp -r python/flash_dmattn "$site/"
  [ -n "$module" ] && cp "$module" "$site/flash_dmattn/"
  if ! python3 -c "import pytest" 2>/dev/null && [ -d .carry/py ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" .carry/py/*.whl
  fi
  files=()
  for f in $PYTHON_TESTS; do files+=("tests/python/$f"); done
  PYTHONPATH="$site" timeout "${PYTHON_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider "${files[@]}" \
    > "$LOGS/python_tests.log" 2>&1 || gpu_rc=1
  python_line="Python tests (${PYTHON_TESTS}): $(tail -1 "$LOGS/python_tests.log")"
  save_logs
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  build-gpu/flash_dmattn_bench_forward --json "$OUT/bench_forward.json" > "$LOGS/bench_forward.txt" 2>&1
  if [ "${cc:-80}" -eq 90 ]; then
    FLASH_DMATTN_KERNELS=sm80 build-gpu/flash_dmattn_bench_forward --json "$OUT/bench_forward_sm80.json" \
      > "$LOGS/bench_forward_sm80.txt" 2>&1
  fi
  python3 benchmarks/baselines_torch.py --json "$OUT/baselines_torch.json" > "$LOGS/baselines_torch.txt" 2>&1
  save_logs
fi

if [ -n "${NCU:-}" ]; then
  # One forward launch of the dense-equivalent workload under Nsight Compute (clocks untouched).
  ncu --clock-control none --kernel-name regex:forward_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    build-gpu/flash_dmattn_bench_forward --runs 1 --only "${NCU_WORKLOAD:-train_dense_d128}" > "$LOGS/ncu.txt" 2>&1
  grep -E "Duration|Throughput|Registers|Occupancy|Warp Cycles|Stall|Issued|Eligible|Block Limit|Shared Memory|L1/TEX Hit|L2 Hit|Bank" \
    "$LOGS/ncu.txt" | head -60
fi

if [ -n "${GATHER_PROFILE:-}" ]; then
  # Where a gather-path forward's time goes (tile summary, key lists, attention) against the tile
  # path's, per kernel, for the scattered-key workloads (clocks untouched).
  for workload in seed_scatter1024_d32_s16k train_scatter2048_d128; do
    for path in tile gather; do
      echo "--- $workload, FLASH_DMATTN_SPARSE_PATH=$path (kernel durations)"
      FLASH_DMATTN_SPARSE_PATH=$path timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum \
        --launch-skip 6 --launch-count 6 build-gpu/flash_dmattn_bench_forward --forward-only --runs 1 \
        --only "$workload" 2>&1 | grep -E "^  [A-Za-z_]|gpu__time_duration" | sed -E 's/\(.*//' | cut -c1-100
    done
  done | tee "$LOGS/gather_profile.txt"
  # Forward and backward times of both paths (the deterministic backward stays on the tile path),
  # then the backward's kernels one by one.
  for workload in seed_scatter1024_d32_s16k train_scatter2048_d128; do
    for path in tile gather; do
      echo "--- $workload, FLASH_DMATTN_SPARSE_PATH=$path (forward and backward)"
      FLASH_DMATTN_SPARSE_PATH=$path timeout 120 build-gpu/flash_dmattn_bench_forward --runs 20 --only "$workload" 2>&1 | tail -3
    done
    echo "--- $workload, FLASH_DMATTN_SPARSE_PATH=gather (backward kernel durations)"
    FLASH_DMATTN_SPARSE_PATH=gather timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum \
      --launch-skip 60 --launch-count 8 build-gpu/flash_dmattn_bench_forward --runs 10 --only "$workload" 2>&1 |
      grep -E "^  [A-Za-z_]|gpu__time_duration" | sed -E 's/\(.*//' | cut -c1-100
  done | tee -a "$LOGS/gather_profile.txt"
  # What bounds the gather backward's main kernel at D128: its fp32 dK/dV reductions into L2
  # (estimated at about 7.5 GB per backward, docs/architecture.md), the tensor pipe or issue.
  echo "--- train_scatter2048_d128, gather backward kernel: reductions, throughput, pipes"
  FLASH_DMATTN_SPARSE_PATH=gather timeout 180 ncu --clock-control none --kernel-name regex:backward_gather_kernel \
    --launch-skip 2 --launch-count 1 --metrics gpu__time_duration.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_atom.sum,\
lts__t_bytes.sum,dram__bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_elapsed,\
smsp__inst_executed.sum build-gpu/flash_dmattn_bench_forward --runs 3 --only train_scatter2048_d128 2>&1 |
    grep -E "^  [A-Za-z_]|__" | cut -c1-120 | tee -a "$LOGS/gather_profile.txt"
  # Where its warps wait, per instruction (PC sampling): scripts/stall_summary.py of the SASS table.
  echo "--- train_scatter2048_d128, gather backward kernel: warp stalls (ncu PC sampling)"
  FLASH_DMATTN_SPARSE_PATH=gather timeout 180 ncu --kernel-name regex:backward_gather_kernel --launch-count 1 \
    --section WarpStateStats --section SourceCounters -f -o "$LOGS/gather_backward_stalls" \
    build-gpu/flash_dmattn_bench_forward --runs 1 --only train_scatter2048_d128 > /dev/null 2>&1 &&
    ncu -i "$LOGS/gather_backward_stalls.ncu-rep" --page source --csv --print-source sass > "$LOGS/gather_backward_sass.csv" &&
    python3 scripts/stall_summary.py "$LOGS/gather_backward_sass.csv" | tee -a "$LOGS/gather_profile.txt"
  save_logs
fi

san="skipped"
if [ -z "${SKIP_SANITIZERS:-}" ]; then
  filter="${SANITIZER_FILTER:-Forward/HeadDims*:SparseMasks*:EmptySizes*:Layouts*:Runtime*:*DecodeMasks*:BackwardSparseMasks.DensityTwoPerThousand*:BackwardSparseMasks.WholeTilesEmpty:BackwardEmptySizes.*:BackwardRuntime.*:BackwardLayouts.*:TileSummaryBuild.*:Limits.OneOfEverything:Backward/BackwardBroadcast.*/mask_BHkSqSk_bias_*:Forward/StagedBias*}"
  san="memcheck:"
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 \
    --gtest_filter="$filter" > "$LOGS/memcheck.log" 2>&1 && san+="clean" || san+="FAILED($?)"
  san+=" racecheck:"
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool racecheck --error-exitcode 9 build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 \
    --gtest_filter="$filter" > "$LOGS/racecheck.log" 2>&1 && san+="clean" || san+="FAILED($?)"
  san+=" synccheck:"
  timeout "${SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool synccheck --error-exitcode 9 build-gpu/tests/gpu/flash_dmattn_gpu_tests --gtest_brief=1 \
    --gtest_filter="$filter" > "$LOGS/synccheck.log" 2>&1 && san+="clean" || san+="FAILED($?)"
  tail -n 3 "$LOGS/memcheck.log" "$LOGS/racecheck.log" "$LOGS/synccheck.log"
  save_logs
fi

echo
echo "================ summary ================"
cat "$LOGS/device.txt"
echo "build ${build_s}s (archs $archs); GPU tests ${gpu_s}s, rc=$gpu_rc: $(grep -sE '^\[  (PASSED|FAILED)  \]|tests ran' "$LOGS/gpu_tests.log" | tr '\n' ' ')"
[ -n "$extra_lines" ] && echo "$extra_lines"
[ -n "$python_line" ] && echo "$python_line"
echo "sanitizers: $san"
echo "stack frames: $spills(scripts/check_spills.py; logs spills_*.txt)"
[ -f "$LOGS/bench_forward_sm80.txt" ] && { echo "--- forward with FLASH_DMATTN_KERNELS=sm80"; cat "$LOGS/bench_forward_sm80.txt"; }
[ -f "$LOGS/bench_forward.txt" ] && cat "$LOGS/bench_forward.txt"
[ -f "$LOGS/baselines_torch.txt" ] && cat "$LOGS/baselines_torch.txt"
exit $gpu_rc
