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

Kernels (`--kernels`): the same queued calls under torch's profiler give each kernel of a call
its duration and the gap before it (medians over the calls), and the call's span from its first
kernel's start to its last one's end: where a call's GPU time goes, for every implementation
alike.

On the CPU (`--device cpu`, for testing the harness) the clock is time.perf_counter.
"""
import gc
import math
import statistics
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

MAX_COPIES = 8


@dataclass
class Timing:
    ms: float           # median
    reps: int
    peak_bytes: Optional[int] = None
    queued_ms: Optional[float] = None  # median GPU time with the host ahead (Clock.time_queued_ms)
    host_ms: Optional[float] = None    # the longest host time of a timed call


@dataclass
class Kernel:
    name: str      # short: no return type, namespaces, template arguments or parameters
    us: float      # median duration
    gap_us: float  # median idle time before it, after the call's previous kernel (0 for the first)


@dataclass
class Timeline:
    kernels: List[Kernel]
    span_us: float  # median time from the first kernel's start to the last one's end
    calls: int      # the calls whose kernels these are


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

    def sleep_cycles_per_ms(self) -> float:
        """torch.cuda._sleep's spin cycles per ms on this device, measured once."""
        if getattr(self, "_cycles_per_ms", None) is None:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(10**7)
            stop.record()
            stop.synchronize()
            self._cycles_per_ms = 10**7 / max(start.elapsed_time(stop), 1e-3)
        return self._cycles_per_ms

    def sleep_for_host(self, host_ms: float):
        """Queues a sleep of 0.1 ms plus twice host_ms (the host's time for the call that follows)
        and returns an event recorded after it: a call whose host work outlasted the sleep finds
        the event complete once it returns (query())."""
        torch.cuda._sleep(int((0.1 + 2 * host_ms) * self.sleep_cycles_per_ms()))
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def time_queued_ms(self, run: Callable[[], object], host_ms: float) -> Optional[float]:
        """The GPU time of run() queued behind a sleep of 0.1 ms plus twice host_ms (the host's time
        for such a call): None where the sleep had ended before run() returned on the host, so
        that the GPU may have waited for the host (a call that synchronizes always does)."""
        start = self.sleep_for_host(host_ms)
        stop = torch.cuda.Event(enable_timing=True)
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
    host_ms = max(host)
    queued = queued_ms(clock, prepare, run, copies, flush, reps, host_ms) if clock.cuda else None
    return Timing(statistics.median(times), reps, peak_bytes(clock, prepare, run), queued, host_ms)


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


def short_kernel_name(name: str) -> str:
    """'void ns::(anonymous namespace)::reduce_kernel<float, 8>(Params)' -> 'reduce_kernel';
    'Memset (Device)' -> 'Memset'."""
    name = name.replace("(anonymous namespace)::", "")
    for stop in ("<", "("):
        name = name.split(stop, 1)[0]
    name = name.strip()
    if name.startswith("void "):
        name = name[len("void "):]
    return name.rsplit("::", 1)[-1].strip() or "?"


# One profiled kernel: its name and start and end in microseconds.
Event = namedtuple("Event", "name start end")


def summarize_calls(events: Sequence[Event], is_marker: Callable[[str], bool], opening_us: float = 50.0,
                    keep: Optional[Sequence[bool]] = None) -> Optional[Timeline]:
    """The timeline of calls that each lie between an opening marker (a sleep of at least
    opening_us) and the next marker: what runs after a short marker (the untimed work before a
    call: a backward's forward, an L2 flush) belongs to no call. keep[i] False leaves out the
    i-th call (one that overtook its sleep). The calls whose sequence of kernel names is the most
    common one are summarized, position by position; None without any call."""
    calls: List[List[Event]] = []
    current: Optional[List[Event]] = None
    for event in sorted(events, key=lambda e: e.start):
        if is_marker(event.name):
            if current is not None:
                calls.append(current)
            current = [] if event.end - event.start >= opening_us else None
        elif current is not None:
            current.append(event)
    if current is not None:
        calls.append(current)
    if keep is not None:
        calls = [call for call, kept in zip(calls, keep) if kept]
    calls = [call for call in calls if call]
    if not calls:
        return None
    shapes = [tuple(e.name for e in call) for call in calls]
    common = max(set(shapes), key=lambda shape: (shapes.count(shape), -shapes.index(shape)))
    kept = [call for call, shape in zip(calls, shapes) if shape == common]
    kernels = []
    for i, name in enumerate(common):
        duration = statistics.median(call[i].end - call[i].start for call in kept)
        gap = statistics.median(call[i].start - call[i - 1].end for call in kept) if i else 0.0
        kernels.append(Kernel(short_kernel_name(name), duration, gap))
    span = statistics.median(call[-1].end - call[0].start for call in kept)
    return Timeline(kernels, span, len(kept))


def kernel_timeline(clock: Clock, prepare: Callable[[int], object], run: Callable[[object], object], copies: int,
                    flush: bool, host_ms: float, calls: int = 8) -> Optional[Timeline]:
    """The kernels of `calls` calls, each queued behind a sleep as queued_ms times them and
    followed by a short one that closes it, from torch's profiler. A call that overtook its sleep
    (its host work outlasted it) is left out and the next sleeps grow 4x, as in queued_ms. None
    on the CPU or where no call's kernels could be told apart."""
    if not clock.cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    closing = int(0.005 * clock.sleep_cycles_per_ms())  # about 5 us: far under summarize_calls' opening_us
    keep = []
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for i in range(calls):
            state = prepare(i % copies)
            if flush:
                clock.flush_l2()
            # At least 100 us, twice summarize_calls' opening_us; longer after overtaken calls.
            started = clock.sleep_for_host(host_ms * 4 ** min(keep.count(False), 2))
            run(state)
            keep.append(not started.query())
            torch.cuda._sleep(closing)
            clock.sync()
            del state  # before the next call's prepare, as between timed calls
    events = [Event(e.name, e.time_range.start, e.time_range.end) for e in profiler.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return summarize_calls(events, is_marker=lambda name: "sleep" in name or "spin" in name, keep=keep)
