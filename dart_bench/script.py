"""What every benchmark script's command line starts from."""

from __future__ import annotations

import argparse
from typing import Optional


def script_parser(doc: str, json: bool = True, threads: Optional[int] = None) -> argparse.ArgumentParser:
    """A parser with the script's docstring as its description (kept as written), `--json PATH` (where the results
    go) unless `json` is false, and `--threads N` (torch CPU threads, default `threads`) when `threads` is given."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if json:
        parser.add_argument("--json", help="write results here")
    if threads is not None:
        parser.add_argument("--threads", type=int, default=threads, help=f"torch CPU threads (default {threads})")
    return parser
