#!/usr/bin/env bash
# On a GPU machine: install the Python package with pip into a fresh virtual environment, check
# that the extension links no torch library, run the README's Python example and the whole Python
# test suite (GPU suites included), and print a short summary last. Logs go to $OUT.
#
# The machine needs no network: the venv sees the torch, transformers, numpy, pytest, nanobind and
# scikit-build-core of the python3 on PATH (--no-build-isolation), and the CuTe/CUTLASS headers come
# from CUTLASS_DIR (default .carry/cutlass).
#
# Environment: FLASH_DMATTN_CUDA_ARCHS (default 90-real), CMAKE_BUILD_PARALLEL_LEVEL (default every
# core), PYTEST_ARGS (more pytest arguments, e.g. "-x -k cuda"), BENCH_ARGS (when set, runs
# `python -m flash_dmattn.bench $BENCH_ARGS` last, with its JSON and plot under $OUT), VENV (default
# /tmp/flash_dmattn_venv). The CMake build stays in build-python/, so a second run (after a time
# limit cut the first, say) only relinks.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
OUT="${OUT:-/tmp/flash_dmattn_python_check}"
mkdir -p "$OUT"
export PATH="/usr/local/cuda/bin:$PATH"
[ -d .carry/cutlass ] && export CUTLASS_DIR="${CUTLASS_DIR:-$repo/.carry/cutlass}"
export FLASH_DMATTN_CUDA_ARCHS="${FLASH_DMATTN_CUDA_ARCHS:-90-real}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export PYTHONUNBUFFERED=1
venv="${VENV:-/tmp/flash_dmattn_venv}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1

rm -rf "$venv"
python3 -m venv --system-site-packages --without-pip "$venv"
py="$venv/bin/python"
# python3 may itself be a virtual environment (on the GPU machines it is), whose packages a new venv
# does not see even with --system-site-packages; a .pth file adds its site-packages after the venv's
# own. pip comes from there too, so the venv needs no ensurepip.
python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
  > "$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/parent_environment.pth"

start=$(date +%s)
"$py" -m pip install --no-build-isolation --no-deps -v -C build-dir=build-python . > "$OUT/install.log" 2>&1
install_rc=$?
install_s=$(( $(date +%s) - start ))
if [ $install_rc -ne 0 ]; then
  grep -E "error|Error|FAILED" "$OUT/install.log" | head -40
  echo "================ summary ================"
  echo "install FAILED (rc=$install_rc, ${install_s}s); see $OUT/install.log"
  exit 1
fi
grep -E "flash_dmattn:|CUDA_ARCHITECTURES|Found Python" "$OUT/install.log" | head -5

# Everything below runs outside the source tree, so that only the installed package is importable.
cd /tmp
extension=$("$py" -c "import flash_dmattn._C as m; print(m.__file__)")
ldd "$extension" > "$OUT/ldd.txt" 2>&1
if grep -qE "libtorch|libc10" "$OUT/ldd.txt"; then
  ldd_result="FAILED: links $(grep -oE "libtorch[^ ]*|libc10[^ ]*" "$OUT/ldd.txt" | sort -u | tr '\n' ' ')"
else
  ldd_result="ok (no libtorch, no libc10)"
fi
backends=$("$py" -c "import flash_dmattn as f; print(f.version(), f.available_backends(), 'cuda_compiled =', f.cuda_compiled())" 2>&1)

# The README's example is its one ```python block, run exactly as written.
awk '/^```python/ {inside = 1; next} /^```/ {if (inside) exit} inside' "$repo/README.md" > "$OUT/readme_example.py"
"$py" "$OUT/readme_example.py" > "$OUT/readme_example.log" 2>&1
example_rc=$?
tail -5 "$OUT/readme_example.log"

start=$(date +%s)
# shellcheck disable=SC2086
"$py" -m pytest -q -p no:cacheprovider --rootdir "$repo" -c "$repo/pyproject.toml" "$repo/tests/python" \
  ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
pytest_rc=$?
pytest_s=$(( $(date +%s) - start ))
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30

bench_rc=0
if [ -n "${BENCH_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  "$py" -m flash_dmattn.bench $BENCH_ARGS --results-dir "$OUT" --no-progress > "$OUT/bench.log" 2>&1
  bench_rc=$?
  tail -60 "$OUT/bench.log"
fi

echo
echo "================ summary ================"
cat "$OUT/device.txt"
echo "install: ok in ${install_s}s (archs $FLASH_DMATTN_CUDA_ARCHS); $backends"
echo "ldd $(basename "$extension"): $ldd_result"
echo "README example: $([ $example_rc -eq 0 ] && echo ok || echo "FAILED (rc=$example_rc), see $OUT/readme_example.log")"
echo "pytest (${pytest_s}s, rc=$pytest_rc): $(tail -1 "$OUT/pytest.log")"
[ -n "${BENCH_ARGS:-}" ] && echo "bench (rc=$bench_rc): $OUT/bench.log"
[ $example_rc -eq 0 ] && [ $pytest_rc -eq 0 ] && [ $bench_rc -eq 0 ] && [[ "$ldd_result" == ok* ]]
