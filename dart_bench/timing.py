"""Timing: the one clock of the benchmarks, `dart-spec bench` and the demo.

Every measurement reads the clock of `dart_runtime.timing` (which the library's own measurements read too). With
`sync=device` a timer waits for the work queued on that device before starting and before stopping
(`dart_runtime.sync.synchronize`; nothing to wait for on the CPU), so GPU times are device times.

- `timed(fn, ...)`: one call -> (its result, seconds); `timed_generate`: one batch-1 `generate()` call;
- `Clock`: named samples (`with clock(key): ...` or `clock.run(key, fn, ...)`), their medians and totals;
- `repeat_seconds` / `median_seconds`: one callable, warm-ups then repeats;
- `interleave`: several callables round robin (A, B, A, B, ...), so a slow spell of the machine hits all alike;
- `median_range`: median, min and max of samples;
- `TargetMeter`: forward hooks timing every forward of a model; `Progress`: elapsed-time log lines.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Any, Callable, Hashable, Iterator, Optional

import torch

from dart_runtime.sync import synchronize
from dart_runtime.timing import interleaved_seconds, timed
from dart_runtime.timing import now as _now


def _waiter(sync: Optional[torch.device]) -> Callable[[], None]:
    return functools.partial(synchronize, sync) if sync is not None else (lambda: None)


def timed_generate(model, ids: torch.Tensor, sync: Optional[torch.device] = None,
                   **kwargs) -> tuple[torch.Tensor, float]:
    """`model.generate(ids, attention_mask=<all ones>, **kwargs)` (batch 1, no padding) timed: (output ids,
    seconds)."""
    return timed(model.generate, ids, attention_mask=torch.ones_like(ids), sync=sync, **kwargs)


class Clock:
    """Wall-time samples by key: `with clock(key): ...` times the block (kept unless `keep` is false, e.g. for a
    warm-up), `clock.run(key, fn, *args, **kwargs)` times a call and returns its result."""

    def __init__(self, sync: Optional[torch.device] = None) -> None:
        self.seconds: dict[Hashable, list[float]] = {}
        self._wait = _waiter(sync)

    @contextlib.contextmanager
    def __call__(self, key: Hashable, keep: bool = True) -> Iterator[None]:
        self._wait()
        t0 = _now()
        yield
        self._wait()
        elapsed = _now() - t0
        if keep:
            self.add(key, elapsed)

    def add(self, key: Hashable, seconds: float) -> None:
        self.seconds.setdefault(key, []).append(seconds)

    def run(self, key: Hashable, fn: Callable, *args, keep: bool = True, **kwargs) -> Any:
        with self(key, keep):
            out = fn(*args, **kwargs)
        return out

    def last(self, key: Hashable) -> float:
        return self.seconds[key][-1]

    def total(self, key: Hashable) -> float:
        return sum(self.seconds.get(key, ()))

    def median(self, key: Hashable) -> float:
        return statistics.median(self.seconds[key])

    def medians(self, scale: float = 1.0) -> dict:
        """{key: median seconds x `scale`} (scale 1e3: ms)."""
        return {key: statistics.median(values) * scale for key, values in self.seconds.items()}


def repeat_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 0,
                   sync: Optional[torch.device] = None) -> list[float]:
    """Seconds of `repeats` calls of `fn` after `warmup` untimed ones."""
    return interleaved_seconds({None: fn}, repeats, warmup, sync)[None]


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1, sync: Optional[torch.device] = None) -> float:
    """Median seconds of `repeats` calls of `fn` after `warmup` untimed ones."""
    return statistics.median(repeat_seconds(fn, repeats, warmup, sync))


def interleave(runs: dict[Hashable, Callable[[], Any]], rounds: int, warmup: int = 0,
               sync: Optional[torch.device] = None,
               after: Optional[Callable[[Hashable, Any, float, int], None]] = None) -> Clock:
    """Every run of `runs` once per round, in order (A, B, A, B, ...), for `warmup` untimed rounds then `rounds` timed
    ones, so that a slow spell of the machine hits every run alike. `after(key, result, seconds, round)` is called
    after each call, outside the clock (round < 0 during the warm-up). Returns the Clock of the timed rounds."""
    clock = Clock(sync)
    for key, seconds in interleaved_seconds(runs, rounds, warmup, sync, after=after).items():
        for value in seconds:
            clock.add(key, value)
    return clock


def median_range(values) -> dict:
    """{"median", "min", "max"} of the samples."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class TargetMeter:
    """Forward hooks on the target: how many forwards ran and how long each took (prefill = the first). On CUDA
    each forward is synchronised, so its time is the GPU's (the drafting and tree times of `DartStats` are host
    times, exact on CPU only)."""

    def __init__(self, model) -> None:
        self.times: list[float] = []
        self._start = 0.0
        self._sync = _waiter(next(model.parameters()).device)
        self._handles = [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def _before(self, module, args) -> None:
        self._sync()
        self._start = _now()

    def _after(self, module, args, output) -> None:
        self._sync()
        self.times.append(_now() - self._start)

    def reset(self) -> None:
        self.times = []

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class Progress:
    """Log lines stamped with the seconds since it was made; `elapsed` for budgets."""

    def __init__(self) -> None:
        self.t0 = _now()

    @property
    def elapsed(self) -> float:
        return _now() - self.t0

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed:6.1f}s] {message}", flush=True)
