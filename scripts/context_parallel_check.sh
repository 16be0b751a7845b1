#!/usr/bin/env bash
# Context parallelism on this machine: the tests (tests/python/test_context_parallel.py spawns its
# own ranks: NCCL where there are enough GPUs, else gloo on CPU), then weak scaling under torchrun
# on 1, 2, 4 ... ranks, as many as there are GPUs (CP_RANKS overrides, e.g. "1 2"), with
# CP_BENCH_ARGS passed on (default: 64k tokens per rank, B1 H16/Hk4 D128). The flash_dmattn package
# must be importable (pip install ., or PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
python3 -m pytest -q -p no:cacheprovider tests/python/test_context_parallel.py || rc=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
ranks="${CP_RANKS:-$(r=1; while [ "$r" -le "$gpus" ]; do echo -n "$r "; r=$((r * 2)); done)}"
lines=$(mktemp)
for n in $ranks; do
  timeout "${CP_TIMEOUT:-600}" torchrun --standalone --nproc_per_node="$n" benchmarks/bench_context_parallel.py \
    ${CP_BENCH_ARGS:---tokens-per-rank 65536} | tee -a "$lines" || rc=1
done
# Weak-scaling efficiency: each line's TFLOP/s per rank over the single call's (printed at one rank).
awk '/^single/ { f0 = $(NF-5); b0 = $(NF-2) }
  /^(single|world)/ && f0 > 0 && b0 > 0 { f = $(NF-5); b = $(NF-2)
  printf "%s %s: forward %.3f, backward %.3f of the single call'"'"'s TFLOP/s per rank\n", $1, $2, f / f0, b / b0 }' "$lines"
exit ${rc:-0}
