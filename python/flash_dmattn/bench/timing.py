"""Timing: medians of CUDA-event timings after warm-up, with inputs that are not L2-warm.

Each timed call is bracketed by two CUDA events, so the time is the GPU's from the first kernel
of the call to the last, launch gaps included; the host synchronizes after each call so that
memory and the queue stay bounded. The number of timed calls follows from the warm-up's speed:
enough to fill about `budget_ms`, within [min_reps, max_reps].

L2: an H100 keeps 50 MB in L2, so a decode cache or a small problem would be timed warm if the
same inputs were used call after call. When an implementation's inputs fit twice in L2, the calls
rotate over copies of them; where even the copies fit (tiny problems), and before a backward
(whose own forward has just run on the same inputs), a 2×L2 buffer is written between calls,
outside the events.

On the CPU (`--device cpu`, for testing the harness) the clock is time.perf_counter.
"""
import math
import statistics
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MAX_COPIES = 8


@dataclass
class Timing:
    ms: float           # median
    reps: int
    peak_bytes: Optional[int] = None


# The timing effort: the CLI's --warmup, --min-reps, --max-reps and --budget-ms.
Settings = namedtuple("Settings", "warmup min_reps max_reps budget_ms", defaults=(3, 5, 30, 150.0))


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))


def rotation(footprint: int, device: torch.device) -> tuple:
    """(copies of the inputs to rotate over, whether to flush L2 between calls anyway)."""
    l2 = l2_bytes(device)
    if l2 == 0 or footprint >= 2 * l2:
        return 1, False
    copies = min(MAX_COPIES, math.ceil(2 * l2 / max(footprint, 1)))
    return copies, copies * footprint < 2 * l2


class Clock:
    """Times one call: CUDA events on a GPU, perf_counter on the CPU; flushes L2 on request."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._scratch = torch.empty(2 * l2_bytes(device), dtype=torch.uint8, device=device) if self.cuda else None

    def flush_l2(self) -> None:
        if self._scratch is not None:
            self._scratch.zero_()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_ms(self, run: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            run()
            return (time.perf_counter() - start) * 1e3
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)


def measure(clock: Clock, prepare: Callable[[int], object], run: Callable[[object], object], copies: int,
            flush: bool, settings: Settings) -> Timing:
    """Median ms of run(prepare(i % copies)) over repeated calls; prepare's work is not timed.

    prepare makes what one call needs (the inputs of copy i, or the output a backward starts
    from); run does the timed work on it.
    """
    def one(i: int) -> float:
        state = prepare(i % copies)
        if flush:
            clock.flush_l2()
        return clock.time_ms(lambda: run(state))

    warm = [one(i) for i in range(max(1, settings.warmup))]
    estimate = statistics.median(warm)
    reps = int(min(settings.max_reps, max(settings.min_reps, settings.budget_ms / max(estimate, 1e-3))))
    times = [one(i) for i in range(reps)]
    return Timing(statistics.median(times), reps, peak_bytes(clock, prepare, run))


def peak_bytes(clock: Clock, prepare: Callable[[int], object], run: Callable[[object], object]) -> Optional[int]:
    """What one call allocates at its peak beyond what was allocated before it (None on the CPU)."""
    if not clock.cuda:
        return None
    state = prepare(0)
    clock.sync()
    before = torch.cuda.memory_allocated(clock.device)
    torch.cuda.reset_peak_memory_stats(clock.device)
    run(state)
    clock.sync()
    return torch.cuda.max_memory_allocated(clock.device) - before


def wall_ms(clock: Clock, fn: Callable[[], object], settings: Settings) -> float:
    """Median wall-clock ms of fn, synchronized: for per-mask preparations (a BlockMask build),
    whose host work is part of their cost, unlike a kernel's launch."""
    def one() -> float:
        clock.sync()
        start = time.perf_counter()
        fn()
        clock.sync()
        return (time.perf_counter() - start) * 1e3

    for _ in range(max(1, settings.warmup)):
        one()
    return statistics.median(one() for _ in range(settings.min_reps))
