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

GPU time with the host ahead (`queued_ms`): timed from an idle GPU, a call's time includes the
host's work until each launch, which for a decode or a small sparse call is most of it. The same
calls are timed again behind a sleep kernel that holds the stream while the host enqueues the
whole call, so that the events bracket the GPU's work alone (gaps between kernels included):
what the call costs where the host runs ahead, as in a training step or under CUDA graphs, and
what "kernel time" means for every implementation alike. A call whose host work outlasts the
sleep (or that waits for the GPU itself) is detected and not counted.

On the CPU (`--device cpu`, for testing the harness) the clock is time.perf_counter.
"""
import gc
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
    queued_ms: Optional[float] = None  # median GPU time with the host ahead (Clock.time_queued_ms)


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
        """The call's time from an idle GPU (its host time until the last launch included); the
        host's own time for the call is kept in host_ms."""
        if not self.cuda:
            start = time.perf_counter()
            run()
            self.host_ms = (time.perf_counter() - start) * 1e3
            return self.host_ms
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        run()
        self.host_ms = (time.perf_counter() - began) * 1e3
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    def _sleep_cycles_per_ms(self) -> float:
        """torch.cuda._sleep's spin cycles per ms on this device, measured once."""
        if getattr(self, "_cycles_per_ms", None) is None:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10**7)
            stop.record()
            stop.synchronize()
            self._cycles_per_ms = 10**7 / max(start.elapsed_time(stop), 1e-3)
        return self._cycles_per_ms

    def time_queued_ms(self, run: Callable[[], object], host_ms: float) -> Optional[float]:
        """The GPU time of run() queued behind a sleep of 0.1 ms plus twice host_ms (the host's time
        for such a call): None where the sleep had ended before run() returned on the host, so
        that the GPU may have waited for the host (a call that synchronizes always does)."""
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int((0.1 + 2 * host_ms) * self._sleep_cycles_per_ms()))
        start.record()
        run()
        stop.record()
        overtaken = start.query()  # (after stop's record: the GPU never waits for it)
        stop.synchronize()
        return None if overtaken else start.elapsed_time(stop)


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
    times, host = [], []
    for i in range(reps):
        times.append(one(i))
        host.append(clock.host_ms)
    queued = queued_ms(clock, prepare, run, copies, flush, reps, max(host)) if clock.cuda else None
    return Timing(statistics.median(times), reps, peak_bytes(clock, prepare, run), queued)


def queued_ms(clock: Clock, prepare: Callable[[int], object], run: Callable[[object], object], copies: int,
              flush: bool, reps: int, host_ms: float) -> Optional[float]:
    """Median GPU time of reps calls queued behind a sleep (Clock.time_queued_ms); the sleep grows
    4x where the host overtook it, twice at most; None where more than half the calls stay
    overtaken (given up as soon as that is certain: a call that waits for the GPU always is)."""
    times = []
    for i in range(reps):
        for attempt in range(3):
            state = prepare(i % copies)  # (again on a retry: a backward's state is spent by its call)
            if flush:
                clock.flush_l2()  # (again on a retry: the overtaken call left its inputs in L2)
            measured = clock.time_queued_ms(lambda: run(state), host_ms * 4**attempt)
            if measured is not None:
                times.append(measured)
                break
        if 2 * (len(times) + reps - 1 - i) <= reps:
            return None
    return statistics.median(times)


def peak_bytes(clock: Clock, prepare: Callable[[int], object], run: Callable[[object], object]) -> Optional[int]:
    """What one call allocates at its peak beyond what was allocated before it (None on the CPU).
    Garbage is collected first and the collector kept off until the peak is read, so that no
    collection moves the baseline in between (a run printed -895 MiB; that this was the cause
    is a guess, not confirmed)."""
    if not clock.cuda:
        return None
    state = prepare(0)
    clock.sync()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated(clock.device)
        torch.cuda.reset_peak_memory_stats(clock.device)
        run(state)
        clock.sync()
        return torch.cuda.max_memory_allocated(clock.device) - before
    finally:
        if was_enabled:
            gc.enable()


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
