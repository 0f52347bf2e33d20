"""The two ways the benchmarks time: interleaved rounds, medians (the machine is noisy)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(cases: dict[str, tuple[Callable, Callable | None]], repeats: int = 21) -> dict[str, float]:
    """Median wall time of each case's ``fn`` over ``repeats`` rounds.

    Cases run round-robin (one of each per round) so machine noise hits them
    alike; ``setup`` runs untimed before each timed call, and each result is
    kept until that case's next call, as a caller would keep it.
    """
    times = {k: [] for k in cases}
    kept = {}
    for i in range(repeats + 2):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            kept[name] = fn()
            dt = time.perf_counter() - t0
            if i >= 2:  # the first two rounds warm up
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def median_rounds(cases: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Median seconds of each whole-run case over ``repeats`` interleaved rounds (no warm-up rounds)."""
    times = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
