"""The benchmark CLI, `python -m flash_dmattn.bench` (docs/benchmarks.md).

suites (case definitions), flops (dense-equivalent and visited-tile FLOPs, our kernels' tile
shapes), check (the --check rule), report (table, JSON, plot, progress) import without torch;
problem, impls, timing and harness need it and are imported only when there is something to run.
"""
