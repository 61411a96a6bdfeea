"""Shared by the benchmark scripts: where and how results are written."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dart_core.io import atomic_write

def write_results(path: str, results: dict) -> None:
    """Write `results` as indented JSON to `path` (folders created, file replaced atomically)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, "w") as fh:
        json.dump(results, fh, indent=2)
        fh.write("\n")
