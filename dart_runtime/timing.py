"""The one clock every measurement reads (the first-call kernel choice, calibration, training's precision choice and
the benchmark toolkit `dart_bench.timing`): a timed call, and several calls timed in interleaved rounds."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager, Hashable, Mapping, Optional

import torch

from dart_runtime.sync import synchronize

now = time.perf_counter  # seconds; differences only


def timed(fn: Callable, *args, sync: Optional[torch.device] = None, **kwargs) -> tuple[Any, float]:
    """(fn(*args, **kwargs), its wall seconds); with `sync`, the device is waited for before and after, so GPU work
    is counted when it runs, not when it is queued."""
    if sync is not None:
        synchronize(sync)
    t0 = now()
    out = fn(*args, **kwargs)
    if sync is not None:
        synchronize(sync)
    return out, now() - t0


def interleaved_seconds(runs: Mapping[Hashable, Callable[[], Any]], rounds: int, warmup: int = 1,
                        sync: Optional[torch.device] = None,
                        around: Optional[Callable[[Hashable], ContextManager]] = None,
                        after: Optional[Callable[[Hashable, Any, float, int], None]] = None
                        ) -> dict[Hashable, list[float]]:
    """{key: seconds of each timed call}: every run called once per round, in order (A, B, A, B, ...), so a slow
    spell of the machine hits all alike; `warmup` untimed rounds first. `around(key)` is a context entered outside
    the clock for each call; `after(key, result, seconds, round)` runs after each call (round < 0 in the warm-up)."""
    times: dict[Hashable, list[float]] = {key: [] for key in runs}
    for index in range(-warmup, rounds):
        for key, fn in runs.items():
            with around(key) if around is not None else contextlib.nullcontext():
                out, seconds = timed(fn, sync=sync)
            if index >= 0:
                times[key].append(seconds)
            if after is not None:
                after(key, out, seconds, index)
    return times
