"""Host time against GPU time of one flash_dmattn_func call, per pass, on a bench CLI case.

A call's host work (argument checks, argument objects, workspace allocation, launches) and its
GPU work overlap only when the GPU is busy: timed from an idle GPU, as the bench CLI times a
forward, the two add up. To separate them, the GPU is held busy by a sleep kernel while N calls
are queued behind it: the host's time per call is then the wall time of queueing them, and the
GPU's the CUDA-event time between the first and the last. The latency of one call from an idle
GPU is printed beside them.

    PYTHONPATH=... python benchmarks/host_time.py --suite seed --case top1024 [--path gather]

--path sets FLASH_DMATTN_SPARSE_PATH (auto, the default, prepares the mask and lets the
preparation choose; tile and gather are given the bool mask, gather also prepared). --profile
adds a cProfile of the host side of forward and backward (Python functions only: the module's
C++ calls count in their callers' own time). --parts splits the forward's host time (no grad)
into the Python alone (the module's work call stubbed out) and the module's `_C.forward` alone on
ready arguments, times SDPA's flash and cuDNN backends on the same q, k and v without mask or
bias, and lists the forward's kernels with their GPU time (torch's profiler). Cases without a
backward (decodes) time the forward only:

    PYTHONPATH=... python benchmarks/host_time.py --suite serving --case "B1 H4/2" --parts
"""
import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from flash_dmattn import flash_dmattn_func, prepare_mask, torch_ops
from flash_dmattn.bench import suites
from flash_dmattn.bench.problem import make_problem

SLEEP_CYCLES = int(2e9)  # about a second of GPU time: longer than queueing the calls takes


def measure(label: str, make_state, run, calls: int) -> None:
    states = [make_state() for _ in range(calls)]
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall = time.perf_counter()
    start.record()
    for state in states:
        run(state)
    stop.record()
    host_us = (time.perf_counter() - wall) / calls * 1e6
    stop.synchronize()
    gpu_us = start.elapsed_time(stop) / calls * 1e3
    latencies = []
    for state in [make_state() for _ in range(11)]:
        torch.cuda.synchronize()
        start.record()
        run(state)
        stop.record()
        stop.synchronize()
        latencies.append(start.elapsed_time(stop) * 1e3)
    print(f"{label:28s} host {host_us:8.1f} us   gpu {gpu_us:8.1f} us   from idle {sorted(latencies)[5]:8.1f} us")


def parts(forward, q, k, v, calls: int) -> None:
    """The no-grad forward's host time, part by part, beside SDPA's (see the module docstring)."""
    with torch.no_grad():
        captured = []
        run = torch_ops._run
        torch_ops._run = lambda *call: captured.append(call)
        try:
            forward()
            measure("  Python alone", lambda: None, lambda _: forward(), calls)
        finally:
            torch_ops._run = run
        call, size_of, args, _ = captured[0]
        nbytes = size_of(args)
        workspace = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=q.device)
        measure("  _C.forward alone", lambda: None, lambda _: call(args, workspace.data_ptr(), nbytes), calls)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for backend in (torch.nn.attention.SDPBackend.FLASH_ATTENTION, torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    measure(f"SDPA {backend.name.lower()}", lambda: None,
                            lambda _: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), calls)
            except RuntimeError as error:  # a backend that does not take this shape
                print(f"SDPA {backend.name.lower()}: {str(error).splitlines()[0][:100]}")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as timeline:
            for _ in range(10):
                forward()
            torch.cuda.synchronize()
    for event in sorted(timeline.key_averages(), key=lambda e: -e.device_time_total):
        if event.device_time_total > 0:
            print(f"  kernel {event.key[:70]:70s} {event.device_time_total / event.count:7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="seed", choices=list(suites.SUITES))
    parser.add_argument("--case", default="top1024", help="text the case's name contains (the first match runs)")
    parser.add_argument("--path", default="auto", choices=("auto", "tile", "gather"))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--parts", action="store_true")
    args = parser.parse_args()

    case = next(c for c in suites.cases(args.suite) if args.case in c.name)
    problem = make_problem(case, torch.bfloat16, torch.device("cuda"), 0)
    os.environ["FLASH_DMATTN_SPARSE_PATH"] = args.path
    leaves = [t.detach().requires_grad_() if t is not None else None
              for t in (problem.q, problem.k, problem.v, problem.bias)]
    q, k, v, bias = leaves
    wrt = [t for t in leaves if t is not None]
    mask = problem.mask
    if mask is not None and args.path != "tile":
        mask = prepare_mask(problem.q, problem.k, problem.v, mask, is_causal=case.causal)
        print(f"{case.name}: prepared mask, forward {mask.path} path, backward {mask.backward_path} path")
    else:
        print(f"{case.name}: bool mask, {args.path} path")

    def forward():
        return flash_dmattn_func(q, k, v, attn_mask=mask, attn_bias=bias, is_causal=case.causal)

    def backward(out):
        return torch.autograd.grad(out, wrt, problem.dout)

    for _ in range(3):
        out = forward()
        if case.backward:
            backward(out)
    with torch.no_grad():
        measure("forward, no grad", lambda: None, lambda _: forward(), args.calls)
    if args.parts:
        parts(forward, q, k, v, args.calls)
    if not case.backward:
        return
    measure("forward, with grad", lambda: None, lambda _: forward(), args.calls)
    measure("backward", forward, backward, args.calls)

    if args.profile:
        outs = [forward() for _ in range(args.calls)]
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        profiler = cProfile.Profile()
        profiler.enable()
        for out in outs:
            forward()
            backward(out)
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())


if __name__ == "__main__":
    main()
