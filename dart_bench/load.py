"""A loaded machine for benchmarks: processes that keep CPU cores busy while a block runs."""

from __future__ import annotations

import contextlib
import multiprocessing
from typing import Iterator


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU for the duration of the block (0: none)."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()
