"""Shared by the benchmark scripts: where the shared prompt data lies, and where and how results are written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dart_core.io import atomic_write

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"  # ../shared/data beside the project


def write_results(path: str, results: dict) -> None:
    """Write `results` as indented JSON to `path` (folders created, file replaced atomically)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, "w") as fh:
        json.dump(results, fh, indent=2)
        fh.write("\n")
